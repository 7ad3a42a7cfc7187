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
        # row-major, 16 floats: observe unpacks and rebuilds it in one statement each
        self._p = tuple(
            (max(abs(self.theta[i]) / ref, 1.0) ** 2 / prior_weight) if i == j else 0.0
            for i in range(4)
            for j in range(4)
        )
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
        x0, x1, x2, x3 = w, w * prefill_tokens / _SCALE[1], w * decode_batch / _SCALE[2], w * seq_len_sum / _SCALE[3]
        # The recursive least-squares update written out (once per status applied, so per engine
        # step): px = P x, k = px / (forget + x.px), theta += k (y - theta.x), P = (P - k px^T) / forget.
        # Each sum is taken in index order, as the loop form does: the fit is the same to the bit
        # (tests/unit/test_predictor.py holds the two equal).
        p00, p01, p02, p03, p10, p11, p12, p13, p20, p21, p22, p23, p30, p31, p32, p33 = self._p
        a0 = p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
        a1 = p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
        a2 = p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
        a3 = p30 * x0 + p31 * x1 + p32 * x2 + p33 * x3
        denom = FORGET + x0 * a0 + x1 * a1 + x2 * a2 + x3 * a3
        k0, k1, k2, k3 = a0 / denom, a1 / denom, a2 / denom, a3 / denom
        t = self.theta
        err = self._ref - (t[0] * x0 + t[1] * x1 + t[2] * x2 + t[3] * x3)
        t[0] += k0 * err
        t[1] += k1 * err
        t[2] += k2 * err
        t[3] += k3 * err
        inv = 1.0 / FORGET
        self._p = (
            (p00 - k0 * a0) * inv, (p01 - k0 * a1) * inv, (p02 - k0 * a2) * inv, (p03 - k0 * a3) * inv,
            (p10 - k1 * a0) * inv, (p11 - k1 * a1) * inv, (p12 - k1 * a2) * inv, (p13 - k1 * a3) * inv,
            (p20 - k2 * a0) * inv, (p21 - k2 * a1) * inv, (p22 - k2 * a2) * inv, (p23 - k2 * a3) * inv,
            (p30 - k3 * a0) * inv, (p31 - k3 * a1) * inv, (p32 - k3 * a2) * inv, (p33 - k3 * a3) * inv,
        )  # fmt: skip
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
