"""Runs an engine core in real time on the asyncio loop: step, sleep the step's duration,
deliver its tokens. The core's state is owned by this loop alone.

Tokens reach each request through a sink, a plain callable run inside the step loop: a
streaming response writes its SSE event straight to its socket from there, so a token costs no
queue and no coroutine switch, and the first token leaves the process in the same loop
iteration that ended the step. The clock is `time.monotonic`: uvloop's `loop.time()` has
millisecond resolution, too coarse for the TTFT the engine reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pilotfish.simulator.engine.base import EngineCore, StepPlan, TokenOutput
from pilotfish.simulator.engine.request import FinishReason, SimRequest

log = logging.getLogger(__name__)

TokenSink = Callable[[TokenOutput], None]
CATCH_UP = 0.005  # seconds a busy engine's step may start before the loop wakes for it


class KVEventSink(Protocol):
    def publish_raw(self, raw: list[tuple]) -> None: ...


class EngineDriver:
    def __init__(self, core: EngineCore, kv_events: KVEventSink | None = None) -> None:
        self.core = core
        self.kv_events = kv_events
        self._sinks: dict[str, TokenSink] = {}
        # the profile's serving overhead: requests reach the core this long after they arrive
        profile = getattr(core, "profile", None)
        self._overhead = getattr(profile, "api_overhead_ms", 0.0) / 1000.0
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine-steps")
        self._task.add_done_callback(self._report_crash)

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        # a dead step loop would leave every request hanging; say so loudly
        if not task.cancelled() and task.exception() is not None:
            log.critical("engine step loop died", exc_info=task.exception())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, request: SimRequest, sink: TokenSink | None = None) -> asyncio.Queue[TokenOutput]:
        """Queue `request`. Its tokens go to `sink`, called in the step loop (it must not block),
        or else to the returned queue; the last one carries a finish reason."""
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._sinks[request.request_id] = sink or queue.put_nowait
        if self._overhead > 0:
            loop = asyncio.get_running_loop()
            self._pending[request.request_id] = loop.call_later(self._overhead, self._admit, request)
        else:
            self._admit(request)
        return queue

    def _admit(self, request: SimRequest) -> None:
        self._pending.pop(request.request_id, None)
        self.core.add_request(request, time.monotonic())
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                pending.cancel()  # never reached the engine
            else:
                self.core.abort_request(request_id, time.monotonic())

    # ---- migration: the request moves, its stream (the sink) stays -----------------------------

    def abort_from_engine(self, request_id: str) -> bool:
        """Abort a request on the engine's side (the llumlet's Abort, not the client): the client's
        stream ends with finish_reason "abort", as vLLM ends an aborted request's stream. False if
        the request is not here."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.cancel()  # never reached the engine
            request = None
        else:
            # read before the abort frees it: the finish goes after the tokens already streamed
            request = getattr(self.core, "requests", {}).get(request_id)
            if not self.core.abort_request(request_id, time.monotonic()):
                return False
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            index = request.num_output_tokens if request is not None else 0
            _deliver(sink, TokenOutput(request_id, None, index, FinishReason.ABORT))
        return True

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._sinks

    def detach(self, request_id: str) -> SimRequest | None:
        """Take a request out of the engine to continue elsewhere; its sink stays, for `relay`."""
        if request_id not in self._sinks or request_id in self._pending:
            return None  # unknown, finished, or not in the engine yet
        return self.core.detach_request(request_id, time.monotonic())

    def relay(self, out: TokenOutput) -> bool:
        """Deliver a token computed elsewhere to the request's sink; False if its client is gone."""
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return False
        if out.finish_reason is not None or out.error is not None:
            del self._sinks[out.request_id]
        _deliver(sink, out)
        return True

    def resume(self, request: SimRequest, sink: TokenSink | None = None) -> None:
        """Put a request that has output tokens (back) into the engine; `sink` is its stream where
        it has none here yet (migrated in). Raises ValueError if the engine cannot take it."""
        if sink is not None:
            if request.request_id in self._sinks:
                raise ValueError(f"request {request.request_id!r} already streams from this engine")
            self._sinks[request.request_id] = sink
        try:
            self.core.resume_request(request, time.monotonic())
        except BaseException:
            if sink is not None:
                del self._sinks[request.request_id]
            raise
        self._wake.set()

    async def _run(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        last_end: float | None = None
        while True:
            if not core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                last_end = None
                continue
            now = time.monotonic()
            # Back to back in model time: a busy engine's next step starts where the last one
            # ended, not when the loop got round to it; otherwise timer granularity (1 ms under
            # uvloop) and loop lag would stretch every step. Only a lag beyond CATCH_UP (an
            # overloaded process) is let into the model, so no request joins a step that began
            # more than that before it arrived.
            start = last_end if last_end is not None and now - last_end <= CATCH_UP else now
            plan = core.begin_step(start)
            # The step ends in a timer callback, not after `await asyncio.sleep`: a callback runs in
            # the loop's timer phase, ahead of the ready queue, so this step's first tokens are not
            # written behind other engines' deferred token batches and new requests' handlers. An
            # awaited sleep would resume the task from the ready queue, behind all of them.
            ended = loop.create_future()
            timer = loop.call_later(max(0.0, plan.end - time.monotonic()), self._end_step, plan, ended)
            try:
                await ended
            finally:
                timer.cancel()  # stopped mid-step: the step never ends
            last_end = plan.end

    def _end_step(self, plan: StepPlan, ended: asyncio.Future[None]) -> None:
        core = self.core
        sinks = self._sinks
        try:
            # First tokens leave now; later tokens wait for the ready queue, after every engine whose
            # step ended at the same time has sent its first tokens, as vLLM overlaps output
            # processing with the next step. A request has one token per step, and the deferred
            # batch runs before any later step ends, so each stream's order holds.
            later: list[tuple[TokenSink, TokenOutput]] = []
            for out in core.end_step(plan):
                sink = sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finish_reason is not None:
                    del sinks[out.request_id]
                if out.index:
                    later.append((sink, out))
                    continue
                try:
                    sink(out)
                except Exception:
                    _delivery_failed(out)
            if later:
                asyncio.get_running_loop().call_soon(_deliver_all, later)
            if self.kv_events is not None:
                self.kv_events.publish_raw(core.take_kv_events())  # type: ignore[attr-defined]
        except BaseException as exc:
            ended.set_exception(exc)  # the step loop dies with it, and says so
            return
        ended.set_result(None)


def _deliver(sink: TokenSink, out: TokenOutput) -> None:
    try:
        sink(out)
    except Exception:
        _delivery_failed(out)


def _deliver_all(batch: list[tuple[TokenSink, TokenOutput]]) -> None:
    # the step loop's hottest path: one call per token, nothing else (a try costs nothing until it catches)
    for sink, out in batch:
        try:
            sink(out)
        except Exception:
            _delivery_failed(out)


def _delivery_failed(out: TokenOutput) -> None:
    # one broken stream must not stop the engine; its handler cleans up
    log.exception("token delivery to request %s failed", out.request_id)
