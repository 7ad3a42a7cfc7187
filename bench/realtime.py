"""`pilotfish bench realtime`: Pilotfish and real peer routers side by side, in real time, over HTTP.

For every load, repetition and target (the order rotated each repetition, so no target always
runs first or last on a machine that warms up or gets busier) it starts a fresh simulated fleet
(cold prefix caches for every target), starts the target's router, replays the same requests
through it from one client, and stops everything it started by PID. Targets and the exact
configuration of each: bench/realtime_targets.py; the client: bench/realtime_client.py; tables,
verdicts and plots: bench/realtime_report.py.

    pilotfish bench realtime --out DIR                                  # the default set: ~12 min on 2 cores
    pilotfish bench realtime --out DIR --requests 20 --reps 1 --targets direct-rr,pilotfish-lite
    pilotfish bench realtime --out DIR --loads 1,2,3 --reps 5           # P99 TTFT against load
    pilotfish bench realtime --out DIR --vllm-router PATH --sglang-router PATH

The workload: a window of a trace (Mooncake by default), rebased to start at 0 and compressed in
time by the load factor; prompts are the trace's prefix structure turned into tokens (equal hash
ids give equal tokens), every segment scaled by `--token-scale` so that one 2-core machine can
replay enough requests for a P99 with the engines' real A100 step times (sharing stays exact:
a 512-token Mooncake block becomes 128 tokens, eight whole KV blocks, at the default 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import DEFAULT_TRACE, Profile, Progress, StepScales, TraceDir, TraceSpec
from pilotfish.bench.realtime_targets import DEFAULT_TARGETS, TARGETS

if TYPE_CHECKING:
    from pilotfish.bench.realtime_client import ReplayResult
    from pilotfish.bench.realtime_targets import FleetSpec, Running
    from pilotfish.simulator.traces import Trace

A100_KV_BLOCKS = 30000  # KV blocks of Llama-3-8B on an 80 GB A100 (as `bench cluster`), before --token-scale
Peers = dict[str, tuple[str, str]]  # peer router -> (its executable, or "" and why it is missing)


class RealtimeBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    trace: TraceSpec = DEFAULT_TRACE
    trace_dir: TraceDir = None
    skip: Annotated[int, Meta(ge=0, description="trace requests to skip before the window")] = 0
    requests: Annotated[int, Meta(ge=1, description="requests in the window (every run replays them)")] = 100
    load: Annotated[
        float,
        Meta(gt=0, description="time compression of the window: 2 = twice the trace's rate (its CDFs are plotted)"),
    ] = 2.0
    loads: Annotated[list[float], Meta(description="loads to run (includes --load; empty: --load only)")] = (
        msgspec.field(default_factory=list)
    )
    reps: Annotated[int, Meta(ge=1, description="repetitions of every target at every load")] = 3
    engines: Annotated[int, Meta(ge=1, description="simulated engines in the fleet")] = 4
    targets: Annotated[list[str], Meta(description=f"targets to run, of: {', '.join(TARGETS)}")] = msgspec.field(
        default_factory=lambda: list(DEFAULT_TARGETS)
    )
    token_scale: Annotated[
        float, Meta(gt=0, description="every prompt segment's length times this (1: the trace's own lengths)")
    ] = 0.25
    profile: Profile = "llama3-8b-a100"
    step_scales: StepScales = msgspec.field(default_factory=list)
    num_gpu_blocks: Annotated[
        int,
        Meta(
            ge=0,
            description=f"KV blocks per engine (0: {A100_KV_BLOCKS} x --token-scale, the A100's cache in the "
            "scaled token units)",
        ),
    ] = 0
    vllm_router: Annotated[
        str | None,
        Meta(
            description="vllm-router executable (unset: .venv-peers/bin, then PATH); its targets are skipped "
            "without one"
        ),
    ] = None
    sglang_router: Annotated[
        str | None,
        Meta(
            description="sglang-router executable (unset: .venv-peers/bin, then PATH); its targets are skipped "
            "without one"
        ),
    ] = None
    request_timeout: Annotated[float, Meta(gt=0, description="seconds one request may take")] = 300.0
    seed: Annotated[int, Meta(description="seed of synthetic traces")] = 0
    agreement: Annotated[
        bool,
        Meta(
            description="also replay each real router's requests through its reproduction in bench/peers.py and "
            "report how often they choose the same engine; without --targets, runs only the routers that have "
            "one (e.g. --agreement --reps 1 --requests 100 --engines 4)"
        ),
    ] = False
    idle_window: Annotated[
        bool,
        Meta(
            description="after each replay, keep the stack up with no requests for as long as the replay took and "
            "measure the router side's CPU again: what it spends per second whatever the load (timers, polling, "
            "statuses), reported beside the replay's figure and taken off it (net); adds one replay's length to "
            "every run"
        ),
    ] = True
    progress: Progress = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, RealtimeBenchConfig)


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args

    started = time.monotonic()
    cfg = struct_from_args(RealtimeBenchConfig, args)
    plan = make_plan(cfg)
    measured = measure(cfg, plan, Path(args.out))
    report(cfg, plan, measured, Path(args.out), time.monotonic() - started)
    return 0


# ---- set-up: the workload, the fleet, the targets ------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every run of one invocation shares, settled before the first starts."""

    targets: list[str]  # in run order of the first repetition
    skipped: list[str]  # "name: reason" for each target this machine cannot run
    peers: Peers
    base: Trace  # the window at load 1
    label: str  # the trace's name for the report
    fleet: FleetSpec
    loads: list[float]


def make_plan(cfg: RealtimeBenchConfig) -> Plan:
    """Targets (SystemExit on an unknown one, ConfigError when none can run), the window and the fleet."""
    from pilotfish.bench.realtime_targets import find_executable
    from pilotfish.config import ConfigError

    peers = {
        "vllm-router": find_executable(cfg.vllm_router or "", "vllm-router"),
        "sglang-router": find_executable(cfg.sglang_router or "", "sglang-router"),
    }
    names = cfg.targets
    if cfg.agreement and names == list(DEFAULT_TARGETS):
        from pilotfish.bench.realtime_agreement import AGREEMENT_TARGETS

        names = list(AGREEMENT_TARGETS)
    targets, skipped = resolve_targets(names, peers)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not targets:
        raise ConfigError("--targets: nothing left to run")
    base, label = workload(cfg)
    return Plan(targets, skipped, peers, base, label, fleet_spec(cfg, base), parse_loads(cfg.load, cfg.loads))


def workload(cfg: RealtimeBenchConfig) -> tuple[Trace, str]:
    """The window every run replays, at load 1: rebased to 0, prompts scaled; and the trace's label."""
    import dataclasses

    from pilotfish.bench.traces import load_trace

    base, label = load_trace(cfg.trace, cfg.trace_dir, cfg.seed)
    window = base[cfg.skip : cfg.skip + cfg.requests]
    if not window:
        raise SystemExit(f"--skip {cfg.skip} --requests {cfg.requests}: the trace has {len(base)} requests")
    t0 = window[0].arrival
    out: Trace = []
    for r in window:
        segments = tuple((key, max(1, round(n * cfg.token_scale))) for key, n in r.segments)
        out.append(
            dataclasses.replace(r, arrival=r.arrival - t0, segments=segments, input_length=sum(n for _, n in segments))
        )
    return out, label


def fleet_spec(cfg: RealtimeBenchConfig, trace: Trace) -> FleetSpec:
    from pilotfish.bench.realtime_targets import FleetSpec

    blocks = cfg.num_gpu_blocks or max(1, round(A100_KV_BLOCKS * cfg.token_scale))
    longest = max(r.input_length + r.output_length for r in trace)
    max_len = max(8192, -(-longest // 1024) * 1024)  # every request of the window fits
    scales = ("--step-scales", ",".join(f"{x:g}" for x in cfg.step_scales)) if cfg.step_scales else ()
    return FleetSpec(
        cfg.engines,
        ("--profile", cfg.profile, "--num-gpu-blocks", str(blocks), "--max-model-len", str(max_len), *scales),
    )


def parse_loads(load: float, loads: list[float]) -> list[float]:
    """--load and --loads, sorted, each once."""
    return sorted({load, *loads})


def resolve_targets(names: list[str], peers: Peers) -> tuple[list[str], list[str]]:
    """(targets to run, "name: reason" for each skipped); SystemExit on an unknown name."""
    from pilotfish.bench.realtime_targets import unavailable

    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"--targets: unknown {', '.join(unknown)} (known: {', '.join(TARGETS)})")
    run, skipped = [], []
    for name in dict.fromkeys(names):
        reason = unavailable(name, peers)
        if reason:
            skipped.append(f"{name}: {reason}")
        else:
            run.append(name)
    return run, skipped


# ---- measure: every load, repetition and target ----------------------------------------------------------------


@dataclass
class Measured:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # load -> target -> run summaries
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # at --load: target -> metric -> seconds


def measure(cfg: RealtimeBenchConfig, plan: Plan, out: Path) -> Measured:
    """Every run, one after another; each request's record to out/records.jsonl as it ends."""
    from pilotfish.bench.cluster import Progress as ProgressBar
    from pilotfish.bench.traces import compressed

    progress = ProgressBar(len(plan.base) * len(plan.loads) * cfg.reps * len(plan.targets), enabled=cfg.progress)
    measured = Measured()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as records_file:
        for load in plan.loads:
            trace = compressed(plan.base, load)
            runs = measured.runs[str(load)] = {name: [] for name in plan.targets}
            for rep, position, name in rotations(plan.targets, cfg.reps):
                progress.label = f"load {load:g} rep {rep + 1}/{cfg.reps} {name}"
                summary, records = run_one(name, trace, plan.fleet, plan.peers, cfg, progress.tick)
                summary.update({"rep": rep, "position": position})
                runs[name].append(summary)
                if "error" in summary:
                    print(f"\n{name} (load {load:g}, rep {rep + 1}): {summary['error']}", file=sys.stderr)
                _write_records(records_file, load, rep, name, records)
                if load == cfg.load:
                    _add_samples(measured.samples.setdefault(name, {"ttft": [], "tpot": [], "e2e": []}), records)
    progress.finish()
    return measured


def rotations(targets: list[str], reps: int) -> list[tuple[int, int, str]]:
    """(repetition, position, target) in run order: the order rotated each repetition, so no target
    always runs first or last on a machine that warms up or gets busier."""
    out = []
    for rep in range(reps):
        order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
        out += [(rep, position, name) for position, name in enumerate(order)]
    return out


def _write_records(records_file: IO[str], load: float, rep: int, target: str, records: list[Any]) -> None:
    for r in records:
        line = {
            "load": load, "rep": rep, "target": target, "request_id": r.request_id, "engine": r.engine,
            "arrival": r.arrival, "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e,
            "output_tokens": r.num_output_tokens, "error": r.finish_reason,
        }  # fmt: skip
        records_file.write(json.dumps(line) + "\n")


def _add_samples(samples: dict[str, list[float]], records: list[Any]) -> None:
    """The finished requests' TTFT, TPOT and end-to-end seconds, for the CDF plot."""
    for r in records:
        if r.finished is not None:
            for key in ("ttft", "tpot", "e2e"):
                if (v := getattr(r, key)) is not None:
                    samples[key].append(v)


@dataclass(frozen=True)
class Replayed:
    """One target's replay, with what its router side spent."""

    running: Running
    warmup: Any  # the warm-up requests' choices (the agreement replay starts from them)
    result: ReplayResult
    start_seconds: float
    router_cpu: float  # CPU seconds of the router side over the replay
    parts: dict[str, float]  # the same, by component
    # CPU seconds over an idle window as long as the replay, right after it (--idle-window); None: not measured
    idle_cpu: float | None = None
    idle_parts: dict[str, float] | None = None


def run_one(
    name: str, trace: Trace, fleet: FleetSpec, peers: Peers, cfg: RealtimeBenchConfig, tick: Any
) -> tuple[dict[str, Any], list[Any]]:
    """Fresh fleet + router for `name`, the replay, everything stopped; (run summary, request records)."""
    from pilotfish.procs import ChildGroup

    group = ChildGroup()
    load_avg = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-realtime-") as tmp:
        try:
            replayed = _replay(name, trace, fleet, peers, cfg, tick, group, Path(tmp))
        except Exception as exc:  # one target that cannot start must not cost the other targets' runs
            for _ in trace:
                tick()
            return {"error": f"{type(exc).__name__}: {exc}"[:600], "load_avg_1m": load_avg}, []
        finally:
            group.stop_all()
    summary = _run_figures(replayed, fleet.engines, load_avg)
    if cfg.agreement:
        _add_agreement(summary, name, trace, replayed, fleet.engines)
    return summary, replayed.result.records


def _replay(
    name: str,
    trace: Trace,
    fleet: FleetSpec,
    peers: Peers,
    cfg: RealtimeBenchConfig,
    tick: Any,
    group: Any,
    tmp: Path,
) -> Replayed:
    """Start `name` in `group` (the caller stops it), warm it up, replay `trace` through it, then
    (--idle-window) leave it idle for as long as the replay took."""
    import asyncio
    import dataclasses

    from pilotfish.bench.realtime_client import replay, warm_up
    from pilotfish.bench.realtime_targets import start_target
    from pilotfish.procs import thread_cpu_seconds as cpu_seconds

    started = time.monotonic()
    running = start_target(name, fleet, group, tmp, peers)
    warmup = asyncio.run(
        warm_up(
            running.urls, count=fleet.engines, token_id_prompts=running.token_id_prompts, engine_ids=running.engine_ids
        )
    )
    start_seconds = time.monotonic() - started
    cpu0 = sum(cpu_seconds(p) for p in running.router_pids)
    parts0 = {part: cpu_seconds(pid) for part, pid in running.router_parts.items()}
    result = asyncio.run(
        replay(
            trace,
            running.urls,
            running.engine_ids,
            token_id_prompts=running.token_id_prompts,
            timeout=cfg.request_timeout,
            tick=tick,
        )
    )
    cpu1 = sum(cpu_seconds(p) for p in running.router_pids)
    parts1 = {part: cpu_seconds(pid) for part, pid in running.router_parts.items()}
    replayed = Replayed(
        running, warmup, result, start_seconds, cpu1 - cpu0, {part: parts1[part] - parts0[part] for part in parts1}
    )
    if not cfg.idle_window:
        return replayed
    # The same window length for every target, with nothing sent: what the router side spends per second
    # anyway. The client is idle too, so nothing else of this run competes with it.
    time.sleep(result.wall_seconds)
    idle_cpu = sum(cpu_seconds(p) for p in running.router_pids) - cpu1
    idle_parts = {part: cpu_seconds(pid) - parts1[part] for part, pid in running.router_parts.items()}
    return dataclasses.replace(replayed, idle_cpu=idle_cpu, idle_parts=idle_parts)


def _run_figures(replayed: Replayed, engines: int, load_avg: float) -> dict[str, Any]:
    """One run's summary: latency, throughput and failures, and what the client and router side spent."""
    from pilotfish.bench.realtime_report import run_summary

    result, requests = replayed.result, len(replayed.result.records)
    summary = run_summary(result.records, engines)
    summary.update(
        {
            "client_cpu_share": result.client_cpu_seconds / result.wall_seconds if result.wall_seconds else 0.0,
            "router_cpu_seconds": replayed.router_cpu,
            # per request of the replay, so targets compare whatever finished; and by component
            "router_cpu_ms_per_request": replayed.router_cpu * 1000 / requests if requests else 0.0,
            "router_cpu_ms_per_request_parts": {
                part: cpu * 1000 / requests for part, cpu in replayed.parts.items() if requests
            },
            **_idle_figures(replayed, requests),
            "replay_seconds": result.wall_seconds,
            "start_seconds": replayed.start_seconds,
            "load_avg_1m": load_avg,
            "prompts": "token ids" if replayed.running.token_id_prompts else "text",
        }
    )
    return summary


def _idle_figures(replayed: Replayed, requests: int) -> dict[str, Any]:
    """The idle window's CPU per request of the replay (the same divisor, so the two subtract), and the
    replay's less it: what the requests themselves cost. Empty without an idle window."""
    if replayed.idle_cpu is None or replayed.idle_parts is None or not requests:
        return {}
    idle_ms = replayed.idle_cpu * 1000 / requests
    return {
        "router_idle_cpu_seconds": replayed.idle_cpu,
        "router_idle_cpu_ms_per_request": idle_ms,
        "router_net_cpu_ms_per_request": replayed.router_cpu * 1000 / requests - idle_ms,
        "router_idle_cpu_ms_per_request_parts": {
            part: cpu * 1000 / requests for part, cpu in replayed.idle_parts.items()
        },
    }


def _add_agreement(summary: dict[str, Any], name: str, trace: Trace, replayed: Replayed, engines: int) -> None:
    """--agreement: the router's reproduction over the same requests, where it has one."""
    from pilotfish.bench.realtime_agreement import REPRODUCTIONS
    from pilotfish.bench.realtime_agreement import replay as agreement_replay

    if name not in REPRODUCTIONS:
        return
    try:
        summary["agreement"] = agreement_replay(
            name, trace, replayed.result.records, replayed.warmup, engines, replayed.running.engine_urls
        )
    except Exception as exc:  # the replay must not cost the run its figures
        summary["agreement"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}


# ---- report ----------------------------------------------------------------------------------------------------


def report(cfg: RealtimeBenchConfig, plan: Plan, measured: Measured, out: Path, wall_seconds: float) -> None:
    """Plots, result.json and report.md (rendered from result.json alone)."""
    from pilotfish.bench.realtime_report import render_markdown, write_plots
    from pilotfish.bench.report import write_report

    families = {name: TARGETS[name].family for name in plan.targets}
    plots, no_plots = write_plots(out, cfg.load, measured.samples, plan.loads, measured.runs, families)
    result = _result(cfg, plan, measured, wall_seconds) | {"plots": plots, "no_plots": no_plots}
    md = render_markdown({"benchmark": "realtime", **result})
    write_report(out, "realtime", result, md)
    print(md)


def _result(cfg: RealtimeBenchConfig, plan: Plan, measured: Measured, wall_seconds: float) -> dict[str, Any]:
    from pilotfish.bench.realtime_report import aggregate

    base = plan.base
    return {
        "trace": plan.label,
        "skip": cfg.skip,
        "requests": len(base),
        "span_seconds_at_load_1": max(r.arrival for r in base),
        "token_scale": cfg.token_scale,
        "mean_prompt_tokens": sum(r.input_length for r in base) / len(base),
        "mean_output_tokens": sum(r.output_length for r in base) / len(base),
        "engines": cfg.engines,
        "engine_args": list(plan.fleet.engine_args),
        "loads": plan.loads,
        "load": cfg.load,
        "reps": cfg.reps,
        "targets": {n: {"family": TARGETS[n].family, "description": TARGETS[n].description} for n in plan.targets},
        "peers": {router: path for router, (path, _) in plan.peers.items() if path},
        "skipped": plan.skipped,
        "runs": measured.runs,
        "summary": {str(ld): aggregate(measured.runs[str(ld)]) for ld in plan.loads},
        "wall_seconds": wall_seconds,
        "machine": {"cpus": os.cpu_count(), "host": platform.node(), "python": platform.python_version()},
        "command": "pilotfish bench realtime " + " ".join(sys.argv[sys.argv.index("realtime") + 1 :])
        if "realtime" in sys.argv
        else "",
    }
