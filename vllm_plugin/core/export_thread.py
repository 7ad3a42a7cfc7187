"""Writes from the engine's process: the export thread, and the hooks' own writes beside it.

ThreadExporter  the thread `pilotfish-llumlet-export` wakes on the flag a block of events sets,
                snapshots the state and writes it, blocking until Redis answers. Events that
                arrive while a write is in flight only re-set the flag, so the next write
                carries the latest state: latest wins, nothing newer is lost. It also re-writes
                status and metadata every `refresh_ms` to keep the TTL alive, and owns
                reconnecting with backoff.
InlineExporter  the same thread, and a change written from the hook itself if that cannot
                block: the snapshot is handed to the kernel with a non-blocking write whose
                replies the next write reads (CmsWriter.try_write_status); failing that (the
                export thread is mid-write, the socket is full, Redis is down) the hook only
                sets the flag. The thread reads replies no write follows to read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.core.exporter import Exporter, ExporterBase
from pilotfish.vllm_plugin.core.metrics_snapshot import SnapshotWriter
from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, LoadState, counter_values

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

log = logging.getLogger("pilotfish.llumlet")

# The replies to the engine thread's writes are read by its next write; when none follows this
# soon, the export thread reads them, so an error reply or a dead Redis after a step's last write
# is seen (and the state written again) within this, not at the next refresh.
_COLLECT_AFTER_S = 0.05
# An engine that has not written for this long is idle: the export thread stops looking and
# sleeps until the refresh; the next write from the engine thread wakes it (one wake-up a burst).
_NAP_AFTER_S = 1.0


class ThreadExporter(ExporterBase):
    kind = "thread"

    def __init__(self, llumlet: Llumlet) -> None:
        self._wake = threading.Event()  # the flag: a change waits for the export thread
        super().__init__(llumlet, wake=self._wake.set)
        self.metadata = llumlet.metadata
        # adapters that run in a child of the engine's frontend (vLLM's engine core): if the
        # parent dies and this process lingers, stop exporting so the keys expire
        self._watch_parent = llumlet.watch_parent
        self._try_write: Callable[[cms_pb2.InstanceStatus], bool] | None = None  # InlineExporter's, once started
        self._owes_replies: Callable[[], bool] | None = None  # the writer's, when the hooks may write
        self._last_inline_s = 0.0  # when the engine thread last wrote (monotonic)
        self._napping = False  # the export thread sleeps until the refresh: the next write wakes it
        self._thread: threading.Thread | None = None
        self._meta_update_id = 0
        # for vLLM's /metrics (core/metrics_snapshot.py), written by the export thread
        self.snapshot = SnapshotWriter(self.config, self.instance_id, self.kind) if llumlet.metrics_snapshot else None

    # ---- engine side --------------------------------------------------------------------------

    def settle(self, write: bool) -> bool:
        state = self.state
        if not state.changed:
            return False  # nothing moved (a decode step's scheduling): no write to make
        if not self._dirty_since_ns:
            self._dirty_since_ns = time.monotonic_ns()
        if not write:
            return False
        state.changed = False
        return True

    def decode_step(self, duration_us: int, used_blocks: int, used_kv_tokens: int, now_ns: int) -> None:
        state = self.state
        with self.write_block:
            state.decode_step(duration_us, used_kv_tokens)
            state.changed = True

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Exporter:
        wanted = self.config.gil_switch_interval_us / 1e6
        if wanted and sys.getswitchinterval() > wanted:
            # measured (bench llumlet-staleness --engine busy): event -> view p99 17 ms at Python's
            # 5 ms, 4 ms at 1 ms; the export thread needs the GIL for every write (an export
            # process does not: the engine's interval is then left alone)
            sys.setswitchinterval(wanted)
        self._bind_writer()
        self._thread = threading.Thread(target=self._run, name="pilotfish-llumlet-export", daemon=True)
        self._thread.start()
        log.info(
            "llumlet %s exporting to %s (cluster %s), gRPC on %s:%s",
            self.instance_id,
            redacted(self.config.cms_url),
            self.config.cluster,
            self.config.llumlet_host,
            self.metadata.llumlet_port or "-",
        )
        return self

    def _bind_writer(self) -> None:
        """At start: the writer's methods for writes from the hooks (InlineExporter's)."""

    def stop(self, remove: bool, stop_services: Callable[[], None]) -> None:
        if self._thread is None:
            return
        self._try_write = None
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._thread = None
        if self.snapshot is not None:
            self.snapshot.remove()
        log.info("llumlet %s stopping: %s", self.instance_id, self.summary())
        stop_services()
        # under the export lock: an engine-thread write already under way lands before the delete,
        # not after it (where it would bring the status back until the TTL)
        with self._export_lock:
            if remove:
                try:
                    self.writer.remove()
                except Exception as exc:  # shutdown goes on: the TTL removes us anyway
                    log.warning("llumlet %s: could not remove CMS keys at shutdown: %s", self.instance_id, exc)
            self.writer.close()

    # ---- export thread ------------------------------------------------------------------------

    def write_metadata(self) -> None:
        self._meta_update_id = max(self._meta_update_id + 1, time.time_ns() // 1000)
        self.metadata.update_id = self._meta_update_id
        self.metadata.timestamp_ms = time.time_ns() // 1_000_000
        self.writer.write_metadata(self.metadata)

    def _next_look(self, now: float) -> float:
        """When the export thread next looks for replies owed to the engine thread's writes: a
        while after the last one; with none owed, a while from now while the engine is busy (one
        can come meanwhile); never while it is idle, where the next write wakes the thread (this
        sets `_napping` for that, before looking, so no write falls between the two)."""
        owes = self._owes_replies
        if owes is None or self._try_write is None:
            return float("inf")
        self._napping = True  # before looking: a write from here on wakes us, one before is owed
        if owes():
            self._napping = False
            return self._last_inline_s + _COLLECT_AFTER_S
        if now - self._last_inline_s < _NAP_AFTER_S:
            self._napping = False
            return now + _COLLECT_AFTER_S
        return float("inf")

    def _write_snapshot(self) -> None:
        """Export thread: the figures for vLLM's /metrics, under the lock only to copy them."""
        assert self.snapshot is not None
        with self.lock:
            counters = dict(zip(COUNTER_FIELDS, counter_values(self.state), strict=True))
        self.snapshot.write(counters, self.exports, self.write_failures, self.staleness_us)

    def _replies_due(self, now: float) -> bool:
        owes = self._owes_replies
        return owes is not None and owes() and now >= self._last_inline_s + _COLLECT_AFTER_S

    def _run(self) -> None:
        refresh_s = self.config.refresh_ms / 1000
        min_gap_s = self.config.min_export_interval_us / 1e6
        next_refresh = 0.0  # metadata first, so a reader never sees status without metadata
        last_write = 0.0
        stats_every = self.config.stats_log_s
        next_stats = time.monotonic() + stats_every
        parent = os.getppid()
        collect = getattr(self.writer, "collect_replies", None)
        while not self._stop.is_set():
            if self._watch_parent and os.getppid() != parent:
                log.warning("llumlet %s: the engine's parent process exited; removing CMS keys", self.instance_id)
                self._try_write = None
                if self.snapshot is not None:
                    self.snapshot.remove()
                with self._export_lock:
                    with contextlib.suppress(Exception):
                        self.writer.remove()
                    self.writer.close()
                return
            now = time.monotonic()
            snapshot_s = float("inf")
            if self.snapshot is not None:
                if self.snapshot.due(now):
                    self._write_snapshot()
                snapshot_s = self.snapshot.next_s
            collect_only = False
            if now < next_refresh:
                woke = self._wake.wait(min(next_refresh, self._next_look(now), snapshot_s) - now)
                self._napping = False
                if self._stop.is_set():
                    break
                if not woke and (now := time.monotonic()) < next_refresh:
                    if not self._replies_due(now):
                        continue  # none owed, or a write made since will read them
                    collect_only = True  # nothing new to write: only replies to read
            if not collect_only:
                if min_gap_s and (gap := last_write + min_gap_s - time.monotonic()) > 0:
                    time.sleep(gap)
                # Cleared before the snapshot: an event landing after it sets the flag again.
                self._wake.clear()
            try:
                if collect is not None:
                    with self._export_lock:
                        collect()  # the engine thread's writes: their replies, or the failure it met
                if collect_only:
                    continue
                if time.monotonic() >= next_refresh:
                    self.write_metadata()
                    next_refresh = time.monotonic() + refresh_s
                    if stats_every and time.monotonic() >= next_stats:
                        self.export_cpu_ns = time.thread_time_ns()
                        log.info("llumlet %s: %s", self.instance_id, self.summary())
                        next_stats = time.monotonic() + stats_every
                self.export_once()
                last_write = time.monotonic()
                self._outage.succeeded()
            except Exception as exc:
                next_refresh = 0.0  # re-send metadata too: the keys may have expired meanwhile
                self._stop.wait(self._outage.failed(exc))


class InlineExporter(ThreadExporter):
    kind = "inline"

    def __init__(self, llumlet: Llumlet) -> None:
        super().__init__(llumlet)
        self._can_try_write: Callable[[], bool] = lambda: True

    def _bind_writer(self) -> None:
        # A minimum interval between writes needs the export thread's timing; test writers may
        # lack the methods. Measured (bench llumlet-staleness --engine busy): a write from the
        # hook skips the export thread's wake-up and GIL hand-off, event -> view p50 0.29 ms and
        # p99 0.87 ms against 1.34 and 2.34 ms through the woken thread, for about the same CPU,
        # but on the step's critical path (bench llumlet).
        if self.config.min_export_interval_us == 0:
            self._try_write = getattr(self.writer, "try_write_status", None)
            self._can_try_write = getattr(self.writer, "can_try_write", self._can_try_write)
            self._owes_replies = getattr(self.writer, "owes_replies", None)

    def settle(self, write: bool) -> bool:
        state = self.state
        if not state.changed:
            return False  # nothing moved (a decode step's scheduling): no write to make
        if not self._dirty_since_ns:
            self._dirty_since_ns = time.monotonic_ns()
        if not write:
            return False
        state.changed = False
        try_write = self._try_write
        if try_write is not None and self._thread is not None and self._export_lock.acquire(False):
            try:
                if self._write_inline(state, try_write):
                    return False
            finally:
                self._export_lock.release()
        return True

    def _write_inline(self, state: LoadState, try_write: Callable[[cms_pb2.InstanceStatus], bool]) -> bool:
        """Under `lock` and the export lock: the write the export thread would make, made now."""
        if not self._can_try_write():  # no snapshot made for nothing (Redis away, TLS)
            return False
        cpu0 = time.thread_time_ns() if self.profiling else 0
        status = state.snapshot(state.next_update_id())
        if not try_write(status):
            return False
        if cpu0:
            self.inline_write_cpu_ns += time.thread_time_ns() - cpu0
        now_ns = time.monotonic_ns()
        self._last_inline_s = now_ns / 1e9
        if self._napping:
            self._napping = False
            self._wake.set()  # its replies need a reader before the refresh
        # to the kernel, not to Redis's reply (which the next write reads): on loopback Redis
        # applies it microseconds later
        self.staleness_us.append((now_ns - self._dirty_since_ns) / 1000)
        self._dirty_since_ns = 0
        self.exports += 1
        self.inline_exports += 1
        return True


def redacted(url: str) -> str:
    """The URL without a password, for logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
