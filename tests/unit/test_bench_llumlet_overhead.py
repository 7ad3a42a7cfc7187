"""bench llumlet: which engines it compares, in what order, and how it reads their costs."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from pilotfish.bench import llumlet_overhead as bench


def test_default_variant_writes_from_the_engine_process() -> None:
    assert bench._variants(None) == {"engine-thread": {"PILOTFISH_EXPORT_PROCESS": "false"}}
    assert bench._variants(["none"]) == {}
    assert bench._variants(["slow:PILOTFISH_MIN_EXPORT_INTERVAL_US=5000,PILOTFISH_GIL_SWITCH_INTERVAL_US=0"]) == {
        "slow": {"PILOTFISH_MIN_EXPORT_INTERVAL_US": "5000", "PILOTFISH_GIL_SWITCH_INTERVAL_US": "0"}
    }


@pytest.mark.parametrize(
    "given",
    [
        ["PILOTFISH_X=1"],  # no label
        ["baseline:PILOTFISH_X=1"],  # a label the bench uses itself
        ["a:PILOTFISH_X=1", "a:PILOTFISH_Y=2"],  # twice
        ["a:X=1"],  # not a llumlet setting
        ["A b:PILOTFISH_X=1"],
    ],
)
def test_bad_variants_fail_with_the_flag_named(given: list[str]) -> None:
    with pytest.raises(SystemExit, match="--variant"):
        bench._variants(given)


@pytest.mark.parametrize("rounds", [2, 4, 6])
def test_every_engine_serves_as_many_rounds_and_each_cycle_mirrors(rounds: int) -> None:
    bench._check_rounds(rounds)
    labels = ["plugin", "engine-thread", "baseline"]
    order = bench._order(labels)
    ran = list(itertools.islice(itertools.cycle(order), rounds * len(labels)))
    assert {label: ran.count(label) for label in labels} == dict.fromkeys(labels, rounds)
    # mirrored: the mean position of every engine within a cycle is the same, so drift falls alike
    assert len({sum(i for i, x in enumerate(order) if x == label) for label in labels}) == 1


def test_costs_are_paired_by_round_and_read_the_llumlets_report() -> None:
    base_rounds = [
        {"tokens_per_s": 100.0, "sched_cpu_us_per_step": 400.0, "schedule_cpu_us_per_step": 250.0},
        {"tokens_per_s": 200.0, "sched_cpu_us_per_step": 600.0, "schedule_cpu_us_per_step": 250.0},
    ]
    # 5% slower in each cycle; the scheduling CPU 30 and 50 us more than the same cycle's baseline;
    # in the second cycle the machine ran the plugin's round 10% slower (schedule 275 against 250)
    plug_rounds = [
        {"tokens_per_s": 95.0, "sched_cpu_us_per_step": 430.0, "schedule_cpu_us_per_step": 250.0},
        {"tokens_per_s": 190.0, "sched_cpu_us_per_step": 650.0, "schedule_cpu_us_per_step": 275.0},
    ]
    base = {"tokens_per_s": 150.0, "step_ms": 4.0, "engine_core_cpu_ms_per_token": 0.05, "vllm_cpu_ms_per_token": 0.3}
    plug = {"tokens_per_s": 142.5, "step_ms": 4.2, "engine_core_cpu_ms_per_token": 0.06, "vllm_cpu_ms_per_token": 0.3}
    report = (
        "9 status writes (0 from the engine's thread); ...; "
        "CPU per step: hooks 43.3 us (4.24% of the engine thread's 1022 us), export thread 153.0 us; "
        "of the hooks, writing 21.5 us (1.10 writes)"
    )
    costs = bench._costs(plug_rounds, base_rounds, plug, base, report)
    assert costs["sched_cpu_added_us_per_step"] == pytest.approx(40.0)
    assert costs["sched_cpu_added_ci95_us"] == pytest.approx(1.96 * statistics.stdev([30.0, 50.0]) / 2**0.5, abs=0.01)
    assert costs["sched_cpu_added_pct_of_step"] == pytest.approx(1.0)  # 40 us of a 4 ms step
    # at the machine's speed: 430 - 400 and 650 - 600 * 1.1
    assert costs["sched_cpu_added_at_speed_us_per_step"] == pytest.approx((30.0 - 10.0) / 2)
    assert costs["paired_throughput_overhead_pct"] == pytest.approx(5.0)
    assert costs["paired_throughput_overhead_ci95_pct"] == pytest.approx(0.0)
    assert costs["step_time_overhead_pct"] == pytest.approx(5.0)
    assert costs["engine_core_cpu_overhead_pct"] == pytest.approx(20.0)
    assert (costs["hook_cpu_us_per_step"], costs["export_cpu_us_per_step"]) == (43.3, 153.0)
    assert costs["inline_write_cpu_us_per_step"] == 21.5
    assert costs["hook_cpu_pct_of_step"] == pytest.approx(100 * 0.0433 / 4.0, abs=1e-3)
    assert bench._costs(plug_rounds, base_rounds, plug, base, "")["hook_cpu_us_per_step"] is None
    # the export process's line names its CPU so
    from_process = "...; CPU per step: hooks 30.1 us (2.98% of the engine thread's 1010 us), export process 41.5 us"
    costs = bench._costs(plug_rounds, base_rounds, plug, base, from_process)
    assert (costs["hook_cpu_us_per_step"], costs["export_cpu_us_per_step"]) == (30.1, 41.5)
    assert costs["inline_write_cpu_us_per_step"] is None


@pytest.mark.parametrize("rounds", [0, 1, 3, 5])
def test_rounds_that_leave_a_cycle_half_run_are_refused(rounds: int) -> None:
    with pytest.raises(SystemExit, match="--rounds"):
        bench._check_rounds(rounds)


def test_a_llumlet_setting_keeps_the_commas_in_its_value() -> None:
    assert bench._setting("PILOTFISH_NODE_ID=rack-1,row-2", "--llumlet-env") == ("PILOTFISH_NODE_ID", "rack-1,row-2")
    with pytest.raises(SystemExit, match="--llumlet-env"):
        bench._setting("NODE_ID=x", "--llumlet-env")


def test_a_baseline_that_measured_nothing_gives_no_figure_not_a_crash() -> None:
    zero = {"tokens_per_s": 0.0, "step_ms": 0.0, "engine_core_cpu_ms_per_token": 0.0, "vllm_cpu_ms_per_token": 0.0}
    plug = {"tokens_per_s": 90.0, "step_ms": 4.0, "engine_core_cpu_ms_per_token": 0.05, "vllm_cpu_ms_per_token": 0.3}
    costs = bench._costs(
        [{"tokens_per_s": 90.0, "sched_cpu_us_per_step": 400.0, "schedule_cpu_us_per_step": 250.0}],
        [{"tokens_per_s": 0.0, "sched_cpu_us_per_step": 0.0, "schedule_cpu_us_per_step": 0.0}],
        plug,
        zero,
        "hooks 4.0 us",
    )
    assert costs["throughput_overhead_pct"] is None and costs["paired_throughput_overhead_pct"] is None
    assert costs["sched_cpu_added_us_per_step"] is None and costs["sched_cpu_added_pct_of_step"] is None
    assert costs["step_time_overhead_pct"] is None and costs["hook_cpu_pct_of_step"] is None
    assert bench._signed(costs["paired_throughput_overhead_pct"], costs["paired_throughput_overhead_ci95_pct"]) == "-"


def test_the_probe_is_read_as_cpu_per_step_between_two_readings(tmp_path: Path) -> None:
    probe = tmp_path / "probe.txt"
    zeros = (0,) * 8
    assert bench.read_probe(probe) == zeros  # the engine has not written it yet
    probe.write_text("not a probe\n")
    assert bench.read_probe(probe) == zeros
    probe.write_text("120 1000000 2000000 3000000\n")  # a probe without the cycle counts: not this one's
    assert bench.read_probe(probe) == zeros
    probe.write_text("120 1000000 2000000 3000000 0 0 119 700000000\n")
    before = bench.read_probe(probe)
    # 400 steps later: 0.4 ms more in add_request, 8 ms in schedule, 12 ms in update_from_output;
    # 200 of the cycles burned (6.1 ms each), 200 did not (6.0 ms each)
    probe.write_text("520 1400000 10000000 15000000 200 1220000000 319 1900000000\n")
    after = bench.read_probe(probe)
    assert bench._sched_cpu_us(before, after) == pytest.approx(
        {
            "sched_cpu_us_per_step": 51.0,
            "add_request_cpu_us_per_step": 1.0,
            "schedule_cpu_us_per_step": 20.0,
            "update_from_output_cpu_us_per_step": 30.0,
        }
    )
    assert bench._cycles_us(before, after) == pytest.approx({"on_cycle_us": 6100.0, "off_cycle_us": 6000.0})
    assert set(bench._sched_cpu_us(before, before).values()) == {0.0}  # no step ran: nothing counted
    assert set(bench._cycles_us(before, before).values()) == {0.0}


def test_an_interleaved_control_prices_a_microsecond_of_engine_thread_cpu() -> None:
    rounds = [
        {"tokens_per_s": 100.0, "sched_cpu_us_per_step": 500.0, "schedule_cpu_us_per_step": 250.0,
         "on_cycle_us": 6100.0 + d, "off_cycle_us": 6000.0}
        for d in (-10.0, 0.0, 10.0)
    ]  # fmt: skip
    base_rounds = [
        {"tokens_per_s": 100.0, "sched_cpu_us_per_step": 400.0, "schedule_cpu_us_per_step": 250.0} for _ in range(3)
    ]
    figures = {"tokens_per_s": 100.0, "step_ms": 6.0, "engine_core_cpu_ms_per_token": 0.05}
    figures["vllm_cpu_ms_per_token"] = 0.3
    costs = bench._costs(rounds, base_rounds, figures, figures, "")
    assert costs["cycle_added_us"] == pytest.approx(100.0)
    # the same per round in percent of the cycle without: (100 + d) / 6000
    assert costs["cycle_added_pct"] == pytest.approx(100 * 100.0 / 6000, abs=1e-3)
    assert costs["cycle_added_ci95_pct"] == pytest.approx(100 * 1.96 * 10.0 / 6000 / 3**0.5, abs=1e-3)
    settings = {bench.BURN_US_ENV: "50", bench.BURN_BLOCK_ENV: "2"}
    rate = bench.exchange_rate(costs, settings)
    assert rate is not None and rate[0] == pytest.approx(2.0) and rate[1] > 0
    assert bench.exchange_rate(costs, {**settings, bench.BURN_AT_ENV: "dispatch"}) is None  # not at the step's end
    assert bench.exchange_rate(bench._costs(base_rounds, base_rounds, figures, figures, ""), settings) is None
    # 30 µs of CPU at 2 µs of step each, of a 6 ms step: 1%
    pct, ci = bench.implied_cost_pct(30.0, 0.0, (2.0, 0.0), 6.0)
    assert (pct, ci) == (1.0, 0.0)
    # either interval alone: 3 µs of CPU at 2, or 30 at 0.2, both 6 µs of step
    assert bench.implied_cost_pct(30.0, 3.0, (2.0, 0.2), 6.0)[1] == pytest.approx(100 * 72**0.5 / 6000, abs=1e-3)


def test_the_hooks_in_engine_figure_comes_from_engines_whose_llumlet_works_in_blocks() -> None:
    timed = {"cycle_added_us": 20.0, "cycle_added_ci95_us": 5.0, "cycle_added_pct": 0.4, "cycle_added_ci95_pct": 0.1}
    costs = {"plugin": {**timed}, "hooks": {**timed}, "control": {**timed}, "idle": {"cycle_added_us": None}}
    settings: dict[str, dict[str, str] | None] = {
        "plugin": {},  # the llumlet on every step: nothing timed in blocks
        "hooks": {bench.LLUMLET_BLOCK_ENV: "4"},
        "control": {bench.BURN_US_ENV: "300", bench.BURN_BLOCK_ENV: "4"},  # a burn, not the hooks
        "idle": {bench.LLUMLET_BLOCK_ENV: "4"},  # its probe timed no cycle
        "baseline": None,
    }
    assert bench.hooks_in_engine(costs, settings) == {"hooks": {"block": 4, **timed}}


def test_the_llumlets_own_report_is_read_from_its_periodic_or_its_last_line(tmp_path: Path) -> None:
    log = tmp_path / "plugin.log"
    assert bench._logged_staleness(log) == ""  # no log yet
    report = "812 status writes (from the export process); event -> Redis staleness p50 410 us, p99 1200 us"
    log.write_text(f"INFO llumlet host-8000: {report}\nINFO other\n")
    assert bench._logged_staleness(log) == report
    last = f"INFO [pilotfish export process] llumlet host-8000 stopping: {report}"
    log.write_text(f"INFO llumlet host-8000: older\n{last}\n")
    assert bench._logged_staleness(log) == report
