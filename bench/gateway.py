"""`pilotfish bench gateway`: what the ext_proc hop costs, side by side with Envoy alone.

All arms run in one process tree at once and are measured in interleaved rounds, so machine
noise hits them alike; figures are reported as differences and ratios against Envoy alone.

- latency: sequential small non-streaming completions through each arm (p50/p99, and what
  the ext_proc adds over Envoy alone);
- throughput: a fixed concurrency for a fixed time, with the CPU time each ext_proc process
  used, which gives its capacity in requests/s per core independent of what else shares the
  machine; and the scale-out with 1..--ext-procs ext_procs behind the same Envoy;
- request body mode: BUFFERED (the sidecar's default) against FULL_DUPLEX_STREAMED with the
  headers reply held back until the body is complete, in the latency and throughput phases, the
  ext_proc messages each takes per request (Envoy's own counters), and what a client gets
  while no ext_proc answers at all;
- streaming: the delay the ext_proc adds to each SSE event (STREAMED response bodies make
  Envoy wait for the ext_proc's reply to every chunk).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotfish.procs import cpu_seconds

MODEL = "bench-sim"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per arm per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all arms")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight in the throughput phase")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each throughput run")
    parser.add_argument("--streams", type=int, default=20, help="streams per arm per round in the streaming phase")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument(
        "--ext-procs", type=int, default=3, help="scale-out: measure 1 up to this many ext_procs behind one Envoy"
    )
    parser.add_argument(
        "--down-requests", type=int, default=50, help="requests sent per body mode while no ext_proc answers"
    )
    parser.add_argument(
        "--vllm-router",
        default="",
        metavar="PATH",
        help="a vllm-router executable (pip install vllm-router) to measure beside Envoy as a peer arm",
    )


FULL_DUPLEX_ARM = "envoy+ext_proc, colocated, FULL_DUPLEX_STREAMED"
COLOCATED_ARM = "envoy+ext_proc, colocated scheduler"
UNARY_ARM = "envoy+ext_proc, remote scheduler, unary calls (no Session)"
GRPC_SESSION_ARM = "envoy+ext_proc, remote scheduler, gRPC Session stream"


@dataclass
class Arm:
    name: str
    port: int
    ext_proc_pids: list[int] = field(default_factory=list)
    admin_url: str = ""  # Envoy's admin, for its ext_proc message counters
    scheduler_pid: int = 0  # the remote scheduler these ext_procs call, for its CPU per request


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pilotfish.bench.report import write_report
    from pilotfish.procs import ChildGroup

    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-gateway-") as tmp:
        try:
            arms, streaming_arms, down_arms = _start(Path(tmp), group, args.vllm_router, args.ext_procs)
            print("stack up; measuring", file=sys.stderr)
            result = asyncio.run(_measure(args, arms, streaming_arms, down_arms))
        finally:
            group.stop_all()
    write_report(args.out, "gateway", result, _markdown(result))
    print(_markdown(result))
    return 0


def _scale_arm(n: int) -> str:
    return f"envoy+{n} ext_proc{'s' if n > 1 else ''}, remote scheduler"


def _start(
    tmp: Path, group: Any, vllm_router: str, ext_procs: int
) -> tuple[dict[str, Arm], dict[str, Arm], dict[str, Arm]]:
    from pilotfish.envoy_bootstrap import REQUEST_BODY_MODES, render_plain_proxy, render_sidecar
    from pilotfish.procs import free_port
    from pilotfish.services import start_envoy

    py = [sys.executable, "-m", "pilotfish"]
    fast, paced = free_port(), free_port()
    # fast: answers as soon as the loop turns; paced: a 5 ms decode step, for per-event timing
    fast_engine = group.start(
        "engine-fast",
        [
            *py,
            "sim",
            "serve",
            "--ports",
            str(fast),
            "--model",
            MODEL,
            "--engine-id-prefix",
            "fast",
            "--step-ms",
            "0.05",
            "--prefill-ms-per-token",
            "0",
            "--decode-ms-per-token",
            "0",
        ],
        log_path=tmp / "fast.log",
    )
    paced_engine = group.start(
        "engine-paced",
        [
            *py,
            "sim",
            "serve",
            "--ports",
            str(paced),
            "--model",
            MODEL,
            "--engine-id-prefix",
            "paced",
            "--step-ms",
            "5",
            "--prefill-ms-per-token",
            "0",
            "--decode-ms-per-token",
            "0",
        ],
        log_path=tmp / "paced.log",
    )
    fast_engine.wait_port(fast)
    paced_engine.wait_port(paced)

    sched_port, session_port = free_port(), free_port()
    scheduler = group.start(
        "scheduler",
        [*py, "scheduler", "--port", str(sched_port), "--session-port", str(session_port),
         "--instances", f"fast=127.0.0.1:{fast}", "--model", MODEL],
        log_path=tmp / "scheduler.log",
    )
    scheduler.wait_port(sched_port)
    scheduler.wait_port(session_port)
    on_socket = ("--scheduler-session-address", f"127.0.0.1:{session_port}")  # what `pilotfish up` runs

    def ext_proc(name: str, instances: str, with_scheduler: bool, *extra: str) -> tuple[int, int]:
        port = free_port()
        child = group.start(
            name,
            [
                *py,
                "ext-proc",
                "--port",
                str(port),
                "--instances",
                instances,
                "--model",
                MODEL,
                "--scheduler-address",
                f"127.0.0.1:{sched_port}" if with_scheduler else "",
                *extra,
            ],
            log_path=tmp / f"{name}.log",
        )
        child.wait_port(port)
        return port, child.pid

    scale = [
        ext_proc(f"ext_proc-{i + 1}", f"fast=127.0.0.1:{fast}", True, *on_socket) for i in range(max(ext_procs, 1))
    ]
    xp1 = scale[0]
    xp_rr = ext_proc("ext_proc-rr", f"fast=127.0.0.1:{fast}", False)
    xp_grpc = ext_proc("ext_proc-grpc-session", f"fast=127.0.0.1:{fast}", True)
    xp_unary = ext_proc("ext_proc-unary", f"fast=127.0.0.1:{fast}", True, "--no-scheduler-session")
    xp_colo = ext_proc("ext_proc-colocated", f"fast=127.0.0.1:{fast}", False, "--colocated-scheduling")
    xp_fd = ext_proc("ext_proc-full-duplex", f"fast=127.0.0.1:{fast}", False, "--colocated-scheduling")
    xp_paced = ext_proc("ext_proc-paced", f"paced=127.0.0.1:{paced}", False)

    def envoy(name: str, ext_proc_ports: list[int], upstream: int, body_mode: str = "BUFFERED") -> tuple[int, str]:
        listen = free_port()
        yaml_text = render_sidecar(
            listen_port=listen,
            admin_port=free_port(),
            ext_proc_ports=ext_proc_ports,
            default_endpoints=[("127.0.0.1", upstream)],
            request_body_mode=body_mode,
        )
        if not ext_proc_ports:
            yaml_text = render_plain_proxy(yaml_text)
        # one worker thread each: the same share of the machine for every arm
        service = start_envoy(yaml_text, tmp / name, extra_args=["--concurrency", "1"])
        assert service.child is not None
        group.children.append(service.child)
        service.child.wait_port(listen)
        return listen, service.url

    def arm(
        name: str, envoy_name: str, xps: list[tuple[int, int]], body_mode: str = "BUFFERED", remote: bool = False
    ) -> Arm:
        port, admin = envoy(envoy_name, [p for p, _ in xps], fast, body_mode)
        return Arm(name, port, [pid for _, pid in xps], admin, scheduler.pid if remote else 0)

    arms = {
        "envoy": arm("envoy", "envoy-plain", []),
        "envoy+ext_proc": arm("envoy+ext_proc", "envoy-xp1", [xp1], remote=True),
        GRPC_SESSION_ARM: arm(GRPC_SESSION_ARM, "envoy-grpc-session", [xp_grpc], remote=True),
        UNARY_ARM: arm(UNARY_ARM, "envoy-unary", [xp_unary], remote=True),
        "envoy+ext_proc, no scheduler": arm("envoy+ext_proc, no scheduler", "envoy-rr", [xp_rr]),
        COLOCATED_ARM: arm(COLOCATED_ARM, "envoy-colo", [xp_colo]),
        FULL_DUPLEX_ARM: arm(FULL_DUPLEX_ARM, "envoy-fd", [xp_fd], "FULL_DUPLEX_STREAMED"),
    }
    for n in range(2, len(scale) + 1):
        arms[_scale_arm(n)] = arm(_scale_arm(n), f"envoy-xp{n}", scale[:n], remote=True)
    # No ext_proc listens on `dead`: what a client gets when the ext_proc is gone, per body mode.
    dead = free_port()
    down = {mode: Arm(mode, envoy(f"envoy-down-{mode}", [dead], fast, mode)[0]) for mode in REQUEST_BODY_MODES}
    if vllm_router:
        port = free_port()
        router = group.start(
            "vllm-router",
            [
                vllm_router,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                f"http://127.0.0.1:{fast}",
                "--policy",
                "round_robin",
                "--log-level",
                "warning",
            ],
            log_path=tmp / "vllm-router.log",
        )
        router.wait_port(port, 60)
        arms["vllm-router (round_robin)"] = Arm("vllm-router (round_robin)", port)
    streaming = {
        "envoy": Arm("envoy", envoy("envoy-plain-paced", [], paced)[0]),
        "envoy+ext_proc": Arm("envoy+ext_proc", envoy("envoy-xp-paced", [xp_paced[0]], paced)[0], [xp_paced[1]]),
    }
    return arms, streaming, down


async def _measure(
    args: argparse.Namespace, arms: dict[str, Arm], streaming: dict[str, Arm], down: dict[str, Arm]
) -> dict[str, Any]:
    import resource

    import aiohttp

    from pilotfish.stats import percentile

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    latency_arms = ["envoy", "envoy+ext_proc", GRPC_SESSION_ARM, UNARY_ARM, COLOCATED_ARM, FULL_DUPLEX_ARM]
    latency_arms.append("envoy+ext_proc, no scheduler")
    latency_arms += [name for name in arms if name.startswith("vllm-router")]
    latencies: dict[str, list[float]] = {a: [] for a in latency_arms}
    round_p50: dict[str, list[float]] = {a: [] for a in latency_arms}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # warm every path (connections, Envoy's ORIGINAL_DST hosts, ext_proc streams)
        for arm in arms.values():
            for _ in range(20):
                await _one(session, arm.port, body)
        for _ in range(args.rounds):
            for name in latency_arms:
                samples = [await _one(session, arms[name].port, body) for _ in range(args.requests)]
                latencies[name] += samples
                round_p50[name].append(percentile(samples, 50))

        throughput: dict[str, dict[str, float]] = {}
        scale_arms = ["envoy+ext_proc"] + [_scale_arm(n) for n in range(2, args.ext_procs + 1)]
        for name in ["envoy", COLOCATED_ARM, FULL_DUPLEX_ARM, *scale_arms, GRPC_SESSION_ARM, UNARY_ARM]:
            arm = arms[name]
            msgs_before = await _ext_proc_messages(session, arm.admin_url)
            cpu_before = sum(cpu_seconds(p) for p in arm.ext_proc_pids)
            sched_before = cpu_seconds(arm.scheduler_pid) if arm.scheduler_pid else 0.0
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            done, elapsed = await _saturate(session, arm.port, body, args.concurrency, args.seconds)
            client_after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = sum(cpu_seconds(p) for p in arm.ext_proc_pids) - cpu_before
            client_cpu = sum(getattr(client_after, f) - getattr(client_before, f) for f in ("ru_utime", "ru_stime"))
            entry = {
                "requests": done,
                "seconds": elapsed,
                "req_per_s": done / elapsed,
                "client_cpu_share": client_cpu / elapsed,
            }
            if arm.ext_proc_pids:
                entry["ext_proc_processes"] = len(arm.ext_proc_pids)
                entry["ext_proc_cpu_us_per_request"] = cpu / done * 1e6
                entry["ext_proc_capacity_req_per_s_per_core"] = done / cpu if cpu else float("inf")
                if arm.scheduler_pid:
                    sched_cpu = cpu_seconds(arm.scheduler_pid) - sched_before
                    entry["scheduler_cpu_us_per_request"] = sched_cpu / done * 1e6
                msgs_after = await _ext_proc_messages(session, arm.admin_url)
                # Envoy's counters: ext_proc messages it sent and took back, per HTTP request
                entry["messages_to_ext_proc_per_request"] = (msgs_after[0] - msgs_before[0]) / done
                entry["messages_from_ext_proc_per_request"] = (msgs_after[1] - msgs_before[1]) / done
            throughput[name] = entry

        # With nothing listening where the ext_proc should be: BUFFERED falls back (failure_mode_allow, then
        # the route-level default destination); FULL_DUPLEX_STREAMED turns failure_mode_allow off once
        # body bytes have gone to the ext_proc, so the client gets Envoy's 500.
        ext_proc_down: dict[str, dict[str, int]] = {}
        for mode, arm in down.items():
            statuses: dict[str, int] = {}
            for _ in range(args.down_requests):
                status = str(await _status(session, arm.port, body))
                statuses[status] = statuses.get(status, 0) + 1
            ext_proc_down[mode] = statuses

        stream_gaps: dict[str, list[float]] = {a: [] for a in streaming}
        stream_ttft: dict[str, list[float]] = {a: [] for a in streaming}
        sbody = {"model": MODEL, "prompt": "hi", "max_tokens": args.stream_tokens, "stream": True}
        for _ in range(args.rounds):
            for name, arm in streaming.items():
                for _ in range(args.streams):
                    ttft, gaps = await _stream(session, arm.port, sbody)
                    stream_ttft[name].append(ttft)
                    stream_gaps[name] += gaps

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "p50_ms": percentile(values, 50) * 1e3,
            "p99_ms": percentile(values, 99) * 1e3,
            "mean_ms": sum(values) / len(values) * 1e3,
        }

    base = summary(latencies["envoy"])
    latency = {}
    for name in latency_arms:
        s = summary(latencies[name])
        s["added_p50_ms"] = s["p50_ms"] - base["p50_ms"]
        s["added_p99_ms"] = s["p99_ms"] - base["p99_ms"]
        s["round_p50_ms"] = [v * 1e3 for v in round_p50[name]]
        latency[name] = s
    gap = {name: summary(values) for name, values in stream_gaps.items()}
    ttft = {name: summary(values) for name, values in stream_ttft.items()}
    return {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "settings": vars(args) | {"out": str(args.out)},
        "latency": latency,
        "throughput": throughput,
        "scale_out": scale_arms,
        "ext_proc_down": ext_proc_down,
        "streaming": {
            "inter_event_gap": gap,
            "ttft": ttft,
            "added_per_event_ms": gap["envoy+ext_proc"]["mean_ms"] - gap["envoy"]["mean_ms"],
        },
    }


async def _one(session: Any, port: int, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"port {port}: HTTP {resp.status}")
    return time.perf_counter() - start


async def _status(session: Any, port: int, body: dict[str, Any]) -> int:
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        await resp.read()
        return int(resp.status)


async def _ext_proc_messages(session: Any, admin_url: str) -> tuple[int, int]:
    """Envoy's ext_proc counters: messages sent to and received from the ext_proc so far."""
    if not admin_url:
        return 0, 0
    async with session.get(f"{admin_url}/stats?filter=ext_proc.stream_msgs") as resp:
        text = await resp.text()
    counts = dict(line.rsplit(": ", 1) for line in text.splitlines() if ": " in line)
    sent = sum(int(v) for k, v in counts.items() if k.endswith("stream_msgs_sent"))
    received = sum(int(v) for k, v in counts.items() if k.endswith("stream_msgs_received"))
    return sent, received


async def _saturate(
    session: Any, port: int, body: dict[str, Any], concurrency: int, seconds: float
) -> tuple[int, float]:
    import asyncio

    deadline = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await _one(session, port, body)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.perf_counter() - start


async def _stream(session: Any, port: int, body: dict[str, Any]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    stamps: list[float] = []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, gaps


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Gateway benchmark: Envoy alone vs Envoy + Pilotfish ext_proc",
        "",
        f"Machine: {r['machine']['cpus']} CPUs, 1-min load {r['machine']['load_avg_1m']:.2f} at the end. "
        "Every process (client, Envoys, ext_procs, scheduler, engines) shares these cores; each Envoy runs one "
        "worker thread.",
        "",
        "`envoy+ext_proc` is what `pilotfish up` runs: a remote scheduler process, reached on its plain Session "
        "socket (`--session-port` / `--scheduler-session-address`). The gRPC Session stream and unary calls are "
        "measured beside it.",
        "",
        "## Latency (sequential small completions)",
        "",
        "| arm | p50 ms | p99 ms | added p50 ms | added p99 ms | per-round p50 ms |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, s in r["latency"].items():
        rounds = ", ".join(f"{v:.2f}" for v in s["round_p50_ms"])
        lines.append(
            f"| {name} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['added_p50_ms']:+.2f} | "
            f"{s['added_p99_ms']:+.2f} | {rounds} |"
        )
    lines += [
        "",
        "## Throughput",
        "",
        "| arm | req/s | ext_proc CPU µs/request | capacity req/s per core | scheduler CPU µs/request "
        "| messages to / from ext_proc |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, t in r["throughput"].items():
        cpu = t.get("ext_proc_cpu_us_per_request")
        cap = t.get("ext_proc_capacity_req_per_s_per_core")
        sched = t.get("scheduler_cpu_us_per_request")
        sched_text = f"{sched:.0f}" if sched is not None else "-"
        msgs = (
            f"{t['messages_to_ext_proc_per_request']:.2f} / {t['messages_from_ext_proc_per_request']:.2f}"
            if cpu
            else "-"
        )
        lines.append(
            f"| {name} | {t['req_per_s']:.0f} | {cpu:.0f} | {cap:.0f} | {sched_text} | {msgs} |"
            if cpu
            else f"| {name} | {t['req_per_s']:.0f} | - | - | - | - |"
        )
    base_rps = r["throughput"][r["scale_out"][0]]["req_per_s"]
    lines += [
        "",
        "## Scale-out (remote scheduler)",
        "",
        "| ext_procs | req/s | vs one | ext_proc CPU µs/request |",
        "|---:|---:|---:|---:|",
    ]
    for name in r["scale_out"]:
        t = r["throughput"][name]
        lines.append(
            f"| {t['ext_proc_processes']} | {t['req_per_s']:.0f} | {t['req_per_s'] / base_rps:.2f}x | "
            f"{t['ext_proc_cpu_us_per_request']:.0f} |"
        )
    lines += ["", "## No ext_proc answering", "", "| request body mode | client statuses |", "|---|---|"]
    for mode, statuses in r["ext_proc_down"].items():
        lines.append(f"| {mode} | {', '.join(f'{n} x {code}' for code, n in sorted(statuses.items()))} |")
    st = r["streaming"]
    lines += [
        "",
        "## Streaming (5 ms decode step)",
        "",
        "| arm | mean gap between SSE events ms | p99 gap ms | TTFT p50 ms |",
        "|---|---:|---:|---:|",
    ]
    for name, g in st["inter_event_gap"].items():
        lines.append(f"| {name} | {g['mean_ms']:.3f} | {g['p99_ms']:.3f} | {st['ttft'][name]['p50_ms']:.2f} |")
    lines += ["", f"Added delay per SSE event: {st['added_per_event_ms']:+.3f} ms (mean gap difference)."]
    return "\n".join(lines)
