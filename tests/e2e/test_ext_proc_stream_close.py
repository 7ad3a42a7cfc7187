"""Every ext_proc stream ends with the ext_proc's OK, never with Envoy's reset, through real Envoy.

A reset cuts grpc.aio's read or final status, whose native op array it then never frees (~120-150
bytes a request: the soak's steady ext_proc growth). The sidecar closes its streams gracefully
(envoy/sidecar.yaml) and the processor ends each one itself once nothing more is owed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import metric
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
RESETS = "cluster.pilotfish_ext_proc.upstream_rq_tx_reset"  # streams Envoy reset on the ext_proc
COMPLETED = "cluster.pilotfish_ext_proc.upstream_rq_completed"  # streams that ended, either way



def send(stack: Stack, n: int) -> list[int]:
    """n completions, streamed and whole, eight at a time: each one's status."""

    async def run() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            gate = asyncio.Semaphore(8)

            async def one(i: int) -> int:
                body = {"model": MODEL, "prompt": f"close {i} " * 5, "max_tokens": 8, "stream": i % 4 != 0}
                async with gate, session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            return list(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(run())


def test_a_counting_gateway_has_no_ext_proc_stream_reset(make_stack) -> None:
    """--response-bodies count (what grpc.aio's server needs): every stream ends with the ext_proc's OK."""
    stack = make_stack(engines=2, response_bodies="count")
    before_resets, before_completed = stack.envoy_stat(RESETS), stack.envoy_stat(COMPLETED)
    statuses = send(stack, 40)
    assert statuses == [200] * 40
    # Envoy counts a stream once it is over, which a graceful close may leave a moment after the response
    wait_until(lambda: stack.envoy_stat(COMPLETED) - before_completed >= 40, 30, "every ext_proc stream ended")
    assert stack.envoy_stat(RESETS) - before_resets == 0


def test_lite_resets_only_the_streams_read_to_their_first_token_and_holds_none(stack: Stack) -> None:
    """The lite default behind the sidecar (--response-bodies first-token) ends each stream's ext_proc stream at
    its first token, and Envoy resets it after the OK: exactly those, and the loop server keeps none open."""
    assert stack.response_bodies == "first-token"
    port = stack.ext_proc_metrics_port
    early_before = metric(port, "pilotfish_ext_proc_first_token_ends_total")
    before_resets, before_completed = stack.envoy_stat(RESETS), stack.envoy_stat(COMPLETED)
    statuses = send(stack, 40)
    assert statuses == [200] * 40
    wait_until(lambda: stack.envoy_stat(COMPLETED) - before_completed >= 40, 30, "every ext_proc stream ended")
    early = metric(port, "pilotfish_ext_proc_first_token_ends_total") - early_before
    assert early == 30  # the streamed three in four; a whole response ends at its headers, with OK
    assert stack.envoy_stat(RESETS) - before_resets == early
    wait_until(lambda: metric(port, "pilotfish_ext_proc_active_streams") == 0, 30, "no ext_proc stream left open")


def test_full_mode_streams_end_with_the_routing_reply_and_none_is_reset(make_stack, redis_service) -> None:
    """Response bodies skipped: the ext_proc ends each stream with its routing reply, long before the
    response ends, and Envoy sends nothing more on it and resets none."""
    stack = make_stack(engines=2, cms_url=redis_service.url)
    before_resets, before_completed = stack.envoy_stat(RESETS), stack.envoy_stat(COMPLETED)
    statuses = send(stack, 40)
    assert statuses == [200] * 40
    wait_until(lambda: stack.envoy_stat(COMPLETED) - before_completed >= 40, 30, "every ext_proc stream ended")
    assert stack.envoy_stat(RESETS) - before_resets == 0
