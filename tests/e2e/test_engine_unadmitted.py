"""An engine whose HTTP side takes requests and passes none to its engine, through the real stack (Envoy, the
ext_proc, the scheduler; in full mode Redis and the llumlets' statuses): its /health answers, and in full mode its
llumlet keeps reporting an idle engine, so nothing but the requests it swallows says it is broken. The scheduler
must eject it once its statuses fail to list what it was sent (full) or it gives no stream a first token while the
others do (lite), send it nothing while it is out, and drain the account when the swallowed requests' clients give
up."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import scrape
from pilotfish.services import RunningService
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
WAIT = 60.0  # a loaded machine's bound; a passing run returns as soon as the condition holds
BAD = "sim-0"


def metric(stack: Stack, name: str, **match: str) -> float:
    samples = scrape(stack.scheduler_metrics_port).get(name, [])
    return sum(v for labels, v in samples if all(labels.get(k) == want for k, want in match.items()))


async def one(session: aiohttp.ClientSession, stack: Stack, tag: str) -> str:
    """One streamed completion read whole: the engine that served it."""
    body = {"model": MODEL, "prompt": f"{tag} " * 8, "max_tokens": 8, "stream": True}
    async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
        text = await resp.read()
        assert resp.status == 200 and b"data: [DONE]" in text, (resp.status, text[-200:])
        return resp.headers["x-pilotfish-instance"]


def test_an_engine_that_swallows_its_requests_is_ejected_and_the_account_drains(
    make_stack, redis_service: RunningService
) -> None:
    """Full mode: its statuses list none of what it was sent."""
    swallowed_and_ejected(
        make_stack(
            engines=3,
            scheduler_metrics=True,
            cms_url=redis_service.url,
            engine_args=["--answer-faults", "hang,ok,ok"],
            # a short admission period keeps the test short; a long backoff keeps the engine out while it runs
            scheduler_args=["--engine-admission-seconds", "2", "--outlier-base-ejection-seconds", "60"],
        )
    )


def test_lite_an_engine_that_answers_no_stream_is_ejected_and_the_account_drains(make_stack) -> None:
    """Lite mode: the ext_proc reads each stream to its first token; this engine gives none (its /health
    answers, so the prober sees nothing)."""
    swallowed_and_ejected(
        make_stack(
            engines=3,
            scheduler_metrics=True,
            engine_args=["--answer-faults", "hang,ok,ok"],
            scheduler_args=["--engine-first-token-seconds", "2", "--outlier-base-ejection-seconds", "60"],
        )
    )


def swallowed_and_ejected(stack: Stack) -> None:
    wait_until(
        lambda: metric(stack, "pilotfish_scheduler_instance_ejected") == 0
        and len(scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_instance_ejected", [])) == 3,
        WAIT,
        "the three engines in the scheduler's CMS view",
    )

    async def run() -> tuple[list[str], list[str]]:
        """Bursts of six until the bad engine is ejected (bounded), then 20 requests one at a time."""
        swallowed: list[asyncio.Task[str]] = []
        served: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2 * WAIT)) as session:
            deadline = time.monotonic() + WAIT
            burst = 0
            ejections = "pilotfish_scheduler_ejections_total"
            while not await asyncio.to_thread(metric, stack, ejections, reason="unadmitted"):
                assert time.monotonic() < deadline, f"{BAD} never ejected"
                tasks = [asyncio.create_task(one(session, stack, f"burst {burst} {k}")) for k in range(6)]
                done, pending = await asyncio.wait(tasks, timeout=1.0)
                served += [t.result() for t in done]
                swallowed += pending
                burst += 1
            after = [await one(session, stack, f"after {k}") for k in range(20)]
            for task in swallowed:  # their clients give up
                task.cancel()
            for task in swallowed:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return served, after

    served, after = asyncio.run(run())
    assert BAD not in served  # it answers nothing
    assert metric(stack, "pilotfish_scheduler_ejections_total", engine=BAD, reason="unadmitted") == 1
    assert metric(stack, "pilotfish_scheduler_instance_ejected", engine=BAD) == 1
    assert len(after) == 20 and BAD not in after, after  # out: nothing goes there
    dispatched = metric(stack, "pilotfish_scheduler_dispatch_total", engine=BAD)
    assert dispatched >= 2  # what ejected it: two requests it did not admit
    wait_until(lambda: metric(stack, "pilotfish_scheduler_account_size") == 0, WAIT, "the scheduler's account drained")
