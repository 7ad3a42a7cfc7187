"""The gateway reports ready only after its first discovery sync, against a real Redis store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pilotfish import services
from pilotfish.discovery import open_registry
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.procs import free_port

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING


async def status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.05)
    assert await condition(), what


async def register(url: str, instance_id: str):
    registry = open_registry(url, ttl=5)
    handle = await registry.register_instance("pilotfish", "engine", instance_id=instance_id, host="127.0.0.1", port=1)
    await handle.set_ready(True)
    return registry, handle


def test_not_ready_while_the_discovery_store_has_never_answered(redis_binary: Path, tmp_path: Path) -> None:
    """Discovery's store is down at start: live, not ready; once it answers, ready."""
    redis_port = free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    config = ExtProcConfig(port=free_port(), scheduler_address="", discovery=url, discovery_interval_seconds=0.2)

    async def scenario() -> None:
        server = ExtProcServer(config)
        port = await server.start()
        redis = None
        try:
            assert await status(port, "liveness") == SERVING
            for name in ("readiness", ""):
                assert await status(port, name) != SERVING  # the store has never answered
            redis = await asyncio.to_thread(services.start_redis, tmp_path / "redis", redis_port)

            async def ready() -> bool:
                return await status(port, "readiness") == SERVING

            await wait_for(ready, "readiness once discovery answered")
        finally:
            await server.stop(0)
            if redis is not None:
                redis.stop()

    asyncio.run(scenario())


def test_ready_means_every_listed_engine_is_known(redis_service) -> None:
    config = ExtProcConfig(
        port=free_port(), scheduler_address="", discovery=redis_service.url, discovery_interval_seconds=0.2
    )

    async def scenario() -> None:
        registry, handle = await register(redis_service.url, "e0")
        server = ExtProcServer(config)
        port = await server.start()
        try:

            async def ready() -> bool:
                return await status(port, "readiness") == SERVING

            await wait_for(ready, "readiness")
            assert server.router.pick_round_robin().instance_id == "e0"
        finally:
            await server.stop(0)
            await handle.deregister()
            await registry.close()

    asyncio.run(scenario())
