"""Moving a request between two engines of the virtual-time cluster: the engine-side mechanics.

Two methods, as llumlet.proto's MigrationMethod:

- **recompute**: the request leaves the source at once (its blocks freed, no finish recorded)
  and joins the destination's waiting queue with the output tokens it has, which the
  destination prefills again with the prompt (its prefix cache helps);
- **kv_transfer**: the destination reserves blocks for the tokens the source has computed and
  the request arrives, straight into its running batch, `kv_transfer_seconds(tokens)` later.
  The source keeps its blocks until then, since they are being read. During the transfer the
  request produces no tokens: that is the price. When the destination has no seat or too few
  free blocks, or the request has nothing computed yet (it waits), it moves by recompute.

A request is taken out between the engine's steps as far as tokens go: if the source's step in
progress includes it, that step's work on it is lost (the step still lasts as long), exactly
as an abort mid-step in `V1Engine.end_step`. The source's object is left dead (MIGRATED, so that
step's end skips it) and the destination gets a fresh `SimRequest` continuing after the same
output tokens: were the same object to start running on the destination before the source's
step ends, that step's end would compute for it too.

Recompute uses the engine's own `V1Engine.detach_request`, as the HTTP driver does. What the engine
has no call for (keeping the source's blocks through a transfer, putting a request with reserved
blocks straight into the running batch) `detach` and `admit_running` below do on its public
fields (`requests`, `running`, `waiting`, `kv`, `observers`), telling observers what the engine
itself would. The HTTP driver's KV transfer frees the source at once and re-admits through the
waiting queue (`num_external_computed_tokens`); here the source holds its blocks while they are
read and the destination reserves its blocks up front, so a transfer that cannot fit is known at
once and done by recompute instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pilotfish.simulator.engine.request import RequestStatus, SimRequest
from pilotfish.vllm_plugin.core.selection import MigrationCandidate

if TYPE_CHECKING:
    from pilotfish.simulator.cluster.driver import ClusterSim
    from pilotfish.simulator.engine.scheduler import V1Engine
    from pilotfish.simulator.virtual import TimedOutput, VirtualEngine

RECOMPUTE = "recompute"
KV_TRANSFER = "kv_transfer"
METHODS = (RECOMPUTE, KV_TRANSFER)


@dataclass(frozen=True, slots=True)
class MigrationOrder:
    """Move `request_ids` (those still on `source` when it runs) from engine `source` to `destination`."""

    source: int
    destination: int
    request_ids: tuple[str, ...]
    method: str = RECOMPUTE
    reason: str = ""  # the rescheduling policy that asked, for the log


@dataclass(slots=True)
class MigrationEvent:
    """One request moved: when it left, by which method, and when it joined the destination."""

    time: float
    request_id: str
    source: int
    destination: int
    method: str  # what was done (a KV transfer that did not fit is done by recompute)
    requested: str  # what was asked
    tokens: int  # tokens of KV cache transferred (0 by recompute)
    arrives: float  # when the destination has it: `time`, plus the transfer time for kv_transfer
    reason: str = ""


# (sim, now) -> orders: called every rescheduling interval of virtual time
Rescheduler = Callable[["ClusterSim", float], Sequence[MigrationOrder]]


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown migration method {method!r} (choose {', '.join(METHODS)})")
    return method


def candidates(core: V1Engine) -> list[MigrationCandidate]:
    """The requests on an engine that a migration may select, for `select_requests`.

    The engine keeps no admission order of its own across both queues, so the arrival time the
    driver stamps on each request (its time of joining this engine) orders them.
    """
    out = [MigrationCandidate(r.request_id, r.arrival_time, True, r.num_tokens) for r in core.running]
    out += [MigrationCandidate(r.request_id, r.arrival_time, False, r.num_tokens) for r in core.waiting]
    return out


def detach(core: V1Engine, request_id: str, now: float, *, keep_blocks: bool = False) -> SimRequest | None:
    """Take a request out of the engine without finishing it; None if the engine does not hold it.

    The engine's own `detach_request` frees its blocks at once (recompute). With `keep_blocks` they
    stay held under its id until `release_blocks`, since a KV transfer reads them meanwhile; the
    engine has no call for that, so it is done here on its public fields, telling observers the
    same `detached`. Either way the returned object is dead (MIGRATED, not RUNNING), so a step in
    progress that scheduled it computes nothing for it.
    """
    if not keep_blocks:
        return core.detach_request(request_id, now)
    request = core.requests.pop(request_id, None)
    if request is None:
        return None
    if request.status is RequestStatus.RUNNING:
        core.running.remove(request)
    else:
        core.waiting.remove(request)
    request.status = RequestStatus.MIGRATED
    for o in core.observers:
        o.detached(request, now)
    return request


def release_blocks(core: V1Engine, request: SimRequest, now: float) -> None:
    """Free every block `request` holds on `core`, telling observers as the engine's own free does."""
    freed = core.kv.free(request)
    if freed:
        for o in core.observers:
            o.blocks_freed(request, freed, now)


def successor(request: SimRequest) -> SimRequest:
    """A fresh request continuing `request` after its output tokens, nothing computed yet."""
    return SimRequest(
        request.request_id,
        request.prompt_token_ids,
        request.max_tokens,
        stop_after=request.stop_after,
        output_token_ids=list(request.output_token_ids),
        num_preemptions=request.num_preemptions,
        block_hashes=list(request.block_hashes),
    )


def reserve_blocks(core: V1Engine, request: SimRequest, num_tokens: int, seats_taken: int, now: float) -> bool:
    """Hold blocks for `num_tokens` computed tokens of `request` on `core`, if a seat and blocks are free.

    `seats_taken`: requests already on their way into this engine's running batch.
    """
    if len(core.running) + seats_taken >= core.config.max_num_seqs:
        return False
    blocks = core.kv.allocate(request, num_tokens)
    if blocks is None:
        return False
    if blocks:
        ids = [b.block_id for b in blocks]
        for o in core.observers:
            o.blocks_allocated(request, ids, now)
    return True


def admit_running(engine: VirtualEngine, request: SimRequest, num_computed: int, now: float) -> list[TimedOutput]:
    """Put a request whose blocks are already reserved on the engine straight into its running batch.

    `VirtualEngine.add_request` adds it (and wakes an idle engine); it is then moved from the
    back of the waiting queue to the back of the running batch with its computed tokens, as the
    engine's own admission would, without the prefix-cache lookup a new request gets.
    """
    done = engine.add_request(request, now)
    core = engine.core
    if core.waiting[-1] is not request:
        raise RuntimeError(f"request {request.request_id!r} is not where add_request put it")
    core.waiting.pop()
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_computed
    core.running.append(request)
    for o in core.observers:
        o.request_scheduled(request, now)
    return done
