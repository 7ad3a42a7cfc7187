"""The vLLM adapter's hooks on a stand-in for vLLM's scheduler: every kind of step they take apart
(the steady decode step as a tick, the mixed step in bulk, a visit per request, admissions and
finishes left to the block that follows) keeps the status the requests themselves make, and the
export process reads that same status back. vLLM itself runs in tests/integration/test_llumlet_vllm.py;
this file drives far more step shapes than a real engine shows in a test's time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, counter_values
from pilotfish.vllm_plugin.standin import StandinRequest, adapter_over_standin, hooked


@pytest.fixture(scope="module")
def adapter() -> Iterator[Any]:
    with adapter_over_standin() as module:
        yield module


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), max_seqs=st.integers(1, 12), budget=st.sampled_from([8, 64, 512]))
def test_the_hooks_keep_the_status_the_requests_make(adapter, seed, max_seqs, budget):
    rng = random.Random(seed)
    engine, reader = hooked(adapter, rng, max_seqs, budget)
    exported: dict[str, int] = {}

    def check() -> None:
        """While the model computes a step: the last one ended and this one scheduled, in the
        state and in what the export process reads."""
        nonlocal exported
        state = engine.llumlet.state
        truth = engine.truth()
        assert {name: getattr(state, name) for name in truth} == truth, f"step {engine.steps}"
        if (record := reader.poll()) is not None:
            exported = record.counters
        # KV blocks allocated ride with the next change (LoadState.kv_usage), so may lag here
        now = dict(zip(COUNTER_FIELDS, (int(v) for v in counter_values(state)), strict=True))
        assert {**exported, "used_kv_tokens": 0} == {**now, "used_kv_tokens": 0}
        assert exported["step_id"] == engine.steps

    for i in range(150):
        for _ in range(rng.choice((0, 0, 0, 1, 3))):
            engine.add_request(StandinRequest(f"q{i}-{rng.random()}", rng.randint(1, 60), rng.randint(1, 40)))
        engine.step(check)
    while engine.has_requests():
        engine.step(check)
    # idle: the last step is stored too
    assert engine.llumlet.state.step_id == engine.steps and engine.llumlet.state.num_running == 0


def test_a_recompute_chunk_a_token_short_of_the_end_samples_nothing(adapter):
    """A preempted request recomputing in a chunk that stops one token short of its end counts as a
    decode by its counts, but its step samples no token for it: the update must not move it by
    one with the decodes (the property test with many preemptions found this)."""
    engine, _ = hooked(adapter, random.Random(0), max_seqs=2, budget=2, preempt_p=0.0, skip_p=0.0)
    engine.add_request(StandinRequest("a", 1, 10))
    engine.add_request(StandinRequest("b", 1, 10))
    engine.step()  # both prefill their one token and sample one
    engine._preempt_request(engine.requests["b"], 0.0)  # b: 2 tokens to recompute
    # a decodes (1 token of the budget of 2), b resumes with the other: computed 1 of its 2 tokens
    engine.step()
    b = engine.requests["b"]
    assert (b.num_computed_tokens, b.num_output_tokens) == (1, 1)  # no token sampled for b
    state = engine.llumlet.state
    while engine.has_requests():
        truth = engine.truth()
        assert {name: getattr(state, name) for name in truth} == truth, f"step {engine.steps}"
        engine.step()
    assert state.num_running == 0 and state.running_decode_seq_len_sum == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), max_seqs=st.integers(1, 12), budget=st.sampled_from([8, 64, 512]))
def test_hooks_that_sat_steps_out_are_brought_to_the_requests_by_resync(adapter, seed, max_seqs, budget):
    """bench llumlet parks the llumlet for blocks of steps (hooks off) to time steps with and
    without it in one engine; resync must leave the status the requests make, whatever the
    parked steps did (admissions, finishes, preemptions), and the export process read it."""
    rng = random.Random(seed)
    # preempting often, so parked steps leave some preempted requests waiting
    engine, reader = hooked(adapter, rng, max_seqs, budget, preempt_p=0.3)
    llumlet = engine.llumlet
    checked = 0

    def check() -> None:
        nonlocal checked
        if engine.llumlet is None:
            return  # parked: nothing to hold it to
        truth = engine.truth()
        assert {name: getattr(llumlet.state, name) for name in truth} == truth, f"step {engine.steps}"
        record = reader.poll()
        if record is not None:
            exported = {name: record.counters[name] for name in truth}
            assert exported == truth
        checked += 1

    for i in range(200):
        for _ in range(rng.choice((0, 0, 1, 3))):
            engine.add_request(StandinRequest(f"q{i}-{rng.random()}", rng.randint(1, 60), rng.randint(1, 40)))
        if rng.random() < 0.25:  # switched where the probe switches: before a step's schedule
            if engine.llumlet is None:
                engine.llumlet = llumlet
                engine.resync()
            else:
                engine.llumlet = None
        engine.step(check)
    engine.llumlet = llumlet
    engine.resync()
    while engine.has_requests():
        engine.step(check)
    assert checked and llumlet.state.num_running == 0 and not llumlet.state.requests


def test_steady_decode_steps_go_as_ticks_and_finishes_as_full_records(adapter):
    engine, reader = hooked(adapter, random.Random(1), max_seqs=4, budget=512)
    for i in range(4):
        engine.add_request(StandinRequest(f"r{i}", 20, 10 + i))
    handoff = engine.llumlet.export_process.handoff
    full: list[bool] = []

    def dispatched() -> None:
        record = reader.poll()
        assert record is not None and record.counters["step_id"] == engine.steps
        if full and not full[-1]:  # after a steady step: its tick carried the blocks in use at its end
            assert record.counters["used_kv_tokens"] == engine.used_at_step_end

    while engine.has_requests():
        seq = handoff._seq
        engine.step(dispatched)
        full.append(handoff._seq != seq)
    # admission and prefill (the schedule hook's record and the step's), then ticks, and a full
    # record for each step where a request finished (the stand-in leaves some out at random)
    assert full[0] and not all(full[1:9]) and sum(full) >= 1 + 4


def test_a_request_admitted_to_a_full_batch_is_stored_when_vllm_schedules(adapter):
    """It joins no batch, but its schedule hook enters it and stores it, a step before the step ends."""
    engine, reader = hooked(adapter, random.Random(3), max_seqs=1, budget=512)
    engine.add_request(StandinRequest("busy", 20, 30))
    for _ in range(3):
        engine.step()
    first = reader.poll()
    assert first is not None and reader.ids_until(first.ring_end) == ["busy"]
    engine.add_request(StandinRequest("queued", 20, 5))
    engine.schedule()  # the batch is full: it waits
    record = reader.poll()
    assert record is not None and (record.counters["num_waiting"], record.counters["num_running"]) == (1, 1)
    assert reader.ids_until(record.ring_end) == ["queued"]
