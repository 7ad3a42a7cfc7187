"""Forged CMS records against a real redis-server, and the reader riding out a Redis restart.

The attacks replayed here were demonstrated against the scheduler (issues #26, #27): one status
with update_id 2^64-1 and a far-future timestamp pinned an engine out; forged metadata and status
for a new instance took most of the traffic. See docs/cms-trust.md for the trust model, including
the Redis ACLs the last tests set up. Every wait is on a condition, bounded, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.cms.reader import CmsReader
from pilotfish.cms.writer import CmsWriter
from pilotfish.procs import free_port
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.scheduler.view.types import RequestInfo
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

CLUSTER = "forge"
U64_MAX = 2**64 - 1


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Engine:
    """An honest llumlet: the real CmsWriter, update_ids from the wall clock as the llumlet's."""

    def __init__(self, url: str, name: str, port: int) -> None:
        self.name = name
        self.writer = CmsWriter(url, CLUSTER, name, ttl_ms=60_000)
        self.meta = cms_pb2.InstanceMetadata(
            instance_id=name, host="127.0.0.1", http_port=port, model="m", infer_type=1, update_id=1
        )
        self.update_id = 0

    async def register(self) -> None:
        await asyncio.to_thread(self.writer.write_metadata, self.meta)

    async def export(self, **fields: object) -> None:
        self.update_id = max(self.update_id + 1, time.time_ns() // 1000)
        status = cms_pb2.InstanceStatus(
            instance_id=self.name,
            update_id=self.update_id,
            timestamp_ms=now_ms(),
            schedulable=True,
            total_kv_tokens=100_000,
            **fields,  # type: ignore[arg-type]
        )
        await asyncio.to_thread(self.writer.write_status, status)

    def close(self) -> None:
        self.writer.close()


async def forge(client: aioredis.Redis, kind: str, name: str, record: bytes) -> None:
    """What an attacker with write access to Redis does: set the key, announce it."""
    key = keys.meta_key(CLUSTER, name) if kind == keys.META else keys.status_key(CLUSTER, name)
    await client.set(key, record, px=60_000)
    await client.publish(keys.events_channel(CLUSTER), f"{kind}:{name}")


@pytest.fixture
async def redis_client(redis_service: RunningService) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_service.url)
    try:
        yield client
    finally:
        await client.aclose()


def full_config(url: str, **kw: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "enable_full_mode_scheduling": True,
        "redis_url": url,
        "cms_cluster": CLUSTER,
        "port": free_port(),
        "model": ["m"],
        "cms_poll_interval_seconds": 0.2,  # the poll catches what a notice missed
    }
    values.update(kw)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(config: SchedulerConfig) -> AsyncIterator[SchedulerServer]:
    server = SchedulerServer(config)
    await server.start()
    try:
        assert server.reader is not None
        await server.reader.wait_first_poll(timeout=30)
        yield server
    finally:
        await server.stop(grace=1)


def waiting(server: SchedulerServer, name: str) -> int | None:
    try:
        status = server.core.instance(name).status
    except KeyError:
        return None
    return None if status is None else status.num_waiting


def refused(server: SchedulerServer) -> dict[str, int]:
    assert server.core.cms is not None
    return server.core.cms.refused_by_reason()


# -- attack (a): one far-future status pinned an engine out ------------------------------------------


async def test_a_forged_future_status_is_refused_and_real_statuses_keep_flowing(
    redis_service: RunningService, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(redis_service.url, "a", 8001)
    try:
        await engine.register()
        await engine.export(num_waiting=1)
        async with serving(full_config(redis_service.url)) as server:
            await eventually(lambda: waiting(server, "a") == 1, "the engine in the view")
            caplog.set_level(logging.WARNING)
            forged = cms_pb2.InstanceStatus(
                instance_id="a", update_id=U64_MAX, timestamp_ms=U64_MAX, schedulable=False, num_waiting=999
            )
            await forge(redis_client, keys.STATUS, "a", forged.SerializeToString())
            await eventually(lambda: refused(server).get("future_timestamp", 0) >= 1, "the forged status refused")
            assert waiting(server, "a") == 1
            # the engine's next statuses are taken as if nothing happened, one after another
            for n in (2, 3, 4):
                await engine.export(num_waiting=n)
                await eventually(lambda n=n: waiting(server, "a") == n, f"real status {n} applied")
            assert server.core.schedule(RequestInfo("r1", "m")).target.instance_id == "a"
            assert any(
                r.levelno == logging.WARNING and "instance a" in r.getMessage() and "future_timestamp" in r.getMessage()
                for r in caplog.records
            )
            text = generate_latest(server.core.registry).decode()
            assert 'pilotfish_scheduler_cms_records_refused_total{reason="future_timestamp"}' in text
            # a forger that keeps writing is refused every time, and logged once
            before = len([r for r in caplog.records if "future_timestamp" in r.getMessage()])
            for k in range(2, 7):
                forged.update_id = U64_MAX - k
                await forge(redis_client, keys.STATUS, "a", forged.SerializeToString())
                await eventually(lambda k=k: refused(server).get("future_timestamp", 0) >= k, f"forgery {k} refused")
            assert len([r for r in caplog.records if "future_timestamp" in r.getMessage()]) == before
            await engine.export(num_waiting=5)
            await eventually(lambda: waiting(server, "a") == 5, "a real status after the flood")
    finally:
        engine.close()


async def test_a_restarted_llumlet_is_taken_at_once_through_its_epoch(redis_service: RunningService) -> None:
    first = Engine(redis_service.url, "a", 8001)
    second: Engine | None = None
    try:
        await first.register()
        first.update_id = (now_ms() + 3_000) * 1000  # its ids ran ahead of the clock (within the skew)
        await first.export(num_waiting=1)
        async with serving(full_config(redis_service.url)) as server:
            await eventually(lambda: waiting(server, "a") == 1, "the first incarnation")
            first.close()
            second = Engine(redis_service.url, "a", 8001)  # a new writer: a new epoch
            assert second.writer.epoch >= first.writer.epoch
            second.writer.epoch = first.writer.epoch + 1  # strictly newer, whatever the clock's grain
            second.writer._epoch_field = cms_pb2.InstanceStatus(epoch=second.writer.epoch).SerializeToString()
            second.update_id = 0
            await second.export(num_waiting=7)  # a lower update_id than the first incarnation's
            await eventually(lambda: waiting(server, "a") == 7, "the restarted llumlet's status")
            assert refused(server) == {}
    finally:
        first.close()
        if second is not None:
            second.close()


# -- attack (b): a forged instance took 98.6% of the traffic -------------------------------------------


async def test_a_forged_instance_gets_no_traffic_when_admission_follows_discovery(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    engine = Engine(redis_service.url, "a", 8001)
    try:
        await engine.register()
        await engine.export()
        config = full_config(redis_service.url, discovery="static:a=127.0.0.1:8001")
        async with serving(config) as server:
            await eventually(lambda: waiting(server, "a") == 0, "the discovered engine admitted")
            evil_meta = cms_pb2.InstanceMetadata(instance_id="evil", host="127.0.0.1", http_port=9999, model="m")
            await forge(redis_client, keys.META, "evil", evil_meta.SerializeToString())
            evil_status = cms_pb2.InstanceStatus(
                instance_id="evil", update_id=1, timestamp_ms=now_ms(), schedulable=True
            )
            await forge(redis_client, keys.STATUS, "evil", evil_status.SerializeToString())
            await eventually(lambda: refused(server).get("not_discovered", 0) >= 1, "the forged instance refused")
            await engine.export(num_waiting=50)  # the real engine looks busy: a forged idle one would win
            await eventually(lambda: waiting(server, "a") == 50, "the busy status")
            targets = {server.core.schedule(RequestInfo(f"r{k}", "m")).target.instance_id for k in range(20)}
            assert targets == {"a"}
            assert [i.instance_id for i in server.core.instances()] == ["a"]
    finally:
        engine.close()


async def test_forged_metadata_is_validated_even_when_the_cms_admits_instances(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    """Without discovery (pilotfish up --full), the CMS is the discovery: ACLs are the guard
    (below), and metadata must still name a served model and a real address."""
    async with serving(full_config(redis_service.url)) as server:
        reader = server.reader
        assert reader is not None
        for name, meta in (
            ("m1", cms_pb2.InstanceMetadata(instance_id="m1", host="127.0.0.1", http_port=9999, model="other")),
            ("m2", cms_pb2.InstanceMetadata(instance_id="m2", host="127.0.0.1/evil", http_port=80, model="m")),
        ):
            await forge(redis_client, keys.META, name, meta.SerializeToString())
        await eventually(
            lambda: refused(server).get("unserved_model", 0) >= 1 and refused(server).get("invalid_field", 0) >= 1,
            "both forged metadata refused",
        )
        assert server.core.instances() == []
        assert {r.reason for r in reader.rejected().values()} == {"invalid_field"}


# -- attack (c): a 10 MB record cost 42 MB of RSS --------------------------------------------------------


async def test_an_oversized_record_is_refused_unread_and_the_engine_keeps_reporting(
    redis_service: RunningService, redis_client: aioredis.Redis
) -> None:
    engine = Engine(redis_service.url, "a", 8001)
    try:
        await engine.register()
        await engine.export(num_waiting=1)
        async with serving(full_config(redis_service.url)) as server:
            reader = server.reader
            assert reader is not None
            await eventually(lambda: waiting(server, "a") == 1, "the engine in the view")
            huge = b"\x0a" + b"\x80" * (10 * 1024 * 1024)
            await forge(redis_client, keys.STATUS, "a", huge)
            key = keys.status_key(CLUSTER, "a")
            await eventually(lambda: key in reader.rejected(), "the oversized record refused")
            summary = reader.rejected()[key]
            assert (summary.reason, summary.size) == ("oversize", len(huge))
            assert len(summary.digest) == 16  # a digest of what was read, not the record
            polls = reader.num_polls
            await eventually(lambda: reader.num_polls >= polls + 2, "polls over the same value")
            assert reader.num_bad_records == 1  # the same value polled again: not counted, not logged again
            await engine.export(num_waiting=2)
            await eventually(lambda: waiting(server, "a") == 2, "a real status after it")
            assert key not in reader.rejected()
    finally:
        engine.close()


# -- Redis ACLs: the llumlet writes only its own keys, the scheduler only reads --------------------------


def _acl(admin: redis.Redis, *rules: str) -> None:
    admin.execute_command("ACL", "SETUSER", *rules)


async def test_redis_acls_confine_the_llumlet_and_the_scheduler_reads_read_only(
    redis_service: RunningService,
) -> None:
    admin = redis.Redis.from_url(redis_service.url)
    version = admin.info("server")["redis_version"]
    if int(version.split(".")[0]) < 7:
        pytest.skip(f"redis-server {version}: per-key read/write ACL selectors need Redis 7")
    events = keys.events_channel(CLUSTER)
    own, pattern = keys.instance_events_channel(CLUSTER, "a"), keys.instance_events_pattern(CLUSTER)
    # the rules docs/cms-trust.md gives, for instance "a" and the scheduler
    _acl(admin, "llumlet-a", "on", ">pw-a", "resetkeys", "resetchannels",
         f"~{keys.meta_key(CLUSTER, 'a')}", f"~{keys.status_key(CLUSTER, 'a')}", f"&{own}",
         "-@all", "+set", "+del", "+publish", "+ping")  # fmt: skip
    _acl(admin, "pilotfish-scheduler", "on", ">pw-s", "resetkeys", "resetchannels",
         f"%R~pilotfish:{CLUSTER}:*", f"&{events}", f"&{pattern}",
         "-@all", "+scan", "+getrange", "+strlen", "+subscribe", "+psubscribe", "+unsubscribe", "+punsubscribe",
         "+ping")  # fmt: skip
    host = f"127.0.0.1:{redis_service.port}/0"
    engine = Engine(f"redis://llumlet-a:pw-a@{host}", "a", 8001)
    llumlet = redis.Redis.from_url(f"redis://llumlet-a:pw-a@{host}")
    scheduler = redis.Redis.from_url(f"redis://pilotfish-scheduler:pw-s@{host}")
    try:
        await engine.register()
        await engine.export(num_waiting=3)
        async with serving(full_config(f"redis://pilotfish-scheduler:pw-s@{host}")) as server:
            reader = server.reader
            assert reader is not None
            await eventually(lambda: waiting(server, "a") == 3, "the view read through the read-only user")
            await engine.export(num_waiting=4)
            await eventually(lambda: waiting(server, "a") == 4, "a notice through the read-only user")
            assert reader.num_redis_errors == 0
            # the default takes records from notices: one on a's own channel (only a's user may publish
            # there) is a's; an admin forging one about "a" on the shared channel or on b's channel
            # changes nothing (the first is only a reason to read a's key, the second is refused)
            forged = cms_pb2.InstanceStatus(instance_id="a", update_id=10**6, num_waiting=99).SerializeToString()
            refused = reader.refused_by_reason.get("notice_sender", 0)
            admin.publish(events, b"status:a:" + forged)
            admin.publish(keys.instance_events_channel(CLUSTER, "b"), b"status:a:" + forged)
            await eventually(lambda: reader.refused_by_reason.get("notice_sender", 0) > refused,
                             "the notice on b's channel refused")
            await engine.export(num_waiting=5)
            await eventually(lambda: waiting(server, "a") == 5, "a's next status")
        # the llumlet's user may publish on its own channel only
        with pytest.raises(redis.exceptions.NoPermissionError):
            llumlet.publish(keys.instance_events_channel(CLUSTER, "b"), b"status:b")
        with pytest.raises(redis.exceptions.NoPermissionError):
            llumlet.publish(events, b"status:b")
        # the llumlet's user cannot write another instance's keys, nor read anything
        for forged_key in (keys.status_key(CLUSTER, "b"), keys.meta_key(CLUSTER, "b"), "pilotfish:other:status:a"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                llumlet.set(forged_key, b"x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            llumlet.get(keys.status_key(CLUSTER, "a"))
        # the scheduler's user writes nothing, not even where it reads
        with pytest.raises(redis.exceptions.NoPermissionError):
            scheduler.set(keys.status_key(CLUSTER, "a"), b"x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            scheduler.publish(events, "status:a")
        assert admin.exists(keys.status_key(CLUSTER, "b")) == 0
    finally:
        engine.close()
        llumlet.close()
        scheduler.close()
        admin.close()


# -- (d) a Redis restart: the reader resumes, staleness grows honestly while it is cut off --------------


async def test_the_reader_resumes_after_redis_is_killed_and_restarted_on_its_port(
    redis_binary: Path, tmp_path: Path
) -> None:
    port = free_port()
    first = services.start_redis(tmp_path / "r1", port)
    second: RunningService | None = None
    engine = Engine(first.url, "a", 8001)
    try:
        await engine.register()
        await engine.export(num_waiting=1)
        async with serving(full_config(first.url)) as server:
            reader, cms = server.reader, server.core.cms
            assert reader is not None and cms is not None
            await eventually(lambda: waiting(server, "a") == 1, "the engine in the view")
            assert first.child is not None
            os.kill(first.child.pid, signal.SIGKILL)  # the redis-server this test started, by its PID
            first.child.proc.wait()
            await eventually(lambda: reader.num_redis_errors > 0, "the outage seen")
            age = cms.status_age("a", time.time())
            assert age is not None
            await eventually(
                lambda: (cms.status_age("a", time.time()) or 0.0) > age + 0.5, "staleness growing while cut off"
            )
            second = services.start_redis(tmp_path / "r2", port)
            # a llumlet retries its writes; its keys were lost with the server (no persistence)

            async def write_until_seen() -> None:
                while waiting(server, "a") != 42:
                    with contextlib.suppress(Exception):
                        await engine.register()
                        await engine.export(num_waiting=42)
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(write_until_seen(), timeout=60)
            await eventually(lambda: waiting(server, "a") == 42, "a status after the restart")
            assert server.core.schedule(RequestInfo("r", "m")).target.instance_id == "a"
    finally:
        engine.close()
        if second is not None:
            second.stop()
        first.stop()


async def test_a_standalone_reader_reconnects_on_its_own(redis_binary: Path, tmp_path: Path) -> None:
    """The reader alone (no scheduler): a notice after the restart reaches the sink."""
    port = free_port()
    first = services.start_redis(tmp_path / "r1", port)
    second: RunningService | None = None

    class Sink:
        def __init__(self) -> None:
            self.status: dict[str, cms_pb2.InstanceStatus] = {}
            self.meta: set[str] = set()

        def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
            self.meta.add(meta.instance_id)
            return True

        def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
            self.status[status.instance_id] = status
            return True

        def status_gone(self, instance_id: str) -> None:
            pass

        def remove(self, instance_id: str) -> bool:
            self.meta.discard(instance_id)
            return True

        def known(self) -> set[str]:
            return set(self.meta)

    sink = Sink()
    reader = CmsReader(first.url, CLUSTER, sink, poll_interval=30.0)  # long: only notices, or the retry's poll
    task = asyncio.create_task(reader.run())
    engine = Engine(first.url, "a", 8001)
    try:
        await reader.wait_first_poll(timeout=30)
        assert first.child is not None
        os.kill(first.child.pid, signal.SIGKILL)
        first.child.proc.wait()
        await eventually(lambda: reader.num_redis_errors > 0, "the outage seen")
        second = services.start_redis(tmp_path / "r2", port)

        async def write_until_seen() -> None:
            while "a" not in sink.status or sink.status["a"].num_waiting != 9:
                with contextlib.suppress(Exception):
                    await engine.register()
                    await engine.export(num_waiting=9)
                await asyncio.sleep(0.02)

        await asyncio.wait_for(write_until_seen(), timeout=60)
        assert sink.status["a"].epoch == engine.writer.epoch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()
        if second is not None:
            second.stop()
        first.stop()
