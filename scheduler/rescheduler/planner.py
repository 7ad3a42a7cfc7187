"""The rescheduling planner: every policy in order over the view, conflicting pairs dropped.

Synchronous and free of I/O and clocks: the caller passes the view and `now` (wall-clock seconds,
the clock of the statuses' timestamp_ms), so the discrete-event simulator can call it in virtual
time with the instances of its SchedulerCore:

    planner = ReschedulingPlanner(config)          # raises ConfigError on bad flags
    pairs = planner.plan(core.instances(), now)    # list[MigrationPair]

Conflicts (stricter than forbidding A->B together with B->A): an instance is the source of at
most one pair per cycle, and no instance both sends and receives in one cycle. One source asked
twice would move twice what either policy sized, and an instance receiving while it sends
would pass requests along a chain. An instance may receive from several sources (failover fans
in). Policies run in --rescheduling-policies order, so an earlier policy wins a conflict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
from pilotfish.scheduler.rescheduler.settings import check_config
from pilotfish.scheduler.rescheduler.types import MigrationPair
from pilotfish.scheduler.view.types import InstanceView

log = logging.getLogger(__name__)


class ReschedulingPlanner:
    def __init__(self, config: SchedulerConfig, ctx: PolicyContext | None = None) -> None:
        """`ctx` defaults to one built from `config` whose clock is the `now` given to plan()."""
        check_config(config)
        from pilotfish.scheduler.policy.registry import context_from_config
        from pilotfish.scheduler.rescheduler.registry import RESCHEDULING_POLICIES

        self._now = 0.0
        # the planner's own context: metrics and filters never read the real clock, and the
        # scheduler's decisions (which set their own ctx.now) are not disturbed
        self.ctx = ctx if ctx is not None else context_from_config(config, wall_clock=lambda: self._now)
        self.policies: list[ReschedulingPolicy] = [
            RESCHEDULING_POLICIES.get(name)(config, self.ctx) for name in config.rescheduling_policies
        ]
        self.num_conflicts = 0

    def plan(self, instances: Iterable[InstanceView], now: float) -> list[MigrationPair]:
        """The pairs to migrate this cycle, in policy order."""
        self._now = self.ctx.now = now
        view = sorted(instances, key=lambda i: i.instance_id)
        chosen: list[MigrationPair] = []
        sending: set[str] = set()
        receiving: set[str] = set()
        for policy in self.policies:
            for pair in policy.pairs(view):
                src, dst = pair.source.instance_id, pair.destination.instance_id
                if src == dst or src in sending or src in receiving or dst in sending:
                    self.num_conflicts += 1
                    log.debug("dropped %r: conflicts with a pair chosen before", pair)
                    continue
                sending.add(src)
                receiving.add(dst)
                chosen.append(pair)
        if chosen and log.isEnabledFor(logging.DEBUG):
            log.debug("rescheduling plan: %s", ", ".join(map(repr, chosen)))
        return chosen
