"""The CPU an arrival takes from a busy engine, from one phase of spaced arrivals.

Where vLLM's API server shares the engine's one CPU (`shared_cpu`), each request's serving work
(HTTP, validation, the hop to the engine core) is CPU the steps do not get. The first-token
overhead that single requests show is that work on an idle engine; on a busy core it measured
larger: `bench fidelity` at 80 req/s ran 10-30% faster in the model than in vLLM until the
overhead was set by hand to about three times the fitted one. So calibration times a phase that
isolates it: short requests arriving one by one at a fixed spacing, each landing on an engine
already decoding a few others, so every step is slowed by the arrivals of its interval and the
requests' mean latency grows with their cost. The engine model replays the phase and
`busy_arrival_ms` is the value that makes its mean latency the measured one.

The spacing keeps the engine busy but well short of saturation (about a quarter of its seats in
use, by the fitted profile): at the knee a small error in any term moves latency a lot.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import msgspec

from pilotfish.simulator.calibrate.probes import Prober, VirtualProber
from pilotfish.simulator.calibrate.saturation import SaturationPhase, saturation_factor, scaled
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile

# busy_arrival_ms is searched in [0, _MAX_MS]; a phase slower than that spans says the engine is
# not what the model describes
_MAX_MS = 50.0
_JOINT_ROUNDS = 8


@dataclass(frozen=True, slots=True)
class ArrivalPlan:
    prompt_lengths: tuple[int, ...]  # cycled over the requests
    requests: int
    max_tokens: int
    interval_s: float  # between one request's send and the next's
    repeats: int = 3

    @classmethod
    def for_engine(cls, max_prompt_tokens: int, max_num_seqs: int, profile: StepTimeProfile) -> ArrivalPlan:
        """Short prompts, 32 tokens each, spaced so about a quarter of the seats are in use."""
        top = max_prompt_tokens
        lengths = (max(8, top // 16), max(8, top // 8), max(8, top // 4))
        max_tokens = 32
        seats = max(1, max_num_seqs // 4)
        context = seats * (sum(lengths) // len(lengths) + max_tokens // 2)
        step_s = profile.step_seconds(0, seats, context)
        # arrival rate x time a request holds its seat = seats in use
        return cls(prompt_lengths=lengths, requests=6 * max_num_seqs, max_tokens=max_tokens,
                   interval_s=max_tokens * step_s / seats)  # fmt: skip

    def offsets(self) -> list[float]:
        return [i * self.interval_s for i in range(self.requests)]


@dataclass(frozen=True, slots=True)
class ArrivalPhase:
    prompt_lengths: list[int]
    max_tokens: int
    interval_s: float
    mean_latency_s: float  # median over the repeats of the requests' mean send -> last token


def _mean_latency(streams: list[list[float]]) -> float:
    return statistics.fmean(s[-1] for s in streams if s)


async def measure_arrivals(prober: Prober, plan: ArrivalPlan, vocab: tuple[int, int], seed: int) -> ArrivalPhase:
    rng = random.Random(seed)
    lengths = [plan.prompt_lengths[i % len(plan.prompt_lengths)] for i in range(plan.requests)]
    means = []
    for _ in range(plan.repeats):
        # fresh random prompts each time: nothing hits the prefix cache
        prompts = [[rng.randrange(*vocab) for _ in range(n)] for n in lengths]
        means.append(_mean_latency(await prober.stream(prompts, plan.max_tokens, plan.offsets())))
    return ArrivalPhase(lengths, plan.max_tokens, plan.interval_s, statistics.median(means))


def with_busy_arrival(profile: StepTimeProfile, ms: float) -> StepTimeProfile:
    return msgspec.structs.replace(profile, busy_arrival_ms=ms)


async def virtual_mean_latency(profile: StepTimeProfile, phase: ArrivalPhase, engine: EngineConfig) -> float:
    rng = random.Random(0)  # distinct random prompts, as measured: no prefix is shared
    prompts = [[rng.randrange(16, 256) for _ in range(n)] for n in phase.prompt_lengths]
    offsets = [i * phase.interval_s for i in range(len(prompts))]
    streams = await VirtualProber(V1Engine(engine, profile)).stream(prompts, phase.max_tokens, offsets)
    return _mean_latency(streams)


async def busy_arrival_ms(profile: StepTimeProfile, phase: ArrivalPhase, engine: EngineConfig) -> float:
    """The busy-arrival cost (ms) that makes the model's mean latency the measured one."""
    lo, hi = 0.0, _MAX_MS
    if await virtual_mean_latency(with_busy_arrival(profile, lo), phase, engine) >= phase.mean_latency_s:
        return lo
    if await virtual_mean_latency(with_busy_arrival(profile, hi), phase, engine) <= phase.mean_latency_s:
        return hi
    for _ in range(24):  # latency grows with the cost: bisect to ~3e-6 ms
        mid = (lo + hi) / 2
        if await virtual_mean_latency(with_busy_arrival(profile, mid), phase, engine) < phase.mean_latency_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


async def fit_busy_arrival(
    profile: StepTimeProfile, factor: float, saturated: SaturationPhase, arrivals: ArrivalPhase, engine: EngineConfig
) -> tuple[float, float]:
    """(busy_arrival_ms, decode factor) that fit both phases. Each phase pays both terms (the
    saturated phase's 63 late arrivals each land on a busy engine), so they are fitted in turn,
    each with the other's latest value, until the decode factor settles."""
    busy = 0.0
    for _ in range(_JOINT_ROUNDS):
        busy = await busy_arrival_ms(scaled(profile, factor), arrivals, engine)
        before, factor = factor, await saturation_factor(with_busy_arrival(profile, busy), saturated, engine)
        if abs(factor / before - 1) < 1e-3:
            break
    return busy, factor
