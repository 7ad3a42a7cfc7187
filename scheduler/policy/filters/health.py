"""schedulabilityFilter and stalenessFilter: block unhealthy instances and mark them for failover."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

from pilotfish.scheduler.policy.base import Candidate, InstanceFilter, InstanceHealth
from pilotfish.scheduler.policy.context import PolicyContext, default_context
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class SchedulabilityFilter(InstanceFilter):
    """Passes an instance whose CMS status says schedulable; blocks (and marks needsFailover)
    one without a status or whose engine said it cannot take requests."""

    name = "schedulability"
    marks_failover = True
    health_indexed = True

    def __init__(self, *, not_skip_when_fallback: bool = True, ctx: PolicyContext | None = None) -> None:
        # a correctness guard: it keeps running in the fallback pass unless told otherwise
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)

    @staticmethod
    def healthy(inst: InstanceView) -> bool:
        s = inst.status
        return s is not None and s.schedulable

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        s = cand.inst.status
        return s is not None and s.schedulable

    def blocked_in(self, health: InstanceHealth) -> AbstractSet[str]:
        return health.without_status() | health.unschedulable()


class StalenessFilter(InstanceFilter):
    """Passes an instance whose status timestamp is at most `staleness_seconds` (default
    --instance-staleness-seconds) before the decision; blocks and marks needsFailover otherwise."""

    name = "staleness"
    marks_failover = True
    health_indexed = True

    def __init__(
        self,
        staleness_seconds: float | None = None,
        *,
        not_skip_when_fallback: bool = True,
        ctx: PolicyContext | None = None,
    ) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.ctx = ctx if ctx is not None else default_context()
        self.staleness_seconds = (
            staleness_seconds if staleness_seconds is not None else self.ctx.instance_staleness_seconds
        )
        self._cutoff_at = (-1.0, 0.0)  # (decision time, cutoff): computed once per decision

    def params(self) -> dict[str, Any]:
        return {"staleness_seconds": self.staleness_seconds}

    def cutoff_ms(self) -> float:
        """Statuses stamped before this (engine wall clock, ms) are stale at this decision."""
        now = self.ctx.now or self.ctx.wall_clock()
        at, cutoff = self._cutoff_at
        if at != now:
            cutoff = (now - self.staleness_seconds) * 1000.0
            self._cutoff_at = (now, cutoff)
        return cutoff

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        s = cand.inst.status
        return s is not None and s.timestamp_ms >= self.cutoff_ms()

    def blocked_in(self, health: InstanceHealth) -> AbstractSet[str]:
        return health.without_status() | health.stamped_before(self.cutoff_ms())
