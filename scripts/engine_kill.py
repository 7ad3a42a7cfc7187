#!/usr/bin/env python3
"""kill -9 one engine under load through the real stack, and count what the clients saw.

Starts the lite stack (each simulated engine its own process, scheduler, ext_proc, Envoy) on
loopback, keeps --concurrency short streams in flight, kills engine sim-1 with SIGKILL after
--warmup seconds, starts it again on its port after --dead seconds, and runs --after seconds
more. `--before` runs the stack as it was before engine health: no ejection, no probes, no retry
(--destination-fallbacks 0). Prints one JSON line: sent, ok, failed (by error), and the requests
the scheduler dispatched to the dead engine while it was dead.

    .venv/bin/python scripts/engine_kill.py            # with engine health
    .venv/bin/python scripts/engine_kill.py --before   # without
    .venv/bin/python scripts/engine_kill.py --no-retry # ejection and probes, Envoy does not retry
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from pilotfish.procs import ChildGroup
from pilotfish.prom_scrape import metric
from pilotfish.stack import StackSpec, start_stack

MODEL = "pilotfish-sim"


async def load(base_url: str, concurrency: int, stop: asyncio.Event, counts: Counter[str]) -> None:
    async def client(k: int) -> None:
        i = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while not stop.is_set():
                i += 1
                body = {"model": MODEL, "prompt": f"client {k} request {i} " * 3, "max_tokens": 4, "stream": True}
                counts["sent"] += 1
                try:
                    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                        raw = await resp.read()
                    if resp.status != 200:
                        counts[f"failed: {resp.status} {raw[:40].decode(errors='replace')}"] += 1
                    elif not raw.rstrip().endswith(b"data: [DONE]"):
                        counts["failed: stream cut"] += 1
                    else:
                        counts["ok"] += 1
                except aiohttp.ClientError as exc:
                    counts[f"failed: {type(exc).__name__}"] += 1

    await asyncio.gather(*(client(k) for k in range(concurrency)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="store_true", help="no ejection, no probes, no retry")
    parser.add_argument("--no-retry", action="store_true", help="ejection and probes, but no retry in Envoy")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--dead", type=float, default=15.0)
    parser.add_argument("--after", type=float, default=3.0)
    args = parser.parse_args()
    scheduler_args = ["--outlier-consecutive-failures", "0", "--health-probes", "off"] if args.before else []
    fallbacks = 0 if args.before or args.no_retry else 1
    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-engine-kill-") as tmp:
        try:
            stack = start_stack(
                StackSpec(engines=2, separate_engines=True, scheduler_metrics=True, ext_proc_metrics=True,
                          scheduler_args=scheduler_args, destination_fallbacks=fallbacks),
                group, Path(tmp),
            )  # fmt: skip

            def dispatched() -> float:
                return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_dispatch_total", engine="sim-1")

            def ejections() -> float:
                return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_ejections_total", engine="sim-1")

            async def run() -> dict[str, object]:
                counts: Counter[str] = Counter()
                stop = asyncio.Event()
                task = asyncio.create_task(load(stack.base_url, args.concurrency, stop, counts))
                await asyncio.sleep(args.warmup)
                before_kill = dict(counts)
                child = stack.children["engine sim-1"]
                os.kill(child.pid, signal.SIGKILL)
                killed_at, at_kill = time.monotonic(), await asyncio.to_thread(dispatched)
                await asyncio.sleep(args.dead)
                await asyncio.to_thread(child.proc.wait)
                new = group.respawn(child)
                await asyncio.to_thread(new.wait_port, dict(stack.engines)["sim-1"])
                to_dead = await asyncio.to_thread(dispatched) - at_kill
                dead_for = time.monotonic() - killed_at
                during = Counter(counts)
                during.subtract(before_kill)
                await asyncio.sleep(args.after)
                stop.set()
                await task
                return {
                    "mode": "before" if args.before else "health, no retry" if args.no_retry else "after",
                    "concurrency": args.concurrency,
                    "dead_seconds": round(dead_for, 1),
                    "sent": counts["sent"],
                    "ok": counts["ok"],
                    "failed": {k[8:]: v for k, v in counts.items() if k.startswith("failed: ")},
                    "failed_while_dead": sum(v for k, v in during.items() if k.startswith("failed: ")),
                    "sent_while_dead": during["sent"],
                    "dispatched_to_dead_engine": to_dead,
                    "ejections": ejections(),
                    "envoy_retries": _envoy_retries(stack.admin_port),
                }

            print(json.dumps(asyncio.run(run())))
        finally:
            group.stop_all()
    return 0


def _envoy_retries(admin_port: int) -> float:
    from pilotfish.services import http_call

    _, body = http_call(f"http://127.0.0.1:{admin_port}/stats?filter=upstream_rq_retry$")
    return sum(float(line.split(": ")[1]) for line in body.decode().splitlines() if ": " in line)


if __name__ == "__main__":
    sys.exit(main())
