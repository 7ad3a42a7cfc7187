"""Seeded workload families (simulator/traces/families.py): deterministic, and the shape each promises."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.simulator.traces.families import (
    FAMILIES,
    bursty_arrivals,
    bursty_trace,
    family_trace,
    heavy_tail_trace,
    long_and_short_trace,
    long_output_trace,
    multi_turn_trace,
    rag_trace,
    system_prompt_trace,
    tenants_trace,
)
from pilotfish.simulator.traces.prompts import prompt_token_ids

SMALL = {
    "system-prompt": {"requests": 60},
    "multi-turn": {"conversations": 12},
    "tenants": {"requests": 60, "tenants": 4},
    "rag": {"requests": 60},
    "heavy-tail": {"requests": 60},
    "bursty": {"requests": 60},
    "long-and-short": {"requests": 60, "long_share": 0.3},
    "long-output": {"requests": 60},
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_same_seed_same_trace_other_seed_other_trace(name: str) -> None:
    make = FAMILIES[name]
    assert make(seed=3, **SMALL[name]) == make(seed=3, **SMALL[name])
    assert make(seed=3, **SMALL[name]) != make(seed=4, **SMALL[name])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_trace_is_well_formed(name: str) -> None:
    trace = FAMILIES[name](**SMALL[name])
    assert trace
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len({r.request_id for r in trace}) == len(trace)
    for r in trace:  # TraceRequest checks lengths against segments itself
        assert r.output_length >= 1 and all(n > 0 for _, n in r.segments)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), system=st.integers(1, 2048), n=st.integers(1, 50))
def test_system_prompt_every_request_shares_the_first_block_then_diverges(seed: int, system: int, n: int) -> None:
    trace = system_prompt_trace(requests=n, system=system, seed=seed)
    assert len(trace) == n
    assert len({r.segments[0] for r in trace}) == 1 and trace[0].segments[0][1] == system
    assert len({r.segments[1][0] for r in trace}) == n  # each turn its own
    assert all(32 <= r.segments[1][1] <= 512 for r in trace)


def test_system_prompt_shares_exactly_the_system_prompt_tokens() -> None:
    a, b = system_prompt_trace(requests=2, system=100, turn=50)
    ids_a, ids_b = prompt_token_ids(a), prompt_token_ids(b)
    assert ids_a[:100] == ids_b[:100] and ids_a[100:] != ids_b[100:]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shared=st.booleans())
def test_multi_turn_prompts_grow_turn_by_turn(seed: int, shared: bool) -> None:
    trace = multi_turn_trace(conversations=6, turns=(1, 5), shared_system=shared, seed=seed)
    by_conversation: dict[str, list] = {}
    for r in trace:
        conversation, turn = r.request_id.rsplit("-", 2)[1:]
        by_conversation.setdefault(conversation, []).append((int(turn), r))
    assert len(by_conversation) == 6
    systems = set()
    for turns in by_conversation.values():
        turns.sort(key=lambda t: t[0])
        assert [t for t, _ in turns] == list(range(len(turns)))
        systems.add(turns[0][1].segments[0])
        for (_, prev), (_, nxt) in itertools.pairwise(turns):
            # the next prompt is the previous one, its answer, and a new user message
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert len(nxt.segments) == len(prev.segments) + 2
            assert nxt.segments[len(prev.segments)][1] == prev.output_length
            assert nxt.arrival >= prev.arrival
    assert (len(systems) == 1) == shared or len(by_conversation) == 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), tenants=st.integers(1, 6))
def test_tenants_each_have_their_own_system_prompt(seed: int, tenants: int) -> None:
    trace = tenants_trace(requests=300, tenants=tenants, seed=seed)
    systems = {r.segments[0][0]: r.segments[0][1] for r in trace}
    assert 1 <= len(systems) <= tenants
    assert all(256 <= n <= 2048 for n in systems.values())
    assert len({r.segments[1][0] for r in trace}) == len(trace)


def test_tenant_skew_makes_the_first_tenant_the_hottest() -> None:
    trace = tenants_trace(requests=2000, tenants=8, skew=1.0, seed=1)
    counts: dict[str, int] = {}
    for r in trace:
        counts[r.segments[0][0]] = counts.get(r.segments[0][0], 0) + 1
    ranked = sorted(counts, key=counts.__getitem__, reverse=True)
    assert ranked[0].endswith(":sys:0") and counts[ranked[0]] > 2 * counts[ranked[-1]]
    uniform = tenants_trace(requests=2000, tenants=8, skew=0.0, seed=1)
    flat: dict[str, int] = {}
    for r in uniform:
        flat[r.segments[0][0]] = flat.get(r.segments[0][0], 0) + 1
    assert max(flat.values()) < 1.5 * min(flat.values())


def test_rate_sets_the_arrival_rate() -> None:
    trace = system_prompt_trace(requests=4000, rate=50.0, seed=2)
    assert 4000 / trace[-1].arrival == pytest.approx(50.0, rel=0.1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), instruction=st.integers(0, 256))
def test_rag_prompts_are_long_and_share_only_the_instruction(seed: int, instruction: int) -> None:
    trace = rag_trace(requests=40, instruction=instruction, seed=seed)
    assert all(2048 + 16 <= r.input_length - instruction <= 8192 + 128 for r in trace)
    if instruction:
        assert {r.segments[0] for r in trace} == {trace[0].segments[0]} and trace[0].segments[0][1] == instruction
    own = [r.segments[1:] if instruction else r.segments for r in trace]
    assert len({segs[0][0] for segs in own}) == len(trace)  # the context is each request's own


def test_heavy_tail_outputs_follow_the_pareto_law() -> None:
    trace = heavy_tail_trace(requests=20_000, output_min=16, output_max=4096, alpha=1.2, seed=3)
    outputs = sorted(r.output_length for r in trace)
    assert outputs[0] >= 16 and outputs[-1] == 4096  # cut at output_max, and the tail reaches it
    median = outputs[len(outputs) // 2]
    assert median == pytest.approx(16 * 2 ** (1 / 1.2), abs=2)  # Pareto median: scale x 2^(1/alpha)
    tail = sum(1 for o in outputs if o >= 16 * 30) / len(outputs)
    assert tail == pytest.approx(30**-1.2, rel=0.15)  # P(X >= 30 x scale) = 30^-alpha
    with pytest.raises(ValueError, match="alpha"):
        heavy_tail_trace(requests=1, alpha=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_long_and_short_mixes_long_unshared_documents_into_short_turns(seed: int, share: float) -> None:
    trace = long_and_short_trace(requests=400, long_share=share, seed=seed)
    long = [r for r in trace if len(r.segments) == 1]
    short = [r for r in trace if len(r.segments) == 2]
    assert len(long) + len(short) == 400
    assert all(16_000 <= r.input_length <= 32_000 for r in long)
    assert len({r.segments[0][0] for r in long}) == len(long)  # each document its own
    assert len({r.segments[0] for r in short}) <= 1 and all(64 <= r.segments[1][1] <= 512 for r in short)
    if share in (0.0, 1.0):
        assert len(long) == 400 * share
    else:  # each request long with probability `share`: within 5 standard deviations
        assert abs(len(long) - 400 * share) <= 5 * (400 * share * (1 - share)) ** 0.5
    with pytest.raises(ValueError, match="long_share"):
        long_and_short_trace(requests=1, long_share=1.5)


def test_long_output_answers_are_log_uniform_between_the_bounds() -> None:
    trace = long_output_trace(requests=20_000, output_min=1000, output_max=8000, seed=2)
    outputs = [r.output_length for r in trace]
    assert min(outputs) >= 1000 and max(outputs) <= 8000
    # log-uniform: each doubling of the length holds a third of the answers
    for low in (1000, 2000, 4000):
        share = sum(1 for o in outputs if low <= o < 2 * low) / len(outputs)
        assert share == pytest.approx(1 / 3, abs=0.02)
    assert len({r.segments[0] for r in trace}) == 1 and all(100 <= r.segments[1][1] <= 1000 for r in trace)
    with pytest.raises(ValueError, match="output_min"):
        long_output_trace(requests=1, output_min=0)


@pytest.mark.parametrize(("burst", "duty"), [(4.0, 0.2), (2.0, 0.25), (1.0, 0.5)])
def test_bursty_arrivals_keep_the_mean_and_crowd_the_bursts(burst: float, duty: float) -> None:
    arrivals = bursty_arrivals(20_000, 50.0, burst, 10.0, duty, seed=1)
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len(arrivals) / arrivals[-1] == pytest.approx(50.0, rel=0.05)
    in_burst = sum(1 for t in arrivals if t % 10.0 < duty * 10.0) / len(arrivals)
    assert in_burst == pytest.approx(burst * duty, abs=0.02)  # the bursts carry burst x duty of the requests


def test_bursty_trace_is_the_system_prompt_shape_with_other_arrivals() -> None:
    trace = bursty_trace(requests=200, seed=5)
    assert len({r.segments[0] for r in trace}) == 1 and len({r.segments[1][0] for r in trace}) == 200
    with pytest.raises(ValueError, match="burst x duty"):
        bursty_trace(requests=10, burst=4.0, duty=0.5)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (
            "system-prompt:requests=5,system=64,turn=10-20",
            lambda t: len(t) == 5 and t[0].segments[0][1] == 64 and all(10 <= r.segments[1][1] <= 20 for r in t),
        ),
        (
            "multi-turn:conversations=3,turns=2,shared_system=false",
            lambda t: len(t) == 6 and len({r.segments[0] for r in t}) == 3,
        ),
        ("tenants:requests=7,tenants=2,rate=2.5", lambda t: len(t) == 7),
        ("system-prompt:requests=3,seed=9", lambda t: t == system_prompt_trace(requests=3, seed=9)),
        ("rag:requests=4,context=100-200,instruction=0", lambda t: all(117 <= r.input_length <= 328 for r in t)),
        ("heavy-tail:requests=50,output_min=8,output_max=64,alpha=2.5",
         lambda t: all(8 <= r.output_length <= 64 for r in t)),
        ("bursty:requests=9,burst=2.0,period=5.0,duty=0.3", lambda t: len(t) == 9),
        ("long-and-short:requests=20,long_share=1.0,long=100-200",
         lambda t: all(100 <= r.input_length <= 200 for r in t)),
        ("long-output:requests=20,output_min=5,output_max=9", lambda t: all(5 <= r.output_length <= 9 for r in t)),
    ],
)
def test_family_trace_parses_knobs(spec: str, check) -> None:
    assert check(family_trace(spec, seed=0))


def test_family_trace_seed_applies_unless_the_spec_sets_one() -> None:
    assert family_trace("tenants:requests=5", seed=4) == tenants_trace(requests=5, seed=4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown workload family"),
        ("tenants:bogus=1", "not knob=value"),
        ("tenants:requests", "not knob"),
        ("multi-turn:shared_system=maybe", "not a boolean"),
        ("tenants:turn=a-b", "turn="),
    ],
)
def test_family_trace_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        family_trace(spec)


def test_bench_cluster_reads_a_family() -> None:
    from pilotfish.bench.cluster import load_trace

    trace, label = load_trace("family:system-prompt:requests=5", None, 7)
    assert trace == system_prompt_trace(requests=5, seed=7) and label == "family:system-prompt:requests=5"
    with pytest.raises(SystemExit, match="unknown workload family"):
        load_trace("family:nope", None, 0)
