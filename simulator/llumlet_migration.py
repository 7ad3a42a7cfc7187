"""Migration on a simulated engine served over HTTP: the MigrationAdapter over an EngineDriver.

Source: `detach` takes the request out of the V1Engine (blocks freed, no finish counted) and
keeps the driver's sink, the client's SSE stream; `relay` writes the destination's tokens to
that sink with their output index continuing; `reattach` puts the request back, keeping its
output tokens, to recompute like a preempted request; `fail` ends the stream with an error event.

Destination: `admit` adds a SimRequest with the output tokens filled in, and a sink that hands
each token to the coordinator's relay. Recompute: it waits and prefills prompt + output like any
request (its prefix cache helps). KV transfer: the KV the source had (`kv_tokens` in the
sampling parameters) travels for `EngineConfig.kv_transfer_seconds(kv_tokens)` (bandwidth x
bytes per token; the request counts as loading meanwhile), then the request joins the waiting
queue with those tokens counted computed when it is scheduled, so only the rest is prefilled.
Blocks for them are taken then, not during the transfer: the model is the link's delay, not
the destination's memory pressure while it lasts.

Every call comes from a gRPC thread; the core and the driver belong to the asyncio loop, so
each call runs there (`call_soon_threadsafe`) and is waited for, bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pilotfish.simulator.engine.base import TokenOutput
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, RequestStatus, SimRequest
from pilotfish.vllm_plugin.core.migration_api import MigratingRequest, TokenRelay
from pilotfish.vllm_plugin.core.selection import MigrationCandidate

if TYPE_CHECKING:
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.server.driver import EngineDriver
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

HANDOFF_TIMEOUT_S = 5.0
T = TypeVar("T")


class SimMigrationAdapter(EngineObserver):
    def __init__(self, driver: EngineDriver, engine_config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.driver = driver
        self.core: Any = driver.core  # a V1Engine: candidates read its queues
        self.engine_config = engine_config
        self.loop = loop
        self.llumlet: Llumlet | None = None  # set once the llumlet exists: loading counts go there
        # all three owned by the loop
        self._away: dict[str, SimRequest] = {}  # migrated out: computed elsewhere, streamed here
        self._arrived: dict[str, TokenRelay] = {}  # migrated in: computed here, streamed by the source
        self._loading: dict[str, asyncio.TimerHandle] = {}  # migrated in, KV still in transfer

    # ---- the hand-over to the loop ------------------------------------------------------------------

    def _on_loop(self, fn: Callable[[], T]) -> T:
        try:
            if asyncio.get_running_loop() is self.loop:
                return fn()  # already on the loop (a test, or a caller inside the driver)
        except RuntimeError:
            pass
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the caller gave up waiting: do nothing half-way
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        try:
            return done.result(timeout=HANDOFF_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise TimeoutError("the simulated engine's loop did not take the call in time") from None

    # ---- MigrationAdapter: both sides -------------------------------------------------------------

    def candidates(self) -> list[MigrationCandidate]:
        def run() -> list[MigrationCandidate]:
            running = RequestStatus.RUNNING
            return [
                MigrationCandidate(r.request_id, r.arrival_time, r.status is running, r.num_tokens)
                for r in self.core.requests.values()
                if r.request_id not in self._arrived and self.driver.has_stream(r.request_id)
            ]

        return self._on_loop(run)

    # ---- source side --------------------------------------------------------------------------------

    def detach(self, request_id: str) -> MigratingRequest | None:
        def run() -> MigratingRequest | None:
            if request_id in self._arrived:
                return None  # migrated in: it is not moved on again
            request = self.core.requests.get(request_id)
            if request is None:
                return None
            running = request.status is RequestStatus.RUNNING
            if self.driver.detach(request_id) is None:
                return None
            self._away[request_id] = request
            age_ms = (time.monotonic() - request.arrival_time) * 1000
            params = {"stop_after": request.stop_after, "kv_tokens": request.num_computed_tokens}
            return MigratingRequest(
                request_id=request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                max_tokens=request.max_tokens,
                sampling_params_json=json.dumps(params).encode(),
                arrival_time_ms=max(0, int(time.time() * 1000 - age_ms)),
                running=running,
                extra={"sim_request": request},
            )

        return self._on_loop(run)

    def relay(self, request_id: str, token_ids: list[int], finish_reason: str | None) -> None:
        def run() -> None:
            request = self._away.get(request_id)
            if request is None:
                raise LookupError(f"{request_id} is not migrating out of this engine")
            reason = _finish_reason(finish_reason)
            outputs = request.output_token_ids
            delivered = True
            if not token_ids:
                delivered = self.driver.relay(TokenOutput(request_id, None, len(outputs), reason))
            for i, token_id in enumerate(token_ids):
                index = len(outputs)
                outputs.append(token_id)
                last = i == len(token_ids) - 1
                delivered = self.driver.relay(TokenOutput(request_id, token_id, index, reason if last else None))
                if not delivered:
                    break
            if reason is not None or not delivered:
                del self._away[request_id]
            if not delivered:
                raise LookupError(f"the client of {request_id} went away")

        self._on_loop(run)

    def reattach(self, request: MigratingRequest) -> None:
        def run() -> None:
            rid = request.request_id
            sim: SimRequest | None = self._away.pop(rid, None) or request.extra.get("sim_request")  # type: ignore[assignment]
            if sim is None:
                raise LookupError(f"{rid} was not migrating out of this engine")
            if not self.driver.has_stream(rid):
                return  # the client left meanwhile: nothing to continue
            sim.output_token_ids = list(request.output_token_ids)
            sim.num_external_computed_tokens = 0
            done = sim.length_limit_reached(self.engine_config.max_model_len)
            if done is not None:
                self.driver.relay(TokenOutput(rid, None, sim.num_output_tokens, done))
                return
            self.driver.resume(sim)

        self._on_loop(run)

    def fail(self, request_id: str, error: str) -> None:
        def run() -> None:
            request = self._away.pop(request_id, None)
            index = request.num_output_tokens if request is not None else 0
            self.driver.relay(TokenOutput(request_id, None, index, None, error))

        self._on_loop(run)

    # ---- destination side ---------------------------------------------------------------------------

    def admit(self, request: MigratingRequest, relay: TokenRelay) -> None:
        params = json.loads(request.sampling_params_json or b"{}")
        if not isinstance(params, dict):
            raise ValueError("sampling_params_json must be a JSON object")
        stop_after = params.get("stop_after")
        kv_tokens = int(params.get("kv_tokens") or 0)
        age_s = max(0.0, time.time() - request.arrival_time_ms / 1000) if request.arrival_time_ms else 0.0
        rid = request.request_id

        def sink(out: TokenOutput) -> None:
            reason = out.finish_reason.value if out.finish_reason is not None else None
            if reason is not None:
                self._arrived.pop(rid, None)
            relay([] if out.token_id is None else [out.token_id], reason)

        def run() -> None:
            if rid in self._arrived or rid in self.core.requests or self.driver.has_stream(rid):
                raise ValueError(f"request {rid!r} is already on this engine")
            sim = SimRequest(rid, list(request.prompt_token_ids), request.max_tokens, stop_after,
                             time.monotonic() - age_s)  # fmt: skip
            sim.output_token_ids = list(request.output_token_ids)
            if not 0 < sim.num_prompt_tokens < self.engine_config.max_model_len:
                raise ValueError(f"prompt of {sim.num_prompt_tokens} tokens does not fit max_model_len")
            if sim.length_limit_reached(self.engine_config.max_model_len) is not None:
                raise ValueError("the request has reached its length limit")
            transferred = min(kv_tokens, sim.num_tokens - 1) if request.method == "kv_transfer" else 0
            if transferred <= 0:
                self.driver.resume(sim, sink)
                self._arrived[rid] = relay
                return
            sim.num_external_computed_tokens = transferred
            delay = self.engine_config.kv_transfer_seconds(transferred)
            self._loading[rid] = self.loop.call_later(delay, self._loaded, sim, sink)
            self._arrived[rid] = relay
            self._count_loading(+1)

        self._on_loop(run)

    def _loaded(self, sim: SimRequest, sink: Callable[[TokenOutput], None]) -> None:
        rid = sim.request_id
        if self._loading.pop(rid, None) is None:
            return
        self._count_loading(-1)
        try:
            self.driver.resume(sim, sink)
        except ValueError as exc:  # cannot happen short of a bug; the source then continues it
            self._arrived.pop(rid, None)
            sink(TokenOutput(rid, None, sim.num_output_tokens, FinishReason.ABORT, str(exc)))

    def drop(self, request_id: str) -> None:
        def run() -> None:
            self._arrived.pop(request_id, None)
            handle = self._loading.pop(request_id, None)
            if handle is not None:
                handle.cancel()
                self._count_loading(-1)
                return
            self.driver.abort(request_id)

        self._on_loop(run)

    def _count_loading(self, delta: int) -> None:
        if self.llumlet is not None:
            with self.llumlet.events() as s:
                s.migrating(loading_delta=delta)

    # ---- EngineObserver: a migrated-in request aborted here (Abort RPC) ends the source's stream too ----

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        if reason is FinishReason.ABORT and request.request_id in self._arrived:
            # through the driver, so its sink goes too; the sink relays the finish to the source
            self.driver.relay(TokenOutput(request.request_id, None, request.num_output_tokens, reason))


def _finish_reason(reason: str | None) -> FinishReason | None:
    if not reason:
        return None
    try:
        return FinishReason(reason)
    except ValueError:
        return FinishReason.ABORT  # another engine's reason this one has no name for
