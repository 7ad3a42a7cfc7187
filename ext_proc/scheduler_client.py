"""The remote scheduler over gRPC: Schedule with a deadline, Reports batched, Releases off the hot path.

All three ride one Session stream (scheduler.proto): a message on an open stream costs about half
a unary call's latency and CPU on loopback. A scheduler without Session (UNIMPLEMENTED) gets
unary calls from then on. A broken stream fails the schedules waiting on it (the router falls
back) and the next call opens a new one.

With --scheduler-session-address the same messages go over the scheduler's plain Session socket
(scheduler --session-port) instead of the gRPC stream: no HTTP/2 and no grpc poller thread, about
a third of the gRPC Session's round trip. Reports and releases fall back to unary gRPC while it is
down, as they do from the gRPC stream.

Security (pilotfish/security.py, the gateway's --tls-* and --auth-token-file): the channel and the
socket dial TLS when the gateway has a certificate or a CA, and every call carries the token
(gRPC metadata `authorization: Bearer`; on the socket, the first frame after the scheduler's HELLO).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import grpc
from google.protobuf.message import DecodeError

from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, Decision, SchedulerUnavailable
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.protos.session_frames import ANSWERED_KEY, HELLO, FrameError, FrameReader, frame

if TYPE_CHECKING:
    from pilotfish.security import Security

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 1.0  # how long a closing Session waits for the scheduler to read what was written

# Scheduler answers passed on to the client, never routed around: the request's fault, or the
# scheduler's verdict that no engine can take it now (UNAVAILABLE: 503, not a fallback pick).
_ANSWERS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _NoSession(Exception):
    """The scheduler does not implement Session."""


def _failure(code: grpc.StatusCode, details: str, answered: bool) -> Exception:
    """What a failed Schedule raises: the scheduler's own answer passed on to the client, or, for
    a transport failure or a scheduler bug, SchedulerUnavailable (the router falls back)."""
    if answered and (status := _ANSWERS.get(code)) is not None:
        return RequestError(status, details or code.name, retry_after=1 if status in (429, 503) else 0)
    return SchedulerUnavailable(f"{code.name}: {details}")


def _rpc_failure(exc: grpc.aio.AioRpcError) -> Exception:
    """A unary Schedule's error: the scheduler's answer only when its trailer says so; an
    UNAVAILABLE from a dead channel must fall back, not reach the client."""
    code = exc.code()
    answered = code != grpc.StatusCode.UNAVAILABLE or any(
        key == ANSWERED_KEY for key, _ in exc.trailing_metadata() or ()
    )
    return _failure(code, exc.details() or "", answered)


def _decision(reply: scheduler_pb2.ScheduleResponse) -> Decision:
    target, fallbacks = reply.target, tuple(f.address for f in reply.fallbacks)
    if reply.HasField("decode_target"):
        decode = reply.decode_target
        return Decision(target.instance_id, target.address, SCHEDULER, fallbacks, decode.address, decode.instance_id)
    return Decision(target.instance_id, target.address, SCHEDULER, fallbacks)


def _extend(deadline: asyncio.Timeout, hold_ms: int, timeout: float) -> Callable[[int], None]:
    """What a queued notice does to a schedule's deadline: the scheduler's wait (at most what this
    gateway allowed), plus one Schedule deadline for the answer to come."""

    def extend(wait_ms: int) -> None:
        deadline.reschedule(asyncio.get_running_loop().time() + min(wait_ms, hold_ms) / 1000 + timeout)

    return extend


class _SessionBase:
    """What every Session transport shares: seq numbers, each schedule's waiter, and the end that
    fails them all. A subclass sends; its reader hands replies to `_deliver` and calls `_end`."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[scheduler_pb2.SessionResponse]] = {}
        # flow control: a schedule the scheduler acknowledged as queued gets its wait as its deadline
        self._queued: dict[int, Callable[[int], None]] = {}
        self.ended: Exception | None = None  # why the session is over; then the owner opens another
        self._up: asyncio.Future[None] = loop.create_future()  # the scheduler answered

    @property
    def up(self) -> bool:
        """The scheduler answered the session, and it has not ended."""
        return self._up.done() and self.ended is None

    async def schedule(self, request: scheduler_pb2.ScheduleRequest, timeout: float) -> Decision:
        seq = next(self._seq)
        waiter: asyncio.Future[scheduler_pb2.SessionResponse] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = waiter
        try:
            async with asyncio.timeout(timeout) as deadline:
                if request.queue_timeout_ms:
                    self._queued[seq] = _extend(deadline, request.queue_timeout_ms, timeout)
                await self.send(scheduler_pb2.SessionRequest(seq=seq, schedule=request))
                reply = await waiter
        except TimeoutError:
            raise SchedulerUnavailable("DEADLINE_EXCEEDED: no Schedule reply in time") from None
        finally:
            self._waiting.pop(seq, None)  # a late reply then finds no waiter and is dropped
            self._queued.pop(seq, None)
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # the session's end may have failed it after `send` raised: seen
        if reply.WhichOneof("kind") == "error":
            raise _failure(_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN), reply.error.message, answered=True)
        return _decision(reply.schedule)

    async def send(self, message: scheduler_pb2.SessionRequest) -> None:
        raise NotImplementedError

    async def _wait_up(self) -> None:
        if not self._up.done():
            await asyncio.shield(self._up)  # shared by every caller: one caller's deadline must not cancel it
        if self.ended is not None:
            raise self.ended

    def _deliver(self, reply: scheduler_pb2.SessionResponse) -> None:
        if reply.WhichOneof("kind") == "queued":  # the answer follows within the wait it names
            extend = self._queued.pop(reply.seq, None)
            if extend is not None:
                extend(reply.queued.wait_ms)
            return
        waiter = self._waiting.pop(reply.seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    def _end(self, reason: Exception) -> Exception:
        """Mark the session over and fail what waits on it; returns what a caller should raise."""
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


class _Session(_SessionBase):
    """One gRPC Session stream: messages written in order (one write at a time, as grpc requires),
    each schedule's reply matched to its waiter by seq.

    The scheduler's Session sends its headers first, and nothing is written before they come: a
    scheduler without Session then ends the call with UNIMPLEMENTED, which a failed write would
    have hidden behind a generic error.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, metadata: tuple[tuple[str, str], ...] | None) -> None:
        super().__init__()
        self._call = stub.Session(metadata=metadata)
        self._lock = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._run())

    async def send(self, message: scheduler_pb2.SessionRequest) -> None:
        await self._wait_up()
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
                self._deliver(reply)
        except asyncio.CancelledError:
            reason = SchedulerUnavailable("session closed")
            raise
        except grpc.aio.AioRpcError as exc:  # a stream's end is never one request's fault
            reason = SchedulerUnavailable(f"{exc.code().name}: {exc.details()}")
        finally:
            self._end(reason)

    async def close(self) -> None:
        """Half-close, so the scheduler reads every message written (a report or release written
        just before would otherwise race the cancel and be lost), wait a moment for it to end
        the call, then cancel whatever is left."""
        if self.up:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    async with self._lock:  # after any write in progress
                        await self._call.done_writing()
                    await asyncio.shield(self._reader)  # the scheduler's end of the call: EOF
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class _SocketSession(_SessionBase, asyncio.Protocol):
    """The Session on the scheduler's plain TCP socket (scheduler --session-port; framing in
    protos/session_frames.py). A write is a plain transport write: no lock, no await. The
    session is up once the scheduler's HELLO has come."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        super().__init__()
        self._address = address
        self._frames = FrameReader()
        self._hello = b""
        self._transport: asyncio.Transport | None = None
        self._security = security
        # written right after HELLO, before any message: the scheduler judges the first frame
        self._auth = frame(security.session_auth_frame()) if security is not None and security.token else b""
        host, _, port = address.rpartition(":")
        self._connecting = asyncio.get_running_loop().create_task(self._connect(host.strip("[]"), int(port)))

    async def _connect(self, host: str, port: int) -> None:
        security = self._security
        ssl_context = security.client_ssl_context() if security is not None else None
        tls = {"ssl": ssl_context, "server_hostname": security.server_name or host} if security and ssl_context else {}
        try:
            await asyncio.get_running_loop().create_connection(lambda: self, host, port, **tls)
        except OSError as exc:  # ssl.SSLError included: a refused or wrong certificate
            self._fail(f"cannot connect: {exc.strerror or exc}")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        if self.ended is not None:  # closed while connecting
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._up.done():
            hello = self._hello + data
            if len(hello) < len(HELLO):
                if not HELLO.startswith(hello):
                    self._fail("the peer is not a Pilotfish scheduler's Session socket")
                self._hello = hello
                return
            if not hello.startswith(HELLO):
                self._fail("the peer is not a Pilotfish scheduler's Session socket")
                return
            self._hello = b""
            if self._auth and self._transport is not None:
                self._transport.write(self._auth)
            self._up.set_result(None)
            data = hello[len(HELLO) :]
        try:
            payloads = self._frames.feed(data)
            for payload in payloads:
                self._deliver(scheduler_pb2.SessionResponse.FromString(payload))
        except (FrameError, DecodeError) as exc:
            self._fail(f"bad reply from the scheduler: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._fail("the scheduler closed the session")

    async def send(self, message: scheduler_pb2.SessionRequest) -> None:
        await self._wait_up()
        transport = self._transport
        if transport is None or transport.is_closing():
            raise self._end(SchedulerUnavailable("the session socket is closed"))
        transport.write(frame(message.SerializeToString()))

    def _fail(self, why: str) -> None:
        if self.ended is None:
            level = logging.WARNING if not self._up.done() else logging.INFO
            log.log(level, "scheduler Session socket %s: %s", self._address, why)
        self._end(SchedulerUnavailable(f"Session socket {self._address}: {why}"))
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        self._end(SchedulerUnavailable("session closed"))
        if self._transport is not None:
            self._transport.abort()
        self._connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._connecting


class GrpcScheduler:
    def __init__(
        self,
        address: str,
        schedule_timeout_s: float,
        report_interval_s: float,
        session: bool = True,
        session_address: str = "",
        security: Security | None = None,
    ) -> None:
        self._address = address
        self._session_address = session_address  # the scheduler's Session socket; empty: the gRPC stream
        self._timeout = schedule_timeout_s
        self._report_interval = report_interval_s
        self._security = security
        self._metadata = security.metadata if security is not None else None  # the token on every call
        self._channel = security.aio_channel(address) if security is not None else grpc.aio.insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._session: _Session | _SocketSession | None = None
        self._sessions = session  # False also once the scheduler answers Session with UNIMPLEMENTED
        self._pending_reports: dict[str, scheduler_pb2.TokenReport] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()

    def _open_session(self) -> _Session | _SocketSession | None:
        """The open Session, a new one if the last has ended; None when the scheduler has none."""
        if not self._sessions:
            return None
        session = self._session
        if session is None or session.ended is not None:
            if session is not None and isinstance(session.ended, _NoSession):
                self._sessions = False
                log.warning("the scheduler at %s has no Session stream: unary calls from now on", self._address)
                return None
            if self._session_address:
                session = self._session = _SocketSession(self._session_address, self._security)
            else:
                session = self._session = _Session(self._stub, self._metadata)
        return session

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        session = self._open_session()
        if session is not None:
            try:
                return await session.schedule(request, self._timeout)
            except _NoSession:
                self._open_session()  # notes it: unary from now on, starting with this request
        try:
            # a unary call has no queued notice: the hold it asks for is added to its deadline
            timeout = self._timeout + request.queue_timeout_ms / 1000
            reply = await self._stub.Schedule(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_failure(exc) from None
        return _decision(reply)

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None:
        """Queue a cumulative count; the latest per request wins and goes out in the next batch."""
        pending = self._pending_reports.get(request_id)
        if not served_address and pending is not None:
            served_address = pending.served_address  # a move not yet sent must not be lost
        self._pending_reports[request_id] = scheduler_pb2.TokenReport(
            request_id=request_id,
            generated_tokens=generated_tokens,
            prefill_done=prefill_done,
            served_address=served_address,
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
                await self._stub.Report(report, timeout=self._timeout * 5, metadata=self._metadata)

    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        """Tell the scheduler the request is over (with the answer's length where only the end told it);
        never delays the response path."""
        pending = self._pending_reports.pop(request_id, None)
        # a move not yet sent goes first: the scheduler counts a served-elsewhere request as a
        # failure of the engine it scheduled, and the release as a success of where it is held
        moved = pending if pending is not None and pending.served_address else None
        task = asyncio.get_running_loop().create_task(self._release(request_id, reason, moved, answer_tokens))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(
        self, request_id: str, reason: int, moved: scheduler_pb2.TokenReport | None = None, answer_tokens: int = 0
    ) -> None:
        if moved is not None:
            report = scheduler_pb2.ReportRequest(reports=[moved])
            if not await self._send(scheduler_pb2.SessionRequest(report=report)):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._stub.Report(report, timeout=self._timeout * 5, metadata=self._metadata)
        release = scheduler_pb2.ReleaseRequest(
            request_id=request_id,
            reason=reason,  # type: ignore[arg-type]
            generated_tokens=min(answer_tokens, 0xFFFFFFFF),
        )
        if await self._send(scheduler_pb2.SessionRequest(release=release)):
            return
        try:
            await self._stub.Release(release, timeout=self._timeout * 5, metadata=self._metadata)
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
