"""Full mode against a real Redis: writers that imitate llumlets, the CMS reader, the gRPC service.

Every wait is on a condition (the view reflecting a write), never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.procs import free_port
from pilotfish.protos import cms_pb2, scheduler_pb2, scheduler_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

CLUSTER = "itest"


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Llumlet:
    """Writes what a llumlet writes: metadata and status records, each followed by a notice."""

    def __init__(self, client: aioredis.Redis, name: str, *, kind: int = 1, port: int = 8000, ttl_ms: int = 60_000):
        self.client, self.name, self.kind, self.port, self.ttl_ms = client, name, kind, port, ttl_ms
        self.update_id = 0

    async def register(self, model: str = "m", notify: bool = True) -> None:
        meta = cms_pb2.InstanceMetadata(
            instance_id=self.name,
            host="127.0.0.1",
            http_port=self.port,
            model=model,
            infer_type=self.kind,
            node_id=f"node-{self.name}",
            update_id=1,
            timestamp_ms=int(time.time() * 1000),
        )
        await self.client.set(keys.meta_key(CLUSTER, self.name), meta.SerializeToString(), px=self.ttl_ms)
        if notify:
            await self.client.publish(keys.events_channel(CLUSTER), f"{keys.META}:{self.name}")

    async def export(self, *, notify: bool = True, update_id: int | None = None, **fields: object) -> None:
        self.update_id = update_id if update_id is not None else self.update_id + 1
        values: dict[str, object] = {"schedulable": True, "total_kv_tokens": 100_000}
        values.update(fields)
        status = cms_pb2.InstanceStatus(
            instance_id=self.name,
            update_id=self.update_id,
            timestamp_ms=int(time.time() * 1000),
            **values,  # type: ignore[arg-type]
        )
        await self.write_raw(status.SerializeToString(), notify=notify)

    async def write_raw(self, raw: bytes, notify: bool = True) -> None:
        await self.client.set(keys.status_key(CLUSTER, self.name), raw, px=self.ttl_ms)
        if notify:
            await self.client.publish(keys.events_channel(CLUSTER), f"{keys.STATUS}:{self.name}")


@pytest.fixture
async def redis_client(redis_service: RunningService) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_service.url)
    try:
        yield client
    finally:
        await client.aclose()


def full_config(redis_service: RunningService, **kw: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "enable_full_mode_scheduling": True,
        "redis_url": redis_service.url,
        "cms_cluster": CLUSTER,
        "port": free_port(),
        "cms_poll_interval_seconds": 30.0,  # long: these tests see notices unless they say otherwise
        "fallback_count": 1,
    }
    values.update(kw)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


async def started(config: SchedulerConfig) -> SchedulerServer:
    server = SchedulerServer(config)
    await server.start()
    assert server.reader is not None
    await server.reader.wait_first_poll(timeout=20)
    await eventually(lambda: server.reader is not None and server.reader.num_redis_errors == 0, "subscription")
    return server


async def subscribed(redis_client: aioredis.Redis) -> None:
    """Until the reader's subscription is live (notices published earlier would be lost)."""
    channel = keys.events_channel(CLUSTER)
    deadline = time.monotonic() + 20
    while (await redis_client.pubsub_numsub(channel))[0][1] < 1:
        assert time.monotonic() < deadline, "reader never subscribed"
        await asyncio.sleep(0.01)


async def test_view_follows_notices_and_dispatch_is_confirmed(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    a, b = Llumlet(redis_client, "a", port=8001), Llumlet(redis_client, "b", port=8002)
    for w in (a, b):
        await w.register()
        await w.export(uncomputed_prefill_tokens=0)
    server = await started(full_config(redis_service))
    try:
        core = server.core
        assert {i.instance_id for i in core.instances()} == {"a", "b"}
        await subscribed(redis_client)
        await a.export(uncomputed_prefill_tokens=5000)  # a is busy now: only the notice tells
        await eventually(lambda: core.instance("a").status.uncomputed_prefill_tokens == 5000, "notice applied")  # type: ignore[union-attr]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            first = await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r1", model="m", prompt_tokens=3000))
            assert (first.target.instance_id, first.target.address) == ("b", "127.0.0.1:8002")
            # b now carries r1 in flight (3000 tokens): the next one still avoids a (5000)
            assert core.instance("b").inflight.prefill_tokens == 3000
            second = await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r2", model="m", prompt_tokens=10))
            assert second.target.instance_id == "b"
            # b's engine admits both: its status now carries them, the account lets go
            await b.export(uncomputed_prefill_tokens=3010, num_waiting=2, admitted_request_ids=["r1", "r2"])
            await eventually(lambda: core.inflight_size == 0, "admitted ids confirming the account")
            released = await stub.Release(scheduler_pb2.ReleaseRequest(request_id="r1"))
            assert released.found
            # the gateway's release counts no answer in full mode; the engine's record does, with its tokens
            assert core.instance("b").lrs.num_released == 0
            await b.export(num_finished_total=1, finished_output_tokens_total=7)
            await eventually(lambda: core.instance("b").lrs.num_released == 1, "the engine's answer counted")
            assert core.instance("b").lrs.released_generated_tokens == 7
    finally:
        await server.stop(grace=1)


async def test_poll_catches_up_a_lost_notice_and_expired_keys(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    a = Llumlet(redis_client, "a", ttl_ms=60_000)
    await a.register()
    await a.export()
    server = await started(full_config(redis_service, cms_poll_interval_seconds=0.1))
    try:
        core = server.core
        await a.export(num_waiting=7, notify=False)  # the notice is lost
        await eventually(lambda: core.instance("a").status.num_waiting == 7, "poll applying the status")  # type: ignore[union-attr]
        # the llumlet dies: its keys expire and the instance leaves the view
        await redis_client.pexpire(keys.meta_key(CLUSTER, "a"), 50)
        await redis_client.pexpire(keys.status_key(CLUSTER, "a"), 50)
        await eventually(lambda: not core.instances(), "expired instance dropped")
        # and a new one appears without any notice
        c = Llumlet(redis_client, "c")
        await c.register(notify=False)
        await c.export(notify=False)
        await eventually(lambda: [i.instance_id for i in core.instances()] == ["c"], "new instance polled")
    finally:
        await server.stop(grace=1)


async def test_hostile_and_stale_records_are_rejected_without_a_crash(
    redis_service: RunningService, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    a = Llumlet(redis_client, "a")
    await a.register()
    await a.export(update_id=10, num_waiting=1)
    server = await started(full_config(redis_service))
    caplog.set_level(logging.WARNING, logger="pilotfish.cms.reader")
    try:
        core, reader = server.core, server.reader
        assert reader is not None
        await subscribed(redis_client)
        hostile = [
            b"\xff\xfe garbage",
            b"x" * (300 * 1024),
            cms_pb2.InstanceStatus(instance_id="b", update_id=11).SerializeToString(),  # under a's key
            cms_pb2.InstanceStatus(
                instance_id="a", update_id=12, admitted_request_ids=["r"] * 5000
            ).SerializeToString(),
        ]
        for k, raw in enumerate(hostile, start=1):
            await a.write_raw(raw)
            await eventually(lambda k=k: reader.num_bad_records >= k, f"hostile record {k} rejected")
        await a.export(update_id=9, num_waiting=99)  # stale: older than the held 10
        await eventually(lambda: core.cms is not None and core.cms.num_rejected >= 1, "stale status dropped")
        assert core.instance("a").status.num_waiting == 1  # type: ignore[union-attr]
        assert "rejected CMS record" in caplog.text
        # garbage on the channel is ignored too
        await redis_client.publish(keys.events_channel(CLUSTER), b"\x00" * 1000)
        await redis_client.publish(keys.events_channel(CLUSTER), b"status:a b")
        await a.export(update_id=13, num_waiting=2)
        await eventually(lambda: core.instance("a").status.num_waiting == 2, "a good record after the bad ones")  # type: ignore[union-attr]
    finally:
        await server.stop(grace=1)


async def test_grpc_codes_and_disaggregation_in_full_mode(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    p, d = Llumlet(redis_client, "p", kind=2, port=8101), Llumlet(redis_client, "d", kind=3, port=8102)
    for w in (p, d):
        await w.register()
        await w.export()
    server = await started(full_config(redis_service))
    try:
        await subscribed(redis_client)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            both = await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="r", model="m", prompt_tokens=10))
            assert (both.target.instance_id, both.decode_target.instance_id) == ("p", "d")
            assert both.target.infer_type == cms_pb2.INFER_TYPE_PREFILL
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="x", model="unknown"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            await p.export(schedulable=False)
            await eventually(lambda: not server.core.instance("p").status.schedulable, "unschedulable")  # type: ignore[union-attr]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Schedule(scheduler_pb2.ScheduleRequest(request_id="y", model="m"))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "schedulability: 1" in (info.value.details() or "")
    finally:
        await server.stop(grace=1)


async def test_reader_survives_a_redis_restart(redis_binary: Path, tmp_path: Path) -> None:
    port = free_port()
    first = services.start_redis(tmp_path / "r1", port)
    client = aioredis.from_url(first.url, socket_timeout=5)
    clients = [client]
    try:
        a = Llumlet(client, "a")
        await a.register()
        await a.export()
        server = await started(full_config(first, cms_poll_interval_seconds=0.1))
        try:
            first.stop()
            await eventually(lambda: server.reader is not None and server.reader.num_redis_errors > 0, "outage seen")
            second = services.start_redis(tmp_path / "r2", port)
            try:
                client = aioredis.from_url(second.url, socket_timeout=5)
                clients.append(client)
                b = Llumlet(client, "b")  # writers re-register after the restart
                await b.register()
                await b.export(num_waiting=4)
                await eventually(lambda: "b" in {i.instance_id for i in server.core.instances()}, "view after restart")
            finally:
                second.stop()
        finally:
            await server.stop(grace=1)
    finally:
        first.stop()
        for c in clients:
            with contextlib.suppress(Exception):
                await c.aclose()


async def test_the_load_index_is_rekeyed_in_the_loops_free_time_not_at_the_next_schedule(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    from pilotfish.scheduler.view.types import InferType, RequestInfo

    server = await started(full_config(redis_service))
    try:
        await subscribed(redis_client)
        llumlets = [Llumlet(redis_client, f"e{k:02d}", port=8000 + k) for k in range(16)]  # enough for an index
        for k, llumlet in enumerate(llumlets):
            await llumlet.register()
            await llumlet.export(uncomputed_prefill_tokens=100 * k)
        core = server.core
        await eventually(lambda: sum(i.status is not None for i in core.instances()) == 16, "16 engines' statuses")
        core.schedule(RequestInfo("first", "m", prompt_tokens=10))  # builds the load index
        index = core._by_model["m"].stages[InferType.NEUTRAL].index
        assert index is not None
        await eventually(lambda: not core._dirty, "the dispatch's engine re-keyed")
        busy = {llumlet.name for llumlet in llumlets[:5]}
        for llumlet in llumlets[:5]:
            await llumlet.export(uncomputed_prefill_tokens=50_000)
        await eventually(
            lambda: all(i.status is not None and i.status.uncomputed_prefill_tokens == 50_000
                        for i in core.instances() if i.instance_id in busy),
            "the five statuses applied",
        )  # fmt: skip
        # no Schedule since: the server's loop re-keyed them, and the index keys their new load
        await eventually(lambda: not core._dirty, "re-keyed without a Schedule")
        assert all(index._key[name][1][0][0] >= 50_000 for name in busy)  # (floor, states, ...): prefill ahead
    finally:
        await server.stop(grace=0)
