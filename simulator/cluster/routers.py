"""The scheduling callback of the virtual-time cluster, and the baselines.

A router picks an engine for each arriving request and hears, `observation_delay` seconds late,
what the engines did: token progress, finishes and (if it asks) each engine's CMS status after
every step. `SchedulerRouter` (scheduler_router.py) runs the real scheduler core in-process; the
baselines here are the smallest policies worth comparing against (bench cluster has the rest).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pilotfish.protos.cms_pb2 import InstanceStatus


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a gateway knows of a request when it schedules it."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: list[int]  # the engine's prefix block hashes of the prompt (full blocks)
    block_size: int


class Router:
    """Base class: every hook but `route` is a no-op."""

    # ask the cluster for an InstanceStatus per engine after every step (full mode); costly
    wants_status: bool = False

    def bind(self, engine_ids: list[str]) -> None:
        """Called once before the run with the engines' ids, index i being engine i."""

    def route(self, request: RouteRequest, now: float) -> int:
        raise NotImplementedError

    def on_progress(self, request_id: str, engine: int, generated_tokens: int, now: float) -> None:
        """Cumulative tokens generated (the first report also means the prefill is done)."""

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        """The request's stream ended (the gateway's Release), with the answer's length where the gateway
        learned it only at the end (0: the reports said it)."""

    def on_status(self, engine: int, status: InstanceStatus, now: float) -> None:
        """An engine's status as the llumlet would have written it, `observation_delay` late."""

    def set_schedulable(self, engine: int, schedulable: bool) -> None:
        """The engine's llumlet reports it (un)schedulable from now on (its statuses say so too)."""


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._next = itertools.count()
        self._n = 1

    def bind(self, engine_ids: list[str]) -> None:
        self._n = len(engine_ids)

    def route(self, request: RouteRequest, now: float) -> int:
        return next(self._next) % self._n


class LeastRequestsRouter(Router):
    """Fewest outstanding requests as this router has seen them (dispatches minus observed finishes)."""

    def __init__(self) -> None:
        self._load: list[int] = []

    def bind(self, engine_ids: list[str]) -> None:
        self._load = [0] * len(engine_ids)

    def route(self, request: RouteRequest, now: float) -> int:
        load = self._load
        best = min(range(len(load)), key=load.__getitem__)  # ties: the lowest index
        load[best] += 1
        return best

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        self._load[engine] -= 1


class FixedRouter(Router):
    """Replays recorded decisions: request id -> engine index (to compare drivers on equal decisions)."""

    def __init__(self, decisions: Mapping[str, int]) -> None:
        self.decisions = dict(decisions)

    def route(self, request: RouteRequest, now: float) -> int:
        return self.decisions[request.request_id]


BASELINES: dict[str, Callable[[], Router]] = {
    "round-robin": RoundRobinRouter,
    "least-requests": LeastRequestsRouter,
}


def router_by_name(name: str) -> Router:
    """`round-robin`, `least-requests`, or `scheduler:<policy>` (the real core, lite mode)."""
    if name in BASELINES:
        return BASELINES[name]()
    if name.startswith("scheduler"):
        from pilotfish.scheduler.config import SchedulerConfig
        from pilotfish.simulator.cluster.scheduler_router import SchedulerRouter

        _, _, policy = name.partition(":")
        return SchedulerRouter(SchedulerConfig(scheduling_policy=policy) if policy else SchedulerConfig())
    known = ", ".join([*BASELINES, "scheduler", "scheduler:<policy>"])
    raise ValueError(f"unknown router {name!r} (known: {known})")
