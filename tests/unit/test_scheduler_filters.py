"""Filters, table-driven: schedulability, staleness, infer type, failover domains, migration sources."""

from __future__ import annotations

import pytest

from pilotfish.config import ConfigError
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.base import Candidate, Pipeline
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverFilter, FailoverMigrationSrcFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.policy.filters.infer_type import InferTypeFilter
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.metrics.counts import NumRequests
from pilotfish.scheduler.policy.registry import FILTERS
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.policy.selectors.round_robin import RoundRobinSelector
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InstanceView, RequestInfo

NOW = 5_000.0
REQ = RequestInfo("r", "m", prompt_tokens=10)
CTX = PolicyContext(wall_clock=lambda: NOW, full_mode=True, instance_staleness_seconds=10.0)


def inst(
    name: str,
    *,
    age: float | None = 0.0,
    schedulable: bool = True,
    node: str = "",
    unit: str = "",
    kind: InferType = InferType.NEUTRAL,
    waiting: int = 0,
) -> InstanceView:
    status = None
    if age is not None:
        status = EngineStatus(timestamp_ms=int((NOW - age) * 1000), schedulable=schedulable, num_waiting=waiting)
    return InstanceView(Endpoint(name, f"{name}:1", kind), status=status, node_id=node, unit_id=unit)


def cand(view: InstanceView) -> Candidate:
    return Candidate(view, {})


@pytest.mark.parametrize(
    ("view", "passes"),
    [
        (inst("a"), True),
        (inst("a", schedulable=False), False),
        (inst("a", age=None), False),  # no status yet
        (inst("a", age=999.0), True),  # staleness is not schedulability's business
    ],
)
def test_schedulability(view: InstanceView, passes: bool) -> None:
    assert SchedulabilityFilter().passes(cand(view), REQ) is passes
    assert SchedulabilityFilter.marks_failover


@pytest.mark.parametrize(
    ("age", "seconds", "passes"),
    [
        (0.0, 10.0, True),
        (9.9, 10.0, True),
        (10.0, 10.0, True),
        (10.5, 10.0, False),
        (3.0, 2.0, False),
        (None, 10, False),
    ],
)
def test_staleness(age: float | None, seconds: float, passes: bool) -> None:
    CTX.begin(REQ)
    assert StalenessFilter(seconds, ctx=CTX).passes(cand(inst("a", age=age)), REQ) is passes
    assert StalenessFilter.marks_failover


def test_staleness_defaults_to_the_configured_window() -> None:
    assert StalenessFilter(ctx=CTX).staleness_seconds == 10.0


@pytest.mark.parametrize(
    ("target", "kind", "passes"),
    [
        ("neutral", InferType.NEUTRAL, True),
        ("neutral", InferType.PREFILL, False),
        ("prefill", InferType.PREFILL, True),
        ("decode", InferType.PREFILL, False),
        ("decode", InferType.DECODE, True),
    ],
)
def test_infer_type(target: str, kind: InferType, passes: bool) -> None:
    assert InferTypeFilter(target).passes(cand(inst("a", kind=kind)), REQ) is passes


def test_infer_type_unknown() -> None:
    with pytest.raises(ConfigError, match="unknown infer type 'middle'"):
        InferTypeFilter("middle")


# the cluster for the failure-domain table: two nodes, two units spanning them
#   node n1: a (unit u1), b (unit u2)      node n2: c (unit u1), d (unit u3)
def cluster(bad: str) -> list[InstanceView]:
    layout = {"a": ("n1", "u1"), "b": ("n1", "u2"), "c": ("n2", "u1"), "d": ("n2", "u3")}
    return [inst(n, node=node, unit=unit, schedulable=n != bad) for n, (node, unit) in layout.items()]


@pytest.mark.parametrize(
    ("domain", "bad", "survivors"),
    [
        ("instance", "a", ["b", "c", "d"]),
        ("node", "a", ["c", "d"]),  # a's node n1 holds b
        ("instance-unit", "a", ["b", "d"]),  # a's unit u1 holds c
        ("node-unit", "a", ["d"]),  # n1's units u1, u2 -> a, b, c
        ("node-unit", "d", ["b"]),  # n2's units u1, u3 -> a, c, d
        ("node", "none", ["a", "b", "c", "d"]),
    ],
)
def test_failover_domains(domain: str, bad: str, survivors: list[str]) -> None:
    pipeline = Pipeline([SchedulabilityFilter(), FailoverFilter(domain)], RoundRobinSelector())
    ranked = pipeline.run(cluster(bad), REQ, 10)
    assert sorted(i.instance_id for i in ranked) == survivors


def test_failover_blocks_staleness_domains_too() -> None:
    views = [inst("a", node="n1", age=60.0), inst("b", node="n1"), inst("c", node="n2")]
    pipeline = Pipeline([StalenessFilter(ctx=CTX), FailoverFilter("node")], RoundRobinSelector())
    CTX.begin(REQ)
    assert [i.instance_id for i in pipeline.run(views, REQ, 5)] == ["c"]


def test_empty_domain_ids_are_their_own_domain() -> None:
    views = [inst("a", schedulable=False), inst("b")]
    pipeline = Pipeline([SchedulabilityFilter(), FailoverFilter("node")], RoundRobinSelector())
    assert [i.instance_id for i in pipeline.run(views, REQ, 5)] == ["b"]


def test_unknown_failover_domain() -> None:
    with pytest.raises(ConfigError, match="--failover-domain: unknown domain 'rack'"):
        FailoverFilter("rack")


def test_everything_unhealthy_is_unavailable_with_the_reasons() -> None:
    pipeline = Pipeline([SchedulabilityFilter(), FailoverFilter("instance")], RoundRobinSelector())
    with pytest.raises(NoSchedulableInstanceError, match=r"all 2 instances .*schedulability: 2"):
        pipeline.run([inst("a", schedulable=False), inst("b", age=None)], REQ, 1)


@pytest.mark.parametrize(
    ("not_skip", "expected"),
    [
        # the threshold (2 waiting) blocks both; skipped in the fallback pass: ranked by load
        (False, ["b", "a"]),
        # kept in the fallback pass: nothing passes
        (True, None),
    ],
)
def test_metric_based_not_skip_when_fallback(not_skip: bool, expected: list[str] | None) -> None:
    metric = NumRequests(CTX)
    flt = MetricBasedFilter(metric, 2, not_skip_when_fallback=not_skip)
    pipeline = Pipeline([SchedulabilityFilter(), flt], MetricBasedSelector([metric]))
    views = [inst("a", waiting=9), inst("b", waiting=5)]
    if expected is None:
        with pytest.raises(NoSchedulableInstanceError, match="num_requests > 2: 2"):
            pipeline.run(views, REQ, 2)
    else:
        assert [i.instance_id for i in pipeline.run(views, REQ, 2)] == expected


def test_schedulability_still_applies_in_the_fallback_pass() -> None:
    metric = NumRequests(CTX)
    pipeline = Pipeline([SchedulabilityFilter(), MetricBasedFilter(metric, 0)], MetricBasedSelector([metric]))
    views = [inst("a", waiting=3, schedulable=False), inst("b", waiting=5)]
    assert [i.instance_id for i in pipeline.run(views, REQ, 2)] == ["b"]


@pytest.mark.parametrize(
    ("views", "domain", "sources"),
    [
        ([inst("a"), inst("b", schedulable=False), inst("c", age=30.0)], "instance", ["b", "c"]),
        ([inst("a", node="n"), inst("b", node="n", schedulable=False), inst("c", node="m")], "node", ["a", "b"]),
        ([inst("a"), inst("b")], "instance", []),
    ],
)
def test_failover_migration_sources(views: list[InstanceView], domain: str, sources: list[str]) -> None:
    CTX.begin(REQ)
    flt = FailoverMigrationSrcFilter(domain, ctx=CTX)
    population = [cand(v) for v in views]
    kept = flt.apply(population, REQ, [], population)
    assert sorted(c.inst.instance_id for c in kept) == sources


@pytest.mark.parametrize(
    "name", ["schedulability", "staleness", "metric_based", "infer_type", "failover", "failover_migration_src"]
)
def test_filters_registered_by_spec_name(name: str) -> None:
    assert FILTERS.get(name).name == name
