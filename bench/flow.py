"""`pilotfish bench flow`: flow control off and on, in virtual time, past the knee.

The scheduler's own FlowController (scheduler/flow) runs on the virtual-time cluster's clock over
the full-mode core (bench/cluster_full.py's router): a request arrives, is dispatched or waits in
the queue, and leaves it when an engine's status (written after every step) shows room, exactly
as the service drains on a CMS status; deadlines are timers. A shed request never reaches an
engine (the gateway's 429). Every run asserts that nothing is lost: each request finished or was
shed, the queue is empty and the core's account drained to zero.

Three parts, one command:

1. the knee: full mode without flow control over a sweep of loads; the knee is the highest load
   whose SLO attainment is at least `--knee-slo` (90%);
2. past the knee (`--loads`, multiples of the knee; one below it shows the cost there): arms
   `pilotfish-full:load-balance` (off), `pilotfish-full:load-balance+flow-control` (on) and the
   peer reproductions (`--peers`), on a priority mix (`--priority-mix`): goodput, SLO attainment,
   P99 TTFT per band, sheds;
3. fairness: tenant A alone at `--tenant-load` x knee, then with tenant B flooding on top (the
   total at `--flood-load` x knee), both standard: A's P99 TTFT with the flood over without it,
   flow control off and on.

    pilotfish bench flow --out DIR
    pilotfish bench flow --instances 4 --requests 1200 --loads 0.8,1.2,1.5 --out DIR
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pilotfish.simulator.cluster import ClusterConfig, Router
    from pilotfish.simulator.traces import Trace

BANDS = ("critical", "standard", "sheddable")
OFF, ON = "pilotfish-full:load-balance", "pilotfish-full:load-balance+flow-control"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--instances", type=int, default=4, help="simulated engines")
    parser.add_argument("--requests", type=int, default=1200, help="requests per run (system-prompt family)")
    parser.add_argument("--rate", type=float, default=10.0, help="the trace's own arrival rate (load 1), req/s")
    parser.add_argument("--sweep", default="4,6,8,10,12,14,16",
                        help="loads (time compression) the knee is searched over")
    parser.add_argument("--knee-slo", type=float, default=0.9, help="the knee: highest load meeting this SLO share")
    parser.add_argument("--loads", default="0.8,1.2,1.5", help="multiples of the knee to compare off and on at")
    parser.add_argument("--peers", default="sglang,llm-d,dynamo", help="peer reproductions run beside (empty: none)")
    parser.add_argument("--priority-mix", default="critical=0.2,standard=0.6,sheddable=0.2",
                        help="band shares of the requests (seeded draw per request)")
    parser.add_argument("--tenant-load", type=float, default=0.6, help="fairness: tenant A alone, x knee")
    parser.add_argument("--flood-load", type=float, default=1.5, help="fairness: A plus B's flood, x knee")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT at most this many seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: TPOT at most this many seconds")
    parser.add_argument("--hold-ms", type=int, default=3000, help="the gateway's --schedule-queue-timeout-ms")
    parser.add_argument("--flow", default="flow_max_queued_prefill_tokens=2048",
                        help="SchedulerConfig flow fields of the on arm: k=v,... (flow_max_kv_usage=0.9)")
    parser.add_argument("--profile", default="llama3-8b-a100", help="engine step-time profile")
    parser.add_argument("--num-gpu-blocks", type=int, default=30000, help="KV blocks per engine")
    parser.add_argument("--seed", type=int, default=0)


# ---- the flow-controlled cluster ----------------------------------------------------------------


@dataclass(slots=True)
class Labels:
    band: dict[str, str] = field(default_factory=dict)  # request id -> band name
    flow: dict[str, str] = field(default_factory=dict)  # request id -> tenant


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
                                           labels.flow.get(rid, ""), hold_s, lambda o, rid=rid: self._late(rid, o))
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


# ---- runs ---------------------------------------------------------------------------------------


def _trace(args: argparse.Namespace, rate: float, n: int, seed: int, namespace: str) -> Trace:
    from pilotfish.simulator.traces.families import system_prompt_trace

    return system_prompt_trace(requests=n, rate=rate, seed=seed, namespace=namespace)


def _router(name: str, engine: Any, seed: int) -> Router:
    from pilotfish.bench.cluster_policies import policy_spec

    return policy_spec(OFF if name == ON else name, engine).make(seed)


def run_arm(args: argparse.Namespace, name: str, trace: Trace, labels: Labels) -> dict[str, Any]:
    """One arm over one trace; the figures and the loss check."""
    from pilotfish.simulator.cluster import ClusterConfig
    from pilotfish.simulator.config import EngineConfig

    engine = EngineConfig(profile=args.profile, num_gpu_blocks=args.num_gpu_blocks)
    router = _router(name, engine, args.seed)
    sim = _cluster_sim(ClusterConfig(engines=args.instances, engine=engine), router, labels,
                       _flow_fields(args.flow) if name == ON else None, args.hold_ms / 1000)
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
            **figures(trace, records, sim.shed if hasattr(sim, "shed") else {}, labels, args.slo_ttft, args.slo_tpot)}


def figures(trace: Trace, records: dict[str, Any], shed: dict[str, str], labels: Labels, slo_ttft: float,
            slo_tpot: float) -> dict[str, Any]:
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
            "p99_ttft": percentile([r.ttft for r in served if r.ttft is not None], 99),
        }
    return out


def _flow_fields(text: str) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = item.partition("=")
        out[key] = yaml.safe_load(raw)
    return out


def _mix(text: str) -> list[tuple[str, float]]:
    pairs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        band, _, share = item.partition("=")
        if band not in BANDS:
            raise SystemExit(f"--priority-mix: {band!r} is not one of {', '.join(BANDS)}")
        pairs.append((band, float(share)))
    return pairs


def priority_labels(trace: Trace, mix: list[tuple[str, float]], seed: int) -> Labels:
    rng = random.Random(f"priority:{seed}")
    bands, weights = [b for b, _ in mix], [w for _, w in mix]
    return Labels(band={r.request_id: rng.choices(bands, weights)[0] for r in trace})


# ---- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.simulator.traces import compress

    started = time.monotonic()
    base = _trace(args, args.rate, args.requests, args.seed, "flow")
    mix = _mix(args.priority_mix)

    # 1. the knee, off
    sweep: dict[str, dict[str, Any]] = {}
    knee = None
    for load in (float(x) for x in args.sweep.split(",") if x.strip()):
        trace = compress(base, load)
        m = run_arm(args, OFF, trace, Labels())
        sweep[f"{load:g}"] = m
        _progress(f"knee sweep: load {load:g}: SLO {m['slo_attainment']:.1%}")
        if m["slo_attainment"] >= args.knee_slo:
            knee = load
        else:
            break
    if knee is None:
        print("no load of --sweep meets --knee-slo: lower the sweep", file=sys.stderr)
        return 2

    # 2. past the knee, priority mix
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    past: dict[str, dict[str, Any]] = {}
    for mult in (float(x) for x in args.loads.split(",") if x.strip()):
        trace = compress(base, knee * mult)
        labels = priority_labels(trace, mix, args.seed)
        past[f"{mult:g}"] = {}
        for name in (*peers, OFF, ON):
            past[f"{mult:g}"][name] = run_arm(args, name, trace, labels)
            _progress(f"{mult:g} x knee: {name}: SLO {past[f'{mult:g}'][name]['slo_attainment']:.1%}")

    # 3. fairness: tenant A alone, then with B flooding
    a_rate = args.rate * knee * args.tenant_load
    b_rate = args.rate * knee * (args.flood_load - args.tenant_load)
    n_a = max(100, int(args.requests * args.tenant_load / args.flood_load))
    trace_a = _trace(args, a_rate, n_a, args.seed + 1, "tenant-a")
    span = trace_a[-1].arrival
    n_b = int(b_rate * span)
    trace_b = [r for r in _trace(args, b_rate, n_b + 50, args.seed + 2, "tenant-b") if r.arrival <= span]
    flooded = sorted(trace_a + trace_b, key=lambda r: r.arrival)
    tenants = Labels(flow={**{r.request_id: "A" for r in trace_a}, **{r.request_id: "B" for r in trace_b}})
    fairness: dict[str, Any] = {}
    for name in (OFF, ON):
        alone = run_arm(args, name, trace_a, tenants)
        flood = run_arm(args, name, flooded, tenants)
        fairness[name] = {"alone": alone, "flood": flood,
                          "a_p99_ratio": flood["tenants"]["A"]["p99_ttft"] / alone["tenants"]["A"]["p99_ttft"]}
        _progress(f"fairness {name}: A's P99 TTFT x{fairness[name]['a_p99_ratio']:.2f} under B's flood")

    problems = [f"{where}: {p}" for where, m in _all_runs(sweep, past, fairness) for p in m["problems"]]
    result = {
        "instances": args.instances, "requests": args.requests, "rate": args.rate, "profile": args.profile,
        "num_gpu_blocks": args.num_gpu_blocks, "seed": args.seed, "slo": {"ttft_s": args.slo_ttft,
        "tpot_s": args.slo_tpot}, "priority_mix": args.priority_mix, "hold_ms": args.hold_ms,
        "flow_fields": _flow_fields(args.flow), "knee_slo": args.knee_slo, "knee": knee, "sweep": sweep,
        "past_knee": past, "fairness": fairness, "tenant_load": args.tenant_load, "flood_load": args.flood_load,
        "tenant_requests": {"A": len(trace_a), "B": len(trace_b)},
        "problems": problems, "wall_seconds": time.monotonic() - started,
        "host": platform.node(), "python": platform.python_version(),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(result)
    write_report(args.out, "flow", result, md)
    print(md)
    if problems:
        print("LOST OR LEAKED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


def _all_runs(sweep: dict[str, Any], past: dict[str, Any], fairness: dict[str, Any]) -> list[tuple[str, Any]]:
    runs = [(f"sweep {k}", m) for k, m in sweep.items()]
    runs += [(f"{k} x knee {n}", m) for k, arms in past.items() for n, m in arms.items()]
    runs += [(f"fairness {n} {part}", f[part]) for n, f in fairness.items() for part in ("alone", "flood")]
    return runs


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _s(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def render_markdown(r: dict[str, Any]) -> str:
    slo = r["slo"]
    md = [
        "# Flow control off and on (virtual time)",
        "",
        f"{r['instances']} engines (`{r['profile']}`, {r['num_gpu_blocks']} KV blocks), the system-prompt family "
        f"({r['requests']} requests at {r['rate']:g} req/s x load), seed {r['seed']}; SLO TTFT <= {slo['ttft_s']:g} s "
        f"and TPOT <= {slo['tpot_s'] * 1000:g} ms; the gateway holds up to {r['hold_ms']} ms; flow settings "
        f"{r['flow_fields'] or 'the defaults'}. Knee (highest load with SLO >= {r['knee_slo']:.0%}, flow control "
        f"off): **{r['knee']:g}**. Wall {r['wall_seconds']:.0f} s on {r['host']}.",
        "",
        "## Knee sweep (off)",
        "",
        "| load | SLO met | goodput (req/s) | P99 TTFT (s) |",
        "|---|---|---|---|",
        *[f"| {k} | {m['slo_attainment']:.1%} | {_s(m['goodput_rps'])} | {_s(m['p99_ttft'])} |"
          for k, m in r["sweep"].items()],
        "",
        f"## Past the knee, priority mix {r['priority_mix']}",
        "",
        "| x knee | arm | SLO met | goodput (req/s) | shed | critical SLO / P99 TTFT | standard SLO / P99 | "
        "sheddable SLO / P99 / shed |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for mult, arms in r["past_knee"].items():
        for name, m in arms.items():
            b = m["bands"]

            def band(n: str, with_shed: bool = False, b: dict[str, Any] = b) -> str:
                x = b.get(n)
                if x is None:
                    return "-"
                cell = f"{x['slo_attainment']:.0%} / {_s(x['p99_ttft'])} s"
                return cell + (f" / {x['shed']}" if with_shed else "")

            md.append(f"| {mult} | `{name}` | {m['slo_attainment']:.1%} | {_s(m['goodput_rps'])} | {m['shed']} | "
                      f"{band('critical')} | {band('standard')} | {band('sheddable', True)} |")
    f = r["fairness"]
    md += [
        "",
        f"## Fairness: tenant A at {r['tenant_load']:g} x knee alone, then with tenant B flooding to "
        f"{r['flood_load']:g} x knee ({r['tenant_requests']['A']} and {r['tenant_requests']['B']} requests)",
        "",
        "| arm | A alone: P99 TTFT | A under flood: P99 TTFT | ratio | A's SLO (alone, flood) | B's SLO | B shed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in f.items():
        a0, a1, b1 = x["alone"]["tenants"]["A"], x["flood"]["tenants"]["A"], x["flood"]["tenants"]["B"]
        md.append(f"| `{name}` | {_s(a0['p99_ttft'])} s | {_s(a1['p99_ttft'])} s | {x['a_p99_ratio']:.2f} | "
                  f"{a0['slo_attainment']:.0%}, {a1['slo_attainment']:.0%} | {b1['slo_attainment']:.0%} | "
                  f"{b1['shed']} |")
    md += ["", "Lost or leaked requests: " + ("; ".join(r["problems"]) if r["problems"] else
                                                "none (every request finished or was shed; queue and account empty).")]
    return "\n".join(md)
