"""The llumlet: load state fed by an engine adapter, exported to the CMS on its own thread.

Threads:
  engine thread   the adapter's hooks run here, inside the engine's step loop. They mutate the
                  LoadState under one lock (`with llumlet.events() as s: s.added(...)`). With an
                  export process (`export_process`, vLLM's default) a change is stored in shared
                  memory for it (core/handoff.py, core/export_process.py) and nothing else runs
                  here. Otherwise it is written at once from here if that cannot block: the
                  snapshot is handed to the kernel with a non-blocking write whose replies the
                  next write reads (CmsWriter.try_write_status); failing that (the export thread
                  is mid-write, the socket is full, Redis is down) the hook only sets a flag.
  export thread   (none with an export process) wakes on the flag, snapshots the state and
                  writes it, blocking until Redis answers. Events that arrive while a write is in
                  flight only re-set the flag, so the next write carries the latest state: latest
                  wins, nothing newer is lost.
                  It also re-writes status and metadata every `refresh_ms` to keep the TTL alive,
                  and owns reconnecting with backoff.
  gRPC threads    Migrate, MigrateIn, Abort, GetStatus (core/server.py); Abort is handed to the
                  engine thread through `abort_handler`, migrations through `migration_adapter`
                  (core/migration.py), never applied from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig, llumlet_security
from pilotfish.vllm_plugin.core.handoff import TICK_MAX_BLOCKS, TICK_MAX_US, TICK_SPAN
from pilotfish.vllm_plugin.core.llumlet_stats import Outage, export_summary
from pilotfish.vllm_plugin.core.migration_api import MigrationAdapter
from pilotfish.vllm_plugin.core.state import LoadState

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.destinations import DestinationCheck
    from pilotfish.vllm_plugin.core.export_process import ExportProcess
    from pilotfish.vllm_plugin.core.migration import MigrationCoordinator

log = logging.getLogger("pilotfish.llumlet")

_INFER_TYPES = {
    "neutral": cms_pb2.INFER_TYPE_NEUTRAL,
    "prefill": cms_pb2.INFER_TYPE_PREFILL,
    "decode": cms_pb2.INFER_TYPE_DECODE,
}
# The replies to the engine thread's writes are read by its next write; when none follows this
# soon, the export thread reads them, so an error reply or a dead Redis after a step's last write
# is seen (and the state written again) within this, not at the next refresh.
_COLLECT_AFTER_S = 0.05
# An engine that has not written for this long is idle: the export thread stops looking and
# sleeps until the refresh; the next write from the engine thread wakes it (one wake-up a burst).
_NAP_AFTER_S = 1.0
# An export process that died is started again, at most this often.
_RESPAWN_EVERY_S = 5.0

AbortHandler = Callable[[list[str]], list[str]]


class Llumlet:
    def __init__(
        self,
        config: LlumletConfig,
        instance_id: str,
        metadata: cms_pb2.InstanceMetadata,
        writer: CmsWriter | None = None,
        abort_handler: AbortHandler | None = None,
        migration_adapter: MigrationAdapter | None = None,
        destination_check: DestinationCheck | None = None,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.state = LoadState(instance_id, config.admitted_window_ms, config.max_admitted_ids)
        self.metadata = metadata
        self.metadata.instance_id = instance_id
        self.metadata.infer_type = _INFER_TYPES[config.infer_type]
        if config.node_id:
            self.metadata.node_id = config.node_id
        if config.unit_id:
            self.metadata.unit_id = config.unit_id
        # TLS files, the token and the Redis password (pilotfish/security.py), read once
        self.security = llumlet_security(config)
        self.writer = writer or CmsWriter(
            config.cms_url,
            config.cluster,
            instance_id,
            config.ttl_ms,
            redis_options=self.security.redis_options(config.cms_url),
        )
        self.abort_handler = abort_handler
        # who may receive a migrating request; None: the CMS decides (core/destinations.py)
        self.destination_check = destination_check
        # gRPC calls refused for want of credentials, by (method, reason) (core/server.py)
        self.rpc_refused: Counter[tuple[str, str]] = Counter()
        # Migrate and MigrateIn answer UNIMPLEMENTED without an adapter
        self.migration: MigrationCoordinator | None = None
        self._migration_adapter: MigrationAdapter | None = None
        self.migration_adapter = migration_adapter
        # Set by adapters that run in a child of the engine's frontend (vLLM's engine core): if
        # the parent dies and this process lingers, stop exporting so the keys expire.
        self.watch_parent = False
        self.lock = threading.Lock()
        self._try_write: Callable[[cms_pb2.InstanceStatus], bool] | None = None
        self._can_try_write: Callable[[], bool] = lambda: True
        self._owes_replies: Callable[[], bool] | None = None  # the writer's, when the hooks may write
        self._last_inline_s = 0.0  # when the engine thread last wrote (monotonic)
        self._napping = False  # the export thread sleeps until the refresh: the next write wakes it
        # Held while a status is snapshotted and written, by whichever thread writes it, so
        # records reach Redis in update_id order. Acquired before `lock`, or tried under it.
        self._export_lock = threading.Lock()
        # Set by adapters whose hooks run in bursts around a long step (vLLM's engine core): a
        # change is then written from the hook itself (`_write_inline`) instead of waking the
        # export thread. Not for hooks that fire per token (the simulator's): they would write
        # per token, where the export thread coalesces.
        self.write_from_engine_thread = False
        # Set by adapters whose engine owns its process (vLLM's engine core): the CMS writes move
        # to a child process fed through shared memory (config export_process). Not for engines
        # sharing a process (the simulator's fleet): one child each would poll side by side.
        self.export_from_process = False
        self._exporter: ExportProcess | None = None
        self._exporter_started_s = 0.0
        self._exporter_watch: threading.Thread | None = None
        self._parent_pid = 0  # the engine's parent at start (watch_parent): a child must not outlive it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._write_block = _EventBlock(self, write=True)
        self._hold_block = _EventBlock(self, write=False)
        self._thread: threading.Thread | None = None
        self._server: object | None = None
        # counters, for tests, benchmarks and logs
        self.exports = 0
        self.inline_exports = 0  # of them, written from the engine's thread
        self._outage = Outage(instance_id)
        self._meta_update_id = 0
        # event -> Redis acknowledged, per write, from the oldest event it carries (µs); a
        # bounded sample, logged at shutdown so any engine reports its own staleness
        self._dirty_since_ns = 0
        self.staleness_us: deque[float] = deque(maxlen=100_000)
        # With stats_log_s, adapters account the engine-thread CPU their hooks cost (thread_time:
        # CPU, not wall, so a loaded machine does not inflate it) against the thread's total.
        self.profiling = config.stats_log_s > 0
        self.hook_cpu_ns = 0
        self.inline_write_cpu_ns = 0  # of hook_cpu_ns, the writes made from the hooks
        self.engine_cpu_start_ns = 0
        self.engine_cpu_ns = 0
        self.export_cpu_ns = 0

    @property
    def write_failures(self) -> int:
        return self._outage.total

    @property
    def migration_adapter(self) -> MigrationAdapter | None:
        return self._migration_adapter

    @migration_adapter.setter
    def migration_adapter(self, adapter: MigrationAdapter | None) -> None:
        """The engine's side of migration; assignable after construction (an adapter that needs the
        llumlet first), before or after start: each Migrate and MigrateIn reads the current one."""
        self._migration_adapter = adapter
        if adapter is None:
            self.migration = None
            return
        from pilotfish.vllm_plugin.core.migration import MigrationCoordinator

        self.migration = MigrationCoordinator(self, adapter)

    # ---- engine side --------------------------------------------------------------------------

    def events(self, write: bool = True) -> _EventBlock:
        """Apply one or more engine events atomically; if they changed load, write it now or wake the exporter.

        `write=False` leaves the change for the next block to write with its own: for a hook that
        another hook follows at once (vLLM frees requests inside the step's output handling), so a
        step costs one write, not one per event. Nothing else writes it: the caller answers for
        that next block.
        """
        return self._write_block if write else self._hold_block

    def decode_step(self, duration_us: int, used_blocks: int, used_kv_tokens: int, now_ns: int) -> None:
        """A steady decode step (LoadState.decode_step; the adapter checked that it is one) that
        ended at monotonic `now_ns`, with `used_blocks` KV blocks (`used_kv_tokens` tokens) in use.

        With an export process, and nothing else waiting to be stored, it goes out as a tick
        (HandoffWriter.tick) and without the lock, which vLLM's engine thread would otherwise take
        every step (~100 cache misses a step for it, by a cache simulation of the hooks). That is
        safe: only this thread writes the tick; LoadState.decode_step makes no call, so Python
        cannot switch threads inside it and a reader under the lock sees the step whole or not
        at all; and the tick names the step by the state's own count, so a full record that
        another thread stores meanwhile, holding the step already, does not count it twice
        (handoff.steady_figures). Otherwise it is an event block's change."""
        state = self.state
        exporter = self._exporter
        if (
            exporter is not None
            and not state.changed  # nothing waits to be stored with it (nor from another thread)
            and not self.profiling  # the CPU figures ride in full records
            and duration_us < TICK_MAX_US
            and used_blocks < TICK_MAX_BLOCKS
            and state.decode_steps - exporter.handoff.record_decode_steps < TICK_SPAN - 1
        ):
            state.decode_step(duration_us, used_kv_tokens)
            if exporter.handoff.tick(state.decode_steps, duration_us, used_blocks, now_ns):
                exporter.wake()
            self.exports += 1
            return
        with self._write_block:
            state.decode_step(duration_us, used_kv_tokens)
            state.changed = True

    def _settle(self, write: bool) -> bool:
        """Under `lock`, after a block of events: store or write the change; True: wake the export thread."""
        state = self.state
        if not state.changed:
            return False  # nothing moved (a decode step's scheduling): no write to make
        if not self._dirty_since_ns:
            self._dirty_since_ns = time.monotonic_ns()
        if not write:
            return False
        state.changed = False
        if self._exporter is not None:
            self._publish(self._exporter, state)
            return False
        try_write = self._try_write if self.write_from_engine_thread else None
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

    def _publish(self, exporter: ExportProcess, state: LoadState) -> None:
        """Under `lock`: store the state for the export process; wake it if it naps."""
        hook_ns = engine_ns = 0
        if self.profiling:
            hook_ns, engine_ns = self.hook_cpu_ns, self.engine_cpu_ns - self.engine_cpu_start_ns
        if exporter.handoff.publish(state, self._dirty_since_ns, hook_ns, engine_ns):
            exporter.wake()
        self._dirty_since_ns = 0
        self.exports += 1

    def _start_exporter(self, replacing: ExportProcess | None = None) -> ExportProcess:
        """A new export process, ready, handed the current state; raises if it cannot start.

        Started outside `lock` (the engine steps on while the child gets ready). If the export
        process being replaced is no longer current (the llumlet stopped meanwhile), the new one
        is stopped again and returned unused.
        """
        from pilotfish.vllm_plugin.core.export_process import ExportProcess

        exporter = ExportProcess(self.config, self.instance_id, self.metadata, self._parent_pid)
        self._exporter_started_s = time.monotonic()
        with self.lock:
            current = self._exporter is replacing and not self._stop.is_set()
            if current:
                self._exporter = exporter
                exporter.handoff.publish(self.state, self._dirty_since_ns)
                self._dirty_since_ns = 0
                self.state.changed = False
        if not current:
            exporter.stop(remove=True)
        return exporter

    def _watch_exporter(self) -> None:
        """Export watcher thread: blocks until the export process exits; if the llumlet still
        exports (and the engine's parent lives), starts another, at most every _RESPAWN_EVERY_S.
        A thread, not a check in the hooks: an idle engine runs no hooks, and its keys would expire."""
        while (exporter := self._exporter) is not None:
            exporter.wait_exit()
            if self._exporter is not exporter:
                return  # stopped (or replaced) by the llumlet itself
            if self.watch_parent and os.getppid() != self._parent_pid:
                log.warning("llumlet %s: the engine's parent process exited; no new export process", self.instance_id)
                return
            code = "unknown: not our child" if exporter.returncode is None else exporter.returncode
            log.warning("llumlet %s: the export process exited (code %s); starting another", self.instance_id, code)
            while self._exporter is exporter:
                if self._stop.wait(max(0.0, self._exporter_started_s + _RESPAWN_EVERY_S - time.monotonic())):
                    return
                try:
                    self._start_exporter(replacing=exporter)
                except Exception as exc:  # tried again after the interval
                    log.warning("llumlet %s: could not start an export process: %s", self.instance_id, exc)
            exporter.stop(remove=False)  # reaped already: this closes its pipe and shared memory

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, serve_grpc: bool = True) -> None:
        if serve_grpc:
            from pilotfish.vllm_plugin.core.server import start_server

            self._server, port = start_server(self, self.config)
            self.metadata.llumlet_port = port
        # The export process takes the write off the engine's thread and process: the engine pays
        # a store to shared memory (core/handoff.py), no system call (bench llumlet).
        if self.watch_parent:
            self._parent_pid = os.getppid()
        if self.export_from_process and self.config.export_process:
            try:
                exporter = self._start_exporter()
            except Exception as exc:  # the engine runs on; its writes go out from here instead
                log.warning(
                    "llumlet %s: could not start the export process (%s); writing from the engine's process",
                    self.instance_id,
                    exc,
                )
            else:
                self.writer.close()  # the child holds its own connection
                self._exporter_watch = threading.Thread(
                    target=self._watch_exporter, name="pilotfish-llumlet-export-watch", daemon=True
                )
                self._exporter_watch.start()
                log.info(
                    "llumlet %s exporting to %s (cluster %s) from process %d, gRPC on %s:%s",
                    self.instance_id,
                    _redacted(self.config.cms_url),
                    self.config.cluster,
                    exporter.pid,
                    self.config.llumlet_host,
                    self.metadata.llumlet_port or "-",
                )
                return
        # In process: a write from the hook skips the export thread's wake-up and GIL hand-off: event -> view
        # p50 0.29 ms and p99 0.87 ms, against 1.34 and 2.34 ms through the woken thread (bench
        # llumlet-staleness --engine busy), for about the same CPU, but on the step's critical path
        # (bench llumlet; adapters choose, vLLM's by engine_thread_writes). A minimum interval
        # between writes needs the export thread's timing; test writers may lack the method.
        wanted = self.config.gil_switch_interval_us / 1e6
        if wanted and sys.getswitchinterval() > wanted:
            # measured (bench llumlet-staleness --engine busy): event -> view p99 17 ms at Python's
            # 5 ms, 4 ms at 1 ms; the export thread needs the GIL for every write (an export
            # process does not: the engine's interval is then left alone)
            sys.setswitchinterval(wanted)
        if self.config.min_export_interval_us == 0:
            self._try_write = getattr(self.writer, "try_write_status", None)
            self._can_try_write = getattr(self.writer, "can_try_write", self._can_try_write)
            self._owes_replies = getattr(self.writer, "owes_replies", None)
        self._thread = threading.Thread(target=self._run, name="pilotfish-llumlet-export", daemon=True)
        self._thread.start()
        log.info(
            "llumlet %s exporting to %s (cluster %s), gRPC on %s:%s",
            self.instance_id,
            _redacted(self.config.cms_url),
            self.config.cluster,
            self.config.llumlet_host,
            self.metadata.llumlet_port or "-",
        )

    def stop(self, remove: bool = True) -> None:
        """Stop exporting; `remove` deletes the keys so readers drop us now, not after the TTL."""
        if self._exporter is not None:
            self._stop.set()  # no new export process from here on
            self._stop_services()  # first: what migration's shutdown changes still goes out
            with self.lock:
                exporter, self._exporter = self._exporter, None
            # the child logs its own figures; a dead one cannot delete the keys: done from here then
            if exporter is not None and not exporter.stop(remove) and remove:
                try:
                    self.writer.remove()
                except Exception as exc:
                    log.warning("llumlet %s: could not remove CMS keys at shutdown: %s", self.instance_id, exc)
                self.writer.close()
            if self._exporter_watch is not None:
                self._exporter_watch.join(timeout=10)
                self._exporter_watch = None
            return
        if self._thread is None:
            return
        self._try_write = None
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._thread = None
        log.info("llumlet %s stopping: %s", self.instance_id, self.staleness_summary())
        self._stop_services()
        # under the export lock: an engine-thread write already under way lands before the delete,
        # not after it (where it would bring the status back until the TTL)
        with self._export_lock:
            if remove:
                try:
                    self.writer.remove()
                except Exception as exc:  # shutdown goes on: the TTL removes us anyway
                    log.warning("llumlet %s: could not remove CMS keys at shutdown: %s", self.instance_id, exc)
            self.writer.close()

    def _stop_services(self) -> None:
        if self.migration is not None:
            self.migration.shutdown()  # before the server stops, so sources hear why
        if self._server is not None:
            self._server.stop(grace=0.5)  # type: ignore[attr-defined]
            self._server = None

    # ---- export thread ------------------------------------------------------------------------

    def status_now(self) -> cms_pb2.InstanceStatus:
        """The current status, without a new update_id (GetStatus)."""
        with self.lock:
            return self.state.snapshot()

    def export_once(self) -> cms_pb2.InstanceStatus:
        """Snapshot with a new update_id and write it; raises on a Redis error."""
        with self._export_lock:
            with self.lock:
                status = self.state.snapshot(self.state.next_update_id())
                since, self._dirty_since_ns = self._dirty_since_ns, 0
            try:
                self.writer.write_status(status)
            except BaseException:
                if since:  # not written: the next write carries these events, charge it from then
                    with self.lock:
                        self._dirty_since_ns = min(self._dirty_since_ns or since, since)
                raise
        if since:
            self.staleness_us.append((time.monotonic_ns() - since) / 1000)
        self.exports += 1
        return status

    def staleness_summary(self) -> str:
        return export_summary(
            self.exports,
            list(self.staleness_us),
            where=f"{self.inline_exports} from the engine's thread",
            steps=self.state.step_id,
            hook_cpu_ns=self.hook_cpu_ns if self.profiling else 0,
            engine_cpu_ns=self.engine_cpu_ns - self.engine_cpu_start_ns,
            exporter_cpu_ns=self.export_cpu_ns,
            inline_exports=self.inline_exports,
            inline_write_cpu_ns=self.inline_write_cpu_ns,
        )

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
        if owes is None or self._try_write is None or not self.write_from_engine_thread:
            return float("inf")
        self._napping = True  # before looking: a write from here on wakes us, one before is owed
        if owes():
            self._napping = False
            return self._last_inline_s + _COLLECT_AFTER_S
        if now - self._last_inline_s < _NAP_AFTER_S:
            self._napping = False
            return now + _COLLECT_AFTER_S
        return float("inf")

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
            if self.watch_parent and os.getppid() != parent:
                log.warning("llumlet %s: the engine's parent process exited; removing CMS keys", self.instance_id)
                self._try_write = None
                with self._export_lock:
                    with contextlib.suppress(Exception):
                        self.writer.remove()
                    self.writer.close()
                return
            now = time.monotonic()
            collect_only = False
            if now < next_refresh:
                woke = self._wake.wait(min(next_refresh, self._next_look(now)) - now)
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
                        log.info("llumlet %s: %s", self.instance_id, self.staleness_summary())
                        next_stats = time.monotonic() + stats_every
                self.export_once()
                last_write = time.monotonic()
                self._outage.succeeded()
            except Exception as exc:
                next_refresh = 0.0  # re-send metadata too: the keys may have expired meanwhile
                self._stop.wait(self._outage.failed(exc))


class _EventBlock:
    """`with llumlet.events() as state:` a class, not a generator: the hooks enter two or three a
    step, and a generator's context manager costs about 1 us more each (0.9 against 0.14 us)."""

    __slots__ = ("_llumlet", "_write")

    def __init__(self, llumlet: Llumlet, write: bool) -> None:
        self._llumlet = llumlet
        self._write = write

    def __enter__(self) -> LoadState:
        self._llumlet.lock.acquire()
        return self._llumlet.state

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        llumlet = self._llumlet
        try:
            wake = exc_type is None and llumlet._settle(self._write)  # an engine error writes nothing
        finally:
            llumlet.lock.release()
        if wake:
            llumlet._wake.set()


def _redacted(url: str) -> str:
    """The URL without a password, for logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
