"""Per-request latency records and their summary, shared by the virtual-time and HTTP replays."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request's life, in seconds on the driver's clock. Unset times stay None.

    A migrated request keeps its one record: its times run on across the move, `engine` follows
    it to the engine it is on (or finished on) and `migrations` counts the moves.
    """

    request_id: str
    engine: int
    arrival: float
    input_length: int
    output_length: int
    scheduled: float | None = None  # first admitted into the running batch
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit at first schedule
    preemptions: int = 0
    finish_reason: str | None = None
    migrations: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


def summarize(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Latency distributions (seconds), counts and throughput of finished requests."""
    records = list(records)
    done = [r for r in records if r.finished is not None]
    out: dict[str, Any] = {"requests": len(records), "finished": len(done)}
    for name in ("ttft", "tpot", "e2e", "queueing"):
        out[name] = distribution([v for r in done if (v := getattr(r, name)) is not None])
    if done:
        span = max(r.finished for r in done if r.finished is not None) - min(r.arrival for r in records)
        tokens = sum(r.num_output_tokens for r in done)
        out["output_tokens_per_s"] = tokens / span if span > 0 else math.nan
        out["requests_per_s"] = len(done) / span if span > 0 else math.nan
    prompt = sum(r.input_length for r in done)
    out["prefix_cache_hit_rate"] = sum(r.cached_tokens for r in done) / prompt if prompt else 0.0
    out["preemptions"] = sum(r.preemptions for r in records)
    return out
