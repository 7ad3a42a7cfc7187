"""`pilotfish bench flow`: its config, traces, ceiling arithmetic and a small run that loses nothing (bench/flow.py)."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest

from pilotfish.bench import flow
from pilotfish.config import struct_from_args
from pilotfish.scheduler.config import SchedulerConfig


def parse(*argv: str) -> flow.FlowBenchConfig:
    parser = argparse.ArgumentParser()
    flow.add_arguments(parser)
    return struct_from_args(flow.FlowBenchConfig, parser.parse_args(list(argv)))


def test_flags_come_from_the_config_struct() -> None:
    cfg = parse()
    assert cfg.workloads == list(flow.FAMILIES) and cfg.seeds == [0, 1, 2] and cfg.instances == 4
    cfg = parse("--workloads", "family:rag,family:system-prompt:turn=32-64;output=16", "--seeds", "3",
                "--fair-bounds", "1,0.5", "--flow", "flow_max_kv_usage=0.9,flow_over_share_bound=0.25")
    assert cfg.workloads == ["family:rag", "family:system-prompt:turn=32-64;output=16"]
    assert cfg.seeds == [3] and cfg.fair_bounds == [1.0, 0.5]
    assert flow.flow_settings(cfg) == {"flow_max_kv_usage": 0.9, "flow_over_share_bound": 0.25}
    assert flow.over_share_bound(cfg) == 0.25
    assert flow.over_share_bound(parse()) == SchedulerConfig().flow_over_share_bound


@pytest.mark.parametrize("spec", [*flow.FAMILIES, "family:system-prompt:turn=32-64;output=16"])
def test_workload_trace_takes_the_first_n_in_its_namespace(spec: str) -> None:
    trace = flow.workload_trace(spec, 40, seed=1, namespace="tenant-x")
    assert len(trace) == 40
    assert all(r.request_id.startswith("tenant-x-") for r in trace)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    assert flow.workload_trace(spec, 40, seed=1, namespace="tenant-x") == trace  # seeded


@pytest.mark.parametrize("spec", ["family:nope", "trace:mooncake_synthetic.jsonl", "family:rag:nope=1"])
def test_a_workload_that_is_not_a_family_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match=r"nope|family"):
        flow.workload_trace(spec, 10, 0, "x")


def _arm(goodput: float, offered: float = 100.0) -> dict[str, float]:
    return {"goodput_rps": goodput, "offered_rps": offered}


def test_the_ceiling_is_the_offered_rate_or_the_capacity_whichever_is_lower() -> None:
    arms = {"sglang": _arm(70), "dynamo": _arm(90), flow.OFF: _arm(88), flow.ON: _arm(95)}
    c = flow.ceiling(arms, capacity=110.0, peers=["sglang", "dynamo"])
    assert c["best_peer_rps"] == 90 and c["ceiling_rps"] == 100
    assert c["offered_x_best_peer"] == pytest.approx(100 / 90)  # 1.3 x out of reach by arithmetic
    assert c["on_x_best_peer"] == pytest.approx(95 / 90)
    c = flow.ceiling(arms, capacity=80.0, peers=["sglang", "dynamo"])
    assert c["ceiling_rps"] == 80 and c["ceiling_x_best_peer"] == pytest.approx(80 / 90)


def test_the_busiest_engine_share_counts_served_requests_per_engine() -> None:
    served = [SimpleNamespace(engine=e) for e in (0, 2, 2, 2)]
    assert flow.busiest_engine_share(served) == 0.75
    assert math.isnan(flow.busiest_engine_share([]))


def test_spread_and_reachable() -> None:
    s = flow.spread([1.0, math.nan, 3.0])
    assert s == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert flow.spread([math.nan])["n"] == 0
    assert flow.reachable(flow.spread([1.4, 1.5])) == "yes"
    assert flow.reachable(flow.spread([1.2, 1.5])) == "some seeds"
    assert flow.reachable(flow.spread([1.0, 1.1])) == "no"
    assert flow._r(flow.spread([1.0, 3.0])) == "2.00 [1.00-3.00]"
    assert flow._r(flow.spread([1.0])) == "1.00"


def test_a_small_run_loses_nothing_and_reports_every_part() -> None:
    workload = "family:system-prompt:turn=1024-2048"  # long turns: 150 requests load one engine past the SLO
    cfg = parse("--workloads", workload, "--seeds", "0", "--requests", "150", "--instances", "1",
                "--loads", "1.2", "--peers", "dynamo", "--fair-bounds", "1,0.5", "--knee-steps", "0",
                "--flow", "flow_max_queued_prefill_tokens=2048,flow_over_share_bound=0.5", "--no-progress")
    cell = flow.measure(cfg, workload, 0)
    assert cell["problems"] == []
    assert cell["knee"] is not None and cell["knee_bounded"]
    arms = cell["past_knee"]["1.2"]
    assert set(arms) == {"dynamo", flow.OFF, flow.ON}
    for m in arms.values():
        assert m["goodput_rps"] <= m["offered_rps"] + 1e-9
    fair = cell["fairness"]
    assert set(fair[flow.ON]["floods"]) == {"1", "0.5"}
    assert fair["requests"]["A"] >= 100 and fair["requests"]["B"] > 0
    summary = flow.summarise(cfg, [cell])
    md = flow.render_markdown(cfg, {"summary": summary, "problems": [], "wall_seconds": 1.0, "host": "h"}, [], "none")
    assert f"| {workload} | 1.2 |" in md and "on, bound 0.5 (the on arm)" in md
    # A's TTFT split: off never queues; on, each part is at most the whole
    assert fair[flow.OFF]["flood"]["tenants"]["A"]["p99_queue_wait"] == 0.0
    for run in (fair[flow.ON]["alone"], *fair[flow.ON]["floods"].values()):
        a = run["tenants"]["A"]
        assert 0.0 <= a["p99_queue_wait"] <= a["p99_ttft"] + 1e-9 and 0.0 < a["p99_engine_ttft"] <= a["p99_ttft"] + 1e-9
        assert a["busiest_engine_share"] == 1.0  # one engine: it served every request
    assert f"| {workload} | on, flood, bound 0.5 |" in md and "| 100% |" in md
    # B's flood again with a new tenant id on every request, folded and counted as given; and spread over
    # ids kept alive from one address, grouped by it and counted as given
    arms = {*flow.ROTATION_ARMS, *flow.KEPT_ALIVE_ARMS}
    assert set(fair[flow.ON]["rotating"]) == arms and set(fair[flow.ON]["rotating_a_p99_ratio"]) == arms
    rotation = md.split("## A flood that sends many tenant ids", 1)[1].split("## ", 1)[0]
    for name in arms:
        assert f"| {workload} | {name} |" in rotation
    # two tenants below the knee: the same arms at A 0.3 + B to 0.8 x knee, and the goodput on over off
    below = cell["below"]
    assert set(below[flow.ON]["floods"]) == {"1", "0.5"} and below["requests"]["B"] > 0
    assert below[flow.OFF]["flood"]["offered_rps"] < fair[flow.OFF]["flood"]["offered_rps"]  # 0.8 against 1.5
    on_off = summary[workload]["below"]["on"]["0.5"]["on_x_off_goodput"]["mean"]
    assert on_off == pytest.approx(below[flow.ON]["floods"]["0.5"]["goodput_rps"]
                                   / below[flow.OFF]["flood"]["goodput_rps"])
    section = md.split("## Two tenants below the knee: A at 0.3 x knee, with B to 0.8 x knee", 1)[1]
    assert f"| {workload} | on, bound 0.5 (the on arm) |" in section.split("## Plots", 1)[0]
    # --loads "" (fairness only): the fairness part is still summarised
    import msgspec

    skipped = msgspec.structs.replace(cfg, below_total_load=0.0, loads=[])
    assert "below" not in flow.measure(skipped, workload, 0)

    only = flow.summarise(msgspec.structs.replace(cfg, loads=[]), [{**cell, "past_knee": {}, "ceilings": {}}])
    assert only[workload]["past"] == {} and only[workload]["fairness"]["on"]["0.5"]["a_p99_ratio"]["n"] == 1


def test_a_rotating_tenant_sends_a_new_id_with_every_request_and_known_ones_are_established() -> None:
    labels = flow.Labels(flow={"r1": "A", "r2": "B", "r3": "B"}, known=frozenset("A"), rotating=frozenset("B"))
    assert labels.flow_id("r1") == "A" and labels.flow_id("r0") == ""
    assert len({labels.flow_id("r2"), labels.flow_id("r3"), "B"}) == 3
    from pilotfish.scheduler.flow.newcomers import NEWCOMERS, Newcomers

    ids = Newcomers(after_s=1.0)
    for key in labels.established():
        ids.establish(key)
    assert ids.flow("A", 0.0) == "A" and ids.flow(labels.flow_id("r2"), 0.0) == NEWCOMERS


def test_a_tenant_keeping_ids_alive_spreads_over_them_all_established_and_in_its_group() -> None:
    rids = [f"r{i}" for i in range(200)]
    labels = flow.Labels(flow=dict.fromkeys(rids, "B"), known=frozenset("AB"), kept_alive={"B": 4},
                         groups={"B": "address-b"})
    keys = {labels.flow_id(rid) for rid in rids}
    assert keys == {f"address-b:B#{i}" for i in range(4)}
    assert set(labels.established()) == {"A", *keys}
