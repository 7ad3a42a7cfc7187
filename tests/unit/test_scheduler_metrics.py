"""The twelve scheduling metrics, table-driven: one row per metric and situation, with the formula's value."""

from __future__ import annotations

import pytest

from pilotfish.scheduler.policy.base import Metric
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.registry import METRICS
from pilotfish.scheduler.view.predictor import StepTimeModel
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables
from pilotfish.scheduler.view.types import (
    Endpoint,
    EngineStatus,
    InferType,
    InflightLoad,
    InstanceView,
    LrsLoad,
    RequestInfo,
)

SPEC_METRICS = [
    "kv_cache_usage_ratio_projected",
    "decode_batch_size",
    "num_waiting_requests",
    "all_prefills_tokens_num",
    "kv_cache_hit_len",
    "cache_aware_all_prefills_tokens_num",
    "num_requests",
    "all_decodes_tokens_num",
    "num_tokens",
    "predicted_ttft",
    "predicted_delay",
    "predicted_stall",
    "predicted_tpot",
]
NOW = 1_000_000.0
# one step = 10 ms + 0.01 ms per prefill token, no decode cost: easy to reason about
FLAT = LatencyProfile(base_ms=10.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.0, context_ms_per_token=0.0)

STATUS = EngineStatus(
    update_id=5,
    timestamp_ms=int(NOW * 1000),
    schedulable=True,
    num_waiting=4,
    num_waiting_prefill=3,
    num_running=6,
    num_loading=1,
    num_running_prefill=2,
    num_running_decode=4,
    uncomputed_prefill_tokens=1000,
    running_decode_seq_len_sum=8000,
    used_kv_tokens=20_000,
    total_kv_tokens=100_000,
    unallocated_tokens=5_000,
)
INFLIGHT = InflightLoad(requests=2, prefill_tokens=300, decode_requests=2, decode_tokens=400)


def ctx(full: bool = True, **kw: object) -> PolicyContext:
    index = PrefixIndex()
    index.record_dispatch("a", [11, 12, 13])  # a holds three blocks of the request's prefix
    index.record_dispatch("b", [11])
    values: dict[str, object] = {
        "wall_clock": lambda: NOW,
        "full_mode": full,
        "prefix_index": index,
        "tables": LatencyTables(FLAT),
    }
    values.update(kw)
    c = PolicyContext(**values)  # type: ignore[arg-type]
    return c


def view(
    name: str = "a",
    status: EngineStatus | None = STATUS,
    inflight: InflightLoad | None = None,
    lrs: LrsLoad | None = None,
) -> InstanceView:
    return InstanceView(
        Endpoint(name, f"{name}:1", InferType.NEUTRAL),
        status=status,
        inflight=inflight or InflightLoad(),
        lrs=lrs or LrsLoad(),
        step_model=StepTimeModel(FLAT, 2.0),
        max_num_batched_tokens=512,
    )


REQ = RequestInfo("r", "m", prompt_tokens=100, prefix_block_hashes=(11, 12, 13, 14), prefix_block_size=16)


def value(name: str, inst: InstanceView, c: PolicyContext | None = None, req: RequestInfo = REQ) -> float:
    c = c or ctx()
    c.begin(req)
    return METRICS.get(name)(c).value(inst, req)


@pytest.mark.parametrize(
    ("name", "inst", "expected"),
    [
        # (used 20000 + unallocated 5000 + in-flight decode 400) / 100000
        ("kv_cache_usage_ratio_projected", view(inflight=INFLIGHT), 0.254),
        ("kv_cache_usage_ratio_projected", view(), 0.25),
        ("kv_cache_usage_ratio_projected", view(status=EngineStatus(), inflight=INFLIGHT), 1.0),  # size unknown
        ("kv_cache_usage_ratio_projected", view(status=EngineStatus()), 0.0),
        # waiting decode (4-3) + loading 1 + running decode 4 + in-flight decode 2
        ("decode_batch_size", view(inflight=INFLIGHT), 8),
        ("decode_batch_size", view(status=None, inflight=INFLIGHT), 2),
        # waiting 4 + in-flight 2
        ("num_waiting_requests", view(inflight=INFLIGHT), 6),
        ("num_waiting_requests", view(), 4),
        # uncomputed 1000 + in-flight prefill 300 (no prediction)
        ("all_prefills_tokens_num", view(inflight=INFLIGHT), 1300),
        ("all_prefills_tokens_num", view(status=None, inflight=INFLIGHT), 300),
        # three leading 16-token blocks cached on a, one on b, none on c
        ("kv_cache_hit_len", view("a"), 48),
        ("kv_cache_hit_len", view("b"), 16),
        ("kv_cache_hit_len", view("c"), 0),
        # prefills 1000 + misses (100 - 48)
        ("cache_aware_all_prefills_tokens_num", view("a"), 1052),
        ("cache_aware_all_prefills_tokens_num", view("c", inflight=INFLIGHT), 1400),
        # full mode: waiting 4 + loading 1 + running 6 + in-flight 2
        ("num_requests", view(inflight=INFLIGHT), 13),
        ("num_requests", view(status=None, inflight=INFLIGHT), 2),
        # running decode seq len sum 8000 + in-flight decode tokens 400
        ("all_decodes_tokens_num", view(inflight=INFLIGHT), 8400),
        ("num_tokens", view(lrs=LrsLoad(num_requests=2, num_tokens=777)), 777),
    ],
)
def test_full_mode_metric_values(name: str, inst: InstanceView, expected: float) -> None:
    assert value(name, inst) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "lrs", "expected"),
    [
        ("num_requests", LrsLoad(num_requests=3, num_tokens=90), 3),
        ("num_tokens", LrsLoad(num_requests=3, num_tokens=90), 90),
    ],
)
def test_lite_mode_counts_read_the_lrs(name: str, lrs: LrsLoad, expected: float) -> None:
    assert value(name, view(status=None, lrs=lrs), ctx(full=False)) == expected


def test_predicted_ttft_from_tables() -> None:
    # FLAT derived table: prefill_ms(t) interpolates base 10 ms at 0 .. step(8192) at 8192 tokens;
    # ahead 1000 + own misses (100 - 48) = 1052 tokens, plus the 4-batch's share per step (0 here)
    tables = LatencyTables(FLAT)
    expected = tables.prefill_ms(1052)
    assert value("predicted_ttft", view("a")) == pytest.approx(expected)
    assert value("predicted_ttft", view("c")) > value("predicted_ttft", view("a"))


@pytest.mark.parametrize(
    ("inst", "batch", "own"),
    [
        (view("a"), 6, 100 - 48),  # decode batch: waiting decode 1 + loading 1 + running decode 4
        (view("c", inflight=INFLIGHT), 8, 100),  # + in-flight decode 2; nothing cached on c
        (view("c", status=None), 0, 100),  # no batch: the delay is the TTFT
    ],
)
def test_predicted_delay_adds_the_batch_stall_to_the_ttft(inst: InstanceView, batch: int, own: int) -> None:
    # every request decoding there waits out this prompt's (uncached) prefill once
    expected = value("predicted_ttft", inst) + batch * LatencyTables(FLAT).prefill_ms(own)
    assert value("predicted_delay", inst) == pytest.approx(expected)


def _loaded(name: str, prefill: int, batch: int, full: bool) -> InstanceView:
    """An instance with `prefill` tokens ahead and `batch` requests decoding 3000-token sequences, in the
    mode's view (a status in full mode, the LRS in lite mode)."""
    if full:
        status = EngineStatus(
            update_id=1,
            timestamp_ms=int(NOW * 1000),
            schedulable=True,
            num_running_decode=batch,
            running_decode_seq_len_sum=batch * 3000,
            uncomputed_prefill_tokens=prefill,
        )
        return view(name, status=status)
    lrs = LrsLoad(
        num_requests=batch + (prefill > 0),
        num_tokens=batch * 3000 + prefill,
        num_decode_requests=batch,
        prefill_tokens=prefill,
    )
    return view(name, status=None, lrs=lrs)


@pytest.mark.parametrize("full", [False, True], ids=["lite", "full"])
def test_predicted_delay_sends_a_long_prompt_behind_a_short_prefill_not_onto_a_decode_batch(full: bool) -> None:
    """A 6000-token prompt: `batchy` has no prefill ahead but 4 requests decoding; `queued` has a
    200-token prefill ahead and none decoding. TTFT alone prefers `batchy` (and so stalls its four
    answers for the whole prefill); the delay prefers `queued`, and an idle instance beats both."""
    req = RequestInfo("long", "m", prompt_tokens=6000)
    c = ctx(full=full, tables=LatencyTables(LatencyProfile()))
    batchy, queued, idle = (
        _loaded(n, prefill, batch, full) for n, prefill, batch in (("batchy", 0, 4), ("queued", 200, 0), ("idle", 0, 0))
    )
    ttft = {n: value("predicted_ttft", v, c, req) for n, v in (("batchy", batchy), ("queued", queued))}
    assert ttft["batchy"] < ttft["queued"]
    views = (("batchy", batchy), ("queued", queued), ("idle", idle))
    delay = {n: value("predicted_delay", v, c, req) for n, v in views}
    assert delay["idle"] < delay["queued"] < delay["batchy"]


@pytest.mark.parametrize("full", [False, True], ids=["lite", "full"])
@pytest.mark.parametrize(
    ("released", "generated", "charged"),
    [
        (0, 0, None),  # cold: nothing released here yet, no evidence the answers are short: the least share
        (4, 40, 11),  # answers of 10 tokens: each absorbs the per-token amount x 11 of the stall
        (2, 4000, 2001),  # answers of 2000 tokens absorb more than the whole prefill: the least share
    ],
)
def test_predicted_stall_charges_the_stall_past_what_the_answers_absorb(
    full: bool, released: int, generated: int, charged: float | None
) -> None:
    """A 6000-token prompt onto 4 decoding requests: the TTFT, plus 4 x (prefill time - per token x (1 + the
    mean output of the requests released there)), and at least 4 x a fifth of the least prefill time at its
    prompt level (4096 tokens): 15 ms per answer token in both modes (full: the engines' counts; lite: the
    gateway's, at the release)."""
    from pilotfish.scheduler.policy.metrics.latency import PredictedStall

    share = PredictedStall.least_stall_share
    assert 0 < share < 1
    if charged is not None:
        charged *= PredictedStall.absorbed_ms_per_token
    req = RequestInfo("long", "m", prompt_tokens=6000)
    tables = LatencyTables(LatencyProfile())
    c = ctx(full=full, tables=tables)
    inst = _loaded("batchy", 0, 4, full)
    inst.lrs.num_released, inst.lrs.released_generated_tokens = released, generated
    inst.lrs.fleet_output_level = -1  # nothing released anywhere: a cold instance has no evidence
    ttft = value("predicted_ttft", inst, c, req)
    stall = tables.prefill_ms(6000)
    over = stall - charged if charged is not None else 0.0
    least = share * tables.prefill_floor(4096)
    assert 0 < least < share * stall
    expected = ttft + 4 * max(over, least)
    assert value("predicted_stall", inst, c, req) == pytest.approx(expected)
    if released == 4:  # short answers: the part past what they absorb is the larger, and the stall ranks it
        assert over > least  # behind a queue of a short prefill, as predicted_delay does
        queued = _loaded("queued", 200, 0, full)
        assert value("predicted_stall", queued, c, req) < value("predicted_stall", inst, c, req)
        assert value("predicted_ttft", inst, c, req) < value("predicted_ttft", queued, c, req)


@pytest.mark.parametrize("full", [False, True], ids=["lite", "full"])
def test_predicted_stall_on_a_cold_instance_goes_by_the_fleet(full: bool) -> None:
    """Nothing released here yet, but the fleet's answers are 2 tokens: the stall past the per-token amount
    (15 ms) x 3 is charged; its own history, once it has one, wins over the fleet's (long
    answers: only the least share of the stall)."""
    from pilotfish.scheduler.policy.metrics.latency import PredictedStall

    req = RequestInfo("long", "m", prompt_tokens=6000)
    tables = LatencyTables(LatencyProfile())
    c = ctx(full=full, tables=tables)
    inst = _loaded("batchy", 0, 4, full)
    ttft = value("predicted_ttft", inst, c, req)
    inst.lrs.fleet_output_level = 2
    absorbed = PredictedStall.absorbed_ms_per_token * 3
    stall = tables.prefill_ms(6000)
    assert value("predicted_stall", inst, c, req) == pytest.approx(ttft + 4 * (stall - absorbed))
    inst.lrs.num_released, inst.lrs.released_generated_tokens = 1, 100_000  # its own: long answers
    least = PredictedStall.least_stall_share * tables.prefill_floor(4096)  # the 6000-token prompt's level
    assert value("predicted_stall", inst, c, req) == pytest.approx(ttft + 4 * least)


@pytest.mark.parametrize("full", [False, True], ids=["lite", "full"])
def test_predicted_stall_leans_to_the_smaller_batch_where_answers_absorb_the_stall(full: bool) -> None:
    """Long answers on both instances absorb the whole prefill, and the one with 8 decoding has the shorter
    prefill queue, so TTFT alone sends the prompt onto its 8 victims; the least share of the stall tips it to
    the one with 2 decoding, while a large enough difference in TTFT still wins (the share only tilts)."""
    req = RequestInfo("turn", "m", prompt_tokens=1500)
    tables = LatencyTables(LatencyProfile())
    c = ctx(full=full, tables=tables)
    big, small = _loaded("big", 0, 8, full), _loaded("small", 100, 2, full)
    for inst in (big, small):
        inst.lrs.num_released, inst.lrs.released_generated_tokens = 10, 10 * 2000  # 2000-token answers
    assert value("predicted_ttft", big, c, req) < value("predicted_ttft", small, c, req)
    assert value("predicted_stall", small, c, req) < value("predicted_stall", big, c, req)
    far = _loaded("far", 20_000, 2, full)  # a long queue ahead: its TTFT outweighs the tilt
    far.lrs.num_released, far.lrs.released_generated_tokens = 10, 10 * 2000
    assert value("predicted_stall", big, c, req) < value("predicted_stall", far, c, req)


def test_the_lrs_tells_cold_instances_the_fleets_output_level() -> None:
    from pilotfish.scheduler.view.lrs import LocalRealtimeState

    a, b, idle = view("a", status=None), view("b", status=None), view("idle", status=None)
    told: list[str] = []
    lrs = LocalRealtimeState(60.0, on_change=told.append)
    lrs.dispatch("a1", "m", a, 100)
    lrs.dispatch("a2", "m", a, 100)
    lrs.dispatch("b1", "m", b, 100)
    assert a.lrs.fleet_output_level == b.lrs.fleet_output_level == -1  # nothing released anywhere
    lrs.report("a1", 5, True)
    told.clear()
    lrs.release("a1")  # the fleet's mean: 5 tokens -> level 4; b is cold and told, a has its own history
    assert b.lrs.fleet_output_level == 4 and told.count("b") == 1
    assert idle.lrs.fleet_output_level == -1  # never dispatched to: not held, not told
    lrs.report("a2", 3, True)
    told.clear()
    lrs.release("a2")  # mean 4: the same level, no one told
    assert "b" not in told
    lrs.dispatch("i1", "m", idle, 100)  # a first dispatch takes the fleet's level
    assert idle.lrs.fleet_output_level == 4
    lrs.report("b1", 40, True)
    told.clear()
    lrs.release("b1")  # b is warm now (own history); the mean 16 tells the one cold instance left
    assert told.count("idle") == 1 and idle.lrs.fleet_output_level == 16


def test_the_lrs_counts_what_released_requests_generated() -> None:
    from pilotfish.scheduler.view.lrs import LocalRealtimeState

    inst = view("a", status=None)
    seen: list[tuple[int, int]] = []
    lrs = LocalRealtimeState(60.0, on_change=lambda _: seen.append((inst.lrs.num_released,
                                                                     inst.lrs.released_generated_tokens)))
    lrs.dispatch("r1", "m", inst, 100)
    lrs.dispatch("r2", "m", inst, 100)
    lrs.report("r1", 7, True)
    assert lrs.release("r1") and not lrs.release("r1")  # once
    lrs.release("r2")  # released before its first token: counted, with none generated
    assert (inst.lrs.num_released, inst.lrs.released_generated_tokens) == (2, 7)
    # the change notice (which re-keys a load index) already sees the counts
    assert seen[-1] == (2, 7) and seen[-2] == (1, 7)


def test_predicted_tpot_from_tables() -> None:
    profile = LatencyProfile(base_ms=10.0, decode_ms_per_token=1.0, context_ms_per_token=0.001)
    c = ctx(tables=LatencyTables(profile))
    # batch 4+1+1 (waiting decode, loading, running) + 1 (this request) = 7, seq 8000 + 100
    expected = 10.0 + 7 * 1.0 + 0.001 * 8100
    assert value("predicted_tpot", view(), c) == pytest.approx(expected)


def test_predictor_enhanced_subtracts_work_done_since_the_status() -> None:
    # 2 s after the status; step(chunk=512-4, batch 4) = 10 + 5.08 ms -> ~132 steps x 508 tokens >> 1000
    later = ctx(predictor_enhanced=True, wall_clock=lambda: NOW + 2.0)
    assert value("all_prefills_tokens_num", view(inflight=INFLIGHT), later) == pytest.approx(300)
    # 20 ms later: 20 / 15.08 steps x 508 tokens ~ 674 tokens done
    soon = ctx(predictor_enhanced=True, wall_clock=lambda: NOW + 0.02)
    got = value("all_prefills_tokens_num", view(), soon)
    assert got == pytest.approx(1000 - 0.02 * 1000 / (10 + 0.01 * 508) * 508, rel=1e-6)
    # at the status's own moment nothing is predicted yet
    assert value("all_prefills_tokens_num", view(), ctx(predictor_enhanced=True)) == 1000


@pytest.mark.parametrize("name", SPEC_METRICS)
def test_every_spec_metric_is_registered_with_the_uniform_interface(name: str) -> None:
    metric = METRICS.get(name)(ctx())
    assert metric.name == name
    low, high = view("c", status=STATUS), view("c", status=STATUS, inflight=INFLIGHT)
    ctx().begin(REQ)
    a, b = metric.get_value(low, REQ), metric.get_value(high, REQ)
    assert metric.value_less(a, b) == (metric.sort_key(a) < metric.sort_key(b))
    assert metric.less(low, high, REQ) == metric.value_less(a, b)
    assert not metric.value_less(a, a)


@pytest.mark.parametrize(
    ("name", "lower_is_better", "lite"),
    [
        ("kv_cache_hit_len", False, True),
        ("num_requests", True, True),
        ("num_tokens", True, True),
        ("all_prefills_tokens_num", True, False),
        # lite mode reads the LRS (held prompt tokens before their prefill, the decode batch)
        ("predicted_ttft", True, True),
        ("predicted_delay", True, True),
        ("predicted_stall", True, True),
        ("predicted_tpot", True, True),
    ],
)
def test_metric_direction_and_mode(name: str, lower_is_better: bool, lite: bool) -> None:
    cls: type[Metric] = METRICS.get(name)
    assert cls.lower_is_better is lower_is_better
    assert cls.lite is lite


def test_registry_holds_exactly_the_spec_metrics() -> None:
    assert METRICS.names() == sorted(SPEC_METRICS)
