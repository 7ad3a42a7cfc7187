"""The `pilotfish_llumlet_*` families, set from the llumlets' snapshots (core/metrics_snapshot.py).

Engine-agnostic: vLLM's stat-logger plugin (adapters/vllm_metrics.py) builds one `SnapshotMetrics`
in its API-server process, over the snapshot of each engine it serves, and calls `refresh` from
vLLM's `record()` (at most every `metrics_interval_ms`) and `log()`. vLLM calls neither while
the engine is idle under --disable-log-stats, so a scrape of the registry refreshes too (at most
every interval): a collector of no family of its own, registered before the families, so
prometheus_client collects it first. Plain prometheus_client gauges and counters, so they land
wherever vLLM's own do (its registry, or its multiprocess directory with several API servers,
where only record() and log() refresh them).

Labels: `model_name` (vLLM's served name, as on vLLM's own families) and `engine` (the llumlet's
instance id, as on every other pilotfish_* family; vLLM's `engine` label is its engine index).
Counters mirror the llumlet's cumulative figures: each refresh adds what they grew by, and a
figure that went down (a new export process) counts as a restart, so the family never decreases.

A snapshot that is missing, corrupt, too big, of another version or older than the one held
counts in `pilotfish_llumlet_snapshot_read_errors_total{reason}` and sets
`pilotfish_llumlet_snapshot_up` to 0; the other gauges then keep the last good figures, and
`pilotfish_llumlet_snapshot_age_seconds` keeps growing from it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric

from pilotfish.vllm_plugin.core.metrics_snapshot import READ_ERRORS, LlumletSnapshot, SnapshotError, read_snapshot

log = logging.getLogger("pilotfish.llumlet")

LABELS = ("model_name", "engine")
# a snapshot older than this many intervals is stale: its writer stopped or cannot write
STALE_AFTER_INTERVALS = 3
# pilotfish_llumlet_requests{state}: the snapshot's load field for each state
REQUEST_STATES = {
    "waiting": "num_waiting",
    "running_prefill": "num_running_prefill",
    "running_decode": "num_running_decode",
    "loading": "num_loading",
    "migrating_out": "num_migrating_out",
    "migrating_in": "num_migrating_in",
}


class Families:
    """The families, created once per registry (prometheus_client refuses a name twice)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            # mostrecent: with several API servers (multiprocess mode) each reads the same snapshot
            return Gauge(name, doc, [*LABELS, *extra], registry=registry, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=registry)

        p = "pilotfish_llumlet_"
        self.requests = gauge(p + "requests", "requests in the llumlet's last exported status, by state", "state")
        self.kv_used = gauge(p + "kv_used_tokens", "KV cache tokens in use (exported status)")
        self.kv_capacity = gauge(p + "kv_capacity_tokens", "KV cache tokens in all (exported status)")
        self.uncomputed_prefill = gauge(
            p + "uncomputed_prefill_tokens", "prompt tokens admitted and not yet computed (exported status)"
        )
        self.unallocated = gauge(
            p + "unallocated_tokens", "tokens of waiting requests and uncomputed prefills, no KV yet (exported status)"
        )
        self.last_step = gauge(p + "last_step_duration_seconds", "the engine's last step, schedule to output")
        self.staleness = gauge(
            p + "export_staleness_seconds",
            "engine event -> status in Redis, over the llumlet's latest 1,024 writes, by percentile (50, 99)",
            "percentile",
        )
        self.exporter = gauge(
            p + "exporter_info", "1 for the exporter writing the CMS: process, inline or thread", "exporter"
        )
        self.up = gauge(p + "snapshot_up", "1 if the llumlet's snapshot was read and is fresh, else 0")
        self.age = gauge(p + "snapshot_age_seconds", "age of the last good snapshot when last read")
        self.timestamp = gauge(
            p + "snapshot_timestamp_seconds", "wall time the last good snapshot was written (unix seconds)"
        )
        self.steps = counter(p + "steps", "engine steps the llumlet saw")
        self.preemptions = counter(p + "preemptions", "requests the engine preempted")
        self.status_writes = counter(p + "cms_status_writes", "status records written to the CMS")
        self.write_failures = counter(p + "cms_write_failures", "CMS writes that failed (retried with backoff)")
        self.read_errors = counter(
            p + "snapshot_read_errors", "snapshot reads that failed, by reason: " + ", ".join(READ_ERRORS), "reason"
        )


# by the registry itself, weakly: an id() would be reused by a later registry
_families: weakref.WeakKeyDictionary[CollectorRegistry, Families] = weakref.WeakKeyDictionary()


def families_for(registry: CollectorRegistry = REGISTRY) -> Families:
    """The families in `registry`, created on first use."""
    found = _families.get(registry)
    if found is None:
        found = _families[registry] = Families(registry)
    return found


@dataclass
class _Engine:
    path: Path
    update_id: int = 0  # of the last good snapshot
    timestamp_s: float = 0.0  # its wall time; 0: none read yet
    exporter: str = ""
    totals: dict[str, int] = field(default_factory=dict)  # the cumulative figures as last mirrored


class SnapshotMetrics:
    """Reads each engine's snapshot and sets the families; never raises on a bad snapshot."""

    def __init__(
        self,
        model_name: str,
        snapshots: Mapping[str, Path],
        interval_s: float,
        registry: CollectorRegistry = REGISTRY,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        refresh_on_scrape: bool = True,
    ) -> None:
        """`snapshots`: engine label (the instance id) -> its snapshot's path."""
        self.model_name = model_name
        self.engines = {engine: _Engine(path) for engine, path in snapshots.items()}
        self.interval_s = interval_s
        self.stale_after_s = STALE_AFTER_INTERVALS * interval_s
        self._wall = wall_clock
        self._clock = clock
        self._next_s = 0.0
        if refresh_on_scrape:
            registry.register(_RefreshOnScrape(self))  # before the families: collected first
        self.families = families_for(registry)

    def maybe_refresh(self) -> None:
        """From vLLM's record(), called every output batch: a refresh at most every interval."""
        now = self._clock()
        if now >= self._next_s:
            self._next_s = now + self.interval_s
            self.refresh()

    def refresh(self) -> None:
        for engine, state in self.engines.items():
            labels = (self.model_name, engine)
            try:
                snapshot = read_snapshot(state.path)
                if snapshot.update_id < state.update_id:
                    raise SnapshotError("older", f"update_id {snapshot.update_id} < {state.update_id}")
            except SnapshotError as exc:
                self.families.read_errors.labels(*labels, exc.reason).inc()
                self._set_age(labels, state, fresh=False)
                continue
            self._apply(labels, state, snapshot)
            self._set_age(labels, state, fresh=True)

    def _set_age(self, labels: tuple[str, str], state: _Engine, fresh: bool) -> None:
        f = self.families
        if not state.timestamp_s:
            f.up.labels(*labels).set(0)
            return
        age = max(0.0, self._wall() - state.timestamp_s)
        f.age.labels(*labels).set(age)
        f.up.labels(*labels).set(1 if fresh and age <= self.stale_after_s else 0)

    def _apply(self, labels: tuple[str, str], state: _Engine, snapshot: LlumletSnapshot) -> None:
        f = self.families
        load = snapshot.load
        state.update_id = snapshot.update_id
        state.timestamp_s = snapshot.timestamp_ms / 1000
        f.timestamp.labels(*labels).set(state.timestamp_s)
        for name, attr in REQUEST_STATES.items():
            f.requests.labels(*labels, name).set(getattr(load, attr))
        f.kv_used.labels(*labels).set(load.used_kv_tokens)
        f.kv_capacity.labels(*labels).set(load.total_kv_tokens)
        f.uncomputed_prefill.labels(*labels).set(load.uncomputed_prefill_tokens)
        f.unallocated.labels(*labels).set(load.unallocated_tokens)
        f.last_step.labels(*labels).set(load.last_step_duration_us / 1e6)
        f.staleness.labels(*labels, "50").set(snapshot.staleness_p50_us / 1e6)
        f.staleness.labels(*labels, "99").set(snapshot.staleness_p99_us / 1e6)
        if snapshot.exporter != state.exporter:
            if state.exporter:
                f.exporter.labels(*labels, state.exporter).set(0)
            f.exporter.labels(*labels, snapshot.exporter).set(1)
            state.exporter = snapshot.exporter
        for counter, name, value in (
            (f.steps, "steps", load.step_id),
            (f.preemptions, "preemptions", load.num_preempted_total),
            (f.status_writes, "status_writes", snapshot.status_writes),
            (f.write_failures, "write_failures", snapshot.write_failures),
        ):
            last = state.totals.get(name, 0)
            grown = value - last if value >= last else value  # went down: its writer restarted
            child = counter.labels(*labels)  # shown from the first snapshot on, at 0 too
            if grown > 0:
                child.inc(grown)
            state.totals[name] = value


class _RefreshOnScrape:
    """A collector that yields nothing: collecting it refreshes the families (at most every interval)."""

    def __init__(self, metrics: SnapshotMetrics) -> None:
        self.metrics = metrics
        self.failed = False

    def describe(self) -> list[Metric]:
        """No names; and the registry (vLLM's has auto_describe) need not collect it to learn that."""
        return []

    def collect(self) -> list[Metric]:
        if not self.failed:
            try:
                self.metrics.maybe_refresh()
            except Exception:  # a scrape of vLLM's /metrics must not fail for us
                log.exception("pilotfish llumlet: refreshing pilotfish_llumlet_* on a scrape failed; no longer tried")
                self.failed = True
        return []
