"""An HTTP/2 server connection in the asyncio loop's own thread: framing, HPACK and flow control.

Why not grpc.aio: it hands every event of a stream between grpc core's threads and the loop, about
40 context switches and 1.1 ms of CPU for an ext_proc stream of two messages, more than the
processor's own work. Here a stream's frames are parsed and answered in the thread that runs the
handler, so a stream costs a handful of wake-ups.

Scope: what a gRPC server behind Envoy needs (RFC 9113, HPACK RFC 7541), cleartext with prior
knowledge or TLS with ALPN h2. No server push, no upgrade from HTTP/1.1; priorities are parsed and
ignored. The peer is bounded everywhere: frame and header-list sizes, concurrent streams, both
flow-control windows, and the bytes waiting to be written. A protocol error closes the connection
with GOAWAY; a stream's error resets that stream only.

The application sees streams (`H2Stream`): it is told of a new stream's headers (`H2App.open`),
then gets its data, end and reset through the `StreamReceiver` it attached, and answers with
`send_headers`, `send_data` and `send_trailers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hpack import Decoder
from hpack.exceptions import HPACKError

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# settings (section 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
_HEADER = struct.Struct(">BHBBI")  # length as 1 + 2 bytes, type, flags, stream id


@dataclass(frozen=True)
class H2Limits:
    """What one connection lets its peer hold; the defaults suit one Envoy talking to one ext_proc."""

    # streams open at once; Envoy opens another connection past it (one stream per request in flight)
    max_concurrent_streams: int = 4096
    # receive window per stream, advertised; a stream's data past it waits for its handler to read
    stream_window: int = 1 << 20
    # receive window for the whole connection, opened at the start
    connection_window: int = 16 << 20
    # largest frame accepted (advertised): a 4 MiB body arrives in 16 frames, not 256
    max_frame_size: int = 256 << 10
    # decoded header list, advertised and enforced (HPACK counts 32 bytes per field)
    max_header_list_size: int = 64 << 10
    # complete messages a stream may queue unread before its window stops opening
    stream_queue_bytes: int = 1 << 20
    # bytes written but not yet taken by the socket before the peer counts as not reading
    max_write_buffer: int = 32 << 20
    # a connection that sends no preface within this many seconds is closed
    preface_timeout_s: float = 10.0
    # connections open at once to one server; past it a new one is told GOAWAY and closed (a gateway
    # keeps a few; a peer opening thousands is not one)
    max_connections: int = 1024


class H2ProtocolError(Exception):
    """A protocol error that ends the connection with GOAWAY(code)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class StreamReceiver(Protocol):
    """What the application attaches to a stream to receive it."""

    def data(self, payload: bytes) -> None: ...  # a stream's DATA, padding removed

    def end(self) -> None: ...  # the peer half-closed (END_STREAM)

    def reset(self, code: int) -> None: ...  # RST_STREAM received, or the connection is gone


class H2App(Protocol):
    def open(self, stream: H2Stream) -> StreamReceiver | None:
        """A stream's request headers arrived (`stream.headers`); None: the app answered already."""
        ...

    def refused(self, reason: str) -> None:
        """This side refused something of the peer's (`reason`: an error code's name, lower case):
        a connection ended with GOAWAY, or a stream reset or refused."""
        ...


ERROR_NAMES = {
    NO_ERROR: "no_error",
    PROTOCOL_ERROR: "protocol_error",
    INTERNAL_ERROR: "internal_error",
    FLOW_CONTROL_ERROR: "flow_control_error",
    STREAM_CLOSED: "stream_closed",
    FRAME_SIZE_ERROR: "frame_size_error",
    REFUSED_STREAM: "refused_stream",
    CANCEL: "cancel",
    COMPRESSION_ERROR: "compression_error",
    ENHANCE_YOUR_CALM: "enhance_your_calm",
}


class H2Stream:
    """One stream: its request headers, its windows, and what waits for window to be sent."""

    __slots__ = (
        "conn",
        "headers",
        "id",
        "local_closed",
        "pending",
        "receiver",
        "recv_window",
        "remote_closed",
        "send_window",
        "unacked",
        "unread",
    )

    def __init__(self, conn: H2Connection, stream_id: int, headers: dict[str, str]) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers = headers
        self.receiver: StreamReceiver | None = None
        self.send_window = conn.peer_initial_window
        self.recv_window = conn.limits.stream_window
        self.unacked = 0  # bytes received and not yet given back as window
        self.unread = 0  # bytes of complete messages the handler has not taken yet
        self.pending: deque[tuple[bytes, bool, bool]] = deque()  # (payload, is_headers, end_stream)
        self.remote_closed = False
        self.local_closed = False

    # -- sending --

    def send_headers(self, block: bytes, end_stream: bool = False) -> None:
        """An encoded header block (`encode_headers`); ordered behind data still waiting for window."""
        if self.local_closed:
            return
        if self.pending:
            self.pending.append((block, True, end_stream))
        else:
            self.conn.write_headers(self.id, block, end_stream)
        if end_stream:
            self._closed_locally()

    def send_data(self, payload: bytes, end_stream: bool = False) -> None:
        if self.local_closed:
            return
        self.pending.append((payload, False, end_stream))
        self.conn.flush_stream(self)
        if end_stream:
            self._closed_locally()

    def send_trailers(self, block: bytes) -> None:
        self.send_headers(block, end_stream=True)

    def reset(self, code: int) -> None:
        """RST_STREAM(code): nothing more is sent or delivered on this stream."""
        if not (self.local_closed and self.remote_closed):
            self.conn.reset_stream(self, code)

    def _closed_locally(self) -> None:
        self.local_closed = True
        if self.remote_closed and not self.pending:
            self.conn.forget(self)

    # -- receiving --

    def consumed(self, n: int) -> None:
        """The handler took `n` bytes of queued messages: the window may open again."""
        self.unread -= n
        self.conn.maybe_open_window(self)


def encode_int(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK integer (RFC 7541 section 5.1) with the high bits of the first byte set to `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """A stateless header block: every field a literal without indexing (new name, no Huffman), so
    no dynamic table is kept and any block may be sent in any order. `:status 200` is the static
    table's entry 8."""
    out = bytearray()
    for name, value in headers:
        if name == ":status" and value == "200":
            out.append(0x88)
            continue
        raw_name, raw_value = name.encode("ascii"), value.encode("ascii")
        out += b"\x00" + encode_int(len(raw_name), 7, 0) + raw_name + encode_int(len(raw_value), 7, 0) + raw_value
    return bytes(out)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


class H2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection."""

    def __init__(
        self, app: H2App, limits: H2Limits | None = None, on_close: Callable[[H2Connection], None] | None = None
    ) -> None:
        self.app = app
        self.limits = limits = limits or H2Limits()
        self._on_close = on_close
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, H2Stream] = {}
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        self.send_window = DEFAULT_WINDOW  # the connection's, granted by the peer
        self.recv_window = limits.connection_window
        self._conn_unacked = 0
        self._decoder = Decoder(max_header_list_size=limits.max_header_list_size)
        self._buf = bytearray()
        self._preface_seen = False
        self._last_stream = 0  # highest stream id the peer opened
        self._headers_block: bytearray | None = None  # a header block continued in CONTINUATION frames
        self._headers_stream = 0
        self._headers_flags = 0
        self._blocked: dict[int, H2Stream] = {}  # streams with data waiting for window
        self._out: list[bytes] = []
        self._flush_due = False
        self._table_update_due = False
        self._going_away = False
        self.closed = False
        self._preface_timer: asyncio.TimerHandle | None = None
        self.refused = False  # set before connection_made: over the server's connection limit

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        limits = self.limits
        if self.refused:
            self._abort(ENHANCE_YOUR_CALM, "too many connections")
            return
        settings = b"".join(
            struct.pack(">HI", key, value)
            for key, value in (
                (ENABLE_PUSH, 0),
                (MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
                (INITIAL_WINDOW_SIZE, limits.stream_window),
                (MAX_FRAME_SIZE, limits.max_frame_size),
                (MAX_HEADER_LIST_SIZE, limits.max_header_list_size),
            )
        )
        self._out.append(frame(SETTINGS, 0, 0, settings))
        if limits.connection_window > DEFAULT_WINDOW:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", limits.connection_window - DEFAULT_WINDOW)))
        self._flush()
        loop = asyncio.get_running_loop()
        self._preface_timer = loop.call_later(limits.preface_timeout_s, self._preface_late)

    def _preface_late(self) -> None:
        if not self._preface_seen:
            self._abort(PROTOCOL_ERROR, "no connection preface in time")

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self._buf
        buf += data
        try:
            if not self._preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self._preface_seen = True
                if self._preface_timer is not None:
                    self._preface_timer.cancel()
            self._frames()
        except H2ProtocolError as exc:
            self._abort(exc.code, str(exc))
            return
        if self._conn_unacked >= self.limits.connection_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._conn_unacked)))
            self.recv_window += self._conn_unacked
            self._conn_unacked = 0
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        streams, self.streams = self.streams, {}
        self._blocked.clear()
        for stream in streams.values():
            if stream.receiver is not None:
                stream.receiver.reset(CANCEL)
        if self._on_close is not None:
            self._on_close(self)

    # -- reading frames --

    def _frames(self) -> None:
        buf = self._buf
        max_frame = self.limits.max_frame_size
        offset = 0
        end = len(buf)
        try:
            while end - offset >= 9:
                hi, lo, kind, flags, stream_id = _HEADER.unpack_from(buf, offset)
                length = (hi << 16) | lo
                if length > max_frame:
                    raise H2ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes over {max_frame}")
                if end - offset < 9 + length:
                    break
                payload = bytes(buf[offset + 9 : offset + 9 + length])
                offset += 9 + length
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
        finally:
            del buf[:offset]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._headers_block is not None and (kind != CONTINUATION or stream_id != self._headers_stream):
            raise H2ProtocolError(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id or len(payload) != 8:
                raise H2ProtocolError(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise H2ProtocolError(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR, "bad RST_STREAM")
            if stream_id > self._last_stream:
                raise H2ProtocolError(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._blocked.pop(stream_id, None)
                stream.local_closed = stream.remote_closed = True
                if stream.receiver is not None:
                    stream.receiver.reset(struct.unpack(">I", payload)[0])
        elif kind == PRIORITY:
            if len(payload) != 5:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "bad PRIORITY")
        elif kind == GOAWAY:
            self._going_away = True  # the peer opens no more streams; the open ones finish
        elif kind == PUSH_PROMISE:
            raise H2ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # other frame types are extensions: ignored (section 5.5)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self.recv_window -= size
        if self.recv_window < 0:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "DATA past the connection window")
        self._conn_unacked += size  # the connection's window reopens whatever becomes of the bytes
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self._last_stream:
                raise H2ProtocolError(PROTOCOL_ERROR, "DATA on an idle stream")
            # a stream this side reset or finished: frames already in flight are ignored (5.4.2)
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            self.reset_stream(stream, FLOW_CONTROL_ERROR)
            return
        stream.unacked += size
        if stream.receiver is not None and payload:
            stream.receiver.data(payload)
        if flags & END_STREAM:
            self._remote_end(stream)
        else:
            self.maybe_open_window(stream)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "short HEADERS priority")
            payload = payload[5:]
        self._headers_stream, self._headers_flags = stream_id, flags
        if flags & END_HEADERS:
            self._header_block(payload)
        else:
            self._headers_block = bytearray(payload)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._headers_block
        if block is None:
            raise H2ProtocolError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        block += payload
        # the encoded block is at most about the decoded list; twice is generous and still bounded
        if len(block) > 2 * self.limits.max_header_list_size:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._headers_block = None
            self._header_block(bytes(block))

    def _header_block(self, block: bytes) -> None:
        stream_id, flags = self._headers_stream, self._headers_flags
        try:  # decoded whatever becomes of the stream: the dynamic table is the connection's
            fields = self._decoder.decode(block)
        except (HPACKError, UnicodeDecodeError, ValueError) as exc:
            raise H2ProtocolError(COMPRESSION_ERROR, f"header block: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: the request's end
            if stream.remote_closed or not flags & END_STREAM:
                raise H2ProtocolError(PROTOCOL_ERROR, "HEADERS on a stream already sending")
            self._remote_end(stream)
            return
        if stream_id % 2 == 0:
            raise H2ProtocolError(PROTOCOL_ERROR, f"HEADERS opening even stream {stream_id}")
        if stream_id <= self._last_stream:  # trailers of a stream this side reset already
            return
        self._last_stream = stream_id
        if self._going_away or self.closed or len(self.streams) >= self.limits.max_concurrent_streams:
            self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            self.app.refused(ERROR_NAMES[REFUSED_STREAM])
            return
        headers: dict[str, str] = {}
        for name, value in fields:
            if name in headers:  # repeated fields are joined, as HTTP does (cookies aside)
                headers[name] = f"{headers[name]}, {value}"
            else:
                headers[name] = value
        stream = H2Stream(self, stream_id, headers)
        self.streams[stream_id] = stream
        # closed before the app sees it: an answer given in `open` needs no RST_STREAM after it
        stream.remote_closed = ended = bool(flags & END_STREAM)
        stream.receiver = self.app.open(stream)
        if ended:
            if stream.receiver is not None:
                stream.receiver.end()
            if stream.local_closed and not stream.pending:
                self.forget(stream)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise H2ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2ProtocolError(FLOW_CONTROL_ERROR, "connection window past 2^31-1")
            self._flush_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise H2ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment:
            self.reset_stream(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self.reset_stream(stream, FLOW_CONTROL_ERROR)
            return
        if stream.pending:
            self.flush_stream(stream)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS of a partial entry")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "initial window past 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise H2ProtocolError(FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise H2ProtocolError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == ENABLE_PUSH:
                if value > 1:
                    raise H2ProtocolError(PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            elif key == HEADER_TABLE_SIZE:
                # no entry is ever added to this encoder's table; a smaller limit is still signalled
                # (a strict decoder expects a table size update in the next block)
                self._table_update_due = True
        self._out.append(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _remote_end(self, stream: H2Stream) -> None:
        stream.remote_closed = True
        if stream.receiver is not None:
            stream.receiver.end()
        if stream.local_closed and not stream.pending:
            self.forget(stream)

    # -- flow control, receiving --

    def maybe_open_window(self, stream: H2Stream) -> None:
        """Give the stream its window back once half is used, unless its handler is behind."""
        limits = self.limits
        if (
            stream.unacked >= limits.stream_window // 2
            and stream.unread <= limits.stream_queue_bytes
            and not stream.remote_closed
            and stream.id in self.streams
        ):
            self._out.append(frame(WINDOW_UPDATE, 0, stream.id, struct.pack(">I", stream.unacked)))
            stream.recv_window += stream.unacked
            stream.unacked = 0
            self._schedule_flush()

    # -- sending --

    def write_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if self._table_update_due:
            block = b"\x20" + block  # dynamic table size update to 0 (RFC 7541 section 6.3)
            self._table_update_due = False
        flags = END_STREAM if end_stream else 0
        max_frame = self.peer_max_frame
        if len(block) <= max_frame:
            self._out.append(frame(HEADERS, flags | END_HEADERS, stream_id, block))
        else:
            chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
            self._out.append(frame(HEADERS, flags, stream_id, chunks[0]))
            for chunk in chunks[1:-1]:
                self._out.append(frame(CONTINUATION, 0, stream_id, chunk))
            self._out.append(frame(CONTINUATION, END_HEADERS, stream_id, chunks[-1]))
        if end_stream:
            self._sent_end(stream_id)
        self._schedule_flush()

    def flush_stream(self, stream: H2Stream) -> None:
        """Send what the stream has waiting, as far as both windows reach."""
        pending = stream.pending
        while pending:
            payload, is_headers, end_stream = pending[0]
            if is_headers:
                pending.popleft()
                self.write_headers(stream.id, payload, end_stream)
                continue
            size = len(payload)
            room = min(self.send_window, stream.send_window, self.peer_max_frame)
            if size and room <= 0:
                self._blocked[stream.id] = stream
                break
            if size > room > 0:  # an empty DATA (END_STREAM) costs no window: it goes even past a negative one
                self._out.append(frame(DATA, 0, stream.id, payload[:room]))
                pending[0] = (payload[room:], False, end_stream)
                self.send_window -= room
                stream.send_window -= room
                continue
            pending.popleft()
            self._out.append(frame(DATA, END_STREAM if end_stream else 0, stream.id, payload))
            self.send_window -= size
            stream.send_window -= size
            if end_stream:
                self._sent_end(stream.id)
        else:
            self._blocked.pop(stream.id, None)
            if stream.local_closed and stream.remote_closed:
                self.forget(stream)
        self._schedule_flush()

    def _sent_end(self, stream_id: int) -> None:
        """This side's END_STREAM went out. A peer still sending is told to stop with
        RST_STREAM(NO_ERROR) (RFC 9113 section 8.1), as grpc's own servers do: the stream's slot is
        freed at once, not held until a peer that may never end its side does."""
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.remote_closed:
            self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", NO_ERROR)))
            stream.remote_closed = True
            self.forget(stream)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self.send_window <= 0:
                break
            self.flush_stream(stream)

    def reset_stream(self, stream: H2Stream, code: int) -> None:
        self._out.append(frame(RST_STREAM, 0, stream.id, struct.pack(">I", code)))
        self.app.refused(ERROR_NAMES.get(code, "unknown"))
        stream.pending.clear()
        stream.local_closed = stream.remote_closed = True
        self.forget(stream)
        if stream.receiver is not None:
            stream.receiver.reset(code)
        self._schedule_flush()

    def forget(self, stream: H2Stream) -> None:
        self.streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)

    def _schedule_flush(self) -> None:
        if not self._flush_due and self.transport is not None:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self._out or self.transport is None or self.closed:
            self._out.clear()
            return
        out = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        self.transport.write(out)
        if self.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            log.warning("HTTP/2 peer does not read what it is sent: closing the connection")
            self._abort(ENHANCE_YOUR_CALM, "peer not reading")

    # -- closing --

    def go_away(self) -> None:
        """GOAWAY(NO_ERROR): the peer opens no new stream here; the open ones finish."""
        if self.closed or self._going_away:
            return
        self._going_away = True
        self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, NO_ERROR)))
        self._flush()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _abort(self, code: int, why: str) -> None:
        log.debug("HTTP/2 connection closed: %s", why)
        if self.transport is None or self.closed:
            return
        self.app.refused(ERROR_NAMES.get(code, "unknown"))
        self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + why.encode()[:256]))
        out = b"".join(self._out)
        self._out.clear()
        with contextlib.suppress(Exception):
            self.transport.write(out)
        self.closed = True
        self.transport.close()  # connection_lost resets every stream's receiver


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise H2ProtocolError(PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise H2ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]
