"""bench fidelity's speed and arrival tracking: the arithmetic, the refits and the profiles it
writes (the runs themselves need vLLM and minutes; `pilotfish bench fidelity` is run by hand, see
the README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotfish.bench import fidelity
from pilotfish.simulator.calibrate.saturation import at_speed
from pilotfish.simulator.engine.step_time import StepTimeProfile, load_profile

PROFILE = StepTimeProfile(name="fit", base_ms=2.4, prefill_ms_per_token=0.013, decode_ms_per_token=0.12,
                          context_ms_per_token=0.0003, api_overhead_ms=3.5, shared_cpu=True)  # fmt: skip


def test_each_run_gets_the_mean_speed_of_the_probes_around_it() -> None:
    # probes before run 1, between runs 1 and 2, after run 2; the calibration's phase took 2.0 s
    assert fidelity.slowdowns([2.0, 3.0, 4.5], 2.0) == pytest.approx([6**0.5 / 2, 13.5**0.5 / 2])
    assert fidelity.slowdowns([2.0], 2.0) == []  # no run bracketed: nothing to track


def test_the_profile_at_a_speed_loads_back_with_every_time_term_scaled(tmp_path: Path) -> None:
    path = fidelity._profile_at(PROFILE, 1.3, tmp_path, "run1-80")
    assert Path(path).name == "profile-run1-80.yaml"
    loaded = load_profile(path)
    assert loaded == at_speed(PROFILE, 1.3)
    assert loaded.base_ms == pytest.approx(2.4 * 1.3) and loaded.api_overhead_ms == pytest.approx(3.5 * 1.3)
    assert loaded.shared_cpu and loaded.name == "fit"


def test_a_run_is_refitted_to_the_arrival_cost_and_decode_level_the_probes_around_it_found(tmp_path: Path) -> None:
    """The probes' plans come from the calibrated profile; refitted at the run's speed, the pair
    they measured on a "real" engine is found again, and the written profile carries it."""
    import asyncio

    from pilotfish.simulator.calibrate import arrivals
    from pilotfish.simulator.calibrate.probes import VirtualProber
    from pilotfish.simulator.calibrate.saturation import SaturationPlan, measure_saturation, scaled
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.engine.scheduler import V1Engine

    engine = EngineConfig(max_model_len=1024, num_gpu_blocks=95, block_size=32, max_num_seqs=16,
                          max_num_batched_tokens=1024)  # fmt: skip
    fitted = arrivals.with_busy_arrival(PROFILE, 1.0)
    real = arrivals.with_busy_arrival(scaled(at_speed(fitted, 1.2), 0.9), 2.5)  # slower, decodes x0.9, 2.5 ms

    async def probes() -> tuple[float, float]:
        sat = SaturationPlan.for_engine(fidelity.CALIBRATED_PROMPT_TOKENS, 16)
        makespan = (await measure_saturation(VirtualProber(V1Engine(engine, real)), sat, (16, 256), 1)).makespan_s
        plan = arrivals.ArrivalPlan.for_engine(fidelity.CALIBRATED_PROMPT_TOKENS, 16, fitted)
        ratio = (await arrivals.measure_arrivals(VirtualProber(V1Engine(engine, real)), plan, (16, 256), 2)).slowdown
        return makespan, ratio

    makespan, ratio = asyncio.run(probes())
    plan = arrivals.ArrivalPlan.for_engine(fidelity.CALIBRATED_PROMPT_TOKENS, 16, fitted)
    refitted = fidelity._refit_around(fitted, 1.2, engine, plan, [makespan, makespan], [ratio, ratio])
    assert refitted.busy_arrival_ms == pytest.approx(2.5, rel=0.03)
    assert refitted.decode_ms_per_token == pytest.approx(real.decode_ms_per_token, rel=0.03)
    assert refitted.base_ms == pytest.approx(real.base_ms)
    written = load_profile(fidelity._profile_at(fitted, 1.2, tmp_path, "run1-80-arrivals", refitted))
    assert written == refitted


def test_a_ratio_table_has_a_row_per_rate_with_the_four_latency_cells() -> None:
    rows = [{"rate": rate, **{k: {"ratio_x": r + i / 100} for i, k in enumerate(fidelity.LATENCIES)}}
            for rate, r in ((4.0, 1.0), (80.0, 0.5))]  # fmt: skip
    assert fidelity._ratio_table(rows, "ratio_x") == [
        "| rate | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |",
        "|---|---|---|---|---|",
        "| 4/s | **1.00** | **1.01** | **1.02** | **1.03** |",
        "| 80/s | **0.50** | **0.51** | **0.52** | **0.53** |",
    ]


def test_a_ratio_section_says_whether_its_ratios_met_the_goal() -> None:
    rows = [{"rate": 80.0, **{k: {"ratio_x": 1.1, "ratio_y": 0.8} for k in fidelity.LATENCIES}}]
    section = fidelity._ratio_section("At some speed", "Prose:", rows, "ratio_x", "at some speed")
    assert section[:5] == ["", "## At some speed", "", "Prose:", ""]
    assert section[5:-2] == fidelity._ratio_table(rows, "ratio_x")
    assert section[-1] == "Latency goal at some speed: **met**."
    assert fidelity._ratio_section("T", "P", rows, "ratio_y", "so")[-1] == "Latency goal so: **missed**."


def test_reusing_an_earlier_runs_real_side_simulates_compares_and_reports_each_rate(tmp_path: Path) -> None:
    """--reuse-real end to end, without vLLM: the earlier run's "real" side is the simulator's own
    replay of the same workload, so every step of the comparison and the report runs here."""
    import argparse
    import asyncio
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    fidelity.add_arguments(parser)
    workload_flags = ["--rates", "20,40", "--groups", "2", "--prompts-per-group", "3", "--real-repeats", "2"]
    earlier = tmp_path / "earlier"
    args = parser.parse_args(["--out", str(tmp_path / "out"), "--profile", "cpu-tiny", "--reuse-real", str(earlier),
                              *workload_flags])  # fmt: skip
    cfg = fidelity.FidelityConfig(rates=[20.0, 40.0], groups=2, prompts_per_group=3, profile="cpu-tiny")
    traces = [fidelity.workload(rate, seed, cfg) for seed, rate in enumerate(cfg.rates)]
    shape = {"model": "pilotfish-sim", "max_model_len": 2048, "block_size": 32, "num_gpu_blocks": 96}
    real = fidelity.Real(shape=shape, real_runs=[], profile_path="cpu-tiny", profile=load_profile("cpu-tiny"))
    runs = asyncio.run(fidelity._simulate(cfg, real, fidelity._sim_engine(cfg, real), traces))
    earlier.mkdir()
    (earlier / "result.json").write_text(json.dumps({"engine": shape, "rates": cfg.rates, "requests_per_rate": 6,
                                                     "real_runs": [runs, runs]}))  # fmt: skip

    assert fidelity.run(args) == 0

    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["benchmark"] == "fidelity" and result["settings"]["reuse_real"] == str(earlier)
    assert [row["rate"] for row in result["rows"]] == [20.0, 40.0]
    for row in result["rows"]:
        for key in fidelity.LATENCIES:
            assert row[key]["real_runs"] == [row[key]["real"]] * 2 and row[key]["ratio"] > 0
            assert len(row[key]["sim_steps_tracked_runs"]) == 2  # each real run simulated at its own step speed
    assert result["speed"] is None and result["timeline_tracked"] is None  # --profile: no probes; no step log
    assert len(result["steps_tracked"]["speeds"]) == 4  # two runs x two rates
    report = (tmp_path / "out" / "report.md").read_text()
    assert report == fidelity.render_markdown(result) + "\n"  # the report is redrawn from result.json alone
    assert "## At the speed vLLM's own steps ran" in report and "## Steps" in report
