"""Prometheus metrics of one scheduling core, on its own CollectorRegistry.

Per-instance figures are read from the live LRS at scrape time, so the hot path pays nothing
for them; only the decision-latency histogram is observed per decision.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pilotfish.scheduler.core import SchedulerCore

DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class _LrsCollector(Collector):
    def __init__(self, core: SchedulerCore) -> None:
        self._core = core

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "pilotfish_scheduler_dispatch", "Requests dispatched, by instance.", labels=["instance"]
            ),
            GaugeMetricFamily(
                "pilotfish_scheduler_inflight_requests",
                "Requests dispatched and not yet released (LRS num_requests), by instance.",
                labels=["instance"],
            ),
            GaugeMetricFamily(
                "pilotfish_scheduler_inflight_tokens",
                "Prompt plus generated tokens of held requests (LRS num_tokens), by instance.",
                labels=["instance"],
            ),
            GaugeMetricFamily(
                "pilotfish_scheduler_account_size", "Requests held in the local account (all instances)."
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()
        yield CounterMetricFamily("pilotfish_scheduler_expired", "")

    def collect(self) -> Iterator[Metric]:
        dispatched, requests, tokens, size = self._families()
        for inst in self._core.instances():
            labels = [inst.instance_id]
            dispatched.add_metric(labels, inst.lrs.num_dispatched)
            requests.add_metric(labels, inst.lrs.num_requests)
            tokens.add_metric(labels, inst.lrs.num_tokens)
        size.add_metric([], self._core.account_size)
        expired = CounterMetricFamily(
            "pilotfish_scheduler_expired",
            "Held requests dropped for staleness (their Release never came).",
            value=self._core.num_expired,
        )
        yield from (dispatched, requests, tokens, size, expired)


class Telemetry:
    def __init__(self, registry: CollectorRegistry, core: SchedulerCore) -> None:
        self.registry = registry
        self.decision_seconds = Histogram(
            "pilotfish_scheduler_decision_seconds",
            "Time to make one scheduling decision, in the core.",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        registry.register(_LrsCollector(core))
