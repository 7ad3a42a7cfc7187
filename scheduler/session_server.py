"""The scheduler's Session on a plain TCP socket (`--session-port`): framing in protos/session_frames.py.

Each connection is one gateway's session, answered by the same code as the gRPC Session stream
(`SchedulerServicer.answer`), on the loop that owns the core. A peer that breaks the framing or
sends bytes that are not a SessionRequest is logged and disconnected; the scheduler goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from google.protobuf.message import DecodeError

from pilotfish.protos import scheduler_pb2
from pilotfish.protos.session_frames import HELLO, FrameError, FrameReader, frame

log = logging.getLogger(__name__)

Answer = Callable[[scheduler_pb2.SessionRequest], "scheduler_pb2.SessionResponse | None"]


class _Connection(asyncio.Protocol):
    def __init__(self, answer: Answer, open_connections: set[_Connection]) -> None:
        self._answer = answer
        self._open = open_connections
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._open.add(self)
        transport.write(HELLO)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        try:
            payloads = self._reader.feed(data)
        except FrameError as exc:
            self._drop(str(exc))
            return
        replies: list[bytes] = []
        answer = self._answer
        for payload in payloads:
            message = scheduler_pb2.SessionRequest()
            try:
                message.ParseFromString(payload)
            except DecodeError:
                self._drop(f"a frame of {len(payload)} bytes is not a SessionRequest")
                return
            reply = answer(message)
            if reply is not None:
                replies.append(frame(reply.SerializeToString()))
        if replies:
            transport.write(b"".join(replies))

    def _drop(self, why: str) -> None:
        log.warning("Session socket %s: %s; disconnected", self._peer, why)
        if self._transport is not None:
            self._transport.abort()

    # a gateway that stops reading must not make the scheduler buffer without bound
    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.discard(self)
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class SessionSocketServer:
    """Listens on host:port; `close()` ends every session, so gateways fall back at once."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self._answer, self._connections), host, port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in list(self._connections):
            connection.close()
        await server.wait_closed()
