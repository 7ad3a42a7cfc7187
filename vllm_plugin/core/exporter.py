"""How the llumlet's load changes reach the CMS: the `Exporter` contract, the choice of one, and
what every exporter shares (the event block the hooks enter, the write count, the staleness).

Three exporters; the llumlet builds one, once, from its settings and two facts its engine adapter
states (`export_kind`), and nothing switches it afterwards:

  process  (core/export_supervisor.py) a child process writes (core/export_process.py); the
           engine thread stores each change in shared memory (core/handoff.py), a steady decode
           step as a tick without the lock. For an engine that owns its process (vLLM's engine
           core: `own_process`) with `export_process` set. If the first child cannot start, it
           hands over to the in-process exporter the same settings pick (`start` returns that one).
  inline   (core/export_thread.py) a change is written from the hook itself when the socket takes
           it at once; the export thread writes the rest, refreshes and reconnects. For hooks that
           run in bursts around a long step (vLLM's: `step_hooks`) with `engine_thread_writes`.
  thread   (core/export_thread.py) every write from the export thread: hooks that fire per token
           (the simulator's) would write per token where the thread coalesces.

The child process's own writer is `export_process.Exporter`, a different thing: it runs in the
child, where this module's exporters run in the engine's process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet_stats import Outage, export_summary
from pilotfish.vllm_plugin.core.state import LoadState

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

ExportKind = Literal["process", "inline", "thread"]


def export_kind(config: LlumletConfig, *, own_process: bool, step_hooks: bool) -> ExportKind:
    """The exporter for an engine whose adapter states whether the engine owns its process
    (`own_process`: a child may write for it) and whether its hooks run once or twice a step
    around a long step (`step_hooks`: they may write themselves)."""
    if own_process and config.export_process:
        return "process"
    return in_process_kind(config, step_hooks=step_hooks)


def in_process_kind(config: LlumletConfig, *, step_hooks: bool) -> ExportKind:
    """The exporter writing from the engine's process: also where a process exporter falls back."""
    return "inline" if step_hooks and config.engine_thread_writes else "thread"


class Exporter(Protocol):
    """Takes the llumlet's changes to the CMS. The hooks reach it through `write_block` and
    `hold_block` (the llumlet's `events()`) and `decode_step`, which the llumlet binds once."""

    kind: ExportKind
    write_block: EventBlock
    hold_block: EventBlock
    exports: int
    inline_exports: int
    staleness_us: deque[float]

    @property
    def write_failures(self) -> int: ...

    def decode_step(self, duration_us: int, used_blocks: int, used_kv_tokens: int, now_ns: int) -> None:
        """A steady decode step (LoadState.decode_step) that ended at monotonic `now_ns`."""

    def start(self) -> Exporter:
        """Start writing; returns the exporter now in use (this one, or the one it handed over to)."""

    def stop(self, remove: bool, stop_services: Callable[[], None]) -> None:
        """Stop writing, and delete the keys if `remove`; `stop_services` stops what can still
        change the state (migration, then the gRPC server), called where its changes still go
        out (process) or once the export thread has stopped (in-process). No-op if not started."""

    def export_once(self) -> cms_pb2.InstanceStatus:
        """Snapshot with a new update_id and write it now, from this thread; raises on a Redis error."""

    def summary(self) -> str:
        """The line logged about the writes: how many, event -> Redis staleness, CPU per step."""


class ExporterBase:
    """What every exporter shares: the llumlet's state, lock and writer, the event blocks, and the
    account of its writes (count, staleness, failures)."""

    kind: ExportKind

    def __init__(self, llumlet: Llumlet, wake: Callable[[], None] = lambda: None) -> None:
        """`wake`: called after a block whose `settle` said so, outside the lock."""
        self.llumlet = llumlet
        self.config = llumlet.config
        self.instance_id = llumlet.instance_id
        self.state = llumlet.state
        self.lock = llumlet.lock
        self.writer = llumlet.writer
        # the CPU figures: the hooks account theirs on the llumlet, read here only when set
        self.profiling = llumlet.profiling
        # write the snapshot vLLM's /metrics shows (core/metrics_snapshot.py)
        self.metrics_snapshot = llumlet.metrics_snapshot
        # Held while a status is snapshotted and written, by whichever thread writes it, so
        # records reach Redis in update_id order. Acquired before `lock`, or tried under it.
        self._export_lock = threading.Lock()
        self._stop = threading.Event()
        # counters, for tests, benchmarks and logs
        self.exports = 0
        self.inline_exports = 0  # of them, written from the engine's thread
        self._outage = Outage(self.instance_id)
        # event -> Redis acknowledged, per write, from the oldest event it carries (µs); a
        # bounded sample, logged at shutdown so any engine reports its own staleness
        self._dirty_since_ns = 0  # monotonic ns of the oldest change not yet written; 0: none
        self.staleness_us: deque[float] = deque(maxlen=100_000)
        self.inline_write_cpu_ns = 0  # of the hooks' CPU, the writes made from them
        self.export_cpu_ns = 0
        self.write_block = EventBlock(self.lock, self.state, self.settle, wake, write=True)
        self.hold_block = EventBlock(self.lock, self.state, self.settle, wake, write=False)

    @property
    def write_failures(self) -> int:
        return self._outage.total

    def settle(self, write: bool) -> bool:
        """Under `lock`, after a block of events: store or write the change; True: call `wake`."""
        raise NotImplementedError

    def take_over(self, other: ExporterBase) -> None:
        """Under `lock`: carry on from `other`, which never wrote (its oldest unwritten change)."""
        self._dirty_since_ns = other._dirty_since_ns

    def export_once(self) -> cms_pb2.InstanceStatus:
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

    def summary(self) -> str:
        llumlet = self.llumlet
        return export_summary(
            self.exports,
            list(self.staleness_us),
            where=f"{self.inline_exports} from the engine's thread",
            steps=self.state.step_id,
            hook_cpu_ns=llumlet.hook_cpu_ns if self.profiling else 0,
            engine_cpu_ns=llumlet.engine_cpu_ns - llumlet.engine_cpu_start_ns,
            exporter_cpu_ns=self.export_cpu_ns,
            inline_exports=self.inline_exports,
            inline_write_cpu_ns=self.inline_write_cpu_ns,
        )


class EventBlock:
    """`with llumlet.events() as state:` a class, not a generator: the hooks enter two or three a
    step, and a generator's context manager costs about 1 us more each (0.9 against 0.14 us).
    It holds its exporter's bound `settle` and `wake`, so a block makes no lookup through the
    llumlet."""

    __slots__ = ("_lock", "_settle", "_state", "_wake", "_write")

    def __init__(
        self,
        lock: threading.Lock,
        state: LoadState,
        settle: Callable[[bool], bool],
        wake: Callable[[], None],
        write: bool,
    ) -> None:
        self._lock = lock
        self._state = state
        self._settle = settle
        self._wake = wake
        self._write = write

    def __enter__(self) -> LoadState:
        self._lock.acquire()
        return self._state

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            wake = exc_type is None and self._settle(self._write)  # an engine error writes nothing
        finally:
            self._lock.release()
        if wake:
            self._wake()
