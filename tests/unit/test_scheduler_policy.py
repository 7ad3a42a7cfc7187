"""Policy stages, table-driven: metrics, metric-based filter, selectors, fallback pass, registry."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import Candidate, InstanceFilter, Metric, Pipeline
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.metrics.counts import NumRequests, NumTokens
from pilotfish.scheduler.policy.registry import (
    FILTERS,
    METRICS,
    SELECTORS,
    build_policy,
    verify_dispatch_load_metric,
)
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.policy.selectors.round_robin import RoundRobinSelector
from pilotfish.scheduler.view.types import Endpoint, InstanceView, LrsLoad, RequestInfo

REQ = RequestInfo(request_id="r", model="m", prompt_tokens=100)


def inst(name: str, requests: int = 0, tokens: int = 0) -> InstanceView:
    return InstanceView(Endpoint(name, f"{name}:8000"), lrs=LrsLoad(num_requests=requests, num_tokens=tokens))


def cands(*loads: tuple[str, dict[str, float]]) -> list[Candidate]:
    return [Candidate(inst(name), dict(values)) for name, values in loads]


def names(selected: list[Candidate] | list[InstanceView]) -> list[str]:
    return [c.inst.instance_id if isinstance(c, Candidate) else c.instance_id for c in selected]


class Higher(Metric):
    """A higher-is-better metric, to test direction handling."""

    name = "higher"
    lower_is_better = False

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return inst.lrs.num_requests


# -- metrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "lrs", "expected"),
    [
        (NumRequests(), LrsLoad(), 0),
        (NumRequests(), LrsLoad(num_requests=3, num_tokens=900), 3),
        (NumTokens(), LrsLoad(), 0),
        (NumTokens(), LrsLoad(num_requests=3, num_tokens=900), 900),
        (NumTokens(), LrsLoad(num_requests=1, num_tokens=7, num_decode_requests=1), 7),
    ],
)
def test_metric_value(metric: Metric, lrs: LrsLoad, expected: float) -> None:
    view = InstanceView(Endpoint("a", "a:1"), lrs=lrs)
    assert metric.value(view, REQ) == expected


@pytest.mark.parametrize(
    ("metric", "a", "b", "a_better"),
    [
        (NumRequests(), 1, 2, True),
        (NumRequests(), 2, 1, False),
        (NumRequests(), 2, 2, False),
        (NumTokens(), 10, 100, True),
        (Higher(), 2, 1, True),
        (Higher(), 1, 2, False),
    ],
)
def test_metric_direction(metric: Metric, a: float, b: float, a_better: bool) -> None:
    assert metric.better(a, b) is a_better


@pytest.mark.parametrize("cls", [NumRequests, NumTokens])
def test_lite_metrics_are_registered_by_spec_name(cls: type[Metric]) -> None:
    assert METRICS.get(cls.name) is cls
    assert cls.lite and cls.lower_is_better


# -- metric-based filter -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "threshold", "value", "passes"),
    [
        (NumRequests(), 4, 3, True),
        (NumRequests(), 4, 4, True),  # at the threshold is still acceptable
        (NumRequests(), 4, 5, False),
        (NumTokens(), 1000, 999, True),
        (NumTokens(), 1000, 1001, False),
        (Higher(), 4, 5, True),  # higher-is-better: blocks what falls below
        (Higher(), 4, 3, False),
    ],
)
def test_metric_based_filter(metric: Metric, threshold: float, value: float, passes: bool) -> None:
    flt = MetricBasedFilter(metric, threshold)
    (cand,) = cands(("a", {metric.name: value}))
    assert flt.passes(cand, REQ) is passes


# -- metric-based selector -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "count", "expected"),
    [
        # ranked by the metric, best first
        ({"a": 3, "b": 1, "c": 2}, 3, ["b", "c", "a"]),
        ({"a": 3, "b": 1, "c": 2}, 1, ["b"]),
        ({"a": 3, "b": 1, "c": 2}, 2, ["b", "c"]),
        # ties keep the candidates' stable order
        ({"a": 1, "b": 1, "c": 1}, 3, ["a", "b", "c"]),
        ({"a": 2, "b": 1, "c": 1}, 3, ["b", "c", "a"]),
        # asking for more than there are returns them all
        ({"a": 0}, 5, ["a"]),
    ],
)
def test_metric_based_selector_ranks(loads: dict[str, float], count: int, expected: list[str]) -> None:
    selector = MetricBasedSelector([NumRequests()], top_k=1)
    selected = selector.select(cands(*((n, {"num_requests": v}) for n, v in loads.items())), REQ, count)
    assert names(selected) == expected


@pytest.mark.parametrize(
    ("second", "values", "expected"),
    [
        # the second metric breaks ties of the first
        (NumTokens(), {"a": (1, 50), "b": (1, 10), "c": (2, 0)}, ["b", "a", "c"]),
        # the first metric dominates the second
        (NumTokens(), {"a": (2, 0), "b": (1, 99)}, ["b", "a"]),
        # a higher-is-better second metric
        (Higher(), {"a": (1, 1), "b": (1, 5)}, ["b", "a"]),
    ],
)
def test_metric_based_selector_metric_list(
    second: Metric, values: dict[str, tuple[float, float]], expected: list[str]
) -> None:
    selector = MetricBasedSelector([NumRequests(), second])
    table = cands(*((n, {"num_requests": v[0], second.name: v[1]}) for n, v in values.items()))
    assert names(selector.select(table, REQ, 3)) == expected


@pytest.mark.parametrize(("top_k", "n"), [(2, 5), (3, 5), (5, 5), (8, 3)])
def test_top_k_picks_only_among_the_best_k(top_k: int, n: int) -> None:
    selector = MetricBasedSelector([NumRequests()], top_k=top_k, rng=random.Random(7))
    table = cands(*((f"i{v}", {"num_requests": v}) for v in range(n)))
    picks = Counter(names(selector.select(table, REQ, 1))[0] for _ in range(600))
    allowed = {f"i{v}" for v in range(min(top_k, n))}
    assert set(picks) == allowed  # every one of the best K is reachable, nothing else is


def test_top_k_fallbacks_are_the_rest_of_the_ranking() -> None:
    selector = MetricBasedSelector([NumRequests()], top_k=3, rng=random.Random(1))
    table = cands(*((f"i{v}", {"num_requests": v}) for v in range(6)))
    for _ in range(50):
        ranked = names(selector.select(table, REQ, 4))
        assert len(ranked) == 4 and len(set(ranked)) == 4
        rest = [n for n in ["i0", "i1", "i2", "i3", "i4", "i5"] if n != ranked[0]]
        assert ranked[1:] == rest[:3]


@pytest.mark.parametrize("bad", [{"metrics": []}, {"metrics": [NumRequests()], "top_k": 0}])
def test_metric_based_selector_rejects_bad_parameters(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MetricBasedSelector(**bad)  # type: ignore[arg-type]


# -- round robin ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "count", "expected"),
    [
        (3, 1, [["a"], ["b"], ["c"], ["a"]]),
        (3, 3, [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]),
        (2, 3, [["a", "b"], ["b", "a"], ["a", "b"]]),
        (1, 2, [["a"], ["a"]]),
    ],
)
def test_round_robin(n: int, count: int, expected: list[list[str]]) -> None:
    selector = RoundRobinSelector()
    table = cands(*((name, {}) for name in "abc"[:n]))
    assert [names(selector.select(table, REQ, count)) for _ in expected] == expected


def test_round_robin_ignores_load() -> None:
    selector = RoundRobinSelector()
    table = cands(("a", {"num_requests": 100}), ("b", {"num_requests": 0}))
    assert [names(selector.select(table, REQ, 1))[0] for _ in range(4)] == ["a", "b", "a", "b"]


# -- pipeline: filters then selector, with the fallback pass ------------------------------------


class BlockNamed(InstanceFilter):
    """Blocks the named instances; kept in the fallback pass when asked to."""

    name = "block_named"

    def __init__(self, blocked: set[str], *, not_skip_when_fallback: bool = False) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        self.blocked = blocked

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        return cand.inst.instance_id not in self.blocked


@pytest.mark.parametrize(
    ("requests", "threshold", "hard_blocked", "expected"),
    [
        # no filter blocks: plain ranking
        ({"a": 1, "b": 0, "c": 2}, None, set(), ["b", "a", "c"]),
        # the threshold removes c; the rest ranked
        ({"a": 1, "b": 0, "c": 5}, 2, set(), ["b", "a"]),
        # everything over the threshold: the fallback pass skips it and ranks all
        ({"a": 7, "b": 5, "c": 6}, 2, set(), ["b", "c", "a"]),
        # a filter kept in the fallback pass still applies there
        ({"a": 7, "b": 5, "c": 6}, 2, {"b"}, ["c", "a"]),
        # the hard filter alone
        ({"a": 0, "b": 0, "c": 0}, None, {"a"}, ["b", "c"]),
    ],
)
def test_pipeline_filters_and_fallback_pass(
    requests: dict[str, int], threshold: float | None, hard_blocked: set[str], expected: list[str]
) -> None:
    metric = NumRequests()
    filters: list[InstanceFilter] = [BlockNamed(hard_blocked, not_skip_when_fallback=True)]
    if threshold is not None:
        filters.append(MetricBasedFilter(metric, threshold))
    pipeline = Pipeline(filters, MetricBasedSelector([metric]))
    views = [inst(n, requests=v) for n, v in requests.items()]
    assert names(pipeline.run(views, REQ, 3)) == expected


def test_pipeline_everything_blocked_names_the_filter() -> None:
    pipeline = Pipeline([BlockNamed({"a", "b"}, not_skip_when_fallback=True)], RoundRobinSelector())
    with pytest.raises(NoSchedulableInstanceError, match=r"all 2 instances .*block_named: 2"):
        pipeline.run([inst("a"), inst("b")], REQ, 1)


def test_pipeline_no_instances() -> None:
    pipeline = Pipeline([], RoundRobinSelector())
    with pytest.raises(NoSchedulableInstanceError, match="no instance serves model 'm'"):
        pipeline.run([], REQ, 1)


def test_pipeline_computes_each_metric_once_per_candidate() -> None:
    calls: Counter[str] = Counter()

    class Counted(NumRequests):
        def value(self, inst: InstanceView, req: RequestInfo) -> float:
            calls[inst.instance_id] += 1
            return super().value(inst, req)

    metric = Counted()
    pipeline = Pipeline([MetricBasedFilter(metric, 10)], MetricBasedSelector([metric]))
    pipeline.run([inst("a"), inst("b")], REQ, 2)
    assert calls == {"a": 1, "b": 1}


# -- registry and the built-in policies ---------------------------------------------------------


@pytest.mark.parametrize(
    ("registry", "name"),
    [(FILTERS, "metric_based"), (SELECTORS, "metric_based"), (SELECTORS, "round_robin")],
)
def test_stages_registered(registry: object, name: str) -> None:
    assert registry.get(name).name == name  # type: ignore[attr-defined]


def test_unknown_stage_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown metric 'nope' \(known: all_decodes_tokens_num, .*num_tokens"):
        METRICS.get("nope")


@pytest.mark.parametrize(
    ("metric", "ok"),
    [
        ("num_requests", True),
        ("num_tokens", True),
        ("kv_cache_usage_ratio_projected", False),
        ("all_prefills_tokens_num", False),
        ("bogus", False),
    ],
)
def test_verify_dispatch_load_metric_lite(metric: str, ok: bool) -> None:
    config = SchedulerConfig(scheduling_policy="load-balance", dispatch_load_metric=metric)
    if ok:
        assert verify_dispatch_load_metric(config).name == metric
    else:
        with pytest.raises(ConfigError, match="not available in lite mode"):
            verify_dispatch_load_metric(config)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("load-balance", ["b", "c", "a"]), ("round-robin", ["a", "b", "c"])],
)
def test_built_in_policies(policy: str, expected: list[str]) -> None:
    built = build_policy(SchedulerConfig(scheduling_policy=policy, fallback_count=2))
    views = [inst("a", requests=2), inst("b", requests=0), inst("c", requests=1)]
    selection = built.schedule(views, REQ, fallback_count=2)
    assert names([selection.target, *selection.fallbacks]) == expected


def test_unknown_policy() -> None:
    with pytest.raises(ConfigError, match="--scheduling-policy: unknown policy 'nope'"):
        build_policy(SchedulerConfig(scheduling_policy="nope"))
    with pytest.raises(ConfigError, match="--scheduling-policy: slo needs full mode"):
        build_policy(SchedulerConfig(scheduling_policy="slo"))


def test_load_balance_threshold_from_config() -> None:
    config = SchedulerConfig(
        scheduling_policy="load-balance", dispatch_load_metric="num_tokens", dispatch_load_threshold=500
    )
    built = build_policy(config)
    views = [inst("a", tokens=400), inst("b", tokens=900), inst("c", tokens=100)]
    selection = built.schedule(views, REQ, fallback_count=5)
    assert names([selection.target, *selection.fallbacks]) == ["c", "a"]
