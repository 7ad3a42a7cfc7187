"""`pilotfish bench flow`: flow control off and on, in virtual time, past the knee, on every
workload family, over several seeds.

The scheduler's own FlowController (scheduler/flow) runs on the virtual-time cluster's clock over
the full-mode core (simulator/cluster/scheduler_router.py): a request arrives, is dispatched or waits in
the queue, and leaves it when an engine's status (written after every step) shows room, exactly
as the service drains on a CMS status; deadlines are timers. A shed request never reaches an
engine (the gateway's 429). Every run asserts that nothing is lost: each request finished or was
shed, the queue is empty and the core's account drained to zero.

For every workload (`--workloads`, the families of simulator/traces/families.py) and seed:

1. the knee: full mode as it ships without flow control, the load (time compression of the family's own
   rate) doubled from `--knee-start` until SLO attainment falls below `--knee-slo`, then bisected
   `--knee-steps` times; the knee is the highest load that met it;
2. past the knee (`--loads`, multiples of the knee; one below it shows the cost there): arms
   `pilotfish-full` (off: full mode's shipped default policy), `pilotfish-full+flow-control` (on: the
   same with flow control at the scheduler's defaults, and `--flow` on top) and the peer
   reproductions (`--peers`), on a priority mix (`--priority-mix`): goodput, SLO attainment,
   P99 TTFT per band, sheds, and the ceiling: no arm's goodput can pass the offered rate (a hard
   bound), nor, as far as this bench can tell, the fleet's capacity (the most goodput any arm
   reached at any load of the workload and seed), so `min(offered, capacity) / best peer` says
   whether a goodput 1.3 x the best peer's is reachable at all;
3. fairness: tenant A alone at `--tenant-load` x knee, then with tenant B flooding on top (the
   total at `--flood-load` x knee), both standard: A's P99 TTFT with the flood over without it,
   flow control off, and on at every over-share bound of `--fair-bounds` (1: fairness by queue
   order only), with B's SLO attainment, the price of the isolation, and where A's P99 TTFT goes:
   the wait in the scheduler's queue, and engine to first token, and the share of A's requests that
   A's busiest engine served (cache affinity can gather a tenant on the engines holding its prefixes);
4. two tenants below the knee (`--below-tenant-load`, `--below-total-load`): the same, where the
   engines could serve both, so holding the tenant over its share back should cost no goodput.

The report gives each figure as the mean over seeds and its min-max spread.

    pilotfish bench flow --out DIR
    pilotfish bench flow --workloads family:system-prompt --seeds 0 --out DIR
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time
import zlib
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import Instances, Progress, SloOptions

if TYPE_CHECKING:
    from pilotfish.simulator.cluster import ClusterConfig, Router
    from pilotfish.simulator.traces import Trace

BANDS = ("critical", "standard", "sheddable")
# full mode's shipped default policy: flow control is judged on what a user runs (load-balance, say,
# ignores the prefix cache and halves multi-turn's knee, which would credit flow control with the gap)
OFF, ON = "pilotfish-full", "pilotfish-full+flow-control"
# B's flood with a new tenant id on every request: the ids folded into one flow until established (as the
# scheduler ships), and each id counted as its own flow (--flow-established-after-ms 0)
ROTATION_ARMS = ("folded", "counted as given")
# B's flood spread over --kept-alive-ids ids, each used again and established: grouped by the client's
# address as the gateway ships (B's ids share one group's share), and counted as given (--flow-groups none)
KEPT_ALIVE_ARMS = ("kept alive, grouped by address", "kept alive, one share each")
FAMILIES = ("family:system-prompt", "family:multi-turn", "family:tenants", "family:rag", "family:heavy-tail",
            "family:bursty")  # fmt: skip


class FlowBenchConfig(SloOptions, frozen=True):
    """Every knob of `bench flow`, with its default (the flags come from it)."""

    instances: Instances = 4
    workloads: Annotated[
        list[str],
        Meta(description="family:<name>[:knob=value;...] (simulator/traces/families.py; knobs separated by ';')"),
    ] = msgspec.field(default_factory=lambda: list(FAMILIES))
    requests: Annotated[int, Meta(ge=50, description="requests per run (the first of the family's trace)")] = 1200
    seeds: Annotated[list[int], Meta(description="seeds: traces, priority draws and routers")] = msgspec.field(
        default_factory=lambda: [0, 1, 2]
    )
    knee_slo: Annotated[float, Meta(gt=0, le=1, description="the knee: highest load meeting this SLO share")] = 0.9
    knee_start: Annotated[
        float, Meta(gt=0, description="the knee search's first load (the family's own rate: 1)")
    ] = 1.0
    knee_steps: Annotated[int, Meta(ge=0, description="bisections after the doubling brackets the knee")] = 2
    loads: Annotated[list[float], Meta(description="multiples of the knee to compare the arms at")] = msgspec.field(
        default_factory=lambda: [0.8, 1.2, 1.5]
    )
    peers: Annotated[list[str], Meta(description="peer reproductions run beside (empty: none)")] = msgspec.field(
        default_factory=lambda: ["sglang", "llm-d", "dynamo"]
    )
    priority_mix: Annotated[
        list[str], Meta(description="band=share of the requests (a seeded draw per request)")
    ] = msgspec.field(default_factory=lambda: ["critical=0.2", "standard=0.6", "sheddable=0.2"])
    tenant_load: Annotated[float, Meta(gt=0, description="fairness: tenant A alone, x knee")] = 0.6
    flood_load: Annotated[float, Meta(gt=0, description="fairness: A plus B's flood, x knee")] = 1.5
    below_tenant_load: Annotated[
        float, Meta(gt=0, description="two tenants below the knee: tenant A alone, x knee")
    ] = 0.3
    below_total_load: Annotated[
        float,
        Meta(
            ge=0,
            description="two tenants below the knee: A plus B, x knee; what holding the tenant over its share "
            "back costs where the engines could serve both (0: not run)",
        ),
    ] = 0.8
    fair_bounds: Annotated[
        list[float],
        Meta(
            description="fairness: B's flood with flow control on at each --flow-over-share-bound "
            "(1: fairness by queue order only)"
        ),
    ] = msgspec.field(default_factory=lambda: [1.0, 0.75, 0.5, 0.25])
    rotation: Annotated[
        bool,
        Meta(
            description="fairness: also run B's flood with a new tenant id on every request, the ids folded into "
            "one flow until established (the scheduler's default) and counted as given "
            "(--flow-established-after-ms 0)"
        ),
    ] = True
    kept_alive_ids: Annotated[
        int,
        Meta(
            ge=0,
            description="fairness: also run B's flood spread over this many tenant ids, each established, from "
            "one client address: grouped by address (the gateway's default) and counted as given "
            "(--flow-groups none); 0: not run",
        ),
    ] = 16
    hold_ms: Annotated[int, Meta(ge=0, description="the gateway's --schedule-queue-timeout-ms")] = 3000
    flow: Annotated[
        list[str],
        Meta(
            description="SchedulerConfig flow fields of the on arm over the scheduler's defaults: key=value "
            "(flow_max_kv_usage=0.9; none: the defaults as they ship)"
        ),
    ] = msgspec.field(default_factory=list)
    jobs: Annotated[
        int, Meta(ge=1, description="worker processes, one (workload, seed) each (the machine is shared)")
    ] = 1
    progress: Progress = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, FlowBenchConfig)


# ---- the flow-controlled cluster ----------------------------------------------------------------


@dataclass(slots=True)
class Labels:
    band: dict[str, str] = field(default_factory=dict)  # request id -> band name
    flow: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    # tenants the fleet has served before the run: their ids are established (scheduler/flow/newcomers.py)
    known: frozenset[str] = frozenset()
    # tenants that send a new tenant id with every request (the figures still count them as one tenant)
    rotating: frozenset[str] = frozenset()
    # tenants that spread their requests over this many ids, all kept alive (established)
    kept_alive: dict[str, int] = field(default_factory=dict)
    # the group (the gateway's hash of the client's address) of each tenant's keys; none: ungrouped
    groups: dict[str, str] = field(default_factory=dict)

    def flow_id(self, rid: str) -> str:
        """The flow key request `rid` carries: its tenant id, in its tenant's group."""
        from pilotfish.scheduler.flow.groups import joined

        tenant = self.flow.get(rid, "")
        if tenant in self.rotating:
            key = f"{tenant}#{rid}"
        elif tenant in self.kept_alive:
            key = f"{tenant}#{zlib.crc32(rid.encode()) % self.kept_alive[tenant]}"
        else:
            key = tenant
        return joined(self.groups.get(tenant, ""), key)

    def established(self) -> list[str]:
        """The keys of the tenants served before the run (every id of one keeping ids alive)."""
        from pilotfish.scheduler.flow.groups import joined

        out = []
        for tenant in sorted(self.known):
            ids = [f"{tenant}#{i}" for i in range(self.kept_alive[tenant])] if tenant in self.kept_alive else [tenant]
            out += [joined(self.groups.get(tenant, ""), i) for i in ids]
        return out


def _cluster_sim(config: ClusterConfig, router: Router, labels: Labels, flow_fields: dict[str, Any] | None,
                 hold_s: float) -> Any:
    """A ClusterSim whose arrivals go through the scheduler's FlowController when `flow_fields` is set."""
    from pilotfish.protos import scheduler_pb2
    from pilotfish.scheduler.core import Decision
    from pilotfish.scheduler.errors import SchedulerError
    from pilotfish.scheduler.flow import FlowController
    from pilotfish.scheduler.view.types import RequestInfo
    from pilotfish.simulator.cluster import ClusterSim, RequestRecord
    from pilotfish.simulator.engine.block_hash import block_hashes
    from pilotfish.simulator.engine.request import SimRequest

    priorities = {"critical": scheduler_pb2.PRIORITY_CRITICAL, "standard": scheduler_pb2.PRIORITY_STANDARD,
                  "sheddable": scheduler_pb2.PRIORITY_SHEDDABLE}

    class FlowSim(ClusterSim):
        def __init__(self) -> None:
            observe = getattr(router, "observe_engine", None)
            super().__init__(config, router, observers=[observe] if observe else ())
            attach = getattr(router, "attach_engines", None)
            if attach is not None:
                attach(self.engines)
            self.flow: FlowController | None = None
            self.shed: dict[str, str] = {}  # request id -> reason
            self.placed: dict[str, float] = {}  # request id -> when it reached an engine (out of the queue)
            self.arrived: dict[str, float] = {}
            self._held: dict[str, tuple[Any, list[int], list[int]]] = {}  # waiting: what to place
            self._drain_at: float | None = None

        def _dispatch(self, request: Any) -> int:
            if flow_fields is None:
                return super()._dispatch(request)
            now = self.now
            self._deliver_until(now)
            if self.flow is None:
                import msgspec

                core = router.core  # type: ignore[attr-defined]
                cfg = msgspec.structs.replace(core.config, enable_flow_control=True, **flow_fields)
                self.flow = FlowController(core, cfg, clock=lambda: self.now, wall_clock=lambda: self.now)
                for key in labels.established():
                    self.flow.newcomers.establish(key)
            router.refresh(now)  # type: ignore[attr-defined]
            tokens = self.prompt_builder(request)
            hashes = block_hashes(tokens, self.config.engine.block_size)
            max_tokens = min(request.output_length, self.config.engine.max_model_len - len(tokens))
            rid = request.request_id
            self.arrived[rid] = request.arrival
            info = RequestInfo(request_id=rid, model=router.model, prompt_tokens=len(tokens),  # type: ignore[attr-defined]
                               prefix_block_hashes=tuple(hashes), prefix_block_size=self.config.engine.block_size,
                               max_tokens=max_tokens, stream=True)
            self._held[rid] = (request, tokens, hashes)
            try:
                outcome = self.flow.submit(info, priorities[labels.band.get(rid, "standard")],
                                           labels.flow_id(rid), hold_s, lambda o, rid=rid: self._late(rid, o))
            except SchedulerError as exc:
                self._held.pop(rid)
                self.shed[rid] = getattr(exc, "reason", exc.code)
                return 0
            if outcome is None:
                self._wake_drain()
                return 0
            return self._place(rid, outcome)

        def _place(self, rid: str, decision: Any) -> int:
            request, tokens, hashes = self._held.pop(rid)
            k = router._index[decision.target.instance_id]  # type: ignore[attr-defined]
            max_tokens = min(request.output_length, self.config.engine.max_model_len - len(tokens))
            self.records[rid] = RequestRecord(rid, k, request.arrival, len(tokens), max_tokens)
            self.placed[rid] = self.now
            sim_request = SimRequest(rid, tokens, max_tokens, block_hashes=list(hashes))
            for out in self.engines[k].add_request(sim_request, self.now):
                self._output(k, out)
            return k

        def _late(self, rid: str, outcome: object) -> None:
            if isinstance(outcome, Decision):
                self._woken.add(self._place(rid, outcome))
            else:
                self._held.pop(rid, None)
                self.shed[rid] = getattr(outcome, "reason", "refused")

        def _step(self, k: int, end: float) -> None:
            super()._step(k, end)
            if self.flow is not None and len(self.flow):
                self._wake_drain(end)  # a new status: room, maybe

        def _wake_drain(self, at: float | None = None) -> None:
            """A drain at `at` (a step's end: a new status), or at the next recheck or deadline."""
            flow = self.flow
            assert flow is not None
            if at is None:
                t = self.now + flow.settings.recheck_s
                deadline = flow.next_deadline()
                if deadline is not None:
                    t = min(t, max(deadline, self.now))
            else:
                t = at
            if self._drain_at is not None and self._drain_at <= t:
                return
            self._drain_at = t
            self.at(t, self._drain)

        def _drain(self) -> None:
            if self._drain_at is None or self.now < self._drain_at:
                return  # superseded by an earlier drain
            self._drain_at = None
            flow = self.flow
            assert flow is not None
            self._deliver_until(self.now)
            router.refresh(self.now)  # type: ignore[attr-defined]
            flow.expire()
            flow.drain()
            if len(flow):
                self._wake_drain()

    return FlowSim()


# ---- traces and runs ----------------------------------------------------------------------------


def workload_trace(spec: str, n: int, seed: int, namespace: str) -> Trace:
    """The first `n` requests (by arrival) of a family's trace; `namespace` keeps two tenants'
    prompts apart. Raises ValueError naming a spec that is not a family."""
    import inspect

    from pilotfish.simulator.traces.families import FAMILIES as MADE
    from pilotfish.simulator.traces.families import family_trace

    kind, _, rest = spec.partition(":")
    name, _, knobs = rest.partition(":")
    if kind != "family" or name not in MADE:
        raise ValueError(f"--workloads: {spec!r} is not family:<name> (known: {', '.join(MADE)})")
    items = [k for k in knobs.replace(";", ",").split(",") if k]
    params = inspect.signature(MADE[name]).parameters
    if "requests" in params:
        items.append(f"requests={n}")
    elif "conversations" in params:  # every conversation has a turn at least: n of them give n requests or more
        items.append(f"conversations={n}")
    items.append(f"namespace={namespace}")
    trace = family_trace(f"{name}:{','.join(items)}", seed)
    return sorted(trace, key=lambda r: (r.arrival, r.request_id))[:n]


def _router(name: str, engine: Any, seed: int) -> Router:
    from pilotfish.bench.cluster_policies import policy_spec

    return policy_spec(OFF if name == ON else name, engine).make(seed)


def run_arm(cfg: FlowBenchConfig, name: str, trace: Trace, labels: Labels, seed: int,
            flow_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm over one trace (`flow_fields`: the on arm's SchedulerConfig fields); the figures and
    the loss check."""
    from pilotfish.simulator.cluster import ClusterConfig

    engine = cfg.engine_config()
    router = _router(name, engine, seed)
    fields = None if name != ON else (flow_fields if flow_fields is not None else flow_settings(cfg))
    sim = _cluster_sim(ClusterConfig(engines=cfg.instances, engine=engine), router, labels, fields,
                       cfg.hold_ms / 1000)
    started = time.perf_counter()
    result = sim.run(trace)
    wall = time.perf_counter() - started
    records = {r.request_id: r for r in result.records}
    lost = [r.request_id for r in trace if r.request_id not in records and r.request_id not in sim.shed]
    core = getattr(router, "core", None)
    flow = getattr(sim, "flow", None)
    problems = list(result.integrity_errors)
    if lost:
        problems.append(f"{len(lost)} requests neither finished nor shed")
    if flow is not None and len(flow):
        problems.append(f"{len(flow)} requests still queued")
    if core is not None and name.startswith("pilotfish") and core.account_size:
        problems.append(f"the account holds {core.account_size} requests at the end")
    return {"wall_seconds": wall, "problems": problems,
            **figures(trace, records, sim.shed, labels, cfg.slo_ttft, cfg.slo_tpot, getattr(sim, "placed", {}))}


def figures(trace: Trace, records: dict[str, Any], shed: dict[str, str], labels: Labels, slo_ttft: float,
            slo_tpot: float, placed: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's figures; `placed` (request id -> when it reached an engine) splits each tenant's
    TTFT into the wait in the scheduler's queue and the rest (no entry: never queued)."""
    from pilotfish.simulator.cluster.metrics import percentile

    arrivals = [r.arrival for r in trace]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else math.nan

    def good(r: Any) -> bool:
        return (r.finished is not None and r.ttft is not None and r.ttft <= slo_ttft
                and (r.tpot is None or r.tpot <= slo_tpot))

    out: dict[str, Any] = {"requests": len(trace), "shed": len(shed)}
    met = sum(1 for r in records.values() if good(r))
    out["slo_attainment"] = met / len(trace) if trace else math.nan
    out["goodput_rps"] = met / span if span > 0 else math.nan
    out["offered_rps"] = len(trace) / span if span > 0 else math.nan
    # what the fleet completed per second of the run's makespan: near its capacity when saturated
    finished = [r.finished for r in records.values() if r.finished is not None]
    makespan = max(finished) - min(arrivals) if finished else math.nan
    out["served_rps"] = len(finished) / makespan if finished and makespan > 0 else math.nan
    ttfts = [r.ttft for r in records.values() if r.ttft is not None]
    out["p99_ttft"] = percentile(ttfts, 99)
    out["bands"] = {}
    for band in BANDS:
        ids = [r.request_id for r in trace if labels.band.get(r.request_id, "standard") == band]
        if not ids:
            continue
        served = [records[i] for i in ids if i in records]
        out["bands"][band] = {
            "requests": len(ids),
            "shed": sum(1 for i in ids if i in shed),
            "slo_attainment": sum(1 for r in served if good(r)) / len(ids),
            "p99_ttft": percentile([r.ttft for r in served if r.ttft is not None], 99),
        }
    out["tenants"] = {}
    for tenant in sorted(set(labels.flow.values())):
        ids = [r.request_id for r in trace if labels.flow.get(r.request_id) == tenant]
        served = [records[i] for i in ids if i in records]
        out["tenants"][tenant] = {
            "requests": len(ids), "shed": sum(1 for i in ids if i in shed),
            "slo_attainment": sum(1 for r in served if good(r)) / len(ids) if ids else math.nan,
            "goodput_rps": sum(1 for r in served if good(r)) / span if span > 0 else math.nan,
            "p99_ttft": percentile([r.ttft for r in served if r.ttft is not None], 99),
            # what of the TTFT is the scheduler's queue, and what the engine (its queue, prefill, batch)
            "p99_queue_wait": percentile([(placed or {}).get(r.request_id, r.arrival) - r.arrival for r in served
                                          if r.ttft is not None], 99),
            "p99_engine_ttft": percentile([r.first_token - (placed or {}).get(r.request_id, r.arrival)
                                           for r in served if r.ttft is not None], 99),
            "busiest_engine_share": busiest_engine_share(served),
        }
    return out


def busiest_engine_share(served: list[Any]) -> float:
    """The share of a tenant's served requests that its busiest engine took (NaN: none served). Under a
    flood, cache affinity can gather a tenant's requests on the engines holding its prefixes, and that
    engine's queue is then what its TTFT waits on (bench/RESULTS.md, 2026-11-29)."""
    if not served:
        return math.nan
    return max(Counter(r.engine for r in served).values()) / len(served)


def flow_settings(cfg: FlowBenchConfig) -> dict[str, Any]:
    """The on arm's SchedulerConfig fields from --flow (key=value, YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in cfg.flow:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"--flow: {item!r} is not key=value")
        out[key.strip()] = yaml.safe_load(raw)
    return out


def over_share_bound(cfg: FlowBenchConfig) -> float:
    """The on arm's --flow-over-share-bound (its --flow setting, else the scheduler's default)."""
    from pilotfish.scheduler.config import SchedulerConfig

    return float(flow_settings(cfg).get("flow_over_share_bound", SchedulerConfig().flow_over_share_bound))


def mix(cfg: FlowBenchConfig) -> list[tuple[str, float]]:
    pairs = []
    for item in cfg.priority_mix:
        band, _, share = item.partition("=")
        if band not in BANDS:
            raise ValueError(f"--priority-mix: {band!r} is not one of {', '.join(BANDS)}")
        pairs.append((band, float(share)))
    return pairs


def priority_labels(trace: Trace, pairs: list[tuple[str, float]], seed: int) -> Labels:
    rng = random.Random(f"priority:{seed}")
    bands, weights = [b for b, _ in pairs], [w for _, w in pairs]
    return Labels(band={r.request_id: rng.choices(bands, weights)[0] for r in trace})


def ceiling(arms: dict[str, Any], capacity: float, peers: list[str]) -> dict[str, float]:
    """The most goodput any arm could reach in a cell (the offered rate, at most the fleet's measured
    capacity) and that over the best peer's goodput: below 1.3 the goal cannot be met there."""
    offered = next(iter(arms.values()))["offered_rps"]
    best_peer = max((arms[p]["goodput_rps"] for p in peers if p in arms), default=math.nan)
    top = min(offered, capacity) if not math.isnan(capacity) else offered
    return {"offered_rps": offered, "capacity_rps": capacity, "ceiling_rps": top, "best_peer_rps": best_peer,
            "ceiling_x_best_peer": top / best_peer if best_peer > 0 else math.nan,
            "offered_x_best_peer": offered / best_peer if best_peer > 0 else math.nan,
            "on_x_best_peer": arms[ON]["goodput_rps"] / best_peer if ON in arms and best_peer > 0 else math.nan}


# ---- one workload and seed ------------------------------------------------------------------------


def find_knee(cfg: FlowBenchConfig, base: Trace, seed: int, note: Any) -> tuple[float | None, bool, dict[str, Any]]:
    """The highest load (time compression) at which flow control off meets --knee-slo, whether a
    load above it missed (False: the trace is too short to load the fleet past the SLO at all, and
    the loads are multiples of the highest tried), and the probes."""
    from pilotfish.simulator.traces import compress

    probes: dict[str, Any] = {}

    def ok(load: float) -> bool:
        m = run_arm(cfg, OFF, compress(base, load), Labels(), seed)
        probes[f"{load:.4g}"] = m
        note(f"knee: load {load:.3g}: SLO {m['slo_attainment']:.1%}")
        return m["slo_attainment"] >= cfg.knee_slo

    lo: float | None = None
    hi: float | None = None
    load = cfg.knee_start
    for _ in range(12):  # double (or halve) until the knee is bracketed
        if ok(load):
            lo = load
            if hi is not None:
                break
            load *= 2
        else:
            hi = load
            if lo is not None:
                break
            load /= 2
    if lo is None or hi is None:
        return lo, hi is not None, probes
    for _ in range(cfg.knee_steps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, True, probes


def measure(cfg: FlowBenchConfig, workload: str, seed: int) -> dict[str, Any]:
    """Knee, past the knee and fairness for one workload and seed."""
    from pilotfish.simulator.traces import compress

    def note(line: str) -> None:
        if cfg.progress:
            print(f"{workload} seed {seed}: {line}", file=sys.stderr, flush=True)

    started = time.monotonic()
    base = workload_trace(workload, cfg.requests, seed, "flow")
    knee, bounded, probes = find_knee(cfg, base, seed, note)
    out: dict[str, Any] = {"workload": workload, "seed": seed, "knee": knee, "knee_bounded": bounded,
                           "probes": probes}
    if knee is None:
        out["problems"] = [f"{workload} seed {seed}: no load met --knee-slo from --knee-start {cfg.knee_start:g}"]
        return out
    pairs = mix(cfg)
    past: dict[str, dict[str, Any]] = {}
    for mult in cfg.loads:
        trace = compress(base, knee * mult)
        labels = priority_labels(trace, pairs, seed)
        arms = past[f"{mult:g}"] = {}
        for name in (*cfg.peers, OFF, ON):
            arms[name] = run_arm(cfg, name, trace, labels, seed)
        note(f"{mult:g} x knee: " + ", ".join(f"{n} {m['goodput_rps']:.1f}" for n, m in arms.items()))
    # the fleet's capacity in goodput's own units: the most goodput any arm reached at any load here
    # (an arm that admitted exactly that much and served all of it within the SLO would reach it at
    # every load past it); a short trace's makespan is mostly its last requests' decode, so a
    # completions-per-second figure would understate it
    capacity = max(m["goodput_rps"] for m in [*probes.values(), *(m for a in past.values() for m in a.values())]
                   if not math.isnan(m["goodput_rps"]))
    ceilings = {mult: ceiling(arms, capacity, cfg.peers) for mult, arms in past.items()}

    fairness = tenants_run(cfg, workload, seed, knee, cfg.tenant_load, cfg.flood_load, cfg.rotation,
                           cfg.kept_alive_ids)
    note(f"fairness: A's P99 TTFT x{fairness[OFF]['a_p99_ratio']['']:.2f} off, on by bound "
         + ", ".join(f"{k}: x{v:.2f}" for k, v in fairness[ON]["a_p99_ratio"].items())
         + "".join(f"; B rotating ids, {k}: x{v:.2f}" for k, v in fairness[ON].get("rotating_a_p99_ratio", {}).items()))
    parts = [fairness]
    if cfg.below_total_load > 0:  # what holding B back costs where the engines could serve both
        below = out["below"] = tenants_run(cfg, workload, seed, knee, cfg.below_tenant_load, cfg.below_total_load)
        parts.append(below)
        off_goodput = below[OFF]["flood"]["goodput_rps"]
        note("two tenants below the knee: goodput on / off by bound "
             + ", ".join(f"{k}: {m['goodput_rps'] / off_goodput:.2f}" for k, m in below[ON]["floods"].items()))
    runs = [*probes.values(), *(m for a in past.values() for m in a.values())]
    for f in parts:
        runs += [f[OFF]["alone"], f[OFF]["flood"], f[ON]["alone"], *f[ON]["floods"].values(),
                 *f[ON].get("rotating", {}).values()]
    out.update(past_knee=past, capacity_rps=capacity, ceilings=ceilings, fairness=fairness,
               problems=[f"{workload} seed {seed}: {p}" for m in runs for p in m["problems"]],
               wall_seconds=time.monotonic() - started)
    return out


def tenants_run(cfg: FlowBenchConfig, workload: str, seed: int, knee: float, tenant_load: float,
                total_load: float, rotation: bool = False, kept_alive_ids: int = 0) -> dict[str, Any]:
    """Tenant A alone at `tenant_load` x knee, then with tenant B on top to `total_load` x knee (both
    standard, both served before the run): flow control off, and on at every over-share bound of
    --fair-bounds and the on arm's; A's P99 TTFT with B over without it per arm (`a_p99_ratio`). With
    `rotation`, the on arm again with B sending a new tenant id with every request, its ids folded into
    the newcomers as the scheduler ships and counted as given (`rotating_a_p99_ratio`); with
    `kept_alive_ids`, also B spreading its flood over that many established ids from one client address,
    grouped by address as the gateway ships and counted as given (in the same dicts)."""
    from pilotfish.simulator.traces import compress

    n_a = max(100, int(cfg.requests * tenant_load / total_load))
    trace_a = compress(workload_trace(workload, n_a, seed + 1, "tenant-a"), knee * tenant_load)
    span = trace_a[-1].arrival
    flood_b = compress(workload_trace(workload, 4 * cfg.requests, seed + 2, "tenant-b"),
                       knee * (total_load - tenant_load))
    trace_b = [r for r in flood_b if r.arrival <= span]
    flooded = sorted(trace_a + trace_b, key=lambda r: (r.arrival, r.request_id))
    tenants = Labels(flow={**{r.request_id: "A" for r in trace_a}, **{r.request_id: "B" for r in trace_b}},
                     known=frozenset("AB"))
    fields = flow_settings(cfg)
    fairness: dict[str, Any] = {"requests": {"A": len(trace_a), "B": len(trace_b)}}
    for name in (OFF, ON):
        fairness[name] = {"alone": run_arm(cfg, name, trace_a, tenants, seed)}
    fairness[OFF]["flood"] = run_arm(cfg, OFF, flooded, tenants, seed)
    fairness[ON]["floods"] = {
        f"{b:g}": run_arm(cfg, ON, flooded, tenants, seed, {**fields, "flow_over_share_bound": b})
        for b in sorted({*cfg.fair_bounds, over_share_bound(cfg)}, reverse=True)
    }
    if rotation:  # B sends a new tenant id with every request: folded into the newcomers, and counted as given
        rotating = Labels(flow=tenants.flow, known=frozenset("A"), rotating=frozenset("B"))
        fairness[ON]["rotating"] = {
            ROTATION_ARMS[0]: run_arm(cfg, ON, flooded, rotating, seed, fields),
            ROTATION_ARMS[1]: run_arm(cfg, ON, flooded, rotating, seed, {**fields, "flow_established_after_ms": 0.0}),
        }
    if kept_alive_ids:  # B keeps many ids alive from one address: grouped by it, and counted as given
        spread_b = {"B": kept_alive_ids}
        grouped = Labels(flow=tenants.flow, known=frozenset("AB"), kept_alive=spread_b,
                         groups={"A": "address-a", "B": "address-b"})
        ungrouped = Labels(flow=tenants.flow, known=frozenset("AB"), kept_alive=spread_b)
        fairness[ON].setdefault("rotating", {}).update({
            KEPT_ALIVE_ARMS[0]: run_arm(cfg, ON, flooded, grouped, seed, fields),
            KEPT_ALIVE_ARMS[1]: run_arm(cfg, ON, flooded, ungrouped, seed, fields),
        })
    for name, f in fairness.items():
        if name in (OFF, ON):
            a0 = f["alone"]["tenants"]["A"]["p99_ttft"]
            runs = {"": f["flood"]} if name == OFF else f["floods"]
            f["a_p99_ratio"] = {k: m["tenants"]["A"]["p99_ttft"] / a0 for k, m in runs.items()}
            if "rotating" in f:
                f["rotating_a_p99_ratio"] = {k: m["tenants"]["A"]["p99_ttft"] / a0 for k, m in f["rotating"].items()}
    return fairness


def _measure(job: tuple[FlowBenchConfig, str, int]) -> dict[str, Any]:
    return measure(*job)


# ---- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(FlowBenchConfig, args)
    out_dir = Path(args.out)
    try:  # bad specs fail before any run
        for w in cfg.workloads:
            workload_trace(w, 1, 0, "check")
        flow_settings(cfg)
        mix(cfg)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    started = time.monotonic()
    jobs = [(cfg, w, s) for w in cfg.workloads for s in cfg.seeds]
    if cfg.jobs > 1:
        with ProcessPoolExecutor(max_workers=cfg.jobs) as pool:
            cells = list(pool.map(_measure, jobs))
    else:
        cells = [measure(*job) for job in jobs]
    result = {
        "config": msgspec.to_builtins(cfg), "cells": cells, "summary": summarise(cfg, cells),
        "problems": [p for c in cells for p in c["problems"]], "wall_seconds": time.monotonic() - started,
        "host": platform.node(), "python": platform.python_version(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plots, why = plot(cfg, result["summary"], out_dir)
    md = render_markdown(cfg, result, plots, why)
    write_report(out_dir, "flow", result, md)
    print(md)
    if result["problems"]:
        print("LOST, LEAKED OR NO KNEE: " + "; ".join(result["problems"]), file=sys.stderr)
        return 1
    return 0


# ---- over seeds -----------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    """Mean and min-max of what is not NaN (NaN when nothing is)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"mean": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(cfg: FlowBenchConfig, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: every figure the report shows, as mean and min-max over seeds."""
    out: dict[str, Any] = {}
    bound = f"{over_share_bound(cfg):g}"
    for w in cfg.workloads:
        mine = [c for c in cells if c["workload"] == w and "fairness" in c]
        s: dict[str, Any] = {"seeds": [c["seed"] for c in mine], "knee": spread([c["knee"] for c in mine]),
                             "knee_bounded": all(c["knee_bounded"] for c in mine)}
        s["past"] = {}
        for mult in (f"{x:g}" for x in cfg.loads):
            arms = [c["past_knee"][mult] for c in mine]
            ceils = [c["ceilings"][mult] for c in mine]
            names = list(arms[0]) if arms else []
            s["past"][mult] = {
                "arms": {n: {
                    "goodput_rps": spread([a[n]["goodput_rps"] for a in arms]),
                    "slo_attainment": spread([a[n]["slo_attainment"] for a in arms]),
                    "p99_ttft": spread([a[n]["p99_ttft"] for a in arms]),
                    "shed": spread([a[n]["shed"] for a in arms]),
                    "critical_slo": spread([a[n]["bands"].get("critical", {}).get("slo_attainment", math.nan)
                                            for a in arms]),
                    "critical_p99_ttft": spread([a[n]["bands"].get("critical", {}).get("p99_ttft", math.nan)
                                                 for a in arms]),
                } for n in names},
                **{k: spread([c[k] for c in ceils]) for k in ("offered_rps", "capacity_rps", "ceiling_rps",
                                                              "best_peer_rps", "ceiling_x_best_peer",
                                                              "offered_x_best_peer",
                                                              "on_x_best_peer")},
                "on_x_off_goodput": spread([a[ON]["goodput_rps"] / a[OFF]["goodput_rps"] for a in arms]),
                "on_x_off_p99_ttft": spread([a[ON]["p99_ttft"] / a[OFF]["p99_ttft"] for a in arms]),
            }
        s["fairness"] = summarise_tenants([c["fairness"] for c in mine], bound)
        below = [c["below"] for c in mine if "below" in c]
        if below:
            s["below"] = summarise_tenants(below, bound)
        out[w] = s
    return out


def summarise_tenants(fair: list[dict[str, Any]], bound: str) -> dict[str, Any]:
    """One two-tenant part over seeds (tenants_run's results): A's P99 ratio and its split, both
    tenants' SLO attainment, B's sheds, the goodput, and the goodput on over off in the same run."""

    def split(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
        """A's P99 TTFT and its parts (the wait in the scheduler's queue, engine to first token), and the share
        of A's requests its busiest engine served."""
        a = [r["tenants"]["A"] for r in runs]
        return {k: spread([x.get(k, math.nan) for x in a])
                for k in ("p99_ttft", "p99_queue_wait", "p99_engine_ttft", "busiest_engine_share")}

    def arm(ratios: list[float], runs: list[dict[str, Any]]) -> dict[str, Any]:
        """One arm's figures over seeds, from A's P99 ratios and the runs with both tenants."""
        return {"a_p99_ratio": spread(ratios), "a_split": split(runs),
                "a_slo": spread([r["tenants"]["A"]["slo_attainment"] for r in runs]),
                "b_slo": spread([r["tenants"]["B"]["slo_attainment"] for r in runs]),
                "goodput_rps": spread([r["goodput_rps"] for r in runs])}

    def on_arm(ratios: list[float], runs: list[dict[str, Any]]) -> dict[str, Any]:
        """An arm with flow control on: what `arm` gives, and B's sheds."""
        return {**arm(ratios, runs), "b_shed": spread([r["tenants"]["B"]["shed"] for r in runs])}

    offs = [f[OFF]["flood"] for f in fair]
    on: dict[str, Any] = {}
    for b in fair[0][ON]["floods"] if fair else {}:
        runs = [f[ON]["floods"][b] for f in fair]
        on[b] = {**on_arm([f[ON]["a_p99_ratio"][b] for f in fair], runs),
                 "on_x_off_goodput": spread([r["goodput_rps"] / o["goodput_rps"]
                                             for r, o in zip(runs, offs, strict=True)])}
    rotating = {k: on_arm([f[ON]["rotating_a_p99_ratio"][k] for f in fair], [f[ON]["rotating"][k] for f in fair])
                for k in (fair[0][ON].get("rotating", {}) if fair else {})}
    return {
        "alone": {"off": split([f[OFF]["alone"] for f in fair]), "on": split([f[ON]["alone"] for f in fair])},
        "off": arm([f[OFF]["a_p99_ratio"][""] for f in fair], offs),
        "on": on,
        "rotating": rotating,
        "bound": bound,
    }


# ---- report ---------------------------------------------------------------------------------------


def _r(x: dict[str, float], fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """`mean [min-max]` (the mean alone for one seed)."""
    if not x["n"]:
        return "-"
    mean = fmt.format(x["mean"] * scale)
    if x["n"] == 1:
        return mean
    return f"{mean} [{fmt.format(x['min'] * scale)}-{fmt.format(x['max'] * scale)}]"


def _pct(x: dict[str, float]) -> str:
    return _r(x, "{:.0f}%", 100.0)


def reachable(x: dict[str, float], goal: float = 1.3) -> str:
    if not x["n"]:
        return "-"
    return "yes" if x["min"] >= goal else "no" if x["max"] < goal else "some seeds"


def _tenant_rows(w: str, f: dict[str, Any], with_on_x_off: bool) -> list[str]:
    """One table row for flow control off and one per over-share bound of a two-tenant scenario."""
    off = f["off"]
    tail = " 1 |" if with_on_x_off else ""
    rows = [f"| {w} | off | {_r(off['a_p99_ratio'])} | {_pct(off['a_slo'])} | {_pct(off['b_slo'])} | 0 | "
            f"{_r(off['goodput_rps'], '{:.1f}')} |{tail}"]
    for b, x in f["on"].items():
        mark = " (the on arm)" if b == f["bound"] else ""
        ratio = f" {_r(x['on_x_off_goodput'], '{:.3f}')} |" if with_on_x_off else ""
        rows.append(f"| {w} | on, bound {b}{mark} | {_r(x['a_p99_ratio'])} | {_pct(x['a_slo'])} | "
                    f"{_pct(x['b_slo'])} | {_r(x['b_shed'], '{:.0f}')} | {_r(x['goodput_rps'], '{:.1f}')} |{ratio}")
    return rows


def render_markdown(cfg: FlowBenchConfig, result: dict[str, Any], plots: list[str], why: str | None) -> str:
    from pilotfish.bench.report import plots_section

    summary = result["summary"]
    md = [
        "# Flow control off and on (virtual time), every workload family",
        "",
        f"{cfg.instances} engines (`{cfg.profile}`, {cfg.num_gpu_blocks} KV blocks); {cfg.requests} requests per "
        f"run; seeds {', '.join(map(str, cfg.seeds))}; SLO TTFT <= {cfg.slo_ttft:g} s and TPOT <= "
        f"{cfg.slo_tpot * 1000:g} ms; the gateway holds up to {cfg.hold_ms} ms; on arm {flow_settings(cfg)} with "
        f"--flow-over-share-bound {over_share_bound(cfg):g}. Knee: the highest load (time compression of the "
        f"family's own rate) with SLO >= {cfg.knee_slo:.0%}, flow control off. Figures: mean [min-max] over seeds. "
        f"Wall {result['wall_seconds']:.0f} s on {result['host']}.",
        "",
        "## Goodput past the knee against the best peer, and the ceiling",
        "",
        "Ceiling: min(offered rate, capacity). No arm's goodput passes the offered rate (a hard bound); capacity "
        "is the most goodput any arm reached at any load of the workload and seed (knee probes included), an "
        "estimate of what an arm that admits exactly the fleet's capacity and serves it within the SLO gets. "
        "`ceiling / best peer` below 1.3 means a goodput 1.3 x the best peer's is out of reach in that cell; "
        "`offered / best peer` below 1.3 means so by arithmetic alone.",
        "",
        "| workload | knee | x knee | offered (req/s) | capacity | best peer goodput | on goodput | on / best peer "
        "| offered / best peer | ceiling / best peer | 1.3 x reachable |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, s in summary.items():
        for mult, p in s["past"].items():
            on = p["arms"].get(ON, {}).get("goodput_rps")
            knee = _r(s["knee"], "{:.3g}") + ("" if s["knee_bounded"] else " (never missed)")
            md.append(f"| {w} | {knee} | {mult} | {_r(p['offered_rps'], '{:.1f}')} | "
                      f"{_r(p['capacity_rps'], '{:.1f}')} | {_r(p['best_peer_rps'], '{:.1f}')} | "
                      f"{_r(on, '{:.1f}') if on else '-'} | {_r(p['on_x_best_peer'])} | "
                      f"{_r(p['offered_x_best_peer'])} | {_r(p['ceiling_x_best_peer'])} | "
                      f"{reachable(p['ceiling_x_best_peer'])} |")
    md += [
        "",
        "## Below the knee: what flow control costs",
        "",
        "| workload | x knee | on / off goodput | on / off P99 TTFT | off P99 TTFT (s) over seeds |",
        "|---|---|---|---|---|",
    ]
    for w, s in summary.items():
        for mult, p in s["past"].items():
            if float(mult) < 1:
                md.append(f"| {w} | {mult} | {_r(p['on_x_off_goodput'], '{:.3f}')} | "
                          f"{_r(p['on_x_off_p99_ttft'], '{:.3f}')} | {_r(p['arms'][OFF]['p99_ttft'])} |")
    md += [
        "",
        f"## Every arm, priority mix {', '.join(cfg.priority_mix)}",
        "",
        "| workload | x knee | arm | SLO met | goodput (req/s) | P99 TTFT (s) | critical SLO | critical P99 TTFT (s) "
        "| shed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, s in summary.items():
        for mult, p in s["past"].items():
            for name, a in p["arms"].items():
                md.append(f"| {w} | {mult} | `{name}` | {_pct(a['slo_attainment'])} | {_r(a['goodput_rps'], '{:.1f}')} "
                          f"| {_r(a['p99_ttft'])} | {_pct(a['critical_slo'])} | {_r(a['critical_p99_ttft'])} | "
                          f"{_r(a['shed'], '{:.0f}')} |")
    md += [
        "",
        f"## Fairness: tenant A at {cfg.tenant_load:g} x knee alone, then with tenant B flooding to "
        f"{cfg.flood_load:g} x knee",
        "",
        "A's P99 TTFT under the flood over alone (goal: at most 1.2), flow control off, then on at each "
        "over-share bound (1: fairness by queue order only); B's SLO attainment and the total goodput are what "
        "the isolation costs.",
        "",
        "| workload | arm | A's P99 ratio | A's SLO | B's SLO | B shed | goodput (req/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, s in summary.items():
        md += _tenant_rows(w, s["fairness"], with_on_x_off=False)
    md += [
        "",
        "Where A's P99 TTFT goes (seconds, P99 of each part on its own): the wait in the scheduler's queue, and "
        "from reaching an engine to the first token (the engine's queue, prefill, a batch shared with B's decodes); "
        "and the share of A's requests its busiest engine served (1/engines would be an even spread).",
        "",
        "| workload | arm | A's P99 TTFT | queue wait | engine to first token | A on its busiest engine |",
        "|---|---|---|---|---|---|",
    ]
    for w, s in summary.items():
        f = s["fairness"]
        rows = [("off, A alone", f["alone"]["off"]), ("on, A alone", f["alone"]["on"]),
                ("off, flood", f["off"]["a_split"]),
                *((f"on, flood, bound {b}", x["a_split"]) for b, x in f["on"].items())]
        for name, x in rows:
            md.append(f"| {w} | {name} | {_r(x['p99_ttft'], '{:.3f}')} | {_r(x['p99_queue_wait'], '{:.3f}')} | "
                      f"{_r(x['p99_engine_ttft'], '{:.3f}')} | {_pct(x['busiest_engine_share'])} |")
    if any(s["fairness"]["rotating"] for s in summary.values()):
        md += [
            "",
            "## A flood that sends many tenant ids",
            "",
            f"B's flood as above, each of its requests carrying a tenant id of its own; A is a tenant served "
            f"before. Flow control on at bound {summary[next(iter(summary))]['fairness']['bound']}: B's ids "
            "folded into one flow until established (`--flow-established-after-ms`, as the scheduler ships), "
            "and counted as given (0). Then B's flood spread over "
            f"{cfg.kept_alive_ids} ids, each kept alive (established), from one client address: grouped by "
            "address as the gateway ships (`--flow-groups source`; A from another address), and counted as "
            "given (`--flow-groups none`). A's P99 ratio is against A alone.",
            "",
            "| workload | B's ids | A's P99 ratio | A's SLO | B's SLO | B shed | goodput (req/s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for w, s in summary.items():
            for k, x in s["fairness"]["rotating"].items():
                md.append(f"| {w} | {k} | {_r(x['a_p99_ratio'])} | {_pct(x['a_slo'])} | {_pct(x['b_slo'])} | "
                          f"{_r(x['b_shed'], '{:.0f}')} | {_r(x['goodput_rps'], '{:.1f}')} |")
    if any("below" in s for s in summary.values()):
        md += [
            "",
            f"## Two tenants below the knee: A at {cfg.below_tenant_load:g} x knee, with B to "
            f"{cfg.below_total_load:g} x knee",
            "",
            "The engines could serve both: what holding the tenant over its share back costs (goal: goodput on / "
            "off within the run-to-run spread), and what it buys A.",
            "",
            "| workload | arm | A's P99 ratio | A's SLO | B's SLO | B shed | goodput (req/s) | on / off goodput |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for w, s in summary.items():
            if "below" in s:
                md += _tenant_rows(w, s["below"], with_on_x_off=True)
    md += ["", "## Plots", "", *plots_section(plots, why), ""]
    problems = result["problems"]
    md.append("Lost or leaked requests: " + ("; ".join(problems) if problems else
                                             "none (every request finished or was shed; queue and account empty)."))
    return "\n".join(md)


def plot(cfg: FlowBenchConfig, summary: dict[str, Any], out_dir: Path) -> tuple[list[str], str | None]:
    """flow_goodput.png (goodput against x knee, one panel per workload, the ceiling dashed) and
    flow_fairness.png (A's P99 ratio against B's SLO attainment, over the over-share bounds)."""
    from pilotfish.bench.report import NO_MATPLOTLIB, family_styles, plot_against_load, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    names = [*cfg.peers, OFF, ON]
    style = family_styles(plt, {n: "pilotfish" if n.startswith("pilotfish") else "peer" for n in names})
    n = len(summary)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (w, s) in zip(axes.flat, summary.items(), strict=False):
        points = {name: [(float(m), *(p["arms"][name]["goodput_rps"][k] for k in ("mean", "min", "max")))
                         for m, p in s["past"].items() if name in p["arms"]] for name in names}
        plot_against_load(ax, points, style, "goodput (req/s)")
        ax.plot([float(m) for m in s["past"]], [p["ceiling_rps"]["mean"] for p in s["past"].values()], "k--",
                linewidth=1, label="ceiling")
        ax.set_xlabel("x knee")
        ax.set_title(w, fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    plots = [save_figure(plt, fig, out_dir / "flow_goodput.png")]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for w, s in summary.items():
        on = s["fairness"]["on"]
        xs = [x["b_slo"]["mean"] * 100 for x in on.values()]
        ys = [x["a_p99_ratio"]["mean"] for x in on.values()]
        line = ax.plot(xs, ys, marker="o", label=w)[0]
        for b, x, y in zip(on, xs, ys, strict=True):
            ax.annotate(b, (x, y), fontsize=7, color=line.get_color())
    ax.axhline(1.2, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("B's SLO attainment (%)")
    ax.set_ylabel("A's P99 TTFT, flood / alone")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    plots.append(save_figure(plt, fig, out_dir / "flow_fairness.png"))
    return plots, None
