"""Which engines run slower than the rest of the fleet, and by how much (`InstanceView.speed_scale`).

A fleet is not always alike: GPUs of two generations behind one pool, or one engine gone slow (a
throttled or failing GPU, a noisy neighbour) while it still answers. The predicted latencies come
from one profile, so without this a slow engine looks as good as any other whenever its queue is
short, and every request sent there takes its slowness: at 10x, a short queue's TTFT is seconds.

Each engine gets a *slowness*, its latency over what the profile predicts:

- lite mode: the time from dispatch to the first token the gateway reports, summed over its
  requests, over the TTFT the profile predicted at each dispatch (`observe_ttft`), with older
  requests weighing less (`DECAY`). Each side gets `allowance_ms` more per request (ten of the
  profile's base steps): the gateway reports first tokens in batches (up to 50 ms late) and the
  network adds its own, which on short prompts would otherwise make an engine that happened to get
  only short ones look slow;
- full mode: the engine's step durations (each status reports its last step), summed, over what the
  profile says steps of the same prefill tokens, decode batch and sequence lengths take
  (`observe_step`), older steps weighing less (`STEP_DECAY`). The step-time fit of view/predictor.py
  is not used: its prefill coefficient learns slowly from a mix of mostly decode steps (a 10x engine
  read as 1.3x after 250 steps).

The fleet's reference is the slowness of its fast engines: the `REFERENCE_QUANTILE` of the engines
with enough evidence. An engine at `threshold` times the reference or more gets that ratio as its
scale, and its predicted latencies are that many times the profile's; every other engine gets 1
exactly, so a fleet of alike engines is ranked as with no scales at all (the float operations are
the same: x * 1.0 is x). The reference is taken again after as many observations as there are
engines, so its cost per observation stays constant however large the fleet.
"""

from __future__ import annotations

from collections.abc import Callable

from pilotfish.scheduler.view.profile import LatencyProfile
from pilotfish.scheduler.view.types import InstanceView

MAX_SPEED_SCALE = 1000.0  # bounds the scale (the load index's floors hold up to it)
DECAY = 0.9  # lite mode: each newer first token weighs 1 / 0.9 of the one before (about the last 10-20 count)
STEP_DECAY = 0.98  # full mode, per step: about the last 50-100 steps count
MIN_EVIDENCE = 8  # observations before an engine's slowness counts (first tokens, or steps)
REFERENCE_QUANTILE = 0.25  # the fleet's reference: its fast engines' slowness, so half a fleet slow is seen


class EngineSpeeds:
    """Slowness per engine and the scales it gives; `on_change(inst)` is told each engine whose scale moved."""

    def __init__(
        self,
        threshold: float,
        on_change: Callable[[InstanceView], None],
        profile: LatencyProfile | None = None,
        allowance_ms: float = 100.0,
    ) -> None:
        # 0 turns scaling off: every scale stays 1
        self.threshold = threshold
        self.allowance_ms = allowance_ms
        self._profile = profile or LatencyProfile()
        self._on_change = on_change
        # engines with enough evidence: slowness, and the view whose scale it sets (the latest one seen)
        self._slowness: dict[str, tuple[float, InstanceView]] = {}
        self._sums: dict[str, tuple[float, float, int]] = {}  # decayed (actual, predicted) ms, count
        self.reference = 1.0
        self._since = 0  # observations since the reference was taken

    def observe_ttft(self, inst: InstanceView, actual_ms: float, predicted_ms: float) -> None:
        """Lite mode: a first token `actual_ms` after its dispatch, where the profile predicted `predicted_ms`."""
        if actual_ms >= 0 and predicted_ms > 0 and self.threshold:
            allowance = self.allowance_ms
            self._add(inst, actual_ms + allowance, predicted_ms + allowance, DECAY)

    def observe_step(
        self, inst: InstanceView, duration_ms: float, prefill_tokens: int, decode_batch: int, seq_len_sum: int
    ) -> None:
        """Full mode: one engine step, as its status reports it (each step once)."""
        if duration_ms > 0 and self.threshold:
            self._add(inst, duration_ms, self._profile.step_ms(prefill_tokens, decode_batch, seq_len_sum), STEP_DECAY)

    def _add(self, inst: InstanceView, actual_ms: float, predicted_ms: float, decay: float) -> None:
        instance_id = inst.instance_id
        actual, predicted, count = self._sums.get(instance_id, (0.0, 0.0, 0))
        actual, predicted, count = actual * decay + actual_ms, predicted * decay + predicted_ms, count + 1
        self._sums[instance_id] = (actual, predicted, count)
        if count >= MIN_EVIDENCE and predicted > 0:
            self._update(inst, actual / predicted)

    def forget(self, instance_id: str) -> None:
        """The engine left the fleet (or came back as another): its evidence goes with it."""
        self._slowness.pop(instance_id, None)
        self._sums.pop(instance_id, None)

    def _update(self, inst: InstanceView, slowness: float) -> None:
        self._slowness[inst.instance_id] = (slowness, inst)
        self._since += 1
        if self._since >= max(1, len(self._slowness)):
            self._take_reference()
        else:
            self._rescale(inst, slowness)

    def _take_reference(self) -> None:
        self._since = 0
        ranked = sorted(slowness for slowness, _ in self._slowness.values())
        self.reference = ranked[int(REFERENCE_QUANTILE * (len(ranked) - 1))]
        for slowness, inst in self._slowness.values():
            self._rescale(inst, slowness)

    def _rescale(self, inst: InstanceView, slowness: float) -> None:
        ratio = slowness / self.reference if self.reference > 0 else 1.0
        scale = min(ratio, MAX_SPEED_SCALE) if ratio >= self.threshold else 1.0
        if scale != inst.speed_scale:
            inst.speed_scale = scale
            self._on_change(inst)
