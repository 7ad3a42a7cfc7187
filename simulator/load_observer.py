"""A simulated engine's events into the llumlet's `LoadState`: the one translation of the hooks.

Two users, one translation:

  real time     (llumlet_adapter.py) every event inside the llumlet's event block, which takes
                its lock and wakes its exporter: `LoadObserver(llumlet.events, ...)`.
  virtual time  (cluster/status.py) straight into a LoadState the cluster owns, with nothing
                exported: `LoadObserver(DirectBlock(state), ...)`.

KV usage is read from the engine's block pool: the block events alone cannot track it, because a
prefix-cache hit that revives a freed block is not a `blocks_allocated`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest
from pilotfish.vllm_plugin.core.state import LoadState

if TYPE_CHECKING:
    from pilotfish.simulator.engine.base import EngineCore

# () -> the block one or more events are applied in: `with events() as state: state.added(...)`
Events = Callable[[], AbstractContextManager[LoadState]]


class DirectBlock:
    """The event block of a LoadState that one thread owns and nobody exports: no lock, no write.

    A class with slots, as the llumlet's EventBlock: the hooks enter one per token.
    """

    __slots__ = ("state",)

    def __init__(self, state: LoadState) -> None:
        self.state = state

    def __call__(self) -> DirectBlock:
        return self

    def __enter__(self) -> LoadState:
        return self.state

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None


def used_blocks_reader(core: EngineCore, num_blocks: int) -> Callable[[], int]:
    """Blocks in use on `core`: its block pool's count (a V1Engine), else its stats' usage."""
    kv = getattr(core, "kv", None)
    if kv is not None:
        pool = kv.pool
        return lambda: int(pool.num_used)
    return lambda: round(core.stats().kv_cache_usage * num_blocks)


class LoadObserver(EngineObserver):
    """Each engine hook as the LoadState call the vLLM adapter makes for the same event."""

    def __init__(self, events: Events, used_blocks: Callable[[], int], block_size: int, num_blocks: int) -> None:
        self.events = events
        self.used_blocks = used_blocks
        self.block_size = block_size
        self.num_blocks = num_blocks
        with events() as s:
            s.kv_usage(used_blocks(), num_blocks, block_size)

    def request_added(self, request: SimRequest, now: float) -> None:
        with self.events() as s:
            s.added(request.request_id, request.num_prompt_tokens, request.num_output_tokens)

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        with self.events() as s:
            s.scheduled(request.request_id, request.num_computed_tokens)

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        with self.events() as s:
            s.cache_hit(request.request_id, num_tokens)

    def blocks_allocated(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        with self.events() as s:
            s.kv_usage(self.used_blocks(), self.num_blocks, self.block_size)

    def blocks_freed(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        with self.events() as s:
            s.kv_usage(self.used_blocks(), self.num_blocks, self.block_size)

    def prefill_chunk(self, request: SimRequest, num_tokens: int, now: float) -> None:
        with self.events() as s:
            s.progressed(request.request_id, request.num_computed_tokens, request.num_output_tokens)

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        with self.events() as s:
            s.progressed(request.request_id, request.num_computed_tokens, request.num_output_tokens)

    def preempted(self, request: SimRequest, now: float) -> None:
        with self.events() as s:
            s.preempted(request.request_id)

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        with self.events() as s:
            s.finished(request.request_id, num_output_tokens=request.num_output_tokens)

    def detached(self, request: SimRequest, now: float) -> None:
        with self.events() as s:
            s.finished(request.request_id, answered=False)  # migrated away: no longer load here

    def step_finished(
        self, now: float, duration: float, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int
    ) -> None:
        with self.events() as s:
            s.step_finished(duration, num_prefill_tokens, num_decodes, num_context_tokens)
            # the step's usage rides with its record, as the vLLM adapter's decode_step carries it
            s.kv_usage(self.used_blocks(), self.num_blocks, self.block_size)
