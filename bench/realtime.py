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
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pilotfish.bench.realtime_targets import FleetSpec
    from pilotfish.simulator.traces import Trace

DEFAULT_TRACE = "mooncake_synthetic.jsonl"
A100_KV_BLOCKS = 30000  # KV blocks of Llama-3-8B on an 80 GB A100 (as `bench cluster`), before --token-scale


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.bench.realtime_targets import DEFAULT_TARGETS, TARGETS

    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake .jsonl, Azure .csv (name in ../shared/traces or a path), or synthetic[:...] "
        "as in `bench cluster`",
    )
    parser.add_argument("--trace-dir", default=None, help="folder of the shared traces (unset: ../shared/traces)")
    parser.add_argument("--skip", type=int, default=0, help="trace requests to skip before the window")
    parser.add_argument("--requests", type=int, default=100, help="requests in the window (every run replays them)")
    parser.add_argument(
        "--load",
        type=float,
        default=2.0,
        help="time compression of the window: 2 = twice the trace's rate (its CDFs are plotted)",
    )
    parser.add_argument("--loads", default="", help="comma list of loads to run (includes --load; empty: --load only)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every target at every load")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines in the fleet")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"comma list of: {', '.join(TARGETS)}")
    parser.add_argument(
        "--token-scale",
        type=float,
        default=0.25,
        help="every prompt segment's length times this (1: the trace's own lengths)",
    )
    parser.add_argument("--profile", default="llama3-8b-a100", help="engine step-time profile (simulator/profiles)")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=0,
        help=f"KV blocks per engine (0: {A100_KV_BLOCKS} x --token-scale, the A100's cache in the scaled token units)",
    )
    parser.add_argument(
        "--vllm-router",
        default="",
        metavar="PATH",
        help="vllm-router executable (unset: .venv-peers/bin, then PATH); its targets are skipped without one",
    )
    parser.add_argument(
        "--sglang-router",
        default="",
        metavar="PATH",
        help="sglang-router executable (unset: .venv-peers/bin, then PATH); its targets are skipped without one",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic traces")
    parser.add_argument(
        "--agreement",
        action="store_true",
        help="also replay each real router's requests through its reproduction in bench/peers.py and report "
        "how often they choose the same engine; without --targets, runs only the routers that have one "
        "(e.g. --agreement --reps 1 --requests 100 --engines 4)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# ---- the workload --------------------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> tuple[Trace, str]:
    """The window every run replays, at load 1: rebased to 0, prompts scaled; and the trace's label."""
    import dataclasses

    from pilotfish.bench.cluster import load_trace

    base, label = load_trace(args.trace, args.trace_dir, args.seed)
    window = base[args.skip : args.skip + args.requests]
    if not window:
        raise SystemExit(f"--skip {args.skip} --requests {args.requests}: the trace has {len(base)} requests")
    t0 = window[0].arrival
    out: Trace = []
    for r in window:
        segments = tuple((key, max(1, round(n * args.token_scale))) for key, n in r.segments)
        out.append(
            dataclasses.replace(r, arrival=r.arrival - t0, segments=segments, input_length=sum(n for _, n in segments))
        )
    return out, label


def fleet_spec(args: argparse.Namespace, trace: Trace) -> FleetSpec:
    from pilotfish.bench.realtime_targets import FleetSpec

    blocks = args.num_gpu_blocks or max(1, round(A100_KV_BLOCKS * args.token_scale))
    longest = max(r.input_length + r.output_length for r in trace)
    max_len = max(8192, -(-longest // 1024) * 1024)  # every request of the window fits
    return FleetSpec(
        args.engines, ("--profile", args.profile, "--num-gpu-blocks", str(blocks), "--max-model-len", str(max_len))
    )


def parse_loads(load: float, loads: str) -> list[float]:
    values = {load}
    values.update(float(x) for x in loads.split(",") if x.strip())
    return sorted(values)


def resolve_targets(spec: str, peers: dict[str, tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(targets to run, "name: reason" for each skipped); SystemExit on an unknown name."""
    from pilotfish.bench.realtime_targets import TARGETS, unavailable

    names = [n.strip() for n in spec.split(",") if n.strip()]
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


# ---- one run ------------------------------------------------------------------------------------------------


def run_one(
    name: str, trace: Trace, fleet: FleetSpec, peers: dict[str, tuple[str, str]], args: argparse.Namespace, tick: Any
) -> tuple[dict[str, Any], list[Any]]:
    """Fresh fleet + router for `name`, the replay, everything stopped; (run summary, request records)."""
    import asyncio
    import tempfile
    from pathlib import Path

    from pilotfish.bench.realtime_client import replay, warm_up
    from pilotfish.bench.realtime_report import run_summary
    from pilotfish.bench.realtime_targets import start_target
    from pilotfish.procs import ChildGroup, cpu_seconds

    group = ChildGroup()
    load_avg = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-realtime-") as tmp:
        try:
            running = start_target(name, fleet, group, Path(tmp), peers)
            warmup = asyncio.run(
                warm_up(
                    running.urls,
                    count=fleet.engines,
                    token_id_prompts=running.token_id_prompts,
                    engine_ids=running.engine_ids,
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
                    timeout=args.request_timeout,
                    tick=tick,
                )
            )
            router_cpu = sum(cpu_seconds(p) for p in running.router_pids) - cpu0
            parts = {part: cpu_seconds(pid) - parts0[part] for part, pid in running.router_parts.items()}
        except Exception as exc:  # one target that cannot start must not cost the other targets' runs
            for _ in trace:
                tick()
            return {"error": f"{type(exc).__name__}: {exc}"[:600], "load_avg_1m": load_avg}, []
        finally:
            group.stop_all()
    summary = run_summary(result.records, fleet.engines)
    summary.update(
        {
            "client_cpu_share": result.client_cpu_seconds / result.wall_seconds if result.wall_seconds else 0.0,
            "router_cpu_seconds": router_cpu,
            # per request of the replay, so targets compare whatever finished; and by component
            "router_cpu_ms_per_request": router_cpu * 1000 / len(result.records) if result.records else 0.0,
            "router_cpu_ms_per_request_parts": {
                part: cpu * 1000 / len(result.records) for part, cpu in parts.items() if result.records
            },
            "replay_seconds": result.wall_seconds,
            "start_seconds": start_seconds,
            "load_avg_1m": load_avg,
            "prompts": "token ids" if running.token_id_prompts else "text",
        }
    )
    if getattr(args, "agreement", False):
        from pilotfish.bench.realtime_agreement import REPRODUCTIONS
        from pilotfish.bench.realtime_agreement import replay as agreement_replay

        if name in REPRODUCTIONS:
            try:
                summary["agreement"] = agreement_replay(
                    name, trace, result.records, warmup, fleet.engines, running.engine_urls
                )
            except Exception as exc:  # the replay must not cost the run its figures
                summary["agreement"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return summary, result.records


def run(args: argparse.Namespace) -> int:
    import json

    from pilotfish.bench.cluster import Progress
    from pilotfish.bench.realtime_report import aggregate, render_markdown, write_plots
    from pilotfish.bench.realtime_targets import DEFAULT_TARGETS, TARGETS, find_executable
    from pilotfish.bench.report import write_report
    from pilotfish.simulator.traces import compress

    started = time.monotonic()
    if args.reps < 1 or args.requests < 1 or args.engines < 1 or args.token_scale <= 0:
        print("--reps, --requests, --engines and --token-scale must be positive", file=sys.stderr)
        return 2
    peers = {
        "vllm-router": find_executable(args.vllm_router, "vllm-router"),
        "sglang-router": find_executable(args.sglang_router, "sglang-router"),
    }
    if getattr(args, "agreement", False) and args.targets == ",".join(DEFAULT_TARGETS):
        from pilotfish.bench.realtime_agreement import AGREEMENT_TARGETS

        args.targets = ",".join(AGREEMENT_TARGETS)
    targets, skipped = resolve_targets(args.targets, peers)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not targets:
        print("--targets: nothing left to run", file=sys.stderr)
        return 2
    base, label = workload(args)
    fleet = fleet_spec(args, base)
    loads = parse_loads(args.load, args.loads)
    progress = Progress(len(base) * len(loads) * args.reps * len(targets), enabled=not args.no_progress)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "records.jsonl", "w") as records_file:
        for load in loads:
            trace = compress(base, load) if load != 1.0 else base
            runs[str(load)] = {name: [] for name in targets}
            for rep in range(args.reps):
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for position, name in enumerate(order):
                    progress.label = f"load {load:g} rep {rep + 1}/{args.reps} {name}"
                    summary, records = run_one(name, trace, fleet, peers, args, progress.tick)
                    summary.update({"rep": rep, "position": position})
                    runs[str(load)][name].append(summary)
                    if "error" in summary:
                        print(f"\n{name} (load {load:g}, rep {rep + 1}): {summary['error']}", file=sys.stderr)
                    for r in records:
                        records_file.write(
                            json.dumps(
                                {
                                    "load": load,
                                    "rep": rep,
                                    "target": name,
                                    "request_id": r.request_id,
                                    "engine": r.engine,
                                    "arrival": r.arrival,
                                    "ttft": r.ttft,
                                    "tpot": r.tpot,
                                    "e2e": r.e2e,
                                    "output_tokens": r.num_output_tokens,
                                    "error": r.finish_reason,
                                }
                            )
                            + "\n"
                        )
                        if load == args.load and r.finished is not None:
                            s = samples.setdefault(name, {"ttft": [], "tpot": [], "e2e": []})
                            for key in ("ttft", "tpot", "e2e"):
                                if (v := getattr(r, key)) is not None:
                                    s[key].append(v)
    progress.finish()
    families = {name: TARGETS[name].family for name in targets}
    plots, no_plots = write_plots(args.out, args.load, samples, loads, runs, families)
    span = max(r.arrival for r in base)
    result = {
        "trace": label,
        "skip": args.skip,
        "requests": len(base),
        "span_seconds_at_load_1": span,
        "token_scale": args.token_scale,
        "mean_prompt_tokens": sum(r.input_length for r in base) / len(base),
        "mean_output_tokens": sum(r.output_length for r in base) / len(base),
        "engines": args.engines,
        "engine_args": list(fleet.engine_args),
        "loads": loads,
        "load": args.load,
        "reps": args.reps,
        "targets": {n: {"family": TARGETS[n].family, "description": TARGETS[n].description} for n in targets},
        "peers": {router: path for router, (path, _) in peers.items() if path},
        "skipped": skipped,
        "runs": runs,
        "summary": {str(ld): aggregate(runs[str(ld)]) for ld in loads},
        "plots": plots,
        "no_plots": no_plots,
        "wall_seconds": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "host": platform.node(), "python": platform.python_version()},
        "command": "pilotfish bench realtime " + " ".join(sys.argv[sys.argv.index("realtime") + 1 :])
        if "realtime" in sys.argv
        else "",
    }
    md = render_markdown({"benchmark": "realtime", **result})
    write_report(args.out, "realtime", result, md)
    print(md)
    return 0
