"""The rescheduling-policy contract: from the cluster view to migration pairs.

A policy computes its metrics with the scheduler's metric classes (scheduler/policy/metrics),
judges health with the scheduler's filters, and picks pairs with a pair selector
(rescheduler/selectors.py). It sees every instance of the cluster, whatever its infer type,
because failure domains span infer types; it returns pairs of its own infer type only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.base import Candidate
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverMigrationSrcFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.rescheduler.types import PROBE, MigrationPair
from pilotfish.scheduler.view.types import InferType, InstanceView


class ReschedulingPolicy(abc.ABC):
    """`name` is the policy's name (the registry key, what --rescheduling-policies lists)."""

    name: ClassVar[str]
    infer_type: ClassVar[InferType]

    @classmethod
    def check_config(cls, config: SchedulerConfig) -> None:
        """What this policy needs of the flags beyond what every policy does (settings.check_config);
        raises ConfigError naming the flag. Runs for the named policies only, before any is built."""
        return  # most need nothing more

    def __init__(self, config: SchedulerConfig, ctx: PolicyContext) -> None:
        self.config = config
        self.ctx = ctx
        self._schedulable = SchedulabilityFilter(ctx=ctx)
        self._fresh = StalenessFilter(config.instance_staleness_seconds, ctx=ctx)
        self._domains = FailoverMigrationSrcFilter(config.failover_domain, config.instance_staleness_seconds, ctx=ctx)

    @abc.abstractmethod
    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        """Pairs for this cycle; `instances` is the whole view in instance-id order, ctx.now is set."""

    def healthy(self, inst: InstanceView) -> bool:
        """Schedulable with a fresh status: the single-instance filters every source and destination
        passes (failover sources are the exception: they are the unhealthy ones)."""
        cand = Candidate(inst)
        return self._schedulable.passes(cand, PROBE) and self._fresh.passes(cand, PROBE)

    def own(self, instances: Sequence[InstanceView]) -> list[InstanceView]:
        return [i for i in instances if i.infer_type == self.infer_type]

    def failure_domains(self, instances: Sequence[InstanceView]) -> list[InstanceView]:
        """The failing instances (unschedulable or stale) and every instance sharing a failure domain
        with one (--failover-domain), whatever their infer type. An instance without a status yet is
        not judged: it holds nothing known."""
        population = [Candidate(i) for i in instances if i.status is not None]
        return [c.inst for c in self._domains.apply([], PROBE, (), population)]

    def balanced(self, instances: Sequence[InstanceView]) -> list[InstanceView]:
        """What the load-balance and binpacking policies move requests between: instances of their
        infer type, healthy, outside every failure domain — the global failover filter, so
        no policy refills a failed node while failover drains it."""
        blocked = {i.instance_id for i in self.failure_domains(instances)}
        return [i for i in self.own(instances) if i.instance_id not in blocked and self.healthy(i)]

    def pair(
        self,
        source: InstanceView,
        destination: InstanceView,
        *,
        rule: str | None = None,
        order: str | None = None,
        value: float | None = None,
    ) -> MigrationPair:
        """A pair with the configured request selection unless the policy says otherwise."""
        config = self.config
        return MigrationPair(
            source=source,
            destination=destination,
            policy=self.name,
            rule=rule or config.rescheduling_req_select_rule,
            order=order or config.rescheduling_req_select_order,
            value=value if value is not None else config.rescheduling_req_select_value,
            method=config.rescheduling_migration_method,
        )
