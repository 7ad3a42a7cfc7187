"""Both deployment modes end to end over a real Redis CMS, with fake llumlets answering Migrate.

The view comes from real CMS records (cms.writer.CmsWriter, as a llumlet writes them) read by the
real CMS reader; only the llumlets' gRPC side is a stand-in, so the tests can see exactly what the
rescheduler sends (fields, bearer token) and what it counts. That fake neighbour is why these live
under tests/unit; tests/integration/test_rescheduler_llumlets.py drives real llumlets.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest

from pilotfish.cms.writer import CmsWriter
from pilotfish.procs import free_port
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

CLUSTER = "resched"
WAIT = 30.0


async def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class FakeLlumlet(llumlet_pb2_grpc.LlumletServicer):
    def __init__(self) -> None:
        self.calls: list[tuple[llumlet_pb2.MigrateRequest, dict[str, Any]]] = []

    async def Migrate(self, request: llumlet_pb2.MigrateRequest, context: Any) -> llumlet_pb2.MigrateResponse:
        self.calls.append((request, dict(context.invocation_metadata())))
        return llumlet_pb2.MigrateResponse(migrated_request_ids=[f"r{len(self.calls)}"])


@pytest.fixture
async def fake_llumlets() -> AsyncIterator[dict[str, tuple[FakeLlumlet, int]]]:
    """hot and cold: a llumlet servicer each, on its own free loopback port."""
    servers, fakes = [], {}
    for name in ("hot", "cold"):
        fake, server = FakeLlumlet(), grpc.aio.server()
        llumlet_pb2_grpc.add_LlumletServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        fakes[name] = (fake, port)
    yield fakes
    for server in servers:
        await server.stop(0)


@pytest.fixture
def cms(redis_service: RunningService, fake_llumlets: dict[str, tuple[FakeLlumlet, int]]) -> Iterator[None]:
    """hot (KV 90% used) and cold (10%) decode instances in the CMS, as their llumlets write them."""
    writers = []
    for name, load in (("hot", 0.9), ("cold", 0.1)):
        writer = CmsWriter(redis_service.url, CLUSTER, name, ttl_ms=600_000)
        writers.append(writer)
        writer.write_metadata(
            cms_pb2.InstanceMetadata(
                instance_id=name,
                host="127.0.0.1",
                http_port=8000,
                llumlet_port=fake_llumlets[name][1],
                infer_type=cms_pb2.INFER_TYPE_DECODE,
                model="m",
                update_id=1,
                timestamp_ms=int(time.time() * 1000),
            )
        )
        writer.write_status(
            cms_pb2.InstanceStatus(
                instance_id=name,
                update_id=1,
                timestamp_ms=int(time.time() * 1000),
                schedulable=True,
                num_running=8,
                num_running_decode=8,
                used_kv_tokens=round(load * 10_000),
                total_kv_tokens=10_000,
            )
        )
    yield
    for writer in writers:
        writer.close()


RESCHEDULING = {
    "rescheduling_policies": ["decode_load"],
    "rescheduling_interval_ms": 50,
    "instance_staleness_seconds": 600.0,  # the records are written once
    "cms_poll_interval_seconds": 0.5,
    "llumlet_token": "tok",
}


def migrations(fake: FakeLlumlet) -> list[tuple[str, str, str, str]]:
    return [
        (r.source_instance_id, r.destination_instance_id, r.reason, md.get("authorization", "")) for r, md in fake.calls
    ]


async def test_standalone_rescheduler_plans_from_the_cms_and_calls_migrate(
    redis_service: RunningService, cms: None, fake_llumlets: dict[str, tuple[FakeLlumlet, int]]
) -> None:
    hot, cold = fake_llumlets["hot"][0], fake_llumlets["cold"][0]
    metrics_port = free_port()
    flags: list[str] = []
    for key, value in RESCHEDULING.items():
        flags += [f"--{key.replace('_', '-')}", ",".join(value) if isinstance(value, list) else str(value)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pilotfish",
        "rescheduler",
        "--redis-url",
        redis_service.url,
        "--cms-cluster",
        CLUSTER,
        "--metrics-port",
        str(metrics_port),
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), WAIT)).decode()
        assert line.startswith("rescheduler running every 50 ms (decode_load)"), line
        await eventually(lambda: len(hot.calls) >= 2, "Migrate calls on the hot instance's llumlet")
        assert set(migrations(hot)) == {("hot", "cold", "decode_load", "Bearer tok")}
        assert cold.calls == []

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                return response.read().decode()

        text = await asyncio.to_thread(scrape)
        assert 'pilotfish_rescheduling_migrated_requests_total{policy="decode_load"}' in text
        assert "pilotfish_rescheduling_failed_total" in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.stderr is not None
    assert b"Traceback" not in await proc.stderr.read()


async def test_colocated_scheduler_runs_the_loop_over_its_own_view(
    redis_service: RunningService, cms: None, fake_llumlets: dict[str, tuple[FakeLlumlet, int]]
) -> None:
    hot = fake_llumlets["hot"][0]
    config = SchedulerConfig(
        enable_full_mode_scheduling=True,
        enable_rescheduling=True,
        redis_url=redis_service.url,
        cms_cluster=CLUSTER,
        port=free_port(),
        **RESCHEDULING,  # type: ignore[arg-type]
    )
    server = SchedulerServer(config)
    await server.start()
    try:
        def migrated() -> float:
            value = server.core.registry.get_sample_value(
                "pilotfish_rescheduling_migrated_requests_total", {"policy": "decode_load"}
            )
            return value or 0.0

        # The fake records a call before its answer reaches the rescheduler, which counts on the answer:
        # wait for the count itself, not only for the calls.
        await eventually(lambda: migrated() >= 2, "migrations counted by the scheduler process")
        assert len(hot.calls) >= 2
        assert set(migrations(hot)) == {("hot", "cold", "decode_load", "Bearer tok")}
    finally:
        await server.stop(grace=1)


def test_standalone_needs_redis() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "pilotfish", "rescheduler"], capture_output=True, text=True, timeout=WAIT
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pilotfish rescheduler: error: --redis-url: the rescheduler reads the CMS from Redis; give its URL"
    )
