"""Forged or broken CMS records must not steer the scheduler (docs/cms-trust.md).

Each refusal is checked for what it refuses, that it is counted and logged (rate-limited), and
that nothing else changes: the instance's real statuses keep being taken afterwards.
"""

from __future__ import annotations

import gc
import logging
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from pilotfish.cms import keys
from pilotfish.cms.reader import MAX_BACKOFF, CmsReader
from pilotfish.cms.records import (
    MAX_RECORD_BYTES,
    BadRecord,
    Bounds,
    decode_metadata,
    decode_status,
    implausible,
    is_newer,
    valid_host,
)
from pilotfish.cms.refusals import RefusalLog
from pilotfish.cms.writer import CmsWriter
from pilotfish.config import ConfigError
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.cms_view import CmsTrust
from pilotfish.scheduler.view.types import RequestInfo

WALL = 1_700_000_000.0
NOW_MS = int(WALL * 1000)
U64_MAX = 2**64 - 1


class Clocks:
    """The scheduler's wall clock and monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.wall = WALL
        self.mono = 100.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def core(clocks: Clocks | None = None, **kw: Any) -> SchedulerCore:
    clocks = clocks or Clocks()
    config = SchedulerConfig(enable_full_mode_scheduling=True, **kw)
    return SchedulerCore(config, clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall)


def meta(name: str = "a", **kw: Any) -> cms_pb2.InstanceMetadata:
    fields: dict[str, Any] = {"instance_id": name, "host": "10.0.0.1", "http_port": 8000, "model": "m"}
    fields["infer_type"] = 1
    fields.update(kw)
    return cms_pb2.InstanceMetadata(**fields)


def status(update_id: int, name: str = "a", **kw: Any) -> cms_pb2.InstanceStatus:
    fields: dict[str, Any] = {"instance_id": name, "update_id": update_id, "timestamp_ms": NOW_MS}
    fields["schedulable"] = True
    fields.update(kw)
    return cms_pb2.InstanceStatus(**fields)


def refused(c: SchedulerCore) -> dict[str, int]:
    assert c.cms is not None
    return c.cms.refused_by_reason()


def waiting(c: SchedulerCore, name: str = "a") -> int:
    s = c.instance(name).status
    assert s is not None
    return s.num_waiting


# -- statuses claiming an impossible future ------------------------------------------------------------


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        ({"update_id": U64_MAX}, "update_id_jump"),
        ({"update_id": U64_MAX, "timestamp_ms": U64_MAX}, "future_timestamp"),  # attack (a) as demonstrated
        ({"update_id": 11, "timestamp_ms": NOW_MS + 3_600_000}, "future_timestamp"),
        ({"update_id": 11, "epoch": NOW_MS + 3_600_000}, "future_epoch"),
        ({"update_id": (NOW_MS + 5_000) * 1000 + 1_000_011}, "update_id_jump"),  # past the clock and the bound
    ],
)
def test_an_implausible_status_is_refused_counted_and_changes_nothing(
    forged: dict[str, int], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = core()
    c.apply_metadata(meta())
    assert c.apply_status(status(10, num_waiting=1))
    caplog.set_level(logging.WARNING)
    fields = {"num_waiting": 99, "admitted_request_ids": ["forged"], **forged}
    assert not c.apply_status(status(**fields))  # type: ignore[arg-type]
    assert refused(c) == {reason: 1}
    assert waiting(c) == 1
    assert c.instance("a").status.update_id == 10  # type: ignore[union-attr]
    assert c.cms is not None and c.cms.num_rejected == 0  # refused, not merely "not newer"
    line = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(line) == 1 and "instance a" in line[0].getMessage() and reason in line[0].getMessage()
    # the engine's real statuses keep being taken
    assert c.apply_status(status(11, num_waiting=2))
    assert c.apply_status(status(12, num_waiting=3))
    assert waiting(c) == 3


def test_a_forged_status_does_not_touch_the_inflight_account() -> None:
    c = core()
    c.apply_metadata(meta())
    c.apply_status(status(1))
    c.schedule(RequestInfo("r1", "m", prompt_tokens=100))
    assert c.inflight_size == 1
    # a forged record "admitting" r1 would retire it from the account: refused first
    assert not c.apply_status(status(U64_MAX, admitted_request_ids=["r1"]))
    assert c.inflight_size == 1
    assert c.apply_status(status(2, admitted_request_ids=["r1"]))
    assert c.inflight_size == 0


def test_time_based_update_ids_may_jump_as_far_as_the_clock() -> None:
    """Llumlets count update_ids from the wall clock in microseconds: an idle hour is a jump of
    3.6e9, which the clock allows; one beyond the clock and the bound does not pass."""
    clocks = Clocks()
    c = core(clocks)
    c.apply_metadata(meta())
    first = (NOW_MS - 3_600_000) * 1000
    assert c.apply_status(status(first, timestamp_ms=NOW_MS - 3_600_000))
    assert c.apply_status(status(NOW_MS * 1000, num_waiting=4))
    skew_us = 5_000 * 1000
    assert not c.apply_status(status(NOW_MS * 1000 + skew_us + 1_000_001))
    assert refused(c) == {"update_id_jump": 1}
    assert waiting(c) == 4


def test_the_first_status_is_bounded_too() -> None:
    c = core()
    c.apply_metadata(meta())
    assert not c.apply_status(status(U64_MAX))
    assert not c.apply_status(status(5, timestamp_ms=NOW_MS + 60_000))
    assert c.instance("a").status is None
    assert c.apply_status(status(5, num_waiting=6))
    assert waiting(c) == 6


def test_a_status_waiting_for_metadata_is_checked_before_it_is_held() -> None:
    c = core()
    assert not c.apply_status(status(U64_MAX, num_waiting=99))  # forged, before any metadata
    c.apply_metadata(meta())
    assert c.instance("a").status is None  # nothing was held for it
    assert refused(c) == {"update_id_jump": 1}


def test_bounds_come_from_the_config() -> None:
    c = core(cms_max_clock_skew_seconds=60, cms_max_update_id_jump=5)
    c.apply_metadata(meta())
    assert c.apply_status(status(10, timestamp_ms=NOW_MS + 59_000))
    assert not c.apply_status(status(11, timestamp_ms=NOW_MS + 61_000))
    # ids above the clock (in microseconds, plus the skew) may climb by the bound, no faster
    horizon_us = (NOW_MS + 60_000) * 1000
    assert c.apply_status(status(horizon_us))
    assert c.apply_status(status(horizon_us + 5))
    assert not c.apply_status(status(horizon_us + 11))
    assert refused(c) == {"future_timestamp": 1, "update_id_jump": 1}


# -- epochs: a restarted llumlet starts its sequence over ----------------------------------------------


def test_a_new_epoch_restarts_the_sequence_and_old_epochs_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    clocks = Clocks()
    c = core(clocks)
    c.apply_metadata(meta())
    old_epoch = NOW_MS - 60_000
    assert c.apply_status(status(500, epoch=old_epoch, num_waiting=1))
    clocks.advance(1)
    caplog.set_level(logging.INFO)
    new_epoch = NOW_MS + 500
    # lower update_id, newer epoch, a timestamp that is only a second on: taken at once
    assert c.apply_status(status(1, epoch=new_epoch, timestamp_ms=NOW_MS + 1000, num_waiting=2))
    assert waiting(c) == 2
    assert "restart" in caplog.text and "instance a" in caplog.text
    # a late write of the dead incarnation does not win, however high its update_id
    assert not c.apply_status(status(501, epoch=old_epoch, timestamp_ms=NOW_MS + 1000, num_waiting=9))
    assert c.apply_status(status(2, epoch=new_epoch, timestamp_ms=NOW_MS + 1000, num_waiting=3))
    assert waiting(c) == 3
    assert refused(c) == {}


def test_a_writer_without_epochs_moving_to_one_is_a_restart() -> None:
    c = core()
    c.apply_metadata(meta())
    assert c.apply_status(status(500))
    assert c.apply_status(status(1, epoch=NOW_MS, num_waiting=5))
    assert waiting(c) == 5


def test_a_forged_epoch_within_the_skew_pins_at_most_until_the_restart_window() -> None:
    """The skew bounds what a forger can claim; the timestamp restart rule bounds how long it holds."""
    clocks = Clocks()
    c = core(clocks, instance_staleness_seconds=10)
    c.apply_metadata(meta())
    real_epoch = NOW_MS - 1000
    assert c.apply_status(status(1, epoch=real_epoch))
    assert c.apply_status(status(2, epoch=NOW_MS + 4_000, num_waiting=99))  # forged, within the 5 s skew
    assert not c.apply_status(status(3, epoch=real_epoch, num_waiting=1))
    clocks.advance(15)  # the forger stopped; real statuses go on
    later = int(clocks.wall * 1000)
    assert c.apply_status(status(4, epoch=real_epoch, timestamp_ms=later, num_waiting=2))
    assert waiting(c) == 2


def test_ordering_helpers() -> None:
    assert is_newer(status(1, epoch=2), status(9, epoch=1))
    assert not is_newer(status(9, epoch=1), status(1, epoch=2))
    assert is_newer(status(2, epoch=1), status(1, epoch=1))
    bounds = Bounds(max_clock_skew_ms=1000, max_update_id_jump=10)
    assert implausible(status(5, timestamp_ms=NOW_MS + 999), NOW_MS, bounds) == ""
    assert implausible(status(5, timestamp_ms=NOW_MS + 1001), NOW_MS, bounds) == "future_timestamp"
    # the clock, not the jump bound, limits time-based ids
    assert implausible(status(NOW_MS * 1000), NOW_MS, bounds, 0, 1) == ""
    assert implausible(status((NOW_MS + 1001) * 1000 + 20), NOW_MS, bounds, 0, 1) == "update_id_jump"


def test_the_writer_stamps_its_epoch_on_every_status() -> None:
    writer = CmsWriter("redis://127.0.0.1:1/0", "c", "a", ttl_ms=1000, epoch=1234)  # connects lazily
    try:
        # pre-encoded bytes get the field appended: protobuf merges it
        merged = decode_status(status(7).SerializeToString() + writer._epoch_field, "a")
        assert merged.epoch == 1234 and merged.update_id == 7
        # a second, older epoch already in the bytes loses to the writer's
        stale = status(7, epoch=99).SerializeToString()
        assert decode_status(stale + writer._epoch_field, "a").epoch == 1234
    finally:
        writer.close()
    assert CmsWriter("redis://127.0.0.1:1/0", "c", "a", ttl_ms=1000).epoch > NOW_MS  # the wall clock now


# -- logs are rate-limited -----------------------------------------------------------------------------


def test_refusals_log_once_per_interval_per_instance_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("t"), clock=lambda: now[0], interval=30.0)
    caplog.set_level(logging.WARNING)
    for _ in range(1000):
        refusals.note("a", "update_id_jump", "x")
    refusals.note("b", "update_id_jump", "x")
    refusals.note("a", "oversize", "x")
    assert len(caplog.records) == 3
    now[0] = 31.0
    refusals.note("a", "update_id_jump", "x")
    assert len(caplog.records) == 4 and "999 more" in caplog.records[-1].getMessage()
    assert refusals.counts == {"update_id_jump": 1002, "oversize": 1}


def test_a_stream_of_forged_statuses_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    c = core()
    c.apply_metadata(meta())
    caplog.set_level(logging.WARNING)
    for k in range(500):
        c.apply_status(status(U64_MAX - k))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert refused(c) == {"update_id_jump": 500}


# -- metrics ---------------------------------------------------------------------------------------------


def test_refusals_and_honest_staleness_show_in_metrics() -> None:
    from prometheus_client import generate_latest

    clocks = Clocks()
    c = core(clocks)
    c.apply_metadata(meta())
    c.apply_status(status(1, timestamp_ms=NOW_MS + 2_000))  # a writer's clock 2 s ahead, within the skew
    c.apply_status(status(U64_MAX, timestamp_ms=U64_MAX))
    text = generate_latest(c.registry).decode()
    assert 'pilotfish_scheduler_cms_records_refused_total{reason="future_timestamp"} 1.0' in text
    clocks.advance(30)  # no status for 30 s (the reader is cut off, say): the age says so
    sample = next(
        line
        for line in generate_latest(c.registry).decode().splitlines()
        if line.startswith('pilotfish_scheduler_view_staleness_seconds{engine="a"}')
    )
    assert float(sample.split()[-1]) == pytest.approx(30.0)


# -- metadata: bounded, a real address, a served model, and (when it follows) discovery ----------------


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"host": "evil host"}, "usable address"),
        ({"host": "http://10.0.0.1"}, "usable address"),
        ({"host": "a..b"}, "usable address"),
        ({"host": "h" * 300}, "usable address"),
        ({"http_port": 70000}, "usable address"),
        ({"llumlet_port": 70000}, "llumlet_port"),
        ({"model": "m" * 300}, "model"),
        ({"node_id": "n\n1"}, "node_id"),
        ({"kv_events_endpoint": "tcp://" + "x" * 600}, "kv_events_endpoint"),
        ({"infer_type": 9}, "infer_type"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank"),
    ],
)
def test_bad_metadata_is_refused(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRecord, match=fragment):
        decode_metadata(meta(**fields).SerializeToString(), "a")


@pytest.mark.parametrize(
    "host", ["10.0.0.1", "fe80::1", "[fe80::1]", "fe80::1%eth0", "engine-0.pool.svc.cluster.local", "localhost", "a."]
)
def test_real_hosts_pass(host: str) -> None:
    assert valid_host(host)
    assert decode_metadata(meta(host=host).SerializeToString(), "a").host == host


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1\n",  # a final newline: `$` matches before it, and the address breaks Envoy's headers
        "a\n",
        "1\n.2",
        "engine-0.pool\n",
        "[fe80::1]\n",
        "fe80::1%a\nb",  # ipaddress takes any scope
        "fe80::1%a b",
        "\u0661\u0662\u0667.0.0.1",  # digits, but not ASCII ones
        "b\u00fccher.example",
    ],
)
def test_a_host_with_anything_but_ascii_letters_and_marks_is_refused(host: str) -> None:
    assert not valid_host(host)
    with pytest.raises(BadRecord, match="usable address") as refused:
        decode_metadata(meta(host=host).SerializeToString(), "a")
    assert refused.value.reason == "invalid_field"


@pytest.mark.parametrize("value", ["e0\n", "e0\r", "e\n0", "\ne0"])
def test_an_id_with_a_newline_anywhere_is_refused(value: str) -> None:
    with pytest.raises(keys.BadId):
        keys.check_id(value, "instance id")


def test_metadata_for_a_model_not_served_is_refused() -> None:
    c = core(model=["m"])
    assert not c.apply_metadata(meta("evil", model="other"))
    assert not c.apply_metadata(meta("empty", model=""))
    assert c.instances() == []
    assert refused(c) == {"unserved_model": 2}
    assert c.apply_metadata(meta("a"))


def test_admission_follows_discovery_when_configured() -> None:
    c = core(discovery="redis://127.0.0.1:1/0")  # a backend named: auto follows discovery
    assert c.cms is not None and c.cms.follows_discovery
    # attack (b): metadata + status for a new instance at an address discovery never listed
    assert not c.apply_metadata(meta("evil", host="127.0.0.1", http_port=9999))
    assert not c.apply_status(status(1, name="evil"))
    assert c.instances() == []
    assert refused(c) == {"not_discovered": 1}
    # a real engine: its metadata may come before or after discovery lists it
    assert not c.apply_metadata(meta("a", host="10.0.0.1", http_port=8000))
    c.apply_status(status(1, num_waiting=3))
    c.cms.discovered("10.0.0.1:8000", "10.0.0.1:8000")
    assert [i.instance_id for i in c.instances()] == ["a"] and waiting(c) == 3
    assert c.schedule(RequestInfo("r", "m")).target.instance_id == "a"
    # discovery drops it: it leaves scheduling, and comes back when listed again
    c.cms.undiscovered("10.0.0.1:8000")
    assert c.instances() == []
    c.cms.discovered("10.0.0.1:8000", "10.0.0.1:8000")
    assert [i.instance_id for i in c.instances()] == ["a"]
    # still not the forged one
    assert "evil" not in {i.instance_id for i in c.instances()}


@pytest.mark.parametrize(
    ("kw", "follows"),
    [
        ({}, False),  # pilotfish up --full: no discovery, the CMS is the discovery
        ({"discovery": "etcd://127.0.0.1:2379"}, True),
        ({"discovery": "etcd://127.0.0.1:2379", "cms_instance_admission": "cms"}, False),
        ({"cms_instance_admission": "cms"}, False),
    ],
)
def test_admission_modes(kw: dict[str, Any], follows: bool) -> None:
    config = SchedulerConfig(enable_full_mode_scheduling=True, **kw)
    assert CmsTrust.from_config(config).follow_discovery is follows


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"cms_instance_admission": "discovery"}, "needs --discovery"),
        ({"cms_instance_admission": "maybe"}, "not one of"),
    ],
)
def test_admission_misconfigured_fails_at_start(kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=f"--cms-instance-admission: .*{fragment}"):
        core(**kw)


# -- the reader: oversized records are refused unread and never kept -----------------------------------


class _Sink:
    def __init__(self) -> None:
        self.statuses: list[cms_pb2.InstanceStatus] = []
        self.refused: list[tuple[str, str]] = []

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        return True

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        self.statuses.append(status)
        return True

    def status_gone(self, instance_id: str) -> None:
        pass

    def remove(self, instance_id: str) -> bool:
        return True

    def known(self) -> set[str]:
        return set()

    def record_refused(self, instance_id: str, reason: str) -> None:
        self.refused.append((instance_id, reason))


class _Redis:
    """What the reader asks of Redis when a value reached the size bound: its length."""

    def __init__(self, size: int) -> None:
        self.size = size

    async def strlen(self, key: str) -> int:
        return self.size


async def test_an_oversized_record_is_refused_and_only_its_summary_kept() -> None:
    sink = _Sink()
    reader = CmsReader("redis://127.0.0.1:1/0", "c", sink)
    real_size = 10 * 1024 * 1024
    reader._client = _Redis(real_size)
    key = keys.status_key("c", "a")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # GETRANGE 0..MAX_RECORD_BYTES hands over at most one byte past the bound
        raw = b"\x0a" + b"\x80" * MAX_RECORD_BYTES
        assert not await reader._apply(key, keys.STATUS, raw)
        del raw
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 16 * 1024, f"{kept} bytes kept after refusing a {MAX_RECORD_BYTES}-byte read"
    summary = reader.rejected()[key]
    assert (summary.instance_id, summary.reason, summary.size) == ("a", "oversize", real_size)
    assert len(summary.digest) == 16
    assert reader.num_bad_records == 1 and sink.refused == [("a", "oversize")]
    assert sink.statuses == []
    # the same value polled again is skipped, not counted twice
    assert not await reader._apply(key, keys.STATUS, b"\x0a" + b"\x80" * MAX_RECORD_BYTES)
    assert reader.num_bad_records == 1
    # and the next real status is taken
    assert await reader._apply(key, keys.STATUS, status(3).SerializeToString())
    assert [s.update_id for s in sink.statuses] == [3] and key not in reader.rejected()


async def test_a_record_handed_over_is_not_kept_whole_by_the_reader() -> None:
    """The sink decides (and may refuse, as the view refuses a forged status); the reader keeps a
    digest to skip the same value next poll, never the bytes."""

    class Refusing(_Sink):
        def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
            return False

    reader = CmsReader("redis://127.0.0.1:1/0", "c", Refusing())
    key = keys.status_key("c", "a")
    big = status(U64_MAX, timestamp_ms=U64_MAX, admitted_request_ids=[f"{k:048d}" for k in range(4000)])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        raw = big.SerializeToString()
        assert len(raw) > 190_000
        assert await reader._apply(key, keys.STATUS, raw)
        assert await reader._apply(key, keys.STATUS, raw)  # the same value again: skipped
        del raw
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 16 * 1024, f"{kept} bytes kept after handing over a record"


async def test_a_bad_record_is_summarised_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    sink = _Sink()
    reader = CmsReader("redis://127.0.0.1:1/0", "c", sink)
    key = keys.status_key("c", "a")
    caplog.set_level(logging.WARNING)
    garbage = b"\xff\xfe" + b"junk" * 1000
    assert not await reader._apply(key, keys.STATUS, garbage)
    summary = reader.rejected()[key]
    assert (summary.reason, summary.size) == ("malformed", len(garbage))
    assert summary.digest != garbage and len(summary.digest) == 16  # the summary holds no record bytes
    assert "rejected CMS record" in caplog.text and "instance a" in caplog.text


def test_reconnect_backoff_is_capped_near_a_second() -> None:
    assert MAX_BACKOFF <= 1.0


async def test_a_redis_that_drops_each_connection_at_once_is_retried_with_a_growing_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscription that connects (Redis answered) and fails at once, over and over: the backoff went back to
    50 ms on each answer, so the reader reconnected and logged twenty times a second. It grows to its cap, one
    warning says so, and a connection that then stays up for STABLE_AFTER starts the next outage afresh."""
    from pilotfish.cms import reader as reader_module

    now = [0.0]
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        now[0] += seconds

    reader = CmsReader("redis://127.0.0.1:1/0", "c", _Sink(), clock=lambda: now[0])
    reader._sleep = sleep  # this reader's waits only: asyncio.sleep patched would spin any other task
    runs = iter(range(30))

    async def flapping(recovered: Callable[[], None]) -> None:
        if next(runs) == 29:
            return
        recovered()  # subscribed: Redis answered
        if len(delays) == 20:
            now[0] += reader_module.STABLE_AFTER + 1  # this time the connection stays up a while
        raise ConnectionError("connection reset by peer")

    caplog.set_level(logging.INFO)
    await reader._retrying(flapping, "notice subscription")
    assert max(delays[:20]) <= reader_module.MAX_BACKOFF
    assert min(delays[10:20]) >= reader_module.MAX_BACKOFF / 2  # at its cap, not back at 50 ms
    assert delays[20] <= 2 * reader_module.FIRST_BACKOFF  # a new outage starts afresh
    assert caplog.text.count("retrying with backoff") == 2 and caplog.text.count("answers again") == 2  # an outage each
