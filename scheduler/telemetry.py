"""Prometheus metrics of one scheduling core, on its own CollectorRegistry.

Per-instance figures are read from the live view at scrape time, so the hot path pays
nothing for them; only the decision-latency histogram is observed per decision. An engine is
labelled `engine` (its instance id): `instance` is the target label Prometheus sets itself.

| series | what |
|---|---|
| `pilotfish_scheduler_decision_seconds` | histogram: one Schedule decision in the core |
| `pilotfish_scheduler_dispatch_total{engine}` | requests dispatched |
| `pilotfish_scheduler_inflight_requests{engine}`, `..._inflight_tokens{engine}` | LRS: held requests, tokens |
| `pilotfish_scheduler_account_size` | requests held (dispatched, not released) |
| `pilotfish_scheduler_expired_total` | held requests dropped for staleness |
| `pilotfish_scheduler_ejections_total{engine,reason}` | ejections by reason (health.py: `upstream_errors`, ...) |
| `pilotfish_scheduler_instance_ejected{engine}` | 1 while the engine is ejected (no candidate), else 0 |
| `pilotfish_scheduler_engine_speed_scale{engine}` | the engine's latencies over the profile's: 1 unless found slow |
| `pilotfish_scheduler_policy_<metric>{engine}` | each policy metric, a family each (the metric's `exported`) |
| `pilotfish_scheduler_inflight_account_entries` | full: dispatched, unconfirmed by any engine |
| `pilotfish_scheduler_inflight_account_removed_total{reason}` | full: confirmed, gap, expired |
| `pilotfish_scheduler_view_staleness_seconds{engine}` | full: now - timestamp_ms, or time since applied if longer |
| `pilotfish_scheduler_cms_records_total{result}` | full: statuses applied / dropped as not newer |
| `pilotfish_scheduler_cms_records_refused_total{reason}` | full: CMS records refused, by reason |
| `pilotfish_scheduler_kv_events_applied_total{kind}` | full: engine KV events applied (stored, removed, cleared) |
| `pilotfish_scheduler_kv_events_dropped_total{reason}` | full: KV event messages dropped (malformed, topic, ...) |
| `pilotfish_scheduler_kv_events_gaps_total`, `..._missed_batches_total` | full: sequence gaps, batches they skipped |
| `pilotfish_scheduler_kv_events_unchained_blocks_total` | full: stored blocks whose parent was never seen |
| `pilotfish_scheduler_kv_events_subscriptions` | full: engines whose KV events are subscribed |
| `pilotfish_scheduler_refused_total{call,reason}` | calls refused, clamped or dropped (limits.py), or malformed |
| `pilotfish_scheduler_session_closed_total{reason}` | Session socket connections refused or closed by a limit |
| `pilotfish_scheduler_session_connections` | open Session socket connections |
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pilotfish.scheduler.health import PASSIVE, PROBE, STALLED, UNADMITTED
from pilotfish.scheduler.view.types import RequestInfo

if TYPE_CHECKING:
    from pilotfish.scheduler.core import Decision, SchedulerCore
    from pilotfish.scheduler.limits import ListenerStats
    from pilotfish.scheduler.view.kv_events import KvEventStats

def policy_metric_family(name: str) -> tuple[str, float, str]:
    """(family name, scale, help) of the policy metric `name`: what its class declares (`exported`), or
    `pilotfish_scheduler_policy_<name>`, unscaled, for one that declares nothing."""
    from pilotfish.scheduler.policy.registry import METRICS

    exported = METRICS.get(name).exported if name in METRICS.names() else None
    if exported is None:
        return f"pilotfish_scheduler_policy_{name}", 1.0, f"Policy metric {name}"
    return exported.family, exported.scale, exported.help


DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_SCRAPE_REQUEST = RequestInfo(request_id="", model="")


class _ViewCollector(Collector):
    def __init__(self, core: SchedulerCore) -> None:
        self._core = core

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the mode; collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        core = self._core
        dispatched = CounterMetricFamily(
            "pilotfish_scheduler_dispatch", "Requests dispatched, by engine.", labels=["engine"]
        )
        requests = GaugeMetricFamily(
            "pilotfish_scheduler_inflight_requests",
            "Requests dispatched and not yet released (LRS num_requests), by engine.",
            labels=["engine"],
        )
        tokens = GaugeMetricFamily(
            "pilotfish_scheduler_inflight_tokens",
            "Prompt plus generated tokens of held requests (LRS num_tokens), by engine.",
            labels=["engine"],
        )
        metrics = {m.name: m for p in core.policy.pipelines.values() for m in p.metrics}
        values = {}
        for name in metrics:
            family, scale, what = policy_metric_family(name)
            help_ = f"{what}, per engine, as the policy's {name} computes it (request-free)."
            values[name] = (GaugeMetricFamily(family, help_, labels=["engine"]), scale)
        staleness = GaugeMetricFamily(
            "pilotfish_scheduler_view_staleness_seconds",
            "Age of each engine's CMS status: now minus its timestamp_ms, or the time since the scheduler "
            "applied it if that is longer (it grows while the CMS reader is cut off).",
            labels=["engine"],
        )
        ejections = CounterMetricFamily(
            "pilotfish_scheduler_ejections",
            "Engine ejections (scheduler/health.py), by engine and reason: upstream_errors (consecutive "
            "failures the gateway reported), health_probes (failed probes in a row), stalled (full mode: "
            "work and no step for --engine-stall-seconds) or unadmitted (requests it did not admit in "
            "--engine-admission-seconds, full mode, or streams it gave no first token in "
            "--engine-first-token-seconds, lite mode).",
            labels=["engine", "reason"],
        )
        ejected = GaugeMetricFamily(
            "pilotfish_scheduler_instance_ejected",
            "1 while the engine is ejected and not picked, else 0.",
            labels=["engine"],
        )
        speed = GaugeMetricFamily(
            "pilotfish_scheduler_engine_speed_scale",
            "How many times the profile's predicted latencies each engine is ranked at: 1 unless it was found "
            "slower than the fleet's fast engines (--slow-engine-ratio, view/speed.py).",
            labels=["engine"],
        )
        health = core.health
        now = core.ctx.wall_clock()
        for inst in core.instances():
            labels = [inst.instance_id]
            counts = health.ejections(inst.instance_id)
            for reason in (PASSIVE, PROBE, STALLED, UNADMITTED):
                ejections.add_metric([inst.instance_id, reason], counts[reason])
            ejected.add_metric(labels, 1.0 if health.is_ejected(inst.instance_id) else 0.0)
            speed.add_metric(labels, inst.speed_scale)
            dispatched.add_metric(labels, inst.lrs.num_dispatched)
            requests.add_metric(labels, inst.lrs.num_requests)
            tokens.add_metric(labels, inst.lrs.num_tokens)
            for name, metric in metrics.items():
                family, scale = values[name]
                family.add_metric(labels, metric.value(inst, _SCRAPE_REQUEST) * scale)
            age = core.cms.status_age(inst.instance_id, now) if core.cms is not None else None
            if age is not None:
                staleness.add_metric(labels, age)
        size = GaugeMetricFamily("pilotfish_scheduler_account_size", "Requests held (dispatched, not released).")
        size.add_metric([], core.account_size)
        expired = CounterMetricFamily(
            "pilotfish_scheduler_expired",
            "Held requests dropped for staleness (their Release never came).",
            value=core.num_expired,
        )
        yield from (dispatched, requests, tokens, size, expired, ejections, ejected, speed)
        yield from (family for family, _ in values.values())
        if not core.full_mode:
            return
        account = core.account
        yield GaugeMetricFamily(
            "pilotfish_scheduler_inflight_account_entries",
            "In-flight account: dispatched requests no engine status has confirmed yet.",
            value=len(account),
        )
        removed = CounterMetricFamily(
            "pilotfish_scheduler_inflight_account_removed",
            "In-flight entries removed, by reason (confirmed by id, taken as confirmed after a status gap, expired).",
            labels=["reason"],
        )
        removed.add_metric(["confirmed"], account.num_confirmed)
        removed.add_metric(["gap"], account.num_gap_confirmed)
        removed.add_metric(["expired"], account.num_expired)
        yield removed
        yield staleness
        if core.cms is not None:
            records = CounterMetricFamily(
                "pilotfish_scheduler_cms_records", "CMS statuses by result.", labels=["result"]
            )
            records.add_metric(["applied"], core.cms.num_applied)
            records.add_metric(["not_newer"], core.cms.num_rejected)
            yield records
            refused = CounterMetricFamily(
                "pilotfish_scheduler_cms_records_refused",
                "CMS records refused before they could steer scheduling, by reason (docs/cms-trust.md).",
                labels=["reason"],
            )
            for reason, n in sorted(core.cms.refused_by_reason().items()):
                refused.add_metric([reason], n)
            yield refused


# the live page's ring buffer (scheduler/ui): the newest decisions, one tuple appended per decision
RECENT_DECISIONS = 256


class Telemetry:
    def __init__(self, registry: CollectorRegistry, core: SchedulerCore) -> None:
        self.registry = registry
        # (perf_counter at the start of the decision, request id, Decision); appended by the core
        self.recent: deque[tuple[float, str, Decision]] = deque(maxlen=RECENT_DECISIONS)
        self.decision_seconds = Histogram(
            "pilotfish_scheduler_decision_seconds",
            "Time to make one scheduling decision, in the core.",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        registry.register(_ViewCollector(core))


class KvEventsCollector(Collector):
    """The KV event subscriber's counts (view/kv_events.py), read at scrape time."""

    def __init__(self, stats: KvEventStats) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        applied = CounterMetricFamily(
            "pilotfish_scheduler_kv_events_applied", "Engine KV events applied to the prefix index.", labels=["kind"]
        )
        for kind in ("stored", "removed", "cleared"):
            applied.add_metric([kind], s.applied[kind])
        dropped = CounterMetricFamily(
            "pilotfish_scheduler_kv_events_dropped", "KV event messages dropped, by reason.", labels=["reason"]
        )
        for reason, n in sorted(s.dropped.items()):
            dropped.add_metric([reason], n)
        yield applied
        yield dropped
        yield CounterMetricFamily(
            "pilotfish_scheduler_kv_events_gaps", "Sequence gaps in engines' KV event streams.", value=s.gaps
        )
        yield CounterMetricFamily(
            "pilotfish_scheduler_kv_events_missed_batches", "KV event batches skipped by gaps.", value=s.missed_batches
        )
        yield CounterMetricFamily(
            "pilotfish_scheduler_kv_events_unchained_blocks",
            "Stored blocks whose parent block was never seen (their prefix cannot be hashed).",
            value=s.unchained_blocks,
        )
        yield GaugeMetricFamily(
            "pilotfish_scheduler_kv_events_subscriptions",
            "Engines whose KV events are subscribed.",
            value=s.subscriptions,
        )


class ListenerCollector(Collector):
    """Refusals at the scheduler's listeners (limits.ListenerStats), read at scrape time."""

    def __init__(self, stats: ListenerStats) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        refused = CounterMetricFamily(
            "pilotfish_scheduler_refused",
            "Schedule, Report and Release messages refused at the listeners, by call and reason: rate_limited, "
            "a bound (prompt_tokens, max_tokens, request_id_length, ...), or for reports clamped (count over "
            "what the stream can generate; applied clamped) and no_progress (dropped: it would only renew); "
            "malformed: a request message that is not a protobuf, on any gRPC call (session and health too)",
            labels=["call", "reason"],
        )
        for (call, reason), n in sorted(s.refused.items()):
            refused.add_metric([call, reason], n)
        closed = CounterMetricFamily(
            "pilotfish_scheduler_session_closed",
            "Session socket connections refused or closed by a limit, by reason: connection_cap, frame_too_large, "
            "buffer_budget, frame_timeout, idle_timeout, malformed, unauthenticated",
            labels=["reason"],
        )
        for reason, n in sorted(s.session_closed.items()):
            closed.add_metric([reason], n)
        yield refused
        yield closed
        yield GaugeMetricFamily(
            "pilotfish_scheduler_session_connections", "Open Session socket connections.", value=s.session_connections()
        )


def register_listener_stats(registry: CollectorRegistry, stats: ListenerStats) -> ListenerCollector:
    collector = ListenerCollector(stats)
    registry.register(collector)
    return collector


def register_kv_events(registry: CollectorRegistry, stats: KvEventStats) -> KvEventsCollector:
    collector = KvEventsCollector(stats)
    registry.register(collector)
    return collector
