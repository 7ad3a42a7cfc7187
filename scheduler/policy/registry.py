"""Name -> class for every policy stage, and the built-in policies assembled from those names.

Adding a metric, filter or selector is one class and one `register` line here; the name is
the spec's, and it is what config (and, later, YAML-composed policies) refer to.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Generic, TypeVar

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.base import Filter, Metric, Pipeline, Policy, Selector
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.metrics.counts import NumRequests, NumTokens
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.policy.selectors.round_robin import RoundRobinSelector
from pilotfish.scheduler.view.types import InferType

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        name: str = cls.name  # type: ignore[attr-defined]
        if name in self._classes:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._classes[name] = cls
        return cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r} (known: {', '.join(self.names())})") from None

    def names(self) -> list[str]:
        return sorted(self._classes)


METRICS: Registry[Metric] = Registry("metric")
METRICS.register(NumRequests)
METRICS.register(NumTokens)

FILTERS: Registry[Filter] = Registry("filter")
FILTERS.register(MetricBasedFilter)

SELECTORS: Registry[Selector] = Registry("selector")
SELECTORS.register(MetricBasedSelector)
SELECTORS.register(RoundRobinSelector)

# the spec's verifyDispatchLoadMetric: lite mode has only the LRS counts to rank by
LITE_DISPATCH_LOAD_METRICS = ("num_requests", "num_tokens")


def verify_dispatch_load_metric(config: SchedulerConfig) -> Metric:
    name = config.dispatch_load_metric
    if not config.enable_full_mode_scheduling and name not in LITE_DISPATCH_LOAD_METRICS:
        raise ConfigError(
            f"--dispatch-load-metric: {name!r} is not available in lite mode "
            f"(choose {' or '.join(LITE_DISPATCH_LOAD_METRICS)})"
        )
    return METRICS.get(name)()


def load_balance(config: SchedulerConfig, rng: random.Random) -> Policy:
    """Lowest load wins: metric_based filter (optional threshold) and selector on the load metric."""
    metric = verify_dispatch_load_metric(config)
    filters: list[Filter] = []
    if config.dispatch_load_threshold is not None:
        filters.append(MetricBasedFilter(metric, config.dispatch_load_threshold))
    selector = MetricBasedSelector([metric], top_k=config.dispatch_top_k, rng=rng)
    return Policy("load-balance", {InferType.NEUTRAL: Pipeline(filters, selector)})


def round_robin(config: SchedulerConfig, rng: random.Random) -> Policy:
    """Load-blind rotation: the baseline the benchmarks compare against."""
    return Policy("round-robin", {InferType.NEUTRAL: Pipeline([], RoundRobinSelector())})


POLICIES: dict[str, Callable[[SchedulerConfig, random.Random], Policy]] = {
    "load-balance": load_balance,
    "round-robin": round_robin,
}


def build_policy(config: SchedulerConfig, rng: random.Random | None = None) -> Policy:
    builder = POLICIES.get(config.scheduling_policy)
    if builder is None:
        raise ConfigError(
            f"--scheduling-policy: unknown policy {config.scheduling_policy!r} (known: {', '.join(POLICIES)})"
        )
    return builder(config, rng or random.Random())
