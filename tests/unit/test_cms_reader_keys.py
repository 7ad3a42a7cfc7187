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


# -- refused keys cost a lookup per poll, however many; the memory of them is bounded ------------------


class CountingDecodes:
    """Counts the records the reader decodes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import pilotfish.cms.reader as reader_module

        self.n = 0
        for name in ("decode_metadata", "decode_status"):
            real = getattr(reader_module, name)

            def counted(*args: Any, _real: Any = real) -> Any:
                self.n += 1
                return _real(*args)

            monkeypatch.setattr(reader_module, name, counted)


def warnings(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if r.levelno == logging.WARNING])


def test_thousands_of_unchanged_bad_records_are_decoded_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis, sink, reader, clock = setup()
    decodes = CountingDecodes(monkeypatch)
    n = 3000  # more than the reader's 2048 summaries, more than the log's 1024 pairs
    for k in range(n):
        redis.data[key("meta", f"bad-{k}")] = b"\xff\xff not a protobuf"
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    caplog.set_level(logging.WARNING)
    poll(reader)
    assert reader.refused_by_reason == {"malformed": n} and len(sink.refused) == n
    assert decodes.n == n + 1
    first_lines = warnings(caplog)
    assert first_lines <= 110  # all pairs together log a bounded number of lines
    for _ in range(3):
        clock.now += 2
        poll(reader)
    assert decodes.n == n + 1  # nothing decoded again
    assert reader.refused_by_reason == {"malformed": n} and len(sink.refused) == n
    assert warnings(caplog) == first_lines
    assert set(sink.metas) == {"e0"}
    # a key that changes is refused (and counted) again; one that leaves is forgotten
    redis.data[key("meta", "bad-0")] = b"\xff changed"
    del redis.data[key("meta", "bad-1")]
    poll(reader)
    assert reader.refused_by_reason == {"malformed": n + 1}
    assert len(reader._refused_keys) == n - 1
    redis.data[key("meta", "bad-1")] = b"\xff\xff not a protobuf"  # back: refused afresh
    poll(reader)
    assert reader.refused_by_reason == {"malformed": n + 2}


def test_past_the_memory_bound_refusals_are_neither_counted_nor_logged_one_by_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pilotfish.cms.refusals import RefusedKeys

    redis, sink, reader, clock = setup()
    reader._refused_keys = RefusedKeys(limit=100)
    for k in range(150):
        redis.data[key("status", f"bad-{k}")] = b"\xff"
    caplog.set_level(logging.WARNING)
    for _ in range(4):
        poll(reader)
        clock.now += 2
    assert len(reader._refused_keys) == 100  # the bound holds
    assert reader.refused_by_reason == {"malformed": 100}
    assert reader.num_unremembered == 4 * 50
    summaries = [r for r in caplog.records if "more than 100 CMS keys" in r.getMessage()]
    assert len(summaries) == 1  # rate-limited: one per interval
    clock.now += 30
    poll(reader)
    assert len([r for r in caplog.records if "more than 100 CMS keys" in r.getMessage()]) == 2
    # a real engine's record still goes through
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    poll(reader)
    assert set(sink.metas) == {"e0"}


def test_refusal_lines_of_all_pairs_together_are_bounded_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    from pilotfish.cms.refusals import RefusalLog

    now = [0.0]
    refusals = RefusalLog(logging.getLogger("t"), clock=lambda: now[0], interval=30.0, max_lines=10)
    caplog.set_level(logging.WARNING)
    for k in range(5000):
        refusals.note(f"i{k}", "malformed", "x")
    assert len(caplog.records) == 11  # ten lines, and one saying the rest are not logged
    assert refusals.counts == {"malformed": 5000}
    now[0] = 31.0
    refusals.note("j", "malformed", "x")
    assert len(caplog.records) == 12 and "4990 refusals of any instance not logged" in caplog.records[-1].getMessage()


def test_the_memory_of_refused_keys_stays_within_its_stated_bound() -> None:
    import tracemalloc

    from pilotfish.cms.records import digest
    from pilotfish.cms.refusals import MAX_REFUSED_KEYS, RefusedKeys

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        refused = RefusedKeys()
        for k in range(MAX_REFUSED_KEYS + 1000):
            refused.add(f"pilotfish:c:meta:bad-{k}-" + "x" * 100, digest(b"%d" % k))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(refused) == MAX_REFUSED_KEYS
    assert used < 7.5 * 2**20, used  # the bound refusals.py states


def test_a_key_of_the_wrong_type_is_refused_once_until_it_changes() -> None:
    redis, sink, reader, clock = setup()
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    redis.data[key("status", "e0")] = {b"a": b"b"}  # a hash
    for _ in range(3):
        poll(reader)
        clock.now += 0.5
    assert reader.refused_by_reason == {"malformed": 1} and sink.refused == [("e0", "malformed")]
    redis.data[key("status", "e0")] = status_bytes("e0", 4)
    poll(reader)
    assert sink.statuses["e0"].update_id == 4
    redis.data[key("status", "e0")] = {b"a": b"b"}  # changed back: refused again, once
    poll(reader)
    poll(reader)
    assert reader.refused_by_reason == {"malformed": 2}


# -- what the reader remembers of keys that left Redis -----------------------------------------------------


def test_statuses_without_metadata_under_rotated_ids_are_not_remembered_once_gone() -> None:
    redis, _, reader, clock = setup()
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    redis.data[key("status", "e0")] = status_bytes("e0")
    for round_ in range(5):
        ghosts = [key("status", f"ghost-{round_}-{k}") for k in range(100)]
        for name in ghosts:
            redis.data[name] = status_bytes(name.decode().rsplit(":", 1)[-1])
        poll(reader)
        for name in ghosts:
            del redis.data[name]
        clock.now += 1
    poll(reader)
    # only e0's two keys are remembered, however many ids came and went
    assert set(reader._last_digest) == {key("meta", "e0").decode(), key("status", "e0").decode()}


def test_a_departure_waiting_out_the_grace_keeps_what_it_needs() -> None:
    redis, sink, reader, clock = setup()
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    redis.data[key("status", "e0")] = status_bytes("e0")
    poll(reader)
    del redis.data[key("status", "e0")]
    poll(reader)
    clock.now += 1
    poll(reader)
    assert "e0" in sink.statuses  # within the grace
    clock.now += 5
    poll(reader)
    assert "e0" not in sink.statuses and set(sink.metas) == {"e0"}
    # both keys gone (a Redis restart, say), then only the metadata back: the status still leaves
    redis.data[key("status", "e0")] = status_bytes("e0", 2)
    poll(reader)
    assert sink.statuses["e0"].update_id == 2
    del redis.data[key("meta", "e0")], redis.data[key("status", "e0")]
    poll(reader)
    clock.now += 1
    redis.data[key("meta", "e0")] = meta_bytes("e0")
    poll(reader)
    clock.now += 5
    poll(reader)
    assert set(sink.metas) == {"e0"} and "e0" not in sink.statuses
