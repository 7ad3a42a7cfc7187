"""The remote scheduler over gRPC: Schedule with a deadline, Reports batched, Releases off the hot path.

All three ride one Session stream (scheduler.proto): a message on an open stream costs about half
a unary call's latency and CPU on loopback. A scheduler without Session (UNIMPLEMENTED) gets
unary calls from then on. A broken stream fails the schedules waiting on it (the router falls
back) and the next call opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc

from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, Decision, SchedulerUnavailable
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

# Scheduler answers that are the client's fault, not the scheduler's: passed on, never retried.
_CLIENT_ERRORS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _NoSession(Exception):
    """The scheduler does not implement Session."""


def _failure(code: grpc.StatusCode, details: str) -> Exception:
    """What a failed Schedule raises: the client's error passed on, or the scheduler unavailable."""
    if (status := _CLIENT_ERRORS.get(code)) is not None:
        return RequestError(status, details or code.name)
    return SchedulerUnavailable(f"{code.name}: {details}")


def _decision(reply: scheduler_pb2.ScheduleResponse) -> Decision:
    target = reply.target
    return Decision(target.instance_id, target.address, SCHEDULER, tuple(f.address for f in reply.fallbacks))


class _Session:
    """One Session stream: messages written in order (one write at a time, as grpc requires), each
    schedule's reply matched to its waiter by seq.

    The scheduler's Session sends its headers first, and nothing is written before they come: a
    scheduler without Session then ends the call with UNIMPLEMENTED, which a failed write would
    have hidden behind a generic error.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        loop = asyncio.get_running_loop()
        self._call = stub.Session()
        self._lock = asyncio.Lock()
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[scheduler_pb2.SessionResponse]] = {}
        self.ended: Exception | None = None  # why the stream is over; then the owner opens another
        self._up: asyncio.Future[None] = loop.create_future()  # the scheduler's headers came
        self._reader = loop.create_task(self._run())

    @property
    def up(self) -> bool:
        """The scheduler answered the stream, and it has not ended."""
        return self._up.done() and self.ended is None

    async def schedule(self, request: scheduler_pb2.ScheduleRequest, timeout: float) -> Decision:
        seq = next(self._seq)
        waiter: asyncio.Future[scheduler_pb2.SessionResponse] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = waiter
        try:
            async with asyncio.timeout(timeout):
                await self.send(scheduler_pb2.SessionRequest(seq=seq, schedule=request))
                reply = await waiter
        except TimeoutError:
            raise SchedulerUnavailable("DEADLINE_EXCEEDED: no Schedule reply in time") from None
        finally:
            self._waiting.pop(seq, None)  # a late reply then finds no waiter and is dropped
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # the stream's end may have failed it after `send` raised: seen
        if reply.WhichOneof("kind") == "error":
            raise _failure(_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN), reply.error.message)
        return _decision(reply.schedule)

    async def send(self, message: scheduler_pb2.SessionRequest) -> None:
        if not self._up.done():
            await asyncio.shield(self._up)  # shared by every caller: one caller's deadline must not cancel it
        if self.ended is not None:
            raise self.ended
        async with self._lock:
            try:
                await self._call.write(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # AioRpcError, or InvalidStateError when the call is over
                raise self._end(SchedulerUnavailable(f"session write failed: {exc!r}")) from None

    async def _run(self) -> None:
        call = self._call
        reason: Exception = SchedulerUnavailable("the scheduler ended the session")
        try:
            await call.initial_metadata()
            if call.done():  # ended before it began: the status says why
                code = await call.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    reason = _NoSession()
                else:
                    reason = SchedulerUnavailable(f"{code.name}: {await call.details()}")
                return
            self._up.set_result(None)
            while (reply := await call.read()) is not grpc.aio.EOF:
                waiter = self._waiting.pop(reply.seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)
        except asyncio.CancelledError:
            reason = SchedulerUnavailable("session closed")
            raise
        except grpc.aio.AioRpcError as exc:  # a stream's end is never one request's fault
            reason = SchedulerUnavailable(f"{exc.code().name}: {exc.details()}")
        finally:
            self._end(reason)

    def _end(self, reason: Exception) -> Exception:
        """Mark the stream over and fail what waits on it; returns what a caller should raise."""
        if self.ended is None:
            self.ended = reason
            if not self._up.done():
                self._up.set_exception(type(reason)(*reason.args))
                self._up.exception()  # nobody may be waiting: no "never retrieved" warning
            waiting, self._waiting = self._waiting, {}
            for waiter in waiting.values():
                if not waiter.done():
                    waiter.set_exception(type(reason)(*reason.args))
        return self.ended

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class GrpcScheduler:
    def __init__(self, address: str, schedule_timeout_s: float, report_interval_s: float, session: bool = True) -> None:
        self._address = address
        self._timeout = schedule_timeout_s
        self._report_interval = report_interval_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._session: _Session | None = None
        self._sessions = session  # False also once the scheduler answers Session with UNIMPLEMENTED
        self._pending_reports: dict[str, scheduler_pb2.TokenReport] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()

    def _open_session(self) -> _Session | None:
        """The open Session stream, a new one if the last has ended; None when the scheduler has none."""
        if not self._sessions:
            return None
        session = self._session
        if session is None or session.ended is not None:
            if session is not None and isinstance(session.ended, _NoSession):
                self._sessions = False
                log.warning("the scheduler at %s has no Session stream: unary calls from now on", self._address)
                return None
            session = self._session = _Session(self._stub)
        return session

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        session = self._open_session()
        if session is not None:
            try:
                return await session.schedule(request, self._timeout)
            except _NoSession:
                self._open_session()  # notes it: unary from now on, starting with this request
        try:
            reply = await self._stub.Schedule(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc.code(), exc.details() or "") from None
        return _decision(reply)

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool) -> None:
        """Queue a cumulative count; the latest per request wins and goes out in the next batch."""
        self._pending_reports[request_id] = scheduler_pb2.TokenReport(
            request_id=request_id, generated_tokens=generated_tokens, prefill_done=prefill_done
        )
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._report_interval)
        batch, self._pending_reports = list(self._pending_reports.values()), {}
        if batch:
            report = scheduler_pb2.ReportRequest(reports=batch)
            if await self._send(scheduler_pb2.SessionRequest(report=report)):
                return
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Report(report, timeout=self._timeout * 5)

    def release(self, request_id: str, reason: int) -> None:
        """Tell the scheduler the request is over; never delays the response path."""
        self._pending_reports.pop(request_id, None)
        task = asyncio.get_running_loop().create_task(self._release(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, request_id: str, reason: int) -> None:
        release = scheduler_pb2.ReleaseRequest(request_id=request_id, reason=reason)  # type: ignore[arg-type]
        if await self._send(scheduler_pb2.SessionRequest(release=release)):
            return
        try:
            await self._stub.Release(release, timeout=self._timeout * 5)
        except grpc.aio.AioRpcError as exc:
            # The scheduler's staleness expiry reclaims what a lost Release leaves behind.
            log.debug("Release %s failed: %s", request_id, exc.code().name)

    async def _send(self, message: scheduler_pb2.SessionRequest) -> bool:
        """Send on the Session; False when the unary call should go instead: no Session known to work
        (one opens with the next schedule), or the write failed."""
        session = self._session
        if session is None or not session.up:
            return False
        try:
            await session.send(message)
        except (SchedulerUnavailable, _NoSession):
            return False
        return True

    def instance_added(self, instance: object) -> None:
        """The remote scheduler discovers instances itself."""

    def instance_removed(self, instance_id: str) -> None:
        """The remote scheduler discovers instances itself."""

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        await self._channel.close()
