"""The virtual-time cluster's statuses are the llumlet's own records: its LoadState, fed by the engine's
hooks, on the virtual clock. Counters agree with the engine after every step, waiting requests count
as waiting, admitted ids age out of the llumlet's window, idle engines refresh their record, KV
transfers show as migrating; and the lite and full arms of bench cluster both run through the one
`SchedulerRouter`."""

from __future__ import annotations

from typing import Any

import pytest

from pilotfish.protos.cms_pb2 import InstanceStatus
from pilotfish.simulator.cluster import (
    KV_TRANSFER,
    ClusterConfig,
    ClusterSim,
    Router,
    RouteRequest,
    SchedulerRouter,
)
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.request import RequestStatus
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.traces import SharedPrefixSpec, TraceRequest, shared_prefix_trace

PROFILE = StepTimeProfile(name="t", base_ms=2.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.05,
                          context_ms_per_token=0.0005)  # fmt: skip
# few blocks and seats: requests wait, and some are preempted
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=80, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=320,
                      migration_bandwidth_gbps=1.0)  # fmt: skip


def trace(per_group: int = 8, rate: float = 200.0, output: tuple[int, int] = (4, 40)) -> list[TraceRequest]:
    return shared_prefix_trace(SharedPrefixSpec(groups=2, prompts_per_group=per_group, system_prompt_length=(24, 60),
                                                question_length=(4, 20), output_length=output, rate=rate, seed=2))


def engine_figures(core: Any) -> dict[str, int]:
    """The status figures recomputed from the engine's own queues, as the llumlet defines them."""
    running = [r for r in core.running if r.status is RequestStatus.RUNNING]
    decode = [r for r in running if r.num_output_tokens > 0 and r.num_computed_tokens >= r.num_tokens - 1]
    return {
        "num_waiting": len(core.waiting),
        "num_running": len(running),
        "num_running_decode": len(decode),
        "num_running_prefill": len(running) - len(decode),
        "running_decode_seq_len_sum": sum(r.num_tokens for r in decode),
        "used_kv_tokens": core.kv.pool.num_used * core.config.block_size,
        "num_preempted_total": core.stats().num_preemptions_total,
    }


class Checker(Router):
    """Reads statuses and, with `check` (no observation delay: heard as written), checks each against
    the engine right then."""

    wants_status = True

    def __init__(self, spread: bool = True, check: bool = True) -> None:
        self.sim: ClusterSim | None = None
        self.spread = spread
        self.check = check
        self.n = 1
        self.statuses: list[tuple[int, InstanceStatus, float]] = []
        self.added: dict[str, float] = {}  # request id -> when it reached its engine
        self.mismatches: list[str] = []

    def bind(self, engine_ids: list[str]) -> None:
        self.n = len(engine_ids)

    def route(self, request: RouteRequest, now: float) -> int:
        self.added[request.request_id] = now
        return len(self.added) % self.n if self.spread else 0

    def on_status(self, engine: int, status: InstanceStatus, now: float) -> None:
        assert self.sim is not None
        self.statuses.append((engine, status, now))
        if not self.check:
            return
        core = self.sim.cores[engine]
        got = {k: getattr(status, k) for k in engine_figures(core)}
        if got != engine_figures(core):
            self.mismatches.append(f"engine {engine} at {now}: {got} != {engine_figures(core)}")
        waiting = {r.request_id for r in core.waiting}
        running = {r.request_id for r in core.running}
        assert status.num_waiting == len(waiting) and status.num_running == len(running)
        assert status.timestamp_ms == int(now * 1000)
        # the llumlet lists what it admitted within its window (2 s), not everything it holds
        for rid in status.admitted_request_ids:
            assert now - 2.0 <= self.added[rid] <= now, rid


def run_checked(router: Checker, requests: list[TraceRequest], engines: int = 2, **config: Any) -> ClusterSim:
    sim = ClusterSim(ClusterConfig(engines=engines, engine=ENGINE, profile=PROFILE, **config), router)
    router.sim = sim
    result = sim.run(requests)
    assert result.integrity_errors == []
    return sim


def test_every_status_agrees_with_its_engine_when_written() -> None:
    router = Checker()
    sim = run_checked(router, trace(output=(60, 150)))
    assert router.mismatches == []
    steps = [s for _, s, _ in router.statuses if s.last_step_duration_us]
    assert len(steps) >= 50
    # the run walked the paths that matter: requests waiting beside running ones, preemptions, decodes
    assert any(s.num_waiting and s.num_running for _, s, _ in router.statuses)
    assert sum(c.stats().num_preemptions_total for c in sim.cores) > 0
    assert any(s.num_running_decode for _, s, _ in router.statuses)
    # every engine drained to zero
    for k in range(2):
        last = [s for e, s, _ in router.statuses if e == k][-1]
        assert (last.num_waiting, last.num_running, last.uncomputed_prefill_tokens) == (0, 0, 0)


def test_statuses_count_steps_and_number_updates_in_the_order_heard() -> None:
    router = Checker()
    run_checked(router, trace(per_group=4))
    for k in range(2):
        mine = [s for e, s, _ in router.statuses if e == k]
        assert [s.update_id for s in mine] == list(range(1, len(mine) + 1))
        step_ids = [s.step_id for s in mine]
        assert step_ids == sorted(step_ids) and step_ids[-1] > 0
        # a step's figures ride with its record: duration and batch of the step just ended
        stepped = [s for s in mine if s.last_step_duration_us]
        assert all(s.last_step_prefill_tokens or s.last_step_decode_batch for s in stepped)


def test_a_request_running_past_the_window_is_no_longer_listed() -> None:
    # one long request at t=0 on an engine to itself: it runs for seconds of virtual time
    slow = StepTimeProfile(name="slow", base_ms=20.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.05,
                           context_ms_per_token=0.0)  # fmt: skip
    request = TraceRequest("long", 0.0, 40, 200, (("s", 40),))
    router = Checker(spread=False)
    sim = ClusterSim(ClusterConfig(engines=1, engine=ENGINE, profile=slow), router)
    router.sim = sim
    sim.run([request])
    early = [s for _, s, t in router.statuses if t < 1.9 and s.num_running]
    late = [s for _, s, t in router.statuses if t > 2.1 and s.num_running]
    assert early and late  # it ran on both sides of the window's edge
    assert all(list(s.admitted_request_ids) == ["long"] for s in early)
    assert all(not s.admitted_request_ids for s in late)  # still running, listed no longer


def test_an_idle_engine_writes_its_record_every_heartbeat() -> None:
    # two requests 3 s apart to engine 0; engine 1 never gets any
    requests = [TraceRequest("a", 0.0, 20, 4, (("s", 20),)), TraceRequest("b", 3.0, 20, 4, (("s", 20),))]
    router = Checker(spread=False, check=False)
    run_checked(router, requests, heartbeat=1.0, observation_delay=0.05)
    idle = [(s, t) for e, s, t in router.statuses if e == 1]
    # written at the start, then heard once more at the next decision (3 s), at once, not late
    assert [t for _, t in idle] == [0.0, pytest.approx(3.0 + PROFILE.api_overhead_ms / 1000)]
    assert all(s.num_running == 0 and s.schedulable for s, _ in idle)
    assert [s.update_id for s, _ in idle] == [1, 2]


class Mover(Checker):
    """Sends everything to engine 0 and, at `at`, moves its running requests to engine 1 by KV transfer."""

    def __init__(self) -> None:
        super().__init__(spread=False)
        self.events: list[Any] = []

    def move(self) -> None:
        assert self.sim is not None
        ids = [r.request_id for r in self.sim.cores[0].running if r.num_computed_tokens]
        self.events = self.sim.migrate(0, 1, ids, KV_TRANSFER)


def test_a_kv_transfer_shows_as_migrating_out_and_in_until_it_lands() -> None:
    router = Mover()
    sim = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), router)
    router.sim = sim
    sim.at(0.03, router.move)
    sim.run(trace(per_group=3, output=(60, 80)))
    moved = [e for e in router.events if e.method == KV_TRANSFER]
    assert moved
    start, end = min(e.time for e in moved), max(e.arrives for e in moved)
    during = [(k, s) for k, s, t in router.statuses if start < t < min(e.arrives for e in moved)]
    assert any(k == 0 and s.num_migrating_out == len(moved) for k, s in during)
    after = [(k, s) for k, s, t in router.statuses if t > end]
    assert after and all((s.num_migrating_out, s.num_migrating_in) == (0, 0) for _, s in after)


def test_a_router_without_statuses_costs_no_load_state() -> None:
    class Lite(Router):
        def route(self, request: RouteRequest, now: float) -> int:
            return 0

    sim = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), Lite())
    assert sim.statuses == []


@pytest.mark.parametrize(("name", "full"), [("pilotfish:load-balance", False), ("pilotfish-full:load-balance", True),
                                            ("pilotfish", False), ("pilotfish-full", True)])
def test_lite_and_full_arms_run_through_the_one_adapter(name: str, full: bool) -> None:
    from pilotfish.bench.cluster_policies import resolve_policies

    (spec,), skipped = resolve_policies([name], ENGINE)
    assert not skipped
    router = spec.make(0)
    assert type(router) is SchedulerRouter
    assert router.wants_status is full
    requests = trace(per_group=4)
    sim = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), router,
                     observers=[router.observe_engine])
    result = sim.run(requests)
    assert result.integrity_errors == [] and len(result.records) == len(requests)
    core = router.core
    assert core.account_size == 0  # every dispatch released
    if full:
        # the core holds each engine's last llumlet record, numbered as the cluster heard them
        held = [inst.status for inst in core.instances()]
        assert all(s is not None and s.update_id > 1 for s in held)
    else:
        assert all(inst.status is None for inst in core.instances())
