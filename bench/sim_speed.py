"""`pilotfish bench sim-speed`: how long one hour of trace takes in the virtual-time cluster.

Replays the Mooncake synthetic trace (1,022 s) looped to `--seconds` (each lap with fresh prefix
ids, so the rate and sharing of the original hold) over `--engines` simulated engines, once per
router, on one core. Reports wall time per router and the run's latency summary.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import DEFAULT_TRACE, EngineOptions, Instances, ObservationDelay, TraceDir

if TYPE_CHECKING:
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.traces import Trace


class SimSpeedConfig(EngineOptions, frozen=True):
    """Every knob of `bench sim-speed`, with its default (the flags and bench/README.md's table come from it)."""

    trace: Annotated[str, Meta(description="Mooncake trace file (a name in ../shared/traces or a path)")] = (
        DEFAULT_TRACE
    )
    trace_dir: TraceDir = None
    seconds: Annotated[float, Meta(gt=0, description="virtual seconds of arrivals (the trace looped)")] = 3600.0
    compress: Annotated[float, Meta(gt=0, description="time compression before looping (load x N)")] = 1.0
    engines: Instances = 16
    routers: Annotated[
        list[str],
        Meta(min_length=1, description="routers timed in turn: scheduler[:policy], round-robin, least-requests"),
    ] = msgspec.field(default_factory=lambda: ["scheduler", "round-robin"])
    observation_delay: ObservationDelay = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, SimSpeedConfig)


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(SimSpeedConfig, args)
    path, trace, cluster = set_up(cfg)
    report(cfg, path, trace, measure(cfg, trace, cluster), Path(args.out))
    return 0


def set_up(cfg: SimSpeedConfig) -> tuple[Path, Trace, ClusterConfig]:
    """The trace file, its arrivals compressed and looped to `seconds`, and the fleet's config."""
    from pilotfish.bench.traces import compressed
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.traces import load_mooncake, loop_to, resolve_trace

    path = resolve_trace(cfg.trace, cfg.trace_dir)
    trace = loop_to(compressed(load_mooncake(path), cfg.compress), cfg.seconds)
    cluster = ClusterConfig(engines=cfg.engines, engine=cfg.engine_config(), observation_delay=cfg.observation_delay)
    return path, trace, cluster


def measure(cfg: SimSpeedConfig, trace: Trace, cluster: ClusterConfig) -> dict[str, Any]:
    """Each router over the whole trace on fresh engines: its run's summary, wall time included."""
    from pilotfish.simulator.cluster import ClusterSim, router_by_name

    runs: dict[str, Any] = {}
    for name in cfg.routers:
        result = ClusterSim(cluster, router_by_name(name)).run(trace)
        runs[name] = result.summary()
        print(f"{name}: {result.wall_seconds:.1f} s wall for {result.virtual_seconds:.0f} s virtual, "
              f"{len(result.records)} requests, {result.steps} steps", flush=True)  # fmt: skip
    return runs


def report(cfg: SimSpeedConfig, path: Path, trace: Trace, runs: dict[str, Any], out: Path) -> None:
    """result.json and report.md in `out`, the report printed too."""
    from pilotfish.bench.report import write_report

    result = {"trace": str(path), "requests": len(trace), "seconds": cfg.seconds, "compress": cfg.compress,
              "engines": cfg.engines, "profile": cfg.profile, "python": platform.python_version(),
              "settings": msgspec.structs.asdict(cfg), "runs": runs}  # fmt: skip
    md = "\n".join(render_markdown(result))
    write_report(out, "sim-speed", result, md)
    print(md)


def render_markdown(result: dict[str, Any]) -> list[str]:
    """report.md's lines from result.json alone."""
    md = [
        "# Virtual-time cluster speed",
        "",
        f"`{Path(result['trace']).name}` looped to {result['seconds']:g} s of arrivals ({result['requests']} "
        f"requests, compression {result['compress']:g}), {result['engines']} engines, profile "
        f"`{result['profile']}`, one core.",
        "",
        "| router | wall s | virtual s | steps | TTFT p50 / p99 s | e2e p50 / p99 s | cache hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["runs"].items():
        md.append(f"| {name} | {s['wall_seconds']:.1f} | {s['virtual_seconds']:.0f} | {s['steps']} | "
                  f"{s['ttft']['p50']:.2f} / {s['ttft']['p99']:.2f} | {s['e2e']['p50']:.2f} / {s['e2e']['p99']:.2f} | "
                  f"{s['prefix_cache_hit_rate']:.2f} |")  # fmt: skip
    return md
