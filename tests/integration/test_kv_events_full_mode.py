"""Engine KV events reach the live scheduler: real Redis, simulated engines with llumlets publishing
vLLM-format KV events over ZMQ, and the scheduler service in full mode with cache-aware scheduling.

A long prompt is served on one engine without passing through the scheduler (as if another
scheduler replica had placed it), so the dispatch feed never saw it; only the engine's KV events
can tell the scheduler where that prefix is cached. Every wait is on a condition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import grpc
import pytest

from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.procs import free_port, free_port_block
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.services import RunningService
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import serve_engines
from pilotfish.simulator.tokens import fallback_token_ids

pytestmark = pytest.mark.integration

CLUSTER = "kvsub"
GATEWAY_BLOCK = 64  # coarser than the engines' 16-token blocks, as the gateway's default is


async def settled(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether `condition` holds within `timeout` (False, not an error, when it does not)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    if not await settled(condition, timeout):
        raise AssertionError(f"timed out waiting for {what}")


ENDPOINT: list[str] = []


async def test_kv_events_route_a_shared_prefix_to_the_engine_that_cached_it(redis_service: RunningService) -> None:
    port = free_port_block(2)  # engine i publishes on port + i
    ENDPOINT[:] = [f"tcp://127.0.0.1:{port}"]
    serve = ServeConfig(
        engines=2, base_port=0, cms_url=redis_service.url, cms_cluster=CLUSTER, kv_events_endpoint=ENDPOINT[0]
    )
    config = SchedulerConfig(
        enable_full_mode_scheduling=True,
        enable_cache_aware_scheduling=True,
        kv_events_prefix_block_size=GATEWAY_BLOCK,
        redis_url=redis_service.url,
        cms_cluster=CLUSTER,
        port=free_port(),
        cms_poll_interval_seconds=0.2,
        fallback_count=1,
    )
    async with serve_engines(serve, EngineConfig(step_ms=2)) as fleet:
        server = SchedulerServer(config)
        await server.start()
        try:
            core = server.core
            await eventually(lambda: len(core.instances()) == 2, "both engines in the view")
            await eventually(lambda: all(i.status is not None for i in core.instances()), "both statuses")
            subscriber = server.kv_events
            assert subscriber is not None
            await eventually(lambda: len(subscriber) == 2, "a KV event subscription per engine")
            index = core.prefix_index
            assert index is not None

            shared = " ".join(f"word{k} of the long shared system prompt" for k in range(120))
            tokens = fallback_token_ids(shared)
            hashes = prefix_block_hashes(tokens, GATEWAY_BLOCK)
            assert len(hashes) >= 4
            # the last engine in id order: on ties (no hit anywhere) the scheduler would pick sim-0
            cached_on = fleet.addresses[1]
            assert cached_on.engine_id == "sim-1"
            assert index.match(hashes) == {}
            async with aiohttp.ClientSession() as session:

                async def ask(prompt: str) -> None:
                    body = {"model": serve.model, "prompt": prompt, "max_tokens": 2}
                    async with session.post(f"{cached_on.url}/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()

                # A SUB socket misses what the engine publishes before its subscription reaches it, and a
                # missed block is never announced again (the blocks after it chain from it): probe with
                # unrelated prompts, each a chain of its own, until one's events land; then the shared one.
                deadline = time.monotonic() + 30
                probe = 0
                while not await settled(lambda: subscriber.stats.applied["stored"] > 0, 1.0):
                    assert time.monotonic() < deadline, f"no KV event reached the scheduler: {subscriber.stats}"
                    probe += 1
                    await ask(" ".join(f"probe{probe} word{k}" for k in range(40)))
                # straight to the engine: the scheduler's dispatch path never records it (same prompt: the
                # engine re-announces blocks only once evicted, so vary an untouched suffix)
                attempt = 0

                def holds() -> bool:
                    return index.match(hashes).get(cached_on.engine_id, 0) >= len(hashes)

                while not holds():
                    assert time.monotonic() < deadline, f"KV events never reached the index: {subscriber.stats}"
                    attempt += 1
                    await ask(f"{shared} question {attempt}")
                    await settled(holds, 1.0)
            assert subscriber.stats.applied["stored"] > 0
            assert not subscriber.stats.dropped

            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                follow_up = fallback_token_ids(f"{shared} a different question")
                decision = await stub.Schedule(
                    scheduler_pb2.ScheduleRequest(
                        request_id="follow-up",
                        model=serve.model,
                        prompt_tokens=len(follow_up),
                        prefix_block_hashes=prefix_block_hashes(follow_up, GATEWAY_BLOCK),
                        prefix_block_size=GATEWAY_BLOCK,
                    )
                )
                assert decision.target.instance_id == cached_on.engine_id
                # control: a prompt cached nowhere goes by load, then id
                other = fallback_token_ids(" ".join(f"unrelated{k} text" for k in range(200)))
                control = await stub.Schedule(
                    scheduler_pb2.ScheduleRequest(
                        request_id="control",
                        model=serve.model,
                        prompt_tokens=len(other),
                        prefix_block_hashes=prefix_block_hashes(other, GATEWAY_BLOCK),
                        prefix_block_size=GATEWAY_BLOCK,
                    )
                )
                assert control.target.instance_id == "sim-0"
        finally:
            await server.stop(grace=1)
