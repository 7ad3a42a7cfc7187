"""A gRPC server on `pilotfish.h2`, run in the asyncio loop's own thread.

It serves the few methods a Pilotfish process registers, each a handler of grpc.aio's shape
(`handler(request or request iterator, context)`; the context is None), so one servicer class runs
on this server or on grpc.aio alike. What a gRPC server owes its clients is kept:
- messages are length-prefixed, at most `max_message_bytes` (RESOURCE_EXHAUSTED past it, checked
  before anything is buffered), uncompressed (UNIMPLEMENTED otherwise);
- every call but health's carries the bearer token when one is configured (UNAUTHENTICATED, and
  the refusal counted, otherwise); TLS with ALPN h2 when the listener has a certificate;
- an unknown method gets UNIMPLEMENTED, a handler's `GrpcError` its status, any other exception
  UNKNOWN (logged here, never sent);
- a stream the peer resets, or a connection that drops, cancels its handler: the handler's
  `finally` runs, as under grpc.aio;
- `stop` sends GOAWAY, lets open calls finish within the grace, then cancels the rest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from pilotfish.h2 import H2Connection, H2Limits, H2Stream, encode_headers

log = logging.getLogger(__name__)

OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND = 0, 1, 2, 3, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAUTHENTICATED = 8, 12, 13, 16

RESPONSE_HEADERS = encode_headers([(":status", "200"), ("content-type", "application/grpc")])
OK_TRAILERS = encode_headers([("grpc-status", "0")])


class Kind(enum.Enum):
    UNARY = "unary"
    CLIENT_STREAM = "client_stream"
    SERVER_STREAM = "server_stream"
    BIDI = "bidi"


class GrpcError(Exception):
    """Raised by a handler: the call ends with this status and message."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Method:
    request_type: type[Message]
    kind: Kind
    handler: Callable[..., Any]


def _grpc_message(text: str, limit: int = 1024) -> str:
    """grpc-message's percent-encoding: printable ASCII but '%' as is, the rest of the UTF-8 bytes %XX;
    at most `limit` characters, cut at a whole character (a split escape or UTF-8 sequence makes a
    client decode the whole message as Latin-1)."""
    out: list[str] = []
    size = 0
    for char in text:
        raw = char.encode(errors="replace")
        part = char if len(raw) == 1 and 0x20 <= raw[0] <= 0x7E and char != "%" else "".join(f"%{b:02X}" for b in raw)
        size += len(part)
        if size > limit:
            break
        out.append(part)
    return "".join(out)


def trailers(code: int, message: str = "", *, headers_sent: bool) -> bytes:
    fields = [] if headers_sent else [(":status", "200"), ("content-type", "application/grpc")]
    fields.append(("grpc-status", str(code)))
    if message:
        fields.append(("grpc-message", _grpc_message(message)))
    return encode_headers(fields)


class _Call:
    """One RPC: gRPC messages cut from the stream's data, handed to the handler; its replies written."""

    __slots__ = (
        "_buf",
        "_ended",
        "_finished",
        "_headers_sent",
        "_queue",
        "_task",
        "_waiter",
        "method",
        "server",
        "stream",
    )

    def __init__(self, server: LoopGrpcServer, stream: H2Stream, method: Method) -> None:
        self.server = server
        self.stream = stream
        self.method = method
        self._buf = bytearray()
        self._queue: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the peer half-closed
        self._finished = False  # trailers sent (or the stream reset): nothing more goes out
        self._headers_sent = False
        self._task: asyncio.Task[None] | None = None

    # -- StreamReceiver: called by the connection --

    def data(self, payload: bytes) -> None:
        if self._finished:
            return  # the call is over; what the peer still sends is dropped
        buf = self._buf
        buf += payload
        limit = self.server.max_message_bytes
        # the trailers are the answer; once they are out (behind replies still waiting for window)
        # the connection stops the rest of the request with RST_STREAM(NO_ERROR); any other code
        # would make a client report its own status over the trailers'
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if buf[0]:
                self.server.refused("compressed_message")
                self._fail_now(UNIMPLEMENTED, "compressed messages are not supported")
                return
            if size > limit:
                self.server.refused("message_too_large")
                self._fail_now(RESOURCE_EXHAUSTED, f"received message larger than max ({size} vs. {limit})")
                return
            if len(buf) < 5 + size:
                break
            self._queue.append(bytes(buf[5 : 5 + size]))
            self.stream.unread += 5 + size
            del buf[: 5 + size]
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def reset(self, code: int) -> None:
        self._finished = True
        self._wake()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail_now(self, code: int, message: str) -> None:
        self._buf.clear()  # what came of the refused message is dropped, as is all that follows
        self._finish(code, message)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # -- the handler's side --

    async def _next(self) -> Message | None:
        """The next request message; None once the peer half-closed."""
        queue = self._queue
        while not queue:
            if self._ended or self._finished:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        raw = queue.popleft()
        self.stream.consumed(5 + len(raw))
        try:
            return self.method.request_type.FromString(raw)
        except DecodeError:  # the peer's fault, not ours: counted, as the server's other refusals are
            self.server.refused("malformed")
            raise GrpcError(INVALID_ARGUMENT, "the request message is not a valid protobuf") from None

    async def _requests(self) -> AsyncIterator[Message]:
        while (message := await self._next()) is not None:
            yield message

    async def _single(self) -> Message:
        message = await self._next()
        if message is None:
            raise GrpcError(UNIMPLEMENTED, "a unary call without its request message")
        return message

    def _send(self, reply: Message) -> None:
        if self._finished:
            return
        body = reply.SerializeToString()
        if not self._headers_sent:
            self._headers_sent = True
            self.stream.send_headers(RESPONSE_HEADERS)
        self.stream.send_data(b"\0" + len(body).to_bytes(4, "big") + body)

    def _finish(self, code: int, message: str = "") -> None:
        if self._finished:
            return
        self._finished = True
        # a read the handler left pending ends now, as at the request's end: the peer is told to
        # stop sending (RST_STREAM(NO_ERROR)), so no message would ever wake it
        self._wake()
        if code == OK and self._headers_sent:
            self.stream.send_trailers(OK_TRAILERS)
        else:
            self.stream.send_trailers(trailers(code, message, headers_sent=self._headers_sent))

    async def run(self) -> None:
        method, code, text = self.method, OK, ""
        try:
            kind = method.kind
            if kind is Kind.BIDI:
                async for reply in method.handler(self._requests(), None):
                    self._send(reply)
            elif kind is Kind.CLIENT_STREAM:
                self._send(await method.handler(self._requests(), None))
            elif kind is Kind.SERVER_STREAM:
                async for reply in method.handler(await self._single(), None):
                    self._send(reply)
            else:
                self._send(await method.handler(await self._single(), None))
        except GrpcError as exc:
            code, text = exc.code, exc.message
        except asyncio.CancelledError:
            if self._finished:  # reset by the peer, or failed on receipt: nothing more to say
                return
            code, text = CANCELLED, "the server is stopping"
        except Exception:
            log.exception("gRPC handler %s failed", self.stream.headers.get(":path"))
            code, text = UNKNOWN, "internal error"
        self._finish(code, text)


class HealthService:
    """grpc.health.v1 on the loop server: `set` as grpc.aio's HealthServicer has it; Check and Watch."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed: dict[str, asyncio.Event] = {}

    async def set(self, service: str, status: int) -> None:
        self._status[service] = status
        event = self._changed.pop(service, None)
        if event is not None:
            event.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            raise GrpcError(NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        service, last = request.service, None
        while True:
            status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            event = self._changed.get(service)
            if event is None:
                event = self._changed[service] = asyncio.Event()
            await event.wait()

    def add_to(self, server: LoopGrpcServer) -> None:
        server.add_method("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, Kind.UNARY, self.Check)
        server.add_method("/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest, Kind.SERVER_STREAM, self.Watch)


class LoopGrpcServer:
    """The methods, the listener and its connections. `authorize(method, authorization)` decides
    each call; `on_unauthenticated(peer, method)` hears of each call it turns away."""

    def __init__(
        self,
        *,
        max_message_bytes: int = 4 << 20,
        authorize: Callable[[str, str | None], bool] | None = None,
        on_unauthenticated: Callable[[str, str], None] | None = None,
        limits: H2Limits | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.limits = limits or H2Limits()
        self._authorize = authorize
        self._on_unauthenticated = on_unauthenticated
        self._methods: dict[str, Method] = {}
        # what this server refused, by reason: HTTP/2 error codes' names (h2.ERROR_NAMES) and the gRPC
        # layer's (message_too_large, compressed_message, unknown_method, not_grpc, unauthenticated)
        self.refusals: collections.Counter[str] = collections.Counter()
        self._connections: set[H2Connection] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    def add_method(self, path: str, request_type: type[Message], kind: Kind, handler: Callable[..., Any]) -> None:
        self._methods[path] = Method(request_type, kind, handler)

    # -- H2App --

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1

    def open(self, stream: H2Stream) -> _Call | None:
        headers = stream.headers
        if headers.get(":method") != "POST":
            self.refused("not_grpc")
            stream.send_headers(encode_headers([(":status", "405")]), end_stream=True)
            return None
        if not headers.get("content-type", "").startswith("application/grpc"):
            self.refused("not_grpc")
            stream.send_headers(encode_headers([(":status", "415")]), end_stream=True)
            return None
        path = headers.get(":path", "")
        method = self._methods.get(path)
        if method is None:
            self.refused("unknown_method")
            stream.send_headers(trailers(UNIMPLEMENTED, f"unknown method {path[:200]}", headers_sent=False), True)
            return None
        if self._authorize is not None and not self._authorize(path, headers.get("authorization")):
            self.refused("unauthenticated")
            if self._on_unauthenticated is not None:
                transport = stream.conn.transport
                peer = transport.get_extra_info("peername") if transport is not None else None
                self._on_unauthenticated(str(peer), path)
            stream.send_headers(trailers(UNAUTHENTICATED, "missing or wrong bearer token", headers_sent=False), True)
            return None
        call = _Call(self, stream, method)
        task = call._task = asyncio.get_running_loop().create_task(call.run())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return call

    # -- the listener --

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        loop = asyncio.get_running_loop()

        def connection() -> H2Connection:
            conn = H2Connection(self, self.limits, on_close=self._connections.discard)
            if len(self._connections) >= self.limits.max_connections:
                conn.refused = True  # told GOAWAY and closed at once, never counted
                log.warning("gRPC connection refused: %d open, the limit", len(self._connections))
            else:
                self._connections.add(conn)
            return conn

        self._server = await loop.create_server(connection, host.strip("[]"), port, ssl=ssl_context)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float = 2.0) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.go_away()
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=grace)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=1.0)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
