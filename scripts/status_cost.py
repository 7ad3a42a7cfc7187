#!/usr/bin/env python3
"""What engine statuses cost a running full-mode scheduler, and its Schedules beside them.

A real Redis and a real scheduler (`SchedulerServer`, full mode, in this process on uvloop), engines
that only write to the CMS: a writer process publishes each engine's metadata, then a status per
engine `--rate` times a second, as llumlets do at every engine step. While they arrive, a task in
the scheduler's loop makes `--decisions` Schedules a second, each released 2 s later (the core's own
call, as a Schedule handler makes it). Each engine count runs twice, in turn: with the load index
re-keyed in the loop's free time (the shipped way, scheduler/idle_rekey.py) and lazily, at the next
Schedule. It reports, per mode and engine count:

- the scheduler thread's CPU per status, net of the same thread idle (no writer) just before;
- each Schedule's thread CPU, p50 and p99.

    .venv/bin/python scripts/status_cost.py [--engines 2,16,64] [--rate 30] [--decisions 20] [--seconds 8]

Linux only (/proc). Needs redis-server (scripts/install-system-deps.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WRITER = """
import random, sys, time
from pilotfish.bench import scheduler as sb
from pilotfish.cms.writer import CmsWriter
url, engines, rate, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rng = random.Random(1)
writers = [CmsWriter(url, "default", f"i{k}", 60_000) for k in range(engines)]
for k, writer in enumerate(writers):
    writer.write_metadata(sb._meta(k))
    writer.write_status(sb._status(k, 1, rng))
print("ready", flush=True)
sys.stdin.readline()  # go
start, tick, written = time.monotonic(), 0, 0
while time.monotonic() - start < seconds:
    tick += 1
    for k, writer in enumerate(writers):
        writer.write_status(sb._status(k, 1 + tick, rng, [f"w{tick}-{k}"]))
        written += 1
    time.sleep(max(0.0, start + tick / rate - time.monotonic()))
print(written, flush=True)
"""


def thread_cpu_ns(tid: int) -> int:
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])


async def one_run(url: str, engines: int, lazy: bool, args: argparse.Namespace) -> dict[str, Any]:
    from pilotfish.bench import scheduler as sb
    from pilotfish.procs import free_port
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.service import SchedulerServer
    from pilotfish.stats import percentile

    server = SchedulerServer(SchedulerConfig(enable_full_mode_scheduling=True, redis_url=url, model=["m"],
                                             port=free_port()))  # fmt: skip
    await server.start()
    tid = threading.get_native_id()
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, url, str(engines), str(args.rate), str(args.seconds),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert writer.stdin is not None and writer.stdout is not None
    try:
        await writer.stdout.readline()  # the metadata is written
        while sum(inst.status is not None for inst in server.core.instances()) < engines:
            await asyncio.sleep(0.05)
        if lazy:
            server.core.on_rekey_due = None
        idle_started = thread_cpu_ns(tid)
        await asyncio.sleep(2.0)
        idle_ns_per_s = (thread_cpu_ns(tid) - idle_started) / 2.0
        rng = random.Random(2)
        prefixes = sb.prefix_chains(rng)
        cpu_us: list[float] = []
        loop = asyncio.get_running_loop()
        writer.stdin.write(b"go\n")
        started, busy_started = time.monotonic(), thread_cpu_ns(tid)
        i = 0
        while time.monotonic() - started < args.seconds:
            req = sb.request(f"r{i}", rng.randrange(16, 4096), prefixes[i % sb.PREFIXES])
            t0 = time.thread_time_ns()
            server.core.schedule(req)
            cpu_us.append((time.thread_time_ns() - t0) / 1000)
            loop.call_later(2.0, server.core.release, req.request_id)
            i += 1
            await asyncio.sleep(max(0.0, started + i / args.decisions - time.monotonic()))
        busy_ns = thread_cpu_ns(tid) - busy_started
        elapsed = time.monotonic() - started
        written = int((await writer.stdout.readline()).decode().strip() or 0)
        await writer.wait()
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()
        await server.stop(grace=0)
    statuses_per_s = written / args.seconds
    decisions_ns = sum(cpu_us) * 1000
    per_status = (busy_ns - decisions_ns - idle_ns_per_s * elapsed) / max(1, written) / 1000
    return {
        "engines": engines,
        "rekey": "lazy" if lazy else "idle",
        "statuses_per_s": round(statuses_per_s),
        "status_cpu_us": round(per_status, 1),
        "schedule_cpu_p50_us": round(percentile(cpu_us, 50), 1),
        "schedule_cpu_p99_us": round(percentile(cpu_us, 99), 1),
        "schedules": len(cpu_us),
    }


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pilotfish import services

    work = Path(tempfile.mkdtemp(prefix="pilotfish-status-cost-"))
    rows = []
    with services.start_redis(work / "redis") as redis:
        for engines in args.engines:
            for rep in range(args.reps):
                for lazy in (False, True) if rep % 2 == 0 else (True, False):
                    redis_flush(redis.url)
                    row = await one_run(redis.url, engines, lazy, args)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def redis_flush(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushall()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=lambda s: [int(x) for x in s.split(",")], default=[2, 16, 64])
    parser.add_argument("--rate", type=float, default=30.0, help="statuses per engine per second")
    parser.add_argument("--decisions", type=float, default=20.0, help="Schedules per second")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each run")
    parser.add_argument("--reps", type=int, default=2, help="runs of each mode per engine count")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    import uvloop

    rows = uvloop.run(measure(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
