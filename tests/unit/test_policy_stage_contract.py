"""A stage declares what it needs (lite, prefix cache, index capability); the index, the registry's
validation, the core and the rescheduler ask it. Test-only stages, registered here and nowhere else,
are served like the built-in ones: indexed exactly as scanned, validated, given a prefix index."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import (
    Candidate,
    ExportedFamily,
    GlobalFilter,
    InstanceFilter,
    InstanceHealth,
    Metric,
    MissValue,
    Pipeline,
)
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.index import LoadIndex, indexable_pipeline
from pilotfish.scheduler.policy.registry import (
    FILTERS,
    METRICS,
    cache_locality_metrics,
    lite_load_metrics,
    policy_from_spec,
    verify_dispatch_load_metric,
)
from pilotfish.scheduler.rescheduler.settings import check_config
from pilotfish.scheduler.telemetry import policy_metric_family
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InstanceView, RequestInfo

NOW = 10_000.0
REQ = RequestInfo("r", "m", prompt_tokens=200, prefix_block_hashes=(1, 2, 3), prefix_block_size=16)


# -- the test's own stages: each one class, registered by the fixture below ------------------------------


class KvCacheMissLen(Metric):
    """Prompt tokens the instance would prefill: the prompt less its cached prefix (lower is better)."""

    name = "test_kv_cache_miss_len"
    lite = True
    indexable = False
    cache_locality = True
    uses_prefix_cache = True

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return max(0, req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.instance_id, 0))

    def miss_value(self) -> MissValue:
        return MissValue(None, lambda req: float(req.prompt_tokens))


class LrsPrefillTokens(Metric):
    """Prompt tokens of the held requests not past their prefill (the LRS)."""

    name = "test_lrs_prefill_tokens"
    lite = True

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return inst.lrs.prefill_tokens


class FreshWithin(InstanceFilter):
    """Status no older than `seconds`; marks needsFailover; the index answers it from its health."""

    name = "test_fresh_within"
    marks_failover = True
    health_indexed = True

    def __init__(self, seconds: float = 5.0, *, not_skip_when_fallback: bool = True, ctx: Any = None) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.seconds = seconds
        self.ctx = ctx

    def _cutoff_ms(self) -> float:
        return (self.ctx.now - self.seconds) * 1000.0

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        s = cand.inst.status
        return s is not None and s.timestamp_ms >= self._cutoff_ms()

    def blocked_in(self, health: InstanceHealth) -> AbstractSet[str]:
        return health.without_status() | health.stamped_before(self._cutoff_ms())


class Unscanned(FreshWithin):
    """The same filter without an index capability declared: its pipelines scan."""

    name = "test_unscanned"
    health_indexed = False


class _Ids:
    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def blocks(self, inst: InstanceView) -> bool:
        return inst.instance_id in self.ids


class Quarantine(GlobalFilter):
    """Blocks the marked instances and those whose id shares their last digit."""

    name = "test_quarantine"
    indexable = True

    def __init__(self, *, not_skip_when_fallback: bool = True) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)

    def blocker(self, marked: Iterable[InstanceView], population: Iterable[InstanceView]) -> _Ids:
        digits = {i.instance_id[-1] for i in marked}
        return _Ids({i.instance_id for i in population if i.instance_id[-1] in digits})

    def apply(
        self, cands: list[Candidate], req: RequestInfo, marked: Sequence[Candidate], population: Sequence[Candidate]
    ) -> list[Candidate]:
        if not marked:
            return cands
        blocker = self.blocker((c.inst for c in marked), (c.inst for c in population))
        return [c for c in cands if not blocker.blocks(c.inst)]


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    for registry, classes in (
        (METRICS, (KvCacheMissLen, LrsPrefillTokens)),
        (FILTERS, (FreshWithin, Unscanned, Quarantine)),
    ):
        for cls in classes:
            registry.register(cls)
    try:
        yield
    finally:
        for registry, names in (
            (METRICS, (KvCacheMissLen.name, LrsPrefillTokens.name)),
            (FILTERS, (FreshWithin.name, Unscanned.name, Quarantine.name)),
        ):
            for name in names:
                registry.unregister(name)


def _ctx(prefix_index: PrefixIndex | None = None) -> PolicyContext:
    return PolicyContext(wall_clock=lambda: NOW, full_mode=True, prefix_index=prefix_index)


def _policy(spec: dict[str, Any], c: PolicyContext, seed: int = 3) -> Pipeline:
    return policy_from_spec("t", {"neutral": spec}, c, random.Random(seed), full_mode=True).pipelines[InferType.NEUTRAL]


FILTER_SETS: list[list[Any]] = [
    [],
    ["test_fresh_within"],
    ["test_fresh_within", "test_quarantine"],
    [
        "test_fresh_within",
        {"name": "metric_based", "metric": "test_lrs_prefill_tokens", "threshold": 300},
        "test_quarantine",
    ],
    ["schedulability", "test_fresh_within", {"name": "failover", "domain": "node"}, "test_quarantine"],
]
SELECTORS: list[dict[str, Any]] = [
    {"name": "metric_based", "metrics": ["test_kv_cache_miss_len", "test_lrs_prefill_tokens"]},
    {"name": "metric_based", "metrics": ["test_lrs_prefill_tokens", "num_requests"]},
    {
        "name": "cache_aware",
        "metrics": ["test_kv_cache_miss_len", "test_lrs_prefill_tokens"],
        "balance_abs_threshold": 150,
    },
    {"name": "cache_aware", "metrics": ["kv_cache_hit_len", "test_lrs_prefill_tokens"]},
]

instance_state = st.tuples(
    st.integers(0, 600),  # LRS prefill tokens
    st.booleans(),  # schedulable
    st.sampled_from([0.0, 1.0, 9.0, None]),  # status age, s (None: no status)
    st.integers(0, 3),  # node
)


@settings(max_examples=200, deadline=None)
@given(
    states=st.lists(instance_state, min_size=1, max_size=30),
    filters=st.sampled_from(FILTER_SETS),
    selector=st.sampled_from(SELECTORS),
    top_k=st.integers(1, 3),
    count=st.integers(1, 4),
    cached=st.lists(st.tuples(st.integers(0, 29), st.integers(1, 3)), max_size=8),
    changes=st.lists(st.tuples(st.integers(0, 29), st.integers(0, 600)), max_size=6),
)
def test_the_index_serves_a_new_stage_exactly_as_the_scan(
    states: list[tuple],
    filters: list[Any],
    selector: dict[str, Any],
    top_k: int,
    count: int,
    cached: list[tuple[int, int]],
    changes: list[tuple[int, int]],
) -> None:
    prefixes = PrefixIndex()
    for k, depth in cached:
        prefixes.record_dispatch(f"i{k:02d}", REQ.prefix_block_hashes[:depth])
    c = _ctx(prefixes)
    c.begin(REQ)
    views = []
    for k, (prefill, ok, age, node) in enumerate(states):
        status = None if age is None else EngineStatus(timestamp_ms=int((NOW - age) * 1000), schedulable=ok)
        v = InstanceView(Endpoint(f"i{k:02d}", f"h{k}:1"), status=status)
        v.node_id = f"n{node}"
        v.lrs.prefill_tokens = prefill
        v.lrs.num_requests = prefill // 100
        views.append(v)
    spec = {"filters": filters, "selector": {**selector, "top_k": top_k}}
    scan, walk = _policy(spec, c), _policy(spec, c)
    assert indexable_pipeline(walk)
    index = LoadIndex(walk, views)
    for k, prefill in [(-1, 0), *changes]:  # decide, then change one instance and decide again
        if 0 <= k < len(views):
            views[k].lrs.prefill_tokens = prefill
            index.rekey(views[k])
        try:
            expected = [i.instance_id for i in scan.run(views, REQ, count)]
        except NoSchedulableInstanceError:
            with pytest.raises(NoSchedulableInstanceError):
                walk.run(views, REQ, count, index)
            continue
        assert [i.instance_id for i in walk.run(views, REQ, count, index)] == expected


@pytest.mark.parametrize(
    ("spec", "indexable"),
    [
        ({"filters": ["test_fresh_within"], "selector": {"name": "metric_based", "metrics": ["num_requests"]}}, True),
        # a marking filter that declares no index capability
        ({"filters": ["test_unscanned"], "selector": {"name": "metric_based", "metrics": ["num_requests"]}}, False),
        # a global filter that does: served; one that does not (failover_migration_src): scanned
        ({"filters": ["test_quarantine"], "selector": {"name": "metric_based", "metrics": ["num_requests"]}}, True),
        (
            {"filters": ["failover_migration_src"], "selector": {"name": "metric_based", "metrics": ["num_requests"]}},
            False,
        ),
        # a cache metric with a miss value heads a ranking; behind another metric it is not indexable
        ({"selector": {"name": "metric_based", "metrics": ["test_kv_cache_miss_len", "num_requests"]}}, True),
        ({"selector": {"name": "metric_based", "metrics": ["num_requests", "test_kv_cache_miss_len"]}}, False),
        ({"selector": {"name": "round_robin"}}, False),
    ],
)
def test_indexability_is_what_the_stages_declare(spec: dict[str, Any], indexable: bool) -> None:
    assert _policy(spec, _ctx()).indexable is indexable


def test_the_core_keeps_a_prefix_index_for_a_metric_that_reads_one() -> None:
    def core(metric: str) -> SchedulerCore:
        spec = {"neutral": {"selector": {"name": "metric_based", "metrics": [metric]}}}
        return SchedulerCore(SchedulerConfig(scheduling_policy="t", policies={"t": spec}, model=["m"]))

    assert core("test_kv_cache_miss_len").prefix_index is not None
    assert core("test_lrs_prefill_tokens").prefix_index is None


def test_registry_validation_asks_the_stages() -> None:
    # a lite load of the instance alone may rank lite load-balance; a cache-locality metric heads it
    assert "test_lrs_prefill_tokens" in lite_load_metrics()
    assert "test_kv_cache_miss_len" not in lite_load_metrics()
    assert "test_kv_cache_miss_len" in cache_locality_metrics(lite=True)
    config = SchedulerConfig(scheduling_policy="load-balance", dispatch_load_metric="test_lrs_prefill_tokens")
    assert verify_dispatch_load_metric(config).name == "test_lrs_prefill_tokens"
    with pytest.raises(ConfigError, match="not available in lite mode"):
        verify_dispatch_load_metric(
            SchedulerConfig(scheduling_policy="load-balance", dispatch_load_metric="all_prefills_tokens_num")
        )
    # the rescheduler's load metric must be a load of the instance alone: not a cache-locality metric
    with pytest.raises(ConfigError, match="--rescheduling-neutral-load-metric: 'test_kv_cache_miss_len' is not a load"):
        check_config(
            SchedulerConfig(enable_full_mode_scheduling=True, rescheduling_neutral_load_metric="test_kv_cache_miss_len")
        )
    check_config(
        SchedulerConfig(enable_full_mode_scheduling=True, rescheduling_neutral_load_metric="test_lrs_prefill_tokens")
    )


def test_a_cache_locality_metric_must_say_it_reads_the_prefix_index() -> None:
    with pytest.raises(TypeError, match="uses_prefix_cache"):

        class Wrong(Metric):
            name = "wrong"
            cache_locality = True

            def value(self, inst: InstanceView, req: RequestInfo) -> float:
                return 0.0


def test_a_rescheduling_policy_checks_its_own_flags() -> None:
    from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
    from pilotfish.scheduler.rescheduler.registry import RESCHEDULING_POLICIES

    class NeedsUnits(ReschedulingPolicy):
        name = "test_needs_units"
        infer_type = InferType.NEUTRAL

        @classmethod
        def check_config(cls, config: SchedulerConfig) -> None:
            if config.rescheduling_load_balance_scope != "unit":
                raise ConfigError("--rescheduling-load-balance-scope: test_needs_units balances within units")

        def pairs(self, instances: Sequence[InstanceView]) -> list:
            return []

    RESCHEDULING_POLICIES.register(NeedsUnits)
    try:
        named = {"enable_full_mode_scheduling": True, "rescheduling_policies": ["neutral_load", NeedsUnits.name]}
        with pytest.raises(ConfigError, match="test_needs_units balances within units"):
            check_config(SchedulerConfig(**named))  # type: ignore[arg-type]
        check_config(SchedulerConfig(**named, rescheduling_load_balance_scope="unit"))  # type: ignore[arg-type]
        check_config(SchedulerConfig(enable_full_mode_scheduling=True))  # not named: not asked
    finally:
        RESCHEDULING_POLICIES.unregister(NeedsUnits.name)


def test_a_metric_says_how_it_is_exported() -> None:
    """Its Prometheus family, unit scale and help come from the class: a new metric needs no table
    elsewhere, and one that declares nothing still gets a family of its own."""

    class Seconds(LrsPrefillTokens):
        name = "test_prefill_seconds"
        exported = ExportedFamily("pilotfish_scheduler_policy_test_prefill_seconds", 1e-3, "Prefill ahead")

    METRICS.register(Seconds)
    try:
        assert policy_metric_family("test_prefill_seconds") == (
            "pilotfish_scheduler_policy_test_prefill_seconds", 1e-3, "Prefill ahead")
    finally:
        METRICS.unregister(Seconds.name)
    family, scale, _ = policy_metric_family("test_lrs_prefill_tokens")
    assert (family, scale) == ("pilotfish_scheduler_policy_test_lrs_prefill_tokens", 1.0)
    assert policy_metric_family("predicted_ttft")[:2] == ("pilotfish_scheduler_policy_predicted_ttft_seconds", 1e-3)
