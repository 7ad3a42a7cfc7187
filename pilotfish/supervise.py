"""Restart a child that dies, on the same ports; give up on one that keeps dying.

`pilotfish up` watches every child it started (engines, scheduler, ext_proc, Envoy, Redis in
full mode). A child that exits is started again with the same command line, so it binds the
same ports and the rest of the stack finds it where it was; the restart counts as done once the
child's readiness condition holds again. A child that dies more than `max_restarts` times within
`restart_window_seconds` stops the whole stack: a crash loop is a fault to report, not to hide.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, NoReturn, Protocol

import msgspec
from msgspec import Meta

from pilotfish.procs import StartError, wait_until


class SuperviseConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_restarts: Annotated[
        int,
        Meta(ge=0, description="restarts of one child allowed within --restart-window-seconds; its next death "
             "stops the whole stack (0: never restart)"),
    ] = 5  # fmt: skip
    restart_window_seconds: Annotated[
        float, Meta(gt=0, description="the window --max-restarts counts a child's restarts in")
    ] = 60.0


class GaveUp(StartError):
    """A child died once more than its restart budget allows; the message names it and why."""


class Supervised(Protocol):
    """What the supervisor needs of a child (`procs.Child` is one)."""

    name: str

    @property
    def pid(self) -> int: ...

    def exit_status(self) -> str | None: ...

    def exited(self) -> str | None: ...

    def stop(self, grace: float = 5.0) -> None: ...


def _log_to_stderr(line: str) -> None:
    print(f"pilotfish up: {line}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class _Watched:
    child: Supervised
    ready: Callable[[], bool]
    recent: deque[float] = field(default_factory=deque)  # when each restart within the window began
    total: int = 0


class Supervisor:
    """Polled by its owner (`check`, or `run` forever); restarts children through `respawn`, which
    starts a dead child again and returns the new one (`ChildGroup.respawn` keeps the stop order)."""

    POLL_SECONDS = 0.2

    def __init__(
        self,
        config: SuperviseConfig,
        respawn: Callable[[Supervised], Supervised],
        *,
        start_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = _log_to_stderr,
    ) -> None:
        self.config = config
        self._respawn = respawn
        self._start_timeout = start_timeout
        self._clock = clock
        self._log = log
        self._watched: dict[str, _Watched] = {}

    def watch(self, child: Supervised, ready: Callable[[], bool]) -> None:
        """Restart `child` when it dies; a restart is done once `ready()` holds."""
        self._watched[child.name] = _Watched(child, ready)

    def pids(self) -> dict[str, int]:
        return {name: w.child.pid for name, w in self._watched.items()}

    def restarts(self, name: str) -> int:
        return self._watched[name].total

    def check(self) -> None:
        """Restart every watched child that has died; GaveUp when one is over its budget."""
        for name, watched in self._watched.items():
            status = watched.child.exit_status()
            if status is None:
                continue
            now = self._clock()
            window, limit = self.config.restart_window_seconds, self.config.max_restarts
            while watched.recent and watched.recent[0] <= now - window:
                watched.recent.popleft()
            if len(watched.recent) >= limit:
                n = len(watched.recent)
                raise GaveUp(
                    f"{name} (pid {watched.child.pid}) died again after {n} restart{'' if n == 1 else 's'} within "
                    f"{window:g}s (--max-restarts {limit}): {watched.child.exited()}"
                )
            watched.recent.append(now)
            watched.total += 1
            self._log(
                f"{name} (pid {watched.child.pid}) {status}; restarting it "
                f"(restart {watched.total}; {len(watched.recent)} of {limit} allowed within {window:g}s)"
            )
            self._restart(name, watched)

    def _restart(self, name: str, watched: _Watched) -> None:
        new = watched.child = self._respawn(watched.child)
        try:
            wait_until(watched.ready, self._start_timeout, f"{name} (pid {new.pid})", alive=new.exited)
        except StartError as exc:
            if new.exit_status() is None:
                new.stop()  # started but never ready: stopped, so the next check counts it as dead
            self._log(f"{name} did not come back: {exc}")
            return
        self._log(f"{name} is back as pid {new.pid}")

    def run(self, sleep: Callable[[float], None] = time.sleep) -> NoReturn:
        """Check forever; returns only by raising (GaveUp, or the owner's signal exception)."""
        while True:
            self.check()
            sleep(self.POLL_SECONDS)
