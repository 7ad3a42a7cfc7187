"""The loop-thread gRPC server (pilotfish.grpc_loop on pilotfish.h2) against a real grpc.aio client.

grpc core is a complete HTTP/2 and gRPC client: what it accepts here is what Envoy's gRPC client
must accept too. The server runs in the test's own loop, on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pilotfish.grpc_loop import (
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    GrpcError,
    HealthService,
    Kind,
    LoopGrpcServer,
)
from pilotfish.procs import wait_until_async
from pilotfish.security import Security

FAILED_PRECONDITION, ABORTED = 9, 10
TIMEOUT = 30.0  # bound on any one wait; pytest-timeout is the outer bound
BIG = 3 << 20  # past the server's 1 MiB stream window and the small client window below
# grpc core advertises 4 MiB windows and grows them (BDP probes); pinned at 64 KiB, a 3 MiB reply
# goes out only as fast as the client's WINDOW_UPDATEs let it
SMALL_CLIENT_WINDOW = (("grpc.http2.lookahead_bytes", 65535), ("grpc.http2.bdp_probe", 0))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def pattern(n: int, seed: int) -> bytes:
    """n bytes drawn from `seed`: a lost, repeated or reordered chunk shows in a comparison."""
    return random.Random(seed).randbytes(n)


class Handlers:
    """The test service's methods and what the tests watch them do."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = asyncio.Event()  # set by the hanging handler's `finally`
        self.release = asyncio.Event()  # lets the waiting handler answer
        self.pending_read: asyncio.Future[BytesValue] | None = None

    async def echo(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        async for request in requests:
            yield BytesValue(value=request.value)

    async def echo_until_fail(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        async for request in requests:
            if request.value == b"fail":
                raise GrpcError(ABORTED, "stopped after the replies")
            yield request

    async def sized(self, request: BytesValue, context: Any) -> BytesValue:
        """A reply of int(request.value) bytes of `pattern(n, 7)`."""
        return BytesValue(value=pattern(int(request.value), 7))

    async def total(self, requests: AsyncIterator[BytesValue], context: Any) -> BytesValue:
        size = 0
        async for request in requests:
            size += len(request.value)
        return BytesValue(value=str(size).encode())

    async def fail(self, request: BytesValue, context: Any) -> BytesValue:
        if request.value.startswith(b"grpc:"):
            raise GrpcError(FAILED_PRECONDITION, request.value[5:].decode())
        raise RuntimeError("secret detail of the failure")

    async def wait(self, request: BytesValue, context: Any) -> BytesValue:
        self.started.set()
        await self.release.wait()
        return request

    async def answer_first(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        """Answers the first message and ends the call while a read of the next one is still pending,
        as the ext_proc does with an immediate response: that read must end, not wait for ever."""
        incoming = aiter(requests)
        first = await anext(incoming)
        self.pending_read = asyncio.ensure_future(anext(incoming))
        await asyncio.sleep(0)  # one turn of the loop: the read starts and waits for a message
        yield first

    async def hang(self, requests: AsyncIterator[BytesValue], context: Any) -> AsyncIterator[BytesValue]:
        try:
            async for request in requests:
                self.started.set()
                yield BytesValue(value=request.value)
            await asyncio.Event().wait()  # the peer half-closed: wait to be cancelled
        finally:
            self.finished.set()


def build_server(handlers: Handlers, **kwargs: Any) -> tuple[LoopGrpcServer, HealthService]:
    server = LoopGrpcServer(**kwargs)
    server.add_method("/test.Echo/Echo", BytesValue, Kind.BIDI, handlers.echo)
    server.add_method("/test.Echo/Sized", BytesValue, Kind.UNARY, handlers.sized)
    server.add_method("/test.Echo/EchoUntilFail", BytesValue, Kind.BIDI, handlers.echo_until_fail)
    server.add_method("/test.Echo/Total", BytesValue, Kind.CLIENT_STREAM, handlers.total)
    server.add_method("/test.Echo/Fail", BytesValue, Kind.UNARY, handlers.fail)
    server.add_method("/test.Echo/Hang", BytesValue, Kind.BIDI, handlers.hang)
    server.add_method("/test.Echo/AnswerFirst", BytesValue, Kind.BIDI, handlers.answer_first)
    server.add_method("/test.Echo/Wait", BytesValue, Kind.UNARY, handlers.wait)
    health = HealthService()
    health.add_to(server)
    return server, health


Serve = Callable[..., AbstractAsyncContextManager[tuple[LoopGrpcServer, HealthService, grpc.aio.Channel]]]


@pytest.fixture
def handlers() -> Handlers:
    return Handlers()


@pytest.fixture
def serve(handlers: Handlers) -> Serve:
    """serve(client_options=(), **LoopGrpcServer kwargs) -> (server, health, channel to it), stopped on exit."""

    @asynccontextmanager
    async def run(
        client_options: tuple[tuple[str, Any], ...] = (), **kwargs: Any
    ) -> AsyncIterator[tuple[LoopGrpcServer, HealthService, grpc.aio.Channel]]:
        server, health = build_server(handlers, **kwargs)
        port = await server.start("127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=list(client_options))
        try:
            yield server, health, channel
        finally:
            await channel.close()
            await server.stop(0.5)

    return run


def bytes_call(channel: grpc.aio.Channel, path: str, kind: str = "unary_unary") -> Any:
    return getattr(channel, kind)(
        path, request_serializer=BytesValue.SerializeToString, response_deserializer=BytesValue.FromString
    )


async def within(awaitable: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(awaitable, TIMEOUT)


async def no_stream_left(server: LoopGrpcServer) -> None:
    """Every finished call's stream is forgotten by its connection (none leaks)."""
    await wait_until_async(lambda: all(not conn.streams for conn in server._connections), TIMEOUT, "streams forgotten")


# -- 1. streams, big messages, both flow-control directions --


async def test_bidi_many_messages_come_back_in_order(serve: Serve) -> None:
    async with serve() as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")()
        sent = [f"message {i}".encode() * (1 + i % 7) for i in range(500)]

        async def write() -> None:
            for value in sent:
                await call.write(BytesValue(value=value))
            await call.done_writing()

        async def read() -> list[bytes]:
            return [reply.value async for reply in call]

        got, _ = await within(asyncio.gather(read(), write()))
        assert got == sent
        assert await call.code() == grpc.StatusCode.OK
        await no_stream_left(server)


async def test_stream_without_replies_ends_ok(serve: Serve) -> None:
    """No message either way: the answer is trailers only, and OK."""
    async with serve() as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")(iter(()))
        assert await within(call.read()) is grpc.aio.EOF
        assert await within(call.code()) == grpc.StatusCode.OK
        await no_stream_left(server)


async def test_a_read_pending_when_the_call_ends_early_ends_too(serve: Serve, handlers: Handlers) -> None:
    """The server ends the call while the client is still sending: its stream is reset with NO_ERROR,
    and the handler's pending read ends as a finished request stream (no task waits for ever)."""
    async with serve() as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/AnswerFirst", "stream_stream")()
        await within(call.write(BytesValue(value=b"first")))
        assert (await within(call.read())).value == b"first"
        assert await within(call.code()) == grpc.StatusCode.OK
        assert handlers.pending_read is not None
        with pytest.raises(StopAsyncIteration):
            await within(handlers.pending_read)
        await no_stream_left(server)


@pytest.mark.parametrize("client_options", [(), SMALL_CLIENT_WINDOW], ids=["grpc-windows", "64KiB-client-window"])
async def test_big_request_and_reply_cross_both_windows(
    serve: Serve, client_options: tuple[tuple[str, Any], ...]
) -> None:
    """3 MiB each way on one bidi call: the server reopens its 1 MiB receive window as the request
    arrives, and its send side waits for the client's WINDOW_UPDATEs and then finishes."""
    async with serve(client_options) as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")()
        value = pattern(BIG, 1)
        await within(call.write(BytesValue(value=value)))
        reply = await within(call.read())
        assert len(reply.value) == BIG
        assert reply.value == value
        await call.done_writing()
        assert await within(call.code()) == grpc.StatusCode.OK
        await no_stream_left(server)


@pytest.mark.parametrize("client_options", [(), SMALL_CLIENT_WINDOW], ids=["grpc-windows", "64KiB-client-window"])
async def test_big_reply_to_a_small_request(serve: Serve, client_options: tuple[tuple[str, Any], ...]) -> None:
    async with serve(client_options) as (_, _, channel):
        reply = await within(bytes_call(channel, "/test.Echo/Sized")(BytesValue(value=str(BIG).encode())))
        assert reply.value == pattern(BIG, 7)


async def test_concurrent_calls_share_the_windows(serve: Serve) -> None:
    """Many calls at once on one connection whose 64 KiB window they share: each reply whole and
    its own, as the connection's WINDOW_UPDATEs release the streams waiting for it."""
    async with serve(SMALL_CLIENT_WINDOW) as (server, _, channel):
        sized = bytes_call(channel, "/test.Echo/Sized")

        async def unary(n: int) -> None:
            reply = await sized(BytesValue(value=str(40_000 + n).encode()))
            assert reply.value == pattern(40_000 + n, 7)

        async def bidi(n: int) -> None:
            sent = [pattern(5_000 + i, n * 100 + i) for i in range(20)]
            call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")(BytesValue(value=v) for v in sent)
            assert [reply.value async for reply in call] == sent

        await within(asyncio.gather(*(unary(n) for n in range(60)), *(bidi(n) for n in range(10))))
        assert len(server._connections) == 1
        await no_stream_left(server)


async def test_client_stream_of_big_messages(serve: Serve) -> None:
    """Several requests past the stream window in a row: the queue bound releases as the handler reads."""
    async with serve() as (_, _, channel):
        chunks = [pattern(BIG, seed) for seed in range(4)]
        reply = await within(
            bytes_call(channel, "/test.Echo/Total", "stream_unary")(iter(BytesValue(value=c) for c in chunks))
        )
        assert int(reply.value) == 4 * BIG


# -- 2. status codes --


async def echo_once(channel: grpc.aio.Channel, value: bytes) -> tuple[grpc.StatusCode, list[bytes]]:
    call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")(iter([BytesValue(value=value)]))
    got: list[bytes] = []

    async def read() -> None:
        async for reply in call:
            got.append(reply.value)

    with contextlib.suppress(grpc.aio.AioRpcError):
        await within(read())
    return await within(call.code()), got


async def test_message_over_the_limit_is_resource_exhausted(serve: Serve) -> None:
    async with serve(max_message_bytes=1024) as (server, _, channel):
        code, _ = await echo_once(channel, b"x" * 2000)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(code.value[0]) == RESOURCE_EXHAUSTED
        # a message at the limit (1,021 bytes of value + 3 of protobuf framing) still passes
        assert await echo_once(channel, b"y" * 1021) == (grpc.StatusCode.OK, [b"y" * 1021])
        await no_stream_left(server)
        assert server.refusals["message_too_large"] == 1  # counted once, the passing one not at all


async def test_a_message_that_is_not_a_protobuf_is_invalid_argument_and_counted(serve: Serve) -> None:
    async with serve() as (server, _, channel):
        garbage = channel.unary_unary("/test.Echo/Echo", request_serializer=lambda raw: raw)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(garbage(b"\xff\xff\xff\xff\x0f"))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert server.refusals["malformed"] == 1
        assert await echo_once(channel, b"after") == (grpc.StatusCode.OK, [b"after"])  # the server goes on


async def test_unknown_method_is_unimplemented(serve: Serve) -> None:
    async with serve() as (server, _, channel):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(bytes_call(channel, "/test.Echo/Nope")(BytesValue(value=b"x")))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/test.Echo/Nope" in (caught.value.details() or "")
        # a streaming call to an unknown method ends as well, and its stream is not held. Nothing is
        # written: a grpc.aio client whose write races the server's early trailers may report its
        # own INTERNAL ("Internal error from Core") over the status, a client-side race
        call = bytes_call(channel, "/test.Echo/Nope", "stream_stream")()
        assert await within(call.code()) == grpc.StatusCode.UNIMPLEMENTED
        await no_stream_left(server)


async def test_grpc_error_from_the_handler_is_its_status(serve: Serve) -> None:
    text = "needs 50% more: précondition ✓"  # '%' and non-ASCII survive grpc-message's encoding
    async with serve() as (_, _, channel):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(bytes_call(channel, "/test.Echo/Fail")(BytesValue(value=b"grpc:" + text.encode())))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.details() == text


async def test_grpc_error_after_replies_ends_the_stream_with_its_status(serve: Serve) -> None:
    """Replies first, then trailers that carry the error (no second :status)."""
    async with serve() as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/EchoUntilFail", "stream_stream")()
        for value in (b"a", b"b"):
            await call.write(BytesValue(value=value))
            assert (await within(call.read())).value == value
        await call.write(BytesValue(value=b"fail"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(call.read())
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert caught.value.details() == "stopped after the replies"
        await no_stream_left(server)


async def test_long_message_is_cut_at_a_whole_character(serve: Serve) -> None:
    """grpc-message is bounded; the cut never splits a %XX escape or a character's UTF-8 bytes."""
    text = "ü" * 400  # 2,400 characters encoded: the 1,024 bound falls inside an escape
    async with serve() as (_, _, channel):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(bytes_call(channel, "/test.Echo/Fail")(BytesValue(value=b"grpc:" + text.encode())))
        details = caught.value.details() or ""
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert details == "ü" * len(details)
        assert 1024 - 6 < 6 * len(details) <= 1024  # as much as fits


async def test_other_exception_is_unknown_without_its_text(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    async with serve() as (_, _, channel):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(bytes_call(channel, "/test.Echo/Fail")(BytesValue(value=b"boom")))
        assert caught.value.code() == grpc.StatusCode.UNKNOWN
        assert caught.value.details() == "internal error"
        assert "secret" not in str(caught.value.debug_error_string())
        assert "secret detail of the failure" in caplog.text  # logged on the server instead


# -- 3. the bearer token --


async def test_token_refused_and_counted_health_open(serve: Serve) -> None:
    security = Security(token=b"s3cret")
    refused: list[tuple[str, str]] = []

    def refuse(peer: str, method: str) -> None:
        refused.append((peer, method))
        security.refused_call("test_grpc", peer, method)  # as the ext_proc wires it

    async with serve(authorize=security.call_authorized, on_unauthenticated=refuse) as (
        _,
        health,
        channel,
    ):
        await health.set("", SERVING)
        sized = bytes_call(channel, "/test.Echo/Sized")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(sized(BytesValue(value=b"3")))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert int(grpc.StatusCode.UNAUTHENTICATED.value[0]) == UNAUTHENTICATED
        assert [method for _, method in refused] == ["/test.Echo/Sized"]
        assert "127.0.0.1" in refused[0][0]

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(sized(BytesValue(value=b"3"), metadata=(("authorization", "Bearer wrong"),)))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(refused) == 2

        reply = await within(sized(BytesValue(value=b"3"), metadata=(("authorization", "Bearer s3cret"),)))
        assert reply.value == pattern(3, 7)
        # health needs no token
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await within(stub.Check(health_pb2.HealthCheckRequest(service="")))
        assert answer.status == SERVING
        assert len(refused) == 2
        assert security.stats.refused == {("test_grpc", "unauthenticated"): 2}


# -- 4. a client that cancels --


async def test_client_cancel_runs_the_handlers_finally(serve: Serve, handlers: Handlers) -> None:
    async with serve() as (server, _, channel):
        call = bytes_call(channel, "/test.Echo/Hang", "stream_stream")()
        await call.write(BytesValue(value=b"hello"))
        assert (await within(call.read())).value == b"hello"
        assert handlers.started.is_set()
        assert not handlers.finished.is_set()
        call.cancel()
        await within(handlers.finished.wait())
        await no_stream_left(server)


# -- 5. health --


async def test_health_check_and_watch(serve: Serve) -> None:
    async with serve() as (_, health, channel):
        stub = health_pb2_grpc.HealthStub(channel)
        await health.set("svc", SERVING)
        assert (await within(stub.Check(health_pb2.HealthCheckRequest(service="svc")))).status == SERVING
        await health.set("svc", NOT_SERVING)
        assert (await within(stub.Check(health_pb2.HealthCheckRequest(service="svc")))).status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await within(stub.Check(health_pb2.HealthCheckRequest(service="other")))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert int(grpc.StatusCode.NOT_FOUND.value[0]) == NOT_FOUND

        watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
        assert (await within(watch.read())).status == NOT_SERVING
        await health.set("svc", SERVING)
        assert (await within(watch.read())).status == SERVING
        await health.set("svc", SERVING)  # no change: nothing sent
        await health.set("svc", NOT_SERVING)
        assert (await within(watch.read())).status == NOT_SERVING
        watch.cancel()

        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="later"))
        assert (await within(unknown.read())).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        await health.set("later", SERVING)
        assert (await within(unknown.read())).status == SERVING
        unknown.cancel()


# -- 6. stop --


async def test_stop_cancels_calls_in_flight_and_refuses_new_connections(handlers: Handlers) -> None:
    server, _ = build_server(handlers)
    port = await server.start("127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = bytes_call(channel, "/test.Echo/Hang", "stream_stream")()
        await call.write(BytesValue(value=b"hello"))
        await call.done_writing()  # the handler now waits on nothing the client does
        assert (await within(call.read())).value == b"hello"
        await within(server.stop(0.05))
        assert handlers.finished.is_set()
        assert await within(call.code()) != grpc.StatusCode.OK
    with pytest.raises(OSError):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()


async def test_stop_lets_a_call_finish_within_the_grace(handlers: Handlers) -> None:
    server, _ = build_server(handlers)
    port = await server.start("127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = bytes_call(channel, "/test.Echo/Wait")(BytesValue(value=b"late answer"))
        await within(handlers.started.wait())
        stopping = asyncio.ensure_future(server.stop(TIMEOUT))
        listener = server._server
        assert listener is not None
        await wait_until_async(lambda: not listener.is_serving(), TIMEOUT, "the listener closed")
        assert not stopping.done()  # waiting for the call, within its grace
        handlers.release.set()
        assert (await within(call)).value == b"late answer"
        await within(stopping)


# -- 7. TLS --


async def test_tls_with_alpn_h2(tmp_path: Path, handlers: Handlers) -> None:
    pytest.importorskip("cryptography", reason="the test extra's cryptography package makes the certificates")
    from pilotfish.security_testing import make_pki

    pki = make_pki(tmp_path / "pki")
    security = Security(cert=str(pki.cert), key=str(pki.key), ca=str(pki.ca))  # mutual TLS
    context = security.server_ssl_context(alpn=("h2",))
    assert context is not None
    server, health = build_server(handlers)
    port = await server.start("127.0.0.1", 0, ssl_context=context)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.read_bytes(),
            private_key=pki.client_key.read_bytes(),
            certificate_chain=pki.client_cert.read_bytes(),
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            value = pattern(BIG, 3)
            call = bytes_call(channel, "/test.Echo/Echo", "stream_stream")()
            await within(call.write(BytesValue(value=value)))
            assert (await within(call.read())).value == value
            await call.done_writing()
            assert await within(call.code()) == grpc.StatusCode.OK
            await health.set("", SERVING)
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await within(stub.Check(health_pb2.HealthCheckRequest()))).status == SERVING
        # ALPN selected h2 (grpc would have refused the server otherwise: "missing selected ALPN")
        client = ssl.create_default_context(cafile=str(pki.ca))
        client.load_cert_chain(pki.client_cert, pki.client_key)
        client.set_alpn_protocols(["http/1.1", "h2"])
        _, writer = await within(asyncio.open_connection("127.0.0.1", port, ssl=client))
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        writer.close()
        # a client without a certificate does not get through mutual TLS
        anonymous = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await within(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0.5)
