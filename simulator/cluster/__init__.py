"""Virtual-time cluster: N simulated engines, a trace, and a router called in-process.

    sim = ClusterSim(ClusterConfig(engines=16), SchedulerRouter(SchedulerConfig()))
    result = sim.run(trace)
    result.summary()  # TTFT / TPOT / e2e / queueing percentiles, throughput, cache hits

`SchedulerRouter` is the scheduler core in lite or full mode (its config's); in full mode it
reads the engines' CMS statuses, which the cluster builds with the llumlet's own LoadState
(status.py), and their KV events (`observers=[router.observe_engine]`).

With a rescheduler (`ClusterSim(..., rescheduler=PlannerRescheduler(planner, router))`) requests
migrate between engines, by recompute or KV transfer (migration.py); `sim.migrate` does it by hand.
"""

from pilotfish.simulator.cluster.driver import ClusterConfig, ClusterResult, ClusterSim
from pilotfish.simulator.cluster.metrics import RequestRecord, summarize
from pilotfish.simulator.cluster.migration import (
    KV_TRANSFER,
    RECOMPUTE,
    MigrationEvent,
    MigrationOrder,
    Rescheduler,
)
from pilotfish.simulator.cluster.rescheduling import PlannerRescheduler
from pilotfish.simulator.cluster.routers import (
    FixedRouter,
    LeastRequestsRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
    router_by_name,
)
from pilotfish.simulator.cluster.scheduler_router import SchedulerRouter
from pilotfish.simulator.cluster.status import EngineStatus

__all__ = [
    "KV_TRANSFER",
    "RECOMPUTE",
    "ClusterConfig",
    "ClusterResult",
    "ClusterSim",
    "EngineStatus",
    "FixedRouter",
    "LeastRequestsRouter",
    "MigrationEvent",
    "MigrationOrder",
    "PlannerRescheduler",
    "RequestRecord",
    "Rescheduler",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "SchedulerRouter",
    "router_by_name",
    "summarize",
]
