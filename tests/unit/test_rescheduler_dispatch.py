"""The migration dispatcher and the rescheduling loop against fake llumlets: in-process grpc.aio
servicers on free loopback ports (the llumlet's Migrate is built elsewhere; these fake that neighbour).

Waits are on conditions (calls recorded, counters reached), bounded by generous timeouts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pilotfish.procs import free_port
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.rescheduler.dispatcher import MigrationDispatcher
from pilotfish.scheduler.rescheduler.loop import ReschedulingLoop, build_loop
from pilotfish.scheduler.rescheduler.telemetry import ReschedulerTelemetry
from pilotfish.scheduler.rescheduler.types import MigrationPair
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView

WAIT = 20.0


async def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class FakeLlumlet(llumlet_pb2_grpc.LlumletServicer):
    """Records every Migrate; answers at once, after `gate` opens, never (`hang`), or with `error`."""

    def __init__(self, *, gate: asyncio.Event | None = None, hang: bool = False, error: str = "") -> None:
        self.gate, self.hang, self.error = gate, hang, error
        self.calls: list[llumlet_pb2.MigrateRequest] = []
        self.metadata: list[dict[str, Any]] = []
        self.port = 0
        self.server: grpc.aio.Server | None = None

    async def Migrate(self, request: llumlet_pb2.MigrateRequest, context: Any) -> llumlet_pb2.MigrateResponse:
        self.calls.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.hang:
            await asyncio.Event().wait()
        if self.gate is not None:
            await self.gate.wait()
        if self.error:
            return llumlet_pb2.MigrateResponse(error=self.error)
        n = len(self.calls)
        return llumlet_pb2.MigrateResponse(migrated_request_ids=[f"{request.source_instance_id}-{n}a", f"-{n}b"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def llumlets() -> AsyncIterator[Callable[..., Awaitable[FakeLlumlet]]]:
    servers: list[grpc.aio.Server] = []

    async def start(**kw: Any) -> FakeLlumlet:
        fake = FakeLlumlet(**kw)
        server = grpc.aio.server()
        llumlet_pb2_grpc.add_LlumletServicer_to_server(fake, server)
        fake.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return fake

    yield start
    for server in servers:
        await server.stop(0)


def inst(iid: str, address: str) -> InstanceView:
    view = InstanceView(Endpoint(iid, "127.0.0.1:8000", InferType.DECODE))
    view.llumlet_address = address
    return view


def pair(src: InstanceView, dst: InstanceView, policy: str = "decode_load") -> MigrationPair:
    return MigrationPair(src, dst, policy, "TOKEN", "SR", 1024.0)


def failed(registry: CollectorRegistry, policy: str, reason: str) -> float:
    return registry.get_sample_value("pilotfish_rescheduling_failed_total", {"policy": policy, "reason": reason}) or 0.0


def counted(registry: CollectorRegistry, name: str, policy: str) -> float:
    return registry.get_sample_value(f"pilotfish_rescheduling_{name}_total", {"policy": policy}) or 0.0


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def dispatcher(registry: CollectorRegistry, **kw: Any) -> MigrationDispatcher:
    return MigrationDispatcher(ReschedulerTelemetry(registry), **kw)


async def test_pairs_are_dispatched_in_parallel_with_the_contract_fields(
    llumlets: Callable[..., Awaitable[FakeLlumlet]], registry: CollectorRegistry
) -> None:
    gate = asyncio.Event()
    a, b = await llumlets(gate=gate), await llumlets(gate=gate)
    dest = await llumlets()
    d = dispatcher(registry, token="s3cret", pool_size=2)
    pairs = [pair(inst("A", a.address), inst("D", dest.address)), pair(inst("B", b.address), inst("D", dest.address))]
    pending = asyncio.create_task(d.dispatch(pairs))
    # both calls are held open by the gate at once: a sequential dispatcher would never get here
    await eventually(lambda: len(a.calls) == 1 and len(b.calls) == 1, "both Migrate calls in flight together")
    assert not pending.done()
    gate.set()
    results = await asyncio.wait_for(pending, WAIT)
    assert [r.ok for r in results] == [True, True]
    assert [r.migrated for r in results] == [("A-1a", "-1b"), ("B-1a", "-1b")]
    req = a.calls[0]
    assert (req.source_instance_id, req.destination_instance_id, req.destination_llumlet_address) == (
        "A",
        "D",
        dest.address,
    )
    assert (req.select_rule, req.select_order, req.select_value) == (
        llumlet_pb2.SELECT_RULE_TOKEN,
        llumlet_pb2.SELECT_ORDER_SR,
        1024.0,
    )
    assert (req.method, req.reason) == (llumlet_pb2.MIGRATION_METHOD_UNSPECIFIED, "decode_load")
    assert a.metadata[0]["authorization"] == "Bearer s3cret"
    assert counted(registry, "attempted", "decode_load") == 2
    assert counted(registry, "migrated_requests", "decode_load") == 4
    assert dest.calls == []  # only sources are asked
    await d.close()


async def test_a_timeout_is_a_failure_and_the_others_still_complete(
    llumlets: Callable[..., Awaitable[FakeLlumlet]], registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    stuck, fine, dest = await llumlets(hang=True), await llumlets(), await llumlets()
    d = dispatcher(registry, timeout_s=2.0)  # the fine call opens its channel within it, even on a loaded machine
    pairs = [
        pair(inst("S", stuck.address), inst("D", dest.address)),
        pair(inst("F", fine.address), inst("D", dest.address)),
    ]
    results = await asyncio.wait_for(d.dispatch(pairs), WAIT)
    assert [(r.ok, r.reason) for r in results] == [(False, "timeout"), (True, "")]
    assert failed(registry, "decode_load", "timeout") == 1
    assert counted(registry, "migrated_requests", "decode_load") == 2
    assert any("timed out" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    await d.close()


async def test_bad_addresses_and_rejections_are_counted_failures(
    llumlets: Callable[..., Awaitable[FakeLlumlet]], registry: CollectorRegistry
) -> None:
    busy, dest = await llumlets(error="no request to migrate"), await llumlets()
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    d = dispatcher(registry, timeout_s=WAIT)
    pairs = [
        pair(inst("noaddr", ""), inst("D", dest.address), "decode_failover"),
        pair(inst("S", dest.address), inst("noaddr-dst", ""), "decode_failover"),
        pair(inst("gone", nobody), inst("D", dest.address), "decode_failover"),
        pair(inst("busy", busy.address), inst("D", dest.address), "decode_failover"),
    ]
    results = await asyncio.wait_for(d.dispatch(pairs), WAIT)
    reasons = [r.reason for r in results]
    assert reasons == ["no_source_address", "no_destination_address", "unavailable", "rejected"]
    assert results[3].detail == "no request to migrate"
    for reason in reasons:
        assert failed(registry, "decode_failover", reason) == 1
    assert counted(registry, "attempted", "decode_failover") == 4
    assert dest.calls == []  # the pair without a destination address was never sent
    await d.close()


async def test_channels_are_pooled_per_address_and_pruned(
    llumlets: Callable[..., Awaitable[FakeLlumlet]], registry: CollectorRegistry
) -> None:
    src, dest = await llumlets(), await llumlets()
    d = dispatcher(registry, pool_size=3)
    for _ in range(4):
        await asyncio.wait_for(d.dispatch([pair(inst("S", src.address), inst("D", dest.address))]), WAIT)
    assert d.addresses == [src.address] and len(src.calls) == 4
    await d.prune([inst("D", dest.address)])  # S left the view
    assert d.addresses == []
    await d.close()


# -- the loop over a real full-mode core ----------------------------------------------------------------------


def full_core(**kw: Any) -> SchedulerCore:
    values: dict[str, Any] = {
        "enable_full_mode_scheduling": True,
        "enable_rescheduling": True,
        "rescheduling_policies": ["decode_load"],
        "rescheduling_interval_ms": 5,
        "instance_staleness_seconds": 600.0,  # a slow machine never makes these views stale
    }
    values.update(kw)
    return SchedulerCore(SchedulerConfig(**values))


def feed(core: SchedulerCore, iid: str, llumlet_port: int, load: float) -> None:
    """What the CMS reader hands the core for one decode instance."""
    core.apply_metadata(
        cms_pb2.InstanceMetadata(
            instance_id=iid, host="127.0.0.1", http_port=8000, llumlet_port=llumlet_port, infer_type=3, update_id=1
        )
    )
    core.apply_status(
        cms_pb2.InstanceStatus(
            instance_id=iid,
            update_id=1,
            timestamp_ms=int(time.time() * 1000),
            schedulable=True,
            num_running=4,
            num_running_decode=4,
            used_kv_tokens=round(load * 1000),
            total_kv_tokens=1000,
        )
    )


class CountingDispatcher(MigrationDispatcher):
    """Records how many dispatches ever ran at once."""

    active = 0
    most = 0

    async def dispatch(self, pairs: Any) -> Any:
        CountingDispatcher.active += 1
        CountingDispatcher.most = max(CountingDispatcher.most, CountingDispatcher.active)
        try:
            return await super().dispatch(pairs)
        finally:
            CountingDispatcher.active -= 1


async def test_loop_carries_on_through_timeouts_and_never_overlaps(
    llumlets: Callable[..., Awaitable[FakeLlumlet]],
) -> None:
    stuck, dest = await llumlets(hang=True), await llumlets()
    core = full_core(llumlet_grpc_timeout_seconds=0.5)  # each call reaches the fake before its deadline
    feed(core, "hot", stuck.port, 0.9)
    feed(core, "cold", dest.port, 0.1)
    loop = build_loop(core)
    CountingDispatcher.most = 0
    loop.dispatcher = CountingDispatcher(loop.telemetry, timeout_s=0.5)
    loop.start()
    try:
        # every cycle's call outlives the 5 ms interval; cycles still run one after another
        await eventually(lambda: failed(core.registry, "decode_load", "timeout") >= 3, "three timed-out cycles")
        extra = await asyncio.wait_for(loop.run_once(), WAIT)  # asked from outside: waits its turn
        assert [r.reason for r in extra] == ["timeout"]
    finally:
        await loop.stop()
    assert CountingDispatcher.most == 1
    assert loop.num_errors == 0 and loop.num_cycles >= 4
    assert len(stuck.calls) >= 4 and all(c.destination_instance_id == "cold" for c in stuck.calls)
    assert core.registry.get_sample_value("pilotfish_rescheduling_cycles_total") == loop.num_cycles


async def test_loop_survives_a_cycle_that_raises(llumlets: Callable[..., Awaitable[FakeLlumlet]]) -> None:
    src, dest = await llumlets(), await llumlets()
    core = full_core()
    feed(core, "hot", src.port, 0.9)
    feed(core, "cold", dest.port, 0.1)
    loop = build_loop(core)
    real_plan, calls = loop.planner.plan, {"n": 0}

    def flaky(instances: Any, now: float) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in one cycle")
        return real_plan(instances, now)

    loop.planner.plan = flaky  # type: ignore[method-assign]
    loop.start()
    try:
        # the fake records a call before its answer reaches the loop, which counts on the answer:
        # wait for the count itself (two answered calls of two requests each), not for the calls
        await eventually(
            lambda: counted(core.registry, "migrated_requests", "decode_load") >= 4, "migrations after the failed cycle"
        )
    finally:
        await loop.stop()
    assert loop.num_errors == 1
    assert len(src.calls) >= 2


async def test_loop_plans_at_the_cores_clock(llumlets: Callable[..., Awaitable[FakeLlumlet]]) -> None:
    src, dest = await llumlets(), await llumlets()
    core = full_core()
    feed(core, "hot", src.port, 0.9)
    feed(core, "cold", dest.port, 0.1)
    seen: list[float] = []
    loop = build_loop(core, wall_clock=lambda: seen.append(123.0) or 123.0)  # type: ignore[func-returns-value]
    results = await asyncio.wait_for(loop.run_once(), WAIT)
    await loop.stop()
    assert seen == [123.0] and loop.planner.ctx.now == 123.0
    assert [(r.pair.source.instance_id, r.pair.destination.instance_id, r.ok) for r in results] == [
        ("hot", "cold", True)
    ]
    assert isinstance(loop, ReschedulingLoop)
