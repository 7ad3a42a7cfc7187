"""The llumlet's export process: writes the engine's status to the CMS from outside the engine.

The engine's process stores each change in shared memory (core/handoff.py) and goes on; this
process, started by the engine's, polls that record and writes it to Redis (SET with TTL and a
PUBLISH, as the export thread would), refreshes metadata and status every `refresh_ms`, and
retries with backoff while Redis is away. It never touches the engine's GIL or CPU time: it runs
on `exporter_cpus` ("auto": off the engine's CPUs when the engine is pinned to some).

Polling: every `exporter_poll_us` while the engine changed its state in the last
`_NAP_AFTER_S`; then it sleeps on a pipe, and the engine's next change writes one byte to wake
it. The pipe also carries stop ("s": remove the keys, "k": keep them) and, closing, the engine's
death: the keys are removed at once rather than at the TTL.

It leaves the engine's process tree (a double fork; it stays in the engine's process group):
vLLM's shutdown SIGKILLs every descendant of its engine core before the engine core itself
(`--shutdown-timeout 0`, the default, kills at once), so a child would die with the keys still
in place. Outside the tree it sees the engine die (the pipe closes) and removes them. Where
Linux cannot hand out a pidfd (before 5.3), it stays a plain child and vLLM's shutdown leaves
the keys to their TTL.

Engine side: `ExportProcess` (spawn, wake, stop). Child side: `python -m` this module, its
settings on stdin (the CMS URL may hold a password: not on the command line).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec

from pilotfish.cms.writer import CmsWriter
from pilotfish.procs import stat_fields
from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.handoff import HandoffReader, HandoffWriter, Record, create_region, map_region
from pilotfish.vllm_plugin.core.llumlet_stats import Outage, export_summary
from pilotfish.vllm_plugin.core.metrics_snapshot import SnapshotWriter
from pilotfish.vllm_plugin.core.state import status_record

log = logging.getLogger("pilotfish.llumlet")

# No change for this long: stop polling, sleep on the pipe. Short, so an engine between bursts
# costs no wake-ups; an engine mid-step (a GPU step is 10-100 ms) pays one pipe write to wake us.
_NAP_AFTER_S = 0.05
# A wake-up byte can cross the exporter going to sleep (the two flags are read without a fence):
# a nap never lasts longer than this, so such a miss costs at most this much staleness.
_NAP_MAX_S = 0.1
_WATCH_EVERY_S = 0.2  # how often the engine's parent is checked (watch_parent)
_STOP_TIMEOUT_S = 5.0
_MIDDLE_EXIT_TIMEOUT_S = 5.0  # the double fork's middle process exits right after forking
# How long the engine waits for a new export process to say it is ready (imports, settings)
# before it writes from its own process instead: minutes for vLLM to start, seconds for this.
READY_TIMEOUT_S = 20.0

STOP_REMOVE, STOP_KEEP, WAKE, READY = b"s", b"k", b"w", b"r"


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether `fd` reads ready within `timeout_s` (None: for ever). poll, not select: vLLM's
    process may hold more than select's 1,024 descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


def can_detach() -> bool:
    """Whether the export process can leave the engine's process tree and still be watched:
    a pidfd (Linux 5.3+) is the engine's handle on a process that is not its child."""
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # ENOSYS: an older kernel
        return False
    return True


class ExportProcess:
    """The engine's handle: the shared record to publish into and the child writing it out."""

    def __init__(
        self,
        config: LlumletConfig,
        instance_id: str,
        metadata: cms_pb2.InstanceMetadata,
        watch_pid: int = 0,
        ready_timeout_s: float = READY_TIMEOUT_S,
        metrics_snapshot: bool = False,
    ) -> None:
        """Start the child and wait until it is ready; RuntimeError (nothing left behind) if it is not.

        `watch_pid`: the engine's parent as the engine first saw it (vLLM's frontend), whose death
        the child watches for; 0: none. `metrics_snapshot`: the child writes the snapshot for
        vLLM's /metrics (core/metrics_snapshot.py).
        """
        self._closed = False
        self._pidfd = -1  # the detached export process's pidfd; -1: a plain child (self.process)
        self._pidfd_lock = threading.Lock()
        self.returncode: int | None = None  # known only for a plain child
        detach = can_detach()
        fd, region = create_region()
        self.handoff = HandoffWriter(region)
        read_end, self._pipe = os.pipe()
        os.set_blocking(self._pipe, False)  # a full pipe already holds a wake-up
        ready_read, ready_write = os.pipe()
        settings = json.dumps({
            "config": msgspec.to_builtins(config),
            "instance_id": instance_id,
            "metadata": base64.b64encode(metadata.SerializeToString()).decode(),
            "region_fd": fd,
            "pipe_fd": read_end,
            "ready_fd": ready_write,
            "engine_pid": os.getpid(),
            "watch_pid": watch_pid,
            "detach": detach,
            "metrics_snapshot": metrics_snapshot,
        }).encode()  # fmt: skip
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                # in the engine's process group: whatever kills the whole engine kills this too
                pass_fds=(fd, read_end, ready_write),
                cwd="/",  # `-m` puts the directory first on sys.path: a source tree there must not shadow us
            )
        except BaseException:
            os.close(self._pipe)
            os.close(ready_read)
            self.handoff.close()
            raise
        finally:
            os.close(fd)
            os.close(read_end)
            os.close(ready_write)
        try:
            with contextlib.suppress(BrokenPipeError):  # it died at once: not ready, below
                self.process.stdin.write(settings)  # type: ignore[union-attr]
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()  # type: ignore[union-attr]
            # READY and its pid: one write of a few bytes, so one read has it whole
            message = os.read(ready_read, 64) if _readable(ready_read, ready_timeout_s) else b""
        finally:
            os.close(ready_read)
        ok = message[:1] == READY
        self.pid = self.process.pid
        if ok and detach:
            try:
                self.process.wait(_MIDDLE_EXIT_TIMEOUT_S)  # the middle process, gone once it forked
                self.pid = int(message[1:])
                # It told us its pid while it runs (it waits for our stop or our death): the
                # pidfd names that process and no later one with its number.
                self._pidfd = os.pidfd_open(self.pid)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                ok = False
                if self.pid != self.process.pid:
                    with contextlib.suppress(OSError):
                        os.kill(self.pid, signal.SIGKILL)
        if not ok:
            self.process.kill()
            code = self.process.wait()
            os.close(self._pipe)
            self.handoff.close()
            raise RuntimeError(f"the export process was not ready within {ready_timeout_s:.0f}s (exit code {code})")
        self.detached = detach

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._pipe, WAKE)

    def stop(self, remove: bool = True) -> bool:
        """Ask the child to write nothing more (and delete the keys if `remove`), wait, reap, close.

        Returns whether the child was alive to do it (a dead one left the keys to its TTL).
        Idempotent: later calls return False.
        """
        if self._closed:
            return False
        self._closed = True
        alive = not self.wait_exit(0)
        with contextlib.suppress(OSError):
            os.write(self._pipe, STOP_REMOVE if remove else STOP_KEEP)
        if not self.wait_exit(_STOP_TIMEOUT_S):
            log.warning("llumlet export process %d did not stop in %.0fs: killed", self.pid, _STOP_TIMEOUT_S)
            self.kill()
            self.wait_exit()
            alive = False
        with self._pidfd_lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        os.close(self._pipe)
        self.handoff.close()
        return alive

    def wait_exit(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` (None: for ever) for the export process to exit; whether it has.
        Any thread (the llumlet's watcher waits here while stop() may run)."""
        if not self.detached:
            try:
                self.returncode = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        with self._pidfd_lock:
            if self._pidfd < 0:
                return True  # closed by stop(), which saw it exit
            # a copy of our own: stop() may close the pidfd while this thread waits on it
            pidfd = os.dup(self._pidfd)
        try:
            return _readable(pidfd, timeout_s)  # a pidfd reads ready once its process exits
        finally:
            os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL the export process (nothing if it is gone)."""
        if not self.detached:
            self.process.kill()
            return
        with self._pidfd_lock, contextlib.suppress(ProcessLookupError, OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class Exporter:
    """The child's loop (also run in-process by tests, with their own writer)."""

    def __init__(
        self,
        config: LlumletConfig,
        instance_id: str,
        metadata: cms_pb2.InstanceMetadata,
        region: Any,
        pipe_fd: int,
        engine_pid: int,
        watch_pid: int = 0,
        writer: CmsWriter | None = None,
        engine_pidfd: int = -1,
        metrics_snapshot: bool = False,
    ) -> None:
        """`engine_pidfd`: a pidfd of the engine's process, for a detached export process (no
        longer the engine's child, so its parent says nothing); -1: the engine is our parent.
        `metrics_snapshot`: also write the snapshot for vLLM's /metrics every `metrics_interval_ms`."""
        self.config = config
        self.instance_id = instance_id
        self.metadata = metadata
        self.reader = HandoffReader(region, max(int(metadata.block_size), 1))
        if writer is None:
            from pilotfish.vllm_plugin.config import llumlet_security

            options = llumlet_security(config).redis_options(config.cms_url)
            writer = CmsWriter(config.cms_url, config.cluster, instance_id, config.ttl_ms, redis_options=options)
        self.writer = writer
        self.pipe_fd = pipe_fd
        self.engine_pid = engine_pid
        self.engine_pidfd = engine_pidfd
        self.watch_pid = watch_pid
        self.record: Record | None = None
        self.admitted: deque[tuple[int, str]] = deque()  # (monotonic ns, id) as read, oldest first
        self.admitted_total = 0  # the record's admitted_total: ids read, and a list's worth more per loss
        self.update_id = 0
        self._meta_update_id = 0
        self._dirty_since_ns = 0
        self.exports = 0
        self._outage = Outage(instance_id)
        self.staleness_us: deque[float] = deque(maxlen=100_000)
        self.terminated = False  # SIGTERM: stop as if told to, removing the keys
        self.snapshot = SnapshotWriter(config, instance_id, "process") if metrics_snapshot else None

    @property
    def write_failures(self) -> int:
        return self._outage.total

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        refresh_s = self.config.refresh_ms / 1000
        poll_s = self.config.exporter_poll_us / 1e6
        min_gap_s = self.config.min_export_interval_us / 1e6
        last_write = 0.0
        stats_every = self.config.stats_log_s
        next_stats = time.monotonic() + stats_every
        next_refresh = 0.0  # metadata first, so a reader never sees status without metadata
        next_watch = 0.0
        last_change = time.monotonic()
        pending = False
        nap_id = 0
        while True:
            now = time.monotonic()
            if now >= next_watch:
                if (why := self._engine_gone()) is not None:
                    log.warning("llumlet %s: %s; removing CMS keys", self.instance_id, why)
                    return self._finish(remove=True, pending=pending)
                next_watch = now + _WATCH_EVERY_S
            if (record := self.reader.poll()) is not None:
                self._take(record)
                pending = True
                last_change = now
            if self.snapshot is not None and self.record is not None and self.snapshot.due(now):
                self.snapshot.write(self.record.counters, self.exports, self.write_failures, self.staleness_us)
            if pending and min_gap_s and (gap := last_write + min_gap_s - now) > 0 and now < next_refresh:
                if (stop := self._wait(gap)) is not None:
                    return self._finish(remove=stop, pending=pending)
                continue
            if pending or now >= next_refresh:
                try:
                    if now >= next_refresh:
                        self._write_metadata()
                        next_refresh = time.monotonic() + refresh_s
                        if stats_every and time.monotonic() >= next_stats:
                            log.info("llumlet %s: %s", self.instance_id, self.summary())
                            next_stats = time.monotonic() + stats_every
                    if self.record is not None:
                        self._write_status()
                        last_write = time.monotonic()
                    pending = False
                    self._outage.succeeded()
                except Exception as exc:
                    pending = True
                    next_refresh = 0.0  # re-send metadata too: the keys may have expired meanwhile
                    if (stop := self._wait(self._outage.failed(exc))) is not None:
                        return self._finish(remove=stop, pending=pending)
                    continue
            if now - last_change < _NAP_AFTER_S:
                stop = self._wait(poll_s)
            else:
                nap_id += 1
                self.reader.set_napping(nap_id)
                if self.reader.changed():  # published after our last look: no nap
                    self.reader.set_napping(0)
                    continue
                stop = self._wait(max(0.0, min(next_refresh - time.monotonic(), _NAP_MAX_S)))
                self.reader.set_napping(0)
            if stop is not None:
                return self._finish(remove=stop, pending=pending)

    def _wait(self, timeout_s: float) -> bool | None:
        """Sleep up to `timeout_s` or until the engine writes to the pipe; a stop: whether to remove the keys."""
        if self.terminated:
            return True
        ready, _, _ = select.select([self.pipe_fd], [], [], timeout_s)  # a signal ends it (PEP 475: not early)
        if not ready:
            return True if self.terminated else None
        try:
            data = os.read(self.pipe_fd, 4096)
        except BlockingIOError:
            return None
        if not data:
            log.warning("llumlet %s: the engine process exited; removing CMS keys", self.instance_id)
            return True
        if STOP_REMOVE in data:
            return True
        if STOP_KEEP in data:
            return False
        return True if self.terminated else None

    def _engine_gone(self) -> str | None:
        if self.engine_pidfd >= 0:
            if _readable(self.engine_pidfd, 0):  # a pidfd reads ready at exit
                return "the engine process exited"
        elif os.getppid() != self.engine_pid:
            return "the engine process exited"
        if self.watch_pid and _parent_of(self.engine_pid) not in (None, self.watch_pid):
            return "the engine's parent process exited"
        return None

    def _finish(self, remove: bool, pending: bool = False) -> None:
        # the state the engine stored last goes out first (one not yet read, or one read but held
        # back by the minimum interval or a failed write): a stop keeping the keys leaves them current
        if not remove:
            if (record := self.reader.poll()) is not None:
                self._take(record)
                pending = True
            if pending and self.record is not None:
                with contextlib.suppress(Exception):
                    self._write_status()
        log.info("llumlet %s stopping: %s", self.instance_id, self.summary())
        if self.snapshot is not None:
            self.snapshot.remove()
        if remove:
            try:
                self.writer.remove()
            except Exception as exc:  # the TTL removes them anyway
                log.warning("llumlet %s: could not remove CMS keys at shutdown: %s", self.instance_id, exc)
        self.writer.close()

    # ---- writes ---------------------------------------------------------------------------------

    def _take(self, record: Record) -> None:
        lost = self.reader.lost_ids
        ids = self.reader.ids_until(record.ring_end)
        if ids:
            now_ns = time.monotonic_ns()
            self.admitted.extend((now_ns, rid) for rid in ids)
        # a stretch not read: more than a status can list, so a reader takes it as statuses it missed
        self.admitted_total += len(ids) + (self.reader.lost_ids - lost) * (self.config.max_admitted_ids + 1)
        if record.dirty_since_ns and not self._dirty_since_ns:
            self._dirty_since_ns = record.dirty_since_ns  # the oldest change not yet written
        self.record = record

    def _write_status(self) -> None:
        record = self.record
        assert record is not None
        admitted = self.admitted
        horizon = time.monotonic_ns() - self.config.admitted_window_ms * 1_000_000
        while admitted and (admitted[0][0] < horizon or len(admitted) > self.config.max_admitted_ids):
            admitted.popleft()
        # ours, not the engine's: a refresh re-writes an unchanged record and must still be newer
        self.update_id = max(self.update_id + 1, record.update_id, time.time_ns() // 1000)
        self.writer.write_status(
            status_record(
                self.instance_id,
                self.update_id,
                record.counters,
                [rid for _, rid in admitted],
                admitted_total=self.admitted_total,
            )
        )
        if self._dirty_since_ns:
            self.staleness_us.append((time.monotonic_ns() - self._dirty_since_ns) / 1000)
            self._dirty_since_ns = 0
        self.exports += 1

    def _write_metadata(self) -> None:
        self._meta_update_id = max(self._meta_update_id + 1, time.time_ns() // 1000)
        self.metadata.update_id = self._meta_update_id
        self.metadata.timestamp_ms = time.time_ns() // 1_000_000
        self.writer.write_metadata(self.metadata)

    def summary(self) -> str:
        record = self.record
        return export_summary(
            self.exports,
            list(self.staleness_us),
            where="from the export process",
            steps=record.counters["step_id"] if record else 0,
            hook_cpu_ns=record.hook_cpu_ns if record else 0,
            engine_cpu_ns=record.engine_cpu_ns if record else 0,
            exporter_cpu_ns=time.process_time_ns(),
            exporter="export process",
            extra=f"; {self.reader.lost_ids} admitted-id reads lost" if self.reader.lost_ids else "",
        )


def _parent_of(pid: int) -> int | None:
    """`pid`'s parent from /proc (None where there is no /proc or no such process)."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def exporter_cpus(setting: str) -> set[int] | None:
    """The CPUs to run on for `exporter_cpus`: None keeps the inherited ones."""
    if setting == "inherit" or not hasattr(os, "sched_getaffinity"):
        return None
    if setting != "auto":
        return _cpu_list(setting)
    mine = os.sched_getaffinity(0)
    everything = set(range(os.cpu_count() or 1))
    with contextlib.suppress(OSError, ValueError), open("/sys/devices/system/cpu/online") as handle:
        everything = _cpu_list(handle.read().strip())
    rest = everything - mine
    return rest or None  # pinned engines leave others free; an unpinned one leaves all to share


def _cpu_list(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return cpus


def main() -> None:
    from pilotfish.logs import configure_logging, resolve_format

    try:
        json_lines = resolve_format(None) == "json"  # PILOTFISH_LOG_FORMAT, as the engine's llumlet
    except ValueError:
        json_lines = False
    if json_lines:
        configure_logging(logging.INFO, "json")
    else:
        logging.basicConfig(
            level=logging.INFO, format="%(levelname)s %(asctime)s [pilotfish export process] %(message)s",
            stream=sys.stderr,
        )  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for vLLM, which stops us in order
    settings = json.loads(sys.stdin.buffer.read())
    engine_pidfd = -1
    if settings.get("detach"):
        # Taken while the engine is our parent and waits for us: the pidfd names that process.
        engine_pidfd = os.pidfd_open(settings["engine_pid"])
        if os.getppid() != settings["engine_pid"]:
            raise SystemExit("pilotfish export process: the engine exited before it started")
        if os.fork():
            os._exit(0)  # the middle process: the engine reaps it; its child leaves the engine's tree
    config = msgspec.convert(settings["config"], LlumletConfig)
    with contextlib.suppress(OSError, ValueError):
        if (cpus := exporter_cpus(config.exporter_cpus)) is not None:
            os.sched_setaffinity(0, cpus)
    metadata = cms_pb2.InstanceMetadata.FromString(base64.b64decode(settings["metadata"]))
    exporter = Exporter(
        config,
        settings["instance_id"],
        metadata,
        map_region(settings["region_fd"]),
        settings["pipe_fd"],
        settings["engine_pid"],
        settings["watch_pid"],
        engine_pidfd=engine_pidfd,
        metrics_snapshot=settings.get("metrics_snapshot", False),
    )

    def terminate(*_: Any) -> None:
        exporter.terminated = True

    signal.signal(signal.SIGTERM, terminate)
    os.write(settings["ready_fd"], READY + str(os.getpid()).encode())
    os.close(settings["ready_fd"])
    exporter.run()


if __name__ == "__main__":
    main()
