"""Full mode on simulated engines: each engine's llumlet exports its load to a real Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio as aioredis

from pilotfish.cms import keys
from pilotfish.cms.records import decode_metadata, decode_status
from pilotfish.services import RunningService
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import serve_engines

pytestmark = pytest.mark.integration


async def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if value := await condition():
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_simulated_engine_exports_status_that_follows_its_requests(redis_service: RunningService) -> None:
    serve = ServeConfig(engines=1, base_port=0, cms_url=redis_service.url, cms_cluster="sim")
    async with serve_engines(serve, EngineConfig(step_ms=5)) as fleet, aioredis.from_url(redis_service.url) as r:
        engine = fleet.addresses[0]

        async def status():
            raw = await r.get(keys.status_key("sim", engine.engine_id))
            return None if raw is None else decode_status(raw, engine.engine_id)

        meta = decode_metadata(await wait_for(lambda: r.get(keys.meta_key("sim", engine.engine_id)), "metadata"))
        assert (meta.host, meta.http_port) == ("127.0.0.1", engine.port)

        async with aiohttp.ClientSession() as session:
            body = {"model": serve.model, "prompt": "hello there", "max_tokens": 200, "stream": True}
            headers = {"x-request-id": "full-1"}
            async with session.post(f"{engine.url}/v1/completions", json=body, headers=headers) as resp:

                async def running():
                    s = await status()
                    return s if s is not None and s.num_running == 1 else None

                seen = await wait_for(running, "the request running in the exported status")
                assert seen.used_kv_tokens > 0
                assert any("full-1" in rid for rid in seen.admitted_request_ids)
                await resp.read()

        async def idle():
            s = await status()
            return s is not None and s.num_running == 0 and s.num_waiting == 0

        await wait_for(idle, "the engine idle again in the exported status")
