"""Virtual-time cluster: N simulated engines, a trace, and a router called in-process.

    sim = ClusterSim(ClusterConfig(engines=16), SchedulerRouter(SchedulerConfig()))
    result = sim.run(trace)
    result.summary()  # TTFT / TPOT / e2e / queueing percentiles, throughput, cache hits
"""

from pilotfish.simulator.cluster.driver import ClusterConfig, ClusterResult, ClusterSim
from pilotfish.simulator.cluster.metrics import RequestRecord, summarize
from pilotfish.simulator.cluster.routers import (
    FixedRouter,
    LeastRequestsRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
    SchedulerRouter,
    router_by_name,
)
from pilotfish.simulator.cluster.status import instance_status

__all__ = [
    "ClusterConfig",
    "ClusterResult",
    "ClusterSim",
    "FixedRouter",
    "LeastRequestsRouter",
    "RequestRecord",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "SchedulerRouter",
    "instance_status",
    "router_by_name",
    "summarize",
]
