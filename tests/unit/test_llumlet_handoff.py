"""The shared-memory hand-off between the engine and the export process, and the export loop with a fake CMS writer."""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core import export_process, export_supervisor, handoff
from pilotfish.vllm_plugin.core.export_process import STOP_KEEP, STOP_REMOVE, Exporter, exporter_cpus
from pilotfish.vllm_plugin.core.handoff import HandoffReader, HandoffWriter, create_region, map_region
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, LoadState, counter_values
from tests.integration.test_llumlet_cms import wait_for


@pytest.fixture
def region():
    fd, region = create_region()
    yield fd, region
    os.close(fd)


def test_a_published_state_reads_back_whole(region):
    fd, mapped = region
    state = LoadState("e0")
    state.added("a", 100)
    state.added("b", 30, exported_id="b-ext")
    state.scheduled("a", 0, num_cached_tokens=64)
    state.step_finished(0.004, 36, 0, 36)
    state.kv_usage(10, 100, 16)
    writer, reader = HandoffWriter(mapped), HandoffReader(map_region(fd))
    assert reader.poll() is None  # nothing published yet
    writer.publish(state, dirty_since_ns=123)
    record = reader.poll()
    assert record is not None
    assert record.counters == _figures(state)
    assert record.counters["uncomputed_prefill_tokens"] == 36 + 30 and record.dirty_since_ns == 123
    assert record.update_id == state.update_id
    assert reader.ids_until(record.ring_end) == ["a", "b-ext"]
    assert reader.poll() is None  # read once
    state.finished("b")
    writer.publish(state, 0)
    record = reader.poll()
    assert record is not None and record.counters["num_waiting"] == 0
    assert reader.ids_until(record.ring_end) == []


def test_ids_cross_the_ring_end_intact(region, monkeypatch):
    _, mapped = region
    monkeypatch.setattr(handoff, "RING_SIZE", 100)
    state = LoadState("e0", max_admitted_ids=4096)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    seen: list[str] = []
    for i in range(40):  # entries of 6 + 11 bytes: the ring wraps every five or six
        state.added(f"request-{i:03d}", 1)
        writer.publish(state, 0)
        record = reader.poll()
        assert record is not None
        seen += reader.ids_until(record.ring_end)
    assert seen == [f"request-{i:03d}" for i in range(40)]
    assert reader.lost_ids == 0


def test_a_reader_that_fell_a_ring_behind_skips_and_counts(region, monkeypatch):
    _, mapped = region
    monkeypatch.setattr(handoff, "RING_SIZE", 100)
    state = LoadState("e0", max_admitted_ids=4096)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    for i in range(20):
        state.added(f"request-{i:03d}", 1)
        writer.publish(state, 0)
    record = reader.poll()
    assert record is not None
    assert reader.ids_until(record.ring_end) == [] and reader.lost_ids == 1
    state.added("next", 1)
    writer.publish(state, 0)
    record = reader.poll()
    assert record is not None and reader.ids_until(record.ring_end) == ["next"]


def test_a_torn_record_is_not_taken(region):
    _, mapped = region
    state = LoadState("e0")
    state.added("a", 5)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    writer.publish(state, 0)
    # a copy caught mid-write: the body's bytes changed under the checksum
    mapped[handoff.RECORD_AT + 40] ^= 0xFF
    assert reader.poll() is None
    mapped[handoff.RECORD_AT + 40] ^= 0xFF
    record = reader.poll()
    assert record is not None and record.counters["num_waiting"] == 1


def test_an_id_too_long_is_not_handed_over(region):
    _, mapped = region
    state = LoadState("e0")
    state.added("x" * (handoff.MAX_ID_BYTES + 1), 1)
    state.added("ok", 1)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    writer.publish(state, 0)
    record = reader.poll()
    assert record is not None and reader.ids_until(record.ring_end) == ["ok"]
    assert writer.dropped_ids == 1


def test_publish_asks_for_one_wake_up_per_nap(region):
    _, mapped = region
    state = LoadState("e0")
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    assert writer.publish(state, 0) == 0  # the exporter polls: nothing to wake
    reader.set_napping(7)
    assert writer.publish(state, 0) == 7
    assert writer.publish(state, 0) == 0  # woken once for this nap already
    reader.set_napping(8)
    assert writer.publish(state, 0) == 8


def test_a_region_of_something_else_is_refused():
    fd = os.memfd_create("not-ours")
    os.ftruncate(fd, handoff.RING_AT + handoff.RING_SIZE)
    with pytest.raises(ValueError, match="not a llumlet hand-off region"):
        map_region(fd)
    os.close(fd)


def test_exporter_cpus():
    assert exporter_cpus("inherit") is None
    assert exporter_cpus("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError):
        exporter_cpus("a-b")
    everything = set(range(os.cpu_count() or 1))
    if os.sched_getaffinity(0) == everything:
        assert exporter_cpus("auto") is None  # not pinned: shares every CPU


class FakeWriter:
    """Records what the exporter writes; `fail` makes the next writes raise."""

    def __init__(self) -> None:
        self.statuses: list[cms_pb2.InstanceStatus] = []
        self.metadata: list[cms_pb2.InstanceMetadata] = []
        self.removed = self.closed = False
        self.fail = 0

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        self._maybe_fail()
        self.statuses.append(status)

    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None:
        self._maybe_fail()
        self.metadata.append(cms_pb2.InstanceMetadata.FromString(meta.SerializeToString()))

    def _maybe_fail(self) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("redis away")

    def remove(self) -> None:
        self.removed = True

    def close(self) -> None:
        self.closed = True


class Running:
    """An Exporter on a thread of this process, fed by a HandoffWriter, told things through a pipe."""

    def __init__(self, **config: object) -> None:
        fd, region = create_region()
        self.state = LoadState("e0", admitted_window_ms=60_000)
        self.handoff = HandoffWriter(region)
        read_end, self.pipe = os.pipe()
        self.fake = FakeWriter()
        cfg = LlumletConfig(cms_url="redis://unused", refresh_ms=60_000, ttl_ms=120_000, **config)  # type: ignore[arg-type]
        meta = cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=1)
        self.exporter = Exporter(cfg, "e0", meta, map_region(fd), read_end, os.getppid(), writer=self.fake)  # type: ignore[arg-type]
        self.handoff.publish(self.state, 0)
        self.thread = threading.Thread(target=self.exporter.run, daemon=True)
        self.thread.start()
        self._fds = (fd, read_end)

    def publish(self) -> None:
        if self.handoff.publish(self.state, time.monotonic_ns()):
            os.write(self.pipe, b"w")

    def last(self) -> cms_pb2.InstanceStatus | None:
        return self.fake.statuses[-1] if self.fake.statuses else None

    def close(self, message: bytes | None = STOP_REMOVE) -> None:
        if message is not None:
            os.write(self.pipe, message)
        else:
            os.close(self.pipe)
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the exporter did not stop"
        for fd in self._fds:
            os.close(fd)
        if message is not None:
            os.close(self.pipe)


def test_exporter_writes_metadata_first_then_every_change():
    run = Running()
    try:
        wait_for(lambda: run.fake.statuses, what="first status")
        assert run.fake.metadata, "metadata before status"
        run.state.added("r1", 40)
        run.publish()
        got = wait_for(lambda: (s := run.last()) and s.num_waiting == 1 and s, what="the change")
        assert list(got.admitted_request_ids) == ["r1"] and got.uncomputed_prefill_tokens == 40
        ids = [s.update_id for s in run.fake.statuses]
        assert ids == sorted(set(ids)), "update ids rise with every write"
    finally:
        run.close()
    assert run.fake.removed and run.fake.closed


def test_a_napping_exporter_is_woken_by_the_engine(monkeypatch):
    # naps last as long as the refresh (a minute): only the engine's byte on the pipe can wake it
    monkeypatch.setattr(export_process, "_NAP_MAX_S", 60.0)
    run = Running()
    try:
        wait_for(lambda: run.fake.statuses, what="first status")
        wait_for(lambda: handoff._CONTROL.unpack_from(run.handoff._region, 0)[2], what="the exporter napping")
        run.state.added("late", 5)
        run.publish()
        wait_for(lambda: (s := run.last()) and s.num_waiting == 1, what="the change after the nap")
    finally:
        run.close()


def test_failed_writes_are_retried_with_the_latest_state():
    run = Running()
    try:
        wait_for(lambda: run.fake.statuses, what="first status")
        run.fake.fail = 3
        for i in range(5):
            run.state.added(f"r{i}", 10)
            run.publish()
        got = wait_for(lambda: (s := run.last()) and s.num_waiting == 5 and s, what="the latest state after failures")
        assert list(got.admitted_request_ids) == [f"r{i}" for i in range(5)]
        assert run.exporter.write_failures == 3
        assert len(run.fake.metadata) >= 2, "metadata re-sent after a failure (the keys may have expired)"
    finally:
        run.close()


def test_stop_keeping_the_keys_writes_the_last_state_first():
    run = Running()
    wait_for(lambda: run.fake.statuses, what="first status")
    run.state.added("r1", 1)
    run.handoff.publish(run.state, 0)  # no time to poll it: the stop must carry it
    run.close(STOP_KEEP)
    assert not run.fake.removed and run.fake.closed
    last = run.last()
    assert last is not None and last.num_waiting == 1


def test_the_engine_closing_the_pipe_removes_the_keys():
    run = Running()
    wait_for(lambda: run.fake.statuses, what="first status")
    run.close(None)  # what the kernel does when the engine dies
    assert run.fake.removed


def test_a_minimum_interval_coalesces_changes_into_fewer_writes():
    run = Running(min_export_interval_us=1_000_000)
    try:
        wait_for(lambda: run.fake.statuses, what="first status")
        before = len(run.fake.statuses)
        for i in range(20):  # one change every 20 ms, each seen on its own without the interval
            run.state.added(f"r{i}", 1)
            run.publish()
            time.sleep(0.02)  # pacing the changes, not waiting for one
        got = wait_for(lambda: (s := run.last()) and s.num_waiting == 20 and s, what="the latest state")
        # 0.4 s of changes at most one write a second apart: 1 or 2 writes, where each change alone made 20
        assert len(run.fake.statuses) - before <= 3
        assert list(got.admitted_request_ids) == [f"r{i}" for i in range(20)]
    finally:
        run.close()


def test_stop_keeping_the_keys_writes_a_state_held_back_by_the_interval():
    run = Running(min_export_interval_us=60_000_000)
    wait_for(lambda: run.fake.statuses, what="first status")
    run.state.added("held", 1)
    run.publish()
    wait_for(lambda: (r := run.exporter.record) and r.counters["num_waiting"] == 1, what="it read the change")
    run.close(STOP_KEEP)
    last = run.last()
    assert last is not None and last.num_waiting == 1


def test_zeroed_or_stale_ring_bytes_are_not_ids(region):
    _, mapped = region
    reader = HandoffReader(mapped)
    # a fresh ring is zeros: length 0 with checksum 0 must not read as empty ids
    assert reader.ids_until(18) == [] and reader.ids_until(18) == []
    assert reader.ids_until(18) == [] and reader.lost_ids == 1  # the third look gives up, counted once
    # an intact entry written at another position does not pass here
    raw = b"old-id"
    entry = handoff._ENTRY.pack(len(raw), zlib.adler32(raw, 12345)) + raw
    mapped[handoff.RING_AT + 18 : handoff.RING_AT + 18 + len(entry)] = entry
    assert HandoffReader(mapped).ids_until(len(entry)) == []


def _decoding(n: int, prompt: int = 40) -> LoadState:
    state = LoadState("e0")
    for i in range(n):
        state.added(f"r{i}", prompt)
        state.scheduled(f"r{i}", prompt)
        state.progressed(f"r{i}", prompt, 1)
    state.kv_usage(12, 100, 16)
    state.step_finished(0.02, n * prompt, 0, n * prompt)
    return state


def _published(mapped, n: int) -> tuple[LoadState, HandoffWriter, HandoffReader]:
    """n decoding requests, stored as a full record that the reader has taken."""
    state = _decoding(n)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped, block_size=16)
    writer.publish(state, 0)
    assert reader.poll() is not None
    return state, writer, reader


def _figures(state: LoadState) -> dict[str, int]:
    return dict(zip(COUNTER_FIELDS, (int(v) for v in counter_values(state)), strict=True))


def test_every_counter_reads_back_in_its_own_place(region):
    """The record's fields are named one by one where it is packed: each goes where COUNTER_FIELDS says."""
    _, mapped = region
    state = LoadState("e0")
    for i, name in enumerate(COUNTER_FIELDS):
        setattr(state, name, 1000 + i)
    state.decode_steps = 77
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped)
    writer.publish(state, 5)
    record = reader.poll()
    assert record is not None and record.decode_steps == 77
    assert record.counters == {name: 1000 + i for i, name in enumerate(COUNTER_FIELDS)}


def test_steady_steps_stored_as_ticks_read_back_as_the_full_state(region):
    _, mapped = region
    state, writer, reader = _published(mapped, 3)
    for k in range(1, 6):
        state.decode_step(6_000 + k, (12 + k) * 16)
        end = time.monotonic_ns()
        assert writer.tick(state.decode_steps, 6_000 + k, 12 + k, end) == 0
        assert reader.changed()
        record = reader.poll()
        assert record is not None, f"tick {k}"
        assert record.counters == _figures(state)
        assert abs(record.dirty_since_ns - end) < 2_000  # the step's end, to the microsecond
        assert reader.poll() is None and not reader.changed()  # read once
    # a full record after the ticks is the state again, and the last tick lies behind it
    state.finished("r0")
    writer.publish(state, 0)
    record = reader.poll()
    assert record is not None and record.counters["num_running"] == 2
    assert record.counters == _figures(state)


def test_a_tick_the_record_already_holds_counts_once(region):
    """Another thread stored a full record between the engine's step and its tick: the record
    holds the step already, and the tick, naming the same count, adds nothing."""
    _, mapped = region
    state = _decoding(2)
    writer, reader = HandoffWriter(mapped), HandoffReader(mapped, block_size=16)
    state.decode_step(5_000, 13 * 16)
    writer.publish(state, 0)  # (from another thread, under the lock)
    writer.tick(state.decode_steps, 5_000, 13, time.monotonic_ns())
    record = reader.poll()
    assert record is not None
    assert record.counters == _figures(state)


def test_a_tick_whose_words_disagree_is_not_taken(region):
    _, mapped = region
    state, writer, reader = _published(mapped, 2)
    state.decode_step(5_000, 13 * 16)
    writer.tick(state.decode_steps, 5_000, 13, time.monotonic_ns())
    second = handoff.TICK_AT + 8
    mapped[second + 7] ^= 0x01  # the second word's tag, as a copy caught between the two stores sees it
    assert reader.poll() is None
    mapped[second + 7] ^= 0x01
    record = reader.poll()
    assert record is not None and record.counters["step_id"] == state.step_id


def test_a_tick_past_the_span_is_not_read_as_new(region):
    _, mapped = region
    state, writer, reader = _published(mapped, 1)
    writer.tick(state.decode_steps - 1 + 2**16, 5_000, 13, time.monotonic_ns())  # "one behind", mod 2**16
    record = reader.poll()
    assert record is not None and record.counters["step_id"] == state.step_id  # the record as it is


class _Exporter:
    """What Llumlet reads of an ExportProcess: its hand-off, and a wake-up it counts."""

    def __init__(self, region: object) -> None:
        self.handoff = HandoffWriter(region)  # type: ignore[arg-type]
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def _llumlet_with(region: object, **config: object) -> tuple[Llumlet, _Exporter]:
    cfg = LlumletConfig(cms_url="redis://unused", **config)  # type: ignore[arg-type]
    llumlet = Llumlet(cfg, "e0", cms_pb2.InstanceMetadata(block_size=16), writer=FakeWriter(), own_process=True)  # type: ignore[arg-type]
    exporter = _Exporter(region)
    llumlet.exporter.adopt(exporter)  # type: ignore[attr-defined]
    return llumlet, exporter


def test_llumlet_decode_step_goes_as_a_tick_only_when_nothing_else_waits(region):
    _, mapped = region
    llumlet, exporter = _llumlet_with(mapped)
    reader = HandoffReader(mapped, block_size=16)
    with llumlet.events() as s:
        s.kv_usage(10, 100, 16)
        for i in range(2):
            s.added(f"r{i}", 40)
            s.scheduled(f"r{i}", 40)
            s.progressed(f"r{i}", 40, 1)
    seq = exporter.handoff._seq
    llumlet.decode_step(5_000, 13, 13 * 16, time.monotonic_ns())
    assert exporter.handoff._seq == seq  # a tick, no full record
    record = reader.poll()
    assert record is not None and record.counters["step_id"] == 1 and record.counters["used_kv_tokens"] == 208
    # an event held back for the next block (vLLM's admissions): the step goes as a full record with it
    with llumlet.events(write=False) as s:
        s.added("late", 10)
    llumlet.decode_step(5_000, 13, 13 * 16, time.monotonic_ns())
    assert exporter.handoff._seq == seq + 1
    record = reader.poll()
    assert record is not None and (record.counters["num_waiting"], record.counters["step_id"]) == (1, 2)
    assert not llumlet.state.changed


def test_llumlet_decode_step_stores_a_full_record_every_tick_span(region, monkeypatch):
    _, mapped = region
    monkeypatch.setattr(export_supervisor, "TICK_SPAN", 4)
    llumlet, exporter = _llumlet_with(mapped)
    reader = HandoffReader(mapped, block_size=16)
    with llumlet.events() as s:
        s.added("r", 40)
        s.scheduled("r", 40)
        s.progressed("r", 40, 1)
    records = []
    for _ in range(9):
        seq = exporter.handoff._seq
        llumlet.decode_step(5_000, 3, 48, time.monotonic_ns())
        records.append(exporter.handoff._seq != seq)
        record = reader.poll()
        assert record is not None and record.counters["step_id"] == llumlet.state.step_id
    assert records == [False, False, False, True] * 2 + [False]  # a full record every TICK_SPAN steps


def test_llumlet_decode_step_goes_whole_while_profiling_or_beyond_a_ticks_range(region):
    _, mapped = region
    llumlet, exporter = _llumlet_with(mapped, stats_log_s=5)
    seq = exporter.handoff._seq
    llumlet.decode_step(5_000, 3, 48, time.monotonic_ns())
    assert exporter.handoff._seq == seq + 1  # profiling: the CPU figures ride in full records
    llumlet, exporter = _llumlet_with(mapped)
    for duration_us, blocks in ((handoff.TICK_MAX_US, 3), (5_000, handoff.TICK_MAX_BLOCKS)):
        seq = exporter.handoff._seq
        llumlet.decode_step(duration_us, blocks, blocks * 16, time.monotonic_ns())
        assert exporter.handoff._seq == seq + 1
        record = HandoffReader(mapped, block_size=16).poll()
        assert record is not None and record.counters["last_step_duration_us"] == duration_us



def test_the_exporter_counts_admissions_and_a_stretch_it_lost_as_more_than_a_status_lists(monkeypatch):
    """admitted_total lets the scheduler tell statuses it missed from a pause: ids read count one each, and ids
    the exporter could not read (the engine overran the ring while it slept) more than any status can list."""
    monkeypatch.setattr(handoff, "RING_SIZE", 100)
    fd, region = create_region()
    read_end, write_end = os.pipe()
    fake = FakeWriter()
    cfg = LlumletConfig(cms_url="redis://unused")
    meta = cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=1)
    exporter = Exporter(cfg, "e0", meta, map_region(fd), read_end, os.getppid(), writer=fake)  # type: ignore[arg-type]
    state, writer = LoadState("e0", admitted_window_ms=60_000), HandoffWriter(region)
    try:

        def export() -> cms_pb2.InstanceStatus:
            record = exporter.reader.poll()
            assert record is not None
            exporter._take(record)
            exporter._write_status()
            return fake.statuses[-1]

        state.added("r1", 1)
        writer.publish(state, 0)
        one = export()
        assert one.HasField("admitted_total") and one.admitted_total == 1
        for i in range(20):  # published while the exporter slept: the ring wraps past what it read
            state.added(f"request-{i:03d}", 1)
            writer.publish(state, 0)
        state.added("last", 1)
        writer.publish(state, 0)
        after = export()
        assert exporter.reader.lost_ids == 1
        assert after.admitted_total - one.admitted_total > len(after.admitted_request_ids)
    finally:
        for f in (fd, read_end, write_end):
            os.close(f)
