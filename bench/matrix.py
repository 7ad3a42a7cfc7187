"""`pilotfish bench matrix`: the shipped defaults against round-robin, the peers and the oracle over a
workload matrix, on the virtual-time cluster.

A cell is (workload, fleet size, load). Workloads are the seeded families of
simulator/traces/families.py and the shared traces (read in place from ../shared/traces or
`--traces-dir`); fleets are 16 and 64 engines; loads are fractions of the fleet's *knee* for that
workload. Every policy in a cell sees the same engines and the same arrivals; each cell runs once
per seed (a seed draws another family trace, another window of a shared trace, and other router
draws), and the report gives the mean and the range over seeds.

The knee: the highest arrival rate at which round-robin's SLO attainment (TTFT and TPOT both met)
is at least 90% (`--knee-attainment`) of what it reaches lightly loaded (a quarter of the starting
rate; Mooncake's longest prompts miss a 2 s TTFT even alone), on the cell's own trace, first seed.
It is found by a short search: the rate doubles until round-robin falls below the mark, then
`--knee-steps` bisections (geometric) narrow the bracket, and the knee is the bracket's lower end
(a rate measured to pass). The larger fleets' searches start from the smallest fleet's knee scaled
by the fleet. Load L then means L x the knee's arrival rate, applied as time compression of the
same trace. A cell holds `--requests-per-cell` requests whatever the fleet, so the 64-engine cells
are shorter bursts (a quarter of the requests per engine), not a steady state: the default size is
meant to fit 15 minutes on 2 cores (22 min 46 s on this project's 2-core host: bench/RESULTS.md).

    pilotfish bench matrix --out DIR              # the default size (2 worker processes)
    pilotfish bench matrix --quick --out DIR      # two workloads, one fleet, one seed: a smoke run
    pilotfish bench matrix --workloads family:rag,trace:mooncake_synthetic.jsonl --fleets 16 --out DIR

`pilotfish` and `pilotfish-full` are whatever ships (the scheduler's default policy, no flags).
Outputs DIR/result.json, DIR/report.md and DIR/heatmap.png (policy x cell, goodput relative to the
best peer reproduction). The simulation machinery is bench/cluster.py's; this module only plans
the cells, finds the knees and reports.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import SloOptions, StepScales, TraceDir, step_scales_note

PEERS = ("llm-d", "dynamo", "sglang")  # the reproductions of other routers (bench/peers.py)
LOCAL_PEERS = ("sglang", "power-of-two", "least-requests")  # router-local: what lite mode is held against
SHIPPED = ("pilotfish", "pilotfish-full")
DEFAULT_POLICIES = (*SHIPPED, "round-robin", "least-requests", "power-of-two", *PEERS, "oracle")
# system-prompt and bursty with longer turns than the family's default, so that a cell's trace can load
# an engine past the SLO at all (with 32-512-token turns, round-robin meets it even when every request of
# a cell arrives at once)
DEFAULT_WORKLOADS = (
    "family:system-prompt:turn=256-2048",
    "family:multi-turn",
    "family:tenants",
    "family:rag",
    "family:heavy-tail",
    "family:bursty:turn=256-2048",
    "trace:mooncake_synthetic.jsonl",
    "trace:azure_code_2023.csv",
)


Workloads = Annotated[
    list[str],
    Meta(description="family:<name>[:knob=value;...] (simulator/traces/families.py; knobs separated by ';' "
                     "here) or trace:<file in the traces folder, or a path: Mooncake-style .jsonl, Azure or "
                     "BurstGPT .csv>"),
]
Policies = Annotated[
    list[str], Meta(description="bench cluster policy names; pilotfish and pilotfish-full are what ships")
]


class MatrixConfig(SloOptions, frozen=True):
    """Every knob of the matrix, with its default size (the CLI flags and bench/README.md's table
    come from it; the engine and SLO options are bench/options.py's)."""

    workloads: Workloads = msgspec.field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    policies: Policies = msgspec.field(default_factory=lambda: list(DEFAULT_POLICIES))
    fleets: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(description="engines per fleet")] = msgspec.field(
        default_factory=lambda: [16, 64])
    loads: Annotated[list[Annotated[float, Meta(gt=0)]], Meta(
        description="loads as fractions of round-robin's knee")] = msgspec.field(
        default_factory=lambda: [0.5, 0.8, 1.0, 1.2])
    seeds: Annotated[list[int], Meta(description="seeds (synthetic traces, windows of a shared one, routers)")] = (
        msgspec.field(default_factory=lambda: [0, 1]))
    # trace length of a cell, the same for every fleet (64 engines get a quarter as many per engine as 16:
    # their cells are shorter bursts, not a steady state)
    requests_per_cell: Annotated[int, Meta(ge=1, description="requests in a cell's trace, whatever the fleet")] = 1024
    knee_attainment: Annotated[float, Meta(gt=0, le=1, description=(
        "the knee: the highest rate at which round-robin's SLO attainment is at least this share of its "
        "attainment at a quarter of the starting rate"))] = 0.9
    knee_steps: Annotated[int, Meta(ge=0, description="bisections after the doubling")] = 2
    knee_doublings: Annotated[int, Meta(ge=1, description="most doublings (or halvings) while bracketing the knee")] = 8
    traces_dir: TraceDir = None
    step_scales: StepScales = msgspec.field(default_factory=list)
    jobs: Annotated[int, Meta(ge=1, description="worker processes (the machine is shared: keep it low)")] = 2
    quick: Annotated[bool, Meta(description=(
        "a smoke-size matrix (two workloads, 16 engines, two loads, one seed, short traces) for what is left "
        "at its default"))] = False


QUICK = {"workloads": [DEFAULT_WORKLOADS[0], "family:rag"], "fleets": [16], "loads": [0.8, 1.2], "seeds": [0],
         "requests_per_cell": 256, "knee_steps": 1, "knee_doublings": 6, "jobs": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, MatrixConfig)


def config_from_args(args: argparse.Namespace) -> MatrixConfig:
    """The struct from the flags typed; --quick replaces what the user left at its default."""
    from pilotfish.config import _UNSET, struct_from_args

    config = struct_from_args(MatrixConfig, args)
    if not config.quick:
        return config
    typed = {name for name in MatrixConfig.__struct_fields__ if getattr(args, name, _UNSET) is not _UNSET}
    return msgspec.structs.replace(config, **{k: v for k, v in QUICK.items() if k not in typed})


# ---- set-up: traces and runs (each a pure function of its arguments, so workers can run them) ------------


# the most requests read from a trace file: the cells' windows come from its start, and a production trace of
# millions of rows (BurstGPT's) would otherwise be read whole by every worker
SHARED_TRACE_REQUESTS = 1 << 16


@lru_cache(maxsize=8)
def _shared_trace(name: str, traces_dir: str | None) -> Any:
    from pilotfish.simulator.traces import load_trace_file, resolve_trace

    path = resolve_trace(name, traces_dir)  # read in place, never copied
    return load_trace_file(path, limit=SHARED_TRACE_REQUESTS)


@lru_cache(maxsize=64)
def base_trace(workload: str, requests: int, seed: int, traces_dir: str | None) -> Any:
    """The workload's trace of `requests` requests at its own rate (load 1 of its own timeline)."""
    import dataclasses

    kind, _, rest = workload.partition(":")
    if kind == "family":
        from pilotfish.simulator.traces.families import family_trace

        name, _, knobs = rest.partition(":")
        knobs = knobs.replace(";", ",")
        count = f"conversations={max(1, requests // 5)}" if name == "multi-turn" else f"requests={requests}"
        trace = family_trace(f"{name}:{count}" + (f",{knobs}" if knobs else ""), seed)
        return trace[:requests]
    if kind == "trace":
        full = _shared_trace(rest, traces_dir)
        if len(full) < requests:
            raise ValueError(f"{workload}: {len(full)} requests, the cell needs {requests}")
        # seed k takes the k-th window (wrapping), re-based to start at 0
        start = (seed * requests) % max(1, len(full) - requests + 1)
        window = full[start:start + requests]
        t0 = window[0].arrival
        return [dataclasses.replace(r, arrival=r.arrival - t0 + 1e-3) for r in window]
    raise ValueError(f"workload {workload!r}: neither family:<name> nor trace:<file>")


def trace_rate(trace: Any) -> float:
    """Mean arrival rate (requests per second) of a trace."""
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace)
    return len(trace) / span if span > 0 else math.inf


def run_cell(config: MatrixConfig, workload: str, engines: int, seed: int, factor: float, policy: str) -> dict:
    """One policy on one cell: the trace compressed by `factor`, on `engines` fresh engines."""
    from pilotfish.bench.cluster import Progress, run_policy
    from pilotfish.bench.cluster_policies import policy_spec
    from pilotfish.bench.cluster_report import policy_metrics
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.engine.step_time import repeated_scales
    from pilotfish.simulator.traces import compress

    engine = EngineConfig(profile=config.profile, num_gpu_blocks=config.num_gpu_blocks,
                          max_model_len=config.max_model_len)
    trace = compress(base_trace(workload, config.requests_per_cell, seed, config.traces_dir), factor)
    spec = policy_spec(policy, engine)
    cluster = ClusterConfig(engines=engines, engine=engine, step_scales=repeated_scales(config.step_scales, engines))
    result = run_policy(cluster, trace, spec, seed, Progress(1, False))
    m = policy_metrics(result, len(trace), config.slo_ttft, config.slo_tpot)
    keep = ("goodput_rps", "slo_attainment", "prefix_cache_hit_rate", "preemptions", "finished", "requests",
            "integrity_errors")
    out = {k: m[k] for k in keep}
    out.update({"ttft_p99": m["ttft"]["p99"], "tpot_p99": m["tpot"]["p99"], "queueing_p99": m["queueing"]["p99"],
                "ttft_p50": m["ttft"]["p50"], "wall_seconds": m["wall_seconds"]})
    return out


def find_knee(config: MatrixConfig, workload: str, engines: int, start: float,
              runs: dict[float, dict] | None = None) -> dict:
    """Round-robin's knee on this workload and fleet (the first seed): see the module docstring.

    `bounded` is False when round-robin still met the mark at the highest rate tried (the cell's
    requests arrive almost at once there): the loads are then fractions of that rate. `runs`, if
    given, gets each probe's run by its compression."""
    seed = config.seeds[0]
    probes: list[tuple[float, float]] = []

    def met(factor: float) -> float:
        run = run_cell(config, workload, engines, seed, factor, "round-robin")
        if runs is not None:
            runs[factor] = run
        probes.append((factor, run["slo_attainment"]))
        return run["slo_attainment"]

    # the mark: a share of what round-robin reaches lightly loaded (a trace whose longest prompts miss
    # the TTFT SLO even alone, as Mooncake's do, never reaches 90% outright)
    light = met(start / 4)
    mark = config.knee_attainment * light

    def ok(factor: float) -> bool:
        return met(factor) >= mark

    lo, hi = None, None
    f = start
    for _ in range(config.knee_doublings):  # double (or halve) until the mark is bracketed
        if ok(f):
            lo = f
            if hi is not None:
                break
            f *= 2
        else:
            hi = f
            if lo is not None:
                break
            f /= 2
    if lo is None:
        raise RuntimeError(f"{workload} x {engines}: round-robin misses {mark:.0%} even at compression {f * 2:.3g}")
    rate_of = trace_rate(base_trace(workload, config.requests_per_cell, seed, config.traces_dir))
    if hi is None:  # never fell below: the knee is past what this trace can show
        return {"factor": lo, "rate_rps": rate_of * lo, "bracket": [lo, None], "probes": probes,
                "light_attainment": light, "mark": mark, "bounded": False}
    for _ in range(config.knee_steps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"factor": lo, "rate_rps": rate_of * lo, "bracket": [lo, hi], "probes": probes,
            "light_attainment": light, "mark": mark, "bounded": True}


# A cell allocates millions of short-lived objects that never form cycles; with the default threshold
# (700) the cyclic collector runs so often it costs 4-9% of a cell (measured). Results do not depend on it.
GC_THRESHOLD = (50_000, 20, 20)


def _fewer_collections() -> None:
    gc.set_threshold(*GC_THRESHOLD)


def _knee_and_probes(config: MatrixConfig, workload: str, engines: int, start: float) -> tuple[dict, dict[float, dict]]:
    """find_knee, and its probes' runs by compression: round-robin's run of a cell whose compression
    a probe ran (load 1 is the knee itself; load 0.5 wherever the search probed half the knee: 23
    of the default's 1,152 runs in the last full run) is that probe's, the same pure function of the
    same arguments, so it is not run twice."""
    runs: dict[float, dict] = {}
    return find_knee(config, workload, engines, start, runs), runs


def _given(result: Any) -> Any:
    return result


# A job: (priority, key, function, arguments); lower priorities start first (knees, which unlock runs).
Job = tuple[int, Any, Callable[..., Any], tuple]


def _run_graph(config: MatrixConfig, first: list[Job], then: Callable[[Any, Any], list[Job]]) -> dict[Any, Any]:
    """Run `first`, and each job `then(key, result)` returns as a job finishes; every result by key.

    Jobs start as soon as what they need is known, not phase by phase: a workload's cells start
    once its knee is found, while other knees are still searched, so no worker waits at a barrier
    for the slowest search (each job is a pure function of its arguments, so the results are the
    same in any order)."""
    results: dict[Any, Any] = {}
    waiting: list[tuple[int, int, Any, Callable[..., Any], tuple]] = []
    order = itertools.count()

    def push(jobs: list[Job]) -> None:
        for priority, key, fn, args in jobs:
            heapq.heappush(waiting, (priority, next(order), key, fn, args))

    def finished(key: Any, result: Any) -> None:
        results[key] = result
        push(then(key, result))

    push(first)
    if config.jobs <= 1:
        before = gc.get_threshold()
        _fewer_collections()
        try:
            while waiting:
                _, _, key, fn, args = heapq.heappop(waiting)
                finished(key, fn(*args))
        finally:
            gc.set_threshold(*before)
        return results
    with ProcessPoolExecutor(max_workers=config.jobs, initializer=_fewer_collections) as pool:
        running: dict[Future[Any], Any] = {}
        while waiting or running:
            # one job queued beyond the workers, so none waits on this process between two jobs;
            # no more, so a knee found later still goes ahead of the runs waiting
            while waiting and len(running) <= config.jobs:
                _, _, key, fn, args = heapq.heappop(waiting)
                running[pool.submit(fn, *args)] = key
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                finished(running.pop(future), future.result())
    return results


# ---- measure ------------------------------------------------------------------------------------------------


def measure(config: MatrixConfig, log: Any = sys.stderr) -> dict[str, Any]:
    from pilotfish.bench.cluster_policies import resolve_policies

    specs, skipped = resolve_policies(config.policies)
    policies = [s.name for s in specs]
    fleets = sorted(set(config.fleets))
    plan = [(w, n, ld, s, p) for w in config.workloads for n in fleets for ld in config.loads for s in config.seeds
            for p in policies]
    print(f"{len(plan)} runs", file=log)
    runs_of: dict[tuple[str, int], list[int]] = {}
    for i, (w, n, *_) in enumerate(plan):
        runs_of.setdefault((w, n), []).append(i)
    started = time.monotonic()
    done = [0]

    def then(key: tuple, result: Any) -> list[Job]:
        if key[0] == "run":
            done[0] += 1
            if (done[0] * 10 // len(plan)) != ((done[0] - 1) * 10 // len(plan)):
                print(f"{done[0]}/{len(plan)} runs, {time.monotonic() - started:.0f} s", file=log, flush=True)
            return []
        _, w, n = key
        knee, probed = result
        print(f"knee {w} x {n}: {knee['rate_rps']:.1f} req/s", file=log, flush=True)
        # the smallest fleet's knee, from the workload's own rate, is where the others' searches start, scaled
        jobs: list[Job] = [(0, ("knee", w, m), _knee_and_probes, (config, w, m, knee["factor"] * m / fleets[0] / 2))
                           for m in fleets[1:] if n == fleets[0]]
        for i in runs_of.get((w, n), []):
            _, _, ld, s, p = plan[i]
            factor = knee["factor"] * ld
            if p == "round-robin" and s == config.seeds[0] and factor in probed:
                jobs.append((1, ("run", i), _given, (probed[factor],)))
            else:
                jobs.append((1, ("run", i), run_cell, (config, w, n, s, factor, p)))
        return jobs

    results = _run_graph(config, [(0, ("knee", w, fleets[0]), _knee_and_probes, (config, w, fleets[0], 1.0))
                                  for w in config.workloads], then)
    knees = {f"{w}|{n}": results[("knee", w, n)][0] for n in fleets for w in config.workloads}
    cells: dict[str, dict[str, Any]] = {}
    for i, (w, n, ld, s, p) in enumerate(plan):
        cell = cells.setdefault(cell_key(w, n, ld), {"workload": w, "engines": n, "load": ld, "runs": {}})
        cell["runs"].setdefault(p, {})[str(s)] = results[("run", i)]
    return {"policies": policies, "skipped": skipped, "knees": knees, "cells": cells}


def cell_key(workload: str, engines: int, load: float) -> str:
    return f"{workload} | {engines} | {load:g}"


# ---- report -------------------------------------------------------------------------------------------------


def summarize(cells: dict[str, dict[str, Any]]) -> None:
    """Per cell and policy: mean and range over seeds, and goodput relative to the best peer, the best
    router-local peer and round-robin (in place)."""
    for cell in cells.values():
        summary: dict[str, dict[str, Any]] = {}
        for p, by_seed in cell["runs"].items():
            s: dict[str, Any] = {}
            for key in ("goodput_rps", "slo_attainment", "ttft_p99", "queueing_p99", "tpot_p99"):
                values = [m[key] for m in by_seed.values() if m[key] is not None and not math.isnan(m[key])]
                s[key] = statistics.fmean(values) if values else math.nan
                s[key + "_range"] = [min(values), max(values)] if values else [math.nan, math.nan]
            summary[p] = s
        cell["summary"] = summary

        cell["best_peer"], cell["best_local_peer"] = _best(summary, PEERS), _best(summary, LOCAL_PEERS)
        for s in summary.values():
            for ref, name in (("vs_best_peer", cell["best_peer"]), ("vs_best_local_peer", cell["best_local_peer"]),
                              ("vs_round_robin", "round-robin" if "round-robin" in summary else None)):
                base = summary[name]["goodput_rps"] if name else math.nan
                s[ref] = s["goodput_rps"] / base if base and not math.isnan(base) else math.nan


def _best(summary: dict[str, dict[str, Any]], names: tuple[str, ...]) -> str | None:
    """The one of `names` with the highest mean goodput in the cell (None if none ran)."""
    there = [n for n in names if n in summary]
    return max(there, key=lambda n: summary[n]["goodput_rps"]) if there else None


def losses(cells: dict[str, dict[str, Any]], tolerance: float = 0.0) -> list[dict[str, Any]]:
    """Every cell where a shipped default's mean goodput is below round-robin's or the reference peer's
    (the best peer for pilotfish-full, the best router-local peer for pilotfish)."""
    out = []
    for key, cell in cells.items():
        for p in SHIPPED:
            s = cell["summary"].get(p)
            if s is None:
                continue
            ref = "best_peer" if p == "pilotfish-full" else "best_local_peer"
            for against, ratio_key in (("round-robin", "vs_round_robin"), (cell.get(ref), f"vs_{ref}")):
                ratio = s.get(ratio_key, math.nan)
                if against and not math.isnan(ratio) and ratio < 1.0 - tolerance:
                    other = cell["summary"][against]
                    out.append({"cell": key, "policy": p, "against": against, "ratio": ratio,
                                "goodput_rps": s["goodput_rps"], "goodput_range": s["goodput_rps_range"],
                                "against_goodput_rps": other["goodput_rps"],
                                "against_range": other["goodput_rps_range"]})
    return out


# where the lowest peer P99 queueing is above this (seconds), the full default's must be at most half of it
QUEUEING_FLOOR_S = 0.1


def latency_misses(cells: dict[str, dict[str, Any]], policy: str = "pilotfish-full") -> dict[str, Any]:
    """The full default's latency goals per cell, against the peers' lowest P99 (mean over seeds): its P99
    TTFT at most theirs, and its P99 queueing at most half theirs where theirs is above QUEUEING_FLOOR_S.
    Returns the cells judged and the misses of each."""
    judged = {"ttft": 0, "queueing": 0}
    misses: dict[str, list[dict[str, Any]]] = {"ttft": [], "queueing": []}
    for key, cell in cells.items():
        summary = cell["summary"]
        mine = summary.get(policy)
        if mine is None:
            continue
        for what, bound in (("ttft", 1.0), ("queueing", 0.5)):
            field = f"{what}_p99"
            finite = [(summary[p][field], p) for p in PEERS if p in summary and not math.isnan(summary[p][field])]
            if not finite or math.isnan(mine[field]):
                continue
            best, peer = min(finite)
            if what == "queueing" and best <= QUEUEING_FLOOR_S:
                continue
            judged[what] += 1
            if mine[field] > bound * best:
                misses[what].append({"cell": key, "p99_s": mine[field], "peer": peer, "peer_p99_s": best,
                                     "ratio": mine[field] / best if best else math.inf})
    return {"policy": policy, "judged": judged, "misses": misses}


def write_heatmap(out_dir: Path, cells: dict[str, dict[str, Any]], policies: list[str]) -> str | None:
    """heatmap.png: one row per policy, one column per cell, colour = goodput / best peer's; None if no
    matplotlib (the reason goes to the report)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return None
    keys = list(cells)
    grid = [[cells[k]["summary"].get(p, {}).get("vs_best_peer", math.nan) for k in keys] for p in policies]
    finite = [v for row in grid for v in row if not math.isnan(v)]
    vmax = max(1.05, max(finite, default=1.05))
    vmin = min(0.95, min(finite, default=0.95))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(keys) + 3), 0.45 * len(policies) + 3))
    image = ax.imshow(grid, cmap="RdBu", norm=TwoSlopeNorm(vcenter=1.0, vmin=vmin, vmax=vmax), aspect="auto")
    ax.set_yticks(range(len(policies)), policies)
    labels = [f"{cells[k]['workload'].split(':', 1)[1][:18]} {cells[k]['engines']}e x{cells[k]['load']:g}"
              for k in keys]
    ax.set_xticks(range(len(keys)), labels, rotation=90, fontsize=7)
    fig.colorbar(image, ax=ax, label="goodput / best peer's (mean over seeds)")
    ax.set_title("Goodput relative to the best peer reproduction, per cell")
    fig.tight_layout()
    fig.savefig(out_dir / "heatmap.png", dpi=100)
    plt.close(fig)
    return "heatmap.png"


def _f(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    cells = result["cells"]
    policies = result["policies"]
    md = [
        "# Workload matrix: shipped defaults, round-robin, peers and the oracle",
        "",
        f"{len(cfg['workloads'])} workloads x fleets {', '.join(map(str, cfg['fleets']))} x loads "
        f"{', '.join(f'{x:g}' for x in cfg['loads'])} of round-robin's knee; "
        f"seeds {', '.join(map(str, cfg['seeds']))}; "
        f"{cfg['requests_per_cell']} requests per cell (whatever the fleet); SLO TTFT <= {cfg['slo_ttft']:g} s "
        f"and TPOT <= {cfg['slo_tpot'] * 1000:g} ms; profile `{cfg['profile']}`, {cfg['num_gpu_blocks']} KV blocks "
        "per engine" + step_scales_note(cfg.get("step_scales")) + ". "
        f"Wall time {result['wall_seconds']:.0f} s with {cfg['jobs']} worker(s) on {result['host']} "
        f"({result['cpus']} CPUs, load average {' / '.join(f'{x:.1f}' for x in result['load_average'])} "
        "at the end).",
        "",
        "The knee is the highest arrival rate at which round-robin's SLO attainment on the cell's trace (seed "
        f"{cfg['seeds'][0]}) is at least {cfg['knee_attainment']:.0%} of what it reaches lightly loaded (a quarter of "
        f"the starting rate), found by doubling then {cfg['knee_steps']} geometric bisections; a load is a fraction "
        "of it. A knee marked unbounded is the highest rate tried: round-robin still met the mark with the cell's "
        "requests arriving almost at once. Goodput is requests within the "
        "SLO per second of arrivals, the mean over seeds with its range; \"best peer\" is the best of "
        f"{', '.join(PEERS)} in that cell, \"best local\" the best of {', '.join(LOCAL_PEERS)}. `pilotfish` and "
        "`pilotfish-full` are the shipped defaults with no flags.",
        "",
        "## Knees (round-robin)",
        "",
        "| workload | engines | knee req/s | SLO met light / mark | probes (compression: SLO met) |",
        "|---|---|---|---|---|",
    ]
    for key, k in result["knees"].items():
        w, n = key.split("|")
        probes = ", ".join(f"{f:.3g}: {m:.0%}" for f, m in k["probes"])
        bound = "" if k["bounded"] else " (unbounded)"
        md.append(f"| {w} | {n} | {k['rate_rps']:.1f}{bound} | {k['light_attainment']:.0%} / {k['mark']:.0%} | "
                  f"{probes} |")
    md += ["", "## Where a shipped default loses", ""]
    lost = result["losses"]
    if not lost:
        md.append("Nowhere: in every cell each shipped default's mean goodput is at least round-robin's and its "
                  "reference peer's (the best peer for pilotfish-full, the best local peer for pilotfish).")
    else:
        md += ["| cell (workload, engines, load) | policy | below | goodput req/s (range) | theirs (range) | ratio |",
               "|---|---|---|---|---|---|"]
        for x in lost:
            md.append(f"| {x['cell']} | {x['policy']} | {x['against']} | {_f(x['goodput_rps'])} "
                      f"({_f(x['goodput_range'][0])}-{_f(x['goodput_range'][1])}) | {_f(x['against_goodput_rps'])} "
                      f"({_f(x['against_range'][0])}-{_f(x['against_range'][1])}) | {_f(x['ratio'], 3)} |")
    md += ["", "## Goodput relative to the best peer (mean over seeds)", "",
           "| cell | " + " | ".join(policies) + " | best peer req/s |", "|---|" + "---|" * (len(policies) + 1)]
    for key, cell in cells.items():
        row = [_f(cell["summary"].get(p, {}).get("vs_best_peer", math.nan), 3) for p in policies]
        best = cell["summary"].get(cell["best_peer"] or "", {}).get("goodput_rps", math.nan)
        md.append(f"| {key} | " + " | ".join(row) + f" | {_f(best)} |")
    md += ["", "## P99 TTFT and P99 queueing (s, mean over seeds)", "",
           "Queueing is the time from arrival to the engine's first scheduling of the request.", "",
           "| cell | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for key, cell in cells.items():
        row = [f"{_f(cell['summary'][p]['ttft_p99'])} / {_f(cell['summary'][p]['queueing_p99'])}"
               if p in cell["summary"] else "" for p in policies]
        md.append(f"| {key} | " + " | ".join(row) + " |")
    lat = result.get("latency")
    if lat:
        judged, misses = lat["judged"], lat["misses"]
        md += ["", f"## `{lat['policy']}`'s latency against the peers' lowest P99 (mean over seeds)", "",
               f"P99 TTFT at most the lowest peer P99 TTFT: above it in {len(misses['ttft'])} of {judged['ttft']} "
               f"cells. P99 queueing at most half the lowest peer P99 queueing where that is above "
               f"{QUEUEING_FLOOR_S * 1000:g} ms: above half in {len(misses['queueing'])} of {judged['queueing']} "
               "such cells."]
        rows = [(what, x) for what in ("ttft", "queueing") for x in misses[what]]
        if rows:
            md += ["", "| goal | cell | P99 s | lowest peer | peer's P99 s | ratio |", "|---|---|---|---|---|---|"]
            for what, x in rows:
                goal = "P99 TTFT <= peer's" if what == "ttft" else "P99 queueing <= half the peer's"
                md.append(f"| {goal} | {x['cell']} | {_f(x['p99_s'], 3)} | {x['peer']} | {_f(x['peer_p99_s'], 3)} | "
                          f"{_f(x['ratio'], 3)} |")
    md += ["", "## Heat map", ""]
    md.append(f"![goodput relative to the best peer]({result['heatmap']})" if result["heatmap"]
              else "None: matplotlib is not installed (`pip install 'pilotfish[bench]'`).")
    if result["skipped"]:
        md += ["", *[f"- skipped: {line}" for line in result["skipped"]]]
    return "\n".join(md)


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report

    config = config_from_args(args)
    started = time.monotonic()
    try:
        measured = measure(config)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"bench matrix: {exc}", file=sys.stderr)
        return 2
    summarize(measured["cells"])
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    heatmap = write_heatmap(out, measured["cells"], measured["policies"])
    result = {
        "config": msgspec.to_builtins(config), **measured, "losses": losses(measured["cells"]),
        "latency": latency_misses(measured["cells"]), "heatmap": heatmap,
        "wall_seconds": time.monotonic() - started, "host": platform.node(), "python": platform.python_version(),
        "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
    }
    md = render_markdown(result)
    write_report(out, "matrix", result, md)
    print(md)
    broken = [f"{k}: {p}" for k, c in measured["cells"].items() for p, by in c["runs"].items()
              if any(m["integrity_errors"] for m in by.values())]
    if broken:
        print(f"token integrity FAILED under: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0
