"""`pilotfish bench sim-capacity`: is the HTTP simulator ever the bottleneck of a fleet?

One process serves `--engines` simulated engines (uvloop, as `sim serve`); `--clients` processes
drive `--streams` concurrent streaming completions at each engine, closed loop, for `--duration`
seconds. Per request it compares the client's TTFT (request written -> first SSE event read)
with the engine's own TTFT (request added -> first token's step end, on the engine's clock).
Goal: p99 gap <= 5 ms at 16 engines x 32 streams.

Client and server share the machine's cores, so a busy client would inflate the gap without the
simulator being at fault. Every process stamps on the one system-wide monotonic clock, which
splits the gap into the server's part (request written -> engine arrival, plus first token's step
end -> its bytes handed to the socket) and the client's part (bytes handed to the socket -> client
read them). Each side's CPU and event-loop lag are reported too. The client is a raw-socket
HTTP/1.1 client that looks only for the first event and the end of each response.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import Profile

GOAL_P99_GAP_MS = 5.0
_FIRST, _DONE, _EOF = b"data: ", b"[DONE]", b"0\r\n\r\n"


class SimCapacityConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every knob of `bench sim-capacity`, with its default (the flags and bench/README.md's table come from it)."""

    engines: Annotated[int, Meta(ge=1, description="simulated engines in the one server process")] = 16
    streams: Annotated[int, Meta(ge=1, description="concurrent streams per engine")] = 32
    clients: Annotated[int, Meta(ge=1, description="client processes the streams are spread over")] = 1
    duration: Annotated[float, Meta(gt=0, description="seconds of load after warm-up")] = 20.0
    warmup: Annotated[float, Meta(ge=0, description="seconds of load not measured")] = 3.0
    prompt_words: Annotated[
        int, Meta(ge=2, description="mean prompt length (one token per word), drawn from 0.5x to 1.5x")
    ] = 256
    output_tokens: Annotated[int, Meta(ge=1, description="mean max_tokens, drawn from 0.5x to 1.5x")] = 64
    profile: Profile = "llama3-8b-a100"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, SimCapacityConfig)


class _Stream(asyncio.Protocol):
    """One keep-alive connection; finds the first SSE event and the end of each response.

    Three phases, each one substring search over the new bytes (and a few kept from the last
    read, in case a marker straddles two reads): the first event, `[DONE]`, the last chunk."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.first: asyncio.Future[float] | None = None
        self.done: asyncio.Future[float] | None = None
        self._phase = 3
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes) -> tuple[asyncio.Future[float], asyncio.Future[float]]:
        loop = asyncio.get_running_loop()
        self.first, self.done, self._tail, self._phase = loop.create_future(), loop.create_future(), b"", 0
        assert self.transport is not None
        self.transport.write(data)
        return self.first, self.done

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase == 3:
            return
        seen = self._tail + data if self._tail else data
        if phase == 0 and _FIRST in seen:
            self.first.set_result(time.monotonic())  # type: ignore[union-attr]
            phase = 1
        if phase == 1 and _DONE in seen:
            phase = 2
            seen = seen[seen.index(_DONE) :]
        if phase == 2 and _EOF in seen:
            self.done.set_result(time.monotonic())  # type: ignore[union-attr]
            phase = 3
        self._phase = phase
        self._tail = seen[-8:]

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.first, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("server closed the connection"))


def _request_bytes(port: int, rid: str, prompt: str, max_tokens: int) -> bytes:
    body = json.dumps(
        {"model": "pilotfish-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _drive(ports: list[int], streams: list[tuple[int, int]], p: dict[str, Any]) -> dict[str, list[float]]:
    """rid -> [sent, first event, done, max_tokens] for the requests sent after the warm-up."""
    loop = asyncio.get_running_loop()
    results: dict[str, list[float]] = {}
    rng = random.Random(p["seed"])
    words = [
        " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) for _ in range(2048)
    ]

    async def worker(engine: int, stream: int) -> None:
        port = ports[engine]
        _, proto = await loop.create_connection(_Stream, "127.0.0.1", port)
        n = 0
        await asyncio.sleep(rng.random() * 0.5)  # stagger, so streams do not march in lockstep
        while time.monotonic() < p["deadline"]:
            rid = f"e{engine}s{stream}n{n}"
            n += 1
            # lengths vary (0.5x to 1.5x), or the streams of an engine finish together and
            # resubmit as one burst for the whole run
            prompt = "".join(
                rng.choice(words) for _ in range(rng.randint(p["prompt_words"] // 2, p["prompt_words"] * 3 // 2))
            )
            max_tokens = rng.randint(max(1, p["output_tokens"] // 2), p["output_tokens"] * 3 // 2)
            data = _request_bytes(port, rid, prompt, max_tokens)
            sent = time.monotonic()
            first, done = proto.send(data)
            t_first = await first
            t_done = await done
            if sent >= p["measure_from"]:
                results[rid] = [sent, t_first, t_done, max_tokens]
        assert proto.transport is not None
        proto.transport.close()

    await asyncio.gather(*(worker(e, s) for e, s in streams))
    return results


def _client_process(ports: list[int], streams: list[tuple[int, int]], p: dict[str, Any], out: Any) -> None:
    """One client process: its share of the streams, its own CPU and loop lag, sent back on `out`."""
    import uvloop

    from pilotfish.bench.sim_capacity_server import lag_probe, run_delay

    async def main() -> dict[str, Any]:
        lag: list[tuple[float, float]] = []
        probe = asyncio.get_running_loop().create_task(lag_probe(lag))
        results = await _drive(ports, streams, p)
        probe.cancel()
        return {"results": results, "lag": lag}

    cpu0, waited0 = os.times(), run_delay()
    got = uvloop.run(main())
    cpu1, waited1 = os.times(), run_delay()
    got["cpu_seconds"] = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    got["run_queue_wait_seconds"] = waited1 - waited0
    out.send(got)
    out.close()


def _run_clients(urls: list[str], cfg: SimCapacityConfig) -> list[dict[str, Any]]:
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    streams = [(e, s) for e in range(len(urls)) for s in range(cfg.streams)]
    now = time.monotonic()
    # fork: the children need no imports again, and this process has no loop or thread to copy
    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    for i in range(cfg.clients):
        params = {
            "seed": i,
            "measure_from": now + cfg.warmup,
            "deadline": now + cfg.warmup + cfg.duration,
            "prompt_words": cfg.prompt_words,
            "output_tokens": cfg.output_tokens,
        }
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_process, args=(ports, streams[i :: cfg.clients], params, send))
        proc.start()
        send.close()
        procs.append(proc)
        pipes.append(recv)
    got = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    return got


def _pct(values: list[float], q: float) -> float:
    from pilotfish.simulator.cluster.metrics import percentile

    return percentile(values, q)


def _dist(values: list[float], qs: tuple[int, ...] = (50, 90, 99, 100)) -> dict[str, float]:
    return {("max" if q == 100 else f"p{q}"): _pct(values, q) * 1000.0 for q in qs}


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(SimCapacityConfig, args)
    result = summarise(cfg, *measure(cfg))
    write_report(args.out, "sim-capacity", result, _markdown(result))
    print(_markdown(result))
    return 0


def measure(cfg: SimCapacityConfig) -> tuple[dict[str, Any], list[dict[str, Any]], list[float]]:
    """Start the server (`sim_capacity_server`), drive it from the client processes, stop it: the
    server's timings, each client's, and the 1-minute load average before and after."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        timings_path = Path(tmp) / "timings.json"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pilotfish.bench.sim_capacity_server",
                "--engines",
                str(cfg.engines),
                "--profile",
                cfg.profile,
                "--timings",
                str(timings_path),
                # diagnosis: PILOTFISH_SIM_CPROFILE=FILE profiles the server
                *(
                    ["--cprofile", os.environ["PILOTFISH_SIM_CPROFILE"]]
                    if os.environ.get("PILOTFISH_SIM_CPROFILE")
                    else []
                ),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the simulator server exited before listening")
            clients = _run_clients(json.loads(line)["urls"], cfg)
            load_after = os.getloadavg()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        engine = json.loads(timings_path.read_text())
        if os.environ.get("PILOTFISH_SIM_TIMINGS"):  # diagnosis: keep the server's raw timings
            Path(os.environ["PILOTFISH_SIM_TIMINGS"]).write_text(timings_path.read_text())
    return engine, clients, [load_before[0], load_after[0]]


def summarise(
    cfg: SimCapacityConfig, engine: dict[str, Any], clients: list[dict[str, Any]], load_average: list[float]
) -> dict[str, Any]:
    """result.json: the gap and its parts per request matched on both sides, CPU, loop lag, GC pauses."""
    client: dict[str, list[float]] = {}
    for got in clients:
        client.update(got["results"])
    gaps, server_gaps, ingress, egress, delivery, client_ttft, engine_ttft = [], [], [], [], [], [], []
    for rid, (sent, first, _done, _tokens) in client.items():
        arrival, first_token, written = engine["requests"].get(rid, (None, -1.0, -1.0))
        if arrival is None or first_token < 0 or written < 0:
            continue
        engine_ttft.append(first_token - arrival)
        client_ttft.append(first - sent)
        gaps.append((first - sent) - (first_token - arrival))
        ingress.append(arrival - sent)
        egress.append(written - first_token)
        server_gaps.append((arrival - sent) + (written - first_token))
        delivery.append(first - written)
    span = cfg.warmup + cfg.duration
    client_cpu = sum(got["cpu_seconds"] for got in clients)
    client_lag = [lag for got in clients for lag, _ in got["lag"]]
    server_lag = [lag for lag, _ in engine["loop_lag"]]
    # the lag left once the time spent waiting for a CPU held by other processes is taken out
    server_own_lag = [max(0.0, lag - waited) for lag, waited in engine["loop_lag"]]
    gc_wall = {gen: [p[1] for p in engine["gc_pauses"] if p[0] == gen] for gen in (0, 1, 2)}
    gc_cpu = {gen: [p[2] for p in engine["gc_pauses"] if p[0] == gen] for gen in (0, 1, 2)}
    result: dict[str, Any] = {
        "engines": cfg.engines,
        "streams_per_engine": cfg.streams,
        "clients": cfg.clients,
        "duration_s": cfg.duration,
        "prompt_words": cfg.prompt_words,
        "output_tokens": cfg.output_tokens,
        "profile": cfg.profile,
        "settings": msgspec.structs.asdict(cfg),
        "requests_measured": len(gaps),
        "output_tokens_per_s": sum(r[3] for r in client.values()) / cfg.duration,
        "load_average_1m": load_average,
        "gap_ms": _dist(gaps),
        "server_gap_ms": _dist(server_gaps),
        "server_ingress_ms": _dist(ingress),
        "server_egress_ms": _dist(egress),
        "client_delivery_ms": _dist(delivery),
        "client_ttft_ms": _dist(client_ttft, (50, 99)),
        "engine_ttft_ms": _dist(engine_ttft, (50, 99)),
        "server_loop_lag_ms": _dist(server_lag),
        "server_loop_lag_less_run_queue_wait_ms": _dist(server_own_lag),
        "client_loop_lag_ms": _dist(client_lag),
        "server_gc_collections": {gen: len(gc_wall[gen]) for gen in (0, 1, 2)},
        "server_gc_pause_ms": {gen: _dist(gc_wall[gen], (50, 100)) for gen in (0, 1, 2)},
        "server_gc_cpu_ms": {gen: _dist(gc_cpu[gen], (50, 100)) for gen in (0, 1, 2)},
        "server_cpu_fraction": engine["cpu_seconds"] / span,
        "client_cpu_fraction": client_cpu / span,
        # runnable but without a CPU: the machine's other work, not this process's own
        "server_run_queue_wait_fraction": engine["run_queue_wait_seconds"] / span,
        "client_run_queue_wait_fraction": sum(got["run_queue_wait_seconds"] for got in clients) / span,
        # both over the whole run, warm-up included, as the CPU figures are
        "server_cpu_us_per_token": engine["cpu_seconds"] / max(1, engine["tokens"]) * 1e6,
        "client_cpu_us_per_token": client_cpu / max(1, engine["tokens"]) * 1e6,
        "goal_p99_gap_ms": GOAL_P99_GAP_MS,
    }
    result["goal_met"] = result["gap_ms"]["p99"] <= GOAL_P99_GAP_MS
    return result


def _markdown(r: dict[str, Any]) -> str:
    def row(name: str, d: dict[str, float]) -> str:
        return f"| {name} | " + " | ".join(f"{d[k]:.2f}" if k in d else "" for k in ("p50", "p90", "p99", "max")) + " |"

    return "\n".join(
        [
            "# Simulator capacity over HTTP",
            "",
            f"{r['engines']} engines x {r['streams_per_engine']} concurrent streams in one process, {r['clients']} "
            f"client process(es), profile `{r['profile']}`, prompt {r['prompt_words']} words and "
            f"{r['output_tokens']} output tokens on average, {r['duration_s']:g} s measured. Load average (1 min) "
            f"{r['load_average_1m'][0]:.2f} before, {r['load_average_1m'][1]:.2f} after.",
            "",
            "| figure (ms) | p50 | p90 | p99 | max |",
            "|---|---|---|---|---|",
            row("gap: client TTFT - engine TTFT", r["gap_ms"]),
            row("server's part: ingress + egress", r["server_gap_ms"]),
            row("ingress: request written -> engine arrival", r["server_ingress_ms"]),
            row("egress: first token's step end -> bytes to the socket", r["server_egress_ms"]),
            row("client's part: bytes to the socket -> client read", r["client_delivery_ms"]),
            row("server loop lag", r["server_loop_lag_ms"]),
            row("server loop lag less its wait for a CPU", r["server_loop_lag_less_run_queue_wait_ms"]),
            row("client loop lag", r["client_loop_lag_ms"]),
            *(
                row(
                    f"server gen-{gen} GC pause, wall ({r['server_gc_collections'][gen]})", r["server_gc_pause_ms"][gen]
                )
                for gen in (0, 1, 2)
            ),
            *(row(f"server gen-{gen} GC pause, CPU", r["server_gc_cpu_ms"][gen]) for gen in (0, 1, 2)),
            "",
            f"Requests measured: {r['requests_measured']}; output tokens/s: {r['output_tokens_per_s']:.0f}. "
            f"CPU: server {r['server_cpu_fraction']:.0%} of a core ({r['server_cpu_us_per_token']:.1f} µs/token), "
            f"client {r['client_cpu_fraction']:.0%} ({r['client_cpu_us_per_token']:.1f} µs/token). Waiting for a CPU "
            f"(run queue): server {r['server_run_queue_wait_fraction']:.0%} of the run, client "
            f"{r['client_run_queue_wait_fraction']:.0%}.",
            f"Engine TTFT p50 {r['engine_ttft_ms']['p50']:.1f} ms, "
            f"client TTFT p50 {r['client_ttft_ms']['p50']:.1f} ms.",
            "",
            f"Goal p99 gap <= {r['goal_p99_gap_ms']:g} ms: **{'met' if r['goal_met'] else 'missed'}**.",
        ]
    )
