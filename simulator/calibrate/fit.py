"""Least-squares fit of the linear step-time model to timed observations.

Two kinds of observation, both in seconds:
  - `ttft`: one request alone on an idle engine: its first token is one prefill step of P new
    tokens attending C tokens (C - P came from the prefix cache), plus the serving overhead `o`
    (HTTP, tokenizing, detokenizing) that only a first token pays;
  - `itl`: the gap between two tokens of a decoding batch of D requests attending C tokens.
Model: ttft = o + base + p*P + c*C;  itl = base + d*D + c*C. Solved in two stages of ordinary
least squares (no numpy: small normal-equation solves): first base, d and c from the decode gaps
alone, then o and p from the first tokens with base and c fixed. Fitting all five at once lets
a few slow first tokens (a busy machine) drag `base` up and every step with it; decode gaps are
many and steady. A coefficient that comes out negative is pinned at 0 and the rest refitted,
since a profile's coefficients are non-negative. Without decode observations it falls back to
one joint fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pilotfish.simulator.engine.step_time import StepTimeProfile

NAMES = ("base_ms", "prefill_ms_per_token", "decode_ms_per_token", "context_ms_per_token", "overhead_ms")


@dataclass(frozen=True, slots=True)
class Observation:
    kind: str  # "ttft" or "itl"
    prefill_tokens: int
    decode_requests: int
    context_tokens: int
    seconds: float

    def row(self) -> list[float]:
        first = self.kind == "ttft"
        return [1.0, float(self.prefill_tokens), float(self.decode_requests), float(self.context_tokens),
                1.0 if first else 0.0]


@dataclass(frozen=True, slots=True)
class Fit:
    profile: StepTimeProfile
    overhead_ms: float
    rms_ms: float  # root-mean-square residual
    r2: float
    observations: int
    # the decode terms' factor from a saturated phase (calibrate/saturation.py), and that
    # phase's measured makespan; None where no phase was run
    saturation_factor: float | None = None
    saturation_makespan_s: float | None = None
    # how much the arrivals phase's arrivals slowed its background's steps (calibrate/arrivals.py)
    arrivals_slowdown: float | None = None

    def describe(self) -> str:
        p = self.profile
        text = (f"base {p.base_ms:.4g} ms + {p.prefill_ms_per_token:.4g} ms/prefill token + "
                f"{p.decode_ms_per_token:.4g} ms/decoding request + {p.context_ms_per_token:.4g} ms/context token; "
                f"first-token overhead {self.overhead_ms:.3g} ms; residual RMS {self.rms_ms:.3g} ms, "
                f"R^2 {self.r2:.4f}, {self.observations} observations")
        if self.saturation_factor is not None:
            text += (f"; decode terms x{self.saturation_factor:.3g} to match a saturated phase "
                     f"({self.saturation_makespan_s:.3g} s)")
        if self.arrivals_slowdown is not None and p.busy_arrival_ms is not None:
            text += (f"; {p.busy_arrival_ms:.3g} ms per arrival on a busy engine to match arrivals onto a "
                     f"decoding batch (its steps x{self.arrivals_slowdown:.3g} while they arrived)")
        return text


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular column gets 0."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


def _least_squares(rows: list[list[float]], y: list[float], free: list[int]) -> list[float]:
    # scale each column to unit size first: token counts are ~1e3, the intercepts 1
    scale = [max(1e-12, math.sqrt(sum(r[j] ** 2 for r in rows))) for j in free]
    xs = [[r[j] / s for j, s in zip(free, scale, strict=True)] for r in rows]
    ata = [[sum(x[i] * x[k] for x in xs) for k in range(len(free))] for i in range(len(free))]
    aty = [sum(x[i] * v for x, v in zip(xs, y, strict=True)) for i in range(len(free))]
    sol = _solve(ata, aty)
    coef = [0.0] * len(rows[0])
    for j, s, v in zip(free, scale, sol, strict=True):
        coef[j] = v / s
    return coef


def _nonnegative_fit(rows: list[list[float]], y: list[float], free: list[int]) -> list[float]:
    free = list(free)
    while True:
        coef = _least_squares(rows, y, free)
        negative = [j for j in free if coef[j] < 0]
        if not negative:
            return coef
        free.remove(min(negative, key=lambda j: coef[j]))  # pin the most negative at 0, refit


def fit_profile(observations: Sequence[Observation], name: str) -> Fit:
    if len(observations) < len(NAMES):
        raise ValueError(f"need at least {len(NAMES)} observations, got {len(observations)}")
    rows = [o.row() for o in observations]
    y = [o.seconds * 1000.0 for o in observations]
    itl = [i for i, o in enumerate(observations) if o.kind == "itl"]
    ttft = [i for i, o in enumerate(observations) if o.kind == "ttft"]
    if len(itl) >= 3 and len(ttft) >= 2:
        # stage 1: the step's fixed, per-request and per-context costs from decode gaps
        step = _nonnegative_fit([rows[i] for i in itl], [y[i] for i in itl], [0, 2, 3])
        # stage 2: what a first token adds on top: prefill per token, and the serving overhead
        rest = [y[i] - step[0] - step[3] * rows[i][3] for i in ttft]
        first = _nonnegative_fit([rows[i] for i in ttft], rest, [1, 4])
        coef = [step[0], first[1], step[2], step[3], first[4]]
    else:
        coef = _nonnegative_fit(rows, y, list(range(len(NAMES))))
    predicted = [sum(c * x for c, x in zip(coef, r, strict=True)) for r in rows]
    residuals = [p - v for p, v in zip(predicted, y, strict=True)]
    mean = sum(y) / len(y)
    ss_tot = sum((v - mean) ** 2 for v in y) or 1e-12
    rms = math.sqrt(sum(e * e for e in residuals) / len(residuals))
    profile = StepTimeProfile(name=name, base_ms=coef[0], prefill_ms_per_token=coef[1], decode_ms_per_token=coef[2],
                              context_ms_per_token=coef[3])
    return Fit(profile, coef[4], rms, 1.0 - sum(e * e for e in residuals) / ss_tot, len(observations))
