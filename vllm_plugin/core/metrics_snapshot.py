"""The llumlet's figures for vLLM's own /metrics: a small snapshot file between two processes.

vLLM serves /metrics from its API-server process; the llumlet lives in the engine-core process
(and writes from its export process). So the exporter that writes the CMS also writes, every
`metrics_interval_ms`, one `LlumletSnapshot` (JSON, at most `MAX_SNAPSHOT_BYTES`) to
`<metrics_dir>/<instance id>.json` by an atomic rename, and the stat-logger plugin in the API
server (adapters/vllm_metrics.py) reads it. A file, not shared memory: the two processes share
no handle (the API server does not start the export process), a rename is atomic, and the write
costs the exporter ~50 us a second, never the engine's thread.

Neither side may hurt vLLM: the writer swallows and counts its I/O errors (one WARNING), the
reader turns any bad file into a `SnapshotError` with a short reason that becomes a counter.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

import msgspec

from pilotfish.vllm_plugin.config import LlumletConfig

log = logging.getLogger("pilotfish.llumlet")

SNAPSHOT_VERSION = 1
# a snapshot is ~900 bytes; anything much larger is not one of ours
MAX_SNAPSHOT_BYTES = 4096
# the staleness percentiles are over the latest writes, so they follow the load of the last minutes
STALENESS_WINDOW = 1024
READ_ERRORS = ("missing", "oversize", "corrupt", "version", "older")


class SnapshotLoad(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The load figures the llumlet last exported (a subset of the CMS status record, same names)."""

    step_id: int
    num_waiting: int
    num_running_prefill: int
    num_running_decode: int
    num_loading: int
    num_migrating_out: int
    num_migrating_in: int
    uncomputed_prefill_tokens: int
    unallocated_tokens: int
    used_kv_tokens: int
    total_kv_tokens: int
    last_step_duration_us: int
    num_preempted_total: int


LOAD_FIELDS = SnapshotLoad.__struct_fields__


class LlumletSnapshot(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One llumlet's figures at `timestamp_ms`; `update_id` grows with every write, across restarts."""

    version: int = SNAPSHOT_VERSION
    instance_id: str
    update_id: int
    timestamp_ms: int
    exporter: str  # process, inline or thread (core/exporter.py)
    status_writes: int  # CMS status writes since the writer started
    write_failures: int  # failed CMS writes since the writer started
    staleness_p50_us: float  # event -> Redis, over the last STALENESS_WINDOW writes (0: none yet)
    staleness_p99_us: float
    load: SnapshotLoad


class SnapshotError(Exception):
    """A snapshot that cannot be used; `reason` is one of READ_ERRORS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def snapshot_dir(config: LlumletConfig) -> Path:
    """`metrics_dir`, else pilotfish-llumlet-<uid> under the temporary directory: the engine and the
    API server inherit the same environment, so both find the same one."""
    if config.metrics_dir:
        return Path(config.metrics_dir)
    return Path(tempfile.gettempdir()) / f"pilotfish-llumlet-{os.getuid()}"


def snapshot_path(config: LlumletConfig, instance_id: str) -> Path:
    return snapshot_dir(config) / f"{quote(instance_id, safe='')}.json"


def percentiles(staleness_us: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of the newest STALENESS_WINDOW values of a deque or list, newest last; (0, 0) if none."""
    values = list(itertools.islice(reversed(staleness_us), STALENESS_WINDOW))
    if not values:
        return 0.0, 0.0
    values.sort()
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return pick(0.5), pick(0.99)


def load_of(counters: Mapping[str, int]) -> SnapshotLoad:
    return SnapshotLoad(**{name: int(counters[name]) for name in LOAD_FIELDS})


class SnapshotWriter:
    """Writes one llumlet's snapshot at most every `metrics_interval_ms`; never raises."""

    def __init__(self, config: LlumletConfig, instance_id: str, exporter: str) -> None:
        self.path = snapshot_path(config, instance_id)
        self.instance_id = instance_id
        self.exporter = exporter
        self.interval_s = config.metrics_interval_ms / 1000
        self.next_s = 0.0  # monotonic: the first call writes
        self.update_id = 0
        self.writes = 0
        self.failures = 0
        self._dir_ready = False

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_s

    def write(
        self, counters: Mapping[str, int], status_writes: int, write_failures: int, staleness_us: Sequence[float]
    ) -> None:
        """Write the snapshot now (the caller asked `due`); an I/O error is logged once and counted."""
        self.next_s = time.monotonic() + self.interval_s
        p50, p99 = percentiles(staleness_us)
        now_ns = time.time_ns()
        # a restarted writer (a new export process) continues above the old one's ids
        self.update_id = max(self.update_id + 1, now_ns // 1000)
        snapshot = LlumletSnapshot(
            instance_id=self.instance_id,
            update_id=self.update_id,
            timestamp_ms=now_ns // 1_000_000,
            exporter=self.exporter,
            status_writes=status_writes,
            write_failures=write_failures,
            staleness_p50_us=p50,
            staleness_p99_us=p99,
            load=load_of(counters),
        )
        try:
            self._replace(msgspec.json.encode(snapshot))
        except (OSError, ValueError) as exc:
            if not self.failures:
                log.warning("llumlet %s: cannot write the metrics snapshot %s: %s", self.instance_id, self.path, exc)
            self.failures += 1
            return
        self.writes += 1

    def _replace(self, data: bytes) -> None:
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"{len(data)} bytes, over {MAX_SNAPSHOT_BYTES}")
        directory = self.path.parent
        if not self._dir_ready:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if directory.stat().st_uid != os.getuid():  # someone else's directory: their files, not ours
                raise OSError(f"{directory} belongs to another user")
            self._dir_ready = True
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def remove(self) -> None:
        """At a clean stop: the reader then reports the snapshot missing, not a frozen one."""
        with contextlib.suppress(OSError):
            self.path.unlink()


def read_snapshot(path: Path) -> LlumletSnapshot:
    """The snapshot at `path`, decoded strictly; SnapshotError naming the reason otherwise."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_SNAPSHOT_BYTES + 1)
    except FileNotFoundError:
        raise SnapshotError("missing") from None
    except OSError as exc:
        raise SnapshotError("missing", str(exc)) from None
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError("oversize", f"over {MAX_SNAPSHOT_BYTES} bytes")
    try:
        version = msgspec.json.decode(data, type=_Versioned).version
    except msgspec.DecodeError as exc:
        raise SnapshotError("corrupt", str(exc)) from None
    if version != SNAPSHOT_VERSION:
        raise SnapshotError("version", f"version {version}, this reader knows {SNAPSHOT_VERSION}")
    try:
        return msgspec.json.decode(data, type=LlumletSnapshot)
    except msgspec.DecodeError as exc:
        raise SnapshotError("corrupt", str(exc)) from None


class _Versioned(msgspec.Struct):
    """Only the version, read first: a newer writer's fields must say 'version', not 'corrupt'."""

    version: int
