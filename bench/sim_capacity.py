"""`pilotfish bench sim-capacity`: is the HTTP simulator ever the bottleneck of a fleet?

One process serves `--engines` simulated engines (uvloop, as `sim serve`); this process drives
`--streams` concurrent streaming completions at each engine, closed loop, for `--duration`
seconds. Per request it compares the client's TTFT (request written -> first SSE event read)
with the engine's own TTFT (request added -> first token's step end, on the engine's clock).
The difference is what the HTTP driver adds: parsing, the step loop waking late, SSE writes, the
socket. Goal: p99 gap <= 5 ms at 16 engines x 32 streams. The client is a minimal raw-socket
HTTP/1.1 client so that it, not the simulator, is the lighter side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_P99_GAP_MS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=16, help="simulated engines in the one server process")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams per engine")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load after warm-up")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load not measured")
    parser.add_argument("--prompt-words", type=int, default=256,
                        help="mean prompt length (one token per word), drawn from 0.5x to 1.5x")
    parser.add_argument("--output-tokens", type=int, default=64, help="mean max_tokens, drawn from 0.5x to 1.5x")
    parser.add_argument("--profile", default="llama3-8b-a100", help="step-time profile of the engines")


class _Stream(asyncio.Protocol):
    """One keep-alive connection; finds the first SSE event and the end of each response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.first: asyncio.Future[float] | None = None
        self.done: asyncio.Future[float] | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes) -> tuple[asyncio.Future[float], asyncio.Future[float]]:
        loop = asyncio.get_running_loop()
        self.first, self.done, self._tail = loop.create_future(), loop.create_future(), b""
        assert self.transport is not None
        self.transport.write(data)
        return self.first, self.done

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        seen = self._tail + data
        if self.first is not None and not self.first.done() and b"data: " in seen:
            self.first.set_result(now)
        if self.done is not None and not self.done.done() and b"0\r\n\r\n" in seen and b"[DONE]" in seen:
            self.done.set_result(now)
        self._tail = seen[-64:] if not (self.done and self.done.done()) else b""

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.first, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("server closed the connection"))


def _request_bytes(port: int, rid: str, prompt: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": "pilotfish-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _drive(urls: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """rid -> [sent, first event, done]; requests sent in the warm-up are tagged and dropped later."""
    loop = asyncio.get_running_loop()
    results: dict[str, list[float]] = {}
    deadline = time.monotonic() + args.warmup + args.duration
    measure_from = time.monotonic() + args.warmup
    rng = random.Random(0)
    tokens = [0]
    words = [" " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
             for _ in range(2048)]

    async def worker(engine: int, stream: int) -> None:
        port = int(urls[engine].rsplit(":", 1)[1])
        _, proto = await loop.create_connection(_Stream, "127.0.0.1", port)
        n = 0
        await asyncio.sleep(rng.random() * 0.5)  # stagger, so streams do not march in lockstep
        while time.monotonic() < deadline:
            rid = f"e{engine}s{stream}n{n}"
            n += 1
            # lengths vary (0.5x to 1.5x), or the streams of an engine finish together and
            # resubmit as one burst for the whole run
            prompt = "".join(rng.choice(words) for _ in range(rng.randint(args.prompt_words // 2,
                                                                         args.prompt_words * 3 // 2)))
            max_tokens = rng.randint(max(1, args.output_tokens // 2), args.output_tokens * 3 // 2)
            data = _request_bytes(port, rid, prompt, max_tokens)
            tokens[0] += max_tokens
            sent = time.monotonic()
            first, done = proto.send(data)
            t_first = await first
            t_done = await done
            if sent >= measure_from:
                results[rid] = [sent, t_first, t_done, max_tokens]
        assert proto.transport is not None
        proto.transport.close()

    await asyncio.gather(*(worker(e, s) for e in range(len(urls)) for s in range(args.streams)))
    return results


def _pct(values: list[float], q: float) -> float:
    from pilotfish.simulator.cluster.metrics import percentile

    return percentile(values, q)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from pilotfish.bench.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        timings_path = Path(tmp) / "timings.json"
        server = subprocess.Popen(
            [sys.executable, "-m", "pilotfish.bench.sim_capacity_server", "--engines", str(args.engines),
             "--profile", args.profile, "--timings", str(timings_path),
             # diagnosis: PILOTFISH_SIM_CPROFILE=FILE profiles the server
             *(["--cprofile", os.environ["PILOTFISH_SIM_CPROFILE"]] if os.environ.get("PILOTFISH_SIM_CPROFILE")
               else [])],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the simulator server exited before listening")
            urls = json.loads(line)["urls"]
            client_cpu0 = os.times()
            client = uvloop.run(_drive(urls, args))
            client_cpu1 = os.times()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        engine = json.loads(timings_path.read_text())

    gaps, client_ttft, engine_ttft = [], [], []
    for rid, (sent, first, _done, _tokens) in client.items():
        arrival, first_token = engine["requests"].get(rid, (None, -1.0))
        if arrival is None or first_token < 0:
            continue
        e = first_token - arrival
        c = first - sent
        engine_ttft.append(e)
        client_ttft.append(c)
        gaps.append(c - e)
    lag = engine["loop_lag"]
    ms = 1000.0
    result: dict[str, Any] = {
        "engines": args.engines, "streams_per_engine": args.streams, "duration_s": args.duration,
        "prompt_words": args.prompt_words, "output_tokens": args.output_tokens, "profile": args.profile,
        "requests_measured": len(gaps),
        "output_tokens_per_s": sum(r[3] for r in client.values()) / args.duration,
        "gap_ms": {q: _pct(gaps, p) * ms for q, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        "client_ttft_ms": {q: _pct(client_ttft, p) * ms for q, p in (("p50", 50), ("p99", 99))},
        "engine_ttft_ms": {q: _pct(engine_ttft, p) * ms for q, p in (("p50", 50), ("p99", 99))},
        "server_loop_lag_ms": {q: _pct(lag, p) * ms for q, p in (("p50", 50), ("p99", 99), ("max", 100))},
        "server_gc_pause_ms": {q: _pct(engine["gc_pauses"], p) * ms for q, p in (("p99", 99), ("max", 100))},
        "server_gc_collections": len(engine["gc_pauses"]),
        "server_cpu_fraction": engine["cpu_seconds"] / (args.warmup + args.duration),
        "client_cpu_fraction": ((client_cpu1.user + client_cpu1.system) - (client_cpu0.user + client_cpu0.system))
        / (args.warmup + args.duration),
        "goal_p99_gap_ms": GOAL_P99_GAP_MS,
    }
    result["goal_met"] = result["gap_ms"]["p99"] <= GOAL_P99_GAP_MS
    g = result["gap_ms"]
    md = [
        "# Simulator capacity over HTTP",
        "",
        f"{args.engines} engines x {args.streams} concurrent streams in one process, profile `{args.profile}`, "
        f"prompt {args.prompt_words} words and {args.output_tokens} output tokens on average, "
        f"{args.duration:g} s measured.",
        "",
        "| figure | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|",
        f"| client TTFT - engine TTFT (ms) | {g['p50']:.2f} | {g['p90']:.2f} | {g['p99']:.2f} | {g['max']:.2f} |",
        f"| server loop lag (ms) | {result['server_loop_lag_ms']['p50']:.2f} | | "
        f"{result['server_loop_lag_ms']['p99']:.2f} | {result['server_loop_lag_ms']['max']:.2f} |",
        f"| server GC pause (ms, {result['server_gc_collections']} collections) | | | "
        f"{result['server_gc_pause_ms']['p99']:.2f} | {result['server_gc_pause_ms']['max']:.2f} |",
        "",
        f"Requests measured: {len(gaps)}; output tokens/s: {result['output_tokens_per_s']:.0f}; "
        f"server CPU {result['server_cpu_fraction']:.0%} of a core, client {result['client_cpu_fraction']:.0%}.",
        f"Engine TTFT p50 {result['engine_ttft_ms']['p50']:.1f} ms, client TTFT p50 "
        f"{result['client_ttft_ms']['p50']:.1f} ms.",
        "",
        f"Goal p99 gap <= {GOAL_P99_GAP_MS:g} ms: **{'met' if result['goal_met'] else 'missed'}**.",
    ]
    write_report(args.out, "sim-capacity", result, "\n".join(md))
    print("\n".join(md))
    return 0
