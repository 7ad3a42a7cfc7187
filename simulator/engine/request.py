"""A request as the engine sees it: its tokens and the counters the scheduler moves."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    MIGRATED = "migrated"  # taken out of this engine to continue on another


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # the simulated model emitted EOS
    ABORT = "abort"


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Simulated EOS: finish with "stop" after this many output tokens (None: only max_tokens ends it).
    stop_after: int | None = None
    arrival_time: float = 0.0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is computed (prompt and output). A request samples a token in a step that
    # brings this to num_tokens; a preempted request restarts from 0 and recomputes everything.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first schedule
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    block_hashes: list[int] = field(default_factory=list)  # of full blocks of all_token_ids, grown lazily
    # Leading tokens whose KV arrived from another engine (migration by KV transfer): they count as
    # computed when the request is next scheduled, like a prefix-cache hit, then this goes back to 0.
    num_external_computed_tokens: int = 0

    # read every step for every running request; the prompt never changes, so its length is kept
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` (0 <= start <= stop) without joining prompt and output."""
        num_prompt = self.num_prompt_tokens
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - num_prompt]

    def length_limit_reached(self, max_model_len: int) -> FinishReason | None:
        if self.stop_after is not None and self.num_output_tokens >= self.stop_after:
            return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
