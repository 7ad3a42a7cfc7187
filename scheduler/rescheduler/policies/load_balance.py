"""decode_load and neutral_load: move load from instances at or above a threshold to those below.

Sources have load >= threshold, destinations load < threshold (both healthy, of the policy's
infer type, outside every failure domain); metricBalanceSelector pairs the highest-load source with the lowest-load
destination, then the next of each, while they differ by at least
--rescheduling-load-balance-threshold. Scope `unit` balances within each unit_id only (an
instance without one is a unit of its own, so it is never paired).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
from pilotfish.scheduler.rescheduler.selectors import Loaded, metric_balance
from pilotfish.scheduler.rescheduler.types import PROBE, MigrationPair
from pilotfish.scheduler.view.types import InferType, InstanceView


class LoadBalancePolicy(ReschedulingPolicy):
    # which --rescheduling-<kind>-load-metric / -threshold this policy reads
    kind: ClassVar[str]

    def __init__(self, config: SchedulerConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        from pilotfish.scheduler.policy.registry import METRICS

        self.metric = METRICS.get(getattr(config, f"rescheduling_{self.kind}_load_metric"))(ctx)
        self.threshold: float = getattr(config, f"rescheduling_{self.kind}_load_threshold")
        self.min_difference = config.rescheduling_load_balance_threshold
        self.per_unit = config.rescheduling_load_balance_scope == "unit"

    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        scopes: dict[str, list[Loaded]] = defaultdict(list)
        for inst in self.balanced(instances):
            scope = (inst.unit_id or "instance:" + inst.instance_id) if self.per_unit else ""
            scopes[scope].append((inst, self.metric.value(inst, PROBE)))
        out = []
        for scope in sorted(scopes):
            loads = scopes[scope]
            sources = [(i, v) for i, v in loads if v >= self.threshold]
            destinations = [(i, v) for i, v in loads if v < self.threshold]
            out += [self.pair(s, d) for s, d in metric_balance(sources, destinations, self.min_difference)]
        return out


class DecodeLoad(LoadBalancePolicy):
    """Balance decode instances by --rescheduling-decode-load-metric."""

    name = "decode_load"
    infer_type = InferType.DECODE
    kind = "decode"


class NeutralLoad(LoadBalancePolicy):
    """Balance neutral instances by --rescheduling-neutral-load-metric."""

    name = "neutral_load"
    infer_type = InferType.NEUTRAL
    kind = "neutral"
