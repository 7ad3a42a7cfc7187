"""`pilotfish bench matrix` end to end at a tiny size: the knee search, every cell, result.json's
structure, the losses list and the heat map."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from pilotfish.bench import matrix
from pilotfish.bench.options import step_scales_note


def _args(out: Path, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    matrix.add_arguments(parser)
    argv = ["--out", str(out)]
    for key, value in overrides.items():
        flag = f"--{key.replace('_', '-')}"
        argv += [flag] if value is True else [flag, str(value)]
    return parser.parse_args(argv)


def test_a_tiny_matrix_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    calls: list[tuple] = []
    run_cell = matrix.run_cell

    def counted(*args: object) -> dict:
        calls.append(args[1:])
        return run_cell(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(matrix, "run_cell", counted)
    args = _args(
        tmp_path,
        workloads="family:rag:context=1024-2048,family:system-prompt:turn=256-2048",
        policies="pilotfish,pilotfish-full,round-robin,sglang,oracle",
        fleets="4",
        loads="0.5,1,1.2",
        seeds="0,1",
        requests_per_cell=48,
        knee_steps=1,
        knee_doublings=5,
        jobs=1,
    )
    assert matrix.run(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["benchmark"] == "matrix"
    assert result["policies"] == ["pilotfish", "pilotfish-full", "round-robin", "sglang", "oracle"]
    assert set(result["knees"]) == {"family:rag:context=1024-2048|4", "family:system-prompt:turn=256-2048|4"}
    for knee in result["knees"].values():
        assert knee["rate_rps"] > 0 and knee["probes"] and knee["mark"] == pytest.approx(0.9 * knee["light_attainment"])
        if knee["bounded"]:  # the knee passed the mark, the rate above it did not
            lo, hi = knee["bracket"]
            assert lo < hi and dict(knee["probes"])[lo] >= knee["mark"] > dict(knee["probes"])[hi]
    assert len(result["cells"]) == 2 * 1 * 3
    # round-robin at load 1 (seed 0) is the knee's own probe, taken from the search, not run again:
    # the same figures a fresh run gives
    config = matrix.config_from_args(args)
    for key, knee in result["knees"].items():
        workload, engines = key.split("|")
        assert calls.count((workload, int(engines), 0, knee["factor"], "round-robin")) == 1
        reused = result["cells"][matrix.cell_key(workload, int(engines), 1.0)]["runs"]["round-robin"]["0"]
        fresh = matrix.run_cell(config, workload, int(engines), 0, knee["factor"], "round-robin")
        assert {k: v for k, v in reused.items() if k != "wall_seconds"} == \
            {k: v for k, v in json.loads(json.dumps(fresh)).items() if k != "wall_seconds"}
    for cell in result["cells"].values():
        assert set(cell["runs"]) == set(result["policies"])
        assert all(set(by_seed) == {"0", "1"} for by_seed in cell["runs"].values())
        assert cell["best_peer"] == "sglang" and cell["best_local_peer"] == "sglang"
        for s in cell["summary"].values():
            lo, hi = s["goodput_rps_range"]
            assert lo <= s["goodput_rps"] <= hi
            assert s["vs_best_peer"] == pytest.approx(s["goodput_rps"] / cell["summary"]["sglang"]["goodput_rps"])
        assert cell["summary"]["sglang"]["vs_best_peer"] == pytest.approx(1.0)
    for loss in result["losses"]:
        assert loss["policy"] in ("pilotfish", "pilotfish-full") and loss["ratio"] < 1.0
    assert result["heatmap"] == "heatmap.png" and (tmp_path / "heatmap.png").stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "## Knees (round-robin)" in report and "## Where a shipped default loses" in report


def test_losses_name_the_cell_and_the_reference() -> None:
    def summary(goodput: float) -> dict[str, object]:
        return {"goodput_rps": goodput, "goodput_rps_range": [goodput, goodput]}

    cells = {"w | 16 | 1": {"runs": {}, "summary": {
        "pilotfish": summary(9.0), "pilotfish-full": summary(11.0), "round-robin": summary(10.0),
        "sglang": summary(10.5), "dynamo": summary(12.0), "power-of-two": summary(8.0)}}}
    for cell in cells.values():
        cell["runs"] = {p: {"0": {}} for p in cell["summary"]}
    # summarize() needs per-seed runs; fill the relative figures the way it does
    for cell in cells.values():
        s = cell["summary"]
        cell["best_peer"], cell["best_local_peer"] = "dynamo", "sglang"
        for p in s.values():
            p["vs_round_robin"] = p["goodput_rps"] / 10.0
            p["vs_best_peer"] = p["goodput_rps"] / 12.0
            p["vs_best_local_peer"] = p["goodput_rps"] / 10.5
    lost = {(x["policy"], x["against"]) for x in matrix.losses(cells)}
    assert lost == {("pilotfish", "round-robin"), ("pilotfish", "sglang"), ("pilotfish-full", "dynamo")}


def test_latency_misses_hold_the_full_default_to_the_peers_lowest_p99() -> None:
    def lat(ttft: float, queueing: float) -> dict[str, float]:
        return {"ttft_p99": ttft, "queueing_p99": queueing}

    cells = {
        # P99 TTFT above the lowest peer's (sglang 1.0), queueing under half of theirs (0.4 against 1.0)
        "a": {"summary": {"pilotfish-full": lat(1.2, 0.4), "sglang": lat(1.0, 1.0), "dynamo": lat(2.0, 3.0)}},
        # peers' queueing under 100 ms: not judged; P99 TTFT equal to the peer's is within the goal
        "b": {"summary": {"pilotfish-full": lat(0.5, 0.09), "llm-d": lat(0.5, 0.05)}},
        # queueing above half the lowest peer's (0.3 against 0.5)
        "c": {"summary": {"pilotfish-full": lat(0.4, 0.3), "dynamo": lat(0.9, 0.5), "sglang": lat(0.8, math.nan)}},
        "d": {"summary": {"pilotfish-full": lat(0.4, 0.3)}},  # no peer ran: nothing judged
    }
    got = matrix.latency_misses(cells)
    assert got["judged"] == {"ttft": 3, "queueing": 2}
    assert [(x["cell"], x["peer"]) for x in got["misses"]["ttft"]] == [("a", "sglang")]
    assert [(x["cell"], x["peer"], x["ratio"]) for x in got["misses"]["queueing"]] == [("c", "dynamo", 0.6)]
    md = matrix.render_markdown({**_minimal_result(), "latency": got})
    assert "above it in 1 of 3 cells" in md and "above half in 1 of 2 such cells" in md
    assert "| P99 queueing <= half the peer's | c | 0.300 | dynamo | 0.500 | 0.600 |" in md


def _minimal_result() -> dict[str, object]:
    config = {"workloads": ["w"], "fleets": [16], "loads": [1.0], "seeds": [0], "requests_per_cell": 10,
              "slo_ttft": 2.0, "slo_tpot": 0.1, "profile": "p", "num_gpu_blocks": 1, "knee_attainment": 0.9,
              "knee_steps": 1, "jobs": 1}
    return {"config": config, "cells": {}, "policies": [], "knees": {}, "losses": [], "heatmap": None,
            "skipped": [], "wall_seconds": 1.0, "host": "h", "cpus": 2, "load_average": [0.0, 0.0, 0.0]}


def test_quick_replaces_only_what_was_left_at_its_default(tmp_path: Path) -> None:
    config = matrix.config_from_args(_args(tmp_path, quick=True, fleets="8"))
    assert config.fleets == [8] and config.seeds == matrix.QUICK["seeds"]
    assert config.workloads == matrix.QUICK["workloads"]


def test_shared_trace_windows_differ_by_seed_and_start_at_zero() -> None:
    from pilotfish.simulator.traces import default_trace_dir

    folder = default_trace_dir()
    if folder is None or not (folder / "azure_code_2023.csv").exists():
        pytest.skip("the shared traces are not here")
    a = matrix.base_trace("trace:azure_code_2023.csv", 50, 0, None)
    b = matrix.base_trace("trace:azure_code_2023.csv", 50, 1, None)
    assert len(a) == len(b) == 50 and a != b
    assert 0 < min(r.arrival for r in a) < 0.01 and 0 < min(r.arrival for r in b) < 0.01


@pytest.mark.parametrize("jobs", [1, 2])
def test_jobs_start_when_what_they_need_is_known_and_knees_go_first(jobs: int) -> None:
    import operator

    config = matrix.MatrixConfig(jobs=jobs)
    seen: list[object] = []

    def then(key: object, result: object) -> list[matrix.Job]:
        seen.append(key)
        if key == "knee-a":  # unlocks a run, and a knee that must start before the runs still waiting
            return [(1, "run-a", operator.mul, (result, 10)), (0, "knee-b", operator.add, (result, 100))]
        if key == "knee-b":
            return [(1, "run-b", operator.neg, (result,))]
        return []

    results = matrix._run_graph(config, [(0, "knee-a", operator.add, (1, 2)), (1, "run-0", operator.add, (0, 0))],
                                then)
    assert results == {"knee-a": 3, "run-0": 0, "run-a": 30, "knee-b": 103, "run-b": -103}
    assert seen.index("knee-a") < seen.index("run-a") and seen.index("knee-b") < seen.index("run-b")
    if jobs == 1:  # one at a time, by priority then by when it was added
        assert seen == ["knee-a", "knee-b", "run-0", "run-a", "run-b"]


def test_step_scales_slow_the_fleet_each_cell_runs_on(tmp_path: Path) -> None:
    even = matrix.config_from_args(_args(tmp_path))
    slowed = matrix.config_from_args(_args(tmp_path, step_scales="1,3"))
    assert slowed.step_scales == [1.0, 3.0]
    cell = ("family:rag:context=1024-2048", 2, 0, 1.0, "round-robin")
    alike, mixed = matrix.run_cell(even, *cell), matrix.run_cell(slowed, *cell)
    assert alike["finished"] == mixed["finished"] > 0
    # half the engines three times slower: later first tokens, at the median and in the tail
    assert mixed["ttft_p50"] > alike["ttft_p50"] and mixed["ttft_p99"] > alike["ttft_p99"]
    assert step_scales_note(slowed.step_scales) == "; engine step times 1, 3 x the profile's, repeated over the fleet"
    assert step_scales_note(even.step_scales) == ""
