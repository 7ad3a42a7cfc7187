"""The scheduler's listeners under the attacks of issue 27: a real SchedulerServer in this process,
real TCP and real gRPC on loopback. Every wait is on a condition (the server closes the socket, a
counter moves); the timeouts are only a loaded machine's bound."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator

import grpc
import pytest

from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.procs import free_port, wait_until_async
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.protos.session_frames import HELLO, frame
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
CAP = 4


async def started(**fields: object) -> SchedulerServer:
    config = SchedulerConfig(
        instances=["e0=127.0.0.1:8001", "e1=127.0.0.1:8002"],
        model=["m"],
        port=free_port(),
        session_port=free_port(),
        **fields,  # type: ignore[arg-type]
    )
    server = SchedulerServer(config)
    await server.start()
    return server


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    srv = await started(
        session_max_connections=CAP,
        session_idle_timeout_seconds=1.0,
        session_frame_timeout_seconds=1.0,
        max_message_bytes=64 * 1024,
    )
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Read until the server ends the connection (EOF or reset); True once it has."""
    try:
        async with asyncio.timeout(TIMEOUT):
            while await reader.read(65536):
                pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


async def hold_unfinished_frame(
    port: int, announced: int, sent: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(struct.pack("!I", announced) + b"\0" * sent)
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        await writer.drain()
    return reader, writer


async def test_twenty_connections_holding_4mb_frames_are_closed(server: SchedulerServer) -> None:
    """The demonstrated attack: 20 connections, each holding an unfinished 4 MB frame."""
    port = server.session_port
    conns = [await hold_unfinished_frame(port, 4 * 1024 * 1024, 4 * 1024 * 1024 - 1) for _ in range(20)]
    # every one is closed: beyond the cap at once, within it at the header (over the frame limit)
    assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in conns)))
    stats = server._servicer.stats
    await wait_until_async(lambda: stats.session_connections() == 0, TIMEOUT, "every attacking connection gone")
    assert stats.session_closed["connection_cap"] + stats.session_closed["frame_too_large"] == 20
    assert stats.session_closed["frame_too_large"] >= 1
    assert server._session_socket is not None and server._session_socket.buffered == 0
    for _, writer in conns:
        writer.close()


async def test_slow_and_idle_connections_are_closed_after_their_timeouts(server: SchedulerServer) -> None:
    port = server.session_port
    slow = await hold_unfinished_frame(port, 1000, 10)  # within the limit, never finished
    idle = await asyncio.open_connection("127.0.0.1", port)  # says nothing at all
    assert await idle[0].readexactly(len(HELLO)) == HELLO
    assert await closed_by_server(slow[0]) and await closed_by_server(idle[0])
    stats = server._servicer.stats
    await wait_until_async(
        lambda: stats.session_closed["frame_timeout"] == 1 and stats.session_closed["idle_timeout"] == 1,
        TIMEOUT,
        "both timeouts counted",
    )
    for _, writer in (slow, idle):
        writer.close()


async def test_the_connection_cap_refuses_the_one_beyond_and_a_gateway_still_gets_in(server: SchedulerServer) -> None:
    port = server.session_port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP)]
    for reader, _ in held:
        assert await reader.readexactly(len(HELLO)) == HELLO
    extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
    assert await extra_reader.read() == b""  # closed at once, no HELLO
    assert server._servicer.stats.session_closed["connection_cap"] == 1
    for _, writer in held:
        writer.close()
    extra_writer.close()
    stats = server._servicer.stats
    await wait_until_async(lambda: stats.session_connections() == 0, TIMEOUT, "the held connections gone")
    # a real gateway's session works, frames and all
    client = GrpcScheduler(f"127.0.0.1:{server.port}", TIMEOUT, 0.01, session_address=f"127.0.0.1:{port}")
    try:
        decision = await client.schedule(scheduler_pb2.ScheduleRequest(request_id="g1", model="m", prompt_tokens=5))
        assert decision.address in ("127.0.0.1:8001", "127.0.0.1:8002")
    finally:
        await client.close()


async def test_a_frame_carrying_a_forged_schedule_gets_invalid_argument_over_the_socket(
    server: SchedulerServer,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.session_port)
    assert await reader.readexactly(len(HELLO)) == HELLO
    forged = scheduler_pb2.ScheduleRequest(request_id="f", model="m", prompt_tokens=4_000_000_000)
    writer.write(frame(scheduler_pb2.SessionRequest(seq=1, schedule=forged).SerializeToString()))
    (length,) = struct.unpack("!I", await reader.readexactly(4))
    reply = scheduler_pb2.SessionResponse.FromString(await reader.readexactly(length))
    assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert server.core.account_size == 0
    writer.close()


async def test_grpc_limits_message_size_rates_and_forged_schedules() -> None:
    srv = await started(max_message_bytes=64 * 1024, peer_schedule_rate=1.0, peer_rate_burst_seconds=3.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            # attack (ii), first part: a forged huge prompt is refused and holds nothing
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Schedule(
                    scheduler_pb2.ScheduleRequest(request_id="f", model="m", prompt_tokens=4_000_000_000)
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # a message over the limit never reaches the handler
            big = scheduler_pb2.ScheduleRequest(request_id="b", model="m", candidate_addresses=["x" * 70_000])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Schedule(big)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # the burst is 3 Schedules (1/s for 3 s; the forged one counted): then RESOURCE_EXHAUSTED,
            # answered by the scheduler (the trailer), so the gateway answers 429 and does not fall back
            await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r1", model="m", prompt_tokens=5))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                for i in range(5):
                    await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id=f"r{i + 2}", model="m"))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("pilotfish-answered", "1") in tuple(info.value.trailing_metadata() or ())
        stats = srv._servicer.stats
        assert stats.refused[("schedule", "prompt_tokens")] == 1 and stats.refused[("schedule", "rate_limited")] == 1
    finally:
        await srv.stop(grace=1)


async def test_grpc_connection_cap() -> None:
    """grpc.max_allowed_incoming_connections: the connection beyond the cap gets no call through."""
    srv = await started(grpc_max_connections=2)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]  # fmt: skip
    try:
        request = scheduler_pb2.ReleaseRequest(request_id="nothing")
        for channel in channels[:2]:
            assert not (await scheduler_pb2_grpc.SchedulerStub(channel).Release(request, timeout=TIMEOUT)).found
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.SchedulerStub(channels[2]).Release(request, timeout=3)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        for channel in channels:
            await channel.close()
        await srv.stop(grace=1)
