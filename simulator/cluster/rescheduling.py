"""The scheduler's rescheduling planner as the virtual-time cluster's rescheduler.

    planner = ReschedulingPlanner(...)                    # pilotfish.scheduler.rescheduler
    sim = ClusterSim(config, router, rescheduler=PlannerRescheduler(planner, router))

It builds no view of its own: the planner plans over the full-mode router's `SchedulerCore`
instances, exactly what the scheduler decides on (statuses `observation_delay` late, in-flight
account, refreshes of idle engines). Each pair's instance ids map back to engine indices, and
the requests that move are chosen on the source engine itself with `select_requests` over its
waiting and running requests, as the llumlet chooses them on a `Migrate` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pilotfish.simulator.cluster.migration import KV_TRANSFER, MigrationOrder, candidates, check_method
from pilotfish.vllm_plugin.core.selection import select_requests

if TYPE_CHECKING:
    from pilotfish.scheduler.core import SchedulerCore
    from pilotfish.simulator.cluster.driver import ClusterSim


class Planner(Protocol):
    def plan(self, instances: Sequence[Any], now: float) -> Sequence[Any]:
        """MigrationPairs (pilotfish.scheduler.rescheduler.types): source and destination InstanceViews,
        policy, select rule/order/value, method."""
        ...


class ViewRouter(Protocol):
    """A router that keeps a `SchedulerCore` (scheduler_router.py's SchedulerRouter, full mode)."""

    @property
    def core(self) -> SchedulerCore: ...

    def refresh(self, now: float) -> None: ...


def method_name(method: str, auto: str) -> str:
    """The cluster's method for a pair's (auto, recompute or kv_transfer); `auto` is what auto means here."""
    return auto if method == "auto" else check_method(method)


class PlannerRescheduler:
    """Calls `planner.plan` over the router's core instances and turns its pairs into migration orders."""

    def __init__(self, planner: Planner, router: ViewRouter, *, auto: str = KV_TRANSFER) -> None:
        self.planner = planner
        self.router = router
        # "auto" lets the source llumlet choose, and it transfers KV where a connector is configured:
        # the simulated engines model one (EngineConfig.migration_bandwidth_gbps)
        self.auto = check_method(auto)
        self.calls = 0
        self.pairs = 0
        self.pairs_by_policy: dict[str, int] = {}

    def __call__(self, sim: ClusterSim, now: float) -> list[MigrationOrder]:
        self.router.refresh(now)
        index = {eid: i for i, eid in enumerate(sim.engine_ids)}
        pairs = self.planner.plan(self.router.core.instances(), now)
        self.calls += 1
        orders: list[MigrationOrder] = []
        taken: set[str] = set()  # a request is moved once per round even if its engine is in two pairs
        for pair in pairs:
            source = index.get(pair.source.instance_id)
            destination = index.get(pair.destination.instance_id)
            if source is None or destination is None or source == destination:
                continue
            policy = pair.policy
            self.pairs += 1
            self.pairs_by_policy[policy] = self.pairs_by_policy.get(policy, 0) + 1
            core = sim.cores[source]
            pool = [c for c in candidates(core) if c.request_id not in taken]
            total_kv_tokens = core.kv.pool.num_blocks * core.config.block_size
            ids = select_requests(pool, pair.rule, pair.order, pair.value, total_kv_tokens)
            if not ids:
                continue
            taken.update(ids)
            orders.append(MigrationOrder(source, destination, tuple(ids), method_name(pair.method, self.auto), policy))
        return orders
