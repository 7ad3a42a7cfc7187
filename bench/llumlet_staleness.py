"""Staleness of the full-mode load view: engine event -> llumlet -> Redis -> scheduler's CMS view.

The engine side runs here: a thread plays an engine emitting load-change events through the
llumlet core (the same Llumlet, export process or thread and CmsWriter as inside vLLM) into a
real redis-server on loopback. Each event also ends a "step", so status.step_id numbers the events.
The scheduler side runs in a second process: the scheduler's own reader (cms/reader.py:
notice, GET, strict decode) feeding a sink that stamps when each step_id became visible.
CLOCK_MONOTONIC is machine-wide, so the two processes' stamps compare directly.

Staleness of event k = the first moment the view holds a status with step_id >= k, minus the
moment the engine thread applied event k. Coalescing means not every event gets its own record;
the measure still charges every event until a record at least as new is visible.

Schedules: `steady` (one event every --interval-us, like per-step or per-token events),
`burst` (--burst events back to back, then a pause: a step finishing many requests at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

NAME = "llumlet_staleness"


class LlumletStalenessConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    events: Annotated[int, Meta(ge=1, description="events per schedule")] = 5000
    interval_us: Annotated[int, Meta(ge=0, description="steady: gap between events (µs)")] = 2000
    burst: Annotated[int, Meta(ge=1, description="burst: events per burst")] = 50
    burst_gap_ms: Annotated[float, Meta(ge=0, description="burst: pause between bursts (ms)")] = 20.0
    engine: Annotated[
        Literal["idle", "busy"],
        Meta(description="engine thread between events: blocked (idle) or running Python (busy)"),
    ] = "idle"
    switch_interval_us: Annotated[
        int | None,
        Meta(
            description="the llumlet's gil_switch_interval_us in the engine process (unset: the llumlet's "
            "default; 0: leave Python's 5000)"
        ),
    ] = None
    redis_url: Annotated[
        str | None, Meta(description="use this Redis instead of starting a redis-server (unset: start one)")
    ] = None
    write_from: Annotated[
        Literal["process", "engine", "export"],
        Meta(
            description="who writes a change: the export process, fed through shared memory, as the vLLM adapter "
            "does by default; the engine's thread at once (PILOTFISH_EXPORT_PROCESS=false); or the export "
            "thread, woken by it"
        ),
    ] = "process"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, LlumletStalenessConfig)


# ---------------------------------------------------------------- the scheduler side (subprocess)


def _reader_main(url: str, cluster: str, out: str, ready: str) -> None:
    import asyncio

    from pilotfish.cms.reader import CmsReader

    seen: list[tuple[int, int]] = []  # (step_id, monotonic ns when it became visible)

    class Sink:
        def __init__(self) -> None:
            self.meta: set[str] = set()
            self.last = 0

        def apply_metadata(self, meta: Any) -> bool:
            self.meta.add(meta.instance_id)
            return True

        def apply_status(self, status: Any) -> bool:
            if status.update_id <= self.last:
                return False
            self.last = status.update_id
            seen.append((status.step_id, time.monotonic_ns()))
            return True

        def status_gone(self, instance_id: str) -> None:
            pass

        def remove(self, instance_id: str) -> bool:
            return True

        def known(self) -> set[str]:
            return self.meta

    async def main() -> None:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        reader = CmsReader(url, cluster, Sink(), poll_interval=1.0)
        task = asyncio.create_task(reader.run())
        await reader.wait_first_poll(timeout=30)
        await asyncio.sleep(0.3)  # subscribed
        Path(ready).write_text("ready")
        while not Path(out + ".stop").exists():
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        Path(out).write_text(json.dumps(seen))

    asyncio.run(main())


# ---------------------------------------------------------------- the engine side


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait_until(deadline_ns: int, engine: str) -> None:
    """How the engine thread spends the time between events.

    idle: blocked (GIL released), as an engine waiting on its GPU or its input queue;
    busy: running Python (GIL held), as vLLM's scheduler on a large batch: the worst case for the
    export thread, which must win the GIL (sys.getswitchinterval) for every step of a write.
    """
    if engine == "idle":
        while (left := deadline_ns - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        return
    while time.monotonic_ns() < deadline_ns:
        pass


def _run_schedule(url: str, cluster: str, schedule: str, cfg: LlumletStalenessConfig, work: Path) -> dict[str, Any]:
    """One schedule's events through a fresh llumlet, seen by a fresh reader process: its figures."""
    out = work / f"{schedule}.json"
    ready = work / f"{schedule}.ready"
    reader = subprocess.Popen(
        [sys.executable, __file__, "--reader", url, cluster, str(out), str(ready)], stdin=subprocess.DEVNULL
    )
    llumlet = None
    try:
        # the llumlet first: its metadata is in Redis by the reader's first poll, so the reader
        # knows the instance from the start (else it finds it a poll interval later)
        llumlet, written = _timed_llumlet(cfg, url, cluster, f"bench-{schedule}")
        _wait_ready(reader, ready)
        applied, hook_cpu_ns = _play(cfg, schedule, llumlet)
        time.sleep(0.5)  # the tail of the writes: what is not visible by then counts as never seen
    finally:
        Path(str(out) + ".stop").write_text("")
        reader.wait(timeout=60)
        if llumlet is not None:
            llumlet.stop()
    seen = [tuple(x) for x in json.loads(out.read_text())]
    view_us = _staleness(applied, seen)
    redis_us = _staleness(applied, written)
    return {
        "events": cfg.events,
        "records_written": len(written),
        "records_seen": len(seen),
        "never_seen": cfg.events - len(view_us),
        "view": _summary(view_us),
        "redis": _summary(redis_us) if redis_us else None,
        # thread_time's resolution is the scheduler tick on some kernels: the mean is the figure
        "engine_cpu_per_event": _summary([ns / 1000 for ns in hook_cpu_ns]),
    }


def _wait_ready(reader: subprocess.Popen[bytes], ready: Path) -> None:
    """Until the scheduler-side process has subscribed (it writes `ready`)."""
    deadline = time.monotonic() + 60
    while not ready.exists():
        if reader.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the reader process did not start")
        time.sleep(0.05)


def _timed_llumlet(
    cfg: LlumletStalenessConfig, url: str, cluster: str, instance: str
) -> tuple[Any, list[tuple[int, int]]]:
    """A started llumlet whose writer stamps each record as Redis takes it: (llumlet, its (step_id, ns) stamps)."""
    from pilotfish.protos import cms_pb2
    from pilotfish.vllm_plugin.config import LlumletConfig
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

    llumlet_cfg = LlumletConfig(cms_url=url, cluster=cluster)
    if cfg.switch_interval_us is not None:
        llumlet_cfg.gil_switch_interval_us = cfg.switch_interval_us
    meta = cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=1)
    # the export process writes in a process of its own: no acknowledgement to stamp here (it
    # logs its own event -> Redis figures); the view's staleness is the measure
    llumlet = Llumlet(
        llumlet_cfg, instance, meta, own_process=cfg.write_from == "process", step_hooks=cfg.write_from == "engine"
    )
    written: list[tuple[int, int]] = []  # (step_id, monotonic ns when Redis acknowledged it)
    write = llumlet.writer.write_status

    def timed_write(status: Any) -> None:
        write(status)
        written.append((status.step_id, time.monotonic_ns()))

    llumlet.writer.write_status = timed_write  # type: ignore[method-assign]
    try_write = llumlet.writer.try_write_status

    def timed_try_write(status: Any) -> bool:
        if done := try_write(status):  # written as far as the kernel: Redis reads it from there
            written.append((status.step_id, time.monotonic_ns()))
        return done

    llumlet.writer.try_write_status = timed_try_write  # type: ignore[method-assign]
    llumlet.start(serve_grpc=False)
    return llumlet, written


def _play(cfg: LlumletStalenessConfig, schedule: str, llumlet: Any) -> tuple[list[int], list[int]]:
    """The engine thread: --events load changes on `schedule`; (when event k was applied at index k
    in monotonic ns, the engine thread's CPU per event: the hook and the write made in it)."""
    applied: list[int] = [0]  # step_id k == event k
    hook_cpu_ns: list[int] = []
    next_at = time.monotonic_ns()
    for k in range(1, cfg.events + 1):
        if schedule == "steady":
            next_at += cfg.interval_us * 1000
        elif k % cfg.burst == 1:
            next_at = time.monotonic_ns() + int(cfg.burst_gap_ms * 1e6)
        else:
            next_at = 0
        _wait_until(next_at, cfg.engine)
        cpu = time.thread_time_ns()
        with llumlet.events() as s:
            s.added(f"r{k}", 100)
            s.step_finished(0.001, 100, 0, 0)
            stamp = time.monotonic_ns()
        hook_cpu_ns.append(time.thread_time_ns() - cpu)
        applied.append(stamp)
    return applied, hook_cpu_ns


def _staleness(applied: list[int], visible: list[tuple[int, int]]) -> list[float]:
    """Per event k: first moment a record with step_id >= k was visible, minus when k happened."""
    out: list[float] = []
    j = 0
    for k in range(1, len(applied)):
        while j < len(visible) and visible[j][0] < k:
            j += 1
        if j == len(visible):
            break
        out.append((visible[j][1] - applied[k]) / 1000)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(_percentile(values, 0.50), 1),
        "p90_us": round(_percentile(values, 0.90), 1),
        "p99_us": round(_percentile(values, 0.99), 1),
        "max_us": round(max(values), 1),
        "mean_us": round(statistics.fmean(values), 1),
    }


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(LlumletStalenessConfig, args)
    return 0 if _report(cfg, _measure(cfg), Path(args.out)) else 1


GOAL_P99_US = 5000  # event -> view, at p99


def _measure(cfg: LlumletStalenessConfig) -> dict[str, dict[str, Any]]:
    """Both schedules against one Redis (--redis-url, else a loopback redis-server started and stopped here)."""
    from pilotfish import services

    with tempfile.TemporaryDirectory(prefix="pf-staleness-") as tmp:
        work = Path(tmp)
        service = None if cfg.redis_url else services.start_redis(work / "redis")
        url = cfg.redis_url or service.url  # type: ignore[union-attr]
        try:
            return {s: _run_schedule(url, "bench", s, cfg, work) for s in ("steady", "burst")}
        finally:
            if service is not None:
                service.stop()


def _report(cfg: LlumletStalenessConfig, results: dict[str, dict[str, Any]], out: Path) -> bool:
    """result.json and report.md; whether the goal was met."""
    from pilotfish.bench.report import write_report

    goal_met = all(r["view"]["p99_us"] <= GOAL_P99_US and r["never_seen"] == 0 for r in results.values())
    result = {
        "schedules": results, "goal_p99_ms": GOAL_P99_US // 1000, "goal_met": goal_met, "cpus": os.cpu_count(),
        "engine": cfg.engine, "switch_interval_us": round(sys.getswitchinterval() * 1e6),
        "write_from": cfg.write_from,
    }  # fmt: skip
    markdown = "\n".join([
        "# llumlet staleness: engine event -> Redis -> scheduler view", "",
        f"Loopback redis-server, the scheduler's CmsReader in a second process, {os.cpu_count()} CPUs. "
        f"{cfg.events} events per schedule; steady: one every {cfg.interval_us} µs; burst: {cfg.burst} back to "
        f"back every {cfg.burst_gap_ms} ms. Engine thread between events: {cfg.engine}; GIL switch interval "
        f"{result['switch_interval_us']} µs. Changes written from the "
        f"{'export process' if cfg.write_from == 'process' else cfg.write_from + ' thread'} "
        f"(event → Redis: handed to the kernel from the engine's thread, acknowledged from the export thread, "
        f"not stamped here from the export process). "
        f"Goal p99 <= {GOAL_P99_US // 1000} ms (event → view): {'met' if goal_met else 'NOT met'}.",
        "", *_table(results),
    ])  # fmt: skip
    write_report(out, NAME, result, markdown)
    print(markdown)
    return goal_met


def _table(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        "| schedule | path | records | p50 (µs) | p90 (µs) | p99 (µs) | max (µs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        paths = (("redis", "event → Redis", "records_written"), ("view", "event → view", "records_seen"))
        for path, label, count in paths:
            v = r[path]
            if v is None:
                rows.append(f"| {name} | {label} | - | - | - | - | - |")  # written in the export process
                continue
            figures = " | ".join(str(v[f"{q}_us"]) for q in ("p50", "p90", "p99", "max"))
            rows.append(f"| {name} | {label} | {r[count]} | {figures} |")
    rows += ["", "Engine thread's CPU per event (the hook and the write made in it, `thread_time`): "
             + "; ".join(f"{name} mean {r['engine_cpu_per_event']['mean_us']} µs, p50 "
                         f"{r['engine_cpu_per_event']['p50_us']} µs" for name, r in results.items()) + "."]  # fmt: skip
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--reader":
        _reader_main(*sys.argv[2:])
    else:
        raise SystemExit("run through `pilotfish bench llumlet-staleness`")
