"""The contract between the llumlet's migration coordinator and an engine adapter.

A migration moves one request from a source engine to a destination engine while the client's
stream stays on the source's server, open and unbroken:

    source                                      destination
    ------                                      -----------
    detach(id) -> MigratingRequest              (the source's llumlet calls MigrateIn)
                                                admit(request, relay)
    relay(id, tokens, finish) <- MigrateInChunk <- relay(tokens, finish) per step

`detach` stops computing the request on the source and frees its KV cache; the client's stream
is kept. The destination continues after the output tokens it was given (recompute: it
prefills prompt + output, helped by its prefix cache), and every token it produces comes back
through the source's `relay` into that same stream, in order, each once. If the destination
fails before it accepts, or its stream breaks before the request finishes, the source
`reattach`es the request with every token the client has seen, and computes the rest itself;
if even that is impossible, `fail` ends the stream with an error. A request is never silently
lost.

Every method may be called from a gRPC thread; an adapter hands the work to its engine's own
thread or loop and waits for it (bounded), as `abort_handler` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pilotfish.vllm_plugin.core.selection import MigrationCandidate

# (new token ids, finish reason or None): called on the destination engine's thread, in order
TokenRelay = Callable[[list[int], str | None], None]


@dataclass(slots=True)
class MigratingRequest:
    """A request in transit: what the destination needs to rebuild it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (on the source, and relayed since)
    max_tokens: int  # the client's total output limit
    sampling_params_json: bytes = b"{}"  # engine-specific, passed through unchanged
    arrival_time_ms: int = 0
    running: bool = True  # was in the running batch on the source (waiting otherwise)
    # adapter-private state the source keeps while the request is away (e.g. its stream handle)
    extra: dict[str, object] = field(default_factory=dict)
    # how the destination gets the KV: "recompute" (prefill prompt + output) or "kv_transfer";
    # the coordinator sets it from the Migrate call on the source and from MigrateIn on the destination
    method: str = "recompute"


class MigrationAdapter(Protocol):
    def candidates(self) -> list[MigrationCandidate]:
        """Requests that may move now: not finished, not already migrating in or out."""
        ...

    # ---- source side ---------------------------------------------------------------------------

    def detach(self, request_id: str) -> MigratingRequest | None:
        """Stop computing the request here and free its KV; keep the client's stream open.

        None if the request is unknown, finished or already migrating.
        """
        ...

    def relay(self, request_id: str, token_ids: list[int], finish_reason: str | None) -> None:
        """Write tokens produced elsewhere into the client's stream; a finish reason ends it."""
        ...

    def reattach(self, request: MigratingRequest) -> None:
        """The destination failed: compute the request here again, after its output tokens."""
        ...

    def fail(self, request_id: str, error: str) -> None:
        """End the client's stream with an error: no engine can continue the request."""
        ...

    # ---- destination side ----------------------------------------------------------------------

    def admit(self, request: MigratingRequest, relay: TokenRelay) -> None:
        """Add a migrated request, continuing after its output tokens; its tokens go to `relay`.

        Raises (with a one-line reason) if the request cannot be admitted here.
        """
        ...

    def drop(self, request_id: str) -> None:
        """The source went away: abort the migrated-in request and free what it holds."""
        ...
