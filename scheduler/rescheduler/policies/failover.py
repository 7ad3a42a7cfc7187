"""prefill_failover, decode_failover, neutral_failover: move requests off unhealthy instances.

Sources: the scheduler's failover_migration_src filter over the whole view: instances that are
unschedulable or stale, and every instance sharing their failure domain (--failover-domain),
keeping those of the policy's infer type that hold requests. An instance without a status yet
is left out: it holds nothing known and is not judged until it reports.
Destinations: healthy instances of the same infer type outside every failure domain.
Selector: round robin over the destinations, one destination per source per cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
from pilotfish.scheduler.rescheduler.selectors import RoundRobin
from pilotfish.scheduler.rescheduler.types import MigrationPair
from pilotfish.scheduler.view.types import InferType, InstanceView


def holds_requests(inst: InstanceView) -> bool:
    s = inst.status
    return s is not None and s.num_waiting + s.num_running + s.num_loading > 0


class FailoverPolicy(ReschedulingPolicy):
    def __init__(self, config: SchedulerConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self._selector = RoundRobin()

    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        in_domain = self.failure_domains(instances)
        if not in_domain:
            return []
        sources = [i for i in in_domain if i.infer_type == self.infer_type and holds_requests(i)]
        return [self.pair(s, d) for s, d in self._selector.assign(sources, self.balanced(instances))]


class PrefillFailover(FailoverPolicy):
    name = "prefill_failover"
    infer_type = InferType.PREFILL


class DecodeFailover(FailoverPolicy):
    name = "decode_failover"
    infer_type = InferType.DECODE


class NeutralFailover(FailoverPolicy):
    name = "neutral_failover"
    infer_type = InferType.NEUTRAL
