"""Forward prediction: the work an instance has done since its last status, from a step-time model.

A status is a snapshot at `timestamp_ms`; a decision happens later. `prefill_tokens_done`
estimates how many of the status's uncomputed prefill tokens the engine has computed since,
so `all_prefills_tokens_num` (predictor-enhanced) and `predicted_ttft` see the load as it is
now, not as it was at the last export.

The step time is linear in what a step does, as the simulator and vLLM behave:

    t_step_ms = c0 + c1 * prefill tokens + c2 * decode batch + c3 * sum of sequence lengths

`StepTimeModel` fits c0..c3 online by recursive least squares (on relative error) over the
steps each llumlet reports (`last_step_*` in its status; a step is counted once, by `step_id`), with the
configured profile as the prior: the prior acts as `prior_weight` pseudo-observations, so a
new instance predicts with the profile and the fit takes over as real steps arrive. Features
are scaled to comparable magnitudes so the 4x4 update stays well conditioned; a forgetting
factor lets the fit follow an engine whose speed drifts.
"""

from __future__ import annotations

from pilotfish.scheduler.view.profile import LatencyProfile

# features are divided by these so each is O(1) in a typical step
_SCALE = (1.0, 1000.0, 100.0, 100_000.0)
FORGET = 0.999
# a step longer than this is an outlier (a stall, a recompilation): it would wreck the fit
MAX_STEP_MS = 60_000.0


class StepTimeModel:
    """Online least-squares fit of the step time of one instance; prior from a profile."""

    __slots__ = ("_floor", "_last_step", "_p", "_ref", "observations", "theta")

    def __init__(self, profile: LatencyProfile, prior_weight: float) -> None:
        prior = (
            profile.base_ms,
            profile.prefill_ms_per_token,
            profile.decode_ms_per_token,
            profile.context_ms_per_token,
        )
        self.theta = [c * s for c, s in zip(prior, _SCALE, strict=True)]
        ref = max(profile.base_ms, 0.01)
        # prior covariance: each coefficient uncertain in proportion to its size (relative prior),
        # worth `prior_weight` steps that each coefficient dominates (see observe's weighting)
        self._p = [
            [(max(abs(self.theta[i]) / ref, 1.0) ** 2 / prior_weight) if i == j else 0.0 for j in range(4)]
            for i in range(4)
        ]
        self._last_step = -1
        self._floor = max(0.01, profile.base_ms * 0.05)
        self._ref = profile.base_ms
        self.observations = 0

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(c0, c1, c2, c3) in ms per unit, as in the profile."""
        t = self.theta
        return (t[0] / _SCALE[0], t[1] / _SCALE[1], t[2] / _SCALE[2], t[3] / _SCALE[3])

    def observe(self, step_id: int, duration_us: int, prefill_tokens: int, decode_batch: int, seq_len_sum: int) -> bool:
        """Fold in one reported step; False when skipped (no step, a repeat, or an outlier)."""
        if duration_us <= 0 or step_id == self._last_step or (prefill_tokens == 0 and decode_batch == 0):
            return False
        self._last_step = step_id
        y = duration_us / 1000.0
        if y > MAX_STEP_MS:
            return False
        # weighted by 1/y: fit relative error, so 10 ms decode steps count as much as 1 s prefills
        # (scaled by the prior's base step, so a typical step weighs about one and the prior's
        # `prior_weight` pseudo-observations compare with real ones)
        w = self._ref / max(y, self._floor)
        x = (w, w * prefill_tokens / _SCALE[1], w * decode_batch / _SCALE[2], w * seq_len_sum / _SCALE[3])
        y = self._ref
        p = self._p
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] + p[i][3] * x[3] for i in range(4)]
        denom = FORGET + x[0] * px[0] + x[1] * px[1] + x[2] * px[2] + x[3] * px[3]
        k = [v / denom for v in px]
        t = self.theta
        err = y - (t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3])
        for i in range(4):
            t[i] += k[i] * err
        inv = 1.0 / FORGET
        for i in range(4):
            row, ki = p[i], k[i]
            for j in range(4):
                row[j] = (row[j] - ki * px[j]) * inv
        self.observations += 1
        return True

    def step_ms(self, prefill_tokens: float, decode_batch: float, seq_len_sum: float) -> float:
        t = self.theta
        ms = t[0] + t[1] * prefill_tokens / _SCALE[1] + t[2] * decode_batch / _SCALE[2] + t[3] * seq_len_sum / _SCALE[3]
        return ms if ms > self._floor else self._floor


def prefill_rate(
    model: StepTimeModel, uncomputed: int, decode_batch: int, seq_len_sum: int, token_budget: int
) -> float:
    """Prefill tokens per second that `prefill_tokens_done` assumes for these arguments (`uncomputed` > 0).

    The load index (policy/index.py) bounds a forward-predicted load with it: the prediction falls
    at this rate from the status's value until the status's uncomputed tokens are done.
    """
    chunk = min(uncomputed, max(1, token_budget - decode_batch))
    return chunk * 1000.0 / model.step_ms(chunk, decode_batch, seq_len_sum)


def prefill_tokens_done(
    model: StepTimeModel,
    uncomputed: int,
    decode_batch: int,
    seq_len_sum: int,
    token_budget: int,
    elapsed_s: float,
) -> float:
    """Prefill tokens computed in `elapsed_s` since the status, at most `uncomputed`.

    Chunked prefill fills each step's token budget after the decode batch's one token each,
    so a step computes `chunk` prefill tokens and lasts `step_ms(chunk, batch, seq)`.
    """
    if uncomputed <= 0 or elapsed_s <= 0:
        return 0.0
    # elapsed times the rate, in this order: the load index caches the rate per status and must get
    # the same float (policy/index.py `_predicted`)
    done = elapsed_s * prefill_rate(model, uncomputed, decode_batch, seq_len_sum, token_budget)
    return done if done < uncomputed else float(uncomputed)
