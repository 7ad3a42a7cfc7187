"""Scheduler and gateway follow discovery: engines registered in a real Redis become routable, and leave."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pilotfish.discovery import open_registry
from pilotfish.procs import wait_until
from pilotfish.services import RunningService
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"


def serving_engines(stack: Stack, attempts: int = 8) -> set[str]:
    """Which engines answer through Envoy now, chosen by the scheduler (empty set when none is)."""

    async def run() -> set[str]:
        # concurrent, so the scheduler sees load and spreads them (idle ties go to the same instance)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def one(i: int) -> str | None:
                body = {"model": MODEL, "prompt": f"d {i}", "max_tokens": 8}
                async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200 and resp.headers["x-pilotfish-route"] == "scheduler":
                        return resp.headers["x-pilotfish-engine"]
                    return None

            return {e for e in await asyncio.gather(*(one(i) for i in range(attempts))) if e}

    return asyncio.run(run())


def test_scheduler_and_gateway_route_to_what_discovery_reports(make_stack, redis_service: RunningService) -> None:
    stack = make_stack(engines=2, discovery_url=redis_service.url)
    (id0, port0), (id1, port1) = stack.engines

    async def register(which: list[tuple[str, int]]) -> tuple:
        registry = open_registry(redis_service.url, ttl=3)
        handles = []
        for instance_id, port in which:
            handle = await registry.register_instance("pilotfish", "engine", instance_id=instance_id,
                                                      host="127.0.0.1", port=port)
            await handle.set_ready(True)
            handles.append(handle)
        return registry, handles

    async def scenario() -> None:
        registry, handles = await register([(id0, port0)])
        await asyncio.to_thread(wait_until, lambda: serving_engines(stack) == {id0}, 60, "engine 0 routable")
        registry1, (h1,) = await register([(id1, port1)])
        await asyncio.to_thread(wait_until, lambda: serving_engines(stack) == {id0, id1}, 60, "both routable")
        await handles[0].deregister()
        await asyncio.to_thread(wait_until, lambda: serving_engines(stack) == {id1}, 60, "engine 0 gone")
        await h1.deregister()
        await registry.close()
        await registry1.close()

    asyncio.run(scenario())
