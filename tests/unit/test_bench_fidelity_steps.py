"""bench fidelity's step log: parsing vLLM's lines, the simulator's recorder, and the sums."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from pilotfish.bench import fidelity
from pilotfish.bench.fidelity_steps import (
    SimStepRecorder,
    Step,
    TimedProfile,
    parse_steps,
    speed_timeline,
    summarize_steps,
)
from pilotfish.simulator.calibrate import arrivals
from pilotfish.simulator.calibrate.probes import VirtualProber
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile

PROFILE = StepTimeProfile(name="fit", base_ms=2.4, prefill_ms_per_token=0.013, decode_ms_per_token=0.12,
                          context_ms_per_token=0.0003, api_overhead_ms=3.5, shared_cpu=True)  # fmt: skip
ENGINE = EngineConfig(max_model_len=1024, num_gpu_blocks=95, block_size=32, max_num_seqs=16,
                      max_num_batched_tokens=1024)  # fmt: skip
EVERYTHING = (float("-inf"), float("inf"))


def test_log_lines_parse_and_a_torn_last_line_is_skipped() -> None:
    text = "1000000000 1004000000 128 3 900 2 1\n1005000000 1008000000 0 4 1000 0 0\n1009000000 10"
    assert parse_steps(text) == [
        Step(1.0, 1.004, 128, 3, 900, 2, True),
        Step(1.005, 1.008, 0, 4, 1000, 0, False),
    ]


def test_a_cycle_runs_to_the_next_start_and_only_while_requests_are_left() -> None:
    flat = StepTimeProfile(name="flat", base_ms=2.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0)
    steps = [
        Step(0.000, 0.002, 64, 0, 64, 1, True),  # cycle 3 ms (1 ms between steps), predicted 2
        Step(0.003, 0.005, 0, 1, 65, 0, False),  # idle after: no cycle
        Step(1.000, 1.002, 0, 1, 66, 1, True),  # cycle 2 ms; the last step has no next
        Step(1.002, 1.004, 0, 1, 67, 0, True),
        Step(5.000, 5.002, 0, 1, 68, 0, True),  # outside the window
    ]
    s = summarize_steps(steps, (0.0, 2.0), flat)
    assert s["steps"] == 4 and s["busy_cycles"] == 2
    assert s["busy_s"] == pytest.approx(0.005) and s["predicted_s"] == pytest.approx(0.004)
    assert s["in_step_fraction"] == pytest.approx(0.8)
    assert s["by_kind"]["with_prefill"]["over_predicted"] == pytest.approx(1.5)
    assert s["by_kind"]["decode_only"]["over_predicted"] == pytest.approx(1.0)
    assert s["arrivals"] == 2 and s["steps_with_prefill"] == 1


def test_the_simulator_steps_match_its_profile_but_for_what_arrivals_take() -> None:
    """A simulated engine's cycles are its steps; only the steps after an arrival on a busy engine
    run longer than the profile's formula, by the busy-arrival cost."""
    profile = arrivals.with_busy_arrival(PROFILE, 2.5)
    core = V1Engine(ENGINE, profile)
    recorder = SimStepRecorder(lambda: bool(core.running or core.waiting))
    core.add_observer(recorder)
    plan = arrivals.ArrivalPlan.for_engine(fidelity.CALIBRATED_PROMPT_TOKENS, 16, profile)
    asyncio.run(arrivals.measure_arrivals(VirtualProber(core), plan, (16, 256), 2))

    s = summarize_steps(recorder.steps, EVERYTHING, profile)
    assert s["steps"] == len(recorder.steps) > 0 and s["arrivals"] > 0
    assert s["in_step_fraction"] == pytest.approx(1.0)
    assert s["by_kind"]["no_arrivals"]["over_predicted"] == pytest.approx(1.0)
    assert s["by_kind"]["with_arrivals"]["over_predicted"] > 1.0
    stolen = s["busy_s"] - s["predicted_s"]
    busy_arrivals = sum(st.arrivals for st, _ in itertools.pairwise(recorder.steps) if st.busy_after)
    assert 0 < stolen <= busy_arrivals * 0.0025 + 1e-9


def test_the_speed_inside_a_run_is_read_second_by_second() -> None:
    """A run whose first second went at the profile's speed and whose second went 1.5x slower."""
    flat = StepTimeProfile(name="flat", base_ms=10.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0)
    steps, t = [], 0.0
    while t < 2.0:
        cycle = 0.010 if t < 1.0 else 0.015
        steps.append(Step(t, t + cycle, 0, 1, 10, 0, True))
        t += cycle
    s = summarize_steps(steps, (0.0, 2.0), flat)
    low, high = s["per_second_over_predicted"]
    assert low == pytest.approx(1.0) and high == pytest.approx(1.5)


def test_the_speed_timeline_is_vllms_speed_each_second_over_the_simulators_own_ratio() -> None:
    flat = StepTimeProfile(name="flat", base_ms=10.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0)
    steps, t = [], 0.0
    while t < 2.0:  # a second at the profile's speed, a second 1.5x slower, then idle
        cycle = 0.010 if t < 1.0 else 0.015
        steps.append(Step(t, t + cycle, 0, 1, 10, 0, True))
        t += cycle
    steps.append(Step(t, t + 0.01, 0, 1, 10, 0, False))
    line = speed_timeline(steps, (0.0, 2.5), flat, baseline=1.25)
    busy = sum(b.start_s - a.start_s for a, b in itertools.pairwise(steps))
    mean = busy / (0.010 * (len(steps) - 1))
    assert line == pytest.approx([1.0 / 1.25, 1.5 / 1.25, mean / 1.25])


def test_a_timed_profile_scales_its_steps_by_the_second_it_is_in() -> None:
    timed = TimedProfile(PROFILE, [1.0, 2.0])
    plain = PROFILE.step_seconds(100, 4, 1000)
    assert timed.step_seconds(100, 4, 1000) == pytest.approx(plain)  # not started: the first second's
    timed.start(time.monotonic() - 1.5)
    assert timed.step_seconds(100, 4, 1000) == pytest.approx(2 * plain)
    timed.start(time.monotonic() - 60)  # past the timeline: its last second holds
    assert timed.step_seconds(100, 4, 1000) == pytest.approx(2 * plain)
    assert timed.busy_arrival_seconds == PROFILE.busy_arrival_seconds and timed.name == "fit"
