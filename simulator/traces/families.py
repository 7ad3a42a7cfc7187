"""Seeded synthetic workload families: prefix structures that real chat fleets see, as traces.

Every family returns a `Trace` (simulator/traces/model.py), so the virtual-time cluster, the
HTTP replay and the tests read it like any loaded trace. A prompt is a list of segments; equal
keys mean equal tokens, so what a family shares is exactly what an engine can cache. Each
family is a pure function of its knobs and `seed`: the same call gives the same trace, and a
different seed gives different lengths, order and arrivals with the same statistics.

Families (`FAMILIES`, also `--trace family:<name>[:knob=value,...]` in `pilotfish bench cluster`):

- `system-prompt`: one system prompt shared by every request, then a turn of its own. The
  trace that made cache-first ranking send everything to one engine.
- `multi-turn`: conversations whose prompts grow turn by turn: turn k's prompt is the system
  prompt, then every earlier user message and answer, then the new user message, so each
  turn's prompt starts with the previous turn's prompt.
- `tenants`: several tenants, each with its own system prompt; tenant popularity is Zipf
  skewed, so one tenant's prefix is hot and the rest are warm.
- `rag`: long prompts that share almost nothing: a short instruction every request shares, then
  retrieved context and a question of their own (prefill-heavy; a cache barely helps).
- `heavy-tail`: output lengths from a bounded Pareto distribution, so a few requests decode for
  thousands of tokens while most stop early (decode load that a request count hides).
- `bursty`: the `system-prompt` shape, with arrivals that alternate between bursts at several
  times the mean rate and lulls below it (an on/off modulated Poisson process).
- `long-and-short`: short chat turns behind a shared system prompt, and among them a few long
  documents of their own (head-of-line blocking: a long prefill stalls every short request on its
  engine, a request count hides the difference, and a cache helps only the short ones).
- `long-output`: short prompts behind a shared system prompt with answers of thousands of tokens,
  as a reasoning model writes (decode load and KV growth, not prefill, fill the engines).

Lengths are a fixed int or an inclusive (low, high) range drawn uniformly; arrivals are
Poisson at `rate` requests (for `multi-turn`: conversations) per second, `bursty`'s modulated
so that `rate` stays the mean.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from pilotfish.simulator.traces.model import Segment, Trace, TraceRequest
from pilotfish.simulator.traces.synthetic import Length, poisson_arrivals


def _draw(rng: random.Random, length: Length) -> int:
    if isinstance(length, tuple):
        low, high = length
        if low < 0 or high < low:
            raise ValueError(f"length range {length!r}: need 0 <= low <= high")
        return rng.randint(low, high)
    if length < 0:
        raise ValueError(f"length {length!r} is negative")
    return length


def _request(request_id: str, at: float, segments: list[Segment], output: int) -> TraceRequest:
    kept = tuple(s for s in segments if s[1] > 0)
    return TraceRequest(request_id, at, sum(n for _, n in kept), max(1, output), kept)


def system_prompt_trace(
    *,
    requests: int = 2000,
    system: Length = 512,
    turn: Length = (32, 512),
    output: Length = (32, 256),
    rate: float = 20.0,
    seed: int = 0,
    namespace: str = "fam-sys",
) -> Trace:
    """One shared system prompt, then a unique turn per request.

    requests: how many; system: system-prompt tokens, the same prompt for all (drawn once when a
    range); turn: each request's own tokens after it; output: tokens to generate; rate: Poisson
    arrivals per second; seed: lengths and arrivals; namespace: segment-key prefix (two traces
    with different namespaces share nothing).
    """
    rng = random.Random(f"{namespace}:{seed}")
    system_len = _draw(rng, system)
    arrivals = poisson_arrivals(requests, rate, seed)
    sys_key = f"{namespace}:{seed}:sys"
    return [
        _request(
            f"{namespace}-{i}",
            at,
            [(sys_key, system_len), (f"{namespace}:{seed}:t:{i}", max(1, _draw(rng, turn)))],
            _draw(rng, output),
        )
        for i, at in enumerate(arrivals)
    ]


def multi_turn_trace(
    *,
    conversations: int = 400,
    turns: Length = (2, 8),
    system: Length = 512,
    user: Length = (32, 256),
    answer: Length = (64, 384),
    think: float = 10.0,
    rate: float = 4.0,
    shared_system: bool = True,
    seed: int = 0,
    namespace: str = "fam-mt",
) -> Trace:
    """Conversations whose prompts grow turn by turn.

    conversations: how many, starting as Poisson arrivals at `rate` per second; turns: turns per
    conversation; system: system-prompt tokens (one prompt for all conversations when
    `shared_system`, else one per conversation); user: tokens of each user message; answer: tokens
    of each answer, which is the turn's output and part of every later turn's prompt; think:
    mean seconds (exponential) between a turn's arrival and the next one's; seed; namespace.

    Turn k's prompt is [system, user 1, answer 1, ..., user k]. The answers in later prompts are
    their own segments (the engine's generated tokens are not these), so a turn reuses the
    previous turn's prompt, not what the engine generated after it: as a gateway that re-sends
    the transcript sees it.
    """
    rng = random.Random(f"{namespace}:{seed}")
    starts = poisson_arrivals(conversations, rate, seed)
    shared_len = _draw(rng, system)
    out: Trace = []
    for c, start in enumerate(starts):
        sys_key = f"{namespace}:{seed}:sys" if shared_system else f"{namespace}:{seed}:sys:{c}"
        sys_len = shared_len if shared_system else _draw(rng, system)
        history: list[Segment] = [(sys_key, sys_len)]
        at = start
        for k in range(max(1, _draw(rng, turns))):
            history.append((f"{namespace}:{seed}:u:{c}:{k}", max(1, _draw(rng, user))))
            reply = max(1, _draw(rng, answer))
            out.append(_request(f"{namespace}-{c}-{k}", at, list(history), reply))
            history.append((f"{namespace}:{seed}:a:{c}:{k}", reply))
            at += rng.expovariate(1.0 / think) if think > 0 else 0.0
    out.sort(key=lambda r: (r.arrival, r.request_id))
    return out


def tenants_trace(
    *,
    requests: int = 2000,
    tenants: int = 8,
    skew: float = 1.0,
    system: Length = (256, 2048),
    turn: Length = (32, 512),
    output: Length = (32, 256),
    rate: float = 20.0,
    seed: int = 0,
    namespace: str = "fam-ten",
) -> Trace:
    """Several tenants, each with its own system prompt, then a unique turn per request.

    requests: how many; tenants: how many system prompts; skew: Zipf exponent of tenant
    popularity (tenant t is picked with weight 1 / (t + 1) ** skew; 0 = uniform); system: each
    tenant's system-prompt tokens (drawn once per tenant); turn, output, rate, seed, namespace as
    in `system_prompt_trace`.
    """
    if tenants < 1:
        raise ValueError("tenants must be >= 1")
    rng = random.Random(f"{namespace}:{seed}")
    lengths = [_draw(rng, system) for _ in range(tenants)]
    weights = [1.0 / (t + 1) ** skew for t in range(tenants)]
    arrivals = poisson_arrivals(requests, rate, seed)
    out: Trace = []
    for i, at in enumerate(arrivals):
        t = rng.choices(range(tenants), weights)[0]
        segments = [
            (f"{namespace}:{seed}:sys:{t}", lengths[t]),
            (f"{namespace}:{seed}:t:{i}", max(1, _draw(rng, turn))),
        ]
        out.append(_request(f"{namespace}-{i}", at, segments, _draw(rng, output)))
    return out


def rag_trace(
    *,
    requests: int = 1000,
    instruction: Length = 64,
    context: Length = (2048, 8192),
    question: Length = (16, 128),
    output: Length = (32, 256),
    rate: float = 5.0,
    seed: int = 0,
    namespace: str = "fam-rag",
) -> Trace:
    """Long unique prompts, as retrieval-augmented generation sends them.

    requests: how many; instruction: tokens of the instruction every request starts with (drawn
    once; 0 = none); context: retrieved-context tokens, unique to each request; question: the
    request's own question after it; output, rate, seed, namespace as in `system_prompt_trace`.
    """
    rng = random.Random(f"{namespace}:{seed}")
    instruction_len = _draw(rng, instruction)
    arrivals = poisson_arrivals(requests, rate, seed)
    key = f"{namespace}:{seed}"
    return [
        _request(
            f"{namespace}-{i}",
            at,
            [(f"{key}:ins", instruction_len), (f"{key}:ctx:{i}", max(1, _draw(rng, context))),
             (f"{key}:q:{i}", _draw(rng, question))],
            _draw(rng, output),
        )
        for i, at in enumerate(arrivals)
    ]


def heavy_tail_trace(
    *,
    requests: int = 2000,
    system: Length = 256,
    prompt: Length = (64, 1024),
    output_min: int = 16,
    output_max: int = 4096,
    alpha: float = 1.2,
    rate: float = 20.0,
    seed: int = 0,
    namespace: str = "fam-tail",
) -> Trace:
    """Heavy-tailed output lengths: most requests stop early, a few decode for thousands of tokens.

    requests; system: shared system-prompt tokens (0 = none); prompt: each request's own tokens
    after it; output_min, output_max, alpha: output lengths follow a Pareto law with shape `alpha`
    and scale `output_min`, cut at `output_max` (alpha 1.2: the median is about 1.8 x output_min,
    and about 1 request in 60 asks for 30 x output_min or more); rate, seed, namespace as in
    `system_prompt_trace`.
    """
    if alpha <= 0 or output_min < 1 or output_max < output_min:
        raise ValueError("need alpha > 0 and 1 <= output_min <= output_max")
    rng = random.Random(f"{namespace}:{seed}")
    return _outputs_by_law(
        rng, lambda: min(output_max, int(output_min * rng.paretovariate(alpha))),
        requests=requests, system=system, prompt=prompt, rate=rate, seed=seed, namespace=namespace,
    )  # fmt: skip


def _outputs_by_law(
    rng: random.Random, output: Callable[[], int], *, requests: int, system: Length, prompt: Length, rate: float,
    seed: int, namespace: str,
) -> Trace:
    """A shared system prompt, then each request's own prompt, with output lengths from `output` (drawn from `rng`
    before each prompt): the shape of the families that differ only in their answers' law."""
    system_len = _draw(rng, system)
    arrivals = poisson_arrivals(requests, rate, seed)
    key = f"{namespace}:{seed}"
    out: Trace = []
    for i, at in enumerate(arrivals):
        length = output()
        segments = [(f"{key}:sys", system_len), (f"{key}:p:{i}", max(1, _draw(rng, prompt)))]
        out.append(_request(f"{namespace}-{i}", at, segments, length))
    return out


def bursty_arrivals(n: int, rate: float, burst: float, period: float, duty: float, seed: int) -> list[float]:
    """`n` arrivals of an on/off modulated Poisson process whose mean rate is `rate`: each `period`
    seconds starts with `duty x period` seconds at `burst x rate`, then the rest at the rate that
    keeps the mean (burst x duty <= 1; burst 1 is plain Poisson)."""
    if rate <= 0 or period <= 0 or not 0 < duty < 1 or burst < 1 or burst * duty > 1:
        raise ValueError("need rate > 0, period > 0, 0 < duty < 1, burst >= 1 and burst x duty <= 1")
    high, low = rate * burst, rate * (1 - burst * duty) / (1 - duty)
    rng = random.Random(f"bursty:{seed}")
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        phase = t % period
        on = phase < duty * period
        end = t - phase + (duty * period if on else period)  # where this phase ends
        r = high if on else low
        step = rng.expovariate(r) if r > 0 else math.inf
        if t + step >= end:  # memoryless: start over at the boundary with the next phase's rate
            t = end
            continue
        t += step
        out.append(t)
    return out


def bursty_trace(
    *,
    requests: int = 2000,
    system: Length = 512,
    turn: Length = (32, 512),
    output: Length = (32, 256),
    rate: float = 20.0,
    burst: float = 4.0,
    period: float = 20.0,
    duty: float = 0.2,
    seed: int = 0,
    namespace: str = "fam-burst",
) -> Trace:
    """The `system-prompt` shape with bursty arrivals.

    requests, system, turn, output, seed, namespace as in `system_prompt_trace`; rate: the mean
    arrival rate per second; burst: the rate during a burst, as a multiple of the mean; period:
    seconds from one burst's start to the next; duty: the share of each period spent in the
    burst. Between bursts the rate is what keeps the mean at `rate` (burst x duty <= 1; the
    defaults send 80% of the requests in the bursts, at 4x the mean, and the rest at a quarter of it).
    """
    rng = random.Random(f"{namespace}:{seed}")
    system_len = _draw(rng, system)
    arrivals = bursty_arrivals(requests, rate, burst, period, duty, seed)
    key = f"{namespace}:{seed}"
    return [
        _request(
            f"{namespace}-{i}",
            at,
            [(f"{key}:sys", system_len), (f"{key}:t:{i}", max(1, _draw(rng, turn)))],
            _draw(rng, output),
        )
        for i, at in enumerate(arrivals)
    ]


def long_and_short_trace(
    *,
    requests: int = 2000,
    system: Length = 256,
    turn: Length = (64, 512),
    long: Length = (16_000, 32_000),
    long_share: float = 0.1,
    output: Length = (32, 256),
    rate: float = 20.0,
    seed: int = 0,
    namespace: str = "fam-mix",
) -> Trace:
    """Short chat turns and a few long documents.

    requests; system: tokens of the system prompt every short request starts with; turn: each short
    request's own tokens after it; long: tokens of a long request, a document of its own that shares
    nothing; long_share: the share of requests that are long (0 to 1, each drawn independently);
    output: every request's output tokens; rate, seed, namespace as in `system_prompt_trace`.
    """
    if not 0 <= long_share <= 1:
        raise ValueError("long_share must be within 0..1")
    rng = random.Random(f"{namespace}:{seed}")
    system_len = _draw(rng, system)
    arrivals = poisson_arrivals(requests, rate, seed)
    key = f"{namespace}:{seed}"
    out: Trace = []
    for i, at in enumerate(arrivals):
        if rng.random() < long_share:
            segments = [(f"{key}:doc:{i}", max(1, _draw(rng, long)))]
        else:
            segments = [(f"{key}:sys", system_len), (f"{key}:t:{i}", max(1, _draw(rng, turn)))]
        out.append(_request(f"{namespace}-{i}", at, segments, _draw(rng, output)))
    return out


def long_output_trace(
    *,
    requests: int = 2000,
    system: Length = 512,
    prompt: Length = (100, 1000),
    output_min: int = 1000,
    output_max: int = 8000,
    rate: float = 20.0,
    seed: int = 0,
    namespace: str = "fam-long-out",
) -> Trace:
    """Short prompts, long answers.

    requests; system: shared system-prompt tokens; prompt: each request's own tokens after it;
    output_min, output_max: output lengths are log-uniform between them (as many answers between
    1,000 and 2,000 tokens as between 4,000 and 8,000); rate, seed, namespace as in `system_prompt_trace`.
    """
    if not 1 <= output_min <= output_max:
        raise ValueError("need 1 <= output_min <= output_max")
    rng = random.Random(f"{namespace}:{seed}")
    low, high = math.log(output_min), math.log(output_max)
    return _outputs_by_law(
        rng, lambda: min(output_max, int(math.exp(rng.uniform(low, high)))),
        requests=requests, system=system, prompt=prompt, rate=rate, seed=seed, namespace=namespace,
    )  # fmt: skip


FAMILIES: dict[str, Callable[..., Trace]] = {
    "system-prompt": system_prompt_trace,
    "multi-turn": multi_turn_trace,
    "tenants": tenants_trace,
    "rag": rag_trace,
    "heavy-tail": heavy_tail_trace,
    "bursty": bursty_trace,
    "long-and-short": long_and_short_trace,
    "long-output": long_output_trace,
}


def _parse_value(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{raw!r} is not a boolean")
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, int | tuple):  # a Length: `n` or `low-high`
        low, sep, high = raw.partition("-")
        return (int(low), int(high)) if sep else int(low)
    return raw


def family_trace(spec: str, seed: int = 0) -> Trace:
    """The trace named by `name[:knob=value,...]`: a range is `low-high` (`turn=32-512`).

    `seed` applies unless the name sets one. Raises ValueError naming an unknown family or knob.
    """
    import inspect

    name, _, knobs = spec.partition(":")
    make = FAMILIES.get(name)
    if make is None:
        raise ValueError(f"unknown workload family {name!r} (known: {', '.join(FAMILIES)})")
    params = inspect.signature(make).parameters
    values: dict[str, Any] = {"seed": seed}
    for item in filter(None, knobs.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key not in params:
            known = ", ".join(params)
            raise ValueError(f"family {name}: {item!r} is not knob=value with a knob of {known}")
        try:
            values[key] = _parse_value(raw, params[key].default)
        except ValueError as exc:
            raise ValueError(f"family {name}: {key}={raw!r}: {exc}") from None
    return make(**values)
