"""The CMS reader's poll against keys anyone may write: a bad key is refused once and skipped, the
rest of the poll goes on, and what the reader remembers stays bounded (docs/cms-trust.md)."""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from typing import Any

import pytest

from pilotfish.cms import keys
from pilotfish.cms.reader import CmsReader
from pilotfish.protos import cms_pb2

CLUSTER = "c"


def _reply_error(message: str) -> Exception:
    from redis.exceptions import ResponseError

    return ResponseError(message)


class FakeRedis:
    """The Redis the reader polls: SCAN (MATCH on the name, as Redis's glob does), GETRANGE, STRLEN,
    each through a pipeline as the reader sends them. A value that is a dict is a hash key."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes | dict[bytes, bytes]] = {}
        self.reads: list[bytes] = []

    def pipeline(self, transaction: bool) -> _Pipeline:
        return _Pipeline(self)

    def value(self, key: bytes, end: int) -> bytes | Exception:
        self.reads.append(key)
        value = self.data.get(key, b"")
        if isinstance(value, dict):
            return _reply_error("WRONGTYPE Operation against a key holding the wrong kind of value")
        return value[: end + 1]

    async def getrange(self, key: str | bytes, start: int, end: int) -> bytes:
        value = self.value(_b(key), end)
        if isinstance(value, Exception):
            raise value
        return value

    async def strlen(self, key: str | bytes) -> int:
        value = self.data.get(_b(key), b"")
        return len(value) if isinstance(value, bytes) else 0


class _Pipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self._redis = redis
        self._queued: list[tuple[str, Any]] = []

    def scan(self, cursor: int, match: str, count: int) -> None:
        self._queued.append(("scan", match))

    def getrange(self, key: str | bytes, start: int, end: int) -> None:
        self._queued.append(("getrange", (_b(key), end)))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        out: list[Any] = []
        for op, arg in self._queued:
            if op == "scan":  # every key in one page
                pattern = arg.encode().decode("latin-1")
                names = [k for k in self._redis.data if fnmatch.fnmatchcase(k.decode("latin-1"), pattern)]
                out.append((0, names))
            else:
                out.append(self._redis.value(*arg))
        return out


def _b(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


class ViewSink:
    """The scheduler's view as the reader sees it: instances by their metadata, statuses, removals."""

    def __init__(self) -> None:
        self.metas: dict[str, cms_pb2.InstanceMetadata] = {}
        self.statuses: dict[str, cms_pb2.InstanceStatus] = {}
        self.refused: list[tuple[str, str]] = []

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        self.metas[meta.instance_id] = meta
        return True

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        self.statuses[status.instance_id] = status
        return True

    def status_gone(self, instance_id: str) -> None:
        self.statuses.pop(instance_id, None)

    def remove(self, instance_id: str) -> bool:
        self.statuses.pop(instance_id, None)
        return self.metas.pop(instance_id, None) is not None

    def known(self) -> set[str]:
        return set(self.metas)

    def record_refused(self, instance_id: str, reason: str) -> None:
        self.refused.append((instance_id, reason))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def meta_bytes(instance_id: str, port: int = 8000) -> bytes:
    meta = cms_pb2.InstanceMetadata(instance_id=instance_id, host="10.0.0.1", http_port=port, model="m", infer_type=1)
    return meta.SerializeToString()


def status_bytes(instance_id: str, update_id: int = 1) -> bytes:
    return cms_pb2.InstanceStatus(instance_id=instance_id, update_id=update_id).SerializeToString()


def key(kind: str, instance_id: str) -> bytes:
    return f"pilotfish:{CLUSTER}:{kind}:{instance_id}".encode()


def setup() -> tuple[FakeRedis, ViewSink, CmsReader, Clock]:
    redis, sink, clock = FakeRedis(), ViewSink(), Clock()
    reader = CmsReader("redis://127.0.0.1:1/0", CLUSTER, sink, removal_grace=3.0, clock=clock)
    reader._client = redis
    return redis, sink, reader, clock


def poll(reader: CmsReader) -> None:
    asyncio.run(reader.poll_once())


# -- key names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind", "expected"),
    [
        (b"pilotfish:c:meta:e0", keys.META, "e0"),
        (b"pilotfish:c:status:e0", keys.STATUS, "e0"),
        ("pilotfish:c:meta:e0", keys.META, "e0"),
        (b"pilotfish:c:meta:\xff", keys.META, None),  # not UTF-8
        (b"pilotfish:c:meta:x:e0", keys.META, None),  # an alias of e0's key
        (b"pilotfish:c:meta:", keys.META, None),
        (b"pilotfish:c:meta:e0\n", keys.META, None),
        (b"pilotfish:c:meta:a*b", keys.META, None),
        (b"pilotfish:c:status:e0", keys.META, None),  # the other kind
        (b"pilotfish:d:meta:e0", keys.META, None),  # another cluster
        (b"pilotfish:c:meta:" + b"e" * (keys.MAX_ID_LENGTH + 1), keys.META, None),
        (b"pilotfish:c:meta:" + b"e" * 10_000, keys.META, None),
    ],
)
def test_a_key_is_exactly_prefix_cluster_kind_id(name: str | bytes, kind: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(keys.BadId):
            keys.instance_in(name, CLUSTER, kind)
    else:
        assert keys.instance_in(name, CLUSTER, kind) == expected


def test_instance_of_never_raises_on_a_name_that_is_not_utf8() -> None:
    assert keys.instance_of(b"pilotfish:c:meta:\xff") == "\ufffd"


def test_a_bad_key_name_is_refused_once_and_the_poll_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    redis, sink, reader, clock = setup()
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    redis.data[key("status", "e0")] = status_bytes("e0")
    redis.data[b"pilotfish:c:meta:\xff"] = b"x"
    redis.data[b"pilotfish:c:status:\xfe\xff"] = status_bytes("e0", 7)
    # an alias key holding e1's valid metadata: not e1's record
    redis.data[b"pilotfish:c:meta:x:e1"] = meta_bytes("e1", 9999)
    caplog.set_level(logging.WARNING)
    poll(reader)
    assert set(sink.metas) == {"e0"} and sink.statuses["e0"].update_id == 1
    assert sorted(reason for _, reason in sink.refused) == ["invalid_field"] * 3
    assert reader.refused_by_reason == {"invalid_field": 3}
    assert "\\xff" in caplog.text and "x:e1" in caplog.text
    # refused by name: never read
    assert not [name for name in redis.reads if b"\xff" in name or b"x:e1" in name]

    # e0 leaves, e2 arrives with no notice: the poll still sees both
    del redis.data[key("meta", "e0")], redis.data[key("status", "e0")]
    redis.data[key("meta", "e2")] = meta_bytes("e2")
    poll(reader)
    assert set(sink.metas) == {"e0", "e2"}  # e0 within the removal grace
    clock.now += 5
    poll(reader)
    assert set(sink.metas) == {"e2"}
    assert reader.num_polls == 3
    assert reader.refused_by_reason == {"invalid_field": 3}  # each bad key counted once
