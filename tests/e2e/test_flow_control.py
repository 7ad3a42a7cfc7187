"""Flow control through the real stack: Envoy (the shipped sidecar), the ext_proc, the scheduler with
--enable-flow-control, and one slow simulated engine that holds one request at a time.

What it proves: a request the scheduler queues is held past the gateway's 200 ms Schedule deadline
and is then routed by the scheduler (not round-robin); the band header set by the client crosses
Envoy (the forward_rules allowlist) and orders the queue; a client that disconnects while its
request waits takes it out of the queue (never dispatched); a sheddable request past the queue's
bound gets 429 with Retry-After.

In full mode (a real Redis CMS): the engine's saturation is judged from its llumlet's status and the
scheduler's in-flight account, with the gateway skipping response bodies (releases come from Envoy's
access log), and the queue moves when the engine's reports and the release say it has room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from pilotfish.ext_proc.flow import group_of_address
from pilotfish.procs import wait_until, wait_until_async
from pilotfish.prom_scrape import metric, scrape
from pilotfish.stack import Stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=120)
WAIT = 60.0  # a loaded machine's bound; a passing run returns as soon as the condition holds

FLOW_ARGS = [
    "--enable-flow-control",
    "--flow-lite-max-requests", "1",
    "--flow-queue-max-requests", "2",
    "--flow-critical-max-wait-ms", "60000",
    "--flow-standard-max-wait-ms", "60000",
    "--flow-sheddable-max-wait-ms", "60000",
]  # fmt: skip


async def until(condition: Callable[[], bool]) -> None:
    """Polls a condition on the stack's metrics without blocking the loop; bounded by WAIT."""
    await wait_until_async(condition, WAIT, "the stack to reach the state the test waits for", interval=0.02)


def queued(stack: Stack, band: str | None = None) -> float:
    labels = {"band": band} if band else {}
    return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_flow_queue_requests", **labels)


def held(stack: Stack) -> float:
    return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests")


def dispatched(stack: Stack) -> float:
    return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_dispatch_total")


async def complete(
    session: aiohttp.ClientSession,
    stack: Stack,
    tag: str,
    max_tokens: int,
    priority: str = "",
    done: list[str] | None = None,
) -> tuple[int, dict[str, str]]:
    headers = {"x-request-priority": priority} if priority else {}
    body = {"model": MODEL, "prompt": f"flow {tag}", "max_tokens": max_tokens}
    async with session.post(f"{stack.base_url}/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        if done is not None:
            done.append(tag)
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}


async def busy_then_sheddable_then_critical(stack: Stack) -> tuple[list[int], list[str]]:
    """A long request takes the engine, a sheddable one then a critical one queue behind it: each one's HTTP
    status, and the order they completed in."""
    done: list[str] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        busy = asyncio.create_task(complete(session, stack, "busy", 40, done=done))
        await until(lambda: held(stack) >= 1)
        sheddable = asyncio.create_task(complete(session, stack, "sheddable", 4, "sheddable", done))
        await until(lambda: queued(stack) >= 1)
        critical = asyncio.create_task(complete(session, stack, "critical", 4, "critical", done))
        await until(lambda: queued(stack) >= 2)
        statuses = [s for s, _ in await asyncio.gather(busy, sheddable, critical)]
        return statuses, done


@pytest.fixture
def flow_stack(make_stack) -> Stack:
    return make_stack(
        engines=1,
        scheduler_metrics=True,
        ext_proc_metrics=True,
        scheduler_args=FLOW_ARGS,
        # the test is the trusted layer that sets the band header: it may claim critical
        ext_proc_args=["--schedule-queue-timeout-ms", "30000", "--flow-header", "x-tenant-id",
                       "--client-priority-max", "critical"],
        engine_args=["--step-ms", "100"],  # a token every 100 ms: 40 hold the engine ~4 s, room on a loaded machine
    )


def test_queued_requests_wait_past_the_gateway_deadline_in_band_order(flow_stack: Stack) -> None:
    stack = flow_stack
    routed_before = metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_routed_total", route="scheduler")

    statuses, order = asyncio.run(busy_then_sheddable_then_critical(stack))
    assert statuses == [200, 200, 200]
    assert order == ["busy", "critical", "sheddable"]  # the critical one arrived later and went first
    # all three by the scheduler's pick, none by the gateway's round-robin fallback
    assert (
        metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_routed_total", route="scheduler") == routed_before + 3
    )
    assert metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_routed_total", route="fallback") == 0
    assert metric(stack.scheduler_metrics_port, "pilotfish_scheduler_flow_dispatched_total", how="queued") == 2


def test_a_client_that_leaves_takes_its_request_out_and_a_full_queue_sheds_with_429(flow_stack: Stack) -> None:
    stack = flow_stack

    async def run() -> tuple[int, dict[str, str]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            busy = asyncio.create_task(complete(session, stack, "busy", 40))
            await until(lambda: held(stack) >= 1)
            before = dispatched(stack)
            leaver = asyncio.create_task(complete(session, stack, "leaver", 4))
            await until(lambda: queued(stack) >= 1)
            leaver.cancel()  # the client disconnects while its request waits
            await until(lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_flow_cancelled_total") >= 1)
            assert queued(stack) == 0
            # the queue holds 2: two standard requests fill it, a sheddable one is shed at once
            fillers = [asyncio.create_task(complete(session, stack, f"fill{i}", 2)) for i in range(2)]
            await until(lambda: queued(stack) >= 2)
            shed = await complete(session, stack, "shed", 2, "sheddable")
            await asyncio.gather(busy, *fillers)
            assert dispatched(stack) == before + 2  # the fillers; never the leaver
            return shed

    status, headers = asyncio.run(run())
    assert status == 429 and headers.get("retry-after") == "1"
    assert metric(stack.scheduler_metrics_port, "pilotfish_scheduler_flow_shed_total", reason="queue_full") == 1
    wait_until(
        lambda: metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests") == 0,
        WAIT,
        "every request released",
    )


def test_the_client_address_groups_its_flows(flow_stack: Stack) -> None:
    """Envoy hands the ext_proc the client's address (`source.address`), and the flow key the scheduler
    queues by is in that address's group: `<hash of 127.0.0.1>:...`. A tenant id seen for the first time is
    not established yet (--flow-established-after-ms), so it waits in its group's shared newcomers flow."""
    stack = flow_stack

    async def run() -> list[str]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            busy = asyncio.create_task(complete(session, stack, "busy", 40))
            await until(lambda: held(stack) >= 1)
            body = {"model": MODEL, "prompt": "flow grouped", "max_tokens": 2}
            waiter = asyncio.create_task(
                session.post(f"{stack.base_url}/v1/completions", json=body, headers={"x-tenant-id": "tenant-7"})
            )
            await until(lambda: queued(stack) >= 1)
            samples = scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_flow_queue_flow_requests", [])
            flows = [labels["flow"] for labels, n in samples if n >= 1]
            resp = await waiter
            assert resp.status == 200
            await resp.read()
            await busy
            return flows

    flows = asyncio.run(run())
    assert flows == [f"{group_of_address('127.0.0.1:1')}:~newcomers"]


def test_two_client_addresses_wait_in_two_groups(flow_stack: Stack) -> None:
    """Clients connecting from 127.0.0.2 and 127.0.0.3 (loopback answers the whole 127/8) queue in the groups
    of their own addresses, whatever tenant ids and X-Forwarded-For they send (the second claims to be the
    first, and a third address besides)."""
    stack = flow_stack

    async def post_from(address: str, tenant: str, forwarded: str = "") -> int:
        connector = aiohttp.TCPConnector(local_addr=(address, 0))
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
            body = {"model": MODEL, "prompt": f"flow from {address}", "max_tokens": 2}
            async with session.post(f"{stack.base_url}/v1/completions", json=body,
                                    headers={"x-tenant-id": tenant,
                                             **({"x-forwarded-for": forwarded} if forwarded else {})}) as resp:
                await resp.read()
                return resp.status

    async def run() -> tuple[list[str], list[int]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            busy = asyncio.create_task(complete(session, stack, "busy", 40))
            await until(lambda: held(stack) >= 1)
            waiters = [asyncio.create_task(post_from("127.0.0.2", "same-tenant"))]
            await until(lambda: queued(stack) >= 1)
            waiters.append(asyncio.create_task(post_from("127.0.0.3", "same-tenant", "10.9.9.9, 127.0.0.2")))
            await until(lambda: queued(stack) >= 2)
            samples = scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_flow_queue_flow_requests", [])
            flows = sorted(labels["flow"] for labels, n in samples if n >= 1)
            statuses = list(await asyncio.gather(*waiters))
            await busy
            return flows, statuses

    flows, statuses = asyncio.run(run())
    assert statuses == [200, 200]
    assert flows == sorted(f"{group_of_address(a)}:~newcomers" for a in ("127.0.0.2", "127.0.0.3"))


def test_full_mode_holds_requests_on_the_engines_reports_and_releases_them_in_band_order(
    make_stack, redis_service
) -> None:
    # full mode's batch bound: the engine is saturated while it runs, loads or waits for one request (its
    # llumlet's status) or one is in flight to it (the account)
    args = [a for a in FLOW_ARGS if a not in ("--flow-lite-max-requests", "1")]
    stack = make_stack(
        engines=1,
        scheduler_metrics=True,
        ext_proc_metrics=True,
        cms_url=redis_service.url,
        scheduler_args=[*args, "--flow-max-batch-requests", "1"],
        ext_proc_args=["--schedule-queue-timeout-ms", "30000", "--flow-header", "x-tenant-id",
                       "--client-priority-max", "critical"],
        engine_args=["--step-ms", "100"],
    )
    wait_until(
        lambda: len(scrape(stack.scheduler_metrics_port).get("pilotfish_scheduler_view_staleness_seconds", [])) == 1,
        WAIT,
        "the engine in the scheduler's CMS view",
    )

    statuses, order = asyncio.run(busy_then_sheddable_then_critical(stack))
    assert statuses == [200, 200, 200]
    assert order == ["busy", "critical", "sheddable"]
    assert metric(stack.scheduler_metrics_port, "pilotfish_scheduler_flow_dispatched_total", how="queued") == 2
    assert metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_routed_total", route="fallback") == 0
    # the engine's reports retire every request: the account drains to zero
    wait_until(lambda: held(stack) == 0, WAIT, "every request released")
