"""The scheduler's Session on a plain socket (--session-port), driven by the gateway's real client.

A real SchedulerServer in this process and real TCP on loopback; nothing is faked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from pilotfish.config import ConfigError
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, SchedulerUnavailable
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.procs import free_port, wait_until_async
from pilotfish.protos import scheduler_pb2
from pilotfish.protos.session_frames import HELLO, frame
from pilotfish.scheduler.config import SchedulerConfig, validate
from pilotfish.scheduler.service import SchedulerServer

pytestmark = pytest.mark.integration

INSTANCES = ["e0=127.0.0.1:8001", "127.0.0.1:8002"]
TIMEOUT = 30.0  # a loaded machine's bound; a passing run returns as soon as the condition holds


def schedule_request(request_id: str, model: str = "m", prompt_tokens: int = 10) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=request_id, model=model, prompt_tokens=prompt_tokens)


def config(session_port: int) -> SchedulerConfig:
    return SchedulerConfig(
        instances=INSTANCES, model=["m"], port=free_port(), session_port=session_port, fallback_count=1
    )


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    srv = SchedulerServer(config(free_port()))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


def client_of(srv: SchedulerServer, timeout: float = TIMEOUT) -> GrpcScheduler:
    return GrpcScheduler(f"127.0.0.1:{srv.port}", timeout, 0.01, session_address=f"127.0.0.1:{srv.session_port}")


async def test_schedule_report_and_release_ride_the_socket(server: SchedulerServer) -> None:
    client = client_of(server)
    try:
        first = await client.schedule(schedule_request("r1", prompt_tokens=100))
        assert (first.source, first.address, first.fallbacks) == (SCHEDULER, "127.0.0.1:8002", ("127.0.0.1:8001",))
        second = await client.schedule(schedule_request("r2"))
        assert second.address == "127.0.0.1:8001"  # r1's load was counted
        assert server._session_socket is not None and server._session_socket.connections == 1
        with pytest.raises(RequestError) as info:
            await client.schedule(schedule_request("r3", model="x"))
        assert info.value.status == 404  # the error answers its request; the session goes on
        client.report("r1", 7, False)
        await wait_until_async(lambda: server.core.load("127.0.0.1:8002").num_tokens == 107, TIMEOUT, "the report")
        client.release("r1", scheduler_pb2.RELEASE_REASON_FINISHED)
        client.release("r2", scheduler_pb2.RELEASE_REASON_FINISHED)
        await wait_until_async(lambda: server.core.account_size == 0, TIMEOUT, "both released")
        assert server._session_socket.connections == 1  # all of it on one connection
    finally:
        await client.close()


async def test_concurrent_schedules_get_their_own_replies(server: SchedulerServer) -> None:
    client = client_of(server)
    try:
        ids = [f"c{i}" for i in range(50)]
        decisions = await asyncio.gather(*(client.schedule(schedule_request(r)) for r in ids))
        assert all(d.source == SCHEDULER for d in decisions)
        assert server.core.account_size == 50
        # least-loaded alternation: each instance got half, which only holds if every reply reached its own waiter
        counts = {a: sum(d.address == a for d in decisions) for a in ("127.0.0.1:8001", "127.0.0.1:8002")}
        assert counts == {"127.0.0.1:8001": 25, "127.0.0.1:8002": 25}
    finally:
        await client.close()


async def test_broken_framing_drops_that_peer_only(server: SchedulerServer, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.session_port)
    assert await asyncio.wait_for(reader.readexactly(len(HELLO)), TIMEOUT) == HELLO
    with caplog.at_level(logging.WARNING, logger="pilotfish.scheduler.session_server"):
        writer.write(frame(b"\xff\xff\xff"))  # not a SessionRequest
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # disconnected
    assert "is not a SessionRequest; disconnected" in caplog.text
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", server.session_port)
    await reader.readexactly(len(HELLO))
    writer.write((64 * 1024 * 1024).to_bytes(4, "big"))  # a length over the limit: refused before its body
    assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
    writer.close()

    client = client_of(server)  # the scheduler goes on serving everyone else
    try:
        assert (await client.schedule(schedule_request("ok"))).source == SCHEDULER
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("target", "why"),
    [
        # the gRPC port speaks HTTP/2, not HELLO
        ("grpc", "not a Pilotfish scheduler's Session socket"),
        ("closed", "cannot connect"),
    ],
)
async def test_a_port_that_is_not_the_session_socket_fails_fast(server: SchedulerServer, target: str, why: str) -> None:
    port = server.port if target == "grpc" else free_port()
    # a deadline far longer than the wait below: only failing at once passes
    client = GrpcScheduler(f"127.0.0.1:{server.port}", 120.0, 0.01, session_address=f"127.0.0.1:{port}")
    try:
        with pytest.raises(SchedulerUnavailable, match=why):
            await asyncio.wait_for(client.schedule(schedule_request("r")), TIMEOUT)
    finally:
        await client.close()


async def test_a_stop_ends_the_session_and_a_restart_is_found_again() -> None:
    session_port = free_port()
    srv = SchedulerServer(config(session_port))
    await srv.start()
    client = GrpcScheduler(f"127.0.0.1:{srv.port}", TIMEOUT, 0.01, session_address=f"127.0.0.1:{session_port}")
    try:
        assert (await client.schedule(schedule_request("r1"))).source == SCHEDULER
        await asyncio.wait_for(srv.stop(grace=300), timeout=120)  # ends the socket sessions, no waiting out grace
        with pytest.raises(SchedulerUnavailable):
            await client.schedule(schedule_request("r2"))
        srv = SchedulerServer(config(session_port))
        await srv.start()
        assert (await client.schedule(schedule_request("r3"))).source == SCHEDULER  # a new session, same client
    finally:
        await client.close()
        await srv.stop(grace=1)


def test_session_port_must_differ_from_the_other_ports() -> None:
    port = free_port()
    with pytest.raises(ConfigError, match="--session-port"):
        validate(SchedulerConfig(instances=INSTANCES, port=port, session_port=port))


def test_a_bad_session_address_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="--scheduler-session-address: 'nowhere' is not host:port"):
        ExtProcServer(ExtProcConfig(instances=["127.0.0.1:8001"], scheduler_session_address="nowhere"))
