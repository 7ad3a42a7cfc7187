"""Built-in policies (docs/policy-framework.md's table), YAML-composed policies equal to flag-built ones, and the
load-ordered index giving exactly the scan's decisions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.config import ConfigError, struct_from_mapping
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import Pipeline
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.index import LoadIndex, indexable_pipeline
from pilotfish.scheduler.policy.registry import METRICS, build_policy, policy_spec
from pilotfish.scheduler.policy.selectors.cache_aware import CacheAwareSelector
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.view.predictor import StepTimeModel
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InflightLoad, InstanceView, RequestInfo

NOW = 10_000.0
REQ = RequestInfo("r", "m", prompt_tokens=200, prefix_block_hashes=(1, 2, 3), prefix_block_size=16)


def full(**kw: object) -> SchedulerConfig:
    kw.setdefault("scheduling_policy", "load-balance")  # the policy these tests are about
    return SchedulerConfig(enable_full_mode_scheduling=True, **kw)  # type: ignore[arg-type]


def ctx(**kw: object) -> PolicyContext:
    values: dict[str, object] = {"wall_clock": lambda: NOW, "full_mode": True}
    values.update(kw)
    return PolicyContext(**values)  # type: ignore[arg-type]


def view(name: str, kind: InferType = InferType.NEUTRAL, **status: object) -> InstanceView:
    fields: dict[str, object] = {"timestamp_ms": int(NOW * 1000), "schedulable": True, "total_kv_tokens": 10_000}
    fields.update(status)
    return InstanceView(Endpoint(name, f"{name}:1", kind), status=EngineStatus(**fields))  # type: ignore[arg-type]


# -- the table of built-in policies -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "metric"),
    [
        ("neutral", "all_prefills_tokens_num"),
        ("prefill", "all_prefills_tokens_num"),
        ("decode", "kv_cache_usage_ratio_projected"),
    ],
)
def test_load_balance_full_mode_defaults(kind: str, metric: str) -> None:
    spec = policy_spec(full(failover_domain="node", dispatch_top_k=2))[kind]
    assert [f["name"] for f in spec["filters"]] == ["schedulability", "staleness", "failover"]
    assert spec["filters"][2]["domain"] == "node"
    assert spec["selector"] == {"name": "metric_based", "metrics": [metric], "top_k": 2}


def test_load_balance_full_mode_threshold_per_infer_type() -> None:
    spec = policy_spec(full(dispatch_decode_load_threshold=0.9))
    assert [f["name"] for f in spec["decode"]["filters"]] == ["schedulability", "staleness", "metric_based", "failover"]
    assert spec["decode"]["filters"][2] == {
        "name": "metric_based",
        "metric": "kv_cache_usage_ratio_projected",
        "threshold": 0.9,
        "not_skip_when_fallback": False,
    }
    assert len(spec["neutral"]["filters"]) == 3


def test_load_balance_lite_mode() -> None:
    spec = policy_spec(
        SchedulerConfig(scheduling_policy="load-balance", dispatch_load_metric="num_tokens", dispatch_load_threshold=5)
    )
    assert set(spec) == {"neutral"}
    assert [f["name"] for f in spec["neutral"]["filters"]] == ["metric_based"]
    assert spec["neutral"]["selector"]["metrics"] == ["num_tokens"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            SchedulerConfig(scheduling_policy="load-balance", dispatch_load_metric="all_prefills_tokens_num"),
            "not available in lite mode",
        ),
        (SchedulerConfig(scheduling_policy="slo"), "slo needs full mode"),
        (SchedulerConfig(enable_predictor_enhanced_scheduling=True), "predictor-enhanced-scheduling: needs full mode"),
        (
            SchedulerConfig(
                scheduling_policy="load-balance",
                enable_cache_aware_scheduling=True, cache_aware_metric="cache_aware_all_prefills_tokens_num"
            ),
            "lite mode can rank by kv_cache_hit_len only",
        ),
        (full(enable_cache_aware_scheduling=True, cache_aware_metric="num_requests"), "--cache-aware-metric"),
        (full(dispatch_decode_load_metric="bogus"), "unknown metric 'bogus'"),
        (full(failover_domain="rack"), "--failover-domain"),
    ],
)
def test_policy_config_errors(config: SchedulerConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_policy(config)


@pytest.mark.parametrize(
    ("kind", "first"),
    [("neutral", "kv_cache_hit_len"), ("prefill", "kv_cache_hit_len"), ("decode", "kv_cache_usage_ratio_projected")],
)
def test_cache_aware_puts_the_locality_metric_first(kind: str, first: str) -> None:
    spec = policy_spec(full(enable_cache_aware_scheduling=True))
    assert spec[kind]["selector"]["metrics"][0] == first


def test_cache_aware_prefers_the_cached_instance_over_the_idler_one_within_the_band() -> None:
    index = PrefixIndex()
    index.record_dispatch("busy", [1, 2, 3])
    policy = build_policy(full(enable_cache_aware_scheduling=True), ctx=ctx(prefix_index=index))
    # all_prefills_tokens_num's band is 512 tokens over the least loaded instance
    views = [view("busy", uncomputed_prefill_tokens=500), view("idle")]
    assert policy.schedule(views, REQ, 1).target.instance_id == "busy"
    # past the band the hit no longer outweighs the load (it used to win at any load: the lock-in)
    views = [view("busy", uncomputed_prefill_tokens=900), view("idle")]
    assert policy.schedule(views, REQ, 1).target.instance_id == "idle"
    # without the feature, load alone decides
    views = [view("busy", uncomputed_prefill_tokens=500), view("idle")]
    assert build_policy(full(), ctx=ctx()).schedule(views, REQ, 1).target.instance_id == "idle"


def test_cache_aware_all_prefills_tokens_num_trades_hits_against_load() -> None:
    index = PrefixIndex()
    index.record_dispatch("cached", [1, 2, 3])  # 48 of 200 tokens cached
    config = full(enable_cache_aware_scheduling=True, cache_aware_metric="cache_aware_all_prefills_tokens_num")
    policy = build_policy(config, ctx=ctx(prefix_index=index))
    # cached: 100 + 152 misses = 252; other: 0 + 200 = 200 -> other wins
    views = [view("cached", uncomputed_prefill_tokens=100), view("other")]
    assert policy.schedule(views, REQ, 1).target.instance_id == "other"
    views = [view("cached", uncomputed_prefill_tokens=10), view("other")]  # 162 < 200
    assert policy.schedule(views, REQ, 1).target.instance_id == "cached"


def test_slo_policy_thresholds_and_ranking() -> None:
    spec = policy_spec(full(scheduling_policy="slo", ttft_slo=500, ttft_slo_dispatch_threshold=0.8, tpot_slo=50))
    prefill = spec["prefill"]
    assert prefill["selector"]["metrics"] == ["predicted_ttft"]
    assert prefill["filters"][2] == {
        "name": "metric_based",
        "metric": "predicted_ttft",
        "threshold": 400.0,
        "not_skip_when_fallback": False,
    }
    assert spec["decode"]["selector"]["metrics"] == ["predicted_tpot"]
    assert spec["decode"]["filters"][2]["threshold"] == 50.0
    assert spec["neutral"]["selector"]["metrics"] == ["predicted_ttft", "predicted_tpot"]


def test_slo_policy_routes_to_the_lowest_predicted_ttft_and_blocks_slo_breakers() -> None:
    profile = LatencyProfile(
        base_ms=10,
        prefill_ms_per_token=0.1,
        decode_ms_per_token=0,
        context_ms_per_token=0,
        ttft_ms=[(0, 10), (10_000, 1010)],
    )
    config = full(scheduling_policy="slo", ttft_slo=300)
    policy = build_policy(config, ctx=ctx(tables=LatencyTables(profile)))
    views = [view("a", uncomputed_prefill_tokens=5000), view("b", uncomputed_prefill_tokens=1000)]
    selection = policy.schedule(views, REQ, 5)
    # b: 10 + 0.1 * 1200 = 130 ms; a: 10 + 0.1 * 5200 = 530 ms > 300: blocked, not even a fallback
    assert selection.target.instance_id == "b" and selection.fallbacks == ()


def test_which_pipelines_are_indexed() -> None:
    assert build_policy(full(), ctx=ctx()).pipelines[InferType.NEUTRAL].indexable
    # predictor-enhanced: by drain time (tests/unit/test_scheduler_index.py)
    enhanced = build_policy(full(enable_predictor_enhanced_scheduling=True), ctx=ctx(predictor_enhanced=True))
    assert enhanced.pipelines[InferType.NEUTRAL].indexable
    cache_aware = build_policy(full(enable_cache_aware_scheduling=True), ctx=ctx())
    assert cache_aware.pipelines[InferType.NEUTRAL].indexable


# -- YAML-composed policies equal the flag-built ones ---------------------------------------------------

YAML_FULL_LB = """
scheduling-policy: my-lb
enable-full-mode-scheduling: true
policies:
  my-lb:
    neutral:
      filters:
        - name: schedulability
          not_skip_when_fallback: true
        - {name: staleness, staleness_seconds: 10.0, not_skip_when_fallback: true}
        - {name: metric_based, metric: all_prefills_tokens_num, threshold: 4096}
        - {name: failover, domain: node}
      selector: {name: metric_based, metrics: [all_prefills_tokens_num], top_k: 2}
    prefill:
      filters: [schedulability, staleness, {name: failover, domain: node}]
      selector: {name: metric_based, metrics: [all_prefills_tokens_num], top_k: 2}
    decode:
      filters: [schedulability, staleness, {name: failover, domain: node}]
      selector: {name: metric_based, metrics: [kv_cache_usage_ratio_projected], top_k: 2}
"""
FLAGS_FULL_LB = {
    "scheduling_policy": "load-balance",
    "enable_full_mode_scheduling": True,
    "dispatch_neutral_load_threshold": 4096,
    "failover_domain": "node",
    "dispatch_top_k": 2,
}
YAML_LITE_LB = """
scheduling-policy: tokens
policies:
  tokens:
    neutral:
      filters: [{name: metric_based, metric: num_tokens, threshold: 900}]
      selector: {name: metric_based, metrics: [num_tokens], top_k: 1}
"""
FLAGS_LITE_LB = {
    "scheduling_policy": "load-balance",
    "dispatch_load_metric": "num_tokens",
    "dispatch_load_threshold": 900,
}


@pytest.mark.parametrize(("text", "flags"), [(YAML_FULL_LB, FLAGS_FULL_LB), (YAML_LITE_LB, FLAGS_LITE_LB)])
def test_yaml_policy_equals_the_flag_built_one(text: str, flags: dict[str, object], tmp_path: Path) -> None:
    from_yaml = struct_from_mapping(SchedulerConfig, yaml.safe_load(text))
    from_flags = struct_from_mapping(SchedulerConfig, flags)
    a, b = build_policy(from_yaml, random.Random(1), ctx()), build_policy(from_flags, random.Random(1), ctx())
    assert a.spec() == b.spec()
    # and they decide alike, step by step, top-K draws included
    rng = random.Random(5)
    for _ in range(50):
        views = [
            view(f"i{k}", uncomputed_prefill_tokens=rng.randrange(0, 6000), schedulable=rng.random() > 0.1)
            for k in range(6)
        ]
        for v in views:
            v.lrs.num_tokens = rng.randrange(0, 2000)
            v.node_id = f"n{rng.randrange(3)}"
        try:
            left = a.schedule(views, REQ, 2)
        except NoSchedulableInstanceError:
            with pytest.raises(NoSchedulableInstanceError):
                b.schedule(views, REQ, 2)
            continue
        right = b.schedule(views, REQ, 2)
        assert (left.target, left.fallbacks) == (right.target, right.fallbacks)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"dispatch_top_k": 3, "dispatch_load_metric": "num_tokens"},
        {"enable_full_mode_scheduling": True, "enable_cache_aware_scheduling": True, "failover_domain": "node-unit"},
        {"enable_full_mode_scheduling": True, "scheduling_policy": "slo", "ttft_slo": 200, "tpot_slo": 40},
        {"enable_full_mode_scheduling": True, "scheduling_policy": "round-robin"},
        {"enable_full_mode_scheduling": True, "enable_predictor_enhanced_scheduling": True},
    ],
)
def test_every_built_in_policy_round_trips_through_yaml(flags: dict[str, object]) -> None:
    config = struct_from_mapping(SchedulerConfig, flags)
    spec = policy_spec(config)
    composed = struct_from_mapping(
        SchedulerConfig, {**flags, "scheduling_policy": "copy", "policies": {"copy": yaml.safe_load(yaml.dump(spec))}}
    )
    assert build_policy(composed, ctx=ctx()).spec() == build_policy(config, ctx=ctx()).spec()


def test_policies_given_as_a_flag_are_parsed_as_yaml() -> None:
    text = "{x: {neutral: {selector: {name: round_robin}}}}"
    policy = build_policy(SchedulerConfig(scheduling_policy="x", policies=text))
    assert policy.spec() == {"neutral": {"filters": [], "selector": {"name": "round_robin"}}}


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ({"x": {"middle": {"selector": "round_robin"}}}, r"policies.x: unknown infer type 'middle'"),
        ({"x": {"neutral": {"filters": []}}}, r"policies.x.neutral: a pipeline is a mapping"),
        ({"x": {"neutral": {"selector": {"name": "nope"}}}}, r"unknown selector 'nope'"),
        ({"x": {"neutral": {"selector": {"name": "metric_based", "metrics": ["nope"]}}}}, r"unknown metric 'nope'"),
        ({"x": {"neutral": {"selector": {"name": "metric_based", "metrics": []}}}}, r"needs at least one metric"),
        (
            {"x": {"neutral": {"selector": "round_robin", "filters": [{"name": "failover", "zone": "a"}]}}},
            r"no parameter zone",
        ),
        # predicted_ttft reads the LRS in lite mode since it became the default's metric; the CMS load stays full-only
        (
            {"x": {"neutral": {"selector": {"name": "metric_based", "metrics": ["all_prefills_tokens_num"]}}}},
            r"needs full mode",
        ),
        ({"load-balance": {}}, r"built-in policy name"),
        ({"x": {"neutral": {"selector": "round_robin", "colour": 1}}}, r"unknown key colour"),
    ],
)
def test_bad_yaml_policies_fail_with_one_line(policies: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_policy(SchedulerConfig(scheduling_policy="x", policies=policies))
    assert "\n" not in str(info.value)


# -- the load-ordered index decides exactly like the scan ------------------------------------------------

FILTER_SETS = [
    [],
    ["schedulability"],
    ["schedulability", "staleness", "failover-node"],
    ["schedulability", "staleness", "threshold", "failover-instance-unit"],
    ["staleness", "threshold", "failover-node-unit"],
    ["threshold"],
]


def _pipeline(names: list[str], metrics: list[str], top_k: int, seed: int, c: PolicyContext) -> Pipeline:
    """`metrics` ranked by metric_based; after a leading "cache_aware", by that selector."""
    banded = metrics[0] == "cache_aware"
    ms = [METRICS.get(n)(c) for n in metrics[banded:]]
    filters = []
    for name in names:
        if name == "schedulability":
            filters.append(SchedulabilityFilter())
        elif name == "staleness":
            filters.append(StalenessFilter(5.0, ctx=c))
        elif name == "threshold":
            filters.append(MetricBasedFilter(ms[0], 3000))
        else:
            filters.append(FailoverFilter(name.removeprefix("failover-")))
    if banded:
        return Pipeline(filters, CacheAwareSelector(ms, top_k=top_k, rng=random.Random(seed)))
    return Pipeline(filters, MetricBasedSelector(ms, top_k=top_k, rng=random.Random(seed)))


instance_state = st.tuples(
    st.integers(0, 5000),  # uncomputed prefill tokens
    st.integers(0, 10_000),  # used KV
    st.booleans(),  # schedulable
    st.sampled_from([0.0, 0.004, 0.05, 1.0, 9.0, -0.5]),  # age of the status, seconds (< 0: clock skew)
    st.integers(0, 3),  # node
    st.integers(0, 3),  # unit
    st.integers(0, 4),  # in-flight requests
)


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(instance_state, min_size=1, max_size=40),
    filters=st.sampled_from(FILTER_SETS),
    metrics=st.sampled_from(
        [
            ["all_prefills_tokens_num"],
            ["num_requests", "kv_cache_usage_ratio_projected"],
            ["kv_cache_hit_len", "all_prefills_tokens_num"],
            ["cache_aware_all_prefills_tokens_num"],
            ["cache_aware_all_prefills_tokens_num", "num_requests"],
            ["cache_aware", "kv_cache_hit_len", "all_prefills_tokens_num"],
            ["cache_aware", "kv_cache_hit_len", "num_requests", "kv_cache_usage_ratio_projected"],
            ["cache_aware", "cache_aware_all_prefills_tokens_num", "all_prefills_tokens_num", "num_requests"],
        ]
    ),
    top_k=st.integers(1, 3),
    count=st.integers(1, 4),
    changes=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 5000)), max_size=10),
    cached=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 3)), max_size=8),
)
def test_index_walk_equals_scan(
    states: list[tuple],
    filters: list[str],
    metrics: list[str],
    top_k: int,
    count: int,
    changes: list[tuple],
    cached: list[tuple],
) -> None:
    index_of_prefixes = PrefixIndex()
    for k, depth in cached:
        index_of_prefixes.record_dispatch(f"i{k:02d}", REQ.prefix_block_hashes[:depth])
    c = ctx(prefix_index=index_of_prefixes)
    c.begin(REQ)
    views = []
    for k, (prefill, used, ok, age, node, unit, inflight) in enumerate(states):
        v = view(
            f"i{k:02d}",
            uncomputed_prefill_tokens=prefill,
            used_kv_tokens=used,
            schedulable=ok,
            timestamp_ms=int((NOW - age) * 1000),
            num_waiting=inflight,
        )
        v.node_id, v.unit_id = f"n{node}", f"u{unit}"
        v.inflight = InflightLoad(requests=inflight, prefill_tokens=inflight * 100)
        v.step_model = StepTimeModel(LatencyProfile(base_ms=5.0 + k % 7), 2.0)  # rates differ per instance
        v.max_num_batched_tokens = 256 * (1 + k % 4)
        views.append(v)
    scan = _pipeline(filters, metrics, top_k, 3, c)
    walk = _pipeline(filters, metrics, top_k, 3, c)
    assert indexable_pipeline(walk)
    index = LoadIndex(walk, views)
    for k, prefill in [(-1, 0), *changes]:  # decide, then change one instance and decide again
        if 0 <= k < len(views):
            views[k].status.uncomputed_prefill_tokens = prefill  # type: ignore[union-attr]
            index.rekey(views[k])
        try:
            expected = [i.instance_id for i in scan.run(views, REQ, count)]
        except NoSchedulableInstanceError:
            with pytest.raises(NoSchedulableInstanceError):
                walk.run(views, REQ, count, index)
            continue
        assert [i.instance_id for i in walk.run(views, REQ, count, index)] == expected


@pytest.mark.parametrize(
    ("filters", "selector", "indexable"),
    [
        ([], MetricBasedSelector([METRICS.get("num_requests")()]), True),
        ([], MetricBasedSelector([METRICS.get("kv_cache_hit_len")()]), True),  # sparse head, merged
        # request-dependent, with a floor per instance: walked by the floor (BoundedLoadIndex)
        ([], MetricBasedSelector([METRICS.get("predicted_ttft")()]), True),
        # no floor first: scanned
        ([], MetricBasedSelector([METRICS.get("predicted_tpot")()]), False),
        # forward-predicted prefill ahead: no state to keep between changes, scanned
        ([], MetricBasedSelector([METRICS.get("predicted_ttft")(ctx(predictor_enhanced=True))]), False),
        ([], MetricBasedSelector([METRICS.get("num_requests")(), METRICS.get("kv_cache_hit_len")()]), False),
        ([], CacheAwareSelector([METRICS.get("kv_cache_hit_len")(), METRICS.get("num_requests")()]), True),
        (
            [],
            CacheAwareSelector(
                [METRICS.get("cache_aware_all_prefills_tokens_num")(), METRICS.get("all_prefills_tokens_num")()]
            ),
            True,
        ),
        # a cost head whose non-hit values do not follow the band metric's order: scanned
        (
            [],
            CacheAwareSelector([METRICS.get("cache_aware_all_prefills_tokens_num")(), METRICS.get("num_requests")()]),
            False,
        ),
        (
            [],
            CacheAwareSelector(
                [METRICS.get(n)() for n in ("kv_cache_hit_len", "predicted_ttft", "predicted_tpot")]
            ),
            True,
        ),  # the default, predicted-latency
        (
            [],
            CacheAwareSelector(
                [METRICS.get(n)() for n in ("cache_aware_all_prefills_tokens_num", "predicted_ttft")]
            ),
            False,
        ),  # misses differ in the head's value: their order is not the floor's
        (
            [MetricBasedFilter(METRICS.get("num_requests")(), 3), SchedulabilityFilter()],
            MetricBasedSelector([METRICS.get("num_requests")()]),
            False,
        ),  # marking after a plain filter
    ],
)
def test_indexable_pipelines(filters: list, selector: MetricBasedSelector, indexable: bool) -> None:
    assert indexable_pipeline(Pipeline(filters, selector)) is indexable
