"""Discovery without servers: the API types, records, URL selection, the static and file backends,
and the sidecar's endpoint list and health thresholds."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from pilotfish.config import ConfigError
from pilotfish.discovery import (
    Instance,
    InstanceAddedEvent,
    InstanceRemovedEvent,
    InstanceStatus,
    open_discovery,
    open_registry,
    parse_instance,
)
from pilotfish.discovery.backends.etcd import EtcdDiscovery, EtcdRegistry
from pilotfish.discovery.backends.file import FileDiscovery
from pilotfish.discovery.backends.memory import MemoryBackend
from pilotfish.discovery.backends.redis import RedisDiscovery, RedisRegistry
from pilotfish.discovery.config import SidecarConfig
from pilotfish.discovery.etcd_http import prefix_end
from pilotfish.discovery.health import HealthState
from pilotfish.discovery.records import InstanceRecord, MalformedRecord, decode_record, encode_record
from pilotfish.discovery.sidecar import endpoints_from_config
from pilotfish.discovery.testing import Watcher, wait_for
from pilotfish.discovery.view import View


@pytest.mark.parametrize(
    ("given", "status"),
    [
        ("ready", InstanceStatus.READY),
        ("Ready", InstanceStatus.READY),
        ("not_ready", InstanceStatus.NOT_READY),
        ("not-ready", InstanceStatus.NOT_READY),
        (True, InstanceStatus.READY),
        (False, InstanceStatus.NOT_READY),
        (InstanceStatus.NOT_READY, InstanceStatus.NOT_READY),
    ],
)
def test_instance_status_parse(given: object, status: InstanceStatus) -> None:
    assert InstanceStatus.parse(given) is status  # type: ignore[arg-type]


def test_instance_status_rejects_other_words() -> None:
    with pytest.raises(ValueError, match="ready"):
        InstanceStatus.parse("maybe")


def test_instance_keeps_the_static_api() -> None:
    inst = parse_instance("e0=127.0.0.1:8001")
    assert inst == Instance("e0", "127.0.0.1", 8001)
    assert inst.address == "127.0.0.1:8001"
    assert Instance("a", "::1", 80).address == "[::1]:80"
    # metadata does not take part in equality or hashing: routing tables key on the address
    with_meta = Instance("e0", "127.0.0.1", 8001, metadata_snapshot={"m": 1})
    assert with_meta == inst and hash(with_meta) == hash(inst) and not with_meta.same_as(inst)


async def test_instance_metadata_from_snapshot_is_a_copy() -> None:
    inst = Instance("e0", "h", 1, metadata_snapshot={"model": "m"})
    got = await inst.metadata()
    got["model"] = "changed"
    assert await inst.metadata() == {"model": "m"}
    assert await Instance("e1", "h", 1).metadata() == {}


def test_view_turns_snapshots_into_events() -> None:
    view = View()
    a, b = Instance("a", "h", 1), Instance("b", "h", 2)
    assert view.replace({"a": a, "b": b}) == [InstanceAddedEvent(a), InstanceAddedEvent(b)]
    assert view.replace({"a": a, "b": b}) == []
    moved = Instance("a", "h", 9)
    assert view.replace({"a": moved, "b": b}) == [InstanceAddedEvent(moved)]  # an update is an Added
    assert view.replace({"a": moved}, keep_missing=lambda _id: True) == []  # kept (store came back)
    assert view.replace({"a": moved}) == [InstanceRemovedEvent(b)]
    assert view.remove("a") == [InstanceRemovedEvent(moved)] and view.remove("a") == []


def _record(**overrides: object) -> bytes:
    fields: dict[str, object] = dict(
        instance_id="i", namespace="n", component="c", host="h", port=1, timestamp_ms=1, update_id=1
    )
    fields.update(overrides)
    return msgspec.json.encode(fields)


def test_record_round_trip() -> None:
    record = InstanceRecord(
        instance_id="i", namespace="n", component="c", host="h", port=80, timestamp_ms=5, update_id=2,
        metadata={"model": "m"},
    )  # fmt: skip
    back = decode_record(encode_record(record), "n", "c", "i")
    assert back == record
    assert back.to_instance() == Instance("i", "h", 80, "n", "c")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{nope", "malformed"),
        (b"[]", "Expected `object`"),
        (_record(port=0), "port"),
        (_record(port=70000), "port"),
        (_record(host=""), "host"),
        (_record(timestamp_ms="soon"), "timestamp_ms"),
        (_record(metadata=[1]), "metadata"),
        (_record(instance_id="other"), "not the key's"),
        (_record(component="other"), "not the key's"),
        (_record(metadata={"x": "y" * 70_000}), "over"),
    ],
)
def test_malformed_records_are_rejected(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedRecord, match=reason):
        decode_record(raw, "n", "c", "i")


def test_unknown_record_fields_are_tolerated() -> None:
    # a newer writer may add fields; an older reader still reads the record
    assert decode_record(_record(zone="a"), "n", "c", "i").port == 1


@pytest.mark.parametrize(
    ("url", "reader", "writer"),
    [
        ("static:", MemoryBackend, MemoryBackend),
        ("static:e0=127.0.0.1:8001,127.0.0.1:8002", MemoryBackend, MemoryBackend),
        ("redis://127.0.0.1:6379/0", RedisDiscovery, RedisRegistry),
        ("redis://127.0.0.1:6379/0?prefix=x", RedisDiscovery, RedisRegistry),
        ("etcd://127.0.0.1:2379", EtcdDiscovery, EtcdRegistry),
        ("etcd://127.0.0.1:2379,127.0.0.1:2380?prefix=x", EtcdDiscovery, EtcdRegistry),
    ],
)
def test_urls_select_backends(url: str, reader: type, writer: type) -> None:
    assert isinstance(open_discovery(url), reader)
    assert isinstance(open_registry(url), writer)


@pytest.mark.parametrize(
    "url",
    ["", "nope:", "http://x", "static:e0=h", "etcd://", "etcd://h:1?bogus=1", "k8s:?bogus=1", "k8s:?metadata_port=x"],
)
def test_bad_urls_fail_with_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="--discovery"):
        open_discovery(url)


def test_file_lists_are_read_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read-only"):
        open_registry(f"file:{tmp_path / 'x.yaml'}")


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"


async def test_static_list_answers_every_query() -> None:
    discovery = open_discovery("static:e0=127.0.0.1:8001,127.0.0.1:8002")
    listed = await discovery.list_instances("any", "thing")
    assert [(i.instance_id, i.address) for i in listed] == [
        ("127.0.0.1:8002", "127.0.0.1:8002"),
        ("e0", "127.0.0.1:8001"),
    ]


async def test_in_process_registry_reaches_watchers() -> None:
    backend = MemoryBackend()
    watchers = [Watcher(backend, "ns", "c") for _ in range(2)]
    handle = await backend.register_instance("ns", "c", instance_id="x", host="127.0.0.1", port=1)
    await handle.set_metadata({"model": "m"})
    assert await backend.list_instances("ns", "c") == []  # registered is not ready
    await handle.set_ready("ready")
    for w in watchers:
        await wait_for(lambda w=w: w.ids() == {"x"}, "ready instance")
    assert await watchers[0].instances["x"].metadata() == {"model": "m"}
    assert await backend.list_instances("ns", "other") == []
    await handle.set_ready(InstanceStatus.NOT_READY)
    for w in watchers:
        await wait_for(lambda w=w: w.ids() == set(), "not-ready instance removed")
    for w in watchers:
        await w.close()


async def test_file_backend_reloads_and_keeps_the_last_good_list(tmp_path: Path) -> None:
    path = tmp_path / "instances.yaml"
    path.write_text("- e0=127.0.0.1:8001\n- {id: e1, host: 127.0.0.1, port: 8002, component: prefill}\n")
    discovery = open_discovery(f"file:{path}", interval=0.05)
    assert isinstance(discovery, FileDiscovery)
    assert [i.instance_id for i in await discovery.list_instances("ns", "decode")] == ["e0"]
    assert [i.instance_id for i in await discovery.list_instances("ns", "prefill")] == ["e0", "e1"]
    watcher = Watcher(discovery, "ns", "decode")
    await wait_for(lambda: watcher.ids() == {"e0"}, "initial list")

    def rewrite(text: str) -> None:
        path.write_text(text)
        st = path.stat()  # make the change visible even within one mtime tick
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    rewrite("instances:\n  - e0=127.0.0.1:8001\n  - e2=127.0.0.1:8003\n")
    await wait_for(lambda: watcher.ids() == {"e0", "e2"}, "reloaded file")
    rewrite("- not an instance\n")
    rewrite("- [broken\n")
    assert [i.instance_id for i in await discovery.list_instances("ns", "decode")] == ["e0", "e2"]
    assert watcher.ids() == {"e0", "e2"}
    rewrite("- e2=127.0.0.1:8003\n")
    await wait_for(lambda: watcher.ids() == {"e2"}, "removal after a good file")
    await watcher.close()


@pytest.mark.parametrize(
    "text",
    ["- e0=h\n", "- {host: h}\n", "[e0=h:1, e0=h:2]\n", "- {host: h, port: 1, metadata: [1]}\n", "- [x\n", "42\n"],
)
def test_bad_file_at_start_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        open_discovery(f"file:{path}")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_discovery(f"file:{tmp_path / 'absent.yaml'}")


def test_sidecar_endpoints_expand_data_parallel_ranks() -> None:
    config = SidecarConfig(engines=["a=127.0.0.1:8000", "127.0.0.1:9000"], data_parallel_size=2)
    endpoints = endpoints_from_config(config)
    assert [(e.instance_id, e.port, e.rank) for e in endpoints] == [
        ("a-dp0", 8000, 0),
        ("a-dp1", 8001, 1),
        ("127.0.0.1:9000", 9000, 0),
        ("127.0.0.1:9001", 9001, 1),
    ]
    assert endpoints[1].check_url == "http://127.0.0.1:8001/health"
    advertised = endpoints_from_config(SidecarConfig(engines=["127.0.0.1:8000"], advertise_host="10.0.0.5"))
    assert [(e.instance_id, e.host, e.check_url) for e in advertised] == [
        ("10.0.0.5:8000", "10.0.0.5", "http://127.0.0.1:8000/health")
    ]


@pytest.mark.parametrize("engines", [[], ["nope"], ["a=127.0.0.1:8000", "a=127.0.0.1:9000"], ["127.0.0.1:65535"]])
def test_sidecar_rejects_bad_engine_lists(engines: list[str]) -> None:
    with pytest.raises(ConfigError, match="--engines"):
        endpoints_from_config(SidecarConfig(engines=engines, data_parallel_size=2 if engines else 1))


@pytest.mark.parametrize(
    ("checks", "success_threshold", "failure_threshold", "actions"),
    [
        ("+", 1, 3, [True]),
        ("++", 2, 3, [None, True]),
        ("+-+", 2, 3, [None, None, None]),
        ("+--", 1, 2, [True, None, False]),
        ("+-+-", 1, 2, [True, None, None, None]),  # failures must be consecutive
        ("---", 1, 1, [None, None, None]),  # never registered: nothing to remove
    ],
)
def test_health_thresholds(checks: str, success_threshold: int, failure_threshold: int, actions: list) -> None:
    state = HealthState()
    got = []
    for c in checks:
        action = state.record(c == "+", success_threshold, failure_threshold)
        if action is not None:
            state.registered = action
        got.append(action)
    assert got == actions
