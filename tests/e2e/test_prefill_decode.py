"""Prefill/decode pairs end to end, llm-d's way: full mode over a real Redis CMS, one prefill and
one decode simulated engine whose llumlets report their roles. The gateway routes each request to
the decode engine and names its prefill engine in x-prefiller-host-port; the decode engine has it
prefill (one token), decodes on the transferred KV, and both engines confirm the request to the
scheduler's in-flight account, which drains to zero."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import metric, scrape
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"


def test_a_pair_goes_to_the_decode_engine_told_its_prefill_engine(make_stack, redis_service: RunningService) -> None:
    stack = make_stack(
        engines=2, scheduler_metrics=True, ext_proc_metrics=True, cms_url=redis_service.url,
        engine_args=["--infer-types", "prefill,decode"],
    )  # fmt: skip
    (_, prefill_port), (decode_id, _) = stack.engines
    port = stack.scheduler_metrics_port
    wait_until(lambda: len(scrape(port).get("pilotfish_scheduler_view_staleness_seconds", [])) == 2, 60,
               "both engines in the scheduler's CMS view")  # fmt: skip
    prefilled_before = metric(prefill_port, "vllm:request_success_total")

    async def run() -> list[tuple[int, dict[str, str], bytes]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def one(i: int) -> tuple[int, dict[str, str], bytes]:
                body = {"model": MODEL, "prompt": f"pair {i} " * 20, "max_tokens": 8, "stream": i % 2 == 0}
                async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                    return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

            return list(await asyncio.gather(*(one(i) for i in range(6))))

    for status, headers, raw in asyncio.run(run()):
        assert status == 200, raw[:300]
        assert headers["x-pilotfish-engine"] == decode_id  # decoded on the decode engine ...
        assert headers["x-pilotfish-prefilled-by"] == f"127.0.0.1:{prefill_port}"  # ... on the prefill engine's KV
        assert headers["x-pilotfish-instance"] == decode_id
        if headers["content-type"].startswith("text/event-stream"):
            payloads = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            assert payloads[-1] == b"[DONE]" and len(payloads) == 9
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 8
    # the prefill engine served each request's prefill (one token each)
    assert metric(prefill_port, "vllm:request_success_total") - prefilled_before == 6
    # both engines confirmed every request the scheduler accounted on them: the account drains
    wait_until(lambda: metric(port, "pilotfish_scheduler_inflight_account_entries") == 0, 60,
               "in-flight account entries on both engines confirmed")  # fmt: skip
    assert metric(port, "pilotfish_scheduler_inflight_account_removed_total", reason="expired") == 0
