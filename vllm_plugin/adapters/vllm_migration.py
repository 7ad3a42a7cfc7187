"""Request migration for vLLM V1 (0.32.x): the MigrationAdapter over the llumlet's scheduler.

Method: recompute. The destination gets a new engine request whose prompt is the original
prompt followed by every token generated so far, with max_tokens and min_tokens reduced by that
count; its prefix cache makes the prefill cheap where it holds the prompt already. No vLLM KV
connector is used (see the README's vLLM section).

Threads. The scheduler belongs to the engine-core thread. Every call here (from a gRPC thread)
queues a closure that `apply` runs inside `update_from_output`, after vLLM's own bookkeeping,
and waits on its Future (bounded). An idle engine core blocks on its input queue and never
steps, so each call also drops a WAKEUP into that queue, and the scheduler reports
`has_requests()` while closures are pending, which makes the engine core run one empty step.

Relayed tokens are the exception: they go straight into the engine core's output queue, the one
its own step outputs go through, without a step. An empty step still sends the worker an
execute_model call, and a vLLM worker that was just called busy-waits (sched_yield) for a second
for the next one: stepping once per relayed token kept the source's worker spinning, and where
it shares a core with the destination's worker (two CPU engines on one machine) the destination
ran one step a second. The first relay waits until the step that detached the request has put
its outputs in that queue (`step_done`, from `has_requests`), so the client's tokens stay in order.

Source. `detach` finishes the request in the scheduler the way an abort does (KV freed, the
worker drops its state) but emits nothing, so the frontend keeps the client's stream open.
`relay` turns the destination's tokens into EngineCoreOutputs under the request's own id: the
frontend detokenizes and streams them as if computed here. `reattach` re-adds the request under
the same id with prompt + every token the client has seen (vLLM's worker forgets a freed
request, so it cannot come back as a preempted one). `fail` ends the stream with
FinishReason.ERROR, which the OpenAI server turns into an error event.

Destination. `admit` adds the request straight to the scheduler (the frontend never hears of it)
and `apply` takes its outputs out of what goes to the frontend and hands them to the relay.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from pilotfish.vllm_plugin.core.migration_api import MigratingRequest, TokenRelay
from pilotfish.vllm_plugin.core.selection import MigrationCandidate

log = logging.getLogger("pilotfish.llumlet")

CALL_TIMEOUT_S = 30.0  # a loaded engine may take seconds per step
_FINISH = {str(reason): reason for reason in FinishReason}  # "stop", "length", "abort", "error", ...
_MOVABLE = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
T = TypeVar("T")
Outputs = dict[int, EngineCoreOutputs]


class ClientGone(LookupError):
    """The request's client went away (abort, a stop string matched by the frontend): stop relaying."""


@dataclass(slots=True)
class _Away:
    """A request detached here whose client still reads from this server."""

    internal_id: str
    request: Request  # the original: prompt, sampling params, client index
    sent: list[int]  # output tokens the frontend has been given, here and relayed
    gone: bool = False
    # set once the step that detached it has put its outputs in the output queue
    flushed: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Incoming:
    exported_id: str
    relay: TokenRelay
    base_output: int  # tokens generated before it arrived (for candidates' sizes)
    extra: dict[str, object] = field(default_factory=dict)


def find_engine_core() -> Any | None:
    """vLLM's EngineCore that is constructing the scheduler (call from the scheduler's __init__).

    vLLM gives the scheduler no handle on its engine core; we need its input queue (to wake an
    idle busy loop) and its request block hasher (so migrated-in requests use the prefix cache).
    """
    from vllm.v1.engine.core import EngineCore

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCore):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def migratable(request: Request) -> bool:
    """What recompute can rebuild exactly from token ids and sampling params, and relay back."""
    sp = request.sampling_params
    return (
        request.status in _MOVABLE
        and sp is not None
        and request.pooling_params is None
        and request.prompt_token_ids is not None
        and request.prompt_embeds is None
        and not request.mm_features
        and request.lora_request is None
        and not request.use_structured_output
        and not request.resumable
        and request.kv_transfer_params is None
        # logprobs would have to travel with every relayed token; not in the relay protocol
        and sp.logprobs is None
        and sp.prompt_logprobs is None
    )


def encode_sampling_params(sp: SamplingParams) -> bytes:
    # msgspec's JSON keeps the frontend-resolved private fields (_all_stop_token_ids, ...)
    return msgspec.json.encode(sp)


def continued_params(raw: bytes, max_tokens: int, num_output: int) -> SamplingParams:
    """The sampling params for the rest of a request that has `num_output` tokens already."""
    sp = msgspec.json.decode(raw or b"{}", type=SamplingParams)
    sp.max_tokens = max_tokens - num_output
    sp.min_tokens = max(0, sp.min_tokens - num_output)
    return sp


class VllmMigrationAdapter:
    """MigrationAdapter over a llumlet scheduler (`sched`), which calls `apply` every step."""

    def __init__(self, sched: Any, engine_core: Any | None, randomized_ids: bool) -> None:
        self.sched = sched
        self._core = engine_core
        self._randomized = randomized_ids
        self._ops: queue.SimpleQueue[tuple[Callable[[Outputs], Any], Future[Any] | None]] = queue.SimpleQueue()
        self._pending = 0  # closures queued and not yet run (read by has_requests, any thread)
        self._lock = threading.Lock()
        self._away: dict[str, _Away] = {}  # exported id ->
        self._incoming: dict[str, _Incoming] = {}  # internal id ->
        self._max_model_len = int(sched.max_model_len)
        self.unflushed: list[_Away] = []  # detached in the current step (engine thread only)
        self._engine_thread: int | None = None  # set by the first apply
        # the engine core's (client index, EngineCoreOutputs) queue to the frontend; None in-process
        self._output_queue: Any = getattr(engine_core, "output_queue", None)
        if engine_core is None or not hasattr(engine_core, "input_queue"):
            log.warning("pilotfish migration: no engine-core input queue; an idle engine applies calls late")

    # ---- gRPC side ---------------------------------------------------------------------------

    def candidates(self) -> list[MigrationCandidate]:
        return self._call(self._candidates)

    def detach(self, request_id: str) -> MigratingRequest | None:
        return self._call(lambda outputs: self._detach(request_id))

    def relay(self, request_id: str, token_ids: list[int], finish_reason: str | None) -> None:
        # Never waits for a step: the destination's pace must not be tied to this engine's.
        away = self._away.get(request_id)
        if away is None or away.gone:
            raise ClientGone(f"request {request_id} is not migrating out of this engine (client gone?)")
        tokens = list(token_ids)
        if self._output_queue is None:  # in-process engine: the engine thread emits at its next step
            self._submit(lambda outputs: self._emit(request_id, tokens, finish_reason, outputs), None)
            return
        if not away.flushed.wait(CALL_TIMEOUT_S):
            raise TimeoutError(f"engine took no step in {CALL_TIMEOUT_S:.0f}s")
        if not tokens and not finish_reason:
            return
        relayed = self._relayed(request_id, tokens, finish_reason)
        if relayed is None:
            raise ClientGone(f"request {request_id} ended here meanwhile (client gone?)")
        client_index, output = relayed
        # an abort that overtakes this put ends the stream first; the frontend drops outputs for ended ids
        self._output_queue.put_nowait((client_index, EngineCoreOutputs(outputs=[output])))

    def step_done(self) -> None:
        """The engine core asks has_requests() after putting a step's outputs in its output queue:
        requests detached in that step may now relay straight into it."""
        if self.unflushed and threading.get_ident() == self._engine_thread:
            for away in self.unflushed:
                away.flushed.set()
            self.unflushed.clear()

    def reattach(self, request: MigratingRequest) -> None:
        self._call(lambda outputs: self._reattach(request.request_id, outputs))

    def fail(self, request_id: str, error: str) -> None:
        self._call(lambda outputs: self._fail(request_id, error, outputs))

    def admit(self, request: MigratingRequest, relay: TokenRelay) -> None:
        self._call(lambda outputs: self._admit(request, relay))

    def drop(self, request_id: str) -> None:
        self._call(lambda outputs: self._drop(request_id))

    def busy(self) -> bool:
        """Closures wait for the engine thread: keep stepping (the scheduler's has_requests)."""
        return self._pending > 0

    def _submit(self, fn: Callable[[Outputs], Any], done: Future[Any] | None) -> None:
        with self._lock:
            self._pending += 1
        self._ops.put((fn, done))
        core = self._core
        if core is not None and hasattr(core, "input_queue"):
            from vllm.v1.engine import EngineCoreRequestType

            core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _call(self, fn: Callable[[Outputs], T], timeout: float = CALL_TIMEOUT_S) -> T:
        done: Future[T] = Future()
        self._submit(fn, done)
        try:
            return done.result(timeout=timeout)
        except TimeoutError:
            if done.cancel():
                raise TimeoutError(f"engine took no step in {timeout:.0f}s") from None
            return done.result()  # it started meanwhile: it finishes within the step

    # ---- engine thread -----------------------------------------------------------------------

    def apply(self, outputs: Outputs) -> None:
        """Run queued calls, then move migrated-in requests' outputs from the frontend to their relays."""
        if not self._pending and not self._incoming:
            return  # the usual step: two reads, on the engine thread's critical path
        self._engine_thread = threading.get_ident()
        ops = self._ops
        while not ops.empty():  # an empty check is cheaper than get_nowait's exception
            fn, done = ops.get()
            with self._lock:
                self._pending -= 1
            if done is None:
                fn(outputs)
                continue
            if not done.set_running_or_notify_cancel():  # the caller gave up waiting
                continue
            try:
                done.set_result(fn(outputs))
            except BaseException as exc:
                done.set_exception(exc)
        if self._incoming:
            self._divert(outputs)

    def before_finish(self, request_ids: Any) -> None:
        """The scheduler's finish_requests is about to run (engine thread)."""
        if request_ids is None:  # engine shutdown: the MigrateIn streams break, sources reattach
            self._incoming.clear()
            return
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        for internal in ids:
            incoming = self._incoming.pop(internal, None)
            if incoming is not None:  # aborted here (Abort RPC): the source's client sees the abort
                self._send(incoming, [], "abort")
                continue
            exported = self._exported(internal)
            with self._lock:
                away = self._away.get(exported)
                if away is not None and away.internal_id == internal:
                    away.gone = True  # the frontend aborted it: client gone or stop string matched
                    del self._away[exported]

    def abort_away(self, exported_ids: list[str], outputs: Outputs) -> list[str]:
        """Abort RPC for requests that are away: end their streams here; the relay then refuses."""
        aborted = []
        for rid in exported_ids:
            with self._lock:
                away = self._away.pop(rid, None)
                if away is not None:
                    away.gone = True
            if away is not None:
                _push(outputs, away.request.client_index, EngineCoreOutput(away.internal_id, [], FinishReason.ABORT))
                aborted.append(rid)
        return aborted

    def _exported(self, internal: str) -> str:
        from pilotfish.vllm_plugin.adapters.vllm_v1 import external_id

        return external_id(_IdOnly(internal), self._randomized)  # type: ignore[arg-type]

    def _candidates(self, outputs: Outputs) -> list[MigrationCandidate]:
        sched = self.sched
        out = []
        for request in (*sched.running, *sched.waiting):
            if request.request_id in self._incoming or not migratable(request):
                continue
            out.append(
                MigrationCandidate(
                    self._exported(request.request_id),
                    request.arrival_time,
                    request.status == RequestStatus.RUNNING,
                    request.num_tokens,
                )
            )
        return out

    def _detach(self, exported: str) -> MigratingRequest | None:
        sched = self.sched
        internal = sched._internal_ids.get(exported, exported)
        request = sched.requests.get(internal)
        if request is None or internal in self._incoming or exported in self._away or not migratable(request):
            why = "unknown" if request is None else "migrating" if internal in self._incoming else request.status
            log.info("pilotfish migration: %s cannot move (%s)", exported, why)
            return None
        running = request.status == RequestStatus.RUNNING
        sent = list(request.output_token_ids)
        # An abort without its output: KV freed, worker state dropped, the frontend not told.
        if not sched.finish_requests([internal], RequestStatus.FINISHED_ABORTED):
            return None
        # Our own copy: the coordinator extends the request's list with what it relays, and this
        # tally must count only what the frontend was actually given.
        away = _Away(internal, request, list(sent))
        with self._lock:
            self._away[exported] = away
        self.unflushed.append(away)
        return MigratingRequest(
            request_id=exported,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=sent,
            max_tokens=int(request.max_tokens),
            sampling_params_json=encode_sampling_params(request.sampling_params),
            arrival_time_ms=int(request.arrival_time * 1000),
            running=running,
            extra={"internal_id": internal},
        )

    def _emit(self, exported: str, tokens: list[int], finish: str | None, outputs: Outputs) -> None:
        relayed = self._relayed(exported, tokens, finish)
        if relayed is not None and (tokens or finish):  # None: client gone, the frontend forgot the id
            _push(outputs, *relayed)

    def _relayed(self, exported: str, tokens: list[int], finish: str | None) -> tuple[int, EngineCoreOutput] | None:
        """Count relayed tokens as given to the client: its client index and the output that gives
        them, or None if the request is no longer away (its client went, or it already finished)."""
        reason = None if not finish else _FINISH.get(finish, FinishReason.ERROR)
        with self._lock:  # any thread: the engine thread ends requests (abort, client gone)
            away = self._away.get(exported)
            if away is None:
                return None
            away.sent.extend(tokens)
            if reason is not None:
                del self._away[exported]
        return away.request.client_index, EngineCoreOutput(away.internal_id, tokens, finish_reason=reason)

    def _reattach(self, exported: str, outputs: Outputs) -> None:
        with self._lock:
            away = self._away.pop(exported, None)
        if away is None:
            return  # its client is gone: nothing to continue
        original = away.request
        assert original.sampling_params is not None and original.prompt_token_ids is not None
        remaining = original.max_tokens - len(away.sent)
        if remaining <= 0:  # everything was relayed but the finish
            _push(outputs, original.client_index, EngineCoreOutput(away.internal_id, [], FinishReason.LENGTH))
            return
        request = self._new_request(
            away.internal_id,
            list(original.prompt_token_ids) + away.sent,
            continued_params(encode_sampling_params(original.sampling_params), original.max_tokens, len(away.sent)),
            original.client_index,
            original.arrival_time,
        )
        self.sched.add_request(request)

    def _fail(self, exported: str, error: str, outputs: Outputs) -> None:
        with self._lock:
            away = self._away.pop(exported, None)
        if away is None:
            return
        log.warning("pilotfish migration: request %s failed: %s", exported, error)
        _push(outputs, away.request.client_index, EngineCoreOutput(away.internal_id, [], FinishReason.ERROR))

    def _admit(self, mr: MigratingRequest, relay: TokenRelay) -> None:
        sched = self.sched
        if mr.request_id in sched._internal_ids or any(i.exported_id == mr.request_id for i in self._incoming.values()):
            raise ValueError(f"request {mr.request_id} is already on this engine")
        num_output = len(mr.output_token_ids)
        if mr.max_tokens - num_output <= 0:
            raise ValueError(f"request {mr.request_id} has no tokens left to generate")
        tokens = list(mr.prompt_token_ids) + list(mr.output_token_ids)
        if len(tokens) >= self._max_model_len:
            raise ValueError(f"request {mr.request_id}: {len(tokens)} tokens >= max_model_len {self._max_model_len}")
        try:
            sp = continued_params(mr.sampling_params_json, mr.max_tokens, num_output)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"request {mr.request_id}: bad sampling params: {exc}") from None
        # Our own suffix, so external_id() maps it back like the frontend's ids.
        internal = f"{mr.request_id}-{os.urandom(4).hex()}" if self._randomized else mr.request_id
        arrival = mr.arrival_time_ms / 1000 if mr.arrival_time_ms else time.time()
        request = self._new_request(internal, tokens, sp, 0, arrival)
        self._incoming[internal] = _Incoming(mr.request_id, relay, num_output)
        sched.add_request(request)
        if internal not in sched.requests:
            del self._incoming[internal]
            raise ValueError(f"request {mr.request_id}: the scheduler did not take it")

    def _drop(self, exported: str) -> None:
        for internal, incoming in list(self._incoming.items()):
            if incoming.exported_id == exported:
                del self._incoming[internal]  # first, so before_finish does not relay an abort
                self.sched.finish_requests([internal], RequestStatus.FINISHED_ABORTED)

    def _new_request(
        self, request_id: str, tokens: list[int], sp: SamplingParams, client_index: int, arrival: float
    ) -> Request:
        hasher = getattr(self._core, "request_block_hasher", None)
        return Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=sp,
            pooling_params=None,
            client_index=client_index,
            arrival_time=arrival,
            block_hasher=hasher,
        )

    def _divert(self, outputs: Outputs) -> None:
        incoming = self._incoming
        for eco in outputs.values():
            ours = [o for o in eco.outputs if o.request_id in incoming]
            if not ours:
                continue
            eco.outputs = [o for o in eco.outputs if o.request_id not in incoming]
            if eco.finished_requests:  # the frontend never knew them
                eco.finished_requests.difference_update(o.request_id for o in ours)
            for out in ours:
                entry = incoming[out.request_id]
                if out.finish_reason is not None:
                    del incoming[out.request_id]
                if not out.new_token_ids and out.finish_reason is None:
                    continue
                finish = None if out.finish_reason is None else str(out.finish_reason)
                if not self._send(entry, list(out.new_token_ids), finish) and out.request_id in incoming:
                    del incoming[out.request_id]
                    self.sched.finish_requests([out.request_id], RequestStatus.FINISHED_ABORTED)

    def _send(self, entry: _Incoming, tokens: list[int], finish: str | None) -> bool:
        try:
            entry.relay(tokens, finish)
            return True
        except Exception as exc:  # the source is gone or refuses: stop computing it here
            log.info("pilotfish migration: relay of %s stopped: %s", entry.exported_id, exc)
            return False


@dataclass(slots=True)
class _IdOnly:
    request_id: str


def _push(outputs: Outputs, client_index: int, output: EngineCoreOutput) -> None:
    eco = outputs.get(client_index)
    if eco is None:
        eco = outputs[client_index] = EngineCoreOutputs()
    eco.outputs.append(output)
