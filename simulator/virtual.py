"""Drives one engine core in virtual time: the discrete-event twin of the HTTP driver.

A cluster simulation keeps one `VirtualEngine` per instance and a clock of its own; it adds
requests at their arrival times and asks each engine for the outputs up to a time. Steps run
back to back while there is work, and an idle engine starts a step when a request arrives,
exactly as the real-time driver does, without sleeping.
"""

from __future__ import annotations

import msgspec

from pilotfish.simulator.engine.base import EngineCore, StepPlan, TokenOutput
from pilotfish.simulator.engine.request import SimRequest


class TimedOutput(msgspec.Struct, frozen=True, gc=False):
    """A token output and the virtual time it exists at (a Struct: cheap to make, one per token;
    untracked by the garbage collector, as it holds a float and an untracked TokenOutput)."""

    time: float
    output: TokenOutput


class VirtualEngine:
    """One engine on a virtual clock.

    An idle engine starts a step at the arrival that wakes it, but only once the clock moves
    past that instant (or `busy_until` is asked), so requests arriving at the same instant
    share the step, as they would in the real-time driver's loop.
    """

    def __init__(self, core: EngineCore, start: float = 0.0) -> None:
        self.core = core
        self.now = start
        self._plan: StepPlan | None = None
        self._wake_at: float | None = None  # an idle engine's next step start

    @property
    def busy_until(self) -> float | None:
        """End of the step in progress, or None when idle: the engine's next event."""
        self._start_woken()
        return self._plan.end if self._plan else None

    @property
    def step_end(self) -> float | None:
        """End of the step already running, without starting one for a pending wake-up."""
        return self._plan.end if self._plan else None

    @property
    def current_plan(self) -> StepPlan | None:
        """The step in progress (it ends at `busy_until`), or None when idle."""
        self._start_woken()
        return self._plan

    def add_request(self, request: SimRequest, at: float) -> list[TimedOutput]:
        """Add `request` at time `at` (>= every earlier call); returns outputs of steps that ended first."""
        done = self.advance_to(at)
        request.arrival_time = at
        self.core.add_request(request, at)
        if self._plan is None and self._wake_at is None:
            self._wake_at = at
        return done

    def abort_request(self, request_id: str, at: float) -> list[TimedOutput]:
        done = self.advance_to(at)
        self.core.abort_request(request_id, at)
        return done

    def advance_to(self, t: float) -> list[TimedOutput]:
        """Run every step that ends at or before `t`; the clock moves to `t`."""
        if t < self.now:
            raise ValueError(f"time runs forward: asked for {t} at {self.now}")
        if self._wake_at is not None and t > self._wake_at:
            self._start_woken()
        out: list[TimedOutput] = []
        plan = self._plan
        core = self.core
        while plan is not None and plan.end <= t:
            end = plan.end
            out += [TimedOutput(end, o) for o in core.end_step(plan)]
            plan = self._plan = core.begin_step(end) if core.has_unfinished_requests() else None
        self.now = t
        return out

    def run_until_idle(self, limit: float = float("inf")) -> list[TimedOutput]:
        """Run steps until no request is left (or the clock would pass `limit`)."""
        out: list[TimedOutput] = []
        while (end := self.busy_until) is not None and end <= limit:
            out.extend(self.advance_to(end))
        return out

    def _start_woken(self) -> None:
        if self._wake_at is None:
            return
        at, self._wake_at = self._wake_at, None
        if self._plan is None and self.core.has_unfinished_requests():
            self._plan = self.core.begin_step(at)
