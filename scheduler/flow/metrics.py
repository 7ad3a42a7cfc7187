"""Flow control's series on the core's registry, read from the controller at scrape time (the
series and their labels are listed in scheduler/flow/README.md). A flow label is the gateway's hash
of the tenant header, never the header's value, after the hash of the client's address and a colon
where the gateway groups flows by address (groups.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pilotfish.scheduler.flow.bands import BANDS
from pilotfish.scheduler.flow.controller import WAIT_BUCKETS
from pilotfish.scheduler.flow.newcomers import MAX_ESTABLISHED

if TYPE_CHECKING:
    from pilotfish.scheduler.flow.controller import FlowController

TOP_FLOWS = 20


class FlowCollector(Collector):
    def __init__(self, controller: FlowController) -> None:
        self._flow = controller

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        flow = self._flow
        stats = flow.stats
        queued = GaugeMetricFamily("pilotfish_scheduler_flow_queue_requests", "Requests waiting, by band.",
                                   labels=["band"])  # fmt: skip
        per_flow = GaugeMetricFamily(
            "pilotfish_scheduler_flow_queue_flow_requests",
            f"Requests waiting per flow (the hash of its tenant header, after its client address's hash and a colon "
            f"where the gateway groups by address), the {TOP_FLOWS} largest flows of each band.",
            labels=["band", "flow"],
        )
        for band in BANDS:
            total = 0
            counts: dict[str, int] = {}
            for queue in flow.queues().values():
                total += queue.count(band)
                for key, n in queue.flow_counts(band).items():
                    counts[key] = counts.get(key, 0) + n
            queued.add_metric([band.label], total)
            for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:TOP_FLOWS]:
                per_flow.add_metric([band.label, key], n)
        waits = HistogramMetricFamily(
            "pilotfish_scheduler_flow_wait_seconds",
            "Time from arrival to dispatch or shed of requests that waited in the queue, by band.",
            labels=["band"],
        )
        for band, buckets in sorted(stats.wait_buckets.items()):
            bounds = [*(str(b) for b in WAIT_BUCKETS), "+Inf"]
            waits.add_metric([band], list(zip(bounds, buckets, strict=True)), stats.wait_sum[band])
        flow_wait = CounterMetricFamily(
            "pilotfish_scheduler_flow_flow_wait_seconds",
            "Seconds waited in the queue per band and flow (the first 4096 pairs).",
            labels=["band", "flow"],
        )
        for (band_label, key), seconds in sorted(stats.flow_wait.items()):
            flow_wait.add_metric([band_label, key], seconds)
        dispatched = CounterMetricFamily(
            "pilotfish_scheduler_flow_dispatched",
            "Requests flow control dispatched, by band and how: at_once, queued, deadline (critical at its deadline).",
            labels=["band", "how"],
        )
        for (band_label, how), n in sorted(stats.dispatched.items()):
            dispatched.add_metric([band_label, how], n)
        shed = CounterMetricFamily(
            "pilotfish_scheduler_flow_shed",
            "Requests shed (the gateway's 429), by band and reason: queue_full, evicted, deadline, "
            "would_miss_deadline.",
            labels=["band", "reason"],
        )
        for (band_label, reason), n in sorted(stats.shed.items()):
            shed.add_metric([band_label, reason], n)
        cancelled = CounterMetricFamily(
            "pilotfish_scheduler_flow_cancelled",
            "Requests that left the queue undispatched (client gone, Session ended), by band.",
            labels=["band"],
        )
        for band_label, n in sorted(stats.cancelled.items()):
            cancelled.add_metric([band_label], n)
        saturated = GaugeMetricFamily(
            "pilotfish_scheduler_instance_saturated",
            "1 while flow control judges the engine saturated for a standard request within its share, by the "
            "first bound it reaches: tokens, requests (lite), prefill, kv, batch, step (--flow-max-step-ms), "
            "headroom (room kept to start a critical request: --flow-critical-headroom-ms), no_status (full).",
            labels=["instance", "reason"],
        )
        inflight = GaugeMetricFamily(
            "pilotfish_scheduler_flow_inflight_tokens",
            f"Tokens (prompt + max tokens) dispatched and not released per flow, the {TOP_FLOWS} largest; "
            "over_share is 1 while the flow is judged against the tighter bounds (--flow-fair-share).",
            labels=["flow", "over_share"],
        )
        over = flow.over_share_flows()  # judged once per scrape, not once per flow
        for key, n in sorted(flow.flow_tokens().items(), key=lambda kv: -kv[1])[:TOP_FLOWS]:
            inflight.add_metric([key, "1" if key in over else "0"], n)
        newcomers = CounterMetricFamily(
            "pilotfish_scheduler_flow_newcomer_requests",
            "Requests counted in the shared flow of tenant ids not yet established (--flow-established-after-ms): "
            "a client sending a new id with every request shows here.",
        )
        newcomers.add_metric([], flow.newcomers.folded)
        established = GaugeMetricFamily(
            "pilotfish_scheduler_flow_established_flows",
            f"Tenant ids counted as flows of their own (at most {MAX_ESTABLISHED}, the least recently seen "
            "forgotten first).",
        )
        established.add_metric([], len(flow.newcomers))
        groups_over = GaugeMetricFamily(
            "pilotfish_scheduler_flow_over_share_groups",
            "Client addresses (flow groups, --flow-groups source at the gateway) judged over their share: every "
            "tenant from one of them is held to the tighter bounds.",
        )
        groups_over.add_metric([], len(flow.over_share_groups))
        judge = flow.saturation.reason
        for inst in flow.core.instances():  # type: ignore[attr-defined]
            reason = judge(inst, reserve_tokens=flow.critical_reserve_on(inst))
            saturated.add_metric([inst.instance_id, reason or "none"], 1.0 if reason else 0.0)
        yield from (queued, per_flow, waits, flow_wait, dispatched, shed, cancelled, inflight, newcomers, established,
                    groups_over, saturated)


def register_flow_metrics(registry: CollectorRegistry, controller: FlowController) -> None:
    registry.register(FlowCollector(controller))
