"""Request messages that are not protobufs (pilotfish/grpc_malformed.py): on every method of the
scheduler's gRPC port and of the ext_proc's grpc.aio server, INVALID_ARGUMENT, counted, logged at
WARNING once however many come, and the server answers the next good call. Real grpc.aio servers
on loopback, raw bytes through a channel's identity serializers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.grpc_malformed import MalformedRequests
from pilotfish.procs import free_port, wait_until_async
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer, malformed_call
from pilotfish.security import write_secret

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a varint longer than ten bytes: no protobuf decodes it
TIMEOUT = 30.0  # a loaded machine's bound on one call, never waited out
TOKEN = "the-token-of-the-test"


def refused(registry: object, call: str) -> float:
    value = registry.get_sample_value(  # type: ignore[attr-defined]
        "pilotfish_scheduler_refused_total", {"call": call, "reason": "malformed"}
    )
    return value or 0.0


async def sent(channel: grpc.aio.Channel, path: str, streaming: tuple[bool, bool]) -> grpc.StatusCode:
    """Send GARBAGE to `path` as a call of its kind (requests streamed, responses streamed); its status."""
    requests_streamed, responses_streamed = streaming
    if requests_streamed:

        async def one() -> AsyncIterator[bytes]:
            yield GARBAGE

        if responses_streamed:
            call: grpc.aio.Call = channel.stream_stream(path)(one())
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            call = channel.stream_unary(path)(one())
            await call
    elif responses_streamed:
        call = channel.unary_stream(path)(GARBAGE)
        async for _ in call:  # type: ignore[attr-defined]
            pass
    else:
        call = channel.unary_unary(path)(GARBAGE)
        await call
    return await call.code()


async def status_of(channel: grpc.aio.Channel, path: str, streaming: tuple[bool, bool]) -> tuple[grpc.StatusCode, str]:
    try:
        code = await asyncio.wait_for(sent(channel, path, streaming), TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return code, ""


@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerServer]:
    server = SchedulerServer(SchedulerConfig(instances=["e0=127.0.0.1:8001"], model=["m"], port=0))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


SCHEDULER_METHODS = [
    ("/pilotfish.v1.Scheduler/Schedule", (False, False), "schedule"),
    ("/pilotfish.v1.Scheduler/Report", (False, False), "report"),
    ("/pilotfish.v1.Scheduler/Release", (False, False), "release"),
    ("/pilotfish.v1.Scheduler/Session", (True, True), "session"),
    ("/grpc.health.v1.Health/Check", (False, False), "health"),
    ("/grpc.health.v1.Health/Watch", (False, True), "health"),
]


@pytest.mark.parametrize(("path", "streaming", "call"), SCHEDULER_METHODS)
async def test_each_scheduler_method_answers_garbage_invalid_argument_and_counts_it(
    scheduler: SchedulerServer, path: str, streaming: tuple[bool, bool], call: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert malformed_call(path) == call
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        code, details = await status_of(channel, path, streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a valid" in details
        assert refused(scheduler.core.registry, call) == 1
        # and the next good call is served
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        reply = await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r1", model="m"), timeout=TIMEOUT)
        assert reply.target.instance_id == "e0"
    assert errors(caplog) == []


async def test_fifty_garbage_schedules_log_one_line_and_count_fifty(
    scheduler: SchedulerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        codes = [await status_of(channel, "/pilotfish.v1.Scheduler/Schedule", (False, False)) for _ in range(50)]
        assert {code for code, _ in codes} == {grpc.StatusCode.INVALID_ARGUMENT}
        assert refused(scheduler.core.registry, "schedule") == 50
        logged = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert len(logged) == 1 and logged[0].levelno == logging.WARNING
        assert "/pilotfish.v1.Scheduler/Schedule" in logged[0].getMessage()
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        reply = await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r1", model="m"), timeout=TIMEOUT)
        assert reply.target.instance_id == "e0"


async def test_a_good_session_is_served_through_the_guard_and_ends_cleanly(scheduler: SchedulerServer) -> None:
    """The Session's replies pass the guard's wrapper, and a Session the gateway cancels leaves nothing open."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        outbox: asyncio.Queue[scheduler_pb2.SessionRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[scheduler_pb2.SessionRequest]:
            while (message := await outbox.get()) is not None:
                yield message

        session = scheduler_pb2_grpc.SchedulerStub(channel).Session(requests())
        for seq in (1, 2):
            schedule = scheduler_pb2.ScheduleRequest(request_id=f"r{seq}", model="m")
            outbox.put_nowait(scheduler_pb2.SessionRequest(seq=seq, schedule=schedule))
            reply = await asyncio.wait_for(session.read(), TIMEOUT)
            assert (reply.seq, reply.schedule.target.instance_id) == (seq, "e0")
        assert len(scheduler._servicer._sessions) == 1
        session.cancel()
        sessions = scheduler._servicer._sessions
        await wait_until_async(lambda: not sessions, TIMEOUT, "the servicer's `finally` ran")


async def test_with_a_token_the_token_is_judged_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = write_secret(tmp_path / "token", TOKEN)
    config = SchedulerConfig(instances=["e0=127.0.0.1:8001"], model=["m"], port=0, auth_token_file=str(token))
    server = SchedulerServer(config)
    await server.start()
    path = "/pilotfish.v1.Scheduler/Schedule"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary(path)
            with pytest.raises(grpc.aio.AioRpcError) as without:
                await call(GARBAGE, timeout=TIMEOUT)
            assert without.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused(server.core.registry, "schedule") == 0
            with pytest.raises(grpc.aio.AioRpcError) as with_token:
                await call(GARBAGE, timeout=TIMEOUT, metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert with_token.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused(server.core.registry, "schedule") == 1
    finally:
        await server.stop(0)
    assert errors(caplog) == []


# -- the rate of the log line ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def health_behind_guard() -> AsyncIterator[tuple[grpc.aio.Channel, Clock, list[str]]]:
    clock, methods = Clock(), []
    server = grpc.aio.server(interceptors=[MalformedRequests(methods.append, "test", clock)])
    health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, clock, methods
    finally:
        await server.stop(0)


class _Health(health_pb2_grpc.HealthServicer):
    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def test_the_warning_comes_at_most_once_a_minute_the_rest_at_debug(
    health_behind_guard: tuple[grpc.aio.Channel, Clock, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    channel, clock, methods = health_behind_guard
    caplog.set_level(logging.DEBUG, logger="pilotfish.grpc_malformed")
    check = "/grpc.health.v1.Health/Check"

    async def garbage() -> None:
        code, _ = await status_of(channel, check, (False, False))
        assert code == grpc.StatusCode.INVALID_ARGUMENT

    def levels() -> list[int]:
        return [r.levelno for r in caplog.records if r.name == "pilotfish.grpc_malformed"]

    for _ in range(3):
        await garbage()
    assert levels() == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    clock.now += 59.0
    await garbage()
    assert levels()[-1] == logging.DEBUG
    clock.now += 1.0
    await garbage()
    assert levels()[-1] == logging.WARNING
    assert methods == [check] * 5
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- the ext_proc's grpc.aio server (--grpc-server grpcio) -----------------------------------------------


@pytest.fixture
async def ext_proc() -> AsyncIterator[ExtProcServer]:
    config = ExtProcConfig(
        port=free_port(), grpc_server="grpcio", scheduler_address="", instances=["e0=127.0.0.1:9"], model=["m"]
    )
    server = ExtProcServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


def ext_proc_refused(server: ExtProcServer) -> float:
    value = server.metrics.registry.get_sample_value("pilotfish_ext_proc_grpc_refused_total", {"reason": "malformed"})
    return value or 0.0


EXT_PROC_METHODS = [
    ("/envoy.service.ext_proc.v3.ExternalProcessor/Process", (True, True)),
    ("/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs", (True, False)),
    ("/grpc.health.v1.Health/Check", (False, False)),
]


@pytest.mark.parametrize(("path", "streaming"), EXT_PROC_METHODS)
async def test_each_ext_proc_method_answers_garbage_invalid_argument_and_counts_it(
    ext_proc: ExtProcServer, path: str, streaming: tuple[bool, bool], caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext_proc.port}") as channel:
        code, _ = await status_of(channel, path, streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert ext_proc_refused(ext_proc) == 1
        assert ext_proc.metrics.active_streams._value.get() == 0  # the processor's `finally` ran
        # the next good call is served: an access-log stream of one message
        logs = channel.stream_unary(
            "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
            request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
        )

        def one() -> Iterator[als_pb2.StreamAccessLogsMessage]:
            yield als_pb2.StreamAccessLogsMessage()

        await logs(one(), timeout=TIMEOUT)
    assert errors(caplog) == []
