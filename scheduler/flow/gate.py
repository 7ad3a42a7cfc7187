"""FlowGate: the flow controller on the event loop that owns the core (service or colocated gateway).

It adds what needs a loop: a timer for the next deadline (and, while requests wait, a recheck
every --flow-recheck-ms), and `poke`, which drains at the next turn of the loop, once however
often it is called in between. Whoever owns the core pokes after every release, report batch and
engine status (SchedulerCore.on_view_change), so a request leaves the queue the moment an engine
has room.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.flow.controller import FlowController
from pilotfish.scheduler.view.types import RequestInfo


class FlowGate:
    def __init__(self, controller: FlowController) -> None:
        self.controller = controller
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._poked = False
        self._closed = False

    @classmethod
    def from_config(cls, core: object, config: SchedulerConfig) -> FlowGate | None:
        """A gate when --enable-flow-control is on; ConfigError for bad --flow-* settings."""
        if not config.enable_flow_control:
            return None
        from pilotfish.scheduler.flow.metrics import register_flow_metrics

        controller = FlowController(core, config)
        registry = getattr(core, "registry", None)
        if registry is not None:
            register_flow_metrics(registry, controller)  # on the core's /metrics
        return cls(controller)

    def submit(
        self, req: RequestInfo, priority: int, flow: str, hold_s: float, reply: Callable[[object], None]
    ) -> object | None:
        """FlowController.submit; arms the timers when the request waits."""
        if self._closed:
            hold_s = 0.0  # stopping: nothing more waits
        outcome = self.controller.submit(req, priority, flow, hold_s, reply)
        if outcome is None:
            self._arm()
        return outcome

    def cancel(self, request_id: str) -> bool:
        return self.controller.cancel(request_id)

    def wait_s(self, request_id: str) -> float:
        """Seconds until the waiting request's deadline (0 if it is not waiting)."""
        w = self.controller._waiting.get(request_id)
        return max(0.0, w.deadline - self.controller._clock()) if w is not None else 0.0

    def poke(self) -> None:
        """Something changed that may give an engine room: drain at the next turn of the loop."""
        if self._poked or not len(self.controller):
            return
        self._poked = True
        asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._poked = False
        self._timer = None
        self._timer_at = math.inf
        controller = self.controller
        controller.expire()
        controller.drain()
        self._arm()

    def _arm(self) -> None:
        controller = self.controller
        if not len(controller):
            if self._timer is not None:
                self._timer.cancel()
                self._timer, self._timer_at = None, math.inf
            return
        now = controller._clock()
        at = now + controller.settings.recheck_s
        deadline = controller.next_deadline()
        if deadline is not None:
            at = min(at, deadline)
        if self._timer is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._run)

    def close(self) -> None:
        """Answer everything waiting (UNAVAILABLE: the gateway falls back) and stop the timers."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.controller.shed_all("the scheduler is stopping")
