"""The contract between the engine model and its drivers (HTTP in real time, or virtual time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest


class TokenOutput(msgspec.Struct, frozen=True, gc=False):
    """One generated token, or the end of a request that produced none (finish_reason set).

    A msgspec Struct, not a frozen dataclass: one is made per token, and a frozen dataclass's
    __init__ (object.__setattr__ per field) cost several times as much. Untracked by the garbage
    collector (gc=False): its fields are strings, numbers and an enum, so it is never in a cycle.
    """

    request_id: str
    token_id: int | None
    index: int  # position in the output, from 0
    finish_reason: FinishReason | None = None
    # set (with no token) when the request ends in an error: no engine could continue it
    error: str | None = None


@dataclass(slots=True)
class StepPlan:
    """A scheduled step: who runs how many tokens, from `start` for `duration` seconds."""

    start: float
    duration: float
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, new tokens)
    num_prefill_tokens: int = 0
    num_decode_requests: int = 0
    decode_flags: list[bool] = field(default_factory=list)  # per scheduled entry: a decode, not a prefill
    num_context_tokens: int = 0  # sum of the context lengths the step attends (the profile's C)
    # start + duration, kept: drivers read it several times per step
    end: float = field(init=False)

    def __post_init__(self) -> None:
        self.end = self.start + self.duration


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: it lasts `duration` seconds and its tokens exist at its end."""

    duration: float
    outputs: list[TokenOutput] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_requests: int = 0


@dataclass(slots=True)
class EngineStats:
    """Gauges and counters a /metrics page or a status record reads."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)


class EngineCore(Protocol):
    """One engine. `now` is the driver's clock in seconds; the core never reads a clock itself."""

    def add_request(self, request: SimRequest, now: float) -> None: ...

    def add_observer(self, observer: EngineObserver) -> None: ...

    def abort_request(self, request_id: str, now: float) -> bool:
        """Drop a waiting or running request and free what it holds; False if it is unknown."""
        ...

    def detach_request(self, request_id: str, now: float) -> SimRequest | None:
        """Take a waiting or running request out to continue elsewhere (migration): its blocks
        are freed and no finish is recorded. None if it is not in the engine."""
        ...

    def resume_request(self, request: SimRequest, now: float) -> None:
        """Add a request that already has output tokens (migrated in, or back after a failed
        migration): it recomputes prompt + output and continues after them."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def begin_step(self, now: float) -> StepPlan:
        """Schedule one step starting at `now` (blocks are allocated here)."""
        ...

    def end_step(self, plan: StepPlan) -> list[TokenOutput]:
        """Apply the step's results at `plan.end`: tokens sampled, requests finished and freed.

        Requests aborted between `begin_step` and `end_step` produce nothing.
        """
        ...

    def step(self, now: float) -> StepResult:
        """`begin_step` and `end_step` at once, for drivers that never abort mid-step."""
        ...

    def stats(self) -> EngineStats: ...
