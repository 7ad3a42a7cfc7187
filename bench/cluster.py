"""`pilotfish bench cluster`: scheduling policies side by side on the virtual-time cluster.

Every policy runs on identical engines (same profile, KV size, token budget) and identical
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
bench/peers.py; the oracle: bench/cluster_oracle.py; full mode on the virtual clock:
bench/cluster_full.py; tables, conclusions and plots: bench/cluster_report.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pilotfish.bench.cluster_policies import PolicySpec
    from pilotfish.simulator.cluster import ClusterConfig, ClusterResult, Router, RouteRequest
    from pilotfish.simulator.traces import Trace

DEFAULT_TRACE = "mooncake_synthetic.jsonl"
_SYNTHETIC_KEYS = {"groups": int, "prompts": int, "system": int, "question": int, "output": int, "rate": float,
                   "seed": int}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.bench.cluster_policies import DEFAULT_POLICIES

    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--trace", default=DEFAULT_TRACE,
                        help="Mooncake .jsonl, Azure .csv (name in ../shared/traces or a path), or "
                             "synthetic[:groups=8,prompts=32,system=1024,question=128,output=128,rate=10,seed=0], or "
                             "family:<system-prompt|multi-turn|tenants>[:knob=value,...] "
                             "(simulator/traces/families.py; ranges as low-high)")
    parser.add_argument("--trace-dir", default=None, help="folder of the shared traces (unset: ../shared/traces)")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of the trace's own timeline to replay, taken before compression (0: all)")
    parser.add_argument("--instances", type=int, default=16, help="simulated engines")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma list: round-robin, least-requests, power-of-two, pilotfish:<policy> (lite), "
                             "pilotfish-full:<policy> (full mode), llm-d, dynamo, sglang, oracle")
    parser.add_argument("--load", type=float, default=2.0,
                        help="time compression: 2 = twice the trace's rate (its latency CDFs are plotted)")
    parser.add_argument("--sweep", default="1,2,3",
                        help="comma list of loads to run (includes --load; empty: --load only)")
    parser.add_argument("--matrix-at", choices=("load", "sweep"), default="load",
                        help="where policies with a feature toggle in their name (pilotfish-full:load-balance"
                             "+predictor, ...-account) run: at --load only, or at every load of the sweep")
    parser.add_argument("--profile", default="llama3-8b-a100", help="engine step-time profile")
    parser.add_argument("--num-gpu-blocks", type=int, default=30000, help="KV blocks per engine (8B on an 80 GB A100)")
    parser.add_argument("--max-model-len", type=int, default=196608, help="fits the Mooncake trace's longest request")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT at most this many seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: TPOT at most this many seconds")
    parser.add_argument("--observation-delay", type=float, default=0.0,
                        help="seconds every router hears engine events late (token reports, finishes, full-mode "
                             "statuses); the same for all policies (llm-d's 50 ms scrape comes on top)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routers' random draws and of synthetic traces")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# ---- inputs -----------------------------------------------------------------------------------------------


def load_trace(spec: str, trace_dir: str | None, seed: int) -> tuple[Trace, str]:
    """The trace named by `spec`, and a label for the report."""
    from pilotfish.simulator.traces import (
        SharedPrefixSpec,
        load_azure,
        load_mooncake,
        resolve_trace,
        shared_prefix_trace,
    )

    if spec.startswith("family:"):  # a seeded workload family (simulator/traces/families.py)
        from pilotfish.simulator.traces.families import family_trace

        try:
            return family_trace(spec.partition(":")[2], seed), spec
        except ValueError as exc:
            raise SystemExit(f"--trace {spec}: {exc}") from None
    if spec == "synthetic" or spec.startswith("synthetic:"):
        values: dict[str, Any] = {"seed": seed}
        for item in filter(None, spec.partition(":")[2].split(",")):
            key, _, raw = item.partition("=")
            if key not in _SYNTHETIC_KEYS:
                raise SystemExit(f"--trace synthetic: unknown key {key!r} (known: {', '.join(_SYNTHETIC_KEYS)})")
            values[key] = _SYNTHETIC_KEYS[key](raw)
        names = {"prompts": "prompts_per_group", "system": "system_prompt_length", "question": "question_length",
                 "output": "output_length"}
        trace = shared_prefix_trace(SharedPrefixSpec(**{names.get(k, k): v for k, v in values.items()}))
        return trace, spec
    path = resolve_trace(spec, trace_dir)
    loader = load_azure if path.suffix == ".csv" else load_mooncake
    return loader(path), path.name


def parse_loads(load: float, sweep: str) -> list[float]:
    loads = {load}
    loads.update(float(x) for x in sweep.split(",") if x.strip())
    return sorted(loads)


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

        def on_finish(self, request_id: str, engine: int, now: float) -> None:
            router.on_finish(request_id, engine, now)

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
    from pilotfish.bench.cluster_policies import resolve_policies
    from pilotfish.bench.cluster_report import latency_samples, policy_metrics, write_plots
    from pilotfish.bench.report import write_report
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.traces import compress, take_duration

    started = time.monotonic()
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    engine = EngineConfig(profile=args.profile, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len)
    try:
        specs, skipped = resolve_policies(names, engine)
    except ValueError as exc:
        print(f"--policies: {exc}", file=sys.stderr)
        return 2
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if not specs:
        print("--policies: nothing left to run", file=sys.stderr)
        return 2
    base, label = load_trace(args.trace, args.trace_dir, args.seed)
    if args.duration > 0:
        base = take_duration(base, args.duration)
    loads = parse_loads(args.load, args.sweep)
    config = ClusterConfig(engines=args.instances, engine=engine, observation_delay=args.observation_delay)

    def runs_at(spec: PolicySpec, load: float) -> bool:
        return not spec.toggles or args.matrix_at == "sweep" or load == args.load

    plan = [(load, spec) for load in loads for spec in specs if runs_at(spec, load)]
    progress = Progress(len(base) * len(plan), enabled=not args.no_progress)
    sweep: dict[str, dict[str, dict[str, Any]]] = {str(load): {} for load in loads}
    samples: dict[str, dict[str, list[float]]] = {}
    traces = {load: compress(base, load) if load != 1.0 else base for load in loads}
    for load, spec in plan:
        trace = traces[load]
        progress.label = f"{spec.name} @ load {load:g}"
        result = run_policy(config, trace, spec, args.seed, progress)
        sweep[str(load)][spec.name] = policy_metrics(result, len(trace), args.slo_ttft, args.slo_tpot)
        if load == args.load:
            samples[spec.name] = latency_samples(result)
    progress.finish()
    wall = time.monotonic() - started

    args.out.mkdir(parents=True, exist_ok=True)
    plots, no_plots = write_plots(args.out, args.load, samples, loads, sweep, {s.name: s.family for s in specs})
    span = (max(r.arrival for r in base) - min(r.arrival for r in base)) if base else 0.0
    result = {
        "trace": label, "duration": args.duration, "requests": len(base), "span_seconds": span,
        "instances": args.instances, "profile": args.profile, "num_gpu_blocks": args.num_gpu_blocks,
        "loads": loads, "load": args.load, "seed": args.seed, "observation_delay": args.observation_delay,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "policies": {s.name: {"family": s.family, "description": s.description, "toggles": s.toggles,
                              "toggled_from": s.toggled_from} for s in specs},
        "matrix_at": args.matrix_at,
        "skipped": skipped, "runs": sweep, "plots": plots, "no_plots": no_plots, "wall_seconds": wall,
        "host": platform.node(), "python": platform.python_version(),
        # the machine is shared: its 1/5/15-minute load average at the end puts the wall time in context
        "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
    }
    md = render_markdown({"benchmark": "cluster", **result})
    write_report(args.out, "cluster", result, md)
    print(md)
    broken = [f"{name} @ load {load}" for load, runs in sweep.items() for name, m in runs.items()
              if m["integrity_errors"]]
    if broken:  # a migration lost or duplicated tokens: the figures cannot be trusted
        print(f"token integrity FAILED under: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


def _machine(result: dict[str, Any]) -> str:
    load = result.get("load_average")
    if not load:
        return ""
    return f", {result.get('cpus')} CPUs, load average {' / '.join(f'{x:.1f}' for x in load)} at the end"


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone, so a report can be redrawn without running again."""
    from pilotfish.bench.cluster_report import conclusions, knee, matrix, table

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
        f"{result['instances']} engines, profile `{result['profile']}`, {result['num_gpu_blocks']} KV blocks each; "
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
    md += ["", "## Plots", ""]
    plots = result["plots"]
    md += [f"![{p}]({p})" for p in plots] if plots else [f"None: {result.get('no_plots')}."]
    md += ["", "Migrations (\"migr\") count moves from the requests' records; only a policy with rescheduling on "
           "moves any. One seed per run: a P99 rests on the slowest 1% of requests, so differences of a few "
           "percent are within what another `--seed` or trace slice can move."]
    return "\n".join(md)
