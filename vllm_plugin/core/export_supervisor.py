"""The process exporter: the engine's side of the export process, and its supervision.

The export process (core/export_process.py) takes the CMS writes off the engine's thread and
process: the engine pays a store to shared memory (core/handoff.py), no system call (bench
llumlet). This module starts it, hands it the current state, stores each change for it, and
watches it: a thread blocked on its exit starts another if it dies alone (at most every
`_RESPAWN_EVERY_S`), unless the engine's parent is gone. If the first cannot start, the writes
go out from the engine's process instead (`start` returns the in-process exporter).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pilotfish.vllm_plugin.core.export_thread import InlineExporter, ThreadExporter, redacted
from pilotfish.vllm_plugin.core.exporter import Exporter, ExporterBase, ExportKind
from pilotfish.vllm_plugin.core.handoff import TICK_MAX_BLOCKS, TICK_MAX_US, TICK_SPAN
from pilotfish.vllm_plugin.core.metrics_snapshot import snapshot_path
from pilotfish.vllm_plugin.core.state import LoadState

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.export_process import ExportProcess
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

log = logging.getLogger("pilotfish.llumlet")

# An export process that died is started again, at most this often.
_RESPAWN_EVERY_S = 5.0


class ProcessExporter(ExporterBase):
    kind = "process"

    def __init__(self, llumlet: Llumlet, fallback: ExportKind) -> None:
        """`fallback`: the in-process exporter to hand over to if the first process cannot start."""
        super().__init__(llumlet)
        self.metadata = llumlet.metadata
        self._fallback = fallback
        self._watch_parent = llumlet.watch_parent
        # The export process the changes go to; None before start and after stop. While a dead
        # one is being replaced it stays here: changes stored meanwhile reach the new one with
        # the state it is handed.
        self.process: ExportProcess | None = None
        self._started_s = 0.0
        self._watcher: threading.Thread | None = None
        self._parent_pid = 0  # the engine's parent at start (watch_parent): a child must not outlive it

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
        process = self.process
        if process is not None:
            self._publish(process, state)
        return False  # the process is woken by the store itself; before start, nothing to wake

    def _publish(self, process: ExportProcess, state: LoadState) -> None:
        """Under `lock`: store the state for the export process; wake it if it naps."""
        hook_ns = engine_ns = 0
        if self.profiling:
            llumlet = self.llumlet
            hook_ns, engine_ns = llumlet.hook_cpu_ns, llumlet.engine_cpu_ns - llumlet.engine_cpu_start_ns
        if process.handoff.publish(state, self._dirty_since_ns, hook_ns, engine_ns):
            process.wake()
        self._dirty_since_ns = 0
        self.exports += 1

    def decode_step(self, duration_us: int, used_blocks: int, used_kv_tokens: int, now_ns: int) -> None:
        """A steady decode step (LoadState.decode_step; the adapter checked that it is one) that
        ended at monotonic `now_ns`, with `used_blocks` KV blocks (`used_kv_tokens` tokens) in use.

        With nothing else waiting to be stored, it goes out as a tick (HandoffWriter.tick) and
        without the lock, which vLLM's engine thread would otherwise take every step (~100 cache
        misses a step for it, by a cache simulation of the hooks). That is safe: only this thread
        writes the tick; LoadState.decode_step makes no call, so Python cannot switch threads
        inside it and a reader under the lock sees the step whole or not at all; and the tick
        names the step by the state's own count, so a full record that another thread stores
        meanwhile, holding the step already, does not count it twice (handoff.steady_figures).
        Otherwise it is an event block's change."""
        state = self.state
        process = self.process
        if (
            process is not None
            and not state.changed  # nothing waits to be stored with it (nor from another thread)
            and not self.profiling  # the CPU figures ride in full records
            and duration_us < TICK_MAX_US
            and used_blocks < TICK_MAX_BLOCKS
            and state.decode_steps - process.handoff.record_decode_steps < TICK_SPAN - 1
        ):
            state.decode_step(duration_us, used_kv_tokens)
            if process.handoff.tick(state.decode_steps, duration_us, used_blocks, now_ns):
                process.wake()
            self.exports += 1
            return
        with self.write_block:
            state.decode_step(duration_us, used_kv_tokens)
            state.changed = True

    # ---- supervision --------------------------------------------------------------------------

    def start(self) -> Exporter:
        if self._watch_parent:
            self._parent_pid = os.getppid()
        try:
            process = self._start_process()
        except Exception as exc:  # the engine runs on; its writes go out from here instead
            log.warning(
                "llumlet %s: could not start the export process (%s); writing from the engine's process",
                self.instance_id,
                exc,
            )
            in_process = InlineExporter(self.llumlet) if self._fallback == "inline" else ThreadExporter(self.llumlet)
            with self.lock:
                in_process.take_over(self)
            return in_process.start()
        self.writer.close()  # the child holds its own connection
        self._watcher = threading.Thread(target=self._watch, name="pilotfish-llumlet-export-watch", daemon=True)
        self._watcher.start()
        log.info(
            "llumlet %s exporting to %s (cluster %s) from process %d, gRPC on %s:%s",
            self.instance_id,
            redacted(self.config.cms_url),
            self.config.cluster,
            process.pid,
            self.config.llumlet_host,
            self.metadata.llumlet_port or "-",
        )
        return self

    def stop(self, remove: bool, stop_services: Callable[[], None]) -> None:
        if self.process is None:
            return
        self._stop.set()  # no new export process from here on
        stop_services()  # first: what migration's shutdown changes still goes out
        with self.lock:
            process, self.process = self.process, None
        # the child logs its own figures; a dead one cannot delete the keys: done from here then
        alive = process is not None and process.stop(remove)
        if not alive and self.metrics_snapshot:
            snapshot_path(self.config, self.instance_id).unlink(missing_ok=True)
        if not alive and remove:
            try:
                self.writer.remove()
            except Exception as exc:
                log.warning("llumlet %s: could not remove CMS keys at shutdown: %s", self.instance_id, exc)
            self.writer.close()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
            self._watcher = None

    def adopt(self, process: ExportProcess, replacing: ExportProcess | None = None) -> bool:
        """Make `process` the one changes go to, handed the current state, if `replacing` is still
        the current one and the exporter still runs; whether it did. Supervision adopts each
        process it starts; the hooks' tests and the cache simulation adopt a bare hand-off."""
        with self.lock:
            current = self.process is replacing and not self._stop.is_set()
            if current:
                self.process = process
                process.handoff.publish(self.state, self._dirty_since_ns)
                self._dirty_since_ns = 0
                self.state.changed = False
        return current

    def _start_process(self, replacing: ExportProcess | None = None) -> ExportProcess:
        """A new export process, ready, handed the current state; raises if it cannot start.

        Started outside `lock` (the engine steps on while the child gets ready). If the export
        process being replaced is no longer current (the llumlet stopped meanwhile), the new one
        is stopped again and returned unused.
        """
        from pilotfish.vllm_plugin.core.export_process import ExportProcess

        process = ExportProcess(
            self.config, self.instance_id, self.metadata, self._parent_pid, metrics_snapshot=self.metrics_snapshot
        )
        self._started_s = time.monotonic()
        if not self.adopt(process, replacing):
            process.stop(remove=True)
        return process

    def _watch(self) -> None:
        """Watcher thread: blocks until the export process exits; if the llumlet still exports
        (and the engine's parent lives), starts another, at most every _RESPAWN_EVERY_S. A thread,
        not a check in the hooks: an idle engine runs no hooks, and its keys would expire."""
        while (process := self.process) is not None:
            process.wait_exit()
            if self.process is not process:
                return  # stopped (or replaced) by the llumlet itself
            if self._watch_parent and os.getppid() != self._parent_pid:
                log.warning("llumlet %s: the engine's parent process exited; no new export process", self.instance_id)
                return
            code = "unknown: not our child" if process.returncode is None else process.returncode
            log.warning("llumlet %s: the export process exited (code %s); starting another", self.instance_id, code)
            while self.process is process:
                if self._stop.wait(max(0.0, self._started_s + _RESPAWN_EVERY_S - time.monotonic())):
                    return
                try:
                    self._start_process(replacing=process)
                except Exception as exc:  # tried again after the interval
                    log.warning("llumlet %s: could not start an export process: %s", self.instance_id, exc)
            process.stop(remove=False)  # reaped already: this closes its pipe and shared memory
