"""The level of the per-request decode terms under load, from one saturated phase.

Decode batches of 1 to B requests pin a step's fixed cost and its slope at small batches. On
vLLM-CPU, though, the steps of a saturated engine (a full batch, prefill chunks mixed in,
preemptions on a full KV cache) are slower than that slope extrapolates: measured, a profile
fitted from the batches alone ran `bench fidelity`'s workload 1.8x too fast at 80 req/s while it
matched 4 req/s. So calibration ends with a phase like that: more requests at once than the engine
runs, timed to the last token. The engine model replays the same phase in virtual time with the
fitted profile, and the per-decoding-request and per-context-token terms are scaled by the one
factor that makes the two makespans agree. The fixed cost and the prefill term stay as fitted:
the single requests and small batches measure them directly.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import msgspec

from pilotfish.simulator.calibrate.probes import Prober, VirtualProber
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile

# The factor is searched in [1/_RANGE, _RANGE]; a makespan outside what that spans says the
# engine is not what the model describes (or the machine changed speed mid-calibration).
_RANGE = 8.0


@dataclass(frozen=True, slots=True)
class SaturationPlan:
    prompt_lengths: tuple[int, ...]  # cycled over the requests
    requests: int
    max_tokens: int
    repeats: int = 3

    @classmethod
    def for_engine(cls, max_prompt_tokens: int, max_num_seqs: int) -> SaturationPlan:
        """Four requests per seat, prompts up to half the calibrated length: it queues and preempts."""
        top = max_prompt_tokens
        lengths = (max(8, top // 16), max(8, top // 4), max(8, top // 2))
        return cls(prompt_lengths=lengths, requests=4 * max_num_seqs, max_tokens=64)

    def request_lengths(self) -> list[int]:
        return [self.prompt_lengths[i % len(self.prompt_lengths)] for i in range(self.requests)]


@dataclass(frozen=True, slots=True)
class SaturationPhase:
    prompt_lengths: list[int]
    max_tokens: int
    makespan_s: float  # median over the repeats: first request sent -> last token received


async def measure_saturation(
    prober: Prober, plan: SaturationPlan, vocab: tuple[int, int], seed: int
) -> SaturationPhase:
    rng = random.Random(seed)
    lengths = plan.request_lengths()
    spans = []
    for _ in range(plan.repeats):
        # fresh random prompts each time: nothing hits the prefix cache
        prompts = [[rng.randrange(*vocab) for _ in range(n)] for n in lengths]
        streams = await prober.stream(prompts, plan.max_tokens)
        spans.append(max(s[-1] for s in streams if s))
    return SaturationPhase(lengths, plan.max_tokens, statistics.median(spans))


def at_speed(profile: StepTimeProfile, slowdown: float) -> StepTimeProfile:
    """The profile on a machine `slowdown` times slower than when it was fitted: every time
    term, serving overhead included, scales alike (a saturated phase's makespan scales with it)."""
    return msgspec.structs.replace(
        profile,
        base_ms=profile.base_ms * slowdown,
        prefill_ms_per_token=profile.prefill_ms_per_token * slowdown,
        decode_ms_per_token=profile.decode_ms_per_token * slowdown,
        context_ms_per_token=profile.context_ms_per_token * slowdown,
        api_overhead_ms=profile.api_overhead_ms * slowdown,
        busy_arrival_ms=None if profile.busy_arrival_ms is None else profile.busy_arrival_ms * slowdown,
    )


def scaled(profile: StepTimeProfile, factor: float) -> StepTimeProfile:
    return msgspec.structs.replace(
        profile,
        decode_ms_per_token=profile.decode_ms_per_token * factor,
        context_ms_per_token=profile.context_ms_per_token * factor,
    )


async def virtual_makespan(profile: StepTimeProfile, phase: SaturationPhase, engine: EngineConfig) -> float:
    rng = random.Random(0)  # distinct random prompts, as measured: no prefix is shared
    prompts = [[rng.randrange(16, 256) for _ in range(n)] for n in phase.prompt_lengths]
    streams = await VirtualProber(V1Engine(engine, profile)).stream(prompts, phase.max_tokens)
    return max(s[-1] for s in streams if s)


async def saturation_factor(profile: StepTimeProfile, phase: SaturationPhase, engine: EngineConfig) -> float:
    """The factor on the decode terms that makes the model's makespan the measured one."""
    lo, hi = 1 / _RANGE, _RANGE
    if await virtual_makespan(scaled(profile, hi), phase, engine) < phase.makespan_s:
        return hi
    if await virtual_makespan(scaled(profile, lo), phase, engine) > phase.makespan_s:
        return lo
    for _ in range(24):  # the makespan grows with the factor: bisect to ~1e-7 of the range
        mid = (lo * hi) ** 0.5
        if await virtual_makespan(scaled(profile, mid), phase, engine) < phase.makespan_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5
