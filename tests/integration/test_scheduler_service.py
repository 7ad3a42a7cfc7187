"""The scheduler's gRPC service, in-process and as `pilotfish scheduler`, driven by the generated stub."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, SchedulerUnavailable
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.procs import Child, free_port, wait_until, wait_until_async
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SERVICE_NAME, SchedulerServer

pytestmark = pytest.mark.integration

INSTANCES = ["e0=127.0.0.1:8001", "127.0.0.1:8002"]


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    config = SchedulerConfig(
        instances=INSTANCES, model=["m"], port=free_port(), metrics_port=free_port(), fallback_count=1
    )
    srv = SchedulerServer(config)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


@pytest.fixture
async def channel(server: SchedulerServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def schedule_request(request_id: str, model: str = "m", prompt_tokens: int = 10) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=request_id, model=model, prompt_tokens=prompt_tokens)


async def test_schedule_report_release_round_trip(server: SchedulerServer, channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    first = await stub.Schedule(schedule_request("r1", prompt_tokens=100))
    assert (first.target.instance_id, first.target.address) == ("127.0.0.1:8002", "127.0.0.1:8002")
    assert [(f.instance_id, f.address) for f in first.fallbacks] == [("e0", "127.0.0.1:8001")]
    assert not first.HasField("decode_target")
    # dispatch counted the load: the next request goes to the other instance
    second = await stub.Schedule(schedule_request("r2"))
    assert second.target.instance_id == "e0"
    # a retried Schedule gets the same answer and is not counted twice
    assert await stub.Schedule(schedule_request("r1", prompt_tokens=100)) == first
    assert server.core.account_size == 2

    report = await stub.Report(
        scheduler_pb2.ReportRequest(
            reports=[
                scheduler_pb2.TokenReport(request_id="r1", generated_tokens=7, prefill_done=True),
                scheduler_pb2.TokenReport(request_id="ghost", generated_tokens=1),
            ]
        )
    )
    assert report.unknown_requests == 1
    assert server.core.load("127.0.0.1:8002").num_tokens == 107

    released = await stub.Release(
        scheduler_pb2.ReleaseRequest(request_id="r1", reason=scheduler_pb2.RELEASE_REASON_FINISHED)
    )
    assert released.found
    assert server.core.load("127.0.0.1:8002").num_tokens == 0
    again = await stub.Release(scheduler_pb2.ReleaseRequest(request_id="r1"))
    assert not again.found


@pytest.mark.parametrize(
    ("call", "code", "detail"),
    [
        ("schedule-unknown-model", grpc.StatusCode.NOT_FOUND, "model 'x' is not served here"),
        ("schedule-empty-id", grpc.StatusCode.INVALID_ARGUMENT, "request_id is required"),
        ("release-empty-id", grpc.StatusCode.INVALID_ARGUMENT, "request_id is required"),
    ],
)
async def test_error_codes(channel: grpc.aio.Channel, call: str, code: grpc.StatusCode, detail: str) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if call == "schedule-unknown-model":
            await stub.Schedule(schedule_request("r", model="x"))
        elif call == "schedule-empty-id":
            await stub.Schedule(schedule_request(""))
        else:
            await stub.Release(scheduler_pb2.ReleaseRequest(request_id=""))
    assert info.value.code() == code
    assert detail in (info.value.details() or "")


async def test_session_carries_schedule_report_and_release(server: SchedulerServer, channel: grpc.aio.Channel) -> None:
    call = scheduler_pb2_grpc.SchedulerStub(channel).Session()
    await call.initial_metadata()  # sent before any message: a gateway knows the stream is up
    await call.write(scheduler_pb2.SessionRequest(seq=1, schedule=schedule_request("r1", prompt_tokens=100)))
    await call.write(scheduler_pb2.SessionRequest(seq=2, schedule=schedule_request("r2")))
    await call.write(scheduler_pb2.SessionRequest(seq=3, schedule=schedule_request("r3", model="x")))
    replies = {}
    for _ in range(3):
        reply = await call.read()
        replies[reply.seq] = reply
    assert replies[1].schedule.target.instance_id == "127.0.0.1:8002"
    assert replies[2].schedule.target.instance_id == "e0"  # r1's load was counted
    # an error answers its request only, as the unary call's status would; the stream goes on
    assert replies[3].WhichOneof("kind") == "error"
    assert replies[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "model 'x' is not served here" in replies[3].error.message

    report = scheduler_pb2.ReportRequest(reports=[scheduler_pb2.TokenReport(request_id="r1", generated_tokens=7)])
    await call.write(scheduler_pb2.SessionRequest(report=report))
    await wait_until_async(lambda: server.core.load("127.0.0.1:8002").num_tokens == 107, 30, "the report applied")
    await call.write(scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id="r1")))
    await call.write(scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id="")))  # dropped
    await call.write(scheduler_pb2.SessionRequest(seq=4, schedule=schedule_request("r4")))
    fourth = await call.read()
    # messages are served in order: r1's release came first, so its instance is the least loaded again
    assert (fourth.seq, fourth.schedule.target.instance_id) == (4, "127.0.0.1:8002")
    assert server.core.load("127.0.0.1:8002").num_tokens == 10  # r4's prompt only
    assert server.core.account_size == 2  # r2 and r4
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_gateway_client_uses_the_session_and_a_stop_ends_it() -> None:
    config = SchedulerConfig(instances=INSTANCES, model=["m"], port=free_port(), fallback_count=1)
    srv = SchedulerServer(config)
    await srv.start()
    client = GrpcScheduler(f"127.0.0.1:{srv.port}", 10.0, 0.01)
    try:
        first = await client.schedule(schedule_request("r1"))
        assert first.source == SCHEDULER and first.address in ("127.0.0.1:8001", "127.0.0.1:8002")
        with pytest.raises(RequestError) as info:
            await client.schedule(schedule_request("r2", model="x"))
        assert info.value.status == 404
        client.release("r1", scheduler_pb2.RELEASE_REASON_FINISHED)
        await wait_until_async(lambda: srv.core.account_size == 0, 30, "r1 released over the session")
        # a stop ends open sessions rather than wait out its grace for them
        await asyncio.wait_for(srv.stop(grace=300), timeout=120)
        with pytest.raises(SchedulerUnavailable):
            await client.schedule(schedule_request("r3"))
    finally:
        await client.close()
        await srv.stop(grace=1)


async def test_no_instances_is_unavailable_with_reason() -> None:
    srv = SchedulerServer(SchedulerConfig(model=["m"], port=free_port()))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scheduler_pb2_grpc.SchedulerStub(ch).Schedule(schedule_request("r"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no instance serves model 'm'" in (info.value.details() or "")
    finally:
        await srv.stop(grace=1)


@pytest.mark.parametrize("service", ["", SERVICE_NAME])
async def test_health_serving(channel: grpc.aio.Channel, service: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    response = await health.Check(health_pb2.HealthCheckRequest(service=service))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_metrics_endpoint(server: SchedulerServer, channel: grpc.aio.Channel) -> None:
    await scheduler_pb2_grpc.SchedulerStub(channel).Schedule(schedule_request("r"))
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    # urllib blocks; the server lives on this loop, so fetch from a thread
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert "pilotfish_scheduler_decision_seconds_count 1.0" in text
    assert 'pilotfish_scheduler_dispatch_total{engine="127.0.0.1:8002"} 1.0' in text
    assert "pilotfish_scheduler_account_size 1.0" in text


# -- the real command ---------------------------------------------------------------------------------


@pytest.fixture
def scheduler_process(tmp_path: Path) -> Iterator[tuple[Child, int]]:
    port = free_port()
    child = Child(
        "scheduler",
        [
            sys.executable,
            "-m",
            "pilotfish",
            "scheduler",
            "--port",
            str(port),
            "--instances",
            ",".join(INSTANCES),
            "--model",
            "m",
        ],
        log_path=tmp_path / "scheduler.log",
    )
    try:
        yield child, port
    finally:
        child.stop()


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            response = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1
            )
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


def test_command_serves_and_stops_on_sigterm(scheduler_process: tuple[Child, int]) -> None:
    child, port = scheduler_process
    wait_until(lambda: _serving(port), 30, "pilotfish scheduler", alive=child.exited)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        decision = scheduler_pb2_grpc.SchedulerStub(ch).Schedule(schedule_request("r1"), timeout=5)
    assert decision.target.address in {"127.0.0.1:8001", "127.0.0.1:8002"}
    os.kill(child.pid, signal.SIGTERM)
    assert child.proc.wait(10) == 0
    log = child.log_path.read_text() if child.log_path else ""
    assert f"scheduler listening on 127.0.0.1:{port}" in log


def test_port_in_use_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pilotfish", "scheduler", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(port) in lines[0] and "address in use" in lines[0]
    assert "Traceback" not in result.stderr
