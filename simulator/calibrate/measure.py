"""The calibration workload: which requests to time, and how each becomes an observation.

1. Prefill: single requests with fresh random prompts of several lengths, one output token:
   TTFT = overhead + one prefill step (P = C = prompt length).
2. Cached prefill: a prefix sent first, then the prefix plus a suffix: the second's step
   computes only what the cache lacks (the hit is read from the engine's counter), so P and C
   differ and the fit can tell the prefill and context terms apart.
3. Decode: B requests sent together, then decoding together: the gaps between their tokens,
   once all have started and before any ends, are steps of D = B requests attending about
   B x (prompt + k) tokens.
Prompts are random token ids, so nothing hits the cache unless a step means it to.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from pilotfish.simulator.calibrate.fit import Observation
from pilotfish.simulator.calibrate.probes import Prober


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 384, 512)
    cached_prefix: int = 256
    cached_suffixes: tuple[int, ...] = (16, 64, 128)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_prompt_lengths: tuple[int, ...] = (32, 256)
    decode_tokens: int = 40
    repeats: int = 5
    decode_repeats: int = 3
    vocab: tuple[int, int] = (16, 256)  # token ids drawn from [lo, hi): inside a tiny model's vocabulary
    seed: int = 0


async def measure(prober: Prober, plan: CalibrationPlan) -> list[Observation]:
    rng = random.Random(plan.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*plan.vocab) for _ in range(n)]

    out: list[Observation] = []
    await prober.stream([prompt(8)], 2)  # warm-up: first requests pay one-off costs
    # each configuration is timed `repeats` times and its median kept: a shared machine's
    # hiccups land in single samples, and a median ignores them where a mean would not
    samples: dict[tuple[int, int], list[float]] = {}
    for _ in range(plan.repeats):
        for length in plan.prefill_lengths:
            before = await prober.prefix_cache_hits()
            (times,) = await prober.stream([prompt(length)], 1)
            hit = await prober.prefix_cache_hits() - before
            samples.setdefault((length - hit, length), []).append(times[0])
        for suffix in plan.cached_suffixes:
            prefix = prompt(plan.cached_prefix)
            await prober.stream([prefix], 1)
            before = await prober.prefix_cache_hits()
            (times,) = await prober.stream([prefix + prompt(suffix)], 1)
            hit = await prober.prefix_cache_hits() - before
            total = plan.cached_prefix + suffix
            samples.setdefault((total - hit, total), []).append(times[0])
    for (prefill, context), values in sorted(samples.items()):
        out.append(Observation("ttft", prefill, 0, context, statistics.median(values)))
    decode: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (B, prompt) -> [(gap, mid)]
    for _ in range(plan.decode_repeats):
        for batch in plan.batch_sizes:
            for length in plan.decode_prompt_lengths:
                streams = await prober.stream([prompt(length) for _ in range(batch)], plan.decode_tokens)
                sample = _decode_gap(streams)
                if sample is not None:
                    decode.setdefault((batch, length), []).append(sample)
    for (batch, length), values in sorted(decode.items()):
        gap = statistics.median(v[0] for v in values)
        mid = statistics.mean(v[1] for v in values)
        out.append(Observation("itl", 0, batch, round(batch * (length + mid)), gap))
    return out


def _decode_gap(streams: list[list[float]]) -> tuple[float, float] | None:
    """(median mean-gap across streams, mean token index of those gaps), or None."""
    # only gaps while all B decode: after the last first token (a real server admits a
    # burst over several steps, each with prefill work) and before the first stream ends
    start = max(s[0] for s in streams)
    end = min(s[-1] for s in streams)
    # Per stream, the mean gap across that interval, not single gaps: a server that
    # falls behind sends tokens in bursts (vLLM-CPU sometimes holds a dozen for tens of
    # ms), so single gaps read 0 and then a stall, and only their mean is its speed.
    # Token k (from 0) comes out of a step attending prompt + k tokens.
    gaps, mids = [], []
    for s in streams:
        inside = [k for k, t in enumerate(s) if start <= t <= end]
        # a stream must decode through most of the window: a few tokens inside it may all be
        # one burst, whose mean gap says nothing of the step
        if len(inside) >= max(3, len(s) // 3):
            first, last = inside[0], inside[-1]
            gaps.append((s[last] - s[first]) / (last - first))
            mids.append((first + last + 1) / 2)  # the steps making tokens first+1 .. last
    if not gaps:
        return None
    return statistics.median(gaps), statistics.mean(mids)
