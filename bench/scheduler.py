"""`pilotfish bench scheduler`: decision latency in-process, gRPC round trip, cost of a status update.

Figures (single thread, this machine):

- **decision**: `SchedulerCore.schedule` p50/p99 with 256 and 4,096 instances, in wall-clock time and in
  the thread's CPU time (on a shared machine the wall-clock tail is mostly other processes' time
  slices; the CPU time is the decision's own work), lite mode
  (num_requests) and full mode (load-balance on all_prefills_tokens_num, health filters and
  failover), in steady state: requests are released as new ones arrive, and in full mode
  every decision is followed by a status confirming the request and a status update of a random
  instance (`--other-statuses`, one by default; each re-keys its instance in the load index at the
  next decision). Engines report every step, so a large fleet sends several per decision: 256
  engines stepping 30 times a second under 1,000 decisions a second, about 8. Cache-aware and predictor-enhanced
  full mode are measured too (the index merges the cached instances in, and orders the forward
  prediction by drain time; see scheduler/policy/index.py). Each request carries the prefix block
  hashes its prompt fills (one of 64 shared prefixes, at most 8 blocks of 16 tokens): a prompt is
  never shorter than its own cached blocks, as a gateway's hashes are of the prompt's tokens.
- **status update**: one InstanceStatus applied to the core (decoded from bytes + applied,
  and applied alone), 4,096 instances.
- **gRPC**: Schedule round trip p50/p99 from a client to `pilotfish scheduler` in another
  process (256 instances, lite mode), sequential calls on one channel.

Goals (issue 4): decision p99 <= 200 µs at 256 instances and <= 1 ms at 4,096.
"""

from __future__ import annotations

import argparse
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

GOALS_US = {256: 200.0, 4096: 1000.0}
# the requests' prefixes: this many shared prefixes, each this many blocks of this many tokens
PREFIXES, PREFIX_BLOCKS, BLOCK_SIZE = 64, 8, 16
REPEATED_TOKENS = 4 * BLOCK_SIZE  # --repeat-share's prompt: whole blocks, so an engine holds all of it
# the decision configurations: label, full mode, SchedulerConfig fields
# the shipped default first (no flags: whatever SchedulerConfig defaults to), then the named policies
LOAD_BALANCE = {"scheduling_policy": "load-balance"}
# not a SchedulerConfig field: the decision's configuration re-keys the changed instances between decisions, as a
# server does when its loop is free (scheduler/idle_rekey.py), and times that apart from the decision
REKEY_BETWEEN = "rekey_between"
CONFIGS: list[tuple[str, bool, dict[str, Any]]] = [
    ("lite default (predicted-latency)", False, {}),
    ("full default (predicted-latency)", True, {}),
    ("lite default, re-keyed between decisions", False, {REKEY_BETWEEN: True}),
    ("full default, re-keyed between decisions", True, {REKEY_BETWEEN: True}),
    ("lite load-balance (num_requests)", False, LOAD_BALANCE),
    ("full load-balance (all_prefills_tokens_num)", True, LOAD_BALANCE),
    ("full load-balance, top-k 4", True, {**LOAD_BALANCE, "dispatch_top_k": 4}),
    ("full load-balance, cache-aware", True, {**LOAD_BALANCE, "enable_cache_aware_scheduling": True}),
    ("full load-balance, predictor-enhanced", True, {**LOAD_BALANCE, "enable_predictor_enhanced_scheduling": True}),
]


class SchedulerBenchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every knob of `bench scheduler`, with its default (the flags and bench/README.md's table come from it)."""

    decisions: Annotated[int, Meta(ge=1, description="timed decisions per configuration")] = 20_000
    rpcs: Annotated[int, Meta(ge=1, description="timed Schedule round trips")] = 3_000
    sizes: Annotated[list[int], Meta(min_length=1, description="instance counts")] = msgspec.field(
        default_factory=lambda: [256, 4096]
    )
    seed: Annotated[int, Meta(description="seed of the random statuses and prompts")] = 1
    configs: Annotated[
        list[str], Meta(description="only the decision configurations whose label contains one of these (none: all)")
    ] = msgspec.field(default_factory=list)
    decisions_only: Annotated[bool, Meta(description="skip the status-update and gRPC figures (with --configs)")] = (
        False
    )
    index_blocks: Annotated[int, Meta(ge=0, description=(
        "also fill a full-mode scheduler's prefix index with this many blocks per engine (the largest --sizes), "
        "4,096-token prompts a quarter of them shared, and time the garbage collector's full pass (0: not)"))] = 0
    repeat_share: Annotated[float, Meta(ge=0, le=1, description=(
        "share of the decisions that ask one short prompt again (64 tokens: retries, a fixed classification "
        "prompt), which every engine that served it holds whole"))] = 0.0
    other_statuses: Annotated[int, Meta(ge=0, le=4096, description=(
        "full mode: status updates of random other engines after each decision, each re-keying its engine at the "
        "next decision (engines report every step: 256 stepping 30 times a second under 1,000 decisions a second "
        "send about 8 per decision)"))] = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, SchedulerBenchConfig)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(samples_s: list[float]) -> dict[str, float]:
    return _summary_us([s * 1e6 for s in samples_s])


def _summary_us(us: list[float]) -> dict[str, float]:
    return {
        "mean_us": round(sum(us) / len(us), 1),
        "p50_us": round(_pct(us, 0.50), 1),
        "p99_us": round(_pct(us, 0.99), 1),
        "n": len(us),
    }


def _meta(k: int) -> Any:
    from pilotfish.protos import cms_pb2

    return cms_pb2.InstanceMetadata(
        instance_id=f"i{k}",
        host=f"10.{k // 65536}.{k // 256 % 256}.{k % 256}",
        http_port=8000,
        model="m",
        infer_type=1,
        node_id=f"node{k // 8}",
        num_gpu_blocks=16384,
        max_num_batched_tokens=8192,
        update_id=1,
    )


def _status(k: int, update_id: int, rng: random.Random, admitted: list[str] = ()) -> Any:  # type: ignore[assignment]
    from pilotfish.protos import cms_pb2

    return cms_pb2.InstanceStatus(
        instance_id=f"i{k}",
        update_id=update_id,
        timestamp_ms=int(time.time() * 1000),
        step_id=update_id,
        schedulable=True,
        num_waiting=rng.randrange(0, 8),
        num_running=rng.randrange(0, 64),
        num_running_decode=rng.randrange(0, 64),
        uncomputed_prefill_tokens=rng.randrange(0, 20_000),
        running_decode_seq_len_sum=rng.randrange(0, 200_000),
        used_kv_tokens=rng.randrange(0, 200_000),
        total_kv_tokens=262_144,
        unallocated_tokens=rng.randrange(0, 10_000),
        last_step_duration_us=rng.randrange(8_000, 200_000),
        last_step_prefill_tokens=rng.randrange(0, 8192),
        last_step_decode_batch=rng.randrange(1, 64),
        last_step_seq_len_sum=rng.randrange(0, 200_000),
        admitted_request_ids=list(admitted),
    )


def _decisions(
    n: int, full: bool, decisions: int, seed: int, repeat_share: float = 0.0, other_statuses: int = 1,
    rekey_between: bool = False, **flags: Any,
) -> dict[str, Any]:
    """Wall-clock and thread-CPU figures of `decisions` timed decisions (after a warm-up) in steady state;
    `repeat_share` of them ask the same short prompt (their own draws: the rest are the same requests); in full
    mode each is followed by the chosen engine's status and `other_statuses` of random others. With
    `rekey_between` the changed instances are re-keyed after each decision's changes, timed apart ("rekey")."""
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore

    rng = random.Random(seed)
    if full:
        core = SchedulerCore(SchedulerConfig(enable_full_mode_scheduling=True, model=["m"], **flags))
        updates = [1] * n
        for k in range(n):
            core.apply_metadata(_meta(k))
            core.apply_status(_status(k, 1, rng))
    else:
        instances = [f"i{k}=10.0.{k // 256}.{k % 256}:8000" for k in range(n)]
        core = SchedulerCore(SchedulerConfig(instances=instances, model=["m"], **flags))
    in_flight = 2 * n  # steady state: about two requests held per instance
    outputs = random.Random(seed + 1)  # answer lengths apart, so the requests are the same with or without them
    prefixes = prefix_chains(rng)
    repeats = random.Random(seed + 2)
    repeated = prefix_chains(random.Random(seed + 3))[0]
    wall: list[float] = []
    cpu: list[float] = []
    rekey: list[float] = []
    warmup = min(2000, decisions // 5)
    for i in range(warmup + decisions):
        req = request(f"r{i}", rng.randrange(16, 4096), prefixes[i % PREFIXES])
        if repeat_share and repeats.random() < repeat_share:
            req = request(req.request_id, REPEATED_TOKENS, repeated)
        # the thread's CPU clock as well as the wall clock: on a shared machine the wall-clock tail is
        # other processes' time slices, the CPU time the decision's own work
        cpu_started = time.thread_time_ns()
        started = time.perf_counter_ns()
        decision = core.schedule(req)
        elapsed = time.perf_counter_ns() - started
        cpu_elapsed = time.thread_time_ns() - cpu_started
        if i >= warmup:
            wall.append(elapsed / 1000)
            cpu.append(cpu_elapsed / 1000)
        if i >= in_flight:
            done = f"r{i - in_flight}"
            if not full:
                # a lite gateway counts the answer and reports it before the release (full mode's skips
                # response bodies): the default learns from it what a batch's answers absorb
                core.report(done, outputs.randrange(16, 512), True)
            core.release(done)
        if full:
            k = int(decision.target.instance_id[1:])
            updates[k] += 1
            core.apply_status(_status(k, updates[k], rng, [f"r{i}"]))
            for _ in range(other_statuses):
                other = rng.randrange(n)
                updates[other] += 1
                core.apply_status(_status(other, updates[other], rng))
        if rekey_between:
            cpu_started = time.thread_time_ns()
            core.rekey_changed()
            if i >= warmup:
                rekey.append((time.thread_time_ns() - cpu_started) / 1000)
    fig = {**_summary_us(wall), "cpu": _summary_us(cpu)}
    if rekey_between:
        fig["rekey_cpu"] = _summary_us(rekey)
    return fig


def prefix_chains(rng: random.Random) -> list[tuple[int, ...]]:
    """The shared prefixes, each a chain of PREFIX_BLOCKS block hashes."""
    return [tuple(rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)) for _ in range(PREFIXES)]


def request(request_id: str, prompt_tokens: int, prefix: tuple[int, ...]) -> Any:
    """A request whose prompt starts with `prefix`: its hashes are the blocks the prompt fills (a prompt
    shorter than the prefix carries fewer), so no request has more cached tokens than prompt tokens."""
    from pilotfish.scheduler.view.types import RequestInfo

    hashes = prefix[: prompt_tokens // BLOCK_SIZE]
    return RequestInfo(
        request_id, "m", prompt_tokens=prompt_tokens, prefix_block_hashes=hashes, prefix_block_size=BLOCK_SIZE
    )


def _collector_pause(n: int, blocks: int, seed: int) -> dict[str, Any]:
    """A full-mode core's prefix index filled with `blocks` blocks on each of `n` engines (4,096-token prompts,
    a quarter from 64 shared ones): the garbage collector's full pass over the process, and the objects it
    tracks. The scheduler's loop stands still for such a pass."""
    import gc

    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore

    rng = random.Random(seed)
    core = SchedulerCore(SchedulerConfig(enable_full_mode_scheduling=True, model=["m"],
                                         prefix_index_capacity_blocks=blocks))
    index = core.prefix_index
    assert index is not None
    chain = 4096 // BLOCK_SIZE
    shared = [tuple(rng.getrandbits(64) for _ in range(chain)) for _ in range(64)]
    for k in range(n):
        for _ in range(-(-blocks // chain)):
            own = rng.random() >= 0.25
            index.record_dispatch(f"i{k}", tuple(rng.getrandbits(64) for _ in range(chain)) if own
                                  else rng.choice(shared))
    pauses = []
    for _ in range(3):
        started = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - started) * 1000)
    return {"instances": n, "blocks_per_instance": blocks, "blocks": len(index),
            "tracked_objects": len(gc.get_objects()), "full_pass_ms": round(min(pauses), 1)}


def _status_cost(n: int, count: int, seed: int) -> dict[str, Any]:
    from pilotfish.cms.records import decode_status
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore
    from pilotfish.scheduler.view.types import RequestInfo

    rng = random.Random(seed)
    core = SchedulerCore(SchedulerConfig(enable_full_mode_scheduling=True, model=["m"]))
    for k in range(n):
        core.apply_metadata(_meta(k))
        core.apply_status(_status(k, 1, rng))
    core.schedule(RequestInfo("warm", "m", prompt_tokens=10))  # build the load index
    raws = [_status(rng.randrange(n), 2 + i, rng, [f"x{i}"]).SerializeToString() for i in range(count)]
    decoded, applied = [], []
    for raw in raws:
        t0 = time.perf_counter()
        status = decode_status(raw)
        t1 = time.perf_counter()
        core.apply_status(status)
        t2 = time.perf_counter()
        decoded.append(t2 - t0)
        applied.append(t2 - t1)
    # the index re-keys changed instances at the next decision: count that share too
    t0 = time.perf_counter()
    core.schedule(RequestInfo("after", "m", prompt_tokens=10))
    return {
        "decode_and_apply": _summary(decoded),
        "apply_only": _summary(applied),
        "bytes": round(sum(len(r) for r in raws) / len(raws)),
    }


def _grpc(n: int, rpcs: int) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pilotfish.procs import free_port
    from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc

    port, session_port = free_port(), free_port()
    instances = ",".join(f"i{k}=10.0.{k // 256}.{k % 256}:8000" for k in range(n))
    cmd = [sys.executable, "-m", "pilotfish", "scheduler", "--port", str(port), "--instances", instances,
           "--session-port", str(session_port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            schedule, release = [], []
            for i in range(rpcs + 200):
                req = scheduler_pb2.ScheduleRequest(request_id=f"r{i}", model="m", prompt_tokens=100)
                t0 = time.perf_counter()
                stub.Schedule(req, timeout=5)
                t1 = time.perf_counter()
                stub.Release(scheduler_pb2.ReleaseRequest(request_id=f"r{i}"), timeout=5)
                t2 = time.perf_counter()
                if i >= 200:
                    schedule.append(t1 - t0)
                    release.append(t2 - t1)
            client = {
                "socket": _client_schedules(port, rpcs, True, f"127.0.0.1:{session_port}"),
                "session": _client_schedules(port, rpcs, True),
                "unary": _client_schedules(port, rpcs, False),
            }
        return {"schedule": _summary(schedule), "release": _summary(release), "instances": n, "client": client}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client_schedules(port: int, rpcs: int, session: bool, session_address: str = "") -> dict[str, float]:
    """Schedule round trips as the ext_proc makes them (its client, on uvloop), each request released
    after: on the Session socket, on the gRPC Session stream, or as unary calls."""
    import asyncio

    import uvloop

    from pilotfish.ext_proc.scheduler_client import GrpcScheduler
    from pilotfish.protos import scheduler_pb2

    async def run() -> list[float]:
        client = GrpcScheduler(f"127.0.0.1:{port}", 5.0, 0.05, session=session, session_address=session_address)
        kind = "t" if session_address else "s" if session else "u"
        times = []
        try:
            for i in range(rpcs + 200):
                req = scheduler_pb2.ScheduleRequest(request_id=f"{kind}{i}", model="m", prompt_tokens=100)
                t0 = time.perf_counter()
                await client.schedule(req)
                if i >= 200:
                    times.append(time.perf_counter() - t0)
                client.release(f"{kind}{i}", scheduler_pb2.RELEASE_REASON_FINISHED)
                await asyncio.sleep(0)  # the release goes out before the next schedule, as between requests
        finally:
            await client.close()
        return times

    return _summary(uvloop.run(run()))


def _decision_rows(decisions: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        "| configuration | instances | wall mean µs | wall p50 µs | wall p99 µs | CPU mean µs | CPU p50 µs "
        "| CPU p99 µs | goal p99 µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, fig in decisions.items():
        n = fig["instances"]
        cpu = fig.get("cpu", {})  # a result written before the CPU column has none
        rows.append(
            f"| {label.split(' @ ')[0]} | {n} | {fig['mean_us']} | {fig['p50_us']} | {fig['p99_us']} "
            f"| {cpu.get('mean_us', '')} | {cpu.get('p50_us', '')} | {cpu.get('p99_us', '')} | {GOALS_US.get(n, '')} |"
        )
    between = [(label, fig["rekey_cpu"]) for label, fig in decisions.items() if "rekey_cpu" in fig]
    if between:
        rows += ["", "The re-keying those \"re-keyed between decisions\" did apart, after each decision's changes "
                 "(thread CPU per decision; a server's loop does it when free, else before the next decision):", ""]
        rows += [f"- {label}: mean {r['mean_us']} µs, p50 {r['p50_us']}, p99 {r['p99_us']}" for label, r in between]
    return rows


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(SchedulerBenchConfig, args)
    result = measure(cfg, chosen_configs(cfg))
    result["command"] = command(cfg, args.out)
    markdown = render_markdown(result)
    write_report(Path(args.out), "scheduler", result, markdown)
    print(markdown)
    return 0


def chosen_configs(cfg: SchedulerBenchConfig) -> list[tuple[str, bool, dict[str, Any]]]:
    """The decision configurations --configs picks (all without it)."""
    return [c for c in CONFIGS if not cfg.configs or any(w in c[0] for w in cfg.configs)]


def measure(cfg: SchedulerBenchConfig, configs: list[tuple[str, bool, dict[str, Any]]]) -> dict[str, Any]:
    """Decisions per configuration and size; then, unless --decisions-only, a status update and gRPC."""
    decisions: dict[str, dict[str, Any]] = {}
    for label, full, flags in configs:
        for n in cfg.sizes:
            fig = _decisions(n, full, cfg.decisions, cfg.seed, cfg.repeat_share, cfg.other_statuses, **flags)
            decisions[f"{label} @ {n}"] = {**fig, "instances": n}
            print(f"{label} @ {n}: {decisions[f'{label} @ {n}']}", flush=True)
    result: dict[str, Any] = {
        "decisions": decisions,
        "goals_p99_us": GOALS_US,
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "settings": msgspec.structs.asdict(cfg),
    }
    if cfg.index_blocks:
        result["collector"] = _collector_pause(max(cfg.sizes), cfg.index_blocks, cfg.seed)
        print(f"collector: {result['collector']}", flush=True)
    if cfg.decisions_only:
        return result
    result["status_update"] = {**_status_cost(max(cfg.sizes), 5000, cfg.seed), "instances": max(cfg.sizes)}
    print(f"status update: {result['status_update']}", flush=True)
    result["grpc"] = _grpc(min(cfg.sizes), cfg.rpcs)
    print(f"gRPC: {result['grpc']}", flush=True)
    return result


def command(cfg: SchedulerBenchConfig, out: Path) -> str:
    """The command line that reruns this configuration."""
    default = SchedulerBenchConfig()
    # quoted: a label such as "full default" is one argument
    given = (f" --configs {shlex.quote(','.join(cfg.configs))}" if cfg.configs else "") + (
        " --decisions-only" if cfg.decisions_only else ""
    )
    if cfg.sizes != default.sizes:
        given += f" --sizes {','.join(map(str, cfg.sizes))}"
    if cfg.decisions != default.decisions:
        given += f" --decisions {cfg.decisions}"
    if cfg.index_blocks != default.index_blocks:
        given += f" --index-blocks {cfg.index_blocks}"
    if cfg.repeat_share != default.repeat_share:
        given += f" --repeat-share {cfg.repeat_share:g}"
    if cfg.other_statuses != default.other_statuses:
        given += f" --other-statuses {cfg.other_statuses}"
    return f"pilotfish bench scheduler{given} --out {out}"


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone."""
    md = ["# Scheduler benchmark", "", "## Schedule decision, in-process", ""]
    share = result.get("settings", {}).get("repeat_share", 0)
    if share:
        md += [f"{share:.0%} of the decisions ask one 64-token prompt again, held whole by the engines that "
               "served it.", ""]
    others = result.get("settings", {}).get("other_statuses", 1)
    if others != 1:
        md += [f"Full mode: {others} status update(s) of other engines after each decision (the default: 1), "
               "re-keyed at the next decision.", ""]
    md += _decision_rows(result["decisions"])
    if "collector" in result:
        c = result["collector"]
        md += ["", f"## The garbage collector's full pass ({c['instances']:,} engines, {c['blocks_per_instance']:,} "
               "blocks each in the prefix index)", "",
               f"- {c['full_pass_ms']} ms (the fastest of 3), over {c['tracked_objects']:,} tracked objects; "
               f"{c['blocks']:,} distinct blocks"]
    if "status_update" in result:
        md += ["", *_status_lines(result["status_update"])]
    if "grpc" in result:
        md += ["", *_grpc_lines(result["grpc"])]
    md += ["", f"Command: `{result['command']}`"]
    return "\n".join(md)


def _status_lines(status: dict[str, Any]) -> list[str]:
    return [
        f"## One status update ({status.get('instances', 4096):,} instances)",
        "",
        f"- decode + apply: p50 {status['decode_and_apply']['p50_us']} µs, "
        f"p99 {status['decode_and_apply']['p99_us']} µs ({status['bytes']} bytes)",
        f"- apply only: p50 {status['apply_only']['p50_us']} µs, p99 {status['apply_only']['p99_us']} µs",
    ]


def _grpc_lines(rpc: dict[str, Any]) -> list[str]:
    client = rpc["client"]
    return [
        f"## gRPC round trip ({rpc['instances']} instances, lite, another process)",
        "",
        "grpc's blocking client, unary calls:",
        "",
        f"- Schedule: p50 {rpc['schedule']['p50_us']} µs, p99 {rpc['schedule']['p99_us']} µs",
        f"- Release: p50 {rpc['release']['p50_us']} µs, p99 {rpc['release']['p99_us']} µs",
        "",
        "The ext_proc's client (on uvloop), each request released after:",
        "",
        f"- Schedule on the Session socket (`--session-port`): p50 {client['socket']['p50_us']} µs, "
        f"p99 {client['socket']['p99_us']} µs",
        f"- Schedule on the gRPC Session stream: p50 {client['session']['p50_us']} µs, "
        f"p99 {client['session']['p99_us']} µs",
        f"- Schedule as unary calls: p50 {client['unary']['p50_us']} µs, p99 {client['unary']['p99_us']} µs",
    ]
