"""Colocated scheduling: the scheduler's core runs inside the ext_proc process.

No gRPC hop for Schedule, Report or Release, so the gateway adds the least latency and CPU
per request. Each ext_proc process then keeps its own local real-time state: with several
ext_proc processes, each sees only the requests it dispatched itself (full mode, where the
view comes from the CMS, does not have that limit).

With --enable-flow-control in the scheduler settings, the core's flow control (scheduler/flow)
runs here too: a Schedule the gateway can hold (--schedule-queue-timeout-ms) waits in this
process's queue while every engine is saturated; a release of a waiting request (its client left)
takes it out, never dispatched.
"""

from __future__ import annotations

import asyncio

from pilotfish.discovery.static import Instance
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, Decision, SchedulerUnavailable
from pilotfish.protos import scheduler_pb2

# the core's error codes (grpc.StatusCode names) as the HTTP status the client gets
_HTTP_STATUS = {
    "NOT_FOUND": 404,
    "INVALID_ARGUMENT": 400,
    "ALREADY_EXISTS": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
}
_MAX_HOLD_MS = 600_000


class LocalScheduler:
    def __init__(self, core: object, models: frozenset[str] = frozenset()) -> None:
        from pilotfish.scheduler.flow import FlowGate
        from pilotfish.scheduler.view.types import RequestInfo

        self._core = core
        self._models = models
        self._request_info = RequestInfo
        self.flow = FlowGate.from_config(core, core.config)  # type: ignore[attr-defined]
        if self.flow is not None:
            core.on_view_change = self.flow.poke  # type: ignore[attr-defined]

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        from pilotfish.scheduler.errors import SchedulerError
        from pilotfish.scheduler.flow import Stopping

        if self._core.on_rekey_due is None:  # type: ignore[attr-defined]
            from pilotfish.scheduler.idle_rekey import rekey_when_idle

            # the loop this gateway serves on: its free time re-keys the load index, not the next request
            rekey_when_idle(self._core, asyncio.get_running_loop())  # type: ignore[arg-type]
        info = self._request_info(
            request_id=request.request_id,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            prefix_block_hashes=tuple(request.prefix_block_hashes),
            prefix_block_size=request.prefix_block_size,
            max_tokens=request.max_tokens,
            stream=request.stream,
            candidate_addresses=frozenset(request.candidate_addresses),
        )
        try:
            if self.flow is not None and request.queue_timeout_ms:
                decision = await self._through_queue(info, request)
            else:
                decision = self._core.schedule(info)  # type: ignore[attr-defined]
        except Stopping as exc:
            raise SchedulerUnavailable(str(exc)) from None
        except SchedulerError as exc:
            status = _HTTP_STATUS.get(exc.code, 503)
            raise RequestError(status, str(exc), retry_after=1 if status in (429, 503) else 0) from None
        target, decode = decision.target, decision.decode_target
        fallbacks = tuple(f.address for f in decision.fallbacks)
        if decode is not None:
            return Decision(
                target.instance_id, target.address, SCHEDULER, fallbacks, decode.address, decode.instance_id
            )
        return Decision(target.instance_id, target.address, SCHEDULER, fallbacks)

    async def _through_queue(self, info: object, request: scheduler_pb2.ScheduleRequest) -> object:
        """Flow control: the Decision now, or once the request leaves the queue; raises its refusal."""
        from pilotfish.scheduler.errors import SchedulerError
        from pilotfish.scheduler.flow.wire import resolve

        assert self.flow is not None
        waiter: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        hold_s = min(request.queue_timeout_ms, _MAX_HOLD_MS) / 1000
        decision = self.flow.submit(info, request.priority, request.flow[:64], hold_s, resolve(waiter))  # type: ignore[arg-type]
        if decision is not None:
            return decision
        try:
            outcome = await waiter
        except asyncio.CancelledError:  # the client left: out of the queue, never dispatched
            self.flow.cancel(request.request_id)
            raise
        if isinstance(outcome, SchedulerError):
            raise outcome
        return outcome

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None:
        if served_address:
            self._core.reroute(request_id, served_address)  # type: ignore[attr-defined]
        self._core.report(request_id, generated_tokens, prefill_done)  # type: ignore[attr-defined]
        if served_address and self.flow is not None:
            self.flow.poke()  # its first engine may have room now

    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        if self.flow is not None and self.flow.cancel(request_id):
            return  # it was still waiting: it leaves the queue, never dispatched
        # the reason feeds the core's engine health (an upstream error is a failure of that engine)
        self._core.release(request_id, reason, answer_tokens)  # type: ignore[attr-defined]
        if self.flow is not None:
            self.flow.poke()

    def instance_added(self, instance: Instance) -> None:
        from pilotfish.scheduler.view.types import Endpoint, InstanceView

        view = InstanceView(Endpoint(instance.instance_id, instance.address), models=self._models)
        self._core.add_instance(view)  # type: ignore[attr-defined]
        if self.flow is not None:
            self.flow.poke()

    def instance_removed(self, instance_id: str) -> None:
        self._core.remove_instance(instance_id)  # type: ignore[attr-defined]

    async def close(self) -> None:
        self._core.on_rekey_due = None  # type: ignore[attr-defined]
        if self.flow is not None:
            self.flow.close()
