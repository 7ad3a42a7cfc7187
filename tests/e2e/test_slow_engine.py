"""A slow engine through the real stack, full mode: Redis, the llumlets' statuses, the scheduler, the ext_proc
and Envoy. One of three simulated engines steps five times slower; the scheduler learns it from the steps
its llumlet reports (view/speed.py), says so in its metrics, and sends it nothing of a burst it took a third
of before."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from pilotfish.procs import wait_until
from pilotfish.prom_scrape import scrape
from pilotfish.services import RunningService
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=120)
WAIT = 60.0  # a loaded machine's bound; a passing run returns as soon as the condition holds


def speed_scales(stack: Stack) -> dict[str, float]:
    samples = scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_engine_speed_scale", [])
    return {labels["engine"]: value for labels, value in samples}


def served_by(stack: Stack, count: int, concurrent: bool, tag: str) -> Counter[str]:
    """`count` completions of 16 tokens, all at once or one after another: the engines that served them."""

    async def run() -> Counter[str]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

            async def one(i: int) -> str:
                body = {"model": MODEL, "prompt": f"{tag} {i} " * 20, "max_tokens": 16}
                async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
                    await resp.read()
                    assert resp.status == 200
                    return resp.headers["x-pilotfish-instance"]

            if concurrent:
                return Counter(await asyncio.gather(*(one(i) for i in range(count))))
            return Counter([await one(i) for i in range(count)])

    return asyncio.run(run())


def test_a_slow_engine_is_found_from_its_steps_and_passed_over(make_stack, redis_service: RunningService) -> None:
    stack = make_stack(engines=3, scheduler_metrics=True, cms_url=redis_service.url,
                       engine_args=["--step-scales", "1,1,5"])
    wait_until(lambda: len(speed_scales(stack)) == 3, WAIT, "the three engines in the scheduler's CMS view")
    assert set(speed_scales(stack).values()) == {1.0}  # nothing known yet: alike

    # work for every engine (alike until found, so the slow one takes its share and reports its steps)
    first = served_by(stack, 12, concurrent=True, tag="warm")
    assert first["sim-2"] > 0, first
    wait_until(lambda: speed_scales(stack).get("sim-2", 1.0) >= 3.0, WAIT, "sim-2 found slow")
    scales = speed_scales(stack)
    assert scales["sim-0"] == scales["sim-1"] == 1.0, scales

    # the same burst again: it went a third to each engine while they looked alike; now the fast two
    # would have to hold five times the slow one's work before it is chosen
    later = served_by(stack, 12, concurrent=True, tag="after")
    assert later["sim-2"] == 0 and sum(later.values()) == 12, later
