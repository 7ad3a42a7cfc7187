"""The load index answers forward-predicted load (predictor-enhanced all_prefills_tokens_num) exactly as
the scan does, while the clock moves and instances change, and visits few instances doing it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import Pipeline
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.index import PredictedLoadIndex, indexable_pipeline, load_index
from pilotfish.scheduler.policy.registry import METRICS, build_policy
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.view.predictor import StepTimeModel
from pilotfish.scheduler.view.profile import LatencyProfile
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InflightLoad, InstanceView, RequestInfo

NOW = 10_000.0
REQ = RequestInfo("r", "m", prompt_tokens=200)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _pipeline(names: list[str], top_k: int, c: PolicyContext, extra: bool) -> Pipeline:
    metric = METRICS.get("all_prefills_tokens_num")(c)
    filters: list = []
    for name in names:
        if name == "schedulability":
            filters.append(SchedulabilityFilter())
        elif name == "staleness":
            filters.append(StalenessFilter(5.0, ctx=c))
        elif name == "threshold":
            filters.append(MetricBasedFilter(metric, 3000))
        else:
            filters.append(FailoverFilter(name.removeprefix("failover-")))
    if extra:  # a threshold on another metric: its value is computed for the candidates visited
        filters.append(MetricBasedFilter(METRICS.get("kv_cache_usage_ratio_projected")(c), 0.6))
    return Pipeline(filters, MetricBasedSelector([metric], top_k=top_k, rng=random.Random(7)))


FILTER_SETS = [
    [],
    ["schedulability"],
    ["schedulability", "staleness", "failover-node"],
    ["schedulability", "staleness", "threshold", "failover-instance-unit"],
    ["staleness", "threshold", "failover-node-unit"],
    ["threshold"],
]

instance_state = st.tuples(
    st.sampled_from([0, 1, 7, 300, 2000, 5000, 20_000]),  # uncomputed prefill tokens
    st.integers(0, 10_000),  # used KV
    st.booleans(),  # schedulable
    st.sampled_from([0.0, 0.001, 0.004, 0.05, 0.3, 1.0, 9.0, 30.0, -0.5, None]),  # status age, s (None: no status)
    st.integers(0, 3),  # node
    st.integers(0, 3),  # unit
    st.sampled_from([0, 0, 0, 1, 3]),  # in-flight requests (100 prefill tokens each)
    st.integers(0, 200),  # running decode batch: slows the rate
    st.booleans(),  # has a step-time fit
)


def _view(k: int, state: tuple) -> InstanceView:
    prefill, used, ok, age, node, unit, inflight, batch, fitted = state
    status = None
    if age is not None:
        status = EngineStatus(
            timestamp_ms=int((NOW - age) * 1000),
            schedulable=ok,
            total_kv_tokens=10_000,
            uncomputed_prefill_tokens=prefill,
            used_kv_tokens=used,
            num_running_decode=batch,
            running_decode_seq_len_sum=batch * 700,
        )
    v = InstanceView(Endpoint(f"i{k:02d}", f"h{k}:1", InferType.NEUTRAL), status=status)
    v.node_id, v.unit_id = f"n{node}", f"u{unit}"
    v.inflight = InflightLoad(requests=inflight, prefill_tokens=inflight * 100)
    if fitted:
        # rates differ per instance, across powers of two
        v.step_model = StepTimeModel(
            LatencyProfile(base_ms=2.0 + 3 * (k % 9), prefill_ms_per_token=0.01 * (1 + k % 5)), 2.0
        )
    v.max_num_batched_tokens = 256 * (1 + k % 4)
    return v


@settings(max_examples=400, deadline=None)
@given(
    states=st.lists(instance_state, min_size=1, max_size=48),
    filters=st.sampled_from(FILTER_SETS),
    extra=st.booleans(),
    top_k=st.integers(1, 3),
    count=st.integers(1, 4),
    steps=st.lists(
        st.tuples(
            # clock advance, s (a step back now and then: what the clock settled must drain again)
            st.sampled_from([0.0, 0.0005, 0.01, 0.2, 2.0, 12.0, -0.3]),
            st.integers(-1, 47),  # instance that changes (-1: none)
            st.sampled_from([0, 5, 900, 4000, 20_000]),  # its new uncomputed prefill tokens
            st.sampled_from([0.0, 0.02, -0.3]),  # its new status age
            st.sampled_from([None, 0, 2]),  # its new in-flight requests (None: as they were)
            st.integers(-1, 47),  # an instance re-keyed with nothing changed (a Release of a confirmed request)
        ),
        max_size=12,
    ),
)
def test_predicted_index_equals_scan(
    states: list[tuple],
    filters: list[str],
    extra: bool,
    top_k: int,
    count: int,
    steps: list[tuple],
) -> None:
    clock = Clock()
    c = PolicyContext(wall_clock=clock, full_mode=True, predictor_enhanced=True, instance_staleness_seconds=10.0)
    views = [_view(k, s) for k, s in enumerate(states)]
    scan = _pipeline(filters, top_k, c, extra)
    walk = _pipeline(filters, top_k, c, extra)
    assert indexable_pipeline(walk)
    index = load_index(walk, views)
    assert isinstance(index, PredictedLoadIndex)
    for advance, k, prefill, age, inflight, touched in [(0.0, -1, 0, 0.0, None, -1), *steps]:
        clock.now += advance
        if 0 <= k < len(views):
            v = views[k]
            v.status = EngineStatus(
                timestamp_ms=int((clock.now - age) * 1000),
                total_kv_tokens=10_000,
                uncomputed_prefill_tokens=prefill,
                num_running_decode=k,
            )
            if inflight is not None:
                v.inflight = InflightLoad(requests=inflight, prefill_tokens=inflight * 100)
            index.rekey(v)
        if 0 <= touched < len(views):
            index.rekey(views[touched])
        c.begin(REQ)
        try:
            expected = [i.instance_id for i in scan.run(views, REQ, count)]
        except NoSchedulableInstanceError:
            with pytest.raises(NoSchedulableInstanceError):
                walk.run(views, REQ, count, index)
            continue
        assert [i.instance_id for i in walk.run(views, REQ, count, index)] == expected


def test_predicted_pipelines_are_indexed_and_others_still_scan() -> None:
    def pipeline(**flags: object) -> Pipeline:
        config = SchedulerConfig(scheduling_policy="load-balance", enable_full_mode_scheduling=True, **flags)  # type: ignore[arg-type]
        return build_policy(config).pipelines[InferType.NEUTRAL]

    assert pipeline(enable_predictor_enhanced_scheduling=True).indexable
    # the cache head with a predicted load behind it has no drain order: it scans
    assert not pipeline(enable_predictor_enhanced_scheduling=True, enable_cache_aware_scheduling=True).indexable


def test_a_decision_visits_few_instances() -> None:
    """4,096 busy instances with statuses of different ages: the decision computes a handful of values."""
    rng = random.Random(3)
    clock = Clock()
    c = PolicyContext(wall_clock=clock, full_mode=True, predictor_enhanced=True)
    model = StepTimeModel(LatencyProfile(), 2.0)
    views = []
    for k in range(4096):
        v = InstanceView(Endpoint(f"i{k:04d}", f"h{k}:1"))
        v.status = EngineStatus(
            timestamp_ms=int((NOW - rng.uniform(0, 0.05)) * 1000),
            uncomputed_prefill_tokens=rng.randrange(5_000, 20_000),
            num_running_decode=rng.randrange(0, 64),
            running_decode_seq_len_sum=rng.randrange(0, 100_000),
        )
        v.step_model = model
        v.max_num_batched_tokens = 8192
        views.append(v)
    metric = METRICS.get("all_prefills_tokens_num")(c)
    calls = 0
    value = metric.value

    def counted(inst: InstanceView, req: RequestInfo) -> float:
        nonlocal calls
        calls += 1
        return value(inst, req)

    pipeline = Pipeline([SchedulabilityFilter()], MetricBasedSelector([metric]))
    index = load_index(pipeline, views)
    metric.value = counted  # type: ignore[method-assign]
    c.begin(REQ)
    ranked = pipeline.run(views, REQ, 3, index)
    visited = calls
    metric.value = value  # type: ignore[method-assign]
    expected = sorted(views, key=lambda v: (value(v, REQ), v.instance_id))[:3]
    assert [v.instance_id for v in ranked] == [v.instance_id for v in expected]
    assert visited < 100, visited


def test_core_with_predictor_enhanced_scheduling_uses_the_index() -> None:
    from pilotfish.protos import cms_pb2

    core = SchedulerCore(
        SchedulerConfig(
            scheduling_policy="load-balance",
            enable_full_mode_scheduling=True,
            enable_predictor_enhanced_scheduling=True,
            model=["m"],
        )
    )
    for k in range(32):
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=f"i{k:02d}", host="h", http_port=1 + k, model="m"))
        core.apply_status(
            cms_pb2.InstanceStatus(
                instance_id=f"i{k:02d}",
                update_id=1,
                timestamp_ms=int(core.ctx.wall_clock() * 1000),
                schedulable=True,
                uncomputed_prefill_tokens=1000 + 100 * ((k * 7) % 32),
            )
        )
    decision = core.schedule(RequestInfo("a", "m", prompt_tokens=10))
    stage = core._by_model["m"].stages[InferType.NEUTRAL]
    assert isinstance(stage.index, PredictedLoadIndex)
    assert decision.target.instance_id == "i00"  # 1000 tokens at the status: the least
