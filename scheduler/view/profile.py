"""Latency profile of one engine type: the step-time prior and the TTFT/TPOT profiling tables.

A YAML file (`--latency-profile`); the simulator's profiles (simulator/profiles/*.yaml) are
valid ones, since the step-time keys are the same:

    base_ms: 10.0                    # t_step = base_ms
    prefill_ms_per_token: 0.11       #        + prefill_ms_per_token * prefill tokens in the step
    decode_ms_per_token: 0.03        #        + decode_ms_per_token  * decoding requests
    context_ms_per_token: 0.00009    #        + context_ms_per_token * sum of their sequence lengths
    ttft_ms:                         # optional: prefill tokens ahead (own included) -> TTFT, ms
      - [128, 25.0]
      - [8192, 910.0]
    tpot_ms:                         # optional: decode batch x mean sequence length -> ms per token
      batch_sizes: [1, 64, 256]
      seq_lens: [128, 4096]
      ms: [[10.1, 10.4], [12.6, 33.5], [19.0, 104.0]]   # one row per batch size

Tables are interpolated linearly (bilinearly for TPOT) and extrapolated linearly from the last
segment; a missing table is derived from the step-time coefficients, so a profile of four
numbers is enough. Unknown keys fail at start-up with the key named.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import msgspec

from pilotfish.config import ConfigError, load_yaml_mapping


class TpotTable(msgspec.Struct, forbid_unknown_fields=True):
    batch_sizes: list[float]
    seq_lens: list[float]
    ms: list[list[float]]


class LatencyProfile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "default"
    base_ms: float = 10.0
    prefill_ms_per_token: float = 0.11
    decode_ms_per_token: float = 0.03
    context_ms_per_token: float = 0.00009
    ttft_ms: list[tuple[float, float]] | None = None
    tpot_ms: TpotTable | None = None

    def step_ms(self, prefill_tokens: float, decode_batch: float, seq_len_sum: float) -> float:
        return (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_token * decode_batch
            + self.context_ms_per_token * seq_len_sum
        )


def load_profile(path: str) -> LatencyProfile:
    """Read and check a profile file; errors name the file and the key."""
    data = load_yaml_mapping(path)
    try:
        profile = msgspec.convert(data, LatencyProfile, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--latency-profile {path}: {exc}") from None
    check_profile(profile, f"--latency-profile {path}")
    return profile


def check_profile(profile: LatencyProfile, where: str) -> None:
    if profile.base_ms <= 0 or min(profile.prefill_ms_per_token, profile.decode_ms_per_token) < 0:
        raise ConfigError(f"{where}: base_ms must be > 0 and per-token costs >= 0")
    if profile.ttft_ms is not None:
        xs = [x for x, _ in profile.ttft_ms]
        if len(xs) < 2 or xs != sorted(set(xs)):
            raise ConfigError(f"{where}: ttft_ms needs two or more rows with increasing token counts")
    table = profile.tpot_ms
    if table is not None:
        for axis, values in (("batch_sizes", table.batch_sizes), ("seq_lens", table.seq_lens)):
            if not values or values != sorted(set(values)):
                raise ConfigError(f"{where}: tpot_ms.{axis} must be non-empty and increasing")
        if len(table.ms) != len(table.batch_sizes) or any(len(row) != len(table.seq_lens) for row in table.ms):
            raise ConfigError(f"{where}: tpot_ms.ms must have one row per batch size, one column per seq len")


def interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends."""
    n = len(xs)
    if n == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), n - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


class LatencyTables:
    """TTFT and TPOT lookups of one profile, with tables derived where the profile has none."""

    def __init__(self, profile: LatencyProfile, token_budget: int = 8192) -> None:
        self.profile = profile
        self.token_budget = token_budget
        if profile.ttft_ms is not None:
            self._ttft_x = [float(x) for x, _ in profile.ttft_ms]
            self._ttft_y = [float(y) for _, y in profile.ttft_ms]
        else:
            # a lone prompt of N tokens runs in ceil(N / budget) full-budget steps
            self._ttft_x = [0.0, float(token_budget)]
            self._ttft_y = [profile.base_ms, profile.step_ms(token_budget, 0, 0)]
        self._tpot = profile.tpot_ms
        xs, ys = self._ttft_x, self._ttft_y
        # the least ms per prefill token anywhere on the prefill curve (`prefill_floor` says what for)
        self.prefill_slope = min(((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)), default=0.0)

    def prefill_ms(self, tokens: float) -> float:
        """Time to compute `tokens` prefill tokens (chunked at the token budget when no table)."""
        if tokens <= 0:
            return 0.0
        if self.profile.ttft_ms is not None:
            return max(0.0, interp1(self._ttft_x, self._ttft_y, tokens))
        full, rest = divmod(tokens, self.token_budget)
        ys = self._ttft_y
        ms = full * ys[1]
        if rest:
            # interp1 over the two points (0, base) and (budget, a full step), inlined: the same float
            # operations without a call and a bisect (the default policy computes this per candidate)
            ms += ys[0] + (ys[1] - ys[0]) * (rest - 0.0) / (self.token_budget - 0.0)
        return ms

    def tpot_ms(self, batch: float, mean_seq_len: float) -> float:
        """One decode step of `batch` requests of mean length `mean_seq_len`."""
        table = self._tpot
        if table is None:
            return self.profile.step_ms(0, batch, batch * mean_seq_len)
        rows = [interp1(table.seq_lens, row, mean_seq_len) for row in table.ms]
        return max(0.0, interp1(table.batch_sizes, rows, batch))

    def ttft_ms(self, prefill_tokens_ahead: float, own_tokens: float, decode_batch: float, seq_len_sum: float) -> float:
        """TTFT of a request whose `own_tokens` queue behind `prefill_tokens_ahead`.

        Prefill time from the table, plus the decode batch that shares every chunked-prefill
        step (its per-step cost beyond the base, from the TPOT lookup).
        """
        return self.ttft_with_share(
            prefill_tokens_ahead + own_tokens, decode_batch, self.decode_share_ms(decode_batch, seq_len_sum)
        )

    def decode_share_ms(self, decode_batch: float, seq_len_sum: float) -> float:
        """What a decode batch adds to every chunked-prefill step (its step cost beyond the base, never
        below 0); 0 without a batch. Depends on the instance alone, so a load index keeps it per instance."""
        if decode_batch <= 0:
            return 0.0
        return max(0.0, self.tpot_ms(decode_batch, seq_len_sum / decode_batch) - self.profile.base_ms)

    def ttft_with_share(self, total_tokens: float, decode_batch: float, share_ms: float) -> float:
        """`ttft_ms` from the prefill tokens in all (ahead + own) and the batch's `decode_share_ms`."""
        ms = self.prefill_ms(total_tokens)
        if decode_batch > 0:
            steps = math.ceil(total_tokens / max(1.0, self.token_budget - decode_batch))
            ms += steps * share_ms
        return ms

    def prefill_floor(self, tokens: float) -> float:
        """A floor under the prefill time of `tokens` behind any queue: for every a >= 0 and tokens >= 1,
        prefill_ms(a + tokens) >= prefill_floor(tokens) + prefill_slope * a.

        With a table, prefill_ms is max(0, g) for g piecewise linear (extended linearly), and g rises by at
        least the least slope per token: the floor is g(tokens). Without one, prefill_ms(t) is
        slope * t + base_ms * ceil(t / budget), so prefill_ms(tokens) itself is one."""
        if self.profile.ttft_ms is not None:
            return interp1(self._ttft_x, self._ttft_y, tokens)
        return self.prefill_ms(tokens)


def profile_from_config(path: str | None) -> LatencyProfile:
    return load_profile(path) if path else LatencyProfile()
