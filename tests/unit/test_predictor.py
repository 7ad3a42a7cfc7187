"""The step-time fit's written-out update against the plain loop form: the same fit to the bit.

StepTimeModel.observe runs once per status applied (every engine step in the virtual-time
cluster), so its update is unrolled; a decision reads the fit, so the unrolled arithmetic must
give the very floats the loop form gives, in every coefficient and every covariance entry.
"""

from __future__ import annotations

import random

import pytest

from pilotfish.scheduler.view.predictor import _SCALE, FORGET, MAX_STEP_MS, StepTimeModel
from pilotfish.scheduler.view.profile import LatencyProfile


class LoopModel:
    """The recursive least-squares update as loops over a 4x4 list of lists (the reference)."""

    def __init__(self, profile: LatencyProfile, prior_weight: float) -> None:
        prior = (profile.base_ms, profile.prefill_ms_per_token, profile.decode_ms_per_token,
                 profile.context_ms_per_token)
        self.theta = [c * s for c, s in zip(prior, _SCALE, strict=True)]
        ref = max(profile.base_ms, 0.01)
        self.p = [[(max(abs(self.theta[i]) / ref, 1.0) ** 2 / prior_weight) if i == j else 0.0 for j in range(4)]
                  for i in range(4)]
        self.last_step = -1
        self.floor = max(0.01, profile.base_ms * 0.05)
        self.ref = profile.base_ms

    def observe(self, step_id: int, duration_us: int, prefill: int, batch: int, seq_len_sum: int) -> bool:
        if duration_us <= 0 or step_id == self.last_step or (prefill == 0 and batch == 0):
            return False
        self.last_step = step_id
        y = duration_us / 1000.0
        if y > MAX_STEP_MS:
            return False
        w = self.ref / max(y, self.floor)
        x = (w, w * prefill / _SCALE[1], w * batch / _SCALE[2], w * seq_len_sum / _SCALE[3])
        p = self.p
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] + p[i][3] * x[3] for i in range(4)]
        denom = FORGET + x[0] * px[0] + x[1] * px[1] + x[2] * px[2] + x[3] * px[3]
        k = [v / denom for v in px]
        t = self.theta
        err = self.ref - (t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3])
        for i in range(4):
            t[i] += k[i] * err
        for i in range(4):
            for j in range(4):
                p[i][j] = (p[i][j] - k[i] * px[j]) * (1.0 / FORGET)
        return True


def _steps(seed: int, n: int) -> list[tuple[int, int, int, int, int]]:
    """Decode steps, prefill chunks, mixed steps, repeats, outliers and empty steps, at random."""
    rng = random.Random(seed)
    steps = []
    step_id = 0
    for _ in range(n):
        step_id += rng.choice((0, 1, 1, 1, 2))  # a repeated step_id is skipped by both
        prefill = rng.choice((0, 0, 0, rng.randrange(1, 8192)))
        batch = rng.choice((0, rng.randrange(1, 256)))
        seq = batch * rng.randrange(1, 4096)
        base = 8 + 0.1 * prefill + 0.03 * batch + 0.0001 * seq
        duration_us = rng.choice((int(base * 1000 * rng.uniform(0.8, 1.2)), 0, int(MAX_STEP_MS * 1000) + 1))
        steps.append((step_id, duration_us, prefill, batch, seq))
    return steps


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "profile",
    [LatencyProfile(), LatencyProfile(base_ms=0.004, prefill_ms_per_token=2.0, decode_ms_per_token=0.0,
                                      context_ms_per_token=0.5)],
)
def test_unrolled_update_equals_the_loop_form_bit_for_bit(seed: int, profile: LatencyProfile) -> None:
    model, reference = StepTimeModel(profile, 2.0), LoopModel(profile, 2.0)
    for step in _steps(seed, 2000):
        assert model.observe(*step) == reference.observe(*step)
        assert model.theta == reference.theta
    assert list(model._p) == [v for row in reference.p for v in row]
