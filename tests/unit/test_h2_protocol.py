"""pilotfish.h2 on the wire: a raw socket as the peer, frames built by hand, header blocks by hpack.

Each case sends what a careless or hostile client might and checks the frames that come back:
a connection error is GOAWAY(code) then EOF, a stream error RST_STREAM on that stream only.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from grpc_health.v1 import health_pb2
from hpack import Decoder, Encoder
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from pilotfish.grpc_loop import GrpcError, HealthService, Kind, LoopGrpcServer
from pilotfish.h2 import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    H2Connection,
    H2Limits,
    H2Stream,
    encode_headers,
    frame,
)
from pilotfish.procs import wait_until_async

TIMEOUT = 10.0  # bound on any one wait for a frame; pytest-timeout is the outer bound
SERVING = health_pb2.HealthCheckResponse.SERVING
MESSAGE = "50% off: ünïcode ✓"  # grpc-message: '%' and non-ASCII are percent-encoded


@dataclass(frozen=True)
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes

    @property
    def code(self) -> int:
        """The error code of a GOAWAY or RST_STREAM."""
        if self.kind == GOAWAY:
            return int(struct.unpack_from(">I", self.payload, 4)[0])
        assert self.kind == RST_STREAM
        return int(struct.unpack(">I", self.payload)[0])


class Peer:
    """A hand-driven HTTP/2 client: writes frames as given, reads frames one by one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.seen: list[Frame] = []

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self.writer.write(frame(kind, flags, stream, payload))

    def raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def read(self) -> Frame | None:
        """The next frame; None at EOF."""
        try:
            head = await self.reader.readexactly(9)
        except asyncio.IncompleteReadError as exc:
            assert not exc.partial, f"EOF inside a frame header: {exc.partial!r}"
            return None
        except ConnectionResetError:
            return None
        length = int.from_bytes(head[:3], "big")
        payload = await self.reader.readexactly(length)
        got = Frame(head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload)
        self.seen.append(got)
        return got

    async def until(self, condition: Callable[[Frame], bool], what: str) -> Frame:
        """Frames are read (and kept in `seen`) until one meets `condition`."""

        async def scan() -> Frame:
            while (got := await self.read()) is not None:
                if condition(got):
                    return got
            raise AssertionError(f"EOF before {what}; frames: {self.seen}")

        return await asyncio.wait_for(scan(), TIMEOUT)

    async def eof(self) -> list[Frame]:
        """Every frame until the server closes the connection."""

        async def drain() -> list[Frame]:
            frames = []
            while (got := await self.read()) is not None:
                frames.append(got)
            return frames

        return await asyncio.wait_for(drain(), TIMEOUT)

    async def goaway(self) -> Frame:
        """The connection's end: a GOAWAY, then EOF."""
        frames = await self.eof()
        goaways = [f for f in frames if f.kind == GOAWAY]
        assert len(goaways) == 1, frames
        return goaways[0]

    def request_headers(self, path: str, **extra: str) -> bytes:
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "test"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra.items(),
        ]
        return bytes(self.encoder.encode(fields))

    def open_call(self, stream: int, path: str, message: bytes | None = None) -> None:
        """HEADERS for a gRPC call, then one message and END_STREAM when `message` is given."""
        self.send(HEADERS, END_HEADERS, stream, self.request_headers(path))
        if message is not None:
            self.send(DATA, END_STREAM, stream, grpc_message(message))

    async def ping(self, opaque: bytes) -> None:
        """PING and wait for its ACK: the connection still answers."""
        self.send(PING, 0, 0, opaque)
        await self.until(lambda f: f.kind == PING and f.flags & ACK and f.payload == opaque, "PING ACK")

    async def response(self, stream: int) -> tuple[list[list[tuple[str, str]]], bytes]:
        """The header blocks (decoded, in order) and the data of one stream, through END_STREAM."""
        blocks: list[list[tuple[str, str]]] = []
        data = bytearray()
        block = bytearray()
        ending = False  # END_STREAM seen on a HEADERS whose block continues
        while True:
            got = await self.until(lambda f: f.stream == stream, f"stream {stream}'s response")
            if got.kind == RST_STREAM:
                raise AssertionError(f"stream {stream} reset with {got.code}")
            if got.kind == DATA:
                data += got.payload
                ending = bool(got.flags & END_STREAM)
            elif got.kind in (HEADERS, CONTINUATION):
                ending = ending or bool(got.kind == HEADERS and got.flags & END_STREAM)
                block += got.payload
                if got.flags & END_HEADERS:
                    blocks.append([(str(k), str(v)) for k, v in self.decoder.decode(bytes(block))])
                    block.clear()
            if ending and not block:
                return blocks, bytes(data)


def grpc_message(body: bytes) -> bytes:
    return b"\0" + len(body).to_bytes(4, "big") + body


def settings(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack(">HI", key, value) for key, value in pairs)


class Service:
    """The server's methods: a health service, an echo, a call that fails, one that waits."""

    def __init__(self) -> None:
        self.health = HealthService()
        self.released = asyncio.Event()

    async def echo(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        async for request in requests:
            yield request

    async def fail(self, request: BytesValue, context: Any) -> BytesValue:
        raise GrpcError(9, MESSAGE)

    async def wait(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        await self.released.wait()
        yield BytesValue(value=b"done")


Connect = Callable[..., Any]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """connect(limits=H2Limits(...), preface=True) -> (Peer, Service, server): a fresh server with those limits.
    With `preface`, the peer has sent the preface and an empty SETTINGS, and read the server's."""
    servers: list[LoopGrpcServer] = []
    peers: list[Peer] = []

    async def open_peer(limits: H2Limits | None = None, preface: bool = True) -> tuple[Peer, Service, LoopGrpcServer]:
        service = Service()
        server = LoopGrpcServer(limits=limits)
        service.health.add_to(server)
        server.add_method("/test.Echo/Echo", BytesValue, Kind.BIDI, service.echo)
        server.add_method("/test.Echo/Fail", BytesValue, Kind.UNARY, service.fail)
        server.add_method("/test.Echo/Wait", BytesValue, Kind.BIDI, service.wait)
        await service.health.set("", SERVING)
        port = await server.start("127.0.0.1", 0)
        servers.append(server)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        peer = Peer(reader, writer)
        peers.append(peer)
        if preface:
            peer.raw(PREFACE)
            peer.send(SETTINGS, 0, 0)
            await peer.until(lambda f: f.kind == SETTINGS and not f.flags & ACK, "the server's SETTINGS")
        return peer, service, server

    yield open_peer
    for peer in peers:
        peer.writer.close()
    for server in servers:
        await server.stop(0.1)


# -- 8. connection errors end with GOAWAY and EOF --


async def test_bad_preface_is_a_protocol_error(connect: Connect) -> None:
    peer, _, _ = await connect(preface=False)
    peer.raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await peer.goaway()).code == PROTOCOL_ERROR


async def test_frame_over_max_frame_size_is_a_frame_size_error(connect: Connect) -> None:
    peer, _, _ = await connect(limits=H2Limits(max_frame_size=16384))
    peer.send(PING, 0, 0, bytes(8))  # a frame at any size below the limit is fine
    await peer.until(lambda f: f.kind == PING and f.flags & ACK, "PING ACK")
    peer.raw((16385).to_bytes(3, "big") + bytes((DATA, 0)) + (1).to_bytes(4, "big"))  # its header is enough
    assert (await peer.goaway()).code == FRAME_SIZE_ERROR


async def test_connections_past_the_limit_are_told_goaway_and_closed(connect: Connect) -> None:
    peer, _, server = await connect(limits=H2Limits(max_connections=1))
    port = server._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = Peer(reader, writer)
        assert (await extra.goaway()).code == ENHANCE_YOUR_CALM
    finally:
        writer.close()
    peer.send(PING, 0, 0, bytes(8))  # the first connection is served as before
    await peer.until(lambda f: f.kind == PING and f.flags & ACK, "PING ACK")
    assert len(server._connections) == 1
    assert server.refusals == {"enhance_your_calm": 1}


async def test_ping_is_acknowledged_with_its_payload(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(PING, 0, 0, b"\x01\x02\x03\x04\x05\x06\x07\x08")
    ack = await peer.until(lambda f: f.kind == PING, "PING ACK")
    assert ack.flags & ACK and ack.payload == b"\x01\x02\x03\x04\x05\x06\x07\x08" and ack.stream == 0
    peer.send(PING, ACK, 0, bytes(8))  # an ACK is not answered: the next PING's ACK comes first
    await peer.ping(b"second!!")
    assert [f.payload for f in peer.seen if f.kind == PING] == [b"\x01\x02\x03\x04\x05\x06\x07\x08", b"second!!"]


async def test_settings_is_acknowledged(connect: Connect) -> None:
    peer, _, _ = await connect(preface=False)
    peer.raw(PREFACE)
    server_settings = await peer.until(lambda f: f.kind == SETTINGS, "the server's SETTINGS")
    assert not server_settings.flags & ACK
    assert not [f for f in peer.seen if f.kind == SETTINGS and f.flags & ACK]  # nothing to ACK yet
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 1 << 20)))
    ack = await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    assert ack.payload == b"" and ack.stream == 0


async def test_header_block_interrupted_is_a_protocol_error(connect: Connect) -> None:
    peer, _, _ = await connect()
    block = peer.request_headers("/grpc.health.v1.Health/Check")
    peer.send(HEADERS, 0, 1, block[:5])  # no END_HEADERS: CONTINUATION on stream 1 must follow
    peer.send(HEADERS, END_HEADERS, 3, peer.request_headers("/grpc.health.v1.Health/Check"))
    assert (await peer.goaway()).code == PROTOCOL_ERROR


async def test_header_block_over_continuation_opens_the_stream(connect: Connect) -> None:
    peer, _, _ = await connect(limits=H2Limits(max_header_list_size=1024))
    block = peer.request_headers("/grpc.health.v1.Health/Check")
    third = len(block) // 3
    peer.send(HEADERS, 0, 1, block[:third])
    peer.send(CONTINUATION, 0, 1, block[third : 2 * third])
    peer.send(CONTINUATION, END_HEADERS, 1, block[2 * third :])
    peer.send(DATA, END_STREAM, 1, grpc_message(health_pb2.HealthCheckRequest().SerializeToString()))
    blocks, data = await peer.response(1)
    assert dict(blocks[0])[":status"] == "200"
    assert dict(blocks[-1])["grpc-status"] == "0"
    assert health_pb2.HealthCheckResponse.FromString(data[5:]).status == SERVING


async def test_header_block_past_its_bound_is_refused(connect: Connect) -> None:
    peer, _, _ = await connect(limits=H2Limits(max_header_list_size=256))
    peer.send(HEADERS, 0, 1, peer.request_headers("/grpc.health.v1.Health/Check")[:4])
    for _ in range(20):  # 20 x 64 bytes: past twice the list bound, END_HEADERS never comes
        peer.send(CONTINUATION, 0, 1, bytes(64))
    assert (await peer.goaway()).code == ENHANCE_YOUR_CALM


async def test_streams_past_the_limit_are_refused(connect: Connect) -> None:
    peer, service, _ = await connect(limits=H2Limits(max_concurrent_streams=2))
    peer.open_call(1, "/test.Echo/Wait")
    peer.open_call(3, "/test.Echo/Wait")
    peer.open_call(5, "/test.Echo/Wait")
    refused = await peer.until(lambda f: f.kind == RST_STREAM, "RST_STREAM")
    assert refused.stream == 5 and refused.code == REFUSED_STREAM
    service.released.set()  # the two admitted calls answer
    for stream in (1, 3):
        peer.send(DATA, END_STREAM, stream, b"")
        blocks, data = await peer.response(stream)
        assert dict(blocks[-1])["grpc-status"] == "0"
        assert BytesValue.FromString(data[5:]).value == b"done"
    # with them done, a new stream is admitted
    peer.open_call(7, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString())
    blocks, _ = await peer.response(7)
    assert dict(blocks[-1])["grpc-status"] == "0"


async def test_data_past_the_stream_window_resets_that_stream_only(connect: Connect) -> None:
    window = 16384
    peer, _, _ = await connect(limits=H2Limits(stream_window=window))
    peer.open_call(1, "/test.Echo/Echo")
    peer.open_call(3, "/test.Echo/Echo")
    peer.send(DATA, 0, 1, bytes(window + 1))  # one byte past what the server advertised
    reset = await peer.until(lambda f: f.kind == RST_STREAM, "RST_STREAM")
    assert reset.stream == 1 and reset.code == FLOW_CONTROL_ERROR
    await peer.ping(b"stillup!")
    # the other stream still works
    peer.send(DATA, END_STREAM, 3, grpc_message(BytesValue(value=b"hi").SerializeToString()))
    blocks, data = await peer.response(3)
    assert dict(blocks[-1])["grpc-status"] == "0"
    assert BytesValue.FromString(data[5:]).value == b"hi"
    assert not [f for f in peer.seen if f.kind == GOAWAY]


async def test_window_update_past_the_maximum_is_a_flow_control_error(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000))  # fine: 65,535 + 1,000
    await peer.ping(b"windowok")
    peer.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW))
    assert (await peer.goaway()).code == FLOW_CONTROL_ERROR


async def test_silent_peer_is_closed_after_the_preface_timeout(connect: Connect) -> None:
    peer, _, _ = await connect(limits=H2Limits(preface_timeout_s=0.05), preface=False)
    assert (await peer.goaway()).code == PROTOCOL_ERROR


async def test_peer_with_the_preface_is_not_timed_out(connect: Connect) -> None:
    """The preface timer stops at the preface: a connection that sent it lives past the timeout."""
    peer, _, server = await connect(limits=H2Limits(preface_timeout_s=3600.0))
    await peer.ping(b"prefaced")
    (conn,) = server._connections
    assert conn._preface_timer is not None and conn._preface_timer.cancelled()


# -- 8b. the send side waits for the peer's window --


@pytest.mark.parametrize("reopen", ["window-update", "settings"])
async def test_reply_waits_for_the_peers_window(connect: Connect, reopen: str) -> None:
    """The stream's window is 100 bytes: that much goes, the rest once the peer gives more, by a
    WINDOW_UPDATE on the stream or a larger SETTINGS_INITIAL_WINDOW_SIZE."""
    peer, _, _ = await connect()
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 100)))
    await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    body = BytesValue(value=bytes(range(256)) * 4).SerializeToString()
    peer.open_call(1, "/test.Echo/Echo", body)
    first = await peer.until(lambda f: f.kind == DATA and f.stream == 1, "the first DATA")
    assert len(first.payload) == 100  # no more than the window
    await peer.ping(b"nomore!!")  # and nothing else of it before more window is given
    assert sum(len(f.payload) for f in peer.seen if f.kind == DATA) == 100
    if reopen == "settings":
        peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 1 << 20)))
    else:
        peer.send(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 20))
    blocks, rest = await peer.response(1)
    assert dict(blocks[-1])["grpc-status"] == "0"
    assert first.payload + rest == grpc_message(body)


async def test_reply_waits_for_the_connection_window(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 1 << 20)))  # only the connection's 64 KiB binds
    await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    body = BytesValue(value=bytes(range(256)) * 400).SerializeToString()  # ~100 KiB
    peer.open_call(1, "/test.Echo/Echo", body)
    await peer.until(lambda f: f.kind == DATA and f.stream == 1, "the first DATA")
    await peer.ping(b"nomore!!")
    assert sum(len(f.payload) for f in peer.seen if f.kind == DATA) == 65535
    peer.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20))
    blocks, _ = await peer.response(1)
    assert dict(blocks[-1])["grpc-status"] == "0"
    assert b"".join(f.payload for f in peer.seen if f.kind == DATA) == grpc_message(body)
    assert max(len(f.payload) for f in peer.seen if f.kind == DATA) == 16384  # the peer's default frame size


async def test_stream_reset_by_the_peer_while_blocked_sends_nothing_more(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 10)))
    await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    peer.send(HEADERS, END_HEADERS, 1, peer.request_headers("/test.Echo/Echo"))
    peer.send(DATA, 0, 1, grpc_message(BytesValue(value=b"x" * 100).SerializeToString()))
    await peer.until(lambda f: f.kind == DATA and f.stream == 1, "the first DATA")
    peer.send(RST_STREAM, 0, 1, struct.pack(">I", 0x8))  # CANCEL
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 1 << 20)))  # window that would unblock it
    peer.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20))
    await peer.ping(b"anymore?")
    assert [f.kind for f in peer.seen if f.stream == 1] == [HEADERS, DATA]
    # and the connection serves the next stream
    peer.open_call(3, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString())
    blocks, _ = await peer.response(3)
    assert dict(blocks[-1])["grpc-status"] == "0"


async def test_padded_and_prioritised_frames_are_read(connect: Connect) -> None:
    """Padding (and HEADERS' priority fields) are stripped; padding counts against the windows."""
    peer, _, _ = await connect()
    block = peer.request_headers("/test.Echo/Echo")
    priority = struct.pack(">IB", 0, 15)  # stream dependency 0, weight 16
    peer.send(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, bytes((7,)) + priority + block + bytes(7))
    message = grpc_message(BytesValue(value=b"padded").SerializeToString())
    peer.send(DATA, PADDED, 1, bytes((200,)) + message + bytes(200))
    peer.send(DATA, PADDED | END_STREAM, 1, bytes((0,)))  # only a pad length
    blocks, data = await peer.response(1)
    assert dict(blocks[-1])["grpc-status"] == "0"
    assert BytesValue.FromString(data[5:]).value == b"padded"


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([(DATA, 0, 0, b"x")], PROTOCOL_ERROR),  # DATA on stream 0
        ([(DATA, 0, 9, b"x")], PROTOCOL_ERROR),  # DATA on a stream never opened
        ([(HEADERS, END_HEADERS, 2, b"\x82")], PROTOCOL_ERROR),  # a client opening an even stream
        ([(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff")], COMPRESSION_ERROR),  # not HPACK
        ([(CONTINUATION, END_HEADERS, 1, b"\x82")], PROTOCOL_ERROR),  # CONTINUATION without HEADERS
        ([(RST_STREAM, 0, 5, bytes(4))], PROTOCOL_ERROR),  # RST_STREAM on an idle stream
        ([(RST_STREAM, 0, 0, bytes(4))], PROTOCOL_ERROR),
        ([(PING, 0, 0, bytes(7))], FRAME_SIZE_ERROR),
        ([(PING, 0, 1, bytes(8))], PROTOCOL_ERROR),
        ([(SETTINGS, 0, 0, bytes(5))], FRAME_SIZE_ERROR),  # a partial entry
        ([(SETTINGS, ACK, 0, bytes(6))], FRAME_SIZE_ERROR),  # an ACK with a payload
        ([(SETTINGS, 0, 1, b"")], PROTOCOL_ERROR),
        ([(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)))], FLOW_CONTROL_ERROR),
        ([(SETTINGS, 0, 0, settings((MAX_FRAME_SIZE, 100)))], PROTOCOL_ERROR),
        ([(SETTINGS, 0, 0, settings((ENABLE_PUSH, 2)))], PROTOCOL_ERROR),
        ([(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0))], PROTOCOL_ERROR),
        ([(WINDOW_UPDATE, 0, 0, bytes(3))], FRAME_SIZE_ERROR),
        ([(PUSH_PROMISE, END_HEADERS, 1, bytes(4))], PROTOCOL_ERROR),
        ([(PRIORITY, 0, 1, bytes(4))], FRAME_SIZE_ERROR),
    ],
)
async def test_connection_errors(connect: Connect, frames: list[tuple[int, int, int, bytes]], code: int) -> None:
    peer, _, _ = await connect()
    await peer.ping(b"ready!!!")
    for kind, flags, stream, payload in frames:
        peer.send(kind, flags, stream, payload)
    assert (await peer.goaway()).code == code


async def test_unknown_frame_types_are_ignored(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(0xFA, 0xFF, 0, b"an extension frame")
    peer.send(0xFB, 0, 7, b"on an idle stream")
    await peer.ping(b"ignored!")
    assert not [f for f in peer.seen if f.kind == GOAWAY]


@pytest.mark.parametrize(
    ("increment", "code"), [(0, PROTOCOL_ERROR), (MAX_WINDOW, FLOW_CONTROL_ERROR)], ids=["zero", "overflow"]
)
async def test_bad_window_update_on_a_stream_resets_that_stream(connect: Connect, increment: int, code: int) -> None:
    peer, _, _ = await connect()
    peer.open_call(1, "/test.Echo/Echo")
    peer.send(WINDOW_UPDATE, 0, 1, struct.pack(">I", increment))
    reset = await peer.until(lambda f: f.kind == RST_STREAM, "RST_STREAM")
    assert reset.stream == 1 and reset.code == code
    await peer.ping(b"stillup!")
    assert not [f for f in peer.seen if f.kind == GOAWAY]


# -- a call the server ends while the peer still sends --


async def test_early_answer_is_followed_by_rst_no_error_and_frees_the_slot(connect: Connect) -> None:
    """Trailers to a stream the peer has not ended, then RST_STREAM(NO_ERROR) (RFC 9113 section 8.1):
    the peer stops sending, and the stream's slot is free at once."""
    peer, _, _ = await connect(limits=H2Limits(max_concurrent_streams=1))
    peer.open_call(1, "/test.Echo/Nope")  # no END_STREAM: the peer would go on sending
    blocks, _ = await peer.response(1)
    assert dict(blocks[-1])["grpc-status"] == "12"
    stop = await peer.until(lambda f: f.stream == 1, "RST_STREAM after the trailers")
    assert stop.kind == RST_STREAM and stop.code == NO_ERROR
    peer.send(DATA, 0, 1, grpc_message(b"late"))  # in flight when the RST came: ignored
    peer.open_call(3, "/test.Echo/Fail")
    peer.send(DATA, 0, 3, grpc_message(b""))  # the request, without END_STREAM
    blocks, _ = await peer.response(3)  # admitted: stream 1 no longer counts
    assert dict(blocks[-1])["grpc-status"] == "9"
    stop = await peer.until(lambda f: f.stream == 3, "RST_STREAM after the trailers")
    assert stop.kind == RST_STREAM and stop.code == NO_ERROR
    await peer.ping(b"stillup!")
    assert not [f for f in peer.seen if f.kind == GOAWAY]


async def test_message_past_the_bound_answers_after_replies_waiting_for_window(connect: Connect) -> None:
    """RESOURCE_EXHAUSTED's trailers go out behind the replies the peer's window holds, and only
    then the RST_STREAM(NO_ERROR)."""
    peer, _, _ = await connect()
    peer.send(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 10)))
    await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    body = BytesValue(value=b"echo me, all of me").SerializeToString()
    peer.send(HEADERS, END_HEADERS, 1, peer.request_headers("/test.Echo/Echo"))
    peer.send(DATA, 0, 1, grpc_message(body))
    await peer.until(lambda f: f.kind == DATA and f.stream == 1, "the first 10 bytes of the reply")
    peer.send(DATA, 0, 1, b"\0" + (64 << 20).to_bytes(4, "big"))  # a 64 MiB message announced
    await peer.ping(b"waiting!")
    assert not [f for f in peer.seen if f.kind in (RST_STREAM, GOAWAY)]
    peer.send(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 20))
    blocks, _ = await peer.response(1)
    assert b"".join(f.payload for f in peer.seen if f.kind == DATA) == grpc_message(body)  # the whole reply
    assert dict(blocks[-1])["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
    stop = await peer.until(lambda f: f.stream == 1, "RST_STREAM after the trailers")
    assert stop.kind == RST_STREAM and stop.code == NO_ERROR


@pytest.mark.parametrize(
    ("fields", "status"),
    [({":method": "GET"}, "405"), ({"content-type": "text/plain"}, "415")],
    ids=["not-post", "not-grpc"],
)
async def test_not_a_grpc_request_gets_an_http_status(connect: Connect, fields: dict[str, str], status: str) -> None:
    peer, _, _ = await connect()
    request = {":method": "POST", ":scheme": "http", ":path": "/grpc.health.v1.Health/Check", ":authority": "t"}
    request.update({"content-type": "application/grpc"} | fields)
    peer.send(HEADERS, END_HEADERS | END_STREAM, 1, bytes(peer.encoder.encode(list(request.items()))))
    blocks, data = await peer.response(1)
    assert blocks == [[(":status", status)]] and data == b""


# -- 9. the header blocks the server sends --


async def test_error_trailers_decode_with_hpack(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.open_call(1, "/test.Echo/Fail", BytesValue(value=b"x").SerializeToString())
    blocks, data = await peer.response(1)
    assert data == b""
    (fields,) = blocks  # trailers only
    answer = dict(fields)
    assert answer[":status"] == "200" and answer["content-type"] == "application/grpc"
    assert answer["grpc-status"] == "9"
    assert answer["grpc-message"].isascii()
    assert unquote(answer["grpc-message"], encoding="utf-8", errors="strict") == MESSAGE


async def test_header_table_size_zero_signals_a_size_update(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(SETTINGS, 0, 0, settings((HEADER_TABLE_SIZE, 0)))
    await peer.until(lambda f: f.kind == SETTINGS and f.flags & ACK, "SETTINGS ACK")
    peer.decoder.max_allowed_table_size = 0  # what the peer now allows: a strict decoder
    peer.open_call(1, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString())
    first = await peer.until(lambda f: f.kind == HEADERS and f.stream == 1, "response HEADERS")
    assert first.payload[0] & 0xE0 == 0x20  # a dynamic table size update opens the block
    assert first.payload[0] == 0x20  # to size 0
    assert dict(peer.decoder.decode(first.payload))[":status"] == "200"
    peer.open_call(3, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString())
    second = await peer.until(lambda f: f.kind == HEADERS and f.stream == 3, "the next response HEADERS")
    assert second.payload[0] != 0x20  # signalled once
    assert dict(peer.decoder.decode(second.payload))[":status"] == "200"


async def test_goaway_from_the_peer_refuses_later_streams(connect: Connect) -> None:
    peer, _, _ = await connect()
    peer.send(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR))
    peer.open_call(1, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString())
    refused = await peer.until(lambda f: f.kind == RST_STREAM, "RST_STREAM")
    assert refused.stream == 1 and refused.code == REFUSED_STREAM


# -- the parser, fed one byte at a time --


class RecordingTransport(asyncio.Transport):
    """What H2Connection writes, kept; a socket that takes everything at once."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def frames_in(data: bytes) -> list[Frame]:
    out = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        out.append(Frame(data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9 : 9 + length]))
        data = data[9 + length :]
    return out


async def test_frames_split_at_every_byte_are_read() -> None:
    """Every frame boundary, header and payload split across reads: the same answers as whole."""
    service = Service()
    server = LoopGrpcServer()
    service.health.add_to(server)
    await service.health.set("", SERVING)
    conn = H2Connection(server, H2Limits())
    transport = RecordingTransport()
    conn.connection_made(transport)
    block = bytes(
        Encoder().encode(
            [
                (":method", "POST"),
                (":path", "/grpc.health.v1.Health/Check"),
                (":scheme", "http"),
                ("content-type", "application/grpc"),
            ]
        )
    )
    wire = (
        PREFACE
        + frame(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 1 << 20)))
        + frame(HEADERS, 0, 1, block[:3])
        + frame(CONTINUATION, END_HEADERS, 1, block[3:])
        + frame(DATA, END_STREAM, 1, grpc_message(health_pb2.HealthCheckRequest().SerializeToString()))
        + frame(PING, 0, 0, b"one byte")
    )
    for i in range(len(wire)):
        conn.data_received(wire[i : i + 1])

    def answered() -> bool:
        return any(
            f.kind == HEADERS and f.stream == 1 and f.flags & END_STREAM for f in frames_in(bytes(transport.out))
        )

    await wait_until_async(answered, TIMEOUT, "the answer")
    got = frames_in(bytes(transport.out))
    assert not transport.closed and not [f for f in got if f.kind == GOAWAY]
    assert any(f.kind == PING and f.flags & ACK and f.payload == b"one byte" for f in got)
    assert any(f.kind == SETTINGS and f.flags & ACK for f in got)
    decoder = Decoder()
    blocks = [dict(decoder.decode(f.payload)) for f in got if f.kind == HEADERS and f.stream == 1]
    assert blocks[0][":status"] == "200" and blocks[-1]["grpc-status"] == "0"
    (data,) = [f.payload for f in got if f.kind == DATA and f.stream == 1]
    assert health_pb2.HealthCheckResponse.FromString(data[5:]).status == SERVING
    conn.connection_lost(None)


class OneStreamApp:
    """An H2App that keeps the streams it is given and answers nothing by itself."""

    def __init__(self) -> None:
        self.streams: list[H2Stream] = []

    def open(self, stream: H2Stream) -> None:
        self.streams.append(stream)

    def refused(self, reason: str) -> None:
        pass


async def test_empty_end_of_stream_goes_out_past_a_negative_window() -> None:
    """A peer that shrinks SETTINGS_INITIAL_WINDOW_SIZE below what was sent leaves the stream's
    window negative; an empty DATA with END_STREAM still goes, once, and costs no window."""
    app = OneStreamApp()
    conn = H2Connection(app, H2Limits())
    transport = RecordingTransport()
    conn.connection_made(transport)
    block = bytes(Encoder().encode([(":method", "POST"), (":path", "/x"), (":scheme", "http")]))
    conn.data_received(
        PREFACE
        + frame(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 10)))
        + frame(HEADERS, END_HEADERS | END_STREAM, 1, block)
    )
    (stream,) = app.streams
    stream.send_headers(encode_headers([(":status", "200")]))
    stream.send_data(b"0123456789")  # the whole window
    conn.data_received(frame(SETTINGS, 0, 0, settings((INITIAL_WINDOW_SIZE, 0))))  # the stream's window: -10
    assert stream.send_window == -10
    stream.send_data(b"", end_stream=True)
    conn._flush()
    data = [f for f in frames_in(bytes(transport.out)) if f.kind == DATA]
    assert [(f.payload, f.flags & END_STREAM) for f in data] == [(b"0123456789", 0), (b"", END_STREAM)]
    assert conn.send_window == DEFAULT_WINDOW - 10  # the connection paid for the 10 bytes, no more, no less
    assert stream.send_window == -10
    conn.connection_lost(None)


# -- whatever a peer sends --

_ECHO_BLOCK = bytes(
    Encoder().encode(
        [(":method", "POST"), (":path", "/test.Echo/Echo"), (":scheme", "http"), ("content-type", "application/grpc")]
    )
)
_FRAMES = st.one_of(
    # frames as they come: any type, flags and payload on a few streams
    st.tuples(st.integers(0, 11), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5]), st.binary(max_size=24)),
    # and ones that open calls and feed them, so that the random ones meet live streams
    st.tuples(
        st.just(HEADERS),
        st.sampled_from([END_HEADERS, END_HEADERS | END_STREAM]),
        st.sampled_from([1, 3, 5]),
        st.just(_ECHO_BLOCK),
    ),
    st.tuples(
        st.just(DATA),
        st.sampled_from([0, END_STREAM]),
        st.sampled_from([1, 3, 5]),
        st.builds(grpc_message, st.binary(max_size=12)),
    ),
)


@given(st.lists(_FRAMES, max_size=14))
@hsettings(max_examples=300, deadline=None)
def test_any_frames_are_answered_or_end_in_goaway(frames: list[tuple[int, int, int, bytes]]) -> None:
    """No sequence of frames makes the connection raise: it answers (in header blocks that decode),
    resets streams, or sends GOAWAY and closes; and once closed it leaves no call running."""

    async def feed() -> None:
        service = Service()
        server = LoopGrpcServer()
        server.add_method("/test.Echo/Echo", BytesValue, Kind.BIDI, service.echo)
        conn = H2Connection(server, H2Limits())
        transport = RecordingTransport()
        conn.connection_made(transport)
        conn.data_received(PREFACE)
        for kind, flags, stream, payload in frames:
            conn.data_received(frame(kind, flags, stream, payload))
            if transport.closed:
                break
        for _ in range(5):  # the calls' tasks run their turns
            await asyncio.sleep(0)
        sent = frames_in(bytes(transport.out))
        assert not transport.closed or sent[-1].kind == GOAWAY
        decoder = Decoder()  # every header block the server wrote decodes, in order
        for got in sent:
            if got.kind == HEADERS:
                assert got.flags & END_HEADERS
                assert decoder.decode(got.payload)
        conn.connection_lost(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert all(task.done() for task in server._calls)

    asyncio.run(feed())
