"""Child processes and loopback ports: start, wait until answering, stop by PID.

Shared by `pilotfish up`, the benchmarks and the test fixtures, so every one of them stops
exactly the processes it started and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class StartError(RuntimeError):
    """A child could not be started or never became ready; the message says which and why."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed out are drawn below the ephemeral range: an outgoing connection (a Redis client, a
# gRPC channel, a test's HTTP client) takes its local port from that range, so one can take a port
# the kernel picked for a server between the pick and the server's own bind (seen in CI: an
# ext_proc that found its port in use). Below the range only another deliberate bind can.
_PORT_RANGE = (20000, max(20000 + 2000, min(_ephemeral_low(), 32768)))
_handed_out: set[int] = set()  # never hand out the same port twice in one process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, drawn below the kernel's ephemeral range."""
    return free_port_block(1, host)


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of `count` consecutive ports that are all free right now.

    For servers that derive ports from a base (vLLM's KV-events endpoint adds the data-parallel
    rank). Drawn below the kernel's ephemeral range, so a later bind to port 0 or an outgoing
    connection by this or any process cannot take one of them between this check and their own
    bind; a port this process handed out before is never handed out again.
    """
    low, high = _PORT_RANGE
    if len(_handed_out) > (high - low) // 2:
        _handed_out.clear()  # a long benchmark's old stacks are gone; their ports may be reused
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        block = range(base, base + count)
        if not _handed_out.intersection(block) and all(port_is_free(port, host) for port in block):
            _handed_out.update(block)
            return base
    raise StartError(f"no {count} consecutive free ports in {low}..{high} after {attempts} tries")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def port_answers(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.05,
    alive: Callable[[], str | None] | None = None,
) -> None:
    """Poll `condition` until it holds; raise StartError naming `what` on timeout.

    `alive` returns a reason string when the thing waited on has died, so a crash is
    reported at once instead of after the whole timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if alive is not None and (reason := alive()):
            raise StartError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise StartError(f"{what}: not ready after {timeout:.0f}s")
        time.sleep(interval)


async def wait_until_async(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """`wait_until` for a condition that code on the running event loop makes true: it polls
    without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise StartError(f"{what}: not ready after {timeout:.0f}s")
        await asyncio.sleep(interval)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (Linux); [pid] where there is none."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = task / "children"
        with contextlib.suppress(OSError):
            for child in children.read_text().split() if children.exists() else []:
                out += descendants(int(child))
    return out


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses):
    [0] state, [1] ppid, [2] process group, [11] user and [12] system CPU in clock ticks; None
    where there is no such process (or no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, 0 once it is gone (from /proc, in clock ticks)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process's live threads so far, from their run time in ns (schedstat), where
    `cpu_seconds` counts 10 ms ticks: too coarse for a few dozen requests, and sampled, so a process
    that runs in short bursts reads unevenly. A thread that ended is no longer counted (the routers
    measured keep theirs); ticks where schedstat is missing, 0 once the process is gone."""
    if not Path(f"/proc/{pid}/task/{pid}/schedstat").exists():
        return cpu_seconds(pid)
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0  # gone
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid`, from /proc (Linux): a `Child`'s group holds what
    it started, and what left its tree (vLLM's llumlet export process); [pgid] without /proc."""
    if not Path("/proc/self/stat").exists():
        return [pgid]
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [pid for pid in pids if (fields := stat_fields(pid)) and fields[2] == str(pgid)]


_PR_SET_PDEATHSIG = 1


def _killed_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when `parent` (this thread) dies; None
    elsewhere. A parent that died before the request took hold is caught by the ppid check."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class Child:
    """One child process, in its own process group, stopped by PID.

    With `die_with_parent`, Linux kills it when the thread that started it dies, so a parent that
    is SIGKILLed (and cannot stop its children) leaves nothing behind holding its ports.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        cwd: str | Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the parent only; it stops us in order
                preexec_fn=_killed_with(os.getpid()) if die_with_parent else None,
            )
        except OSError as exc:
            self._close_log()
            raise StartError(f"{name}: cannot run {self.argv[0]}: {exc.strerror}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> str | None:
        """None while running; else how it ended: `exited with code N` or `killed by SIGKILL`."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def exited(self) -> str | None:
        """None while running; else a reason including the tail of its log."""
        status = self.exit_status()
        return None if status is None else f"{status}{self._log_tail()}"

    def respawn(self) -> Child:
        """A new process with this one's name, argv, environment, folder and log (appended to);
        this one must have exited. Its log file is closed here."""
        assert self.proc.poll() is not None, f"{self.name} (pid {self.pid}) is still running"
        self._close_log()
        return Child(
            self.name,
            self.argv,
            env=self.env,
            log_path=self.log_path,
            cwd=self.cwd,
            die_with_parent=self.die_with_parent,
        )

    def _log_tail(self, lines: int = 5) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_bytes().decode(errors="replace").strip().splitlines()[-lines:]
        return (" — last output: " + " | ".join(tail)) if tail else ""

    def wait_port(self, port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
        what = f"{self.name} on {host}:{port}"
        wait_until(lambda: port_answers(port, host), timeout, what, alive=self.exited)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM this PID, then SIGKILL if it outlives `grace`; never touches other processes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL


class ChildGroup:
    """Children started in order and stopped in reverse order; `die_with_parent` for each one
    it starts."""

    def __init__(self, die_with_parent: bool = False) -> None:
        self.children: list[Child] = []
        self.die_with_parent = die_with_parent

    def start(self, name: str, argv: Sequence[str], **kwargs: object) -> Child:
        kwargs.setdefault("die_with_parent", self.die_with_parent)
        child = Child(name, argv, **kwargs)  # type: ignore[arg-type]
        self.children.append(child)
        return child

    def respawn(self, child: Child) -> Child:
        """Start `child` again (it must have exited) in its place in the stop order."""
        index = self.children.index(child)
        self.children[index] = new = child.respawn()
        return new

    def first_exited(self) -> tuple[Child, str] | None:
        for child in self.children:
            if reason := child.exited():
                return child, reason
        return None

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
