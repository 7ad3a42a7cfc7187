"""The simulated engine's side of migration: detach and resume keep KV blocks and tokens exact."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.request import RequestStatus, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.llumlet_adapter import attach_llumlet
from pilotfish.simulator.tokens import generated_token_id
from pilotfish.vllm_plugin.config import LlumletConfig

PROFILE = StepTimeProfile(name="t", base_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.1,
                          context_ms_per_token=0.001)  # fmt: skip


def engine_for(num_blocks: int = 64, prefix_caching: bool = True) -> V1Engine:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                       num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching)  # fmt: skip
    return V1Engine(cfg, PROFILE)


def assert_blocks_exact(engine: V1Engine) -> None:
    """Every used block is held by a request in the engine, and nothing else holds one."""
    held = {id(b) for blocks in engine.kv.req_blocks.values() for b in blocks}
    assert engine.kv.pool.num_used == len(held)
    assert set(engine.kv.req_blocks) <= set(engine.requests)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), num_requests=st.integers(1, 25), num_blocks=st.integers(70, 160),
       prefix_caching=st.booleans())  # fmt: skip
def test_detach_and_resume_conserve_blocks_and_tokens(seed, num_requests, num_blocks, prefix_caching):
    rng = random.Random(seed)
    engine = engine_for(num_blocks, prefix_caching)
    llumlet = attach_llumlet(engine, engine.config, LlumletConfig(cms_url="redis://127.0.0.1:1/0"), "sim-0",
                             "127.0.0.1", 8000, start=False)  # fmt: skip
    shared = [rng.randrange(50) for _ in range(24)]
    pending = [
        SimRequest(f"r{i}", shared[: rng.randrange(0, 24)] + [rng.randrange(50) for _ in range(rng.randrange(1, 50))],
                   max_tokens=rng.randrange(1, 40))
        for i in range(num_requests)
    ]  # fmt: skip
    everyone = list(pending)
    away: list[SimRequest] = []  # detached, as if computed elsewhere for a while
    now, steps = 0.0, 0
    while (pending or away or engine.has_unfinished_requests()) and steps < 5000:
        if pending and rng.random() < 0.5:
            engine.add_request(pending.pop(), now)
        if engine.requests and rng.random() < 0.1:
            request = engine.detach_request(rng.choice(list(engine.requests)), now)
            assert request is not None and request.status is RequestStatus.MIGRATED
            # another engine may have produced some tokens meanwhile (relayed: the same ids)
            for _ in range(rng.randrange(0, 3)):
                if request.length_limit_reached(engine.config.max_model_len) is None:
                    request.output_token_ids.append(generated_token_id(request.num_output_tokens))
            away.append(request)
        if away and rng.random() < 0.2:
            request = away.pop(rng.randrange(len(away)))
            if request.length_limit_reached(engine.config.max_model_len) is None:
                if rng.random() < 0.5:  # migrated back by KV transfer
                    request.num_external_computed_tokens = request.num_tokens - 1
                engine.resume_request(request, now)
        assert_blocks_exact(engine)
        now += max(engine.step(now).duration, 0.001)
        assert_blocks_exact(engine)
        steps += 1
    assert not engine.requests and engine.kv.pool.num_used == 0 and engine.kv.req_blocks == {}
    for request in everyone:
        n = request.num_output_tokens
        assert request.output_token_ids == [generated_token_id(i) for i in range(n)], request.request_id
        assert n == request.max_tokens or request.num_tokens >= engine.config.max_model_len
    # the llumlet saw every request leave, detached ones included
    status = llumlet.status_now()
    assert llumlet.state.requests == {}
    assert (status.num_waiting, status.num_running, status.used_kv_tokens) == (0, 0, 0)


def test_detach_during_a_step_in_flight_produces_nothing_for_it():
    engine = engine_for()
    engine.add_request(SimRequest("a", list(range(10)), max_tokens=5), 0.0)
    engine.add_request(SimRequest("b", list(range(20, 30)), max_tokens=5), 0.0)
    plan = engine.begin_step(0.0)
    assert engine.kv.num_blocks_held("a") > 0
    detached = engine.detach_request("a", 0.0)
    assert detached is not None and engine.kv.num_blocks_held("a") == 0
    outputs = engine.end_step(plan)
    assert [o.request_id for o in outputs] == ["b"]
    assert detached.num_output_tokens == 0
    assert engine.detach_request("a", 0.0) is None  # already gone
    assert_blocks_exact(engine)


def test_detached_request_records_no_finish():
    engine = engine_for()
    engine.add_request(SimRequest("a", list(range(10)), max_tokens=5), 0.0)
    engine.step(0.0)
    engine.detach_request("a", 1.0)
    assert engine.stats().finished_total == {} and engine.stats().num_running == 0


def test_kv_transfer_resumes_straight_into_decode():
    engine = engine_for(prefix_caching=False)
    request = SimRequest("m", list(range(30)), max_tokens=20)
    request.output_token_ids = [generated_token_id(i) for i in range(5)]
    request.num_external_computed_tokens = request.num_tokens - 1
    engine.resume_request(request, 0.0)
    result = engine.step(0.0)
    assert (result.num_prefill_tokens, result.num_decode_requests) == (0, 1)
    assert [(o.index, o.token_id) for o in result.outputs] == [(5, generated_token_id(5))]
    assert engine.kv.num_blocks_held("m") == -(-36 // 4)  # every token's KV now has a block
    assert request.num_external_computed_tokens == 0


def test_recompute_resume_prefills_prompt_and_output():
    engine = engine_for(prefix_caching=False)
    request = SimRequest("m", list(range(30)), max_tokens=20)
    request.output_token_ids = [generated_token_id(i) for i in range(5)]
    engine.resume_request(request, 0.0)
    result = engine.step(0.0)
    assert result.num_prefill_tokens == 35
    assert [(o.index, o.token_id) for o in result.outputs] == [(5, generated_token_id(5))]


def test_resume_refuses_a_request_at_its_limit():
    engine = engine_for()
    request = SimRequest("m", list(range(30)), max_tokens=2)
    request.output_token_ids = [generated_token_id(0), generated_token_id(1)]
    try:
        engine.resume_request(request, 0.0)
    except ValueError as exc:
        assert "length limit" in str(exc)
    else:
        raise AssertionError("resume_request took a finished request")
    assert not engine.requests
