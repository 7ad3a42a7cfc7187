"""The rescheduling planner and its policies, table-driven over hand-built cluster views; the flags' checks.

Every view is built at one virtual time (NOW); the planner reads no clock but the `now` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.config import ConfigError, struct_from_mapping
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.filters.failover import DomainBlocker
from pilotfish.scheduler.policy.registry import context_from_config
from pilotfish.scheduler.rescheduler import MigrationPair, ReschedulingPlanner
from pilotfish.scheduler.rescheduler.settings import check_config, colocated
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InstanceView

NOW = 1_700_000_000.0
D, N, P = InferType.DECODE, InferType.NEUTRAL, InferType.PREFILL


def view(
    iid: str,
    kind: InferType = D,
    *,
    load: float = 0.0,
    requests: int = 1,
    batch: int = 0,
    node: str = "",
    unit: str = "",
    schedulable: bool = True,
    age_s: float = 0.0,
    status: bool = True,
    **fields: Any,
) -> InstanceView:
    """An instance whose kv_cache_usage_ratio_projected is `load` and decode batch `batch`."""
    inst = InstanceView(Endpoint(iid, f"10.0.0.1:{8000 + len(iid)}", kind), node_id=node, unit_id=unit)
    inst.llumlet_address = f"10.0.0.1:9{len(iid):03d}"
    if status:
        inst.status = EngineStatus(
            update_id=1,
            timestamp_ms=int((NOW - age_s) * 1000),
            schedulable=schedulable,
            num_running=max(requests, batch),
            num_running_decode=batch,
            used_kv_tokens=round(load * 1000),
            total_kv_tokens=1000,
            **fields,
        )
    return inst


def config(*policies: str, **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(
        enable_full_mode_scheduling=True, enable_rescheduling=True, rescheduling_policies=list(policies), **kw
    )


def planner(cfg: SchedulerConfig) -> ReschedulingPlanner:
    return ReschedulingPlanner(cfg)


def ids(pairs: Sequence[MigrationPair]) -> list[tuple[str, str]]:
    return [(p.source.instance_id, p.destination.instance_id) for p in pairs]


# -- load balance -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "threshold", "min_difference", "expected"),
    [
        # the worked example: sources [0.9, 0.8], destinations [0.3, 0.2, 0.4]
        ([0.9, 0.3, 0.8, 0.2, 0.4], 0.7, 0.0, [("i0", "i3"), ("i2", "i1")]),
        ([0.9, 0.3, 0.8, 0.2, 0.4], 0.7, 0.1, [("i0", "i3"), ("i2", "i1")]),
        # the second pair differs by 0.5 only
        ([0.9, 0.3, 0.8, 0.2, 0.4], 0.7, 0.6, [("i0", "i3")]),
        ([0.9, 0.3, 0.8, 0.2, 0.4], 0.7, 0.8, []),
        # exactly the threshold is a source
        ([0.7, 0.1], 0.7, 0.0, [("i0", "i1")]),
        # more sources than destinations: the lightest source waits
        ([0.95, 0.9, 0.8, 0.1], 0.7, 0.0, [("i0", "i3")]),
        ([0.75, 0.7, 0.6, 0.2], 0.7, 0.2, [("i0", "i3")]),
        ([0.9, 0.8], 0.7, 0.0, []),  # no destination
        ([0.1, 0.2], 0.7, 0.0, []),  # no source
    ],
)
def test_decode_load_pairs_heaviest_with_lightest(
    loads: list[float], threshold: float, min_difference: float, expected: list[tuple[str, str]]
) -> None:
    cfg = config(
        "decode_load",
        rescheduling_decode_load_threshold=threshold,
        rescheduling_load_balance_threshold=min_difference,
    )
    views = [view(f"i{k}", load=load) for k, load in enumerate(loads)]
    pairs = planner(cfg).plan(views, NOW)
    assert ids(pairs) == expected
    for p in pairs:
        assert (p.policy, p.rule, p.order, p.value, p.method) == ("decode_load", "TOKEN", "SR", 1024.0, "auto")


def test_neutral_load_balances_neutral_instances_only_by_its_own_flags() -> None:
    views = [
        view("d-hot", D, load=0.95),
        view("d-cold", D, load=0.1),
        view("n-hot", N, load=0.6),
        view("n-cold", N, load=0.2),
    ]
    cfg = config("neutral_load", rescheduling_neutral_load_threshold=3, rescheduling_neutral_load_metric="num_requests")
    # num_requests: waiting + loading + running; the hot one runs 5, the cold one 1 (under 3)
    views[2].status.num_running = 5  # type: ignore[union-attr]
    assert ids(planner(cfg).plan(views, NOW)) == [("n-hot", "n-cold")]


@pytest.mark.parametrize(
    ("units", "scope", "expected"),
    [
        # u1 holds both hot instances, u2 both cold ones
        (["u1", "u1", "u2", "u2"], "cluster", [("i0", "i2"), ("i1", "i3")]),
        (["u1", "u1", "u2", "u2"], "unit", []),
        # each unit one hot and one cold: the cluster pairs across units, the unit scope within
        (["u1", "u2", "u2", "u1"], "cluster", [("i0", "i2"), ("i1", "i3")]),
        (["u1", "u2", "u2", "u1"], "unit", [("i0", "i3"), ("i1", "i2")]),
        # an instance without a unit is a unit of its own
        (["", "", "", ""], "unit", []),
    ],
)
def test_load_balance_scope(units: list[str], scope: str, expected: list[tuple[str, str]]) -> None:
    loads = [0.9, 0.8, 0.1, 0.3]
    views = [view(f"i{k}", load=load, unit=u) for k, (load, u) in enumerate(zip(loads, units, strict=True))]
    cfg = config("decode_load", rescheduling_load_balance_scope=scope)
    assert ids(planner(cfg).plan(views, NOW)) == expected


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"schedulable": False}, [("i1", "i2")]),  # an unschedulable source is failover's business
        ({"age_s": 60.0}, [("i1", "i2")]),  # a stale load is not believed
        ({"status": False}, [("i1", "i2")]),
    ],
)
def test_load_balance_skips_unhealthy_instances(bad: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    views = [view("i0", load=0.99, **bad), view("i1", load=0.9), view("i2", load=0.1), view("i3", load=0.2, **bad)]
    assert ids(planner(config("decode_load")).plan(views, NOW)) == expected


# -- failover -----------------------------------------------------------------------------------------------


def failover_cluster() -> list[InstanceView]:
    """d1 fails (unschedulable); the others are healthy and all hold requests."""
    return [
        view("d1", node="n1", unit="u1", schedulable=False),
        view("d2", node="n1", unit="u2"),
        view("d3", node="n2", unit="u1"),
        view("d4", node="n3", unit="u3"),
        view("d5", node="n2", unit="u4"),
        view("d6", node="n4", unit="u5"),
    ]


@pytest.mark.parametrize(
    ("domain", "sources", "blocked"),
    [
        ("instance", {"d1"}, {"d1"}),
        ("node", {"d1", "d2"}, {"d1", "d2"}),
        ("instance-unit", {"d1", "d3"}, {"d1", "d3"}),
        # units with an instance on n1: u1 and u2
        ("node-unit", {"d1", "d2", "d3"}, {"d1", "d2", "d3"}),
    ],
)
def test_failover_moves_everything_in_the_domain_out_of_it(domain: str, sources: set[str], blocked: set[str]) -> None:
    plan = planner(config("decode_failover", failover_domain=domain))
    healthy = {f"d{k}" for k in range(1, 7)} - blocked
    for _ in range(4):  # round robin turns between cycles; nothing ever lands inside the domain
        pairs = plan.plan(failover_cluster(), NOW)
        assert {s for s, _ in ids(pairs)} == sources
        assert {d for _, d in ids(pairs)} <= healthy
        assert all(p.policy == "decode_failover" for p in pairs)


def test_failover_round_robin_spreads_a_source_over_the_destinations() -> None:
    plan = planner(config("decode_failover"))
    views = [view("bad", schedulable=False), view("a"), view("b"), view("c")]
    seen = [ids(plan.plan(views, NOW)) for _ in range(6)]
    assert [pairs[0][1] for pairs in seen] == ["a", "b", "c", "a", "b", "c"]


def test_two_failing_sources_in_one_cycle_get_different_destinations() -> None:
    views = [view("bad1", schedulable=False), view("bad2", age_s=30.0), view("a"), view("b")]
    pairs = ids(planner(config("decode_failover")).plan(views, NOW))
    assert pairs == [("bad1", "a"), ("bad2", "b")]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("decode_failover", [("d-bad", "d-ok")]),
        ("neutral_failover", [("n-bad", "n-ok")]),
        ("prefill_failover", [("p-bad", "p-ok")]),
    ],
)
def test_failover_policies_keep_to_their_infer_type(policy: str, expected: list[tuple[str, str]]) -> None:
    views = [
        view(f"{k.name[0].lower()}-{health}", k, schedulable=health == "ok")
        for k in (D, N, P)
        for health in ("bad", "ok")
    ]
    assert ids(planner(config(policy)).plan(views, NOW)) == expected


def test_failover_needs_something_to_move_and_somewhere_to_go() -> None:
    plan = planner(config("decode_failover"))
    # an idle failing instance has nothing to migrate
    assert plan.plan([view("bad", schedulable=False, requests=0), view("ok")], NOW) == []
    # unhealthy or status-less instances are no destination
    views = [view("bad", schedulable=False), view("stale", age_s=60, requests=0), view("new", status=False)]
    assert plan.plan(views, NOW) == []
    # an instance without a status yet is not judged: no failover from it, none around it
    assert plan.plan([view("new", status=False, node="n1"), view("ok", node="n1"), view("other")], NOW) == []


def test_staleness_is_judged_at_the_given_virtual_time() -> None:
    plan = planner(config("decode_failover", instance_staleness_seconds=10.0))
    views = [view("x", age_s=NOW - 1.0), view("y", age_s=NOW - 30.0)]  # stamped at t=1s and t=30s
    assert plan.plan(views, 5.0) == []  # both fresh at t=5s (y's stamp is even ahead of it)
    assert ids(plan.plan(views, 25.0)) == [("x", "y")]  # x is 24 s old at t=25s


# -- adaptive PD: binpacking ---------------------------------------------------------------------------------

SLO = {"tpot_slo": 50.0, "tpot_slo_dispatch_threshold": 0.85}


def tpot_planner(*policies: str, **kw: Any) -> ReschedulingPlanner:
    """Predicted TPOT = 10 ms + 1 ms per decode request, the probe's own included: batch b -> 11 + b ms."""
    cfg = config(*policies, **SLO, **kw)
    profile = LatencyProfile(base_ms=10.0, decode_ms_per_token=1.0, context_ms_per_token=0.0)
    plan = ReschedulingPlanner(cfg, context_from_config(cfg, tables=LatencyTables(profile), wall_clock=lambda: NOW))
    return plan


def tpot(iid: str, ms: float, kind: InferType = D, **kw: Any) -> InstanceView:
    """A decode instance predicted at `ms` TPOT."""
    return view(iid, kind, batch=round(ms - 11), **kw)


@pytest.mark.parametrize(
    ("tpots", "expected"),
    [
        # the worked example: D1 48 ms > 47.5 ceiling, D2 35 ms < 42.5 dispatch threshold
        ({"D1": 48, "D2": 35}, [("D1", "D2")]),
        ({"D1": 47, "D2": 35}, []),  # under the ceiling
        ({"D1": 48, "D2": 43}, []),  # no destination under the dispatch threshold
        # the worst source, the least-loaded destination, one pair only
        ({"D1": 48, "D5": 52, "D2": 35, "D3": 30, "D4": 40}, [("D5", "D3")]),
    ],
)
def test_binpacking_mitigation(tpots: dict[str, float], expected: list[tuple[str, str]]) -> None:
    views = [tpot(iid, ms) for iid, ms in tpots.items()]
    pairs = tpot_planner("binpacking_mitigation").plan(views, NOW)
    assert ids(pairs) == expected
    for p in pairs:  # the configured request selection
        assert (p.rule, p.order, p.value) == ("TOKEN", "SR", 1024.0)


def test_binpacking_mitigation_leaves_prefill_reserved_and_non_decode_instances_alone() -> None:
    views = [
        tpot("N1", 60, N),  # neutral: not adaptive PD's
        tpot("D1", 48),
        tpot("D2", 20, num_waiting_prefill=1),  # prefilling now: reserved
        tpot("D3", 25, uncomputed_prefill_tokens=512),
        tpot("D4", 40),
        tpot("D9", 70, num_running_prefill=1),
    ]
    assert ids(tpot_planner("binpacking_mitigation").plan(views, NOW)) == [("D1", "D4")]


@pytest.mark.parametrize(
    ("tpots", "expected"),
    [
        # the worked example: D3 25 ms < 30 ms floor with requests; D4 40 ms, the most loaded under 42.5
        ({"D3": 25, "D4": 40, "D2": 35}, [("D3", "D4")]),
        # the least-loaded source goes first, one pair only
        ({"D3": 25, "D6": 20, "D4": 40}, [("D6", "D4")]),
        ({"D3": 31, "D4": 40}, []),  # above the floor
        ({"D3": 25, "D4": 43}, []),  # the only busy one is over the dispatch threshold
        ({"D3": 25}, []),  # nowhere to go
        # an empty instance (batch 0: 11 ms) is neither source nor destination
        ({"D0": 11, "D3": 25}, []),
        # never downhill: two light instances pack the lighter into the heavier
        ({"D3": 25, "D7": 28}, [("D3", "D7")]),
    ],
)
def test_binpacking_consolidation(tpots: dict[str, float], expected: list[tuple[str, str]]) -> None:
    views = [tpot(iid, ms) for iid, ms in tpots.items()]
    pairs = tpot_planner("binpacking_consolidation").plan(views, NOW)
    assert ids(pairs) == expected
    for p in pairs:  # consolidation drains its source
        assert (p.rule, p.order, p.value) == ("RATIO", "SR", 1.0)


def test_binpacking_consolidation_skips_prefill_reserved_destinations() -> None:
    views = [tpot("D3", 25), tpot("D4", 40, num_waiting_prefill=2), tpot("D2", 35)]
    assert ids(tpot_planner("binpacking_consolidation").plan(views, NOW)) == [("D3", "D2")]


def test_both_binpacking_policies_in_one_cycle() -> None:
    views = [tpot("D1", 48), tpot("D2", 35), tpot("D3", 25), tpot("D4", 40)]
    pairs = tpot_planner("binpacking_mitigation", "binpacking_consolidation").plan(views, NOW)
    # mitigation D1 -> D3 (least loaded); consolidation's source D3 now receives: dropped
    assert ids(pairs) == [("D1", "D3")]


# -- conflicts ----------------------------------------------------------------------------------------------


class Fixed:
    """A stand-in policy returning fixed pairs, to test the planner's conflict rules alone."""

    def __init__(self, name: str, pairs: list[tuple[str, str]], views: dict[str, InstanceView]) -> None:
        self.name, self._pairs, self._views = name, pairs, views

    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        v = self._views
        return [MigrationPair(v[s], v[d], self.name, "NUM_REQ", "SR", 1.0) for s, d in self._pairs]


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ([("A", "B")], [("B", "A")], [("A", "B")]),  # the rule: no A->B with B->A
        ([("A", "B")], [("A", "C")], [("A", "B")]),  # a source once per cycle
        ([("A", "B")], [("C", "B")], [("A", "B"), ("C", "B")]),  # fan-in is fine
        ([("A", "B")], [("B", "C")], [("A", "B")]),  # B receives: it does not send
        ([("A", "B")], [("C", "A")], [("A", "B")]),  # A sends: it does not receive
        ([("A", "A")], [("B", "C")], [("B", "C")]),
        ([("A", "B"), ("B", "A")], [], [("A", "B")]),  # within one policy too
    ],
)
def test_planner_drops_conflicting_pairs(
    first: list[tuple[str, str]], second: list[tuple[str, str]], expected: list[tuple[str, str]]
) -> None:
    views = {k: view(k) for k in "ABC"}
    plan = planner(config("decode_load"))
    plan.policies = [Fixed("first", first, views), Fixed("second", second, views)]  # type: ignore[list-item]
    assert ids(plan.plan(views.values(), NOW)) == expected
    assert plan.num_conflicts == len(first) + len(second) - len(expected)


def test_earlier_policy_wins_a_conflict() -> None:
    # failover (first) sends bad's requests to a; decode_load would then have a send too, and an
    # instance never both receives and sends in one cycle
    views = [
        view("bad", node="n1", schedulable=False),
        view("a", node="n2", load=0.95),
        view("b", node="n3", load=0.1),
    ]
    plan = planner(config("decode_failover", "decode_load", failover_domain="node"))
    pairs = plan.plan(views, NOW)
    assert [(p.policy, *ids([p])[0]) for p in pairs] == [("decode_failover", "bad", "a")]
    assert plan.num_conflicts == 1  # decode_load's a -> b


def test_load_balance_stays_out_of_failure_domains() -> None:
    # hot shares node n1 with a failed instance: only failover moves its requests, and no policy
    # sends requests into n1 (the global failover filter applies to every policy)
    views = [
        view("bad", node="n1", schedulable=False),
        view("hot", node="n1", load=0.9),
        view("cold", node="n1", load=0.0),
        view("a", node="n2", load=0.95),
        view("b", node="n3", load=0.2),
    ]
    pairs = planner(config("decode_load", failover_domain="node")).plan(views, NOW)
    assert [ids([p])[0] for p in pairs] == [("a", "b")]
    pairs = planner(config("decode_failover", "decode_load", failover_domain="node")).plan(views, NOW)
    assert all(p.destination.node_id != "n1" for p in pairs)
    assert {p.source.instance_id for p in pairs if p.policy == "decode_load"} <= {"a"}


def test_default_policies_run_failover_first() -> None:
    plan = planner(SchedulerConfig(enable_full_mode_scheduling=True))
    assert [p.name for p in plan.policies] == [
        "prefill_failover",
        "decode_failover",
        "neutral_failover",
        "decode_load",
        "neutral_load",
    ]


# -- flags ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ({"rescheduling_policies": ["nope"]}, "--rescheduling-policies"),
        ({"rescheduling_policies": []}, "--rescheduling-policies"),
        ({"rescheduling_policies": ["decode_load", "decode_load"]}, "--rescheduling-policies"),
        ({"rescheduling_decode_load_metric": "nope"}, "--rescheduling-decode-load-metric"),
        ({"rescheduling_neutral_load_metric": "kv_cache_hit_len"}, "--rescheduling-neutral-load-metric"),
        ({"rescheduling_load_balance_scope": "rack"}, "--rescheduling-load-balance-scope"),
        ({"rescheduling_req_select_rule": "BYTES"}, "--rescheduling-req-select-rule"),
        ({"rescheduling_req_select_order": "sr"}, "--rescheduling-req-select-order"),
        (
            {"rescheduling_req_select_rule": "RATIO", "rescheduling_req_select_value": 2},
            "--rescheduling-req-select-value",
        ),
        ({"rescheduling_migration_method": "teleport"}, "--rescheduling-migration-method"),
        ({"failover_domain": "rack"}, "--failover-domain"),
        ({"rescheduling_policies": ["binpacking_mitigation"]}, "--tpot-slo"),
        (
            {
                "rescheduling_policies": ["binpacking_consolidation"],
                **SLO,
                "tpot_migrate_out_floor_threshold": 0.95,
            },
            "--tpot-migrate-out-floor-threshold",
        ),
        (
            {"rescheduling_policies": ["binpacking_mitigation"], "tpot_slo": 50.0},
            "--tpot-slo-dispatch-threshold",
        ),
        ({"enable_adaptive_pd": True, "tpot_slo": 50.0}, "--enable-adaptive-pd"),
        ({"enable_adaptive_pd": True, "scheduling_policy": "slo"}, "--enable-adaptive-pd"),
        # msgspec's own bounds name the flag too
        ({"rescheduling_interval_ms": 0}, "--rescheduling-interval-ms"),
        ({"llumlet_grpc_connection_pool_size": 0}, "--llumlet-grpc-connection-pool-size"),
        ({"llumlet_grpc_timeout_seconds": 0}, "--llumlet-grpc-timeout-seconds"),
        ({"rescheduling_load_balance_threshold": -0.1}, "--rescheduling-load-balance-threshold"),
        ({"rescheduling_req_select_value": 0}, "--rescheduling-req-select-value"),
    ],
)
def test_bad_flags_fail_with_one_line_naming_the_flag(values: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(struct_from_mapping(SchedulerConfig, {"enable_full_mode_scheduling": True, **values}))
    message = str(err.value)
    assert flag in message and "\n" not in message


def test_good_adaptive_pd_flags_pass() -> None:
    check_config(
        config(
            "binpacking_mitigation",
            "binpacking_consolidation",
            enable_adaptive_pd=True,
            scheduling_policy="slo",
            rescheduling_interval_ms=100,
            **SLO,
        )
    )


@pytest.mark.parametrize(
    ("values", "runs_here", "flag"),
    [
        ({}, False, None),  # rescheduling off
        ({"enable_rescheduling": True, "enable_full_mode_scheduling": True}, True, None),
        (
            {"enable_rescheduling": True, "enable_full_mode_scheduling": True, "standalone_rescheduling_mode": True},
            False,
            None,
        ),
        ({"enable_rescheduling": True}, None, "--enable-rescheduling"),  # lite mode has no CMS view
        (
            {"enable_rescheduling": True, "enable_full_mode_scheduling": True, "colocated_rescheduling_mode": False},
            None,
            "--enable-rescheduling",
        ),
    ],
)
def test_deployment_mode(values: dict[str, Any], runs_here: bool | None, flag: str | None) -> None:
    cfg = SchedulerConfig(**values)
    if flag is None:
        assert colocated(cfg) is runs_here
    else:
        with pytest.raises(ConfigError, match=flag):
            colocated(cfg)


def test_flags_reach_both_subcommands() -> None:
    from pilotfish.cli import build_parser
    from pilotfish.config import struct_from_args

    parser = build_parser()
    for command in ("scheduler", "rescheduler"):
        args = parser.parse_args(
            [
                command,
                "--enable-rescheduling",
                "--rescheduling-policies",
                "decode_load,binpacking_mitigation",
                "--rescheduling-interval-ms",
                "100",
                "--no-colocated-rescheduling-mode",
                "--llumlet-token",
                "s3cret",
            ]
        )
        cfg = struct_from_args(SchedulerConfig, args)
        assert cfg.enable_rescheduling and not cfg.colocated_rescheduling_mode
        assert cfg.rescheduling_policies == ["decode_load", "binpacking_mitigation"]
        assert (cfg.rescheduling_interval_ms, cfg.llumlet_token) == (100, "s3cret")


# -- invariants over random clusters ---------------------------------------------------------------------------

random_instance = st.tuples(
    st.sampled_from([D, N]),
    st.floats(0.0, 1.0),
    st.booleans(),  # schedulable
    st.sampled_from([0.0, 60.0]),  # age: fresh or stale
    st.sampled_from(["n1", "n2", "n3"]),
    st.integers(0, 3),  # requests
)


@settings(max_examples=150, deadline=None)
@given(st.lists(random_instance, max_size=12), st.sampled_from(["instance", "node", "instance-unit", "node-unit"]))
def test_plans_never_conflict_and_respect_the_filters(
    specs: list[tuple[InferType, float, bool, float, str, int]], domain: str
) -> None:
    views = [
        view(f"i{k}", kind, load=load, schedulable=ok, age_s=age, node=node, unit=f"u{k % 4}", requests=requests)
        for k, (kind, load, ok, age, node, requests) in enumerate(specs)
    ]
    pairs = planner(config(*SchedulerConfig().rescheduling_policies, failover_domain=domain)).plan(views, NOW)
    sources = [p.source.instance_id for p in pairs]
    destinations = {p.destination.instance_id for p in pairs}
    assert len(sources) == len(set(sources)) and not set(sources) & destinations
    for p in pairs:
        dst = p.destination.status
        assert p.source.infer_type == p.destination.infer_type
        assert dst is not None and dst.schedulable and dst.timestamp_ms == int(NOW * 1000)  # healthy
        if p.policy.endswith("_load"):
            assert p.source.status.used_kv_tokens >= 700 > dst.used_kv_tokens  # type: ignore[union-attr]
        else:  # failover: from a failing domain, never into one
            fresh = int(NOW * 1000)
            failing = [v for v in views if not (v.status.schedulable and v.status.timestamp_ms == fresh)]  # type: ignore[union-attr]
            blocker = DomainBlocker(domain, failing, views)
            assert blocker.blocks(p.source) and not blocker.blocks(p.destination)
