"""A broken engine behind a live server, through the real stack (Envoy, the ext_proc reading streams to their
first token and releasing from Envoy's access log, the scheduler): one of three simulated engines answers every
completion at once with a 429 or an empty 200 stream while its /health answers. Released as finished, each such
answer dropped the load and counted as the engine's success: it looked idle and healthy and drew the traffic it
failed. It must be ejected after a few failures and serve nothing while out, and the account must drain."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import scrape
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=60)
WAIT = 60.0  # a loaded machine's bound; a passing run returns as soon as the condition holds
BAD = "sim-0"  # first by id: it wins the ties of an idle fleet, as the black hole did


def ejections(stack: Stack) -> float:
    samples = scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_ejections_total", [])
    return sum(v for labels, v in samples if labels["engine"] == BAD and labels["reason"] == "upstream_errors")


def account_size(stack: Stack) -> float:
    return sum(v for _, v in scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_account_size", []))


async def one(session: aiohttp.ClientSession, stack: Stack, i: int) -> tuple[str, bool]:
    """One streamed completion: the engine it went to, and whether it came whole (200 and data: [DONE])."""
    body = {"model": MODEL, "prompt": f"request {i} " * 8, "max_tokens": 8, "stream": True}
    async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
        text = await resp.read()
        return resp.headers.get("x-pilotfish-instance", ""), resp.status == 200 and b"data: [DONE]" in text


@pytest.mark.parametrize("fault", ["refuse", "empty"])
def test_an_engine_failing_fast_behind_a_live_server_is_ejected_and_serves_nothing_while_out(
    make_stack, fault: str
) -> None:
    stack = make_stack(engines=3, scheduler_metrics=True, engine_args=["--answer-faults", f"{fault},ok,ok"])

    async def run() -> tuple[int, list[tuple[str, bool]]]:
        """Requests at about 10 a second until the bad engine is ejected (bounded), then 20 more."""
        failed = 0
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            deadline = time.monotonic() + WAIT
            i = 0
            while not await asyncio.to_thread(ejections, stack):
                assert time.monotonic() < deadline, f"{BAD} never ejected; {failed} requests failed there"
                engine, whole = await one(session, stack, i)
                failed += engine == BAD and not whole
                assert whole or engine == BAD, (engine, i)  # only the bad engine fails
                i += 1
                await asyncio.sleep(0.1)
            after = [await one(session, stack, i + k) for k in range(20)]
        return failed, after

    failed, after = asyncio.run(run())
    # ejected after --outlier-consecutive-failures (3) failures in a row, not after drawing the traffic
    assert 1 <= failed <= 4, failed  # (a 4th may start before the third's release reaches the scheduler)
    assert all(whole and engine != BAD for engine, whole in after), after  # out: nothing goes there
    wait_until(lambda: account_size(stack) == 0, WAIT, "the scheduler's account drained")
