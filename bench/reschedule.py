"""`pilotfish bench reschedule`: the rescheduler off and on, side by side, on the virtual-time cluster.

Full-mode Pilotfish dispatch (the real SchedulerCore, simulator/cluster/scheduler_router.py) on identical engines
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
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pilotfish.bench.options import ClusterRunOptions, Duration, Instances, Load
from pilotfish.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from pilotfish.simulator.cluster import ClusterConfig, ClusterResult, ClusterSim, MigrationOrder
    from pilotfish.simulator.traces import Trace

SCENARIOS = ("load_balance", "failover")
LOAD_BALANCE_POLICIES = ["decode_load", "neutral_load"]
# the scheduler's shipped default list: failover first, then load balance
FAILOVER_POLICIES = SchedulerConfig().rescheduling_policies


class RescheduleBenchConfig(ClusterRunOptions, frozen=True):
    """Every knob of `bench reschedule`, with its default (the flags and bench/README.md's table come from it)."""

    num_gpu_blocks: Annotated[
        int, Meta(ge=1, description="KV blocks per engine: fewer than bench cluster's 30000 so KV pressure builds up")
    ] = 16000
    duration: Duration = 300.0
    load: Load = 1.0
    instances: Instances = 8
    scenarios: Annotated[
        list[Literal["load_balance", "failover"]], Meta(min_length=1, description="scenarios to run, in order")
    ] = msgspec.field(default_factory=lambda: list(SCENARIOS))
    scheduling_policy: Annotated[str, Meta(description="the dispatch policy (full mode)")] = "load-balance"
    migration_bandwidth_gbps: Annotated[
        float | None, Meta(description="KV-transfer link between engines, Gb/s (unset: the engine config's default)")
    ] = None
    migration_method: Annotated[
        Literal["auto", "recompute", "kv_transfer"],
        Meta(description="--rescheduling-migration-method; auto is a KV transfer here (the engines model a link)"),
    ] = "auto"
    rescheduling_interval_ms: Annotated[
        int | None, Meta(description="period of the rescheduling loop (unset: the scheduler's default)")
    ] = None
    load_threshold: Annotated[
        float | None,
        Meta(description="--rescheduling-{decode,neutral}-load-threshold (unset: the scheduler's default)"),
    ] = None
    select_rule: Annotated[str | None, Meta(description="--rescheduling-req-select-rule (unset: default)")] = None
    select_order: Annotated[str | None, Meta(description="--rescheduling-req-select-order (unset: default)")] = None
    select_value: Annotated[float | None, Meta(description="--rescheduling-req-select-value (unset: default)")] = None
    failover_engine: Annotated[int, Meta(ge=0, description="failover: the engine marked unschedulable")] = 0
    failover_at: Annotated[
        float,
        Meta(ge=0, description="failover: when it is marked, as a fraction of the compressed slice's arrival span"),
    ] = 0.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, RescheduleBenchConfig)


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


def scheduler_config(cfg: RescheduleBenchConfig, policies: list[str]) -> Any:
    from pilotfish.scheduler.config import SchedulerConfig

    fields: dict[str, Any] = {
        "enable_full_mode_scheduling": True,
        "scheduling_policy": cfg.scheduling_policy,
        "enable_rescheduling": True,
        "rescheduling_policies": policies,
        "rescheduling_migration_method": cfg.migration_method,
    }
    optional = {
        "rescheduling_interval_ms": cfg.rescheduling_interval_ms,
        "rescheduling_decode_load_threshold": cfg.load_threshold,
        "rescheduling_neutral_load_threshold": cfg.load_threshold,
        "rescheduling_req_select_rule": cfg.select_rule,
        "rescheduling_req_select_order": cfg.select_order,
        "rescheduling_req_select_value": cfg.select_value,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return SchedulerConfig(**fields)


def run_arm(
    cluster: ClusterConfig, scheduler: Any, trace: Trace, *, rescheduling: bool, mark: tuple[int, float] | None
) -> tuple[ClusterResult, Watch, Any]:
    """One run: full-mode dispatch, the rescheduler on or off, an engine marked unschedulable at a time."""
    from pilotfish.scheduler.rescheduler import ReschedulingPlanner
    from pilotfish.simulator.cluster import ClusterSim, PlannerRescheduler, SchedulerRouter

    router = SchedulerRouter(scheduler, engine=cluster.engine)
    planner = PlannerRescheduler(ReschedulingPlanner(scheduler), router) if rescheduling else None
    watch = Watch(planner, watch_engine=mark[0] if mark else None, marked_at=mark[1] if mark else None)
    sim = ClusterSim(cluster, router, observers=[router.observe_engine], rescheduler=watch)
    if mark is not None:
        k, at = mark
        sim.at(at, lambda: sim.set_schedulable(k, False))
    return sim.run(trace), watch, planner


def arm_metrics(
    result: ClusterResult,
    watch: Watch,
    planner: Any,
    requests: int,
    cfg: RescheduleBenchConfig,
    mark: tuple[int, float] | None,
) -> dict[str, Any]:
    from pilotfish.bench.cluster_report import policy_metrics

    m = policy_metrics(result, requests, cfg.slo_ttft, cfg.slo_tpot)
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
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(RescheduleBenchConfig, args)
    started = time.monotonic()
    setup = set_up(cfg)
    runs, series = measure(cfg, setup)
    result = report(cfg, setup, runs, series, Path(args.out), time.monotonic() - started)
    return 0 if all(arm["integrity"]["ok"] for s in result["runs"].values() for arm in s.values()) else 1


@dataclass(frozen=True)
class Setup:
    """What both scenarios share: validated scheduler configs, the engine, the compressed slice."""

    configs: dict[str, Any]  # scenario -> SchedulerConfig
    engine: Any  # EngineConfig
    trace: Trace
    label: str
    start: float  # the first arrival
    span: float  # seconds from the first arrival to the last


def set_up(cfg: RescheduleBenchConfig) -> Setup:
    """The scheduler's config per scenario (a bad rescheduling flag fails here, named), the engine, the slice."""
    from pilotfish.bench.traces import arrival_span, compressed
    from pilotfish.config import ConfigError
    from pilotfish.scheduler.rescheduler import ReschedulingPlanner

    if not 0 <= cfg.failover_engine < cfg.instances:
        raise ConfigError(f"--failover-engine: {cfg.failover_engine} is not one of the {cfg.instances} engines")
    bandwidth = cfg.migration_bandwidth_gbps
    engine = cfg.engine_config(**({"migration_bandwidth_gbps": bandwidth} if bandwidth is not None else {}))
    try:
        configs = {
            "load_balance": scheduler_config(cfg, LOAD_BALANCE_POLICIES),
            "failover": scheduler_config(cfg, FAILOVER_POLICIES),
        }
        for config in configs.values():
            ReschedulingPlanner(config)  # bad flags fail here, with the flag's name
    except (ConfigError, msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"rescheduling flags: {exc}") from None
    base, label = cfg.base_trace()
    trace = compressed(base, cfg.load)
    start = min((r.arrival for r in trace), default=0.0)
    return Setup(configs=configs, engine=engine, trace=trace, label=label, start=start, span=arrival_span(trace))


def measure(cfg: RescheduleBenchConfig, setup: Setup) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each scenario with rescheduling off, then on: the metrics and the watcher's series per arm."""
    from pilotfish.simulator.cluster import ClusterConfig

    runs: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, Any]] = {}
    for scenario in cfg.scenarios:
        config = setup.configs[scenario]
        cluster = ClusterConfig(
            engines=cfg.instances,
            engine=setup.engine,
            observation_delay=cfg.observation_delay,
            rescheduling_interval=config.rescheduling_interval_ms / 1000.0,
        )
        at = setup.start + cfg.failover_at * setup.span
        mark = (cfg.failover_engine, at) if scenario == "failover" else None
        runs[scenario], series[scenario] = {}, {}
        for arm, on in (("off", False), ("on", True)):
            if cfg.progress:
                print(f"{scenario} / rescheduling {arm} ...", file=sys.stderr, flush=True)
            result, watch, planner = run_arm(cluster, config, setup.trace, rescheduling=on, mark=mark)
            runs[scenario][arm] = arm_metrics(result, watch, planner, len(setup.trace), cfg, mark)
            series[scenario][arm] = {"t": watch.times, "kv_max": watch.kv_max, "held": watch.held}
    return runs, series


def report(
    cfg: RescheduleBenchConfig,
    setup: Setup,
    runs: dict[str, dict[str, Any]],
    series: dict[str, dict[str, Any]],
    out: Path,
    wall: float,
) -> dict[str, Any]:
    """Plots, result.json and report.md in `out` (the report printed too); the result."""
    from pilotfish.bench.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    plots, no_plots = write_plots(out, runs, series)
    example = setup.configs[cfg.scenarios[0]]
    result = {
        "trace": setup.label,
        "duration": cfg.duration,
        "load": cfg.load,
        "requests": len(setup.trace),
        "span_seconds": setup.span,
        "instances": cfg.instances,
        "profile": cfg.profile,
        "num_gpu_blocks": cfg.num_gpu_blocks,
        "migration_bandwidth_gbps": setup.engine.migration_bandwidth_gbps,
        "scheduling_policy": cfg.scheduling_policy,
        "seed": cfg.seed,
        "observation_delay": cfg.observation_delay,
        "rescheduling": {
            "interval_ms": example.rescheduling_interval_ms,
            "method": cfg.migration_method,
            "load_metric": example.rescheduling_neutral_load_metric,
            "load_threshold": example.rescheduling_neutral_load_threshold,
            "min_difference": example.rescheduling_load_balance_threshold,
            "select": [
                example.rescheduling_req_select_rule,
                example.rescheduling_req_select_order,
                example.rescheduling_req_select_value,
            ],
            "policies": {s: setup.configs[s].rescheduling_policies for s in cfg.scenarios},
            "failover_domain": example.failover_domain,
        },
        "slo": cfg.slo(),
        "settings": msgspec.structs.asdict(cfg),
        "runs": runs,
        "plots": plots,
        "no_plots": no_plots,
        "wall_seconds": wall,
        "host": platform.node(),
        "python": platform.python_version(),
    }
    md = render_markdown(result)
    write_report(out, "reschedule", result, md)
    print(md)
    return result


# ---- report -------------------------------------------------------------------------------------------------


def _f(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{digits}f}"


def _delta(off: float, on: float) -> str:
    if not off or math.isnan(off) or math.isnan(on):
        return ""
    return f" ({(on - off) / off:+.0%})"


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone."""
    from pilotfish.bench.report import plots_section

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
    md += ["## Plots", "", *plots_section(result["plots"], result.get("no_plots"))]
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
    from pilotfish.bench.report import NO_MATPLOTLIB, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
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
    written.append(save_figure(plt, fig, out_dir / "reschedule_latency.png"))
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
    written.append(save_figure(plt, fig, out_dir / "reschedule_timeline.png"))
    return written, None
