"""`pilotfish bench cluster`: scheduling policies side by side on the virtual-time cluster.

Every policy runs on the same engines (same profile, KV size, token budget; `--step-scales` makes some
slower, the same ones for every policy) and identical
arrivals: one trace, sliced once, compressed by the load factor, the same for all; routers that
draw random numbers are seeded from `--seed`. A sweep repeats the whole set per load to find the
knee. Outputs DIR/result.json, DIR/report.md and, with matplotlib, latency CDFs and P99 TTFT
against load.

    pilotfish bench cluster --out DIR                                   # the default set
    pilotfish bench cluster --trace azure_code_2023.csv --instances 4 --load 2 --sweep "" --out DIR
    pilotfish bench cluster --trace synthetic:groups=16,rate=40 --policies oracle,dynamo --out DIR
    pilotfish bench cluster --policies pilotfish-full:slo,pilotfish-full:slo+dispatch_top_k=2 --out DIR
    pilotfish bench cluster --matrix-at sweep --out DIR          # the feature matrix at every load, not just --load

The feature matrix (full mode's shipped default with one feature flipped per arm: the in-flight
account, forward prediction, cache-aware ranking, rescheduling) runs at --load only unless
`--matrix-at sweep`, which keeps the default set within 15 minutes on 2 cores.

Policy names: bench/cluster_policies.py; the peers' reimplementations and their sources:
bench/peers.py; the oracle: bench/cluster_oracle.py; the scheduler core on the virtual clock (lite and
full mode): simulator/cluster/scheduler_router.py; tables, conclusions and plots: bench/cluster_report.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pilotfish.bench.cluster_policies import DEFAULT_POLICIES
from pilotfish.bench.options import DEFAULT_TRACE, ClusterRunOptions, StepScales, step_scales_note
from pilotfish.bench.traces import load_trace

if TYPE_CHECKING:
    from pilotfish.bench.cluster_policies import PolicySpec
    from pilotfish.simulator.cluster import ClusterConfig, ClusterResult, Router, RouteRequest
    from pilotfish.simulator.traces import Trace

# bench realtime, bench reschedule and the tests import these from here
__all__ = ["DEFAULT_TRACE", "ClusterBenchConfig", "Progress", "load_trace", "run", "run_policy"]


class ClusterBenchConfig(ClusterRunOptions, frozen=True):
    """Every knob of `bench cluster`, with its default (the flags and bench/README.md's table come from it)."""

    policies: Annotated[
        list[str],
        Meta(
            description="round-robin, least-requests, power-of-two, pilotfish:<policy> (lite), "
            "pilotfish-full:<policy> (full mode), llm-d, dynamo, sglang, oracle (bench/cluster_policies.py)"
        ),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_POLICIES))
    sweep: Annotated[
        list[float], Meta(description="loads to run; --load is always one of them (empty: --load only)")
    ] = msgspec.field(default_factory=lambda: [1.0, 2.0, 3.0])
    step_scales: StepScales = msgspec.field(default_factory=list)
    matrix_at: Annotated[
        Literal["load", "sweep"],
        Meta(
            description="where policies with a feature toggle in their name (pilotfish-full:load-balance"
            "+predictor, ...-account) run: load (at --load only) or sweep (at every load)"
        ),
    ] = "load"

    def loads(self) -> list[float]:
        """Every load of the sweep with --load in it, in order."""
        return sorted({self.load, *self.sweep})

    def runs_at(self, spec: PolicySpec, load: float) -> bool:
        """Whether `spec` runs at `load`: a feature arm only at --load unless --matrix-at sweep."""
        return not spec.toggles or self.matrix_at == "sweep" or load == self.load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, ClusterBenchConfig)


# ---- progress -------------------------------------------------------------------------------------------------


class Progress:
    """A one-line bar on stderr over every request of every run; redrawn at most 4 times a second."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.enabled = enabled
        self.started = time.monotonic()
        self._drawn = 0.0

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and now - self._drawn >= 0.25:
            self._drawn = now
            self.draw()

    def draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = time.monotonic() - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        sys.stderr.write(f"\r[{bar:<30}] {frac:5.1%} {self.label:<44.44} {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left ")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            self.draw()
            sys.stderr.write("\n")


def _counted(router: Router, progress: Progress) -> Router:
    """The router, with every routed request counted on the bar (the run loop is the driver's own)."""
    from pilotfish.simulator.cluster import Router as Base

    class Counted(Base):
        wants_status = router.wants_status

        def bind(self, engine_ids: list[str]) -> None:
            router.bind(engine_ids)

        def route(self, request: RouteRequest, now: float) -> int:
            progress.tick()
            return router.route(request, now)

        def on_progress(self, request_id: str, engine: int, generated_tokens: int, now: float) -> None:
            router.on_progress(request_id, engine, generated_tokens, now)

        def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
            router.on_finish(request_id, engine, now, answer_tokens)

        def on_status(self, engine: int, status: Any, now: float) -> None:
            router.on_status(engine, status, now)

    return Counted()


# ---- the run ------------------------------------------------------------------------------------------------


def run_policy(config: ClusterConfig, trace: Trace, spec: PolicySpec, seed: int, progress: Progress) -> ClusterResult:
    """One policy over one trace on fresh engines (and its rescheduler, if it has one); the ClusterResult."""
    import dataclasses

    from pilotfish.simulator.cluster import ClusterSim

    router = spec.make(seed)
    observe = getattr(router, "observe_engine", None)
    rescheduler = spec.rescheduler(router) if spec.rescheduler is not None else None
    if rescheduler is not None:
        config = dataclasses.replace(config, rescheduling_interval=spec.rescheduling_interval)
    sim = ClusterSim(config, _counted(router, progress), observers=[observe] if observe else (),
                     rescheduler=rescheduler)
    attach = getattr(router, "attach_engines", None)
    if attach is not None:
        attach(sim.engines)
    return sim.run(trace)


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(ClusterBenchConfig, args)
    started = time.monotonic()
    plan = set_up(cfg)
    sweep, samples = measure(cfg, plan)
    result = report(cfg, plan, sweep, samples, Path(args.out), time.monotonic() - started)
    return 1 if integrity_failed(result) else 0


# ---- set-up ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What `measure` runs: the policies, the trace slice and every (load, policy) run, in order."""

    specs: list[PolicySpec]
    skipped: list[str]  # policies left out, each with its reason
    base: Trace  # the slice, uncompressed
    label: str
    loads: list[float]
    traces: dict[float, Trace]  # the slice at each load
    cluster: ClusterConfig
    runs: list[tuple[float, PolicySpec]]


def set_up(cfg: ClusterBenchConfig) -> Plan:
    """Resolve the policies (ConfigError names a bad one), load and slice the trace, plan the runs."""
    from pilotfish.bench.cluster_policies import resolve_policies
    from pilotfish.bench.traces import compressed
    from pilotfish.config import ConfigError
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.engine.step_time import repeated_scales

    engine = cfg.engine_config()
    try:
        specs, skipped = resolve_policies(cfg.policies, engine)
    except ValueError as exc:
        raise ConfigError(f"--policies: {exc}") from None
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not specs:
        raise ConfigError("--policies: nothing left to run")
    base, label = cfg.base_trace()
    loads = cfg.loads()
    return Plan(
        specs=specs, skipped=skipped, base=base, label=label, loads=loads,
        traces={load: compressed(base, load) for load in loads},
        cluster=ClusterConfig(engines=cfg.instances, engine=engine, observation_delay=cfg.observation_delay,
                              step_scales=repeated_scales(cfg.step_scales, cfg.instances)),
        runs=[(load, spec) for load in loads for spec in specs if cfg.runs_at(spec, load)],
    )  # fmt: skip


# ---- measurement ----------------------------------------------------------------------------------------------


Sweep = dict[str, dict[str, dict[str, Any]]]  # load (as a string, as in result.json) -> policy -> metrics


def measure(cfg: ClusterBenchConfig, plan: Plan) -> tuple[Sweep, dict[str, dict[str, list[float]]]]:
    """Every planned run: the metrics per load and policy, and the latency samples at --load (the CDFs)."""
    from pilotfish.bench.cluster_report import latency_samples, policy_metrics

    progress = Progress(len(plan.base) * len(plan.runs), enabled=cfg.progress)
    sweep: Sweep = {str(load): {} for load in plan.loads}
    samples: dict[str, dict[str, list[float]]] = {}
    for load, spec in plan.runs:
        trace = plan.traces[load]
        progress.label = f"{spec.name} @ load {load:g}"
        result = run_policy(plan.cluster, trace, spec, cfg.seed, progress)
        sweep[str(load)][spec.name] = policy_metrics(result, len(trace), cfg.slo_ttft, cfg.slo_tpot)
        if load == cfg.load:
            samples[spec.name] = latency_samples(result)
    progress.finish()
    return sweep, samples


# ---- report ---------------------------------------------------------------------------------------------------


def report(
    cfg: ClusterBenchConfig, plan: Plan, sweep: Sweep, samples: dict[str, dict[str, list[float]]], out: Path,
    wall: float,
) -> dict[str, Any]:  # fmt: skip
    """Plots, result.json and report.md in `out` (the report printed too); the result."""
    from pilotfish.bench.cluster_report import write_plots
    from pilotfish.bench.report import write_report
    from pilotfish.bench.traces import arrival_span

    out.mkdir(parents=True, exist_ok=True)
    families = {s.name: s.family for s in plan.specs}
    plots, no_plots = write_plots(out, cfg.load, samples, plan.loads, sweep, families)
    result = {
        "trace": plan.label, "duration": cfg.duration, "requests": len(plan.base),
        "span_seconds": arrival_span(plan.base), "instances": cfg.instances, "profile": cfg.profile,
        "num_gpu_blocks": cfg.num_gpu_blocks, "loads": plan.loads, "load": cfg.load, "seed": cfg.seed,
        "observation_delay": cfg.observation_delay, "slo": cfg.slo(), "step_scales": cfg.step_scales,
        "policies": {s.name: {"family": s.family, "description": s.description, "toggles": s.toggles,
                              "toggled_from": s.toggled_from} for s in plan.specs},
        "matrix_at": cfg.matrix_at,
        "skipped": plan.skipped, "runs": sweep, "plots": plots, "no_plots": no_plots, "wall_seconds": wall,
        "settings": msgspec.structs.asdict(cfg),
        "host": platform.node(), "python": platform.python_version(),
        # the machine is shared: its 1/5/15-minute load average at the end puts the wall time in context
        "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
    }  # fmt: skip
    md = render_markdown({"benchmark": "cluster", **result})
    write_report(out, "cluster", result, md)
    print(md)
    return result


def integrity_failed(result: dict[str, Any]) -> bool:
    """Whether a migration lost or duplicated tokens in any run (said on stderr): the figures cannot be trusted."""
    broken = [f"{name} @ load {load}" for load, runs in result["runs"].items() for name, m in runs.items()
              if m["integrity_errors"]]  # fmt: skip
    if broken:
        print(f"token integrity FAILED under: {', '.join(broken)}", file=sys.stderr)
    return bool(broken)


def _machine(result: dict[str, Any]) -> str:
    load = result.get("load_average")
    if not load:
        return ""
    return f", {result.get('cpus')} CPUs, load average {' / '.join(f'{x:.1f}' for x in load)} at the end"


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone, so a report can be redrawn without running again."""
    from pilotfish.bench.cluster_report import conclusions, knee, matrix, table
    from pilotfish.bench.report import plots_section

    loads = result["loads"]
    sweep = result["runs"]
    families = {name: p["family"] for name, p in result["policies"].items()}
    slo = result["slo"]
    duration = result["duration"]
    md = [
        "# Virtual-time cluster: policies side by side",
        "",
        f"Trace `{result['trace']}`" + (f", first {duration:g} s" if duration > 0 else "")
        + f" ({result['requests']} requests over {result.get('span_seconds', 0):.0f} s before compression); "
        f"{result['instances']} engines, profile `{result['profile']}`, {result['num_gpu_blocks']} KV blocks each"
        + step_scales_note(result.get("step_scales")) + "; "
        f"loads {', '.join(f'{x:g}' for x in loads)} (time compression"
        + ("; the feature arms at load " + f"{result['load']:g} only" if result.get("matrix_at", "load") == "load"
           and any(p.get("toggles") for p in result["policies"].values()) else "")
        + f"); seed {result['seed']}; routers hear engine "
        f"events {result.get('observation_delay', 0.0) * 1000:g} ms late. Goodput SLO: "
        f"TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:g} ms; goodput counts the requests that "
        "met both, per second of the trace's arrivals at that load, and \"SLO met\" is their share of all "
        "requests (the knee uses it). Every policy saw the same engines and the same arrivals. "
        f"Wall time {result['wall_seconds']:.0f} s on {result.get('host') or 'this machine'} "
        f"(Python {result['python']}" + _machine(result) + ").",
        "",
        "Policies:",
        "",
        *[f"- `{name}` ({p['family']}): {p['description']}" for name, p in result["policies"].items()],
        *[f"- skipped: {line}" for line in result["skipped"]],
        "",
    ]
    for load in loads:
        md += [f"## Load {load:g}", "", *table(sweep[str(load)], families), ""]
    toggled_from = {name: p.get("toggled_from") for name, p in result["policies"].items()}
    for load in loads:
        rows = matrix(sweep[str(load)], toggled_from)
        if rows:
            md += [f"## One feature at a time (load {load:g})", "",
                   "Each arm flips one feature of the policy it is set against; the percentages are its change "
                   "from that policy, and the verdict ranks as the conclusions do (SLO met, then P99 TTFT). "
                   "`-account` drops each in-flight account entry as the core makes it (a bench-only switch: the "
                   "scheduler has no flag for it); `+rescheduling` runs the scheduler's ReschedulingPlanner with "
                   "its default settings every interval over the router's own view, moving requests as the "
                   "llumlets would.", "", *rows, ""]
    md += ["## Conclusions (computed from the tables)", ""]
    for load in loads:
        md += conclusions(load, sweep[str(load)], families)
    if len(loads) > 1:
        md += ["", "## Knee", "", *knee(loads, sweep, slo["ttft_s"], list(result["policies"]))]
    md += ["", "## Plots", "", *plots_section(result["plots"], result.get("no_plots"))]
    md += ["", "Migrations (\"migr\") count moves from the requests' records; only a policy with rescheduling on "
           "moves any. One seed per run: a P99 rests on the slowest 1% of requests, so differences of a few "
           "percent are within what another `--seed` or trace slice can move."]
    return "\n".join(md)
