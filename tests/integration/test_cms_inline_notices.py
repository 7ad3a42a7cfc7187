"""The CMS reader against a real redis-server: statuses arrive inside their notices (no GET per
write), plain notices are still read with a GET, and the subscription survives what is no notice."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis

from pilotfish.cms import keys
from pilotfish.cms.notices import MAX_BULK, MAX_INLINE_RECORD
from pilotfish.cms.reader import CmsReader
from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2

pytestmark = pytest.mark.integration


class Sink:
    def __init__(self) -> None:
        self.meta: set[str] = set()
        self.statuses: list[cms_pb2.InstanceStatus] = []

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        self.meta.add(meta.instance_id)
        return True

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        self.statuses.append(status)
        return True

    def status_gone(self, instance_id: str) -> None:
        pass

    def remove(self, instance_id: str) -> bool:
        self.meta.discard(instance_id)
        return True

    def known(self) -> set[str]:
        return set(self.meta)

    def newest(self, instance_id: str) -> int:
        return max((s.update_id for s in self.statuses if s.instance_id == instance_id), default=0)


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def reads(client: redis.Redis) -> int:
    """GETRANGE commands Redis has served so far (the reader's only way of reading a key)."""
    return int(client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))


async def test_statuses_arrive_in_their_notices_without_a_read(redis_service) -> None:
    client = redis.Redis.from_url(redis_service.url)
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    sink = Sink()
    reader = CmsReader(redis_service.url, "t", sink, poll_interval=3600.0)  # after the first, only notices
    task = asyncio.create_task(reader.run())
    try:
        await reader.wait_first_poll(timeout=10)
        await eventually(lambda: client.pubsub_numsub(keys.events_channel("t"))[0][1] == 1, "the subscription")
        before = reads(client)
        for update_id in range(1, 51):
            writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=update_id, num_running=update_id))
        await eventually(lambda: sink.newest("e0") == 50, "the last status")
        assert reads(client) == before, "an inline status was read with a GET"
        ids = [s.update_id for s in sink.statuses]
        assert ids == sorted(ids) and len(ids) <= 50  # in order; a read's older ones may be skipped
        # a record too large to travel inline is announced plainly and read with one GET
        big = cms_pb2.InstanceStatus(
            instance_id="e0", update_id=51, admitted_request_ids=[f"{i:040d}" for i in range(MAX_INLINE_RECORD // 40)]
        )
        writer.write_status(big)
        await eventually(lambda: sink.newest("e0") == 51, "the large status")
        assert reads(client) == before + 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()


async def test_the_subscription_survives_what_is_no_notice(redis_service) -> None:
    client = redis.Redis.from_url(redis_service.url)
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    sink = Sink()
    reader = CmsReader(redis_service.url, "t", sink, poll_interval=3600.0)
    task = asyncio.create_task(reader.run())
    channel = keys.events_channel("t")
    try:
        await reader.wait_first_poll(timeout=10)
        await eventually(lambda: client.pubsub_numsub(channel)[0][1] == 1, "the subscription")
        # on e0's own channel: taken as e0's record, refused as one, counted
        client.publish(keys.instance_events_channel("t", "e0"), b"status:e0:\xff\xfe garbage")
        await eventually(lambda: reader.num_bad_records == 1, "the bad inline record refused")
        errors = reader.num_redis_errors
        # no notice is this long: discarded as it arrives and counted, the connection kept
        client.publish(channel, b"x" * (MAX_BULK + 1))
        await eventually(lambda: reader.refused_by_reason.get("oversize") == 1, "the oversized message refused")
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=7))
        await eventually(lambda: sink.newest("e0") == 7, "a status after it")
        assert reader.num_redis_errors == errors  # the subscription was never dropped
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()


async def test_without_notice_records_every_notice_is_only_a_hint_to_read(redis_service) -> None:
    """For Redis ACLs that confine each llumlet to its own keys: a record in a notice, which anyone
    allowed to publish could have sent, is never taken; the key it names is read instead."""
    client = redis.Redis.from_url(redis_service.url)
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=1))
    sink = Sink()
    reader = CmsReader(redis_service.url, "t", sink, poll_interval=3600.0, notice_records=False)
    task = asyncio.create_task(reader.run())
    channel = keys.events_channel("t")
    try:
        await reader.wait_first_poll(timeout=10)
        await eventually(lambda: client.pubsub_numsub(channel)[0][1] == 1, "the subscription")
        before = reads(client)
        forged = cms_pb2.InstanceStatus(instance_id="e0", update_id=2, num_running=99).SerializeToString()
        client.publish(channel, b"status:e0:" + forged)
        await eventually(lambda: reads(client) == before + 1, "the key read instead")
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=3, num_running=1))
        await eventually(lambda: sink.newest("e0") == 3, "the written status, read from its key")
        assert all(s.num_running != 99 for s in sink.statuses), "a record from a notice was taken"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()


async def test_a_record_is_taken_only_from_its_own_instances_channel(redis_service) -> None:
    """Redis ACLs can confine a llumlet to publishing on its own channel, not to what it says there:
    a record about e0 is taken from e0's channel only. On the shared channel it is a reason to read
    e0's key; on another instance's channel it is refused (counted), and nothing is read."""
    client = redis.Redis.from_url(redis_service.url)
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=1))
    sink = Sink()
    reader = CmsReader(redis_service.url, "t", sink, poll_interval=3600.0)
    task = asyncio.create_task(reader.run())
    shared = keys.events_channel("t")
    try:
        await reader.wait_first_poll(timeout=10)
        await eventually(lambda: client.pubsub_numsub(shared)[0][1] == 1, "the subscription")
        await eventually(lambda: client.pubsub_numpat() == 1, "the pattern subscription")
        forged = cms_pb2.InstanceStatus(instance_id="e0", update_id=2, num_running=99).SerializeToString()
        before = reads(client)
        client.publish(shared, b"status:e0:" + forged)
        await eventually(lambda: reads(client) == before + 1, "the key read instead")
        client.publish(keys.instance_events_channel("t", "e1"), b"status:e0:" + forged)
        await eventually(lambda: reader.refused_by_reason.get("notice_sender") == 1, "the notice refused")
        assert reads(client) == before + 1
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=3, num_running=1))
        await eventually(lambda: sink.newest("e0") == 3, "e0's own status, from its own channel")
        assert reads(client) == before + 1, "e0's own notice carried its record: no read"
        assert all(s.num_running != 99 for s in sink.statuses), "a forged record was taken"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()
