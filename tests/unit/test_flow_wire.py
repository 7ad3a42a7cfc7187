"""Flow control over every way a gateway reaches the scheduler: the Session socket, the gRPC Session
stream, unary Schedule, and colocated. A real SchedulerServer on loopback and the gateway's real
client (ext_proc/scheduler_client.py) or colocated backend (ext_proc/colocated.py); nothing faked.

The gateway's Schedule deadline here is 0.2 s (as the shipped --schedule-timeout-ms); a request the
scheduler acknowledged as queued must outlive it and still get the scheduler's pick.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pilotfish.ext_proc.colocated import LocalScheduler
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, Decision, SchedulerUnavailable
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.procs import free_port, wait_until_async
from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.service import SchedulerServer

TIMEOUT = 30.0  # a loaded machine's bound; a passing run returns as soon as the condition holds
GATEWAY_DEADLINE = 0.2
ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
DONE = scheduler_pb2.RELEASE_REASON_FINISHED


def flow_config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "instances": ["e0=127.0.0.1:8001", "e1=127.0.0.1:8002"],
        "model": ["m"],
        "port": free_port(),
        "session_port": free_port(),
        "enable_flow_control": True,
        "flow_lite_max_requests": 1,
        # the tenants here send a few requests at once: counted apart from their first (newcomers.py)
        "flow_established_after_ms": 0.0,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def sreq(rid: str, priority: int = 0, flow: str = "", hold_ms: int = 20_000) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=rid,
        model="m",
        prompt_tokens=10,
        priority=priority,
        flow=flow,  # type: ignore[arg-type]
        queue_timeout_ms=hold_ms,
    )


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    srv = SchedulerServer(flow_config())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


def client(srv: SchedulerServer, transport: str) -> GrpcScheduler:
    address = f"127.0.0.1:{srv.port}"
    if transport == "socket":
        return GrpcScheduler(address, GATEWAY_DEADLINE, 0.01, session_address=f"127.0.0.1:{srv.session_port}")
    return GrpcScheduler(address, GATEWAY_DEADLINE, 0.01, session=transport == "grpc-session")


async def warmed(gw: GrpcScheduler) -> GrpcScheduler:
    """`gw` once a Schedule has gone through it: its connection is made before the test's own Schedules,
    which the 0.2 s gateway deadline bounds (on a loaded machine connecting can take longer). Each try is
    released, answered or not."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + TIMEOUT
    attempt = 0
    while True:
        rid = f"warm-{attempt}"
        attempt += 1
        try:
            await gw.schedule(sreq(rid, hold_ms=0))
            return gw
        except SchedulerUnavailable:
            if loop.time() > give_up:
                raise
        finally:
            gw.release(rid, ABORT)


def queued(srv: SchedulerServer, rid: str) -> bool:
    flow = srv._servicer.flow
    return flow is not None and flow.controller.queued(rid)


async def past_the_gateway_deadline() -> None:
    """Lets more than the gateway's own Schedule deadline pass: what the test must outlive."""
    loop = asyncio.get_running_loop()
    until = loop.time() + 2 * GATEWAY_DEADLINE
    await wait_until_async(lambda: loop.time() > until, TIMEOUT, "the gateway's deadline to pass")


@pytest.mark.parametrize("transport", ["socket", "grpc-session", "unary"])
async def test_a_saturated_fleet_holds_the_request_past_the_gateway_deadline_then_dispatches_it(
    server: SchedulerServer, transport: str
) -> None:
    gw = await warmed(client(server, transport))
    try:
        first = await gw.schedule(sreq("busy0"))
        second = await gw.schedule(sreq("busy1"))
        assert {first.address, second.address} == {"127.0.0.1:8001", "127.0.0.1:8002"}
        waiting = asyncio.create_task(gw.schedule(sreq("w")))
        await wait_until_async(lambda: queued(server, "w"), TIMEOUT, "the request queued")
        await past_the_gateway_deadline()
        assert not waiting.done()  # no fallback: the scheduler said it waits
        gw.release("busy1", DONE)
        decision = await asyncio.wait_for(waiting, TIMEOUT)
        assert (decision.source, decision.address) == (SCHEDULER, second.address)
        assert server.core.account_size == 2
    finally:
        await gw.close()


@pytest.mark.parametrize("transport", ["socket", "grpc-session"])
async def test_strict_priority_then_fair_turns_over_the_session(server: SchedulerServer, transport: str) -> None:
    gw = await warmed(client(server, transport))
    crit, std, shed = scheduler_pb2.PRIORITY_CRITICAL, scheduler_pb2.PRIORITY_STANDARD, scheduler_pb2.PRIORITY_SHEDDABLE
    try:
        await gw.schedule(sreq("busy0"))
        await gw.schedule(sreq("busy1"))
        order: list[str] = []

        async def one(r: scheduler_pb2.ScheduleRequest) -> Decision:
            d = await gw.schedule(r)
            order.append(r.request_id)
            return d

        reqs = [sreq("s0", shed), sreq("a0", std, "a"), sreq("a1", std, "a"), sreq("a2", std, "a"),
                sreq("b0", std, "b"), sreq("c0", crit)]  # fmt: skip
        tasks = []
        for r in reqs:  # one at a time, so the queue's order is the arrival order
            tasks.append(asyncio.create_task(one(r)))
            await wait_until_async(lambda r=r: queued(server, r.request_id), TIMEOUT, "queued")
        held = ["busy0", "busy1"]
        while len(order) < len(reqs):
            n = len(order)
            gw.release(held.pop(0), DONE)
            await wait_until_async(lambda n=n: len(order) > n, TIMEOUT, "one more dispatched")
            held.append(order[-1])
        assert order == ["c0", "a0", "b0", "a1", "a2", "s0"]
        await asyncio.gather(*tasks)
    finally:
        await gw.close()


@pytest.mark.parametrize("transport", ["socket", "grpc-session"])
async def test_an_abandoned_request_leaves_the_queue_and_is_never_dispatched(
    server: SchedulerServer, transport: str
) -> None:
    gw = await warmed(client(server, transport))
    try:
        await gw.schedule(sreq("busy0"))
        await gw.schedule(sreq("busy1"))
        gone = asyncio.create_task(gw.schedule(sreq("gone")))
        await wait_until_async(lambda: queued(server, "gone"), TIMEOUT, "queued")
        gone.cancel()  # what the processor does when Envoy's stream ends: then the release below
        gw.release("gone", ABORT)
        await wait_until_async(lambda: not queued(server, "gone"), TIMEOUT, "out of the queue")
        gw.release("busy0", DONE)
        await wait_until_async(lambda: server.core.account_size == 1, TIMEOUT, "busy0 released")
        later = await gw.schedule(sreq("later"))  # the room went to this one, not to the abandoned request
        assert later.source == SCHEDULER and server.core.account_size == 2
        assert server.core._lrs.get("gone") is None
    finally:
        await gw.close()


async def test_a_session_that_ends_takes_its_waiting_requests_out(server: SchedulerServer) -> None:
    gw = await warmed(client(server, "socket"))
    await gw.schedule(sreq("busy0"))
    await gw.schedule(sreq("busy1"))
    waiting = asyncio.create_task(gw.schedule(sreq("w")))
    await wait_until_async(lambda: queued(server, "w"), TIMEOUT, "queued")
    await gw.close()
    await wait_until_async(lambda: not queued(server, "w"), TIMEOUT, "out of the queue with its session")
    with pytest.raises(Exception):  # noqa: B017 - the gateway's waiter fails (it falls back); which error is its own
        await waiting
    assert server.core._lrs.get("w") is None


async def test_shed_is_the_gateways_429_with_retry_after() -> None:
    srv = SchedulerServer(flow_config(flow_queue_max_requests=1, flow_sheddable_max_wait_ms=20_000))
    await srv.start()
    gw = await warmed(client(srv, "socket"))
    try:
        await gw.schedule(sreq("busy0"))
        await gw.schedule(sreq("busy1"))
        first = asyncio.create_task(gw.schedule(sreq("s0", scheduler_pb2.PRIORITY_SHEDDABLE)))
        await wait_until_async(lambda: queued(srv, "s0"), TIMEOUT, "queued")
        with pytest.raises(RequestError) as full:  # the queue is full, nothing lower to shed
            await gw.schedule(sreq("s1", scheduler_pb2.PRIORITY_SHEDDABLE))
        assert (full.value.status, full.value.retry_after) == (429, 1)
        crit = asyncio.create_task(gw.schedule(sreq("c0", scheduler_pb2.PRIORITY_CRITICAL)))
        with pytest.raises(RequestError) as evicted:  # the critical request took the sheddable one's place
            await first
        assert evicted.value.status == 429
        await wait_until_async(lambda: queued(srv, "c0"), TIMEOUT, "critical queued")
        gw.release("busy0", DONE)
        assert (await asyncio.wait_for(crit, TIMEOUT)).source == SCHEDULER
    finally:
        await gw.close()
        await srv.stop(grace=1)


async def test_a_gateway_that_cannot_hold_gets_its_answer_at_once(server: SchedulerServer) -> None:
    gw = await warmed(client(server, "socket"))
    try:
        await gw.schedule(sreq("busy0"))
        await gw.schedule(sreq("busy1"))
        now = await gw.schedule(sreq("now", hold_ms=0))  # an older gateway, or --schedule-queue-timeout-ms 0
        assert now.source == SCHEDULER and server.core.account_size == 3
    finally:
        await gw.close()


async def test_colocated_waits_and_releases_the_same_way() -> None:
    config = flow_config()
    backend = LocalScheduler(SchedulerCore(config), frozenset(["m"]))
    await backend.schedule(sreq("busy0"))
    await backend.schedule(sreq("busy1"))
    waiting = asyncio.create_task(backend.schedule(sreq("w")))
    gone = asyncio.create_task(backend.schedule(sreq("gone")))
    assert backend.flow is not None
    flow = backend.flow.controller
    await wait_until_async(lambda: flow.queued("w") and flow.queued("gone"), TIMEOUT, "both queued")
    gone.cancel()
    backend.release("gone", ABORT)
    backend.release("busy0", DONE)
    assert (await asyncio.wait_for(waiting, TIMEOUT)).source == SCHEDULER
    assert not flow.queued("gone") and backend._core._lrs.get("gone") is None  # type: ignore[attr-defined]
    await backend.close()
