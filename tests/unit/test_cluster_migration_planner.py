"""The scheduler's ReschedulingPlanner driving migrations in the virtual-time cluster: an overloaded
engine is relieved within a few intervals, and a failover-marked engine is drained with nothing
landing in its failure domain, by dispatch or by migration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.rescheduler import ReschedulingPlanner
from pilotfish.simulator.cluster import (
    ClusterConfig,
    ClusterResult,
    ClusterSim,
    MigrationOrder,
    PlannerRescheduler,
    RouteRequest,
    SchedulerRouter,
)
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.traces import SharedPrefixSpec, TraceRequest, shared_prefix_trace

PROFILE = StepTimeProfile(
    name="t", base_ms=2.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.05, context_ms_per_token=0.0005
)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=160, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=512)
INTERVAL = 0.02
THRESHOLD = 0.5


def trace(per_group: int = 10, rate: float = 100.0) -> list[TraceRequest]:
    return shared_prefix_trace(
        SharedPrefixSpec(
            groups=3,
            prompts_per_group=per_group,
            system_prompt_length=(24, 60),
            question_length=(4, 20),
            output_length=(20, 60),
            rate=rate,
            seed=1,
        )
    )


class Pinned(SchedulerRouter):
    """Full mode's view of the engines, but every request to engine 0: the hotspot to relieve."""

    def route(self, request: RouteRequest, now: float) -> int:
        self.refresh(now)
        return 0


class Routed(SchedulerRouter):
    """The real full-mode decisions, logged as (time, engine)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decisions: list[tuple[float, int]] = []

    def route(self, request: RouteRequest, now: float) -> int:
        k = super().route(request, now)
        self.decisions.append((now, k))
        return k


class Watched:
    """The planner's rescheduler, with what each tick saw: (time, engine 0's load in the planner's view).

    With `move` off it plans but moves nothing, so a run without rescheduling is watched the same way.
    """

    def __init__(self, inner: PlannerRescheduler, metric: Any, on_tick: Any = None, move: bool = True) -> None:
        self.inner = inner
        self.metric = metric
        self.on_tick = on_tick
        self.move = move
        self.loads: list[tuple[float, float]] = []

    def __call__(self, sim: ClusterSim, now: float) -> Sequence[MigrationOrder]:
        orders = self.inner(sim, now)  # refreshes the view first
        from pilotfish.scheduler.rescheduler.types import PROBE

        inst = self.inner.router.core.instance(sim.engine_ids[0])
        self.loads.append((now, self.metric.value(inst, PROBE)))
        if self.on_tick is not None:
            self.on_tick(sim, now, orders)
        return orders if self.move else []


def run(
    router: SchedulerRouter,
    config: SchedulerConfig,
    requests: list[TraceRequest],
    engines: int,
    *,
    rescheduling: bool,
    on_tick: Any = None,
    before: Any = None,
) -> tuple[ClusterResult, ClusterSim, Watched]:
    from pilotfish.scheduler.policy.registry import METRICS, context_from_config

    planner = ReschedulingPlanner(config)
    metric = METRICS.get(config.rescheduling_neutral_load_metric)(context_from_config(config))
    watched = Watched(PlannerRescheduler(planner, router), metric, on_tick, move=rescheduling)
    sim = ClusterSim(
        ClusterConfig(engines=engines, engine=ENGINE, profile=PROFILE, rescheduling_interval=INTERVAL),
        router,
        observers=[router.observe_engine],
        rescheduler=watched,
    )
    if before is not None:
        before(sim)
    return sim.run(requests), sim, watched


def longest_run_above(loads: list[tuple[float, float]], threshold: float) -> int:
    longest = current = 0
    for _, load in loads:
        current = current + 1 if load >= threshold else 0
        longest = max(longest, current)
    return longest


def test_an_overloaded_engine_is_relieved_within_a_few_intervals() -> None:
    config = SchedulerConfig(
        enable_full_mode_scheduling=True,
        rescheduling_policies=["neutral_load"],
        rescheduling_neutral_load_threshold=THRESHOLD,
        rescheduling_req_select_rule="NUM_REQ",
        rescheduling_req_select_value=2,
    )
    requests = trace()
    off, _, watched_off = run(Pinned(config, engine=ENGINE), config, requests, 3, rescheduling=False)
    on, sim, watched_on = run(Pinned(config, engine=ENGINE), config, requests, 3, rescheduling=True)
    assert not off.migrations and on.migrations
    assert on.integrity_errors == [] and off.integrity_errors == []
    # without rescheduling engine 0 stays over the threshold for many intervals on end
    assert longest_run_above(watched_off.loads, THRESHOLD) >= 5
    # with it, every time engine 0 crosses the threshold it is back under within a few intervals
    assert 0 < longest_run_above(watched_on.loads, THRESHOLD) <= 3
    # and what moved went from engine 0 to the idle engines first, by the planner's own rule
    first = on.migrations[0]
    assert first.source == 0 and first.destination in (1, 2) and first.reason == "neutral_load"
    assert on.summary()["ttft"]["p99"] < off.summary()["ttft"]["p99"]
    for core in sim.cores:
        assert core.kv.pool.num_used == 0


@pytest.mark.parametrize("policies", [["neutral_failover"], ["neutral_failover", "neutral_load"]])
def test_a_failover_marked_engine_is_drained_and_nothing_lands_in_its_domain(policies: list[str]) -> None:
    config = SchedulerConfig(
        enable_full_mode_scheduling=True,
        failover_domain="node",
        rescheduling_policies=policies,
        rescheduling_neutral_load_threshold=0.9,
    )
    nodes = ["n0", "n0", "n1", "n1", "n2"]
    router = Routed(config, engine=ENGINE, node_ids=nodes)
    mark_at = 0.1
    domain = {0, 1}
    ticks: list[tuple[float, list[int]]] = []  # requests held on engines 0 and 1, per tick after the mark

    def on_tick(sim: ClusterSim, now: float, orders: Sequence[MigrationOrder]) -> None:
        if now > mark_at:
            held = [len(sim.cores[k].requests) + sum(1 for e in sim.transfers() if e.source == k) for k in (0, 1)]
            ticks.append((now, held))

    def before(sim: ClusterSim) -> None:
        sim.at(mark_at, lambda: sim.set_schedulable(0, False))

    requests = trace(per_group=20, rate=150.0)
    result, _, _ = run(router, config, requests, len(nodes), rescheduling=True, on_tick=on_tick, before=before)
    assert result.integrity_errors == []
    assert ticks[0][1][0] > 0  # engine 0 was busy when it was marked
    # drained: within a few intervals of the mark, engines 0 and 1 hold nothing, and stay empty
    drained = [now for now, held in ticks if held == [0, 0]]
    assert drained and drained[0] <= mark_at + 4 * INTERVAL
    assert all(held == [0, 0] for now, held in ticks if now >= drained[0])
    moved_out = [e for e in result.migrations if e.source in domain]
    assert moved_out and all(e.reason == "neutral_failover" for e in moved_out)
    # nothing lands in the failure domain after the mark: no migration into it, no dispatch to it
    assert not [e for e in result.migrations if e.time >= mark_at and e.destination in domain]
    assert not [k for t, k in router.decisions if t > mark_at and k in domain]
    assert [k for t, k in router.decisions if t <= mark_at and k in domain]  # both were used before
    assert all(r.finish_reason == "length" for r in result.records)
