"""Engine event hooks: what the llumlet, metrics and tests observe, one method per event.

Subclass `EngineObserver` and override what you need; every method is a no-op by default.
Events are called synchronously inside the engine step, so observers must be quick and must
not call back into the engine. `now` is the driver's clock: scheduling events carry the step's
start, compute results (prefill chunks, tokens, finishes) the step's end.
"""

from __future__ import annotations

from pilotfish.simulator.engine.request import FinishReason, SimRequest


class EngineObserver:
    def request_added(self, request: SimRequest, now: float) -> None:
        """A request joined the waiting queue."""

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        """A waiting (or preempted) request moved into the running batch."""

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        """The prefix-cache lookup at scheduling found `num_tokens` (possibly 0) computed tokens."""

    def blocks_allocated(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        """Fresh blocks taken for a request (cache hits are not fresh and are not listed)."""

    def blocks_freed(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        """Blocks that became free (no request holds them) when a request let go of them."""

    def prefill_chunk(self, request: SimRequest, num_tokens: int, now: float) -> None:
        """`num_tokens` tokens of a request were computed by a prefill (or recompute) chunk."""

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        """A request sampled one output token."""

    def preempted(self, request: SimRequest, now: float) -> None:
        """A running request lost its blocks and went back to the front of the waiting queue."""

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        """A request left the engine: finished by length or stop, or aborted."""

    def detached(self, request: SimRequest, now: float) -> None:
        """A request left the engine to continue on another (migration); it did not finish."""

    def step_finished(
        self, now: float, duration: float, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int
    ) -> None:
        """A step that started at `now` lasted `duration` seconds; it computed `num_prefill_tokens`
        prompt tokens and `num_decodes` decode tokens, attending `num_context_tokens` of context."""
