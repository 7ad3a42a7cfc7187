"""The llumlet's figures for vLLM's /metrics: the snapshot channel (writer, reader, bad files) and
the pilotfish_llumlet_* families set from it; both exporters that write it."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import deque
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig, config_from_env
from pilotfish.vllm_plugin.core.export_process import STOP_REMOVE, Exporter
from pilotfish.vllm_plugin.core.handoff import HandoffWriter, create_region, map_region
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.metrics_snapshot import (
    MAX_SNAPSHOT_BYTES,
    STALENESS_WINDOW,
    SnapshotError,
    SnapshotWriter,
    percentiles,
    read_snapshot,
    snapshot_dir,
    snapshot_path,
)
from pilotfish.vllm_plugin.core.snapshot_metrics import STALE_AFTER_INTERVALS, SnapshotMetrics
from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, LoadState

INTERVAL_MS = 1000


def config(tmp_path: Path, **kw: object) -> LlumletConfig:
    kw.setdefault("metrics_interval_ms", INTERVAL_MS)
    return LlumletConfig(cms_url="redis://unused", metrics_dir=str(tmp_path), **kw)  # type: ignore[arg-type]


def counters(**figures: int) -> dict[str, int]:
    values = dict.fromkeys(COUNTER_FIELDS, 0)
    values.update(figures)
    return values


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


# ---- the channel --------------------------------------------------------------------------------


def test_a_written_snapshot_reads_back_whole(tmp_path):
    writer = SnapshotWriter(config(tmp_path), "host-8000", "process")
    figures = counters(step_id=7, num_waiting=2, num_running_decode=3, used_kv_tokens=48, total_kv_tokens=160)
    writer.write(figures, status_writes=5, write_failures=1, staleness_us=deque([100.0, 300.0, 200.0]))
    got = read_snapshot(writer.path)
    assert writer.path == tmp_path / "host-8000.json"
    assert (got.instance_id, got.exporter, got.status_writes, got.write_failures) == ("host-8000", "process", 5, 1)
    assert (got.load.step_id, got.load.num_waiting, got.load.num_running_decode) == (7, 2, 3)
    assert (got.load.used_kv_tokens, got.load.total_kv_tokens) == (48, 160)
    assert (got.staleness_p50_us, got.staleness_p99_us) == (200.0, 300.0)
    assert abs(got.timestamp_ms / 1000 - time.time()) < 60
    # the rename leaves no temporary file; the directory is the user's alone
    assert [p.name for p in tmp_path.iterdir()] == ["host-8000.json"]


def test_update_ids_rise_with_every_write_and_across_writers(tmp_path):
    cfg = config(tmp_path)
    first = SnapshotWriter(cfg, "e", "thread")
    ids = []
    for _ in range(3):
        first.write(counters(), 0, 0, [])
        ids.append(read_snapshot(first.path).update_id)
    second = SnapshotWriter(cfg, "e", "thread")  # a restarted export process
    second.write(counters(), 0, 0, [])
    ids.append(read_snapshot(second.path).update_id)
    assert ids == sorted(set(ids))


def test_the_writer_creates_a_private_directory_and_a_safe_file_name(tmp_path):
    cfg = config(tmp_path / "runtime")
    writer = SnapshotWriter(cfg, "a/b:c", "process")
    writer.write(counters(), 0, 0, [])
    assert writer.path.parent == tmp_path / "runtime" and writer.path.name == "a%2Fb%3Ac.json"
    assert stat.S_IMODE(writer.path.parent.stat().st_mode) == 0o700
    assert read_snapshot(snapshot_path(cfg, "a/b:c")).instance_id == "a/b:c"


def test_the_default_directory_is_per_user_under_the_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert snapshot_dir(LlumletConfig()) == tmp_path / f"pilotfish-llumlet-{os.getuid()}"


def test_a_write_that_fails_is_counted_never_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = SnapshotWriter(config(blocker), "e", "process")
    writer.write(counters(), 0, 0, [])
    writer.write(counters(), 0, 0, [])
    assert (writer.writes, writer.failures) == (0, 2)


def test_the_interval_spaces_the_writes(tmp_path):
    writer = SnapshotWriter(config(tmp_path), "e", "process")
    assert writer.due(time.monotonic())
    writer.write(counters(), 0, 0, [])
    now = time.monotonic()
    assert not writer.due(now) and writer.due(now + INTERVAL_MS / 1000)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "missing"),
        (b"", "corrupt"),
        (b"\x00\xff garbage", "corrupt"),
        (b'{"version": 1, "instance_id": "e"}', "corrupt"),  # fields missing
        (b'{"version": 2, "anything": "new"}', "version"),
        (b'{"version": 1' + b" " * MAX_SNAPSHOT_BYTES + b"}", "oversize"),
    ],
)
def test_a_bad_snapshot_is_an_error_naming_the_reason(tmp_path, content, reason):
    path = tmp_path / "e.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SnapshotError) as err:
        read_snapshot(path)
    assert err.value.reason == reason


def test_an_unknown_field_is_refused(tmp_path):
    writer = SnapshotWriter(config(tmp_path), "e", "process")
    writer.write(counters(), 0, 0, [])
    raw = msgspec.json.decode(writer.path.read_bytes())
    raw["extra"] = 1
    writer.path.write_bytes(msgspec.json.encode(raw))
    with pytest.raises(SnapshotError, match="corrupt"):
        read_snapshot(writer.path)


def test_the_largest_snapshot_fits_the_bound(tmp_path):
    big = 2**63 - 1
    writer = SnapshotWriter(config(tmp_path), "x" * 200, "process")  # the longest instance id
    writer.write(dict.fromkeys(COUNTER_FIELDS, big), big, big, [1e300])
    assert writer.writes == 1 and writer.path.stat().st_size <= MAX_SNAPSHOT_BYTES


def test_percentiles_follow_the_latest_writes():
    assert percentiles([]) == (0.0, 0.0)
    old = [1_000_000.0] * 5000
    recent = [float(i) for i in range(1, STALENESS_WINDOW + 1)]
    p50, p99 = percentiles(deque(old + recent))
    assert p50 == STALENESS_WINDOW // 2 + 1 and p99 < STALENESS_WINDOW


def test_metrics_settings_come_from_the_environment():
    cfg = config_from_env({"PILOTFISH_VLLM_METRICS": "false", "PILOTFISH_METRICS_INTERVAL_MS": "250"})
    assert (cfg.vllm_metrics, cfg.metrics_interval_ms) == (False, 250)
    assert LlumletConfig().vllm_metrics is True


# ---- the families -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.wall = time.time()
        self.mono = 100.0


class Reading:
    """A SnapshotMetrics over one engine's snapshot, in a registry of its own."""

    def __init__(self, tmp_path: Path, refresh_on_scrape: bool = False) -> None:
        self.cfg = config(tmp_path)
        self.registry = CollectorRegistry(auto_describe=True)  # as prometheus_client's REGISTRY, vLLM's
        self.clock = Clock()
        self.path = snapshot_path(self.cfg, "e0")
        self.metrics = SnapshotMetrics(
            "m",
            {"e0": self.path},
            INTERVAL_MS / 1000,
            registry=self.registry,
            wall_clock=lambda: self.clock.wall,
            clock=lambda: self.clock.mono,
            refresh_on_scrape=refresh_on_scrape,  # off: reading a value here would refresh
        )

    def write(self, exporter: str = "process", status_writes: int = 0, **figures: int) -> None:
        writer = SnapshotWriter(self.cfg, "e0", exporter)
        writer.write(counters(**figures), status_writes, 0, [2000.0, 4000.0])
        self.clock.wall = read_snapshot(self.path).timestamp_ms / 1000

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"model_name": "m", "engine": "e0", **labels})


def test_a_snapshot_sets_every_family(tmp_path):
    r = Reading(tmp_path)
    r.write(
        step_id=40, num_waiting=2, num_running_prefill=1, num_running_decode=3, num_migrating_out=1,
        used_kv_tokens=64, total_kv_tokens=160, uncomputed_prefill_tokens=30, unallocated_tokens=50,
        last_step_duration_us=2500, num_preempted_total=4, status_writes=12,
    )  # fmt: skip
    r.clock.wall += 0.25
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_requests", state="waiting") == 2
    assert r.value("pilotfish_llumlet_requests", state="running_prefill") == 1
    assert r.value("pilotfish_llumlet_requests", state="running_decode") == 3
    assert r.value("pilotfish_llumlet_requests", state="migrating_out") == 1
    assert r.value("pilotfish_llumlet_requests", state="loading") == 0
    assert r.value("pilotfish_llumlet_kv_used_tokens") == 64
    assert r.value("pilotfish_llumlet_kv_capacity_tokens") == 160
    assert r.value("pilotfish_llumlet_uncomputed_prefill_tokens") == 30
    assert r.value("pilotfish_llumlet_unallocated_tokens") == 50
    assert r.value("pilotfish_llumlet_last_step_duration_seconds") == pytest.approx(0.0025)
    assert r.value("pilotfish_llumlet_export_staleness_seconds", percentile="50") == pytest.approx(0.004)
    assert r.value("pilotfish_llumlet_export_staleness_seconds", percentile="99") == pytest.approx(0.004)
    assert r.value("pilotfish_llumlet_exporter_info", exporter="process") == 1
    assert r.value("pilotfish_llumlet_steps_total") == 40
    assert r.value("pilotfish_llumlet_preemptions_total") == 4
    assert r.value("pilotfish_llumlet_cms_status_writes_total") == 12
    assert r.value("pilotfish_llumlet_cms_write_failures_total") == 0
    assert r.value("pilotfish_llumlet_snapshot_up") == 1
    assert r.value("pilotfish_llumlet_snapshot_age_seconds") == pytest.approx(0.25)
    assert r.value("pilotfish_llumlet_snapshot_timestamp_seconds") == pytest.approx(r.clock.wall - 0.25)


def test_counters_add_what_the_figures_grew_by_and_survive_a_writer_restart(tmp_path):
    r = Reading(tmp_path)
    r.write(step_id=10, status_writes=5)
    r.metrics.refresh()
    r.write(step_id=15, status_writes=9)
    r.metrics.refresh()
    assert (r.value("pilotfish_llumlet_steps_total"), r.value("pilotfish_llumlet_cms_status_writes_total")) == (15, 9)
    r.write(step_id=16, status_writes=2)  # a new export process counts its writes from 0
    r.metrics.refresh()
    assert (r.value("pilotfish_llumlet_steps_total"), r.value("pilotfish_llumlet_cms_status_writes_total")) == (16, 11)


def test_a_missing_snapshot_counts_and_reads_down_keeping_the_last_figures(tmp_path):
    r = Reading(tmp_path)
    r.metrics.refresh()  # vLLM up before its first snapshot
    assert r.value("pilotfish_llumlet_snapshot_up") == 0
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason="missing") == 1
    assert r.value("pilotfish_llumlet_requests", state="waiting") is None
    r.write(num_waiting=3)
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_up") == 1
    r.path.unlink()  # the llumlet stopped
    r.clock.wall += 7
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_up") == 0
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason="missing") == 2
    assert r.value("pilotfish_llumlet_snapshot_age_seconds") == pytest.approx(7)
    assert r.value("pilotfish_llumlet_requests", state="waiting") == 3


@pytest.mark.parametrize(("content", "reason"), [(b"{not json", "corrupt"), (b'{"version": 9}', "version")])
def test_a_corrupt_snapshot_never_raises(tmp_path, content, reason):
    r = Reading(tmp_path)
    r.path.parent.mkdir(parents=True, exist_ok=True)
    r.path.write_bytes(content)
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason=reason) == 1
    assert r.value("pilotfish_llumlet_snapshot_up") == 0


def test_a_snapshot_not_rewritten_goes_stale(tmp_path):
    r = Reading(tmp_path)
    r.write(num_waiting=1)
    r.clock.wall += STALE_AFTER_INTERVALS * INTERVAL_MS / 1000 - 0.1
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_up") == 1
    r.clock.wall += 0.2
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_up") == 0
    assert r.value("pilotfish_llumlet_snapshot_age_seconds") == pytest.approx(STALE_AFTER_INTERVALS + 0.1)


def test_an_older_snapshot_than_the_one_held_is_refused(tmp_path):
    r = Reading(tmp_path)
    r.write(num_waiting=5)
    newer = r.path.read_bytes()
    r.metrics.refresh()
    raw = msgspec.json.decode(newer)
    raw["update_id"] -= 10
    raw["load"]["num_waiting"] = 1
    r.path.write_bytes(msgspec.json.encode(raw))
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason="older") == 1
    assert r.value("pilotfish_llumlet_requests", state="waiting") == 5


def test_record_reads_at_most_once_an_interval(tmp_path):
    r = Reading(tmp_path)
    r.metrics.maybe_refresh()
    r.metrics.maybe_refresh()  # vLLM calls record() for every batch of outputs
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason="missing") == 1
    r.clock.mono += INTERVAL_MS / 1000
    r.metrics.maybe_refresh()
    assert r.value("pilotfish_llumlet_snapshot_read_errors_total", reason="missing") == 2


def test_the_exporter_label_moves_with_the_exporter(tmp_path):
    r = Reading(tmp_path)
    r.write(exporter="process")
    r.metrics.refresh()
    r.write(exporter="inline")  # the export process could not start again
    r.metrics.refresh()
    assert r.value("pilotfish_llumlet_exporter_info", exporter="process") == 0
    assert r.value("pilotfish_llumlet_exporter_info", exporter="inline") == 1


# ---- the exporters write it ---------------------------------------------------------------------


class FakeWriter:
    def __init__(self) -> None:
        self.statuses: list[cms_pb2.InstanceStatus] = []

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        self.statuses.append(status)

    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None:
        pass

    def remove(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_export_thread_writes_the_snapshot_and_removes_it_at_stop(tmp_path):
    cfg = config(tmp_path, refresh_ms=60_000, ttl_ms=120_000, metrics_interval_ms=100)
    writer = FakeWriter()
    llumlet = Llumlet(cfg, "e0", cms_pb2.InstanceMetadata(), writer, metrics_snapshot=True)  # type: ignore[arg-type]
    path = snapshot_path(cfg, "e0")
    llumlet.start(serve_grpc=False)
    try:
        with llumlet.events() as s:
            s.added("r1", 40)
        got = wait_for(
            lambda: path.exists() and (snap := read_snapshot(path)).load.num_waiting == 1 and snap, "the snapshot"
        )
        assert got.exporter == "thread" and got.load.unallocated_tokens == 40
        wait_for(lambda: read_snapshot(path).status_writes >= 1, "the write counted")
    finally:
        llumlet.stop()
    assert not path.exists()


def test_no_snapshot_unless_asked(tmp_path):
    cfg = config(tmp_path, refresh_ms=60_000, ttl_ms=120_000, metrics_interval_ms=100)
    llumlet = Llumlet(cfg, "e0", cms_pb2.InstanceMetadata(), FakeWriter())  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        llumlet.export_once()
        with llumlet.events() as s:
            s.added("r1", 40)
        wait_for(lambda: llumlet.exports >= 2, "two writes")
    finally:
        llumlet.stop()
    assert list(tmp_path.iterdir()) == []


def test_the_export_process_writes_the_snapshot_and_removes_it_at_stop(tmp_path):
    cfg = config(tmp_path, refresh_ms=60_000, ttl_ms=120_000, metrics_interval_ms=100)
    fd, region = create_region()
    state = LoadState("e0", admitted_window_ms=60_000)
    handoff = HandoffWriter(region)
    read_end, pipe = os.pipe()
    meta = cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=1)
    exporter = Exporter(
        cfg,
        "e0",
        meta,
        map_region(fd),
        read_end,
        os.getppid(),
        writer=FakeWriter(),
        metrics_snapshot=True,  # type: ignore[arg-type]
    )
    handoff.publish(state, 0)
    thread = threading.Thread(target=exporter.run, daemon=True)
    thread.start()
    path = snapshot_path(cfg, "e0")
    try:
        state.added("r1", 40)
        if handoff.publish(state, time.monotonic_ns()):
            os.write(pipe, b"w")
        got = wait_for(
            lambda: path.exists() and (snap := read_snapshot(path)).load.num_waiting == 1 and snap, "the snapshot"
        )
        assert got.exporter == "process" and got.load.unallocated_tokens == 40
    finally:
        os.write(pipe, STOP_REMOVE)
        thread.join(timeout=10)
        for handle in (fd, read_end, pipe):
            os.close(handle)
    assert not thread.is_alive() and not path.exists()


def test_a_scrape_refreshes_an_idle_engines_figures(tmp_path):
    # vLLM calls neither record() nor log() while idle under --disable-log-stats
    r = Reading(tmp_path, refresh_on_scrape=True)
    r.write(num_waiting=1)
    assert "pilotfish_llumlet_snapshot_up" in generate_latest(r.registry).decode()
    assert r.value("pilotfish_llumlet_requests", state="waiting") == 1
    r.write(num_waiting=4)
    generate_latest(r.registry)  # within the interval: not read again
    assert r.value("pilotfish_llumlet_requests", state="waiting") == 1
    r.clock.mono += INTERVAL_MS / 1000
    text = generate_latest(r.registry).decode()
    assert 'pilotfish_llumlet_requests{engine="e0",model_name="m",state="waiting"} 4.0' in text


def test_a_scrape_that_fails_to_refresh_still_serves_the_page(tmp_path, monkeypatch):
    r = Reading(tmp_path, refresh_on_scrape=True)
    r.write(num_waiting=1)
    monkeypatch.setattr(r.metrics, "refresh", lambda: 1 / 0)
    assert "pilotfish_llumlet" in generate_latest(r.registry).decode()  # the families, as last set


# ---- the engine's name, derived alike in vLLM's two processes -------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "dp_rank", "dp_size", "expected"),
    [
        (["serve", "--port", "8001"], {}, 0, 1, "{host}-8001"),
        (["serve", "--port=8002"], {}, 0, 1, "{host}-8002"),
        (["serve"], {}, 0, 1, "{host}-8000"),  # vLLM's default port
        (["serve", "--port", "8001"], {}, 1, 2, "{host}-8001-dp1"),
        (["serve", "--port", "8001"], {"PILOTFISH_HTTP_PORT": "9000"}, 0, 1, "{host}-9000"),
        (["serve", "--port", "8001"], {"PILOTFISH_INSTANCE_ID": "gpu-a"}, 0, 1, "gpu-a"),
        (["serve"], {"PILOTFISH_INSTANCE_ID": "gpu-a"}, 3, 4, "gpu-a-dp3"),
    ],
)
def test_both_processes_name_the_engine_alike(monkeypatch, argv, env, dp_rank, dp_size, expected):
    import socket

    from pilotfish.vllm_plugin.adapters import vllm_identity

    monkeypatch.setattr("sys.argv", argv)
    cfg = config_from_env({"PILOTFISH_CMS_URL": "redis://x", **env})
    assert vllm_identity.instance_id(cfg, dp_rank, dp_size) == expected.format(host=socket.gethostname())


def test_an_export_process_found_dead_at_stop_leaves_no_snapshot(tmp_path):
    # the engine removes what the dead child cannot
    cfg = config(tmp_path)
    llumlet = Llumlet(cfg, "e0", cms_pb2.InstanceMetadata(), FakeWriter(), own_process=True, metrics_snapshot=True)  # type: ignore[arg-type]
    SnapshotWriter(cfg, "e0", "process").write(counters(), 0, 0, [])

    class DeadProcess:
        def stop(self, remove: bool) -> bool:
            return False

    llumlet.exporter.process = DeadProcess()  # type: ignore[attr-defined]
    llumlet.stop()
    assert not snapshot_path(cfg, "e0").exists()
