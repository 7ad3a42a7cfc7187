"""metricBasedFilter: block instances whose metric is worse than a threshold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pilotfish.scheduler.policy.base import Candidate, InstanceFilter, Metric
from pilotfish.scheduler.view.types import RequestInfo


class MetricBasedFilter(InstanceFilter):
    """Passes an instance whose metric is no worse than `threshold` (<= when lower is better).

    Skipped in the fallback pass unless built with not_skip_when_fallback (notSkipWhenFallback
    in Llumnix): a threshold shapes load, it does not guard correctness.
    """

    name = "metric_based"

    def __init__(self, metric: Metric, threshold: float, *, not_skip_when_fallback: bool = False) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.metric = metric
        self.threshold = threshold

    @property
    def metrics(self) -> Sequence[Metric]:
        return (self.metric,)

    def params(self) -> dict[str, Any]:
        return {"metric": self.metric.name, "threshold": float(self.threshold)}

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        return not self.metric.better(self.threshold, cand.values[self.metric.name])

    def describe(self) -> str:
        op = ">" if self.metric.lower_is_better else "<"
        return f"{self.metric.name} {op} {self.threshold:g}"
