"""The engine model: V1 scheduling, the paged KV cache with prefix caching, step time, events."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pilotfish.config import ConfigError
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.block_hash import block_hashes
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, RequestStatus, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile, load_profile, profile_names
from pilotfish.simulator.virtual import VirtualEngine

PROFILE = StepTimeProfile(name="test", base_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.1,
                          context_ms_per_token=0.001)


class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []
        self.prefill: Counter[str] = Counter()
        self.hits: dict[str, list[int]] = defaultdict(list)
        self.tokens: Counter[str] = Counter()

    def request_added(self, request: SimRequest, now: float) -> None:
        self.events.append(("added", request.request_id, None))

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        self.events.append(("scheduled", request.request_id, None))

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.hits[request.request_id].append(num_tokens)

    def blocks_allocated(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        self.events.append(("allocated", request.request_id, len(block_ids)))

    def blocks_freed(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        self.events.append(("freed", request.request_id, len(block_ids)))

    def prefill_chunk(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.prefill[request.request_id] += num_tokens
        self.events.append(("prefill", request.request_id, num_tokens))

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        self.tokens[request.request_id] += 1

    def preempted(self, request: SimRequest, now: float) -> None:
        self.events.append(("preempted", request.request_id, None))

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        self.events.append(("finished", request.request_id, reason.value))


def engine(**overrides: Any) -> tuple[V1Engine, Recorder]:
    settings_ = {"block_size": 4, "num_gpu_blocks": 64, "max_num_batched_tokens": 32, "max_num_seqs": 8,
                 "max_model_len": 256, **overrides}
    recorder = Recorder()
    return V1Engine(EngineConfig(**settings_), PROFILE, [recorder]), recorder


def req(rid: str, prompt: int | list[int], max_tokens: int = 4) -> SimRequest:
    ids = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return SimRequest(rid, ids, max_tokens)


def run_all(core: V1Engine, limit: int = 10_000) -> list[Any]:
    results = []
    now = 0.0
    for _ in range(limit):
        if not core.has_unfinished_requests():
            return results
        result = core.step(now)
        now += result.duration
        results.append(result)
    raise AssertionError("engine did not drain")


# ---- scheduling -------------------------------------------------------------------------------


def test_chunked_prefill_spends_the_token_budget_then_decodes() -> None:
    core, rec = engine(max_num_batched_tokens=32)
    core.add_request(req("a", 100, max_tokens=3), 0.0)
    results = run_all(core)
    assert [r.num_prefill_tokens for r in results] == [32, 32, 32, 4, 0, 0]
    assert [r.num_decode_requests for r in results] == [0, 0, 0, 0, 1, 1]
    assert [len(r.outputs) for r in results] == [0, 0, 0, 1, 1, 1]  # the first token ends the prefill
    assert results[-1].outputs[0].finish_reason is FinishReason.LENGTH
    assert rec.prefill["a"] == 100


def test_a_shared_cpu_frontend_lengthens_the_busy_engines_next_step() -> None:
    shared = StepTimeProfile(name="shared", base_ms=2.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0,
                             api_overhead_ms=5.0, shared_cpu=True)  # fmt: skip
    core = V1Engine(EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=256), shared)
    core.add_request(req("a", 8, max_tokens=4), 0.0)  # to an idle engine: the frontend used idle CPU
    assert core.step(0.0).duration == pytest.approx(0.002)
    core.add_request(req("b", 8, max_tokens=4), 0.002)  # to a busy one: its step pays the 5 ms
    core.add_request(req("c", 8, max_tokens=4), 0.002)
    assert core.step(0.002).duration == pytest.approx(0.002 + 2 * 0.005)
    assert core.step(0.014).duration == pytest.approx(0.002)  # charged once
    alone = V1Engine(EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=256),
                     msgspec.structs.replace(shared, shared_cpu=False))  # fmt: skip
    alone.add_request(req("a", 8), 0.0)
    alone.add_request(req("b", 8), 0.0)
    assert alone.step(0.0).duration == pytest.approx(0.002)


def test_running_decodes_come_before_waiting_prefills() -> None:
    core, _ = engine(max_num_batched_tokens=10)
    core.add_request(req("a", 5, max_tokens=5), 0.0)
    first = core.step(0.0)
    assert first.num_prefill_tokens == 5 and len(first.outputs) == 1
    core.add_request(req("b", 30, max_tokens=1), 0.0)
    second = core.step(1.0)
    # a decodes (1 token), b prefills with the 9 tokens left in the budget
    assert second.num_decode_requests == 1
    assert second.num_prefill_tokens == 9


def test_max_num_seqs_keeps_the_rest_waiting_in_fcfs_order() -> None:
    core, rec = engine(max_num_seqs=2)
    for rid in "abc":
        core.add_request(req(rid, 4, max_tokens=3), 0.0)
    core.step(0.0)
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    run_all(core)
    scheduled = [rid for kind, rid, _ in rec.events if kind == "scheduled"]
    assert scheduled == ["a", "b", "c"]


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens; two requests that each grow to 12 tokens (3 blocks) cannot both fit
    core, rec = engine(num_gpu_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    core.add_request(req("a", 8, max_tokens=8), 0.0)
    core.add_request(req("b", 8, max_tokens=8), 0.0)
    run_all(core)
    preempted = [rid for kind, rid, _ in rec.events if kind == "preempted"]
    assert preempted and set(preempted) == {"b"}  # the later arrival gives way
    assert core.stats().num_preemptions_total == len(preempted)
    assert rec.tokens == {"a": 8, "b": 8}  # recompute loses no token and repeats none
    assert core.kv.pool.num_used == 0


def test_abort_between_begin_and_end_of_a_step_produces_nothing_and_frees_blocks() -> None:
    core, rec = engine()
    core.add_request(req("a", 10), 0.0)
    plan = core.begin_step(0.0)
    assert core.kv.pool.num_used == 3
    assert core.abort_request("a", 0.0005)
    assert core.end_step(plan) == []
    assert core.kv.pool.num_used == 0
    assert ("finished", "a", "abort") in rec.events
    assert not core.abort_request("a", 0.001)


def test_step_time_follows_the_profile() -> None:
    core, _ = engine(max_num_batched_tokens=64)
    core.add_request(req("a", 20, max_tokens=2), 0.0)
    prefill = core.step(0.0)
    assert prefill.duration == pytest.approx((1.0 + 0.01 * 20 + 0.001 * 20) / 1000)
    decode = core.step(prefill.duration)
    assert decode.duration == pytest.approx((1.0 + 0.1 * 1 + 0.001 * 21) / 1000)


def test_length_limits() -> None:
    core, _ = engine(max_model_len=12)
    core.add_request(req("a", 8, max_tokens=100), 0.0)
    stop = req("b", 4, max_tokens=100)
    stop.stop_after = 2
    core.add_request(stop, 0.0)
    results = run_all(core)
    finals = {o.request_id: o for r in results for o in r.outputs if o.finish_reason}
    assert finals["a"].finish_reason is FinishReason.LENGTH and finals["a"].index == 3  # 8 + 4 = 12
    assert finals["b"].finish_reason is FinishReason.STOP and finals["b"].index == 1


# ---- prefix caching ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        (list(range(16)), list(range(16)), 12),  # identical: the last block is recomputed for logits
        (list(range(16)), [*range(16), 99, 98], 16),
        (list(range(16)), [*range(6), 77, *range(7, 16)], 4),  # differs inside block 1
        (list(range(16)), [77, *range(1, 16)], 0),
        (list(range(10)), list(range(10)), 8),
    ],
)
def test_a_cached_prefix_reduces_prefill_by_exactly_the_hit(first: list[int], second: list[int], hit: int) -> None:
    core, rec = engine()
    core.add_request(req("a", first, max_tokens=1), 0.0)
    run_all(core)
    core.add_request(req("b", second, max_tokens=1), 0.0)
    run_all(core)
    assert rec.hits["b"] == [hit]
    assert rec.prefill["b"] == len(second) - hit
    stats = core.stats()
    assert stats.prefix_cache_hits_total == hit
    assert stats.prefix_cache_queries_total == len(first) + len(second)


def test_prefix_caching_off_never_hits() -> None:
    core, rec = engine(enable_prefix_caching=False)
    for rid in "ab":
        core.add_request(req(rid, 16, max_tokens=1), 0.0)
        run_all(core)
    assert rec.hits["b"] == [0] and rec.prefill["b"] == 16


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    core, rec = engine(num_gpu_blocks=8, max_num_batched_tokens=64, max_model_len=32)
    old, new = list(range(100, 116)), list(range(200, 216))
    for rid, prompt in (("old", old), ("new", new)):
        core.add_request(req(rid, prompt, max_tokens=1), 0.0)
        run_all(core)
    # 8 blocks, 4 + 4 cached and free; a 16-token prompt needs 4 fresh ones: "old" goes first
    core.add_request(req("other", list(range(300, 316)), max_tokens=1), 0.0)
    run_all(core)
    for rid, prompt in (("new-again", new), ("old-again", old)):
        core.add_request(req(rid, prompt, max_tokens=1), 0.0)
        run_all(core)
    assert rec.hits["new-again"] == [12]
    assert rec.hits["old-again"] == [0]
    assert core.kv.pool.num_evictions >= 4


def test_block_hashes_are_chained() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1, 2, 3, 4, 5], 4) == a[:1]


def test_block_hashes_are_the_same_in_another_process() -> None:
    # the gateway computes them in its own process and must get the engine's values
    code = "from pilotfish.simulator.engine.block_hash import block_hashes; print(block_hashes(range(40), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == str(block_hashes(range(40), 16))


# ---- config and profiles ----------------------------------------------------------------------


def test_profiles_are_data_files() -> None:
    assert "llama3-8b-a100" in set(profile_names())
    profile = load_profile("llama3-8b-a100")
    assert profile.base_ms > 0 and profile.prefill_ms_per_token > 0
    with pytest.raises(ConfigError):
        load_profile("no-such-profile")


def test_flags_override_the_profile() -> None:
    core = V1Engine(EngineConfig(step_ms=2.0, decode_ms_per_token=0.0))
    assert core.profile.base_ms == 2.0 and core.profile.decode_ms_per_token == 0.0
    assert core.profile.prefill_ms_per_token == load_profile(EngineConfig().profile).prefill_ms_per_token


def test_kv_cache_must_hold_one_longest_request() -> None:
    with pytest.raises(ConfigError):
        V1Engine(EngineConfig(block_size=16, num_gpu_blocks=4, max_model_len=100))


# ---- virtual time -----------------------------------------------------------------------------


def test_virtual_time_driver_runs_steps_back_to_back_from_arrival() -> None:
    core, _ = engine(max_num_batched_tokens=64)
    sim = VirtualEngine(core)
    assert sim.add_request(req("a", 20, max_tokens=3), at=5.0) == []
    outputs = sim.run_until_idle()
    prefill = (1.0 + 0.01 * 20 + 0.001 * 20) / 1000
    assert outputs[0].time == pytest.approx(5.0 + prefill)
    assert [o.output.index for o in outputs] == [0, 1, 2]
    assert outputs[-1].output.finish_reason is FinishReason.LENGTH
    assert sim.busy_until is None


def test_virtual_time_abort_mid_step() -> None:
    core, rec = engine()
    sim = VirtualEngine(core)
    sim.add_request(req("a", 8, max_tokens=50), at=0.0)
    sim.add_request(req("b", 8, max_tokens=2), at=0.0)
    first_end = sim.busy_until
    assert first_end is not None
    first = sim.advance_to(first_end)  # the prefill step: each samples its first token
    assert {o.output.request_id for o in first} == {"a", "b"}
    assert sim.busy_until is not None and sim.busy_until > first_end
    sim.abort_request("a", at=first_end + 1e-6)  # while the second step runs
    rest = sim.run_until_idle()
    assert [(o.output.request_id, o.output.index) for o in rest] == [("b", 1)]
    assert ("finished", "a", "abort") in rec.events
    assert core.kv.pool.num_used == 0


# ---- invariants -------------------------------------------------------------------------------

workload = st.lists(
    st.tuples(
        st.integers(0, 3),  # which shared prefix
        st.integers(0, 30),  # own suffix length
        st.integers(1, 24),  # max_tokens
        st.integers(0, 6),  # steps to wait before adding
        st.booleans(),  # abort it a few steps later
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload, st.integers(6, 30), st.sampled_from([4, 8]), st.integers(8, 64), st.integers(1, 6))
def test_engine_invariants(
    jobs: list[tuple[int, int, int, int, bool]], num_blocks: int, block_size: int, budget: int, seqs: int
) -> None:
    max_model_len = min(num_blocks * block_size, 96)
    core, rec = engine(num_gpu_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                       max_num_seqs=seqs, max_model_len=max_model_len)
    prefixes = [list(range(p * 1000, p * 1000 + 20)) for p in range(4)]
    pending = []
    for i, (prefix, suffix, max_tokens, wait, abort) in enumerate(jobs):
        prompt = (prefixes[prefix] + list(range(50_000 + i * 100, 50_000 + i * 100 + suffix)))[: max_model_len - 1]
        pending.append((wait, SimRequest(f"r{i}", prompt, max_tokens), abort))
    outputs: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, FinishReason] = {}
    to_abort: dict[str, int] = {}
    all_requests = [r for _, r, _ in pending]
    now = 0.0
    for step in range(2000):
        for wait, request, abort in list(pending):
            if wait <= step:
                pending.remove((wait, request, abort))
                core.add_request(request, now)
                if abort:
                    to_abort[request.request_id] = step + 2
        for rid, at in list(to_abort.items()):
            if at <= step:
                del to_abort[rid]
                core.abort_request(rid, now)
        if not core.has_unfinished_requests():
            if not pending:
                break
            continue
        result = core.step(now)
        now += result.duration
        for out in result.outputs:
            outputs[out.request_id].append(out.index)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        check_kv_invariants(core)
    else:
        raise AssertionError("engine did not drain")

    assert core.kv.pool.num_used == 0  # every finished request freed its blocks
    assert core.kv.req_blocks == {}
    for request in all_requests:
        got = outputs[request.request_id]
        assert got == list(range(len(got)))  # no token lost or duplicated
        assert request.status is RequestStatus.FINISHED
        if request.finish_reason is not FinishReason.ABORT:
            expected = min(request.max_tokens, max_model_len - request.num_prompt_tokens)
            assert len(got) == expected
            assert finish[request.request_id] is FinishReason.LENGTH
            if request.num_preemptions == 0:
                # a cached prefix cuts prefill work by exactly the hit
                assert rec.prefill[request.request_id] == request.num_prompt_tokens - request.num_cached_tokens
    stats = core.stats()
    assert stats.generation_tokens_total == sum(len(v) for v in outputs.values())
    event(f"preempted: {stats.num_preemptions_total > 0}")
    event(f"prefix hit: {stats.prefix_cache_hits_total > 0}")
    event(f"aborted: {stats.finished_total.get('abort', 0) > 0}")


def check_kv_invariants(core: V1Engine) -> None:
    pool = core.kv.pool
    assert 0 <= pool.num_used <= pool.num_blocks
    holders: Counter[int] = Counter()
    for blocks in core.kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks)
        holders.update(b.block_id for b in blocks)
    assert sum(1 for _ in holders) == pool.num_used
    for block_id, count in holders.items():
        assert pool.block(block_id).ref_cnt == count
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    for request in core.running:
        held = len(core.kv.req_blocks.get(request.request_id, []))
        assert held * core.config.block_size >= request.num_computed_tokens
    for request in core.waiting:
        assert request.request_id not in core.kv.req_blocks  # preempted requests hold nothing
