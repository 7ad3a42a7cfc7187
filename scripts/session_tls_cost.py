#!/usr/bin/env python3
"""What TLS costs the gateway's Session socket: Schedule round trips, plaintext against mutual TLS, one run.

Two real schedulers (`pilotfish scheduler`, each its own process, lite mode, two static engines, the
Session socket on), one plaintext and one with mutual TLS and a token (certificates made here). The
gateway's real client (GrpcScheduler over the Session socket, on uvloop) sends N Schedules to each, one
at a time, each followed by its Release, in interleaved blocks so drift hits both alike. It reports
the Schedule round trip (median, p99) and the CPU per request (Schedule + Release) of the client and
of the scheduler process, from each process's on-CPU time in /proc/<pid>/task/*/schedstat (ns).

    .venv/bin/python scripts/session_tls_cost.py [--requests 2000] [--blocks 4] [--json out.json]

Needs the `cryptography` package (the test extra). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def cpu_ns(pid: int | str = "self") -> int:
    """On-CPU time of every thread of a process, in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


def start_scheduler(extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    from pilotfish.procs import free_port, port_answers, wait_until

    port, session = free_port(), free_port()
    argv = [sys.executable, "-m", "pilotfish", "--log-level", "WARNING", "scheduler", "--port", str(port),
            "--session-port", str(session), "--instances", "127.0.0.1:8001,127.0.0.1:8002", "--model", "m",
            *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_until(lambda: port_answers(session), 60, f"scheduler on {session}", alive=proc.poll)
    return proc, port, session


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pilotfish.ext_proc.scheduler_client import GrpcScheduler
    from pilotfish.protos import scheduler_pb2
    from pilotfish.security import Security
    from pilotfish.security_testing import make_pki

    work = Path(tempfile.mkdtemp(prefix="pilotfish-tls-cost-"))
    pki = make_pki(work / "pki")
    token = work / "token"
    token.write_text(os.urandom(16).hex() + "\n")
    tls_flags = ["--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key), "--tls-ca-file", str(pki.ca),
                 "--auth-token-file", str(token)]  # fmt: skip
    gateway = Security(cert=str(pki.client_cert), key=str(pki.client_key), ca=str(pki.ca),
                       token=token.read_text().strip().encode())  # fmt: skip
    modes: dict[str, dict[str, Any]] = {
        "plaintext": {"flags": [], "security": None},
        "tls": {"flags": tls_flags, "security": gateway},
    }
    procs = []
    try:
        for name, mode in modes.items():
            proc, port, session = start_scheduler(mode["flags"], work / f"{name}.log")
            procs.append(proc)
            mode["pid"] = proc.pid
            mode["client"] = GrpcScheduler(f"127.0.0.1:{port}", 5.0, 0.05, session_address=f"127.0.0.1:{session}",
                                           security=mode["security"])  # fmt: skip
            mode["rtt"], mode["client_ns"], mode["server_ns"] = [], 0, 0
        seq = 0

        async def run(mode: dict[str, Any], n: int, record: bool) -> None:
            nonlocal seq
            client: GrpcScheduler = mode["client"]
            client_before, server_before = cpu_ns(), cpu_ns(mode["pid"])
            for _ in range(n):
                seq += 1
                request = scheduler_pb2.ScheduleRequest(request_id=f"r{seq}", model="m", prompt_tokens=100)
                t0 = time.perf_counter_ns()
                await client.schedule(request)
                t1 = time.perf_counter_ns()
                client.release(request.request_id, scheduler_pb2.RELEASE_REASON_FINISHED)
                if record:
                    mode["rtt"].append(t1 - t0)
                await asyncio.sleep(0)  # the release goes out before the next schedule
            if record:
                mode["client_ns"] += cpu_ns() - client_before
                mode["server_ns"] += cpu_ns(mode["pid"]) - server_before

        for mode in modes.values():
            await run(mode, args.warmup, record=False)  # connect, handshake, warm caches
        block = args.requests // args.blocks
        for i in range(args.blocks):
            order = list(modes.values()) if i % 2 == 0 else list(reversed(modes.values()))
            for mode in order:
                await run(mode, block, record=True)
        for mode in modes.values():
            await mode["client"].close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)

    out: dict[str, Any] = {"requests_per_mode": block * args.blocks, "blocks": args.blocks}
    for name, mode in modes.items():
        rtt = sorted(mode["rtt"])
        n = len(rtt)
        out[name] = {
            "schedule_rtt_p50_us": statistics.median(rtt) / 1000,
            "schedule_rtt_p99_us": rtt[min(n - 1, int(n * 0.99))] / 1000,
            "client_cpu_us_per_request": mode["client_ns"] / n / 1000,
            "scheduler_cpu_us_per_request": mode["server_ns"] / n / 1000,
        }
    p, t = out["plaintext"], out["tls"]
    out["tls_added"] = {key: t[key] - p[key] for key in p}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="measured Schedules per mode")
    parser.add_argument("--blocks", type=int, default=4, help="interleaved blocks per mode")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured Schedules per mode first")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    try:
        import uvloop

        result = uvloop.run(measure(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(measure(args))
    print(f"Session socket, {result['requests_per_mode']} Schedule+Release per mode, {args.blocks} interleaved blocks")
    print(f"{'':<12}{'p50 us':>10}{'p99 us':>10}{'client CPU us/req':>20}{'scheduler CPU us/req':>23}")
    for name in ("plaintext", "tls", "tls_added"):
        r = result[name]
        print(f"{name:<12}{r['schedule_rtt_p50_us']:>10.1f}{r['schedule_rtt_p99_us']:>10.1f}"
              f"{r['client_cpu_us_per_request']:>20.1f}{r['scheduler_cpu_us_per_request']:>23.1f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
