"""`pilotfish bench reschedule`: the rescheduler off and on, side by side, on the virtual-time cluster.

Full-mode Pilotfish dispatch (the real SchedulerCore, bench/cluster_full.py) on identical engines
and identical arrivals (one trace slice, compressed by --load, one seed), in two scenarios:

- **load balance**: the `decode_load`/`neutral_load` policies move requests off engines whose
  projected KV usage crosses the threshold (imbalance builds up because dispatch cannot see
  how long a request will run);
- **failover**: one engine is marked unschedulable part-way through (its llumlet says so, as on
  a failing health check or a drain); without rescheduling its requests finish where they are,
  with it the failover policies move them away. The report gives how long it took to drain.

The planner is the scheduler's own `ReschedulingPlanner` over the router's core, exactly what
the scheduler decides on; the requests that move are chosen on the source engine with
`select_requests`, as the llumlet does. Token integrity is checked on every run: each request's
outputs arrive with indices 0..n-1, each once, whatever moved. Outputs DIR/result.json,
DIR/report.md and PNG plots.

    pilotfish bench reschedule --out DIR
    pilotfish bench reschedule --duration 120 --load 3 --migration-method recompute --out DIR
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from pilotfish.bench.cluster_full import FullModeRouter
    from pilotfish.simulator.cluster import ClusterConfig, ClusterResult, ClusterSim, MigrationOrder
    from pilotfish.simulator.traces import Trace

SCENARIOS = ("load_balance", "failover")
LOAD_BALANCE_POLICIES = ["decode_load", "neutral_load"]
FAILOVER_POLICIES = ["prefill_failover", "decode_failover", "neutral_failover", "decode_load", "neutral_load"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.bench.cluster import DEFAULT_TRACE

    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake .jsonl, Azure .csv (name in ../shared/traces or a path), or synthetic[:...]",
    )
    parser.add_argument("--trace-dir", default=None, help="folder of the shared traces (unset: ../shared/traces)")
    parser.add_argument(
        "--duration",
        type=float,
        default=300.0,
        help="the trace slice: seconds of the trace's own timeline, before compression (0: all)",
    )
    parser.add_argument("--load", type=float, default=1.0, help="time compression: 2 = twice the trace's rate")
    parser.add_argument("--instances", type=int, default=8, help="simulated engines")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    parser.add_argument("--scheduling-policy", default="load-balance", help="the dispatch policy (full mode)")
    parser.add_argument("--profile", default="llama3-8b-a100", help="engine step-time profile")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=16000,
        help="KV blocks per engine: fewer than bench cluster's 30000 so KV pressure builds up",
    )
    parser.add_argument("--max-model-len", type=int, default=196608, help="fits the Mooncake trace's longest request")
    parser.add_argument(
        "--migration-bandwidth-gbps",
        type=float,
        default=None,
        help="KV-transfer link between engines (unset: the engine config's default)",
    )
    parser.add_argument(
        "--migration-method",
        default="auto",
        choices=("auto", "recompute", "kv_transfer"),
        help="--rescheduling-migration-method; auto is a KV transfer here (the engines model a link)",
    )
    parser.add_argument(
        "--rescheduling-interval-ms",
        type=int,
        default=None,
        help="period of the rescheduling loop (unset: the scheduler's default)",
    )
    parser.add_argument(
        "--load-threshold",
        type=float,
        default=None,
        help="--rescheduling-{decode,neutral}-load-threshold (unset: the scheduler's default)",
    )
    parser.add_argument("--select-rule", default=None, help="--rescheduling-req-select-rule (unset: default)")
    parser.add_argument("--select-order", default=None, help="--rescheduling-req-select-order (unset: default)")
    parser.add_argument(
        "--select-value", type=float, default=None, help="--rescheduling-req-select-value (unset: default)"
    )
    parser.add_argument("--failover-engine", type=int, default=0, help="failover: the engine marked unschedulable")
    parser.add_argument(
        "--failover-at",
        type=float,
        default=0.3,
        help="failover: when it is marked, as a fraction of the compressed slice's arrival span",
    )
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT at most this many seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: TPOT at most this many seconds")
    parser.add_argument(
        "--observation-delay",
        type=float,
        default=0.0,
        help="seconds the scheduler hears engine events late (statuses, token reports, finishes)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic traces")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


# ---- the watcher: what every tick sees, with rescheduling on or off --------------------------------------


@dataclass(slots=True)
class Watch:
    """Called every rescheduling interval in both arms (off: it plans nothing), so both sample alike.

    Samples each engine's true KV usage (the imbalance the rescheduler works on) and the marked
    engine's requests (the drain).
    """

    inner: Callable[[ClusterSim, float], Sequence[MigrationOrder]] | None
    watch_engine: int | None = None
    marked_at: float | None = None
    times: list[float] = field(default_factory=list)
    kv_spread: list[float] = field(default_factory=list)  # max minus mean KV usage across engines
    kv_max: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # requests on (or leaving) the watched engine
    drained_at: float | None = None

    def __call__(self, sim: ClusterSim, now: float) -> Sequence[MigrationOrder]:
        usage = [c.kv.usage() for c in sim.cores]
        self.times.append(now)
        self.kv_max.append(max(usage))
        self.kv_spread.append(max(usage) - sum(usage) / len(usage))
        if self.watch_engine is not None:
            k = self.watch_engine
            held = len(sim.cores[k].requests) + sum(1 for e in sim.transfers() if e.source == k)
            self.held.append(held)
            if self.marked_at is not None and now >= self.marked_at and held == 0 and self.drained_at is None:
                self.drained_at = now
        return self.inner(sim, now) if self.inner is not None else []


# ---- one run ------------------------------------------------------------------------------------------------


def scheduler_config(args: argparse.Namespace, policies: list[str]) -> Any:
    from pilotfish.scheduler.config import SchedulerConfig

    fields: dict[str, Any] = {
        "enable_full_mode_scheduling": True,
        "scheduling_policy": args.scheduling_policy,
        "enable_rescheduling": True,
        "rescheduling_policies": policies,
        "rescheduling_migration_method": args.migration_method,
    }
    optional = {
        "rescheduling_interval_ms": args.rescheduling_interval_ms,
        "rescheduling_decode_load_threshold": args.load_threshold,
        "rescheduling_neutral_load_threshold": args.load_threshold,
        "rescheduling_req_select_rule": args.select_rule,
        "rescheduling_req_select_order": args.select_order,
        "rescheduling_req_select_value": args.select_value,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return SchedulerConfig(**fields)


def run_arm(
    cluster: ClusterConfig, scheduler: Any, trace: Trace, *, rescheduling: bool, mark: tuple[int, float] | None
) -> tuple[ClusterResult, Watch, Any]:
    """One run: full-mode dispatch, the rescheduler on or off, an engine marked unschedulable at a time."""
    from pilotfish.bench.cluster_full import FullModeRouter
    from pilotfish.scheduler.rescheduler import ReschedulingPlanner
    from pilotfish.simulator.cluster import ClusterSim, PlannerRescheduler

    router: FullModeRouter = FullModeRouter(scheduler, cluster.engine)
    planner = PlannerRescheduler(ReschedulingPlanner(scheduler), router) if rescheduling else None
    watch = Watch(planner, watch_engine=mark[0] if mark else None, marked_at=mark[1] if mark else None)
    sim = ClusterSim(cluster, router, observers=[router.observe_engine], rescheduler=watch)
    router.attach_engines(sim.engines)
    if mark is not None:
        k, at = mark
        sim.at(at, lambda: sim.set_schedulable(k, False))
    return sim.run(trace), watch, planner


def arm_metrics(
    result: ClusterResult,
    watch: Watch,
    planner: Any,
    requests: int,
    args: argparse.Namespace,
    mark: tuple[int, float] | None,
) -> dict[str, Any]:
    from pilotfish.bench.cluster_report import policy_metrics

    m = policy_metrics(result, requests, args.slo_ttft, args.slo_tpot)
    moved = result.migrations
    m["migrations"] = len(moved)
    m["migrated_requests"] = sum(1 for r in result.records if r.migrations)
    m["migrations_by_method"] = {
        name: sum(1 for e in moved if e.method == name) for name in ("recompute", "kv_transfer")
    }
    m["kv_transfer_fallbacks"] = sum(1 for e in moved if e.requested != e.method)
    m["kv_tokens_transferred"] = sum(e.tokens for e in moved)
    m["migrations_by_policy"] = {p: sum(1 for e in moved if e.reason == p) for p in sorted({e.reason for e in moved})}
    m["planner_pairs"] = planner.pairs if planner is not None else 0
    m["integrity"] = {
        "ok": not result.integrity_errors,
        "errors": len(result.integrity_errors),
        "examples": result.integrity_errors[:5],
        "requests_checked": len(result.records),
    }
    m["kv_usage_spread_mean"] = _mean(watch.kv_spread)
    m["kv_usage_max_mean"] = _mean(watch.kv_max)
    m["kv_usage_peak"] = max(watch.kv_max, default=math.nan)
    if mark is not None:
        k, at = mark
        m["failover"] = {
            "engine": k,
            "marked_at": at,
            "held_at_mark": next((h for t, h in zip(watch.times, watch.held, strict=True) if t >= at), 0),
            "drain_seconds": (watch.drained_at - at) if watch.drained_at is not None else None,
            "dispatched_after_mark": sum(
                1 for r in result.records if r.arrival > at and r.engine == k and r.migrations == 0
            ),
            "migrated_in_after_mark": sum(1 for e in moved if e.destination == k and e.time >= at),
        }
    return m


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# ---- the benchmark ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import msgspec

    from pilotfish.bench.cluster import load_trace
    from pilotfish.bench.report import write_report
    from pilotfish.config import ConfigError
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.traces import compress, take_duration

    started = time.monotonic()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        print(f"--scenarios: unknown {unknown} (choose from {', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    if not 0 <= args.failover_engine < args.instances:
        print(f"--failover-engine: {args.failover_engine} is not one of the {args.instances} engines", file=sys.stderr)
        return 2
    engine_fields: dict[str, Any] = {
        "profile": args.profile,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_model_len": args.max_model_len,
    }
    if args.migration_bandwidth_gbps is not None:
        engine_fields["migration_bandwidth_gbps"] = args.migration_bandwidth_gbps
    engine = EngineConfig(**engine_fields)
    try:
        configs = {
            "load_balance": scheduler_config(args, LOAD_BALANCE_POLICIES),
            "failover": scheduler_config(args, FAILOVER_POLICIES),
        }
        from pilotfish.scheduler.rescheduler import ReschedulingPlanner

        for config in configs.values():
            ReschedulingPlanner(config)  # bad flags fail here, with the flag's name
    except (ConfigError, msgspec.ValidationError, ValueError) as exc:
        print(f"rescheduling flags: {exc}", file=sys.stderr)
        return 2
    base, label = load_trace(args.trace, args.trace_dir, args.seed)
    if args.duration > 0:
        base = take_duration(base, args.duration)
    trace = compress(base, args.load) if args.load != 1.0 else base
    arrivals = [r.arrival for r in trace]
    span = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    runs: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, Any]] = {}
    for scenario in scenarios:
        config = configs[scenario]
        cluster = ClusterConfig(
            engines=args.instances,
            engine=engine,
            observation_delay=args.observation_delay,
            rescheduling_interval=config.rescheduling_interval_ms / 1000.0,
        )
        mark = (args.failover_engine, min(arrivals) + args.failover_at * span) if scenario == "failover" else None
        runs[scenario], series[scenario] = {}, {}
        for arm, on in (("off", False), ("on", True)):
            if not args.no_progress:
                print(f"{scenario} / rescheduling {arm} ...", file=sys.stderr, flush=True)
            result, watch, planner = run_arm(cluster, config, trace, rescheduling=on, mark=mark)
            runs[scenario][arm] = arm_metrics(result, watch, planner, len(trace), args, mark)
            series[scenario][arm] = {"t": watch.times, "kv_max": watch.kv_max, "held": watch.held}
    wall = time.monotonic() - started

    args.out.mkdir(parents=True, exist_ok=True)
    plots, no_plots = write_plots(args.out, runs, series)
    example = configs[scenarios[0]]
    result = {
        "trace": label,
        "duration": args.duration,
        "load": args.load,
        "requests": len(trace),
        "span_seconds": span,
        "instances": args.instances,
        "profile": args.profile,
        "num_gpu_blocks": args.num_gpu_blocks,
        "migration_bandwidth_gbps": engine.migration_bandwidth_gbps,
        "scheduling_policy": args.scheduling_policy,
        "seed": args.seed,
        "observation_delay": args.observation_delay,
        "rescheduling": {
            "interval_ms": example.rescheduling_interval_ms,
            "method": args.migration_method,
            "load_metric": example.rescheduling_neutral_load_metric,
            "load_threshold": example.rescheduling_neutral_load_threshold,
            "min_difference": example.rescheduling_load_balance_threshold,
            "select": [
                example.rescheduling_req_select_rule,
                example.rescheduling_req_select_order,
                example.rescheduling_req_select_value,
            ],
            "policies": {s: configs[s].rescheduling_policies for s in scenarios},
            "failover_domain": example.failover_domain,
        },
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "runs": runs,
        "plots": plots,
        "no_plots": no_plots,
        "wall_seconds": wall,
        "host": platform.node(),
        "python": platform.python_version(),
    }
    md = render_markdown(result)
    write_report(args.out, "reschedule", result, md)
    print(md)
    ok = all(arm["integrity"]["ok"] for s in runs.values() for arm in s.values())
    return 0 if ok else 1


# ---- report -------------------------------------------------------------------------------------------------


def _f(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{digits}f}"


def _delta(off: float, on: float) -> str:
    if not off or math.isnan(off) or math.isnan(on):
        return ""
    return f" ({(on - off) / off:+.0%})"


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone."""
    r = result["rescheduling"]
    slo = result["slo"]
    md = [
        "# Rescheduling off vs on (virtual-time cluster)",
        "",
        f"Trace `{result['trace']}`"
        + (f", first {result['duration']:g} s" if result["duration"] > 0 else "")
        + f" at load {result['load']:g} ({result['requests']} requests over {result['span_seconds']:.0f} s); "
        f"{result['instances']} engines, profile `{result['profile']}`, {result['num_gpu_blocks']} KV blocks each, "
        f"{result['migration_bandwidth_gbps']:g} Gb/s between engines. Dispatch: Pilotfish full mode "
        f"`{result['scheduling_policy']}`, events heard {result['observation_delay'] * 1000:g} ms late. "
        f"Rescheduling every {r['interval_ms']} ms, method `{r['method']}`, load `{r['load_metric']}` >= "
        f"{r['load_threshold']:g} (min difference {r['min_difference']:g}), select {' '.join(map(str, r['select']))}. "
        f"Goodput: requests with TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:g} ms, per second "
        f"of arrivals. Same engines, arrivals and seed ({result['seed']}) in both arms. Wall time "
        f"{result['wall_seconds']:.0f} s on {result.get('host') or 'this machine'}.",
        "",
    ]
    for scenario, arms in result["runs"].items():
        title = {"load_balance": "Load balance", "failover": "Failover"}[scenario]
        md += [f"## {title} (policies: {', '.join(r['policies'][scenario])})", ""]
        md += ["| | rescheduling off | rescheduling on |", "|---|---|---|"]
        off, on = arms["off"], arms["on"]
        rows: list[tuple[str, Callable[[dict[str, Any]], float], float, int]] = [
            ("TTFT P50 (s)", lambda m: m["ttft"]["p50"], 1.0, 3),
            ("TTFT P99 (s)", lambda m: m["ttft"]["p99"], 1.0, 2),
            ("TPOT P50 (ms)", lambda m: m["tpot"]["p50"], 1000.0, 1),
            ("TPOT P99 (ms)", lambda m: m["tpot"]["p99"], 1000.0, 1),
            ("goodput (req/s)", lambda m: m["goodput_rps"], 1.0, 3),
            ("SLO attainment (%)", lambda m: m["slo_attainment"], 100.0, 1),
            ("KV usage, hottest engine minus mean (points)", lambda m: m["kv_usage_spread_mean"], 100.0, 1),
        ]
        for name, get, scale, digits in rows:
            md.append(
                f"| {name} | {_f(get(off), scale, digits)} | {_f(get(on), scale, digits)}{_delta(get(off), get(on))} |"
            )
        md.append(
            f"| migrations (requests moved) | {off['migrations']} ({off['migrated_requests']}) | "
            f"{on['migrations']} ({on['migrated_requests']}) |"
        )
        by = on["migrations_by_method"]
        md.append(
            f"| of which KV transfer / recompute (fallbacks) | | {by['kv_transfer']} / {by['recompute']} "
            f"({on['kv_transfer_fallbacks']}) |"
        )
        md.append(f"| preemptions | {off['preemptions']} | {on['preemptions']} |")
        md.append(
            f"| finished / requests | {off['finished']} / {off['requests']} | {on['finished']} / {on['requests']} |"
        )
        md.append(f"| token integrity (indices 0..n-1, each once) | {_integrity(off)} | {_integrity(on)} |")
        if "failover" in on:
            fo, fn = off["failover"], on["failover"]
            md.append(
                f"| engine {fo['engine']} marked at {fo['marked_at']:.1f} s: requests on it then | "
                f"{fo['held_at_mark']} | {fn['held_at_mark']} |"
            )
            md.append(
                f"| ... drained after (s) | {_f(fo['drain_seconds'], 1.0, 1)} | {_f(fn['drain_seconds'], 1.0, 1)} |"
            )
            md.append(
                f"| ... dispatched to / migrated into it after the mark | {fo['dispatched_after_mark']} / "
                f"{fo['migrated_in_after_mark']} | {fn['dispatched_after_mark']} / "
                f"{fn['migrated_in_after_mark']} |"
            )
        md.append("")
    md += ["## Plots", ""]
    plots = result["plots"]
    md += [f"![{p}]({p})" for p in plots] if plots else [f"None: {result.get('no_plots')}."]
    md += [
        "",
        "One seed and one trace slice per run: P99s rest on the slowest 1% of requests, so differences of a "
        "few percent are within what another slice can move.",
    ]
    return "\n".join(md)


def _integrity(m: dict[str, Any]) -> str:
    i = m["integrity"]
    return f"ok ({i['requests_checked']} requests)" if i["ok"] else f"FAILED: {i['errors']} errors"


def write_plots(
    out_dir: Path, runs: dict[str, dict[str, Any]], series: dict[str, dict[str, Any]]
) -> tuple[list[str], str | None]:
    """PNG files written (names), or the reason none were (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (`pip install 'pilotfish[bench]'`): no PNG plots"
    written: list[str] = []
    scenarios = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    metrics = (
        ("TTFT P50 (s)", "ttft", "p50", 1.0),
        ("TTFT P99 (s)", "ttft", "p99", 1.0),
        ("TPOT P99 (ms)", "tpot", "p99", 1000.0),
        ("goodput (req/s)", "goodput_rps", None, 1.0),
    )
    width = 0.38
    for ax, (label, key, q, scale) in zip(axes, metrics, strict=True):
        for j, arm in enumerate(("off", "on")):
            values = [(runs[s][arm][key][q] if q else runs[s][arm][key]) * scale for s in scenarios]
            ax.bar(
                [i + (j - 0.5) * width for i in range(len(scenarios))],
                values,
                width,
                label=f"rescheduling {arm}",
                color=("#999999", "#1f77b4")[j],
            )
        ax.set_xticks(range(len(scenarios)), [s.replace("_", " ") for s in scenarios])
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "reschedule_latency.png", dpi=110)
    plt.close(fig)
    written.append("reschedule_latency.png")
    fig, axes = plt.subplots(1, len(scenarios), figsize=(7 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for arm, color in (("off", "#999999"), ("on", "#1f77b4")):
            s = series[scenario][arm]
            if scenario == "failover":
                ax.plot(s["t"], s["held"], color=color, label=f"rescheduling {arm}")
                ax.axvline(runs[scenario][arm]["failover"]["marked_at"], color="red", linestyle=":", linewidth=1)
                ax.set_ylabel(f"requests on engine {runs[scenario][arm]['failover']['engine']}")
                ax.set_title("failover: the marked engine drains (red: marked)")
            else:
                ax.plot(s["t"], [v * 100 for v in s["kv_max"]], color=color, label=f"rescheduling {arm}", linewidth=1)
                ax.set_ylabel("highest KV usage of any engine (%)")
                ax.set_title("load balance: the hottest engine")
        ax.set_xlabel("virtual time (s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "reschedule_timeline.png", dpi=110)
    plt.close(fig)
    written.append("reschedule_timeline.png")
    return written, None
