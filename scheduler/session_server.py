"""The scheduler's Session on a plain TCP socket (`--session-port`): framing in protos/session_frames.py.

Each connection is one gateway's session, answered by the same code as the gRPC Session stream
(`SchedulerServicer.answerer`), on the loop that owns the core. A peer that breaks the framing or
sends bytes that are not a SessionRequest is logged and disconnected; the scheduler goes on.

Limits (`SocketLimits`, from the scheduler's config; each close counted by reason in
`ListenerStats.session_closed`):
  connection_cap   beyond `max_connections` open connections a new one is closed at once, before HELLO
  frame_too_large  a frame header announcing more than `max_frame_bytes`: closed at the header
  buffer_budget    incomplete frames of all connections together over `max_buffered_bytes`: the
                   connection whose frame would take the total over is closed
  frame_timeout    a frame still incomplete `frame_timeout_s` after its first byte
  idle_timeout     no complete frame for `idle_timeout_s` (a quiet gateway reconnects at its next request)
  malformed        a frame that is not a SessionRequest
  unauthenticated  with a token configured (--auth-token-file), a first frame that is not the token
                   (protos/session_frames.py's auth frame, pilotfish/security.py); also counted in
                   pilotfish_auth_refused_total{listener="scheduler_session"}
With TLS configured the socket serves TLS from the same files as the gRPC port (reloaded when they
change; client certificates required when --tls-ca-file is given); a handshake not done within the
frame timeout is dropped by asyncio.
So the memory slow senders can hold is bounded by `max_buffered_bytes` (plus the kernel's socket
buffers), however many connect. Timeouts are checked by one sweep task, not a timer per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from google.protobuf.message import DecodeError

from pilotfish.protos import scheduler_pb2
from pilotfish.protos.session_frames import HELLO, MAX_FRAME_BYTES, FrameError, FrameReader, frame
from pilotfish.scheduler.limits import ListenerStats

if TYPE_CHECKING:
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.security import Security

log = logging.getLogger(__name__)

Answer = Callable[[scheduler_pb2.SessionRequest], "scheduler_pb2.SessionResponse | None"]
# the answer for one peer (its IP): the rate limits are per peer. The second argument takes the late
# answers of schedules that wait in flow control's queue (scheduler/flow/wire.py); an answer with a
# `close` is closed when its connection goes (its waiting requests leave the queue)
AnswerFor = Callable[[str, Callable[[scheduler_pb2.SessionResponse], None]], Answer]


@dataclass(frozen=True, slots=True)
class SocketLimits:
    max_connections: int = 256
    idle_timeout_s: float = 300.0
    frame_timeout_s: float = 10.0
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_buffered_bytes: int = 64 * 1024 * 1024

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> SocketLimits:
        return cls(
            max_connections=config.session_max_connections,
            idle_timeout_s=config.session_idle_timeout_seconds,
            frame_timeout_s=config.session_frame_timeout_seconds,
            max_frame_bytes=config.max_message_bytes,
            max_buffered_bytes=config.session_max_buffered_bytes,
        )

    @property
    def sweep_interval_s(self) -> float:
        return min(max(min(self.idle_timeout_s, self.frame_timeout_s) / 4, 0.05), 1.0)


class _Connection(asyncio.Protocol):
    def __init__(self, server: SessionSocketServer) -> None:
        self._server = server
        self._answer: Answer | None = None
        self._reader = FrameReader(server.limits.max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._buffered = 0  # bytes of an incomplete frame, counted in the server's total
        self.last_frame = 0.0  # loop time of the last complete frame (or of the connection)
        self.partial_since = 0.0  # loop time the incomplete frame's first byte came; 0: none
        self._loop = server.loop
        # the first frame is judged for the token (pilotfish/security.py) before any message counts
        self._first_frame = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if len(server.connections_set) >= server.limits.max_connections:
            server.stats.session_closed["connection_cap"] += 1
            cap = server.limits.max_connections
            server.note(f"Session socket {self._peer}: {cap} connections open already; closed")
            self._transport = None
            transport.close()
            return
        self.last_frame = self._loop.time()
        server.connections_set.add(self)
        self._answer = server.answer_for(peer[0] if isinstance(peer, tuple) else str(peer), self._deliver)
        transport.write(HELLO)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        reader = self._reader
        try:
            payloads = reader.feed(data)
        except FrameError as exc:
            self._drop("frame_too_large", str(exc))
            return
        server = self._server
        buffered = reader.buffered
        if buffered != self._buffered:
            server.buffered += buffered - self._buffered
            self._buffered = buffered
            if buffered and server.buffered > server.limits.max_buffered_bytes:
                self._drop(
                    "buffer_budget",
                    f"incomplete frames over the {server.limits.max_buffered_bytes}-byte budget of all connections",
                )
                return
        if payloads:
            now = self._loop.time()
            self.last_frame = now
            self.partial_since = now if buffered else 0.0
        elif buffered and not self.partial_since:
            self.partial_since = self._loop.time()
        replies: list[bytes] = []
        answer = self._answer
        assert answer is not None
        for payload in payloads:
            if self._first_frame:
                self._first_frame = False
                security = server.security
                verdict = security.check_session_auth(payload) if security is not None else None
                if verdict is False:
                    if security is not None:
                        security.stats.refuse("scheduler_session", "unauthenticated")
                    self._drop("unauthenticated", "the first frame does not carry the token")
                    return
                if verdict:
                    continue  # the auth frame: consumed
            message = scheduler_pb2.SessionRequest()
            try:
                message.ParseFromString(payload)
            except DecodeError:
                self._drop("malformed", f"a frame of {len(payload)} bytes is not a SessionRequest")
                return
            reply = answer(message)
            if reply is not None:
                replies.append(frame(reply.SerializeToString()))
        if replies:
            transport.write(b"".join(replies))

    def _drop(self, reason: str, why: str) -> None:
        self._server.stats.session_closed[reason] += 1
        log.warning("Session socket %s: %s; disconnected", self._peer, why)
        if self._transport is not None:
            self._transport.abort()
        self._forget_buffer()

    def timed_out(self, reason: str, why: str) -> None:
        """Closed by the sweep: an idle gateway gets a clean end of stream, a slow frame a reset."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._server.stats.session_closed[reason] += 1
        self._server.note(f"Session socket {self._peer}: {why}; closed")
        if reason == "idle_timeout":
            transport.close()
        else:
            transport.abort()
        self._forget_buffer()

    def _forget_buffer(self) -> None:
        if self._buffered:
            self._server.buffered -= self._buffered
            self._buffered = 0
        self._reader = FrameReader(self._server.limits.max_frame_bytes)  # its bytes go now, not at the close

    # a gateway that stops reading must not make the scheduler buffer without bound
    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _deliver(self, reply: scheduler_pb2.SessionResponse) -> None:
        """A late answer (a schedule that waited in flow control's queue)."""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(frame(reply.SerializeToString()))

    def connection_lost(self, exc: Exception | None) -> None:
        close = getattr(self._answer, "close", None)
        if close is not None:
            close()
        self._server.connections_set.discard(self)
        self._forget_buffer()
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class SessionSocketServer:
    """Listens on host:port; `close()` ends every session, so gateways fall back at once."""

    def __init__(
        self,
        answer_for: AnswerFor,
        limits: SocketLimits | None = None,
        stats: ListenerStats | None = None,
        security: Security | None = None,
    ) -> None:
        self.answer_for = answer_for
        self.security = security
        self.limits = limits or SocketLimits()
        self.stats = stats or ListenerStats()
        self.stats.session_connections = lambda: len(self.connections_set)
        self.connections_set: set[_Connection] = set()
        self.buffered = 0  # bytes of incomplete frames, all connections
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop = cast(asyncio.AbstractEventLoop, None)
        self._last_note = -1e9
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self.loop = loop = asyncio.get_running_loop()
        security = self.security
        ssl_context = security.server_ssl_context() if security is not None else None
        tls = {"ssl": ssl_context, "ssl_handshake_timeout": self.limits.frame_timeout_s} if ssl_context else {}
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = loop.create_task(self._sweep(), name="scheduler-session-sweep")
        return self.port

    def note(self, message: str) -> None:
        """A refusal's log line: WARNING at most once a minute (a flood must not flood the log)."""
        now = self.loop.time()
        if now - self._last_note >= 60.0:
            self._last_note = now
            log.warning("%s (further such closes this minute at DEBUG; counted in the metrics)", message)
        else:
            log.debug("%s", message)

    async def _sweep(self) -> None:
        limits = self.limits
        while True:
            await asyncio.sleep(limits.sweep_interval_s)
            now = self.loop.time()
            for conn in list(self.connections_set):
                if conn.partial_since:
                    # a frame under way is bounded by its own timeout, never called idle: a sweep between the
                    # connection's start and its first bytes being read (a loaded machine) closed it as idle
                    if now - conn.partial_since > limits.frame_timeout_s:
                        conn.timed_out("frame_timeout", f"a frame incomplete for over {limits.frame_timeout_s:g} s")
                elif now - conn.last_frame > limits.idle_timeout_s:
                    conn.timed_out("idle_timeout", f"no complete frame for {limits.idle_timeout_s:g} s")

    @property
    def connections(self) -> int:
        return len(self.connections_set)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        server.close()
        for connection in list(self.connections_set):
            connection.close()
        await server.wait_closed()
