"""The gateway through real Envoy: exact token counts, usage stripping, Release exactly once
(normal end, client abort, engine killed), progress reports, and fallback while the scheduler
is down with recovery when it returns."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from pilotfish.procs import Child, wait_until
from pilotfish.prom_scrape import metric
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=120)


def engine_generated(stack: Stack) -> float:
    return sum(metric(port, "vllm:generation_tokens_total") for _, port in stack.engines)


def releases(stack: Stack, reason: str | None = None) -> float:
    labels = {"reason": reason} if reason else {}
    return metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_releases_total", **labels)


def scheduler_idle(stack: Stack) -> bool:
    return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests") == 0


async def stream(session: aiohttp.ClientSession, stack: Stack, i: int, max_tokens: int, usage: bool) -> list[dict]:
    body: dict = {"model": MODEL, "prompt": f"count {i} " * 5, "max_tokens": max_tokens, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    payloads = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    assert payloads[-1] == b"[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_counted_tokens_equal_engine_usage_and_usage_reaches_only_who_asked(make_stack) -> None:
    """--response-bodies count: every chunk read, the counts exact (the lite default behind the sidecar reads
    to the first token and estimates the rest: test_gateway_skip_bodies.py)."""
    stack = make_stack(engines=2, scheduler_metrics=True, ext_proc_metrics=True, response_bodies="count")
    gateway_before = metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_generated_tokens_total")
    engine_before = engine_generated(stack)
    finished_before = releases(stack, "finished")
    plan = [(i, 3 + i * 5, i % 3 == 0) for i in range(12)]

    async def run() -> list[list[dict]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return list(await asyncio.gather(*(stream(session, stack, i, n, usage) for i, n, usage in plan)))

    results = asyncio.run(run())
    for (_, max_tokens, asked), events in zip(plan, results, strict=True):
        usage_events = [e for e in events if "usage" in e and not e["choices"]]
        assert len(usage_events) == (1 if asked else 0), "usage must reach exactly the clients that asked"
        if asked:
            assert usage_events[0]["usage"]["completion_tokens"] == max_tokens
        assert sum(1 for e in events if e["choices"]) == max_tokens

    expected = sum(n for _, n, _ in plan)
    wait_until(lambda: releases(stack, "finished") - finished_before == len(plan), 30, "one Release per request")
    gateway = metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_generated_tokens_total") - gateway_before
    assert gateway == expected == engine_generated(stack) - engine_before
    wait_until(lambda: scheduler_idle(stack), 30, "scheduler account draining to zero")


def test_reports_advance_the_scheduler_while_streaming(stack: Stack) -> None:
    async def run() -> tuple[float, float]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 400, "stream": True}
            async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                instance = resp.headers["x-pilotfish-instance"]
                tokens = []
                events = 0
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        events += 1
                        if events in (2, 120):
                            # give the batched Report (every 50 ms) a chance to land, on a condition
                            await asyncio.to_thread(
                                wait_until,
                                lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_tokens",
                                               engine=instance) > 0,
                                30, "scheduler holding the stream's tokens",
                            )
                            tokens.append(metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_tokens",
                                                 engine=instance))
                return tokens[0], tokens[1]

    early, late = asyncio.run(run())
    assert late > early, "streamed tokens must reach the scheduler before the request ends"
    wait_until(lambda: scheduler_idle(stack), 30, "scheduler account draining to zero")


def test_client_abort_releases_exactly_once(stack: Stack) -> None:
    before = releases(stack)

    async def abort_after_three_events() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {"model": MODEL, "prompt": "never read to the end", "max_tokens": 2000, "stream": True}
            resp = await session.post(f"{stack.base_url}/v1/completions", json=body)
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data:")
                if seen == 3:
                    break
            resp.close()  # drop the connection mid-stream

    asyncio.run(abort_after_three_events())
    wait_until(lambda: releases(stack, "client_abort") >= 1, 60, "a Release for the aborted stream")
    wait_until(lambda: scheduler_idle(stack), 30, "scheduler account draining to zero")
    assert releases(stack) - before == 1


def test_engine_killed_mid_stream_releases_once_and_gateway_stays_up(make_stack) -> None:
    stack = make_stack(engines=1, scheduler_metrics=True, ext_proc_metrics=True)

    async def stream_until_killed() -> int:
        seen = 0
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "stream": True}
            async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                try:
                    async for line in resp.content:
                        seen += line.startswith(b"data:")
                        if seen == 5:
                            os.kill(stack.children["engines"].pid, signal.SIGKILL)
                except aiohttp.ClientError:
                    pass  # the upstream reset reaches the client as a broken stream
        return seen

    seen = asyncio.run(stream_until_killed())
    assert seen < 4000
    wait_until(lambda: releases(stack) == 1, 60, "exactly one Release for the broken stream")
    wait_until(lambda: scheduler_idle(stack), 30, "scheduler account draining to zero")
    assert stack.children["ext_proc"].exited() is None, "the ext_proc must survive an engine crash"
    assert releases(stack) == 1


def test_scheduler_killed_mid_load_falls_back_then_recovers(make_stack) -> None:
    stack = make_stack(engines=2, ext_proc_metrics=True, ext_proc_args=["--breaker-open-seconds", "0.5"])
    scheduler = stack.children["scheduler"]

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 4}
        async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status, resp.headers.get("x-pilotfish-route", "")

    async def load() -> list[tuple[int, str]]:
        results = []
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for i in range(40):
                if i == 10:
                    os.kill(scheduler.pid, signal.SIGKILL)
                results.append(await one(session, i))
        return results

    results = asyncio.run(load())
    assert all(status == 200 for status, _ in results), "no request may fail while the scheduler is down"
    assert {route for _, route in results[:10]} == {"scheduler"}
    assert {route for _, route in results[11:]} == {"fallback"}

    # Bring the scheduler back on the same port: the breaker's probe finds it and routing returns.
    scheduler.proc.wait()
    revived = Child("scheduler", scheduler.argv, log_path=scheduler.log_path)
    try:
        revived.wait_port(stack.scheduler_port, 60)

        async def route_now() -> str:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                return (await one(session, 99))[1]

        wait_until(lambda: asyncio.run(route_now()) == "scheduler", 60, "routing to return to the scheduler")
        assert metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_breaker_open") == 0
    finally:
        revived.stop()
