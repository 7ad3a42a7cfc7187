"""The default policy's ranking (predicted TTFT, then TPOT, through cache_aware) walked by the floor under
predicted TTFT (BoundedLoadIndex) decides exactly as the scan does: random fleets, requests and prefix hits,
lite and full mode, with health, failover and SLO filters, as instances change; and a decision visits a
few instances of thousands."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.protos import cms_pb2
from pilotfish.scheduler import core as core_module
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import Pipeline, Selector
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.index import BoundedLoadIndex, indexable_pipeline, load_index
from pilotfish.scheduler.policy.registry import METRICS
from pilotfish.scheduler.policy.selectors.cache_aware import CacheAwareSelector
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables, TpotTable
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InflightLoad, InstanceView, RequestInfo

NOW = 10_000.0
BLOCKS = (11, 12, 13, 14, 15, 16)

# the built-in profile (tables derived from four numbers), and one with tables whose prefill curve dips
# (a floor from its least slope, negative here) and whose TPOT is not monotone in the batch
PROFILES = {
    "derived": LatencyProfile(),
    "tables": LatencyProfile(
        base_ms=8.0,
        ttft_ms=[(64.0, 30.0), (512.0, 25.0), (2048.0, 180.0), (8192.0, 900.0)],
        tpot_ms=TpotTable(batch_sizes=[1, 16, 64], seq_lens=[128, 4096], ms=[[9.0, 12.0], [8.5, 30.0], [20.0, 90.0]]),
    ),
    "steep": LatencyProfile(base_ms=2.0, prefill_ms_per_token=0.5, decode_ms_per_token=3.0, context_ms_per_token=0.01),
}


def _context(full: bool, profile: str, hits: PrefixIndex) -> PolicyContext:
    return PolicyContext(
        wall_clock=lambda: NOW,
        full_mode=full,
        prefix_index=hits,
        tables=LatencyTables(PROFILES[profile], token_budget=512),
        instance_staleness_seconds=5.0,
    )


def _pipeline(
    ranking: str, filters: list[str], top_k: int, c: PolicyContext, first: str = "predicted_ttft"
) -> Pipeline:
    """`first`: the ranking's first load metric (predicted_ttft, or predicted_delay / predicted_stall)."""
    ttft, tpot, hit = (METRICS.get(n)(c) for n in (first, "predicted_tpot", "kv_cache_hit_len"))
    stages: list = []
    for name in filters:
        if name == "schedulability":
            stages.append(SchedulabilityFilter(not_skip_when_fallback=True))
        elif name == "staleness":
            stages.append(StalenessFilter(5.0, ctx=c))
        elif name == "ttft-slo":  # a fresh metric object, as the registry builds one per stage
            stages.append(MetricBasedFilter(METRICS.get("predicted_ttft")(c), 400.0))
        elif name == "tpot-slo":
            stages.append(MetricBasedFilter(METRICS.get("predicted_tpot")(c), 40.0))
        else:
            stages.append(FailoverFilter(name.removeprefix("failover-")))
    rng = random.Random(5)
    selector: Selector
    if ranking == "default":
        selector = CacheAwareSelector([hit, ttft, tpot], top_k=top_k, rng=rng)
    elif ranking == "narrow-band":
        selector = CacheAwareSelector([hit, ttft, tpot], top_k=top_k, balance_abs_threshold=0.0, rng=rng)
    elif ranking == "hit-first":
        selector = MetricBasedSelector([hit, ttft], top_k=top_k, rng=rng)
    else:
        selector = MetricBasedSelector([ttft, tpot], top_k=top_k, rng=rng)
    return Pipeline(stages, selector)


FILTER_SETS = [
    [],
    ["ttft-slo"],
    ["ttft-slo", "tpot-slo"],
    ["schedulability", "staleness", "failover-node"],
    ["schedulability", "staleness", "ttft-slo", "tpot-slo", "failover-instance-unit"],
    ["staleness", "tpot-slo", "failover-node-unit"],
]

# small value sets, so instances tie (idle ones most of all) and the ties' order is exercised
instance_state = st.tuples(
    st.sampled_from([0, 0, 1, 100, 511, 512, 700, 3000]),  # prefill tokens ahead (lite) / uncomputed (full)
    st.sampled_from([0, 0, 1, 5, 63, 600]),  # decode batch
    st.sampled_from([0, 100, 5000, 200_000]),  # its sequence lengths, in all
    st.booleans(),  # schedulable
    st.sampled_from([0.0, 1.0, 9.0, -0.5, None]),  # status age, s (None: no status yet)
    st.integers(0, 3),  # node
    st.integers(0, 3),  # unit
    st.sampled_from([0, 0, 1, 3]),  # in-flight requests (full mode)
    st.sampled_from([1.0, 1.0, 1.0, 1.5, 4.0, 10.0]),  # speed scale (view/speed.py): most engines alike
    # (requests released, tokens they generated, the fleet's mean output level): predicted_stall's absorbed
    # stall: the instance's own history, else the fleet's, else none
    st.sampled_from([(0, 0, -1), (0, 0, 0), (0, 0, 16), (1, 1, -1), (3, 30, 4), (2, 400, 0), (1, 100_000, 1)]),
)


def _apply(v: InstanceView, state: tuple, full: bool) -> None:
    ahead, batch, seq, ok, age, node, unit, inflight, *rest = state
    # then the speed scale, where given, then the release counts, where given
    v.speed_scale = rest[0] if len(rest) == 2 else 1.0
    released = rest[-1:]
    # both modes keep the LRS's release counts (Release comes through the core in full mode too)
    lrs = v.lrs
    lrs.num_released, lrs.released_generated_tokens, lrs.fleet_output_level = released[0] if released else (0, 0, -1)
    if full:
        v.status = (
            None
            if age is None
            else EngineStatus(
                timestamp_ms=int((NOW - age) * 1000),
                schedulable=ok,
                uncomputed_prefill_tokens=ahead,
                num_running_decode=batch,
                running_decode_seq_len_sum=seq,
            )
        )
        v.inflight = InflightLoad(
            requests=inflight, prefill_tokens=inflight * 90, decode_requests=inflight, decode_tokens=inflight * 300
        )
    else:
        lrs = v.lrs
        lrs.prefill_tokens, lrs.num_decode_requests = ahead, batch
        lrs.num_tokens = ahead + seq
        lrs.num_requests = batch + (1 if ahead else 0)
    v.node_id, v.unit_id = f"n{node}", f"u{unit}"


def _views(states: list[tuple], full: bool) -> list[InstanceView]:
    views = []
    for k, state in enumerate(states):
        v = InstanceView(Endpoint(f"i{k:02d}", f"h{k}:1", InferType.NEUTRAL))
        _apply(v, state, full)
        views.append(v)
    return views


def decisions_st(prompts: list[int], least_blocks: int) -> st.SearchStrategy[list[tuple]]:
    """(prompt tokens, blocks of it the request names; 0: none) of each decision, and an instance that
    changes before it with its new state (-1: none)."""
    blocks = st.integers(least_blocks, len(BLOCKS))
    step = st.tuples(st.sampled_from(prompts), blocks, st.integers(-1, 39), instance_state)
    return st.lists(step, min_size=1, max_size=8)


@settings(max_examples=500, deadline=None)
@given(
    full=st.booleans(),
    profile=st.sampled_from(sorted(PROFILES)),
    ranking=st.sampled_from(["default", "default", "narrow-band", "hit-first", "load"]),
    first=st.sampled_from(["predicted_ttft", "predicted_delay", "predicted_stall"]),
    states=st.lists(instance_state, min_size=1, max_size=40),
    filters=st.sampled_from(FILTER_SETS),
    top_k=st.integers(1, 3),
    count=st.integers(1, 4),
    cached=st.lists(st.tuples(st.integers(0, 39), st.integers(1, len(BLOCKS))), max_size=10),
    steps=decisions_st(prompts=[0, 1, 16, 40, 96, 700, 5000], least_blocks=0),
)
def test_bounded_index_equals_scan(
    full: bool,
    profile: str,
    ranking: str,
    first: str,
    states: list[tuple],
    filters: list[str],
    top_k: int,
    count: int,
    cached: list[tuple[int, int]],
    steps: list[tuple],
) -> None:
    _replay_against_scan(full, profile, ranking, states, filters, top_k, count, cached, steps, first)


@settings(max_examples=400, deadline=None)
@given(
    full=st.booleans(),
    profile=st.sampled_from(sorted(PROFILES)),
    ranking=st.sampled_from(["default", "narrow-band"]),
    # each instance's state and how much of the prefix it holds: most hold some, many all of it
    fleet=st.lists(st.tuples(instance_state, st.sampled_from([0, 1, 3, 3, 6, 6, 6])), min_size=4, max_size=40),
    filters=st.sampled_from(FILTER_SETS),
    top_k=st.integers(1, 3),
    count=st.integers(1, 4),
    steps=decisions_st(prompts=[1, 16, 40, 96, 700, 5000], least_blocks=1),
)
def test_bounded_index_equals_scan_with_a_widely_held_prefix(
    full: bool,
    profile: str,
    ranking: str,
    fleet: list[tuple],
    filters: list[str],
    top_k: int,
    count: int,
    steps: list[tuple],
) -> None:
    """Many holders, many of them in the band: the walk stops visiting hits once the band is told apart and
    enough in-band candidates outrank the rest, and still decides as the scan does."""
    states = [state for state, _ in fleet]
    cached = [(k, depth) for k, (_, depth) in enumerate(fleet) if depth]
    _replay_against_scan(full, profile, ranking, states, filters, top_k, count, cached, steps)


def _replay_against_scan(
    full: bool,
    profile: str,
    ranking: str,
    states: list[tuple],
    filters: list[str],
    top_k: int,
    count: int,
    cached: list[tuple[int, int]],
    steps: list[tuple],
    first: str = "predicted_ttft",
) -> None:
    if not full:
        filters = [f for f in filters if f in ("ttft-slo", "tpot-slo")]  # lite mode has no statuses
    hits = PrefixIndex()
    for k, depth in cached:
        hits.record_dispatch(f"i{k:02d}", BLOCKS[:depth])
    c = _context(full, profile, hits)
    views = _views(states, full)
    scan = _pipeline(ranking, filters, top_k, c, first)
    walk = _pipeline(ranking, filters, top_k, c, first)
    assert indexable_pipeline(walk)
    index = load_index(walk, views)
    assert isinstance(index, BoundedLoadIndex)
    for n, (prompt, blocks, k, state) in enumerate(steps):
        if 0 <= k < len(views):
            _apply(views[k], state, full)
            index.rekey(views[k])
        req = RequestInfo(f"r{n}", "m", prompt_tokens=prompt, prefix_block_hashes=BLOCKS[:blocks], prefix_block_size=16)
        c.begin(req)
        try:
            expected = [i.instance_id for i in scan.run(views, req, count)]
        except NoSchedulableInstanceError:
            with pytest.raises(NoSchedulableInstanceError):
                walk.run(views, req, count, index)
            continue
        assert [i.instance_id for i in walk.run(views, req, count, index)] == expected


@pytest.mark.parametrize("name", ["predicted_ttft", "predicted_delay", "predicted_stall"])
@pytest.mark.parametrize("full", [False, True])
def test_predicted_ttft_floor_holds(full: bool, name: str) -> None:
    """lower_bound(state) + bound_offset(req, 0) never exceeds the value, over a grid of loads and prompts (and
    a tight floor is no use: it often equals the value, to the last few bits)."""
    for profile in PROFILES:
        c = _context(full, profile, PrefixIndex())
        ttft = METRICS.get(name)(c)
        for ahead in (0, 1, 300, 511, 512, 513, 1500, 9000):
            for batch in (0, 1, 7, 511, 512, 2000):
                histories = ((0, 0, -1), (0, 0, 2), (1, 1, -1), (3, 30, 0))  # released, generated, fleet level
                for seq, released, scale in itertools.product((0, 10, 4000, 300_000), histories, (1.0, 3.5)):
                    v = _views([(ahead, batch, seq, True, 0.0, 0, 0, 0, scale, released)], full)[0]
                    state = ttft.state(v)
                    # the levels' floors in one go are the same floats as level by level (an index finds its
                    # old entries by them)
                    assert ttft.lower_bounds_at(state) == [ttft.lower_bound_at(state, n) for n in ttft.floor_levels]
                    for prompt in (0, 1, 2, 15, 512, 513, 4000, 20_000):
                        req = RequestInfo("r", "m", prompt_tokens=prompt)
                        c.begin(req)
                        value = ttft.value(v, req)
                        # within the rounding slack the index allows (index.py: _BOUND_*_SLACK)
                        slack = abs(value) * 1e-12
                        assert ttft.lower_bound(state) + ttft.bound_offset(req, 0) <= value + slack
                        # and at every prompt-size level at or under the prompt (the walk of a request by its size)
                        for level in (lv for lv in ttft.floor_levels if lv <= prompt):
                            assert ttft.lower_bound_at(state, level) + ttft.bound_offset(req, 0) <= value + slack


@pytest.mark.parametrize("name", ["predicted_ttft", "predicted_delay", "predicted_stall"])
@pytest.mark.parametrize("full", [False, True])
def test_a_prompt_all_cached_still_costs_a_step_with_the_batch_and_keeps_its_floor(full: bool, name: str) -> None:
    """An instance holding the whole prompt computes its last token in a step with its decode batch: the value
    is that of one own token, so it rises with the batch (counted as none it was the idle TTFT, 0, whatever
    the batch, and a burst of exact repeats all went to one engine), and the floor holds under it."""
    for profile in PROFILES:
        hits = PrefixIndex()
        hits.record_dispatch("i00", BLOCKS)
        c = _context(full, profile, hits)
        metric = METRICS.get(name)(c)
        for blocks in range(1, len(BLOCKS) + 1):
            req = RequestInfo("r", "m", prompt_tokens=16 * blocks, prefix_block_hashes=BLOCKS[:blocks],
                              prefix_block_size=16)
            one = RequestInfo("one", "m", prompt_tokens=1)  # one token of its own, nothing cached
            values = []
            for batch in (0, 1, 7, 600):
                v = _views([(0, batch, 4000 * batch, True, 0.0, 0, 0, 0, 1.0, (3, 30, 0))], full)[0]
                state = metric.state(v)
                c.begin(req)
                value = metric.value(v, req)
                assert metric.lower_bound(state) + metric.bound_offset(req, 16 * blocks) <= value * (1 + 1e-12)
                c.begin(one)
                assert value == metric.value(v, one), (profile, blocks, batch)
                values.append(value)
            assert values[0] > 0 and values == sorted(values) and values[-1] > values[1], values


def _fleet(n: int, rng: random.Random, full: bool) -> list[InstanceView]:
    return _views(
        [
            (rng.randrange(0, 20_000) if full else rng.choice([0, 0, rng.randrange(16, 8192)]), rng.randrange(0, 64),
             rng.randrange(0, 200_000), True, 0.0, k % 7, k % 5, 0)
            for k in range(n)
        ],
        full,
    )


def _visits_deciding(
    full: bool, views: list[InstanceView], hits: PrefixIndex, requests: list[RequestInfo]
) -> list[int]:
    """Each request decided by the default through its load index, and as a scan decides it (asserted the same):
    how many members the index evaluated for each."""
    c = _context(full, "derived", hits)
    c.tables = LatencyTables(PROFILES["derived"])
    filters = ["schedulability", "staleness", "failover-node"] if full else []
    pipeline = _pipeline("default", filters, 1, c)
    index = load_index(pipeline, views)
    ttft = pipeline.selector.metrics[1]
    evaluate = ttft.evaluate
    visits: list[int] = []

    def counted(*args: object) -> float:
        visits[-1] += 1
        return evaluate(*args)  # type: ignore[arg-type]

    for req in requests:
        c.begin(req)
        visits.append(0)
        ttft.evaluate = counted  # type: ignore[method-assign]
        try:
            walked = [v.instance_id for v in pipeline.run(views, req, 3, index)]
        finally:
            ttft.evaluate = evaluate  # type: ignore[method-assign]
        assert walked == [v.instance_id for v in _pipeline("default", filters, 1, c).run(views, req, 3)]
    return visits


@pytest.mark.parametrize("full", [False, True])
def test_a_default_decision_visits_few_of_4096_instances(full: bool) -> None:
    rng = random.Random(4)
    hits = PrefixIndex()
    views = _fleet(4096, rng, full)
    for k in rng.sample(range(4096), 100):  # a prefix held by 100 instances
        hits.record_dispatch(f"i{k:02d}", BLOCKS)
    requests = [RequestInfo(f"r{n}", "m", prompt_tokens=1000, prefix_block_hashes=BLOCKS[:blocks], prefix_block_size=16)
                for n, blocks in enumerate((0, 3, len(BLOCKS)))]
    assert max(_visits_deciding(full, views, hits, requests)) < 150


@pytest.mark.parametrize("full", [False, True])
def test_a_prompt_every_instance_holds_whole_is_decided_with_few_visits(full: bool) -> None:
    """The same short prompt asked again and again (retries, a fixed classification prompt) comes to be held
    whole by every instance: no floor under the value holds there, and before the index kept its members by
    that value it evaluated all 4,096 of them (2.97 ms a decision in full mode). Every instance has work ahead:
    idle ones would all tie at a value of 0, and the ties are all visited for the TPOT after it."""
    rng = random.Random(5)
    hits = PrefixIndex()
    views = _views([(rng.randrange(1, 20_000), rng.randrange(0, 64), rng.randrange(0, 200_000), True, 0.0, k % 7,
                     k % 5, 0) for k in range(4096)], full)
    for k in range(4096):
        hits.record_dispatch(f"i{k:02d}", BLOCKS)
    requests = [RequestInfo(f"r{n}", "m", prompt_tokens=16 * blocks, prefix_block_hashes=BLOCKS[:blocks],
                            prefix_block_size=16) for n, blocks in enumerate((1, len(BLOCKS)))]
    assert max(_visits_deciding(full, views, hits, requests)) < 150


@pytest.mark.parametrize("full", [False, True])
def test_the_core_decides_the_default_as_a_scan_does(full: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cores, one indexed and one that scans, fed the same dispatches, reports, releases and statuses:
    the index follows every change it is told of, and every decision is the same."""

    now = [0.0]

    def build() -> SchedulerCore:
        if full:
            core = SchedulerCore(
                SchedulerConfig(enable_full_mode_scheduling=True, model=["m"]),
                wall_clock=lambda: NOW,
                rng=random.Random(3),
            )
            for k in range(40):
                core.apply_metadata(
                    cms_pb2.InstanceMetadata(instance_id=f"i{k:02d}", host="h", http_port=1 + k, model="m",
                                             node_id=f"n{k % 5}", update_id=1)
                )
            return core
        instances = [f"i{k:02d}=10.0.0.{k}:8000" for k in range(40)]
        # one clock for both, so the first tokens' times (view/speed.py) are the same to both
        # and lite's judgement of slow engines on, so scales move in the index as well
        return SchedulerCore(SchedulerConfig(instances=instances, model=["m"], slow_engine_ratio_lite=1.5),
                             rng=random.Random(3), clock=lambda: now[0])

    indexed = build()
    indexed._groups("m")  # its candidate groups and their index, before the scanning one's are made without
    monkeypatch.setattr(core_module, "INDEX_MIN_INSTANCES", 10**9)
    scanned = build()
    rng = random.Random(8)
    prefixes = [tuple(rng.getrandbits(32) for _ in range(4)) for _ in range(5)]
    updates = [1] * 40
    for i in range(300):
        if full and i % 2 == 0:  # a status for a random instance
            k = rng.randrange(40)
            updates[k] += 1
            status = cms_pb2.InstanceStatus(
                instance_id=f"i{k:02d}",
                update_id=updates[k],
                timestamp_ms=int(NOW * 1000),
                schedulable=rng.random() > 0.1,
                uncomputed_prefill_tokens=rng.choice([0, rng.randrange(0, 9000)]),
                num_running_decode=rng.randrange(0, 30),
                running_decode_seq_len_sum=rng.randrange(0, 60_000),
            )
            for core in (indexed, scanned):
                core.apply_status(status)
        req = RequestInfo(
            f"r{i}", "m", prompt_tokens=rng.randrange(1, 3000), prefix_block_hashes=rng.choice(prefixes),
            prefix_block_size=16,
        )
        decisions = [core.schedule(req) for core in (indexed, scanned)]
        assert decisions[0] == decisions[1]
        now[0] += 0.013
        for core in (indexed, scanned):
            if i % 3 == 0:
                core.report(f"r{i}", 0, prefill_done=True)  # joins the decode batch
            if i >= 5:
                core.report(f"r{i - 5}", 1 + i % 9)  # tokens generated: the batch's sequences grow
        if i >= 60:
            for core in (indexed, scanned):
                core.release(f"r{i - 60}")
    stage = indexed._by_model["m"].stages[InferType.NEUTRAL]
    assert isinstance(stage.index, BoundedLoadIndex)
    assert scanned._by_model["m"].stages[InferType.NEUTRAL].index is None


@settings(max_examples=200, deadline=None)
@given(states=st.lists(instance_state, min_size=1, max_size=8), waiting=st.integers(0, 5), prefill=st.integers(0, 5))
def test_the_full_mode_load_is_the_load_metrics(states: list[tuple], waiting: int, prefill: int) -> None:
    """The predicted metrics read the full-mode load in one go: the very values of the three load metrics."""
    c = _context(True, "derived", PrefixIndex())
    ttft, tpot = METRICS.get("predicted_ttft")(c), METRICS.get("predicted_tpot")(c)
    loads = [METRICS.get(n)(c) for n in ("all_prefills_tokens_num", "decode_batch_size", "all_decodes_tokens_num")]
    req = RequestInfo("r", "m", prompt_tokens=10)
    for v in _views(states, True):
        if v.status is not None:
            v.status.num_waiting, v.status.num_waiting_prefill, v.status.num_loading = waiting, prefill, 1
        ahead, batch, seq = (m.value(v, req) for m in loads)
        assert ttft.state(v) == (ahead, batch, c.tables.decode_share_ms(batch, seq), v.speed_scale)
        assert tpot.state(v) == (batch, seq, v.speed_scale)
