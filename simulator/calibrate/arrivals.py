"""The CPU an arrival takes from a busy engine, from a phase of arrivals onto a decoding batch.

Where vLLM's API server shares the engine's one CPU (`shared_cpu`), each request's serving work
(HTTP, validation, the hop to the engine core) is CPU the steps do not get. The first-token
overhead that single requests show is that work on an idle engine; on a busy core it measured
larger: `bench fidelity` at 80 req/s ran 10-30% faster in the model than in vLLM until the
overhead was set by hand to about three times the fitted one.

So calibration times it by difference. A few background requests decode a long output; in the
middle third of their run, short requests (one output token: a prefill step and nothing more)
arrive one by one. The background's inter-token gap while they arrive, over its gap before and
after, is the phase's figure: the fixed, decode and context terms are in both and cancel, and what
is left is each arrival's prefill (the fitted prefill term) and its serving work. The engine model
replays the phase and `busy_arrival_ms` is the value that gives the same ratio. An absolute figure
(a mean latency) would charge any error of the fixed and decode terms to the arrivals: measured,
one calibration fitted 0 ms that way where three others found about 3 ms.
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

_JOINT_ROUNDS = 8
_WINDOW_STEPS = 120  # background steps in each third: before, during and after the arrivals
_STEPS_PER_ARRIVAL = 4  # an arrival every few steps: each lands alone, on a busy engine


@dataclass(frozen=True, slots=True)
class ArrivalPlan:
    background: int  # requests decoding throughout
    background_prompt: int
    arrival_lengths: tuple[int, ...]  # prompt lengths of the arriving requests, cycled
    arrivals: int
    first_arrival_s: float  # after the background is sent
    interval_s: float  # between one arrival and the next
    repeats: int = 3

    @classmethod
    def for_engine(cls, max_prompt_tokens: int, max_num_seqs: int, profile: StepTimeProfile) -> ArrivalPlan:
        """A quarter of the seats decoding; short prompts arriving every few of their steps."""
        top = max_prompt_tokens
        background = max(1, max_num_seqs // 4)
        prompt = max(8, top // 8)
        step_s = profile.step_seconds(0, background, background * (prompt + _WINDOW_STEPS * 3 // 2))
        return cls(background=background, background_prompt=prompt,
                   arrival_lengths=(max(8, top // 16), max(8, top // 8)), arrivals=_WINDOW_STEPS // _STEPS_PER_ARRIVAL,
                   first_arrival_s=_WINDOW_STEPS * step_s, interval_s=_STEPS_PER_ARRIVAL * step_s)  # fmt: skip

    @property
    def background_tokens(self) -> int:
        # three windows, and a margin: on a slower engine the arrivals end later in its output
        return 4 * _WINDOW_STEPS

    def arrival_offsets(self) -> list[float]:
        return [self.first_arrival_s + i * self.interval_s for i in range(self.arrivals)]


@dataclass(frozen=True, slots=True)
class ArrivalPhase:
    plan: ArrivalPlan
    slowdown: float  # median over the repeats: the background's gap during the arrivals / outside them


def _mean_gap(stream: list[float], start: float, end: float) -> float | None:
    inside = [t for t in stream if start <= t < end]
    if len(inside) < 10:  # a few tokens may be one burst: their gap says nothing of the step
        return None
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def slowdown(streams: list[list[float]], plan: ArrivalPlan) -> float:
    """How much longer the background's steps were while the requests arrived."""
    offsets = plan.arrival_offsets()
    during = (offsets[0], offsets[-1] + plan.interval_s)
    # the last arrival's prefill ends a step or two after it is sent: its own interval covers that
    span = during[1] - during[0]
    before = (max(min(s[0] for s in streams), during[0] - span), during[0])
    after = (during[1], during[1] + span)
    ratios = []
    for s in streams:
        ahead, amid, behind = (_mean_gap(s, *window) for window in (before, during, after))
        if ahead and amid and behind:
            ratios.append(amid / ((ahead + behind) / 2))
    if not ratios:
        raise RuntimeError("arrivals phase: the background did not decode through all three windows")
    return statistics.median(ratios)


async def _run(prober: Prober, plan: ArrivalPlan, prompts: list[list[int]]) -> float:
    # the background decodes long outputs; each arrival makes one token (its prefill step)
    tokens = [plan.background_tokens] * plan.background + [1] * plan.arrivals
    streams = await prober.stream(prompts, tokens, [0.0] * plan.background + plan.arrival_offsets())
    return slowdown(streams[:plan.background], plan)


async def measure_arrivals(prober: Prober, plan: ArrivalPlan, vocab: tuple[int, int], seed: int) -> ArrivalPhase:
    rng = random.Random(seed)
    figures = []
    for _ in range(plan.repeats):
        # fresh random prompts each time: nothing hits the prefix cache
        figures.append(await _run(prober, plan, _prompts(plan, rng, vocab)))
    return ArrivalPhase(plan, statistics.median(figures))


def _prompts(plan: ArrivalPlan, rng: random.Random, vocab: tuple[int, int]) -> list[list[int]]:
    lengths = [plan.background_prompt] * plan.background
    lengths += [plan.arrival_lengths[i % len(plan.arrival_lengths)] for i in range(plan.arrivals)]
    return [[rng.randrange(*vocab) for _ in range(n)] for n in lengths]


def with_busy_arrival(profile: StepTimeProfile, ms: float) -> StepTimeProfile:
    return msgspec.structs.replace(profile, busy_arrival_ms=ms)


async def virtual_slowdown(profile: StepTimeProfile, phase: ArrivalPhase, engine: EngineConfig) -> float:
    prompts = _prompts(phase.plan, random.Random(0), (16, 256))  # distinct random prompts, as measured
    return await _run(VirtualProber(V1Engine(engine, profile)), phase.plan, prompts)


async def busy_arrival_ms(profile: StepTimeProfile, phase: ArrivalPhase, engine: EngineConfig) -> float:
    """The busy-arrival cost (ms) that makes the model's slowdown the measured one.

    Searched up to the arrivals' interval: past that the engine would be all arrivals (a slowdown
    beyond it says the engine is not what the model describes, and it is clamped there)."""
    lo, hi = 0.0, phase.plan.interval_s * 1000
    if await virtual_slowdown(with_busy_arrival(profile, lo), phase, engine) >= phase.slowdown:
        return lo
    if await virtual_slowdown(with_busy_arrival(profile, hi), phase, engine) <= phase.slowdown:
        return hi
    for _ in range(24):  # the slowdown grows with the cost: bisect to ~3e-6 ms
        mid = (lo + hi) / 2
        if await virtual_slowdown(with_busy_arrival(profile, mid), phase, engine) < phase.slowdown:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


async def fit_busy_arrival(
    profile: StepTimeProfile, factor: float, saturated: SaturationPhase, arrivals: ArrivalPhase, engine: EngineConfig
) -> tuple[float, float]:
    """(busy_arrival_ms, decode factor) that fit both phases. The saturated phase's late arrivals
    land on a busy engine too, so the two are fitted in turn, each with the other's latest value,
    until the decode factor settles."""
    busy = 0.0
    for _ in range(_JOINT_ROUNDS):
        busy = await busy_arrival_ms(scaled(profile, factor), arrivals, engine)
        before, factor = factor, await saturation_factor(with_busy_arrival(profile, busy), saturated, engine)
        if abs(factor / before - 1) < 1e-3:
            break
    return busy, factor
