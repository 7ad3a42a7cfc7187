"""Global filters on failure domains: failoverFilter and failoverMigrationSrcFilter.

Domains (--failover-domain), from the instances' CMS metadata:

| domain | an unhealthy instance blocks |
|---|---|
| instance | itself only |
| node | every instance on its node (`node_id`) |
| instance-unit | every instance of its unit (`unit_id`: a DP group, a PD unit) |
| node-unit | every instance of every unit that has an instance on its node |

An instance with an empty node_id or unit_id is its own node or unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pilotfish.config import ConfigError
from pilotfish.scheduler.policy.base import Candidate, GlobalFilter
from pilotfish.scheduler.policy.context import PolicyContext, default_context
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter
from pilotfish.scheduler.view.types import InstanceView, RequestInfo

FAILOVER_DOMAINS = ("instance", "node", "instance-unit", "node-unit")


def _node(inst: InstanceView) -> str:
    return inst.node_id or "instance:" + inst.instance_id


def _unit(inst: InstanceView) -> str:
    return inst.unit_id or "instance:" + inst.instance_id


class DomainBlocker:
    """Which instances share a failure domain with a set of unhealthy ones."""

    def __init__(self, domain: str, unhealthy: Iterable[InstanceView], candidates: Iterable[InstanceView]) -> None:
        self.domain = domain
        bad = list(unhealthy)
        self._ids = {i.instance_id for i in bad}
        self._nodes = {_node(i) for i in bad} if domain in ("node", "node-unit") else set()
        self._units = {_unit(i) for i in bad} if domain == "instance-unit" else set()
        if domain == "node-unit" and bad:
            self._units = {_unit(i) for i in candidates if _node(i) in self._nodes}

    def __bool__(self) -> bool:
        return bool(self._ids)

    def blocks(self, inst: InstanceView) -> bool:
        if inst.instance_id in self._ids:
            return True
        if self._nodes and _node(inst) in self._nodes:
            return True
        return bool(self._units) and _unit(inst) in self._units


def check_domain(domain: str) -> str:
    if domain not in FAILOVER_DOMAINS:
        raise ConfigError(f"--failover-domain: unknown domain {domain!r} (choose {', '.join(FAILOVER_DOMAINS)})")
    return domain


class FailoverFilter(GlobalFilter):
    """Blocks every candidate in the failure domain of an instance marked needsFailover."""

    name = "failover"
    indexable = True

    def __init__(
        self, domain: str = "instance", *, not_skip_when_fallback: bool = True, ctx: PolicyContext | None = None
    ) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.domain = check_domain(domain)

    def params(self) -> dict[str, Any]:
        return {"domain": self.domain}

    def describe(self) -> str:
        return f"failover ({self.domain})"

    def apply(
        self, cands: list[Candidate], req: RequestInfo, marked: Sequence[Candidate], population: Sequence[Candidate]
    ) -> list[Candidate]:
        if not marked:
            return cands
        blocker = self.blocker((c.inst for c in marked), (c.inst for c in population))
        return [c for c in cands if not blocker.blocks(c.inst)]

    def blocker(self, marked: Iterable[InstanceView], population: Iterable[InstanceView]) -> DomainBlocker:
        # only node-unit reads the population (the units on a marked node), and only then is it iterated
        return DomainBlocker(self.domain, marked, population)


class FailoverMigrationSrcFilter(GlobalFilter):
    """For failover rescheduling: keeps the instances whose requests must move away.

    Runs the schedulability and staleness checks itself (so it works without them in the
    pipeline), tags the failing instances and their failure domain, and keeps those tagged:
    the migration sources. Healthy candidates are dropped.
    """

    name = "failover_migration_src"

    def __init__(
        self,
        domain: str = "instance",
        staleness_seconds: float | None = None,
        *,
        not_skip_when_fallback: bool = True,
        ctx: PolicyContext | None = None,
    ) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.domain = check_domain(domain)
        self.ctx = ctx if ctx is not None else default_context()
        self.staleness_seconds = (
            staleness_seconds if staleness_seconds is not None else self.ctx.instance_staleness_seconds
        )

    def params(self) -> dict[str, Any]:
        return {"domain": self.domain, "staleness_seconds": self.staleness_seconds}

    def _failing(self, inst: InstanceView) -> bool:
        if not SchedulabilityFilter.healthy(inst):
            return True
        now = self.ctx.now or self.ctx.wall_clock()
        return inst.status is not None and inst.status.timestamp_ms < (now - self.staleness_seconds) * 1000.0

    def apply(
        self, cands: list[Candidate], req: RequestInfo, marked: Sequence[Candidate], population: Sequence[Candidate]
    ) -> list[Candidate]:
        for c in population:
            if self._failing(c.inst):
                c.needs_failover = True
        failing = [c.inst for c in population if c.needs_failover]
        blocker = DomainBlocker(self.domain, failing, (c.inst for c in population))
        return [c for c in population if blocker.blocks(c.inst)]
