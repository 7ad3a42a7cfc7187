"""`sim calibrate`: the least-squares fit, and the whole measurement recovering a known profile
from the engine model itself (in virtual time, so the check is exact and takes no wall time)."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from pilotfish.simulator.calibrate import arrivals
from pilotfish.simulator.calibrate.command import plan_for, profile_yaml
from pilotfish.simulator.calibrate.fit import Observation, fit_profile
from pilotfish.simulator.calibrate.measure import CalibrationPlan, measure
from pilotfish.simulator.calibrate.probes import VirtualProber, metric_labels, metric_value
from pilotfish.simulator.calibrate.saturation import (
    SaturationPhase,
    SaturationPlan,
    at_speed,
    measure_saturation,
    saturation_factor,
    scaled,
)
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile, load_profile

KNOWN = [
    StepTimeProfile(name="a", base_ms=5.0, prefill_ms_per_token=0.05, decode_ms_per_token=0.4,
                    context_ms_per_token=0.003),
    StepTimeProfile(name="b", base_ms=10.0, prefill_ms_per_token=0.11, decode_ms_per_token=0.03,
                    context_ms_per_token=0.00009),
    StepTimeProfile(name="c", base_ms=2.0, prefill_ms_per_token=0.0, decode_ms_per_token=1.0),
]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 1e-3 * abs(b)


@pytest.mark.parametrize("known", KNOWN, ids=lambda p: p.name)
async def test_calibration_recovers_a_known_profile(known: StepTimeProfile) -> None:
    core = V1Engine(EngineConfig(max_model_len=2048, num_gpu_blocks=4096, block_size=16), known)
    observations = await measure(VirtualProber(core), CalibrationPlan())
    fit = fit_profile(observations, "fitted")
    for field in ("base_ms", "prefill_ms_per_token", "decode_ms_per_token", "context_ms_per_token"):
        assert close(getattr(fit.profile, field), getattr(known, field)), field
    assert fit.overhead_ms == pytest.approx(0.0, abs=0.01) and fit.r2 > 0.9999


def test_the_fit_separates_overhead_and_pins_negative_terms_at_zero() -> None:
    # ttft = 7 + 3 + 0.1 P + 0.01 C; itl = 3 + 0.5 D + 0.01 C; plus a decode term that would fit negative
    obs = [Observation("ttft", p, 0, c, (7 + 3 + 0.1 * p + 0.01 * c) / 1000) for p, c in
           [(10, 10), (100, 100), (50, 300), (200, 200), (20, 500)]]
    obs += [Observation("itl", 0, d, c, (3 + 0.5 * d + 0.01 * c) / 1000) for d, c in
            [(1, 100), (4, 400), (8, 2000), (16, 1000), (2, 3000)]]
    fit = fit_profile(obs, "x")
    assert fit.profile.base_ms == pytest.approx(3.0) and fit.overhead_ms == pytest.approx(7.0)
    assert fit.profile.prefill_ms_per_token == pytest.approx(0.1)
    assert fit.profile.decode_ms_per_token == pytest.approx(0.5)
    assert fit.profile.context_ms_per_token == pytest.approx(0.01)
    falling = [Observation("itl", 0, d, 0, (10 - 0.1 * d) / 1000) for d in range(1, 9)]
    falling += [Observation("ttft", p, 0, p, (10 + 0.2 * p) / 1000) for p in (10, 50, 100)]
    assert fit_profile(falling, "y").profile.decode_ms_per_token == 0.0


def test_the_written_profile_loads_back(tmp_path: Path) -> None:
    fit = fit_profile([Observation("ttft", p, 0, p, (12 + 0.1 * p) / 1000) for p in (10, 50, 100)] +
                      [Observation("itl", 0, d, 100 * d, (2 + 0.3 * d + 0.001 * 100 * d) / 1000) for d in (1, 2, 4)],
                      "fitted")
    path = tmp_path / "fitted.yaml"
    path.write_text(profile_yaml(fit, "http://127.0.0.1:1", "test"))
    loaded = load_profile(str(path))
    assert loaded.name == "fitted" and loaded.base_ms == pytest.approx(fit.profile.base_ms, rel=1e-5)
    assert loaded.api_overhead_ms >= 0


def test_the_plan_stays_inside_the_engine_limits() -> None:
    args = argparse.Namespace(max_prompt_tokens=512, max_batch=16, repeats=2, vocab_size=300)
    plan = plan_for(args)
    assert max(plan.prefill_lengths) == 512 and max(plan.batch_sizes) == 16
    assert plan.cached_prefix + max(plan.cached_suffixes) <= 512 + 512 // 4
    assert plan.vocab == (16, 300)


def test_shipped_cpu_tiny_profile_loads() -> None:
    profile = load_profile("cpu-tiny")
    assert profile.name == "cpu-tiny" and profile.base_ms > 0


def test_prometheus_text_helpers() -> None:
    text = ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="256"} 1.0\n')
    assert metric_value(text, "vllm:prefix_cache_hits_total") == 96.0
    assert metric_labels(text, "vllm:cache_config_info")["num_gpu_blocks"] == "256"


# ---- the saturated phase


SATURATION_ENGINE = EngineConfig(max_model_len=1024, num_gpu_blocks=96, block_size=32, max_num_seqs=16,
                                 max_num_batched_tokens=1024)  # fmt: skip
SATURATION_PLAN = SaturationPlan(prompt_lengths=(32, 128, 256), requests=64, max_tokens=64, repeats=2)


@pytest.mark.parametrize("factor", [0.6, 1.0, 1.7])
async def test_the_saturated_phase_recovers_the_decode_level(factor: float) -> None:
    fitted = KNOWN[0]
    engine = V1Engine(SATURATION_ENGINE, scaled(fitted, factor))  # the "real" engine: decode terms x factor
    phase = await measure_saturation(VirtualProber(engine), SATURATION_PLAN, (16, 256), seed=3)
    assert engine.stats().num_preemptions_total > 0  # saturated indeed: the KV cache ran out
    found = await saturation_factor(fitted, phase, SATURATION_ENGINE)
    assert found == pytest.approx(factor, rel=1e-3)


@pytest.mark.parametrize("slowdown", [0.7, 1.0, 1.45])
async def test_a_machine_slower_by_a_factor_stretches_the_saturated_phase_by_it(slowdown: float) -> None:
    """What bench fidelity's speed probes rest on: the phase's makespan ratio is the slowdown."""
    profile = msgspec.structs.replace(KNOWN[0], api_overhead_ms=3.0, shared_cpu=True)
    then = await measure_saturation(VirtualProber(V1Engine(SATURATION_ENGINE, profile)), SATURATION_PLAN, (16, 256), 3)
    now = await measure_saturation(
        VirtualProber(V1Engine(SATURATION_ENGINE, at_speed(profile, slowdown))), SATURATION_PLAN, (16, 256), 3
    )
    assert now.makespan_s / then.makespan_s == pytest.approx(slowdown, rel=1e-6)


def test_the_plan_for_an_engine_queues_four_requests_per_seat() -> None:
    plan = SaturationPlan.for_engine(512, 16)
    assert (plan.requests, plan.prompt_lengths, plan.max_tokens) == (64, (32, 128, 256), 64)
    assert SATURATION_PLAN.prompt_lengths == plan.prompt_lengths  # the tests above measure what calibration does


async def test_a_makespan_beyond_the_model_is_clamped() -> None:
    phase = await measure_saturation(
        VirtualProber(V1Engine(SATURATION_ENGINE, KNOWN[0])), SATURATION_PLAN, (16, 256), seed=3
    )
    slow = SaturationPhase(phase.prompt_lengths, phase.max_tokens, phase.makespan_s * 100)
    assert await saturation_factor(KNOWN[0], slow, SATURATION_ENGINE) == 8.0


# ---- the arrivals phase


SHARED = msgspec.structs.replace(KNOWN[0], base_ms=2.0, api_overhead_ms=1.5, shared_cpu=True)


@pytest.mark.parametrize(("factor", "busy_ms"), [(1.0, 1.5), (1.3, 4.0), (0.8, 0.0)])
async def test_the_two_phases_recover_the_decode_level_and_the_busy_arrival_cost(factor: float, busy_ms: float) -> None:
    """Both phases pay both terms; fitted in turn they find the "real" engine's pair."""
    real = arrivals.with_busy_arrival(scaled(SHARED, factor), busy_ms)
    saturated = await measure_saturation(VirtualProber(V1Engine(SATURATION_ENGINE, real)), SATURATION_PLAN,
                                         (16, 256), seed=3)  # fmt: skip
    plan = arrivals.ArrivalPlan.for_engine(512, 16, SHARED)
    phase = await arrivals.measure_arrivals(VirtualProber(V1Engine(SATURATION_ENGINE, real)), plan, (16, 256), 5)
    start = await saturation_factor(SHARED, saturated, SATURATION_ENGINE)  # what calibration has first
    busy, found = await arrivals.fit_busy_arrival(SHARED, start, saturated, phase, SATURATION_ENGINE)
    assert busy == pytest.approx(busy_ms, abs=0.05) and found == pytest.approx(factor, rel=0.01)


async def test_the_arrivals_figure_does_not_hang_on_the_decode_terms() -> None:
    """The phase's figure is a ratio within one batch's run: a profile whose fixed and decode terms
    are off still reads the arrivals' cost (an absolute latency would charge the error to them)."""
    real = arrivals.with_busy_arrival(SHARED, 3.0)
    plan = arrivals.ArrivalPlan.for_engine(512, 16, SHARED)
    phase = await arrivals.measure_arrivals(VirtualProber(V1Engine(SATURATION_ENGINE, real)), plan, (16, 256), 1)
    off = msgspec.structs.replace(SHARED, base_ms=SHARED.base_ms * 1.2,
                                  decode_ms_per_token=SHARED.decode_ms_per_token * 1.5)  # fmt: skip
    assert await arrivals.busy_arrival_ms(off, phase, SATURATION_ENGINE) == pytest.approx(3.0, rel=0.05)


async def test_the_background_decodes_through_the_arrivals_and_they_slow_it() -> None:
    plan = arrivals.ArrivalPlan.for_engine(512, 16, SHARED)
    core = V1Engine(SATURATION_ENGINE, arrivals.with_busy_arrival(SHARED, 0.0))
    busiest = 0

    class Seats(EngineObserver):
        def request_scheduled(self, request: SimRequest, now: float) -> None:
            nonlocal busiest
            busiest = max(busiest, len(core.running))

    core.add_observer(Seats())
    free = await arrivals.measure_arrivals(VirtualProber(core), plan, (16, 256), seed=1)
    # the background and an arrival or two at a time: busy, short of the 16 seats, no preemption
    assert plan.background < busiest <= plan.background + 2 and core.stats().num_preemptions_total == 0
    assert free.slowdown > 1.0  # the arrivals' prefill alone lengthens the steps they join
    assert free.slowdown < await arrivals.virtual_slowdown(arrivals.with_busy_arrival(SHARED, 3.0), free,
                                                           SATURATION_ENGINE)  # fmt: skip


async def test_a_prober_times_each_request_from_its_own_send() -> None:
    profile = StepTimeProfile(name="flat", base_ms=10.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0,
                              api_overhead_ms=2.0)  # fmt: skip
    prober = VirtualProber(V1Engine(EngineConfig(max_model_len=256, num_gpu_blocks=64, block_size=16), profile))
    first, late = await prober.stream([[20] * 8, [21] * 8], [2, 3], offsets=[0.0, 1.0])
    # each reaches the engine 2 ms after its send, then one 10 ms step per token
    assert first == pytest.approx([0.012, 0.022]) and late == pytest.approx([0.012, 0.022, 0.032])


def test_a_profile_without_busy_arrival_charges_its_serving_overhead() -> None:
    old = msgspec.structs.replace(SHARED, busy_arrival_ms=None)
    assert old.busy_arrival_seconds == pytest.approx(0.0015)
    assert arrivals.with_busy_arrival(old, 4.0).busy_arrival_seconds == pytest.approx(0.004)
    assert msgspec.structs.replace(old, shared_cpu=False, busy_arrival_ms=4.0).busy_arrival_seconds == 0.0
    assert at_speed(arrivals.with_busy_arrival(old, 4.0), 1.5).busy_arrival_ms == pytest.approx(6.0)
