"""Migration in the virtual-time cluster: tokens complete and unduplicated, KV blocks exact on both
engines, a KV transfer costs exactly its modelled time, and an unschedulable mark reaches the router."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.simulator.cluster import (
    KV_TRANSFER,
    RECOMPUTE,
    ClusterConfig,
    ClusterSim,
    FixedRouter,
    MigrationOrder,
    Router,
    RouteRequest,
)
from pilotfish.simulator.cluster.migration import candidates
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.traces import SharedPrefixSpec, TraceRequest, shared_prefix_trace
from pilotfish.vllm_plugin.core.selection import select_requests

PROFILE = StepTimeProfile(
    name="t", base_ms=2.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.05, context_ms_per_token=0.0005
)
# a slow link (1 Gb/s) so a transfer lasts many steps: 131072 B/token -> ~1.05 ms per token
ENGINE = EngineConfig(
    block_size=4,
    num_gpu_blocks=160,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    max_model_len=512,
    migration_bandwidth_gbps=1.0,
)


class TokenLog(EngineObserver):
    """Every token an engine samples: (request, output index, engine, time), across all engines."""

    def __init__(self, log: list[tuple[str, int, int, float]], engine: int) -> None:
        self.log = log
        self.engine = engine

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        self.log.append((request.request_id, request.num_output_tokens - 1, self.engine, now))


def attach_log(log: list[tuple[str, int, int, float]]) -> Any:
    def attach(i: int, core: V1Engine) -> None:
        core.add_observer(TokenLog(log, i))

    return attach


class ToEngine(Router):
    """Everything to one engine: the imbalance a rescheduler has to undo."""

    def __init__(self, k: int = 0) -> None:
        self.k = k

    def route(self, request: RouteRequest, now: float) -> int:
        return self.k


def check_blocks(sim: ClusterSim) -> None:
    """Every engine's pool agrees with who holds what: ref counts are the holders, nobody else holds."""
    moving = {e.request_id: e for e in sim.transfers()}
    for k, core in enumerate(sim.cores):
        holders: dict[int, int] = defaultdict(int)
        for rid, blocks in core.kv.req_blocks.items():
            on_its_way = rid in moving and k in (moving[rid].source, moving[rid].destination)
            assert rid in core.requests or on_its_way, f"engine {k} holds blocks of {rid}, which is not there"
            for b in blocks:
                holders[b.block_id] += 1
        for block_id, n in holders.items():
            assert core.kv.pool.block(block_id).ref_cnt == n
        assert core.kv.pool.num_used == len(holders)


class Shuffler:
    """A test rescheduler: each tick moves a few requests between random engines, checking blocks first."""

    def __init__(self, seed: int, methods: tuple[str, ...]) -> None:
        self.rng = random.Random(seed)
        self.methods = methods
        self.ticks = 0

    def __call__(self, sim: ClusterSim, now: float) -> list[MigrationOrder]:
        check_blocks(sim)
        self.ticks += 1
        n = len(sim.cores)
        orders = []
        for _ in range(self.rng.randint(0, 2)):
            src, dst = self.rng.sample(range(n), 2)
            order = self.rng.choice(["LCR", "FCR", "LR", "SR", "FCW", "FCWSR"])
            ids = select_requests(candidates(sim.cores[src]), "NUM_REQ", order, self.rng.randint(1, 3))
            orders.append(MigrationOrder(src, dst, tuple(ids), self.rng.choice(self.methods), "test"))
        return orders


def trace(seed: int = 1, groups: int = 3, per_group: int = 6, rate: float = 200.0) -> list[TraceRequest]:
    return shared_prefix_trace(
        SharedPrefixSpec(
            groups=groups,
            prompts_per_group=per_group,
            system_prompt_length=(24, 60),
            question_length=(4, 20),
            output_length=(8, 40),
            rate=rate,
            seed=seed,
        )
    )


def run_shuffled(seed: int, methods: tuple[str, ...], interval: float = 0.004) -> tuple[Any, ClusterSim, list]:
    log: list[tuple[str, int, int, float]] = []
    config = ClusterConfig(engines=3, engine=ENGINE, profile=PROFILE, rescheduling_interval=interval)
    sim = ClusterSim(config, ToEngine(0), observers=[attach_log(log)], rescheduler=Shuffler(seed, methods))
    return sim.run(trace(seed)), sim, log


def assert_tokens_exact(result: Any, requests: list[TraceRequest], log: list[tuple[str, int, int, float]]) -> None:
    by_request: dict[str, list[int]] = defaultdict(list)
    for rid, index, _, _ in log:
        by_request[rid].append(index)
    for req in requests:
        # in order, each once, all of them: the log is in time order across engines
        assert by_request[req.request_id] == list(range(req.output_length)), req.request_id
    assert result.integrity_errors == []
    for rec in result.records:
        assert rec.finish_reason == "length" and rec.num_output_tokens == rec.output_length


def assert_no_leaks(sim: ClusterSim) -> None:
    assert sim.transfers() == []
    for core in sim.cores:
        assert not core.requests and not core.running and not core.waiting
        assert core.kv.req_blocks == {} and core.kv.pool.num_used == 0


@pytest.mark.parametrize("methods", [(RECOMPUTE,), (KV_TRANSFER,), (RECOMPUTE, KV_TRANSFER)])
def test_migration_keeps_every_token_once_and_every_block_exact(methods: tuple[str, ...]) -> None:
    requests = trace(7)
    result, sim, log = run_shuffled(7, methods)
    assert_tokens_exact(result, requests, log)
    assert_no_leaks(sim)
    assert result.migrations and sum(r.migrations for r in result.records) == len(result.migrations)
    assert {e.requested for e in result.migrations} == set(methods)
    assert result.summary()["migrations"] == len(result.migrations)
    if KV_TRANSFER in methods:
        assert any(e.method == KV_TRANSFER and e.tokens > 0 for e in result.migrations)
    # requests left engine 0, which got every arrival
    assert {r.engine for r in result.records} - {0}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), interval=st.sampled_from([0.002, 0.005, 0.013]))
def test_any_migration_schedule_conserves_tokens_and_blocks(seed: int, interval: float) -> None:
    requests = trace(seed)
    result, sim, log = run_shuffled(seed, (RECOMPUTE, KV_TRANSFER), interval)
    assert_tokens_exact(result, requests, log)
    assert_no_leaks(sim)


def test_kv_transfer_delays_the_request_by_the_modelled_transfer_time() -> None:
    req = trace(seed=3, groups=1, per_group=1)[0]
    log: list[tuple[str, int, int, float]] = []
    config = ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE)
    sim = ClusterSim(config, FixedRouter({req.request_id: 0}), observers=[attach_log(log)])
    seen: dict[str, Any] = {}

    def move() -> None:
        r = sim.cores[0].requests[req.request_id]
        seen["computed"], seen["tokens"] = r.num_computed_tokens, r.num_output_tokens
        seen["source_blocks"] = sim.cores[0].kv.pool.num_used
        seen["event"] = sim.migrate(0, 1, [req.request_id], KV_TRANSFER)[0]
        seen["during"] = (sim.cores[0].kv.pool.num_used, sim.cores[1].kv.pool.num_used)

    move_at = 0.030
    sim.at(move_at, move)
    result = sim.run([req])
    event = seen["event"]
    n = seen["computed"]
    assert 0 < seen["tokens"] < req.output_length and n == req.input_length + seen["tokens"] - 1
    assert event.method == KV_TRANSFER and event.tokens == n and event.time == move_at
    assert event.arrives == pytest.approx(move_at + n * ENGINE.kv_bytes_per_token * 8 / 1e9, abs=1e-12)
    assert event.arrives == move_at + ENGINE.kv_transfer_seconds(n)
    # both engines hold its KV while it moves: the source is read, the destination written
    assert seen["during"] == (seen["source_blocks"], -(-n // ENGINE.block_size))
    times = [(i, e, t) for rid, i, e, t in log]
    after = [(i, e, t) for i, e, t in times if t > move_at]
    # nothing produced in transit; the next token is one decode step after arrival, on engine 1
    assert after[0][2] > event.arrives
    first_index, engine, t = after[0]
    assert (first_index, engine) == (seen["tokens"], 1)
    assert t == pytest.approx(event.arrives + PROFILE.step_seconds(0, 1, n + 1), abs=1e-12)
    assert [i for i, _, _ in times] == list(range(req.output_length))
    assert result.records[0].migrations == 1 and result.records[0].engine == 1
    assert result.integrity_errors == []
    assert_no_leaks(sim)


def test_recompute_moves_at_once_and_prefills_prompt_and_output_again() -> None:
    req = trace(seed=3, groups=1, per_group=1)[0]
    log: list[tuple[str, int, int, float]] = []
    sim = ClusterSim(
        ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE),
        FixedRouter({req.request_id: 0}),
        observers=[attach_log(log)],
    )
    seen: dict[str, Any] = {}

    def move() -> None:
        seen["tokens"] = sim.cores[0].requests[req.request_id].num_output_tokens
        seen["event"] = sim.migrate(0, 1, [req.request_id], RECOMPUTE)[0]
        seen["source_used"] = sim.cores[0].kv.pool.num_used
        seen["waiting"] = [r.request_id for r in sim.cores[1].waiting]

    sim.at(0.030, move)
    result = sim.run([req])
    event = seen["event"]
    assert event.method == RECOMPUTE and event.tokens == 0 and event.arrives == event.time == 0.030
    assert seen["source_used"] == 0 and seen["waiting"] == [req.request_id]
    after = [(i, e, t) for _, i, e, t in log if t > 0.030]
    assert after[0][:2] == (seen["tokens"], 1)
    # engine 1 computes prompt + output again (its cache is cold): more than one decode step
    assert after[0][2] - 0.030 > PROFILE.step_seconds(0, 1, req.input_length + seen["tokens"])
    assert result.integrity_errors == [] and result.records[0].num_output_tokens == req.output_length
    assert_no_leaks(sim)


def test_kv_transfer_without_room_on_the_destination_falls_back_to_recompute() -> None:
    small = EngineConfig(
        block_size=4,
        num_gpu_blocks=160,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        max_model_len=512,
        migration_bandwidth_gbps=1.0,
    )
    reqs = trace(seed=4, groups=1, per_group=3, rate=1000.0)
    decisions = {reqs[0].request_id: 0, reqs[1].request_id: 1, reqs[2].request_id: 1}
    sim = ClusterSim(ClusterConfig(engines=2, engine=small, profile=PROFILE), FixedRouter(decisions))
    seen: dict[str, Any] = {}

    def move() -> None:
        assert len(sim.cores[1].running) == 2  # no seat left on the destination
        seen["event"] = sim.migrate(0, 1, [reqs[0].request_id], KV_TRANSFER)[0]

    sim.at(0.02, move)
    result = sim.run(reqs)
    assert seen["event"].requested == KV_TRANSFER and seen["event"].method == RECOMPUTE
    assert result.integrity_errors == []
    assert_no_leaks(sim)


class StatusSpy(Router):
    wants_status = True

    def __init__(self) -> None:
        self.schedulable: list[tuple[int, bool, float]] = []
        self.marks: list[tuple[int, bool]] = []

    def route(self, request: RouteRequest, now: float) -> int:
        return 0

    def on_status(self, engine: int, status: Any, now: float) -> None:
        self.schedulable.append((engine, status.schedulable, now))

    def set_schedulable(self, engine: int, schedulable: bool) -> None:
        self.marks.append((engine, schedulable))


def test_an_unschedulable_mark_reaches_the_router_in_the_next_statuses() -> None:
    reqs = trace(seed=5, groups=1, per_group=4, rate=50.0)
    spy = StatusSpy()
    sim = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE, observation_delay=0.01), spy)
    sim.at(0.02, lambda: sim.set_schedulable(1, False))
    sim.run(reqs)
    assert spy.marks == [(1, False)]
    engine1 = [(ok, t) for k, ok, t in spy.schedulable if k == 1]
    # its first status as an idle engine at the start (heard at once), then the one written at the
    # mark, heard 10 ms later
    assert engine1 == [(True, 0.0), (False, pytest.approx(0.03))]
    assert all(ok for k, ok, _ in spy.schedulable if k == 0)
