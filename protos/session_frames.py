"""The Session's messages framed on a plain TCP socket: the scheduler's fast path for its gateways.

The same SessionRequest / SessionResponse messages as the gRPC Session stream (scheduler.proto),
each as a 4-byte big-endian length and the serialized message. The server speaks first: `HELLO`,
so a gateway pointed at the wrong port fails at once instead of waiting out a deadline. Nothing
else is on the wire: no HTTP/2, no gRPC poller thread, one write and one read per message. On
loopback a Schedule then costs about a third of its round trip on the gRPC Session (see the README).
"""

from __future__ import annotations

import struct

HELLO = b"pilotfish-session/1\n"
# Trailing metadata of a unary Schedule the scheduler refused itself (no engine eligible, a bad
# request): the gateway answers the client with it, where a transport failure would fall back.
ANSWERED_KEY = "pilotfish-answered"
MAX_FRAME_BYTES = 4 * 1024 * 1024  # gRPC's default message limit, the same bound as the gRPC Session
_LENGTH = struct.Struct("!I")


class FrameError(ValueError):
    """The peer broke the framing: the connection is closed, nothing else is harmed."""


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Bytes in as they arrive, whole payloads out; a frame over MAX_FRAME_BYTES raises FrameError."""

    __slots__ = ("_buffer", "_limit")

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        payloads: list[bytes] = []
        start, size = 0, len(buffer)
        while size - start >= 4:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > self._limit:
                raise FrameError(f"a frame of {length} bytes is over the {self._limit}-byte limit")
            end = start + 4 + length
            if end > size:
                break
            payloads.append(bytes(buffer[start + 4 : end]))
            start = end
        if start:
            del buffer[:start]
        return payloads

    @property
    def buffered(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buffer)
