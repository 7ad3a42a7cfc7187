"""Full mode without response bodies: the sidecar asks Envoy for none, the llumlets count tokens, and
each request is released once, from Envoy's access log, with how it ended."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import metric, scrape
from pilotfish.services import RunningService
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"


def releases(stack: Stack, reason: str | None = None) -> float:
    labels = {"reason": reason} if reason else {}
    return metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_releases_total", **labels)



def send_mixed(stack: Stack, max_tokens: int) -> list[tuple[int, bytes, bool]]:
    """Six streamed and two whole completions at once: (status, body, streamed) each."""

    async def run() -> list[tuple[int, bytes, bool]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def one(i: int) -> tuple[int, bytes, bool]:
                stream = i < 6
                body = {"model": MODEL, "prompt": f"mixed {i} " * 10, "max_tokens": max_tokens, "stream": stream}
                async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                    return resp.status, await resp.read(), stream

            return list(await asyncio.gather(*(one(i) for i in range(8))))

    return asyncio.run(run())


def whole_and_released_once_from_the_access_log(stack: Stack) -> None:
    """Six 100-token streams and two whole completions arrive whole, nothing added, each released once."""
    for status, raw, stream in send_mixed(stack, max_tokens=100):
        assert status == 200, raw[:300]
        if stream:
            payloads = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            assert payloads[-1] == b"[DONE]" and len(payloads) == 101
            assert all(b'"usage"' not in p or b'"usage":null' in p for p in payloads)  # nothing added
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 100
    wait_until(lambda: releases(stack, "finished") == 8, 30, "one release per request, from the access log")
    assert releases(stack) == 8


def test_streams_are_released_once_from_the_access_log_without_reading_bodies(
    make_stack, redis_service: RunningService
) -> None:
    stack = make_stack(engines=2, scheduler_metrics=True, ext_proc_metrics=True, cms_url=redis_service.url)
    port = stack.scheduler_metrics_port
    wait_until(lambda: len(scrape(port).get("pilotfish_scheduler_view_staleness_seconds", [])) == 2, 60,
               "both engines in the scheduler's CMS view")  # fmt: skip
    sent_before = stack.envoy_stat("http.inference.ext_proc.stream_msgs_sent")

    whole_and_released_once_from_the_access_log(stack)
    assert metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_generated_tokens_total") == 0  # bodies unread
    # request headers and body only: no response message at all (the stream ends with the routing reply)
    sent = stack.envoy_stat("http.inference.ext_proc.stream_msgs_sent") - sent_before
    assert sent == 2 * 8, sent

    async def abort() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {"model": MODEL, "prompt": "walk away", "max_tokens": 4000, "stream": True}
            resp = await session.post(f"{stack.base_url}/v1/completions", json=body)
            await resp.content.readline()
            resp.close()

    asyncio.run(abort())
    wait_until(lambda: releases(stack, "client_abort") == 1, 30, "the aborted stream released as such")
    assert releases(stack) == 9


def test_an_observing_filter_counts_streams_exactly_without_a_reply_per_chunk(make_stack) -> None:
    """Lite mode, --response-bodies observe: the routing filter reads no response body; a second
    filter in observability mode hands the SSE chunks over without waiting for replies."""
    stack = make_stack(engines=2, scheduler_metrics=True, ext_proc_metrics=True, response_bodies="observe")
    engines_before = sum(metric(port, "vllm:generation_tokens_total") for _, port in stack.engines)

    for status, raw, stream in send_mixed(stack, max_tokens=40):
        assert status == 200, raw[:300]
        if stream:
            payloads = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            assert payloads[-1] == b"[DONE]" and len(payloads) == 41
    wait_until(lambda: releases(stack, "finished") == 8, 30, "one release per request")
    assert releases(stack) == 8
    streamed = sum(metric(port, "vllm:generation_tokens_total") for _, port in stack.engines) - engines_before
    # the streams' tokens counted exactly (the whole responses are released at their headers, uncounted)
    assert (
        metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_generated_tokens_total") == 6 * 40 == streamed - 2 * 40
    )
    wait_until(lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests") == 0, 30,
               "the scheduler's account drained")  # fmt: skip


def test_first_token_mode_reads_each_stream_to_its_first_token_and_sizes_the_answer_at_the_release(
    make_stack,
) -> None:
    """Lite mode, --response-bodies first-token: the ext_proc reads each stream up to its first token,
    then ends its own stream; Envoy passes the rest untouched and unwatched, and the access log
    releases each request with the answer's length estimated from the body's size."""
    stack = make_stack(engines=2, scheduler_metrics=True, ext_proc_metrics=True, response_bodies="first-token")
    sent_before = stack.envoy_stat("http.inference.ext_proc.stream_msgs_sent")

    whole_and_released_once_from_the_access_log(stack)  # the client gets every event, unchanged
    # per stream: request headers and body, response headers, and the body only to the first token (the
    # simulated engine sends one event per chunk), not the 101 chunks of the whole answer
    sent = stack.envoy_stat("http.inference.ext_proc.stream_msgs_sent") - sent_before
    assert 3 * 8 <= sent <= 3 * 8 + 6 * 2, sent
    # each stream's answer, sized from the body: 100 tokens each, within a few percent
    estimated = metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_generated_tokens_total")
    assert abs(estimated - 6 * 100) <= 6 * 5, estimated
    wait_until(lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests") == 0, 30,
               "the scheduler's account drained")  # fmt: skip


@pytest.mark.parametrize("response_bodies", ["first-token", "count"])
def test_envoys_own_5xx_after_a_placement_is_the_gateways_and_ejects_no_engine(
    make_stack, response_bodies: str
) -> None:
    """A client can make Envoy itself answer 500 after the scheduler placed its request: with its headers
    near Envoy's count limit, the routing reply's added headers overflow it. Released from the access log,
    that is the gateway's error, not the engine's: engines a client never reached are not ejected."""
    stack = make_stack(engines=2, scheduler_metrics=True, ext_proc_metrics=True, response_bodies=response_bodies)

    async def run() -> list[int]:
        # a connection per request: Envoy closes one after refusing a request on it
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), connector=connector) as session:
            statuses = []
            body = {"model": MODEL, "prompt": "headers", "max_tokens": 4}
            # Over its limit, Envoy refuses the request at the door (431, or it closes the connection: 0 here);
            # a few headers under it, the request is placed, and the routing reply's headers overflow it (500)
            for extra in range(80, 100):
                headers = {f"x-h{i}": "v" for i in range(extra)}
                try:
                    async with session.post(f"{stack.base_url}/v1/completions", json=body, headers=headers) as resp:
                        statuses.append(resp.status)
                except aiohttp.ServerDisconnectedError:
                    statuses.append(0)
            async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                statuses.append(resp.status)
            return statuses

    statuses = asyncio.run(run())
    assert set(statuses) <= {0, 200, 431, 500} and statuses[-1] == 200, str(statuses)
    assert 500 in statuses, "no request met Envoy's limit after the routing reply: the case is not exercised"
    placed = statuses.count(200) + statuses.count(500)
    wait_until(lambda: releases(stack) == placed, 30, "every request placed released once")
    assert releases(stack, "upstream_error") == 0
    if response_bodies == "first-token":  # from the access log, which says Envoy answered itself
        assert releases(stack, "gateway_error") == statuses.count(500)
    # counting, the ext_proc's stream just ends with no response (Envoy does not say why): not the engine's either
    assert metric(stack.scheduler_metrics_port, "pilotfish_scheduler_ejections_total") == 0
    wait_until(lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests") == 0, 30,
               "the scheduler's account drained")  # fmt: skip
