"""`pilotfish rescheduler` against real llumlets: two simulated engines, each with its llumlet writing the
CMS in a real Redis and serving Migrate over gRPC. The rescheduler process plans from those records
and moves requests from the loaded engine to the idle one; every client stream stays whole.

Waits are on conditions, bounded by generous timeouts.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from pilotfish.services import RunningService
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import serve_engines
from pilotfish.simulator.tokens import WORDS

pytestmark = pytest.mark.integration

TIMEOUT_S = 120.0
CLUSTER = "resched-int"
MODEL = "pilotfish-sim"


async def wait_for(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def stream(session: aiohttp.ClientSession, url: str, request_id: str, max_tokens: int) -> list[str]:
    """One streamed completion; returns its token texts, after checking it ended once, by length."""
    body = {"model": MODEL, "prompt": "tell me a long story " * 8, "max_tokens": max_tokens, "stream": True}
    texts, finishes, done = [], [], 0
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done += 1
                continue
            choice = json.loads(data)["choices"][0]
            if choice["text"]:
                texts.append(choice["text"])
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    assert (finishes, done) == (["length"], 1)
    return texts


async def test_standalone_rescheduler_moves_requests_between_real_llumlets(redis_service: RunningService) -> None:
    n = 300
    engine = EngineConfig(
        step_ms=10, prefill_ms_per_token=0, decode_ms_per_token=0, max_num_seqs=8, max_model_len=4096,
        num_gpu_blocks=2048,
    )  # fmt: skip
    serve = ServeConfig(engines=2, base_port=0, cms_url=redis_service.url, cms_cluster=CLUSTER)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with serve_engines(serve, [engine, engine]) as fleet, aiohttp.ClientSession(timeout=timeout) as session:
        a, b = fleet.engines
        # neutral_load by request count: the busier engine sends one request per cycle to the other
        # while they differ by 2 or more
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pilotfish", "rescheduler",
            "--redis-url", redis_service.url, "--cms-cluster", CLUSTER,
            "--rescheduling-policies", "neutral_load",
            "--rescheduling-neutral-load-metric", "num_requests",
            "--rescheduling-neutral-load-threshold", "2",
            "--rescheduling-load-balance-threshold", "2",
            "--rescheduling-req-select-rule", "NUM_REQ",
            "--rescheduling-req-select-order", "LCR",
            "--rescheduling-req-select-value", "1",
            "--rescheduling-interval-ms", "100",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT_S)).decode()
            assert line.startswith("rescheduler running"), line
            # every request goes to A; B is idle
            clients = [asyncio.create_task(stream(session, a.address.url, f"req-{k}", n)) for k in range(4)]
            await wait_for(lambda: a.llumlet.migration.num_migrated_out >= 1, "a request migrated away from A")
            assert b.llumlet.migration.num_migrated_in >= 1
            results = await asyncio.wait_for(asyncio.gather(*clients), TIMEOUT_S)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), TIMEOUT_S) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for texts in results:  # no token lost, duplicated or reordered, wherever it was computed
            assert texts == [WORDS[i % len(WORDS)] for i in range(n)]
    assert proc.stderr is not None
    assert b"Traceback" not in await proc.stderr.read()
