"""A synthetic shared-prefix workload: groups of prompts that share a system prompt.

Each request is the system prompt of its group followed by a question of its own; lengths are
fixed or drawn uniformly from a range, arrivals are Poisson at a given rate. Seeded: the same
spec gives the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pilotfish.simulator.traces.model import Trace, TraceRequest

Length = int | tuple[int, int]  # a fixed length, or an inclusive range drawn uniformly


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    groups: int = 8
    prompts_per_group: int = 32
    system_prompt_length: Length = 1024
    question_length: Length = 128
    output_length: Length = 128
    rate: float = 10.0  # requests per second (Poisson)
    seed: int = 0
    namespace: str = "syn"
    shuffle: bool = True  # interleave the groups; False sends group 0 first, then group 1, ...


def _draw(rng: random.Random, length: Length) -> int:
    return rng.randint(*length) if isinstance(length, tuple) else length


def poisson_arrivals(n: int, rate: float, seed: int = 0, start: float = 0.0) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` per second, from `start`."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(f"arrivals:{seed}")
    t = start
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def shared_prefix_trace(spec: SharedPrefixSpec) -> Trace:
    rng = random.Random(f"{spec.namespace}:{spec.seed}")
    system = [_draw(rng, spec.system_prompt_length) for _ in range(spec.groups)]
    order = [(g, p) for g in range(spec.groups) for p in range(spec.prompts_per_group)]
    if spec.shuffle:
        rng.shuffle(order)
    arrivals = poisson_arrivals(len(order), spec.rate, spec.seed)
    out: Trace = []
    for i, ((g, p), at) in enumerate(zip(order, arrivals, strict=True)):
        question = _draw(rng, spec.question_length)
        segments = ((f"{spec.namespace}:{spec.seed}:sys:{g}", system[g]),
                    (f"{spec.namespace}:{spec.seed}:q:{g}:{p}", question))
        segments = tuple(s for s in segments if s[1] > 0)
        out.append(TraceRequest(f"{spec.namespace}-{i}", at, system[g] + question,
                                _draw(rng, spec.output_length), segments))
    return out
