"""The llumlet against a real redis-server: what it writes, the TTL, the notices, the gRPC API,
and the scheduler's reader (cms/reader.py) refusing hostile records without crashing."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import pytest
import redis

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.cms.reader import CmsReader
from pilotfish.cms.records import MAX_RECORD_BYTES, decode_metadata, decode_status
from pilotfish.cms.writer import CmsWriter
from pilotfish.procs import free_port
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


def make_llumlet(url: str, instance: str = "e0", abort=None, write_from_engine_thread: bool = True, **kw) -> Llumlet:
    cfg = LlumletConfig(cms_url=url, cluster="t", **{"ttl_ms": 1500, "refresh_ms": 500, **kw})
    meta = cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=8000, model="m", block_size=16)
    llumlet = Llumlet(cfg, instance, meta, abort_handler=abort, step_hooks=write_from_engine_thread)
    return llumlet


def test_writer_output_is_what_the_reader_accepts(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.instance_events_channel("t", "e0"))  # the writer's own channel
    writer = CmsWriter(redis_service.url, "t", "e0", ttl_ms=5000)
    status = cms_pb2.InstanceStatus(instance_id="e0", update_id=7, num_waiting=3, admitted_request_ids=["a", "b"])
    writer.write_status(status)
    raw = client.get(keys.status_key("t", "e0"))
    assert decode_status(raw, "e0") == status
    assert 0 < client.pttl(keys.status_key("t", "e0")) <= 5000
    message = wait_for(lambda: pubsub.get_message(timeout=0.1), what="status notice")
    assert message["data"] == b"status:e0:" + raw  # the record travels with its notice
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=1))
    assert decode_metadata(client.get(keys.meta_key("t", "e0")), "e0").host == "h"
    writer.remove()
    assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 0
    writer.close()


def test_remove_lands_after_every_write_made_without_waiting(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    writer = CmsWriter(redis_service.url, "t", "e1", ttl_ms=5000)
    writer.write_status(cms_pb2.InstanceStatus(instance_id="e1", update_id=1))  # opens the status connection
    sent = [writer.try_write_status(cms_pb2.InstanceStatus(instance_id="e1", update_id=i)) for i in range(2, 200)]
    assert any(sent), "no write went without waiting"
    writer.remove()
    # every SET the kernel took had been answered before the DELETE went out: none can revive the key
    assert writer._unread == 0
    assert client.exists(keys.status_key("t", "e1")) == 0
    writer.close()


@pytest.mark.parametrize("from_engine_thread", [True, False], ids=["engine-thread", "export-thread"])
def test_llumlet_registers_exports_and_removes(redis_service, from_engine_thread):
    client = redis.Redis.from_url(redis_service.url)
    # a TTL of six refreshes: the keys outlive it only by the refresh, even with a refresh a second late
    llumlet = make_llumlet(redis_service.url, write_from_engine_thread=from_engine_thread, ttl_ms=3000)
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
        time.sleep(3.5)
        assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 2
    finally:
        llumlet.stop()
    assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 0


_MONITOR_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_MONITOR_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)
_MONITOR_CHARS = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _monitor_args(line: bytes) -> list[bytes]:
    """The arguments of one MONITOR line, unescaped (Redis quotes them the way sdscatrepr does)."""

    def unescape(m: re.Match[bytes]) -> bytes:
        code = m.group(1)
        return bytes([int(code[1:], 16)]) if code[:1] == b"x" and len(code) == 3 else _MONITOR_CHARS.get(code, code)

    return [_MONITOR_ESCAPE.sub(unescape, arg) for arg in _MONITOR_ARG.findall(line)]


def test_engine_thread_writes_land_in_update_order(redis_service):
    """Events written from the engine's thread and the export thread's refreshes share one
    connection: Redis executes them in update_id order, and the last record is the last state."""
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url, refresh_ms=100, ttl_ms=1000)
    llumlet.start(serve_grpc=False)
    try:
        wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="first status")
        status_key = keys.status_key("t", "e0").encode()
        written: list[bytes] = []
        from_export_thread = llumlet.exports - llumlet.inline_exports
        with client.monitor() as monitor:
            for i in range(300):
                with llumlet.events() as s:
                    s.added(f"r{i}", 10)
                if i % 50 == 0:
                    time.sleep(0.15)  # let refreshes from the export thread interleave
            with llumlet.events() as s:
                s.set_schedulable(False)  # the last event: its record must be the last one
            last = wait_for(
                lambda: (
                    (raw := client.get(keys.status_key("t", "e0")))
                    and not decode_status(raw, "e0").schedulable
                    and decode_status(raw, "e0")
                ),
                what="the last state",
            )
            client.set("t:done", b"1")
            while (args := _monitor_args(monitor.connection.read_response()))[:2] != [b"SET", b"t:done"]:
                if args[:2] == [b"SET", status_key]:
                    written.append(args[2])
        assert last.num_waiting == 300
        assert llumlet.inline_exports > 0, "no write came from the engine's thread"
        assert llumlet.exports - llumlet.inline_exports > from_export_thread, "no write came from the export thread"
    finally:
        llumlet.stop()
    records = [decode_status(raw, "e0") for raw in written]
    ids = [r.update_id for r in records]
    assert len(ids) >= llumlet.inline_exports
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # the last record Redis executed carries the last state (a refresh may have re-written it since)
    assert ids[-1] >= last.update_id
    assert (records[-1].num_waiting, records[-1].schedulable) == (300, False)


# No refresh within any test's waits: a failure is seen, and the state written again, by the
# export thread reading the replies the engine thread's writes left behind.
NO_REFRESH = {"refresh_ms": 600_000, "ttl_ms": 1_200_000}


@pytest.mark.parametrize("events", [1, 5], ids=["last-write-refused", "later-writes-follow"])
def test_a_refused_write_is_reported_and_the_latest_state_lands_later(redis_service, caplog, events):
    """Redis answers SET with an error (out of memory): the engine-thread write cannot see the
    reply; the next write or the export thread does, logs it, and retries until the state lands."""
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url, **NO_REFRESH)
    llumlet.start(serve_grpc=False)
    try:
        wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="first status")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        with caplog.at_level(logging.WARNING, logger="pilotfish.llumlet"):
            for i in range(events):
                with llumlet.events() as s:
                    s.added(f"r{i}", 10)
            # the failure is counted before its warning is logged, on the writer's thread: wait for the line too
            wait_for(lambda: llumlet.write_failures > 0 and "OOM" in caplog.text, timeout=30, what="a failed write")
            client.config_set("maxmemory", "0")
            wait_for(
                lambda: (
                    (raw := client.get(keys.status_key("t", "e0"))) and decode_status(raw, "e0").num_waiting == events
                ),
                timeout=30,
                what="the latest state after Redis takes writes again",
            )
        assert llumlet.inline_exports > 0  # the refused write was the engine thread's
    finally:
        client.config_set("maxmemory", "0")
        llumlet.stop()


def test_a_refused_write_right_after_an_accepted_one_is_seen_without_a_refresh(redis_service, caplog):
    """The export thread looks for owed replies on its own while the engine is busy (no wake-up
    from the write), and sleeps, to be woken by the next write, once it is idle."""
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url, **NO_REFRESH)
    llumlet.start(serve_grpc=False)
    try:
        wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="first status")
        # each write is the engine thread's own only when the export thread is not holding the export lock
        # to read replies: wait until it sleeps, idle (on a loaded machine it may still be reading)
        def idle() -> bool:
            return llumlet.exporter._napping

        wait_for(idle, timeout=30, what="the export thread idle")
        with llumlet.events() as s:
            s.added("r0", 10)
        wait_for(lambda: not llumlet.writer.owes_replies(), timeout=30, what="the accepted write's replies read")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        wait_for(idle, timeout=30, what="the export thread idle again")
        with caplog.at_level(logging.WARNING, logger="pilotfish.llumlet"):
            with llumlet.events() as s:
                s.added("r1", 10)
            wait_for(lambda: llumlet.write_failures > 0, timeout=30, what="the refused write seen")
            client.config_set("maxmemory", "0")
            wait_for(
                lambda: (raw := client.get(keys.status_key("t", "e0"))) and decode_status(raw, "e0").num_waiting == 2,
                timeout=30,
                what="the latest state",
            )
        assert llumlet.inline_exports >= 2 and "OOM" in caplog.text
    finally:
        client.config_set("maxmemory", "0")
        llumlet.stop()


def test_engine_thread_writes_resume_after_a_redis_restart(redis_binary, tmp_path):
    port = free_port()
    first = services.start_redis(tmp_path / "r1", port)
    llumlet = make_llumlet(first.url, **NO_REFRESH)
    llumlet.start(serve_grpc=False)
    try:
        client = redis.Redis.from_url(first.url)
        wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="first status")
        first.stop()
        for i in range(3):  # the engine goes on while Redis is away: never blocked, nothing kept back
            with llumlet.events() as s:
                s.added(f"r{i}", 10)
        wait_for(lambda: llumlet.write_failures > 0, timeout=30, what="the outage seen")
        with services.start_redis(tmp_path / "r2", port) as second:
            client = redis.Redis.from_url(second.url)
            wait_for(
                lambda: (raw := client.get(keys.status_key("t", "e0"))) and decode_status(raw, "e0").num_waiting == 3,
                what="the state written again after the restart",
            )
            added = [3]

            def add_one() -> bool:  # until one is written from the engine's thread again
                with llumlet.events() as s:
                    s.added(f"r{added[0]}", 10)
                added[0] += 1
                return llumlet.inline_exports > before

            before = llumlet.inline_exports
            wait_for(add_one, what="an engine-thread write after the restart")
            wait_for(
                lambda: decode_status(client.get(keys.status_key("t", "e0")), "e0").num_waiting == added[0],
                what="the latest state",
            )
            llumlet.stop()
    finally:
        llumlet.stop()
        first.stop()


def test_keys_expire_after_the_ttl_when_the_llumlet_dies(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    wait_for(lambda: client.exists(keys.status_key("t", "e0")), what="status")
    llumlet.stop(remove=False)  # as if killed: nothing refreshes or deletes the keys
    ttl = client.pttl(keys.meta_key("t", "e0"))
    assert ttl == -2 or 0 < ttl <= 1500  # expiring (or, on a slow machine, gone already), never kept
    wait_for(lambda: client.exists(keys.meta_key("t", "e0")) == 0, timeout=10, what="metadata to expire")


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


@pytest.mark.parametrize("serve_grpc", [True, False])
def test_an_engine_without_the_grpc_server_advertises_no_llumlet_port(redis_service, serve_grpc):
    """PILOTFISH_SERVE_GRPC=false: no server, so the metadata names no port the rescheduler could call."""
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.engine.scheduler import V1Engine
    from pilotfish.simulator.engine.step_time import load_profile
    from pilotfish.simulator.llumlet_adapter import attach_llumlet

    engine_config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=16,
                                 num_gpu_blocks=32)  # fmt: skip
    config = LlumletConfig(cms_url=redis_service.url, cluster="t", serve_grpc=serve_grpc)
    llumlet = attach_llumlet(V1Engine(engine_config, load_profile("cpu-tiny")), engine_config, config, "e0",
                             "127.0.0.1", 8000)  # fmt: skip
    try:
        client = redis.Redis.from_url(redis_service.url)
        meta = decode_metadata(wait_for(lambda: client.get(keys.meta_key("t", "e0")), what="metadata"), "e0")
        assert (meta.llumlet_port > 0) is serve_grpc
        assert (llumlet._server is not None) is serve_grpc
    finally:
        llumlet.stop()


async def test_a_redis_that_comes_back_empty_does_not_empty_the_view_before_the_llumlets_write_again(
    redis_service,
):
    """Records missing from a poll count as gone only after the removal grace (the clock here is
    the test's): a restarted Redis is refilled by the llumlets within their refresh interval."""
    url = redis_service.url
    writer = CmsWriter(url, "t", "e0", ttl_ms=60_000)
    writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
    writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=5))
    now = [1000.0]
    sink = Sink()
    reader = CmsReader(url, "t", sink, poll_interval=0.02, removal_grace=3.0, clock=lambda: now[0])
    task = asyncio.create_task(reader.run())
    try:
        await reader.wait_first_poll(timeout=10)
        redis.Redis.from_url(url).flushall()  # what a Redis restarted without persistence holds

        async def polls(n: int) -> None:
            target = reader.num_polls + n
            async with asyncio.timeout(30):
                while reader.num_polls < target:
                    await asyncio.sleep(0.01)

        await polls(3)
        now[0] += 2.9  # within the grace: still there, schedulable on its last status
        await polls(3)
        assert "e0" in sink.meta and "e0" in sink.status
        writer.write_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="127.0.0.1", http_port=8000))
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=6))
        now[0] += 10  # written again in time: the grace never ran out
        await polls(3)
        assert sink.status["e0"].update_id == 6
        redis.Redis.from_url(url).flushall()
        await polls(3)
        now[0] += 3.1  # missing past the grace: gone
        await polls(3)
        assert "e0" not in sink.meta
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()
