"""The llumlet against a real redis-server: what it writes, the TTL, the notices, the gRPC API,
and the scheduler's reader (cms/reader.py) refusing hostile records without crashing."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import redis

from pilotfish.cms import keys
from pilotfish.cms.reader import CmsReader
from pilotfish.cms.records import MAX_RECORD_BYTES, decode_metadata, decode_status
from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet import Llumlet

pytestmark = pytest.mark.integration


def wait_for(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def make_llumlet(url: str, instance: str = "e0", abort=None, **kw) -> Llumlet:
    cfg = LlumletConfig(cms_url=url, cluster="t", **{"ttl_ms": 1500, "refresh_ms": 500, **kw})
    meta = cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=8000, model="m", block_size=16)
    return Llumlet(cfg, instance, meta, abort_handler=abort)


def test_writer_output_is_what_the_reader_accepts(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.events_channel("t"))
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=5000)
    status = cms_pb2.InstanceStatus(instance_id="e0", update_id=7, num_waiting=3, admitted_request_ids=["a", "b"])
    writer.write_status(status)
    raw = client.get(keys.status_key("t", "e0"))
    assert decode_status(raw, "e0") == status
    assert 0 < client.pttl(keys.status_key("t", "e0")) <= 5000
    message = wait_for(lambda: pubsub.get_message(timeout=0.1), what="status notice")
    assert message["data"] == b"status:e0"
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=1))
    assert decode_metadata(client.get(keys.meta_key("t", "e0")), "e0").host == "h"
    writer.remove()
    assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 0
    writer.close()


def test_llumlet_registers_exports_and_removes(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    try:
        meta = wait_for(lambda: client.get(keys.meta_key("t", "e0")), what="metadata")
        assert decode_metadata(meta, "e0").model == "m"
        with llumlet.events() as s:
            s.added("r1", 40)
        got = wait_for(
            lambda: (raw := client.get(keys.status_key("t", "e0"))) and decode_status(raw, "e0").num_waiting == 1,
            what="status with one waiting",
        )
        assert got
        status = decode_status(client.get(keys.status_key("t", "e0")), "e0")
        assert list(status.admitted_request_ids) == ["r1"] and status.uncomputed_prefill_tokens == 40
        # the refresh keeps both keys alive past the TTL with no events at all
        time.sleep(2.0)
        assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 2
    finally:
        llumlet.stop()
    assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 0


def test_keys_expire_after_the_ttl_when_the_llumlet_dies(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="status")
    llumlet.stop(remove=False)  # as if killed: nothing refreshes or deletes the keys
    t0 = time.monotonic()
    wait_for(lambda: client.exists(keys.meta_key("t", "e0")) == 0, timeout=5, what="metadata to expire")
    assert time.monotonic() - t0 <= 1.5 + 0.5


def test_grpc_status_abort_migrate_and_auth(redis_service):
    aborted: list[list[str]] = []

    def abort(ids: list[str]) -> list[str]:
        aborted.append(ids)
        return [i for i in ids if i != "unknown"]

    llumlet = make_llumlet(redis_service.url, abort=abort, llumlet_token="s3cret")
    llumlet.start()
    try:
        with llumlet.events() as s:
            s.added("r1", 10)
        port = llumlet.metadata.llumlet_port
        assert port > 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = llumlet_pb2_grpc.LlumletStub(channel)
            auth = (("authorization", "Bearer s3cret"),)
            with pytest.raises(grpc.RpcError) as denied:
                stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=5)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as wrong:
                stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=5, metadata=(("authorization", "Bearer x"),))
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            status = stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=5, metadata=auth)
            assert status.instance_id == "e0" and status.num_waiting == 1
            reply = stub.Abort(llumlet_pb2.AbortRequest(request_ids=["r1", "unknown"]), timeout=5, metadata=auth)
            assert list(reply.aborted_request_ids) == ["r1"] and aborted == [["r1", "unknown"]]
            with pytest.raises(grpc.RpcError) as migrate:
                stub.Migrate(llumlet_pb2.MigrateRequest(request_ids=["r1"]), timeout=5, metadata=auth)
            assert migrate.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "rescheduler" in migrate.value.details()
    finally:
        llumlet.stop()


class Sink:
    def __init__(self) -> None:
        self.meta: dict[str, cms_pb2.InstanceMetadata] = {}
        self.status: dict[str, cms_pb2.InstanceStatus] = {}

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        self.meta[meta.instance_id] = meta
        return True

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        held = self.status.get(status.instance_id)
        if held is None or status.update_id > held.update_id:
            self.status[status.instance_id] = status
        return True

    def status_gone(self, instance_id: str) -> None:
        self.status.pop(instance_id, None)

    def remove(self, instance_id: str) -> bool:
        self.meta.pop(instance_id, None)
        self.status.pop(instance_id, None)
        return True

    def known(self) -> set[str]:
        return set(self.meta)


HOSTILE = {
    "garbage": b"\xff\xfe not a protobuf",
    "oversized": b"\x0a" + b"\x80" * (MAX_RECORD_BYTES + 10),
    "other instance": cms_pb2.InstanceStatus(instance_id="e1", update_id=99).SerializeToString(),
    "id flood": cms_pb2.InstanceStatus(
        instance_id="e0", update_id=99, admitted_request_ids=["x"] * 5000
    ).SerializeToString(),
    "more KV used than exists": cms_pb2.InstanceStatus(
        instance_id="e0", update_id=99, used_kv_tokens=10, total_kv_tokens=1
    ).SerializeToString(),
}


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_reader_refuses_hostile_records_and_keeps_the_good_one(redis_service, caplog, name):
    url = redis_service.url
    writer = CmsWriter(url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    good = cms_pb2.InstanceStatus(instance_id="e0", update_id=5, num_running=2)
    writer.write_status(good)
    sink = Sink()
    reader = CmsReader(url, "t", sink, poll_interval=0.1)
    task = asyncio.create_task(reader.run())
    try:
        await reader.wait_first_poll(timeout=10)
        assert sink.status["e0"].num_running == 2
        caplog.set_level(logging.WARNING)
        client = redis.Redis.from_url(url)
        client.set(keys.status_key("t", "e0"), HOSTILE[name])
        client.publish(keys.events_channel("t"), "status:e0")
        client.publish(keys.events_channel("t"), b"\xff" * 10_000)  # a hostile notice, too
        for _ in range(100):
            if reader.num_bad_records:
                break
            await asyncio.sleep(0.05)
        assert reader.num_bad_records >= 1
        assert any("rejected CMS record" in r.getMessage() for r in caplog.records)
        assert not task.done(), "the reader must survive"
        assert sink.status["e0"] == good  # the last good record stands
        # and the next good write from the llumlet is taken again
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=6, num_running=3))
        for _ in range(100):
            if sink.status["e0"].num_running == 3:
                break
            await asyncio.sleep(0.05)
        assert sink.status["e0"].num_running == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()


def test_cli_shows_the_cms_and_calls_the_llumlet(redis_service, capsys):
    import json

    from pilotfish.cli import main

    llumlet = make_llumlet(redis_service.url, abort=lambda ids: ids[:1])
    llumlet.start()
    try:
        client = redis.Redis.from_url(redis_service.url)
        wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="status")
        client.set(keys.status_key("t", "bad"), b"\xff junk")
        assert main(["llumlet", "show", "--cms-url", redis_service.url, "--cluster", "t"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert {"kind": "meta", "instance": "e0"}.items() <= lines[0].items() and lines[0]["record"]["model"] == "m"
        assert any(line.get("rejected") for line in lines if line["instance"] == "bad")
        address = f"127.0.0.1:{llumlet.metadata.llumlet_port}"
        assert main(["llumlet", "status", "--address", address]) == 0
        assert json.loads(capsys.readouterr().out)["instance_id"] == "e0"
        assert main(["llumlet", "abort", "--address", address, "r1", "r2"]) == 0
        assert json.loads(capsys.readouterr().out) == {"aborted_request_ids": ["r1"]}
    finally:
        llumlet.stop()
