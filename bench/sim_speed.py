"""`pilotfish bench sim-speed`: how long one hour of trace takes in the virtual-time cluster.

Replays the Mooncake synthetic trace (1,022 s) looped to `--seconds` (each lap with fresh prefix
ids, so the rate and sharing of the original hold) over `--engines` simulated engines, once per
router, on one core. Reports wall time per router and the run's latency summary.
"""

from __future__ import annotations

import argparse
import platform
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="mooncake_synthetic.jsonl", help="trace file (name or path)")
    parser.add_argument("--trace-dir", default=None, help="folder of the shared traces (default: ../shared/traces)")
    parser.add_argument("--seconds", type=float, default=3600.0, help="virtual seconds of arrivals (looped trace)")
    parser.add_argument("--compress", type=float, default=1.0, help="time compression before looping (load x N)")
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--routers", default="scheduler,round-robin",
                        help="comma list: scheduler[:policy], round-robin, least-requests")
    parser.add_argument("--observation-delay", type=float, default=0.0, help="seconds the router sees state late")
    parser.add_argument("--profile", default="llama3-8b-a100")
    parser.add_argument("--num-gpu-blocks", type=int, default=30000, help="per engine (Llama-3-8B on an 80 GB A100)")
    parser.add_argument("--max-model-len", type=int, default=196608, help="fits the trace's longest request")


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.simulator.cluster import ClusterConfig, ClusterSim, router_by_name
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.traces import compress, load_mooncake, loop_to, resolve_trace

    path = resolve_trace(args.trace, args.trace_dir)
    trace = compress(load_mooncake(path), args.compress) if args.compress != 1.0 else load_mooncake(path)
    trace = loop_to(trace, args.seconds)
    engine = EngineConfig(profile=args.profile, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len)
    config = ClusterConfig(engines=args.engines, engine=engine, observation_delay=args.observation_delay)
    runs: dict[str, Any] = {}
    for name in [n.strip() for n in args.routers.split(",") if n.strip()]:
        result = ClusterSim(config, router_by_name(name)).run(trace)
        runs[name] = result.summary()
        print(f"{name}: {result.wall_seconds:.1f} s wall for {result.virtual_seconds:.0f} s virtual, "
              f"{len(result.records)} requests, {result.steps} steps", flush=True)
    out = {"trace": str(path), "requests": len(trace), "seconds": args.seconds, "compress": args.compress,
           "engines": args.engines, "profile": args.profile, "python": platform.python_version(), "runs": runs}
    md = [
        "# Virtual-time cluster speed",
        "",
        f"`{path.name}` looped to {args.seconds:g} s of arrivals ({len(trace)} requests, compression "
        f"{args.compress:g}), {args.engines} engines, profile `{args.profile}`, one core.",
        "",
        "| router | wall s | virtual s | steps | TTFT p50 / p99 s | e2e p50 / p99 s | cache hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        md.append(f"| {name} | {s['wall_seconds']:.1f} | {s['virtual_seconds']:.0f} | {s['steps']} | "
                  f"{s['ttft']['p50']:.2f} / {s['ttft']['p99']:.2f} | {s['e2e']['p50']:.2f} / {s['e2e']['p99']:.2f} | "
                  f"{s['prefix_cache_hit_rate']:.2f} |")
    write_report(args.out, "sim-speed", out, "\n".join(md))
    print("\n".join(md))
    return 0
