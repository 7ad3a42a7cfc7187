"""The rescheduler: plans migrations of running requests and asks the source llumlets to carry them out.

- `planner.ReschedulingPlanner`: synchronous and I/O-free; every policy in order over the cluster
  view, conflicting pairs dropped (usable from a virtual-time simulation).
- `dispatcher.MigrationDispatcher`: the pairs of one cycle in parallel, as llumlet Migrate calls.
- `loop.ReschedulingLoop`: refresh, plan, dispatch, every --rescheduling-interval-ms, never overlapping.
- `service`: the two deployment modes, colocated in `pilotfish scheduler` or `pilotfish rescheduler`.
"""

from pilotfish.scheduler.rescheduler.planner import ReschedulingPlanner
from pilotfish.scheduler.rescheduler.types import MigrationPair, MigrationResult

__all__ = ["MigrationPair", "MigrationResult", "ReschedulingPlanner"]
