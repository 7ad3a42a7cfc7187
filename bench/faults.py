"""`pilotfish bench faults`: one fault at a time, injected by PID into a stack this benchmark starts
itself, under a bounded open-loop load of streaming requests on loopback; then a soak.

Each fault gets a fresh stack (`pilotfish.stack.start_stack`: each simulated engine its own
process in lite mode; full mode adds a Redis CMS the engines' llumlets write to; `etcd-restart`
runs lite mode with `--discovery etcd://` and a discovery sidecar registering the engines). The
load sends `rate` streaming completions a second on a fixed schedule (open loop: a slow answer
does not slow the arrivals), at most `max_in_flight` at once (arrivals past that are counted as
skipped, never sent), for the warm-up, the fault and `after_seconds` more. Every request's
outcome is recorded: the error the client saw, whether a 200 stream ended without `data: [DONE]`,
and the routing the gateway tagged it with (`x-pilotfish-instance`: the engine the scheduler
picked; `x-pilotfish-route`: scheduler or fallback). The scheduler's /metrics is sampled every
`sample_interval_seconds` meanwhile (dispatches, in-flight account, ejections, view staleness).
After the load stops, the scheduler's account must drain to zero.

Definitions the report uses (seconds from the start of the load; a fault's *window* runs from the
kill to the moment it answers again):

- engine faults: *detect* = the fault to the last request picked for the faulty engine while it
  was down or stalled (0: none was); *recover* = from it answering again to the first request
  picked for it that succeeded.
- component faults: *detect* = the kill to the first request the gateway served another way than
  through the scheduler (none: the client could not tell); *recover* = from the restart to the
  last request sent that failed or was not routed by the scheduler (0: none after the restart).

`run()` is split into set-up (`Rig`), measure (`measure_fault`, `measure_soak`) and report
(`summarise_fault`, `summarise_soak`, `render_markdown`, `plot_timeline`); the functions that
turn records into figures are pure and tested (tests/unit/test_bench_faults.py). What the soak
samples besides RSS and the rule that calls its memory flat live in bench/faults_soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.faults_soak import (
    MEMORY_FIELDS,
    envoy_memory,
    plot_memory,
    process_kib,
    render_memory,
    summarise_memory,
)

MODEL = "pilotfish-sim"
TARGET_ENGINE = "sim-1"  # the engine the engine faults hit (engines are sim-0 and sim-1)
OK = "ok"
INCOMPLETE = "incomplete stream (200, cut before data: [DONE])"
NOMINAL_ROUTE = "scheduler"


@dataclass(frozen=True)
class Fault:
    name: str
    mode: str  # lite, full, etcd (lite with etcd discovery)
    kind: str  # engine, component, notices, not-applicable
    what: str  # what the bench does
    models: str  # what it stands for in production


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("engine-kill", "lite", "engine", "kill -9 engine sim-1, start it again on its port after "
              "engine_down_seconds", "an engine host or process crash"),
        Fault("engine-kill-midstream", "lite", "engine", "long streams (stream_tokens); kill -9 sim-1 once the "
              "scheduler holds streams on it, restart after engine_down_seconds", "a crash with streams half sent"),
        Fault("engine-stall", "lite", "engine", "SIGSTOP sim-1 for stall_seconds, then SIGCONT",
              "a stalled engine (GC pause, hung GPU, swapped out): the port accepts, nothing answers"),
        Fault("engine-flap", "lite", "engine", "kill -9 sim-1 and restart it `flaps` times (down "
              "flap_down_seconds, up flap_up_seconds)", "a crash-looping engine"),
        Fault("scheduler-kill", "lite", "component", "kill -9 the scheduler, restart it on its ports after "
              "component_down_seconds", "a scheduler crash"),
        Fault("ext-proc-kill", "lite", "component", "kill -9 the ext_proc, restart it on its port after "
              "component_down_seconds", "a gateway picker crash"),
        Fault("etcd-restart", "etcd", "component", "lite mode with --discovery etcd:// and a discovery sidecar; "
              "kill -9 etcd, restart it on its port (same data dir) after component_down_seconds",
              "the discovery store restarting under its consumers"),
        Fault("redis-kill", "full", "component", "full mode; kill -9 Redis, restart it (empty) on its port after "
              "component_down_seconds", "the CMS store crashing and losing its records"),
        Fault("cms-notices-drop", "full", "notices", "full mode; for notice_drop_seconds Redis's ACL denies "
              "SUBSCRIBE and the subscriber connections are cut (CLIENT KILL TYPE pubsub): every change notice the "
              "llumlets publish reaches nobody, their status writes go on",
              "a subscriber Redis disconnected (its pub/sub output-buffer limit, a network blip) that cannot get "
              "back for a while: pub/sub is at most once, so only the reader's poll (every 2 s) catches up"),
        Fault("llumlet-export-kill", "full", "not-applicable", "kill a llumlet's export process",
              "the process inside a vLLM engine that writes the llumlet's records to Redis dying alone"),
    )
}  # fmt: skip

EXPORT_PROCESS_NOT_APPLICABLE = (
    "does not apply to the simulator: its llumlet writes to Redis from a thread of the engine process "
    "(only the vLLM adapter, vllm_plugin/adapters/vllm_v1.py, builds its Llumlet with own_process=True; "
    "simulated engines share one process), so there is no export process to kill. A dead export process is "
    "replaced on a stand-in engine in tests/integration/test_llumlet_export_process.py "
    "(test_a_dead_export_process_is_replaced_on_an_idle_engine); not measured under load here."
)


class FaultsBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    faults: Annotated[list[str], Meta(description="faults to run, in order: " + ", ".join(FAULTS))] = msgspec.field(
        default_factory=lambda: list(FAULTS)
    )
    quick: Annotated[
        bool,
        Meta(description="a smoke run: engine-kill only (unless --faults names others), short periods, 4 s soak"),
    ] = False
    rate: Annotated[float, Meta(gt=0, description="requests sent a second (open loop, fixed spacing)")] = 20.0
    max_tokens: Annotated[int, Meta(ge=1, description="tokens per streamed completion")] = 32
    stream_tokens: Annotated[int, Meta(ge=1, description="tokens per stream in engine-kill-midstream")] = 128
    max_in_flight: Annotated[
        int, Meta(ge=1, description="requests outstanding at most; arrivals past it are skipped")
    ] = 256
    max_requests: Annotated[int, Meta(ge=1, description="requests one load run sends at most")] = 20000
    request_timeout_seconds: Annotated[float, Meta(gt=0, description="a request not done within this fails")] = 30.0
    warmup_seconds: Annotated[float, Meta(ge=0, description="load before each fault")] = 3.0
    after_seconds: Annotated[float, Meta(ge=0, description="load after each fault has ended")] = 5.0
    engine_down_seconds: Annotated[float, Meta(ge=0, description="a killed engine stays down this long")] = 10.0
    component_down_seconds: Annotated[
        float, Meta(ge=0, description="a killed scheduler, ext_proc, Redis or etcd stays down this long")
    ] = 3.0
    stall_seconds: Annotated[float, Meta(ge=0, description="engine-stall: SIGSTOP this long")] = 10.0
    flaps: Annotated[int, Meta(ge=1, description="engine-flap: kills")] = 3
    flap_down_seconds: Annotated[float, Meta(ge=0, description="engine-flap: down this long each time")] = 1.5
    flap_up_seconds: Annotated[float, Meta(ge=0, description="engine-flap: up this long between kills")] = 3.0
    notice_drop_seconds: Annotated[float, Meta(ge=0, description="cms-notices-drop: how long subscribers are cut")] = (
        10.0
    )
    drain_timeout_seconds: Annotated[
        float, Meta(gt=0, description="after the load, how long the scheduler's account may take to reach zero")
    ] = 15.0
    sample_interval_seconds: Annotated[float, Meta(gt=0, description="the scheduler's /metrics sampled this often")] = (
        0.25
    )
    soak_seconds: Annotated[
        float, Meta(ge=0, description="soak: a steady load this long on a lite stack, RSS sampled (0: no soak)")
    ] = 60.0
    soak_rate: Annotated[float, Meta(gt=0, description="soak: requests sent a second")] = 20.0
    rss_interval_seconds: Annotated[float, Meta(gt=0, description="soak: RSS of every process sampled this often")] = (
        2.0
    )
    soak_warmup_seconds: Annotated[
        float, Meta(ge=0, description="soak: RSS growth is measured from the first sample after this")
    ] = 10.0
    memory_flat_pct: Annotated[
        float,
        Meta(ge=0, description="soak, the old rule (reported, not deciding): RSS grew at most this percent (+1 MiB)"),
    ] = 5.0
    soak_leak_pct_per_hour: Annotated[
        float,
        Meta(
            ge=0,
            description="soak: a leak is an RSS slope over the second half, per hour, above this percent of "
            "the process's level (+ soak_leak_mib_per_hour)",
        ),
    ] = 10.0
    soak_leak_mib_per_hour: Annotated[
        float, Meta(ge=0, description="soak: the fixed part of the leak bound, MiB per hour")
    ] = 2.0
    soak_live_return_pct: Annotated[
        float,
        Meta(
            ge=0,
            description="soak: Envoy's live bytes at the end within this percent (+1 MiB) of their level "
            "after the warm-up",
        ),
    ] = 10.0
    soak_live_window_seconds: Annotated[
        float,
        Meta(gt=0, description="soak: live bytes are the median over this long, after the warm-up and at the end"),
    ] = 30.0
    soak_leak_min_seconds: Annotated[
        float,
        Meta(
            ge=0,
            description="soak: the slope rule decides only over a second half at least this long (shorter: "
            "the whole-run growth decides)",
        ),
    ] = 120.0
    soak_step_window_seconds: Annotated[
        float, Meta(gt=0, description="soak: a step is the largest RSS rise within this long")
    ] = 20.0
    soak_burst_factor: Annotated[
        float,
        Meta(
            gt=0,
            description="soak: a step coincides with a burst when the in-flight peak around it is this many "
            "times the soak's typical peak",
        ),
    ] = 2.0

    def effective(self, given: set[str]) -> FaultsBenchConfig:
        """`--quick` shortens every period; flags the user gave win."""
        if not self.quick:
            return self
        quick = {
            "faults": ["engine-kill"], "rate": 10.0, "warmup_seconds": 1.5, "after_seconds": 2.0,
            "engine_down_seconds": 3.0, "component_down_seconds": 1.0, "stall_seconds": 3.0, "flaps": 2,
            "flap_down_seconds": 1.0, "flap_up_seconds": 1.5, "notice_drop_seconds": 3.0,
            "drain_timeout_seconds": 10.0, "soak_seconds": 4.0, "soak_warmup_seconds": 1.0,
            "rss_interval_seconds": 1.0,
        }  # fmt: skip
        return msgspec.structs.replace(self, **{k: v for k, v in quick.items() if k not in given})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, FaultsBenchConfig)


# ---------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.config import _UNSET, ConfigError, struct_from_args

    base = struct_from_args(FaultsBenchConfig, args)
    given = {name for name in base.__struct_fields__ if getattr(args, name, _UNSET) is not _UNSET}
    cfg = base.effective(given)
    if unknown := [name for name in cfg.faults if name not in FAULTS]:
        raise ConfigError(f"--faults: {unknown[0]!r} is not one of {', '.join(FAULTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    entries: list[dict[str, Any]] = []
    for name in cfg.faults:
        fault = FAULTS[name]
        print(f"bench faults: {name} ({fault.mode} mode)", file=sys.stderr, flush=True)
        t = time.monotonic()
        if fault.kind == "not-applicable":
            entry = {"fault": name, "mode": fault.mode, "kind": fault.kind, "what": fault.what,
                     "models": fault.models, "applies": False, "reason": EXPORT_PROCESS_NOT_APPLICABLE}  # fmt: skip
        else:
            with tempfile.TemporaryDirectory(prefix=f"pilotfish-bench-faults-{name}-") as tmp:
                rig = Rig(cfg, fault.mode, Path(tmp))
                try:
                    rig.start()
                    raw = asyncio.run(measure_fault(rig, fault, cfg))
                finally:
                    rig.stop()
            entry = summarise_fault(fault, raw, cfg)
            entry["timeline_png"] = plot_timeline(entry, raw, out / f"timeline-{name}.png")
        entry["wall_seconds"] = round(time.monotonic() - t, 1)
        entries.append(entry)
        (out / "partial.json").write_text(json.dumps(entries, indent=2, default=str) + "\n")
    soak: dict[str, Any] | None = None
    if cfg.soak_seconds > 0:
        print(f"bench faults: soak ({cfg.soak_seconds:.0f} s at {cfg.soak_rate:g}/s)", file=sys.stderr, flush=True)
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pilotfish-bench-faults-soak-") as tmp:
            rig = Rig(cfg, "lite", Path(tmp))
            try:
                rig.start()
                raw_soak = asyncio.run(measure_soak(rig, cfg))
            finally:
                rig.stop()
        soak = summarise_soak(raw_soak, cfg)
        soak["rss_png"] = plot_rss(soak, out / "soak-rss.png")
        soak["wall_seconds"] = round(time.monotonic() - t, 1)
    with contextlib.suppress(FileNotFoundError):
        (out / "partial.json").unlink()
    result = {
        "settings": msgspec.structs.asdict(cfg) | {"out": str(out)},
        "command": " ".join(["pilotfish", "bench", "faults", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        "wall_seconds": round(time.monotonic() - started, 1),
        "faults": entries,
        "soak": soak,
    }
    markdown = render_markdown(result)
    write_report(out, "faults", result, markdown)
    print(markdown)
    return 0


# ---------------------------------------------------------------------------------------------- set-up


class Rig:
    """One stack for one fault: started here, every child stopped by PID at the end."""

    def __init__(self, cfg: FaultsBenchConfig, mode: str, tmp: Path) -> None:
        from pilotfish.procs import ChildGroup

        self.cfg = cfg
        self.mode = mode
        self.tmp = tmp
        # die_with_parent: a bench killed midway leaves nothing holding its ports; so every
        # (re)start happens on the main thread, whose death is what kills them
        self.group = ChildGroup(die_with_parent=True)
        self.stack: Any = None
        self.redis: Any = None  # RunningService, full mode
        self.etcd: Any = None  # RunningService, etcd mode
        self.discovery_url = ""
        self.stack_cluster = ""  # the CMS cluster name (full mode)

    def start(self) -> None:
        from pilotfish.services import start_etcd, start_redis
        from pilotfish.stack import StackSpec, start_stack

        spec = StackSpec(engines=2, model=MODEL, scheduler_metrics=True, ext_proc_metrics=True)
        if self.mode == "full":
            # simulated engines with a CMS run in one process (StackSpec: separate_engines is lite
            # mode only), so no engine fault runs in full mode
            self.redis = start_redis(self.tmp / "redis", die_with_parent=True)
            spec.cms_url = self.redis.url
            self.stack_cluster = spec.cms_cluster
        else:
            spec.separate_engines = True
        if self.mode == "etcd":
            self.etcd = start_etcd(self.tmp / "etcd")
            self.discovery_url = f"etcd://127.0.0.1:{self.etcd.port}"
            spec.discovery_url = self.discovery_url
        self.stack = start_stack(spec, self.group, self.tmp)
        if self.mode == "etcd":
            engines = ",".join(f"{name}=127.0.0.1:{port}" for name, port in self.stack.engines)
            self.group.start(
                "discovery sidecar",
                [sys.executable, "-m", "pilotfish", "sidecar", "--discovery", self.discovery_url,
                 "--engines", engines, "--metadata", json.dumps({"model": MODEL}),
                 "--check-interval-seconds", "0.5"],
                log_path=self.tmp / "discovery-sidecar.log",
            )  # fmt: skip
        wait_routable(self.stack.base_url, {name for name, _ in self.stack.engines}, self.cfg.request_timeout_seconds)

    def child(self, name: str) -> Any:
        return self.stack.children[name]

    def respawn(self, name: str) -> Any:
        """Start the stack's child `name` again (it must be dead) with its command line, so on its ports."""
        old = self.stack.children[name]
        old.proc.wait()
        self.stack.children[name] = new = self.group.respawn(old)
        return new

    def ready(self, name: str) -> bool:
        return bool(self.stack.ready[name]())

    def stop(self) -> None:
        for child in list(self.group.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)  # a stalled engine must be able to stop
        self.group.stop_all()
        for service in (self.redis, self.etcd):
            if service is not None:
                service.stop()


def wait_routable(base_url: str, engines: set[str], timeout: float) -> None:
    """Until the scheduler has routed to every engine (concurrent streams, so load spreads them;
    engines seen are kept across attempts)."""
    from pilotfish.procs import wait_until

    routed: set[str] = set()

    async def seen() -> set[str]:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

            async def one(i: int) -> str:
                body = {"model": MODEL, "prompt": f"ready {i}", "max_tokens": 32}
                try:
                    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status == 200 and resp.headers.get("x-pilotfish-route") == NOMINAL_ROUTE:
                            return resp.headers.get("x-pilotfish-instance", "")
                except (aiohttp.ClientError, TimeoutError):
                    pass
                return ""

            return set(await asyncio.gather(*(one(i) for i in range(8))))

    def every_engine() -> bool:
        routed.update(asyncio.run(seen()))
        return engines <= routed

    wait_until(every_engine, max(timeout, 60.0), "the scheduler routing to every engine")


def envoy_retries(admin_port: int) -> dict[str, float]:
    """Envoy's retry counters summed over its clusters: upstream_rq_retry and its _success."""
    from pilotfish.services import http_call

    _, body = http_call(f"http://127.0.0.1:{admin_port}/stats?filter=upstream_rq_retry")
    out: Counter[str] = Counter()
    for line in body.decode().splitlines():
        key, sep, value = line.partition(": ")
        if sep and key.startswith("cluster."):
            out[key.rsplit(".", 1)[1]] += float(value)
    return dict(out)


EXT_PROC_COUNTERS = ("routed", "rejected", "releases", "served_elsewhere", "gateway_errors")


def ext_proc_counters(port: int) -> dict[str, float]:
    """The ext_proc's routing and release counters, by label (the process running at the end: a
    restarted ext_proc counts from its restart)."""
    from pilotfish.prom_scrape import scrape

    try:
        samples = scrape(port)
    except Exception as exc:
        return {"unreachable": 1.0, "error": str(exc)}  # type: ignore[dict-item]
    out: dict[str, float] = {}
    for name in EXT_PROC_COUNTERS:
        for labels, value in samples.get(f"pilotfish_ext_proc_{name}_total", []):
            tag = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[f"{name}{{{tag}}}" if tag else name] = value
    return out


# ---------------------------------------------------------------------------------------------- load


@dataclass(slots=True)
class Record:
    """One request, times in seconds from the start of the load."""

    t_send: float
    t_end: float = -1.0
    t_first: float = -1.0  # first body byte
    status: int = 0
    outcome: str = ""  # OK, or the error the client saw
    instance: str = ""  # x-pilotfish-instance: the engine the scheduler picked
    route: str = ""  # x-pilotfish-route: scheduler, fallback; empty: no ext_proc tagged it


class OpenLoop:
    """Streamed completions at a fixed rate, bounded in count, time and requests outstanding."""

    def __init__(self, base_url: str, cfg: FaultsBenchConfig, t0: float, rate: float, max_tokens: int) -> None:
        self.url = f"{base_url}/v1/completions"
        self.cfg = cfg
        self.t0 = t0
        self.rate = rate
        self.max_tokens = max_tokens
        self.records: list[Record] = []
        self.skipped = 0  # arrivals not sent: max_in_flight outstanding
        self.outstanding = 0

    async def run(self, stop: asyncio.Event, max_requests: int) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_seconds)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            tasks: set[asyncio.Task[None]] = set()
            interval = 1.0 / self.rate
            due = time.monotonic()
            while not stop.is_set() and len(self.records) < max_requests:
                wait = due - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                    continue
                due += interval
                if self.outstanding >= self.cfg.max_in_flight:
                    self.skipped += 1
                    continue
                record = Record(t_send=time.monotonic() - self.t0)
                self.records.append(record)
                task = asyncio.create_task(self._one(session, record, len(self.records)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks)

    async def _one(self, session: Any, record: Record, k: int) -> None:
        import aiohttp

        body = {"model": MODEL, "prompt": f"fault bench request {k}: " + "tell me more " * 4,
                "max_tokens": self.max_tokens, "stream": True}  # fmt: skip
        self.outstanding += 1
        try:
            async with session.post(self.url, json=body) as resp:
                record.status = resp.status
                record.instance = resp.headers.get("x-pilotfish-instance", "")
                record.route = resp.headers.get("x-pilotfish-route", "")
                if resp.status != 200:
                    record.outcome = http_error(resp.status, await resp.read())
                    return
                tail = b""
                async for chunk in resp.content.iter_any():
                    if record.t_first < 0:
                        record.t_first = time.monotonic() - self.t0
                    tail = (tail + chunk)[-64:]
                record.outcome = OK if tail.rstrip().endswith(b"data: [DONE]") else INCOMPLETE
        except TimeoutError:
            record.outcome = INCOMPLETE if record.status == 200 else f"timeout ({self.cfg.request_timeout_seconds:g} s)"
        except aiohttp.ClientError as exc:
            record.outcome = INCOMPLETE if record.status == 200 else type(exc).__name__
        finally:
            self.outstanding -= 1
            record.t_end = time.monotonic() - self.t0


def http_error(status: int, body: bytes) -> str:
    """`HTTP 503: upstream connect error ...`, the body's start, whitespace folded, at most 48 chars."""
    text = " ".join(body.decode(errors="replace").split())
    return f"HTTP {status}: {text[:48]}" if text else f"HTTP {status}"


# ---------------------------------------------------------------------------------------------- measure


@dataclass
class Window:
    """One fault: injected at `start`, let go (restart, SIGCONT, end of the cuts) at `restart`,
    answering again at `back`; seconds from the start of the load."""

    start: float
    restart: float
    back: float
    inflight_at_start: float = 0.0  # the scheduler's in-flight requests on the target just before


@dataclass
class Clock:
    t0: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, what: str) -> float:
        t = self.now()
        self.events.append({"t": round(t, 3), "what": what})
        return t


async def sample_scheduler(
    port: int, clock: Clock, stop: asyncio.Event, out: list[dict[str, Any]], every: float
) -> None:
    """The scheduler's figures every `every` seconds; a scrape that fails is a sample of None."""
    from pilotfish.prom_scrape import scrape

    while not stop.is_set():
        t = clock.now()
        try:
            samples = await asyncio.to_thread(scrape, port)
        except Exception:
            out.append({"t": t, "up": False})
        else:
            out.append({"t": t, "up": True, **scheduler_figures(samples)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


def scheduler_figures(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """What the bench reads from one scrape of the scheduler's /metrics."""

    def by_engine(name: str) -> dict[str, float]:
        return {labels.get("engine", ""): v for labels, v in samples.get(name, [])}

    def total(name: str) -> float:
        return sum(v for _, v in samples.get(name, []))

    staleness = by_engine("pilotfish_scheduler_view_staleness_seconds")
    return {
        "dispatch": by_engine("pilotfish_scheduler_dispatch_total"),
        "inflight": by_engine("pilotfish_scheduler_inflight_requests"),
        "ejected": by_engine("pilotfish_scheduler_instance_ejected"),
        "account": total("pilotfish_scheduler_account_size"),
        "account_entries": total("pilotfish_scheduler_inflight_account_entries"),
        "staleness_max": max(staleness.values(), default=None),
    }


async def measure_fault(rig: Rig, fault: Fault, cfg: FaultsBenchConfig) -> dict[str, Any]:
    """Start the load, inject the fault after the warm-up, run `after_seconds` more, stop, drain."""
    clock = Clock(time.monotonic())
    max_tokens = cfg.stream_tokens if fault.name == "engine-kill-midstream" else cfg.max_tokens
    load = OpenLoop(rig.stack.base_url, cfg, clock.t0, cfg.rate, max_tokens)
    stop_load, stop_sampling = asyncio.Event(), asyncio.Event()
    samples: list[dict[str, Any]] = []
    sampler = asyncio.create_task(
        sample_scheduler(rig.stack.scheduler_metrics_port, clock, stop_sampling, samples, cfg.sample_interval_seconds)
    )
    planned = cfg.warmup_seconds + _fault_seconds(fault, cfg) + cfg.after_seconds + 30
    loader = asyncio.create_task(load.run(stop_load, min(cfg.max_requests, math.ceil(cfg.rate * planned))))
    clock.mark("load starts")
    extra: dict[str, Any] = {}
    windows: list[Window] = []
    try:
        await asyncio.sleep(cfg.warmup_seconds)
        windows = await INJECT[fault.name](rig, cfg, clock, samples, extra)
        await asyncio.sleep(cfg.after_seconds)
    finally:
        stop_load.set()
        clock.mark("load stops")
        await loader
        clock.mark("last request done")
    drain = await wait_drained(rig, clock, samples, cfg)
    stop_sampling.set()
    await sampler
    extra["envoy_retries"] = await asyncio.to_thread(envoy_retries, rig.stack.admin_port)
    extra["ext_proc_counters"] = await asyncio.to_thread(ext_proc_counters, rig.stack.ext_proc_metrics_port)
    return {
        "records": load.records,
        "skipped": load.skipped,
        "windows": windows,
        "events": clock.events,
        "samples": samples,
        "drain": drain,
        "extra": extra,
        "max_tokens": max_tokens,
    }


def _fault_seconds(fault: Fault, cfg: FaultsBenchConfig) -> float:
    return {
        "engine-kill": cfg.engine_down_seconds + 10,
        "engine-kill-midstream": cfg.engine_down_seconds + 15,
        "engine-stall": cfg.stall_seconds + 5,
        "engine-flap": cfg.flaps * (cfg.flap_down_seconds + cfg.flap_up_seconds + 5),
        "cms-notices-drop": cfg.notice_drop_seconds + 5,
    }.get(fault.name, cfg.component_down_seconds + 15)


async def wait_drained(rig: Rig, clock: Clock, samples: list[dict[str, Any]], cfg: FaultsBenchConfig) -> dict[str, Any]:
    """After the last request: until the scheduler holds nothing (account, per-engine in-flight and,
    in full mode, unconfirmed dispatches), at most drain_timeout_seconds."""
    from pilotfish.prom_scrape import scrape

    stop_at = clock.now() + cfg.drain_timeout_seconds
    done_at = clock.now()
    last: dict[str, Any] = {}
    while True:
        try:
            last = scheduler_figures(await asyncio.to_thread(scrape, rig.stack.scheduler_metrics_port))
        except Exception as exc:
            last = {"error": str(exc)}
        held = _held(last)
        if held == 0 or clock.now() >= stop_at:
            return {
                "drained": held == 0,
                "seconds": round(clock.now() - done_at, 2),
                "account": last.get("account"),
                "inflight_requests": sum(last.get("inflight", {}).values()) if "inflight" in last else None,
                "account_entries": last.get("account_entries"),
                **({"error": last["error"]} if "error" in last else {}),
            }
        await asyncio.sleep(0.2)


def _held(figures: dict[str, Any]) -> float:
    if "error" in figures:
        return math.inf
    return figures["account"] + sum(figures["inflight"].values()) + figures["account_entries"]


async def _wait(condition: Any, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(condition):
            return True
        await asyncio.sleep(every)
    return False


def _inflight(samples: list[dict[str, Any]], engine: str) -> float:
    """The scheduler's in-flight requests on `engine` at its latest sample."""
    for sample in reversed(samples):
        if sample.get("up"):
            return float(sample["inflight"].get(engine, 0.0))
    return 0.0


async def _kill_engine(rig: Rig, clock: Clock, samples: list[dict[str, Any]], down: float) -> Window:
    name = f"engine {TARGET_ENGINE}"
    child = rig.child(name)
    inflight = _inflight(samples, TARGET_ENGINE)
    os.kill(child.pid, signal.SIGKILL)
    start = clock.mark(f"kill -9 {TARGET_ENGINE} (pid {child.pid})")
    await asyncio.sleep(down)
    new = rig.respawn(name)  # on the loop's (main) thread: see Rig.group
    restart = clock.mark(f"{TARGET_ENGINE} started again (pid {new.pid})")
    await _wait(lambda: rig.ready(name), 30)
    back = clock.mark(f"{TARGET_ENGINE} answers")
    return Window(start, restart, back, inflight)


async def inject_engine_kill(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    return [await _kill_engine(rig, clock, samples, cfg.engine_down_seconds)]


async def inject_engine_kill_midstream(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    # the scheduler's count of streams on it, fresh: kill only once it holds some
    held_any = await _wait(lambda: _inflight(samples, TARGET_ENGINE) >= 1, 10)
    extra["streams_on_target_seen_before_kill"] = held_any
    return [await _kill_engine(rig, clock, samples, cfg.engine_down_seconds)]


async def inject_engine_flap(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    windows = []
    for i in range(cfg.flaps):
        if i:
            await asyncio.sleep(cfg.flap_up_seconds)
        windows.append(await _kill_engine(rig, clock, samples, cfg.flap_down_seconds))
    return windows


async def inject_engine_stall(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    child = rig.child(f"engine {TARGET_ENGINE}")
    inflight = _inflight(samples, TARGET_ENGINE)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        start = clock.mark(f"SIGSTOP {TARGET_ENGINE} (pid {child.pid})")
        await asyncio.sleep(cfg.stall_seconds)
    finally:
        os.kill(child.pid, signal.SIGCONT)
    restart = clock.mark(f"SIGCONT {TARGET_ENGINE}")
    return [Window(start, restart, restart, inflight)]


def _component(name: str) -> Any:
    async def inject(rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict) -> list[Window]:
        child = rig.child(name)
        os.kill(child.pid, signal.SIGKILL)
        start = clock.mark(f"kill -9 {name} (pid {child.pid})")
        await asyncio.sleep(cfg.component_down_seconds)
        new = rig.respawn(name)
        restart = clock.mark(f"{name} started again (pid {new.pid})")
        await _wait(lambda: rig.ready(name), 30)
        back = clock.mark(f"{name} answers")
        return [Window(start, restart, back)]

    return inject


async def inject_redis_kill(rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict) -> list[Window]:
    from pilotfish.services import redis_answers_ping

    service = rig.redis
    os.kill(service.child.pid, signal.SIGKILL)
    start = clock.mark(f"kill -9 redis-server (pid {service.child.pid})")
    await asyncio.sleep(cfg.component_down_seconds)
    service.child.proc.wait()
    service.child = service.child.respawn()  # same command line: same port, empty (no persistence)
    restart = clock.mark(f"redis-server started again, empty (pid {service.child.pid})")
    await _wait(lambda: redis_answers_ping(service.port), 30)
    back = clock.mark("redis-server answers")
    # the CMS reader's recovery: the view fresh again (every engine's status under 1 s old)
    fresh = await _wait(lambda: _fresh(samples, after=back), 30, every=0.1)
    extra["view_fresh_after_restart_s"] = round(clock.now() - restart, 2) if fresh else None
    return [Window(start, restart, back)]


def _fresh(samples: list[dict[str, Any]], after: float, bound: float = 1.0) -> bool:
    return any(
        s["t"] >= after and s.get("up") and s["staleness_max"] is not None and s["staleness_max"] < bound
        for s in samples[-4:]
    )


async def inject_etcd_restart(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    from pilotfish.services import etcd_is_healthy

    service = rig.etcd
    os.kill(service.child.pid, signal.SIGKILL)
    start = clock.mark(f"kill -9 etcd (pid {service.child.pid})")
    await asyncio.sleep(cfg.component_down_seconds)
    service.child.proc.wait()
    service.child = service.child.respawn()  # same command line and data dir: its keys and leases
    restart = clock.mark(f"etcd started again (pid {service.child.pid})")
    await _wait(lambda: etcd_is_healthy(service.url), 30)
    back = clock.mark("etcd answers")
    listed = await _wait_listed(rig, {name for name, _ in rig.stack.engines}, 15)
    extra["engines_listed_after_restart_s"] = round(clock.now() - restart, 2) if listed else None
    return [Window(start, restart, back)]


async def _wait_listed(rig: Rig, engines: set[str], timeout: float) -> bool:
    from pilotfish.discovery import open_discovery

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        discovery = open_discovery(rig.discovery_url)
        try:
            listed = {i.instance_id for i in await asyncio.wait_for(discovery.list_instances("pilotfish", "engine"), 2)}
        except Exception:
            listed = set()
        finally:
            with contextlib.suppress(Exception):
                await discovery.close()
        if engines <= listed:
            return True
        await asyncio.sleep(0.1)
    return False


SUBSCRIBE_COMMANDS = ("subscribe", "psubscribe", "ssubscribe")


async def inject_notices_drop(
    rig: Rig, cfg: FaultsBenchConfig, clock: Clock, samples: list, extra: dict
) -> list[Window]:
    """Redis's ACL takes SUBSCRIBE from its (default) user and the subscriber connections are cut:
    the scheduler's reader cannot subscribe again (NOPERM, retried with its backoff) and every
    notice the llumlets PUBLISH meanwhile reaches nobody; their writes are untouched."""
    import redis

    from pilotfish.cms import keys

    channel = keys.events_channel(rig.stack_cluster)
    client = redis.Redis(host="127.0.0.1", port=rig.redis.port, socket_timeout=2)
    kills = checks = unsubscribed = 0

    def acl(sign: str) -> None:
        client.execute_command("ACL", "SETUSER", "default", *(sign + c for c in SUBSCRIBE_COMMANDS))

    def subscribers() -> int:
        [(_, n)] = client.pubsub_numsub(channel)
        return int(n)

    try:
        await asyncio.to_thread(acl, "-")
        kills += await asyncio.to_thread(client.client_kill_filter, _type="pubsub")
        start = clock.mark("ACL: SUBSCRIBE denied; CLIENT KILL TYPE pubsub")
        while clock.now() < start + cfg.notice_drop_seconds:
            await asyncio.sleep(0.1)
            checks += 1
            unsubscribed += int(await asyncio.to_thread(subscribers) == 0)
    finally:
        await asyncio.to_thread(acl, "+")
    restart = clock.mark("ACL: SUBSCRIBE allowed again")
    again = await _wait(lambda: subscribers() > 0, 15, every=0.05)
    extra["resubscribed_after_s"] = round(clock.now() - restart, 2) if again else None
    client.close()
    extra["subscriber_connections_cut"] = kills
    extra["checks_with_no_subscriber"] = f"{unsubscribed} of {checks}"
    return [Window(start, restart, restart)]


INJECT: dict[str, Any] = {
    "engine-kill": inject_engine_kill,
    "engine-kill-midstream": inject_engine_kill_midstream,
    "engine-stall": inject_engine_stall,
    "engine-flap": inject_engine_flap,
    "scheduler-kill": _component("scheduler"),
    "ext-proc-kill": _component("ext_proc"),
    "etcd-restart": inject_etcd_restart,
    "redis-kill": inject_redis_kill,
    "cms-notices-drop": inject_notices_drop,
}


async def measure_soak(rig: Rig, cfg: FaultsBenchConfig) -> dict[str, Any]:
    """A steady load for soak_seconds; every rss_interval_seconds the memory of every process of the
    stack, Envoy's allocator figures and the requests in flight (bench/faults_soak.py)."""
    clock = Clock(time.monotonic())
    load = OpenLoop(rig.stack.base_url, cfg, clock.t0, cfg.soak_rate, cfg.max_tokens)
    stop = asyncio.Event()
    loader = asyncio.create_task(
        load.run(stop, min(cfg.max_requests, math.ceil(cfg.soak_rate * (cfg.soak_seconds + 5))))
    )
    rss: list[dict[str, Any]] = []
    while clock.now() < cfg.soak_seconds:
        rss.append(await soak_sample(rig, clock, load))
        await asyncio.sleep(min(cfg.rss_interval_seconds, max(0.0, cfg.soak_seconds - clock.now())))
    stop.set()
    await loader
    rss.append(await soak_sample(rig, clock, load))
    samples: list[dict[str, Any]] = []
    drain = await wait_drained(rig, clock, samples, cfg)
    return {"records": load.records, "skipped": load.skipped, "rss": rss, "drain": drain}


async def soak_sample(rig: Rig, clock: Clock, load: OpenLoop) -> dict[str, Any]:
    t = round(clock.now(), 2)
    memory = process_memory(rig.stack.children)
    return {
        "t": t,
        **{key: {name: m[key] for name, m in memory.items() if key in m} for key in MEMORY_FIELDS.values()},
        "envoy": await asyncio.to_thread(envoy_memory, rig.stack.admin_port),
        "client_in_flight": load.outstanding,
    }


def process_memory(children: dict[str, Any]) -> dict[str, dict[str, int]]:
    """faults_soak.process_kib of each child of the stack and of each of its descendants, by a
    stable name."""
    from pilotfish.procs import descendants

    out: dict[str, dict[str, int]] = {}
    for name, child in children.items():
        for i, pid in enumerate(descendants(child.pid)):  # the child first
            if kib := process_kib(pid):
                out[name if i == 0 else f"{name} (child {i})"] = kib
    return out


# ---------------------------------------------------------------------------------------------- report (pure)


def outcome_counts(records: list[Record]) -> dict[str, Any]:
    """sent, ok, failed, the failures grouped by the error the client saw, incomplete streams."""
    errors = Counter(r.outcome for r in records if r.outcome != OK)
    return {
        "sent": len(records),
        "ok": sum(1 for r in records if r.outcome == OK),
        "failed": sum(errors.values()),
        "failed_by_error": dict(errors.most_common()),
        "incomplete_streams": errors.get(INCOMPLETE, 0),
        # a stalled engine fails nothing but holds its requests: those that took over 2 s
        "slower_than_2s": sum(1 for r in records if r.t_end - r.t_send > 2.0),
        "longest_s": round(max((r.t_end - r.t_send for r in records), default=0.0), 2),
    }


def picked(records: list[Record], engine: str, start: float, end: float) -> list[Record]:
    """Requests sent in [start, end) that the scheduler picked `engine` for."""
    return [r for r in records if start <= r.t_send < end and r.instance == engine]


def dispatched_between(samples: list[dict[str, Any]], engine: str, start: float, end: float) -> float | None:
    """The scheduler's dispatch_total{engine} growth from its first sample at or after `start` to
    its last before `end` (None: no two samples of one scheduler there)."""
    inside = [s for s in samples if s.get("up") and start <= s["t"] < end]
    if len(inside) < 2:
        return None
    return inside[-1]["dispatch"].get(engine, 0.0) - inside[0]["dispatch"].get(engine, 0.0)


def engine_figures(records: list[Record], windows: list[Window], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine fault: what went to it while down, the bound on failures, detect and recover."""
    routed_after_1s = dispatched_after_1s = sent_first_second = 0
    dispatched_known = True
    inflight = 0.0
    detect: list[float] = []
    recover: list[float | None] = []
    for i, w in enumerate(windows):
        nxt = windows[i + 1].start if i + 1 < len(windows) else math.inf
        during = picked(records, TARGET_ENGINE, w.start, w.restart)
        detect.append(max((r.t_send for r in during), default=w.start) - w.start)
        routed_after_1s += len(picked(records, TARGET_ENGINE, w.start + 1.0, w.restart))
        d = dispatched_between(samples, TARGET_ENGINE, w.start + 1.0, w.restart)
        dispatched_known &= d is not None
        dispatched_after_1s += d or 0
        on_it_client = sum(1 for r in records if r.instance == TARGET_ENGINE and r.t_send < w.start < r.t_end)
        inflight += max(w.inflight_at_start, on_it_client)
        sent_first_second += sum(1 for r in records if w.start <= r.t_send < w.start + 1.0)
        back_ok = [r.t_send for r in picked(records, TARGET_ENGINE, w.back, nxt) if r.outcome == OK]
        recover.append(min(back_ok) - w.back if back_ok else None)
    return {
        "routed_to_faulty_during": sum(len(picked(records, TARGET_ENGINE, w.start, w.restart)) for w in windows),
        "routed_to_faulty_after_1s": routed_after_1s,
        "dispatched_to_faulty_after_1s": dispatched_after_1s if dispatched_known else None,
        "inflight_on_faulty_at_fault": inflight,
        "sent_first_second": sent_first_second,
        "failed_bound": inflight + sent_first_second,
        "detect_s": round(max(detect), 2) if detect else None,
        "recover_s": None if not recover or any(v is None for v in recover) else round(max(recover), 2),  # type: ignore[type-var]
    }


def component_figures(records: list[Record], windows: list[Window]) -> dict[str, Any]:
    """Per component fault: when the gateway first went around it, and when routing was whole again."""
    w = windows[0]
    after = [r for r in records if r.t_send >= w.start]
    around = [r.t_send for r in after if r.route != NOMINAL_ROUTE and r.outcome == OK]
    bad = [r.t_send for r in after if r.outcome != OK or r.route != NOMINAL_ROUTE]
    return {
        "detect_s": round(min(around) - w.start, 2) if around else None,
        "recover_s": round(max(0.0, max(bad) - w.restart), 2) if bad else 0.0,
        "answers_after_restart_s": round(w.back - w.restart, 2),
        "recover_after_answering_s": round(max(0.0, max(bad) - w.back), 2) if bad else 0.0,
        "not_via_scheduler": len(bad),
    }


def per_second(records: list[Record], engine: str = "") -> list[dict[str, int]]:
    """By second of sending: requests ok, failed, picked for `engine`, and not routed by the scheduler."""
    if not records:
        return []
    last = int(max(r.t_send for r in records))
    rows = [{"t": t, "ok": 0, "failed": 0, "picked": 0, "around": 0} for t in range(last + 1)]
    for r in records:
        row = rows[int(r.t_send)]
        row["ok" if r.outcome == OK else "failed"] += 1
        row["picked"] += int(bool(engine) and r.instance == engine)
        row["around"] += int(r.route != NOMINAL_ROUTE)
    return rows


def goals(fault: Fault, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals that apply to this fault, each met or not, with the figure behind it."""
    out = []
    if fault.kind == "engine" and fault.name != "engine-stall":
        out.append({"goal": "failed <= in flight on it + sent in the first second",
                    "met": entry["failed"] <= entry["failed_bound"],
                    "figure": f"{entry['failed']} <= {entry['failed_bound']:g}"})  # fmt: skip
        dispatched = entry["dispatched_to_faulty_after_1s"]
        out.append({"goal": "none routed to it after 1 s",
                    "met": entry["routed_to_faulty_after_1s"] == 0 and not dispatched,
                    "figure": f"{entry['routed_to_faulty_after_1s']} (scheduler: {_show(dispatched)})"})  # fmt: skip
        retries = entry.get("envoy_retries", {})
        tried, succeeded = retries.get("upstream_rq_retry", 0), retries.get("upstream_rq_retry_success", 0)
        out.append({"goal": "retried requests succeed", "met": tried == succeeded,
                    "figure": f"{succeeded:g} of {tried:g} retries succeeded"})  # fmt: skip
    if fault.name == "engine-stall":
        out.append({"goal": "new requests stop going to it within 2 s", "met": entry["detect_s"] <= 2.0,
                    "figure": f"last picked {entry['detect_s']} s after SIGSTOP"})  # fmt: skip
    if fault.kind in ("component", "notices"):
        note = "" if fault.kind == "component" else " (no goal of its own; held to the Redis goal)"
        out.append({"goal": "zero failed" + note, "met": entry["failed"] == 0, "figure": str(entry["failed"])})
    if fault.kind == "component":
        out.append({"goal": "recovery <= 2 s", "met": entry["recover_s"] <= 2.0,
                    "figure": f"{entry['recover_s']} s after the restart"})  # fmt: skip
    drain = entry["account_after"]
    out.append({"goal": "the scheduler's account drains to zero", "met": bool(drain["drained"]),
                "figure": f"account {_show(drain['account'])}, in flight {_show(drain['inflight_requests'])}, "
                          f"unconfirmed {_show(drain['account_entries'])} after {drain['seconds']} s"})  # fmt: skip
    return out


def summarise_fault(fault: Fault, raw: dict[str, Any], cfg: FaultsBenchConfig) -> dict[str, Any]:
    records: list[Record] = raw["records"]
    windows: list[Window] = raw["windows"]
    entry: dict[str, Any] = {
        "fault": fault.name, "mode": fault.mode, "kind": fault.kind, "what": fault.what, "models": fault.models,
        "applies": True, "max_tokens": raw["max_tokens"], **outcome_counts(records),
        "skipped_by_client_cap": raw["skipped"],
        "routes": dict(Counter(r.route or "(none)" for r in records).most_common()),
        "windows": [{k: round(v, 3) for k, v in vars(w).items()} for w in windows],
        "events": raw["events"], "account_after": raw["drain"], **raw["extra"],
    }  # fmt: skip
    if fault.kind == "engine":
        entry.update(engine_figures(records, windows, raw["samples"]))
        entry["ejected_at_s"] = _first_ejected(raw["samples"], windows[0].start)
    else:
        entry.update(component_figures(records, windows))
    staleness = [s for s in raw["samples"] if s.get("up") and s.get("staleness_max") is not None]
    if staleness and windows:
        w = windows[0]
        entry["view_staleness_max_s"] = {
            "before": _round(max((s["staleness_max"] for s in staleness if s["t"] < w.start), default=None)),
            "during": _round(max((s["staleness_max"] for s in staleness if w.start <= s["t"] < w.back + 2),
                                 default=None)),
        }  # fmt: skip
    entry["scheduler_unreachable_samples"] = sum(1 for s in raw["samples"] if not s.get("up"))
    entry["goals"] = goals(fault, entry)
    return entry


def _first_ejected(samples: list[dict[str, Any]], start: float) -> float | None:
    for s in samples:
        if s.get("up") and s["t"] >= start and s["ejected"].get(TARGET_ENGINE):
            return round(s["t"] - start, 2)
    return None


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def summarise_soak(raw: dict[str, Any], cfg: FaultsBenchConfig) -> dict[str, Any]:
    memory = summarise_memory(raw["rss"], [(r.t_send, r.t_end) for r in raw["records"]], cfg)
    return {
        "seconds": cfg.soak_seconds,
        "rate": cfg.soak_rate,
        **outcome_counts(raw["records"]),
        "skipped_by_client_cap": raw["skipped"],
        "account_after": raw["drain"],
        "memory_flat": memory.pop("flat"),
        **memory,
        "rss_samples": raw["rss"],
    }


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _met(goal_list: list[dict[str, Any]]) -> str:
    if not goal_list:
        return "-"
    return "; ".join(f"{'met' if g['met'] else 'NOT met'}: {g['goal']}" for g in goal_list)


DETAIL_KEYS = (
    "slower_than_2s",
    "longest_s",
    "routed_to_faulty_during",
    "routed_to_faulty_after_1s",
    "dispatched_to_faulty_after_1s",
    "inflight_on_faulty_at_fault",
    "sent_first_second",
    "failed_bound",
    "ejected_at_s",
    "detect_s",
    "recover_s",
    "answers_after_restart_s",
    "recover_after_answering_s",
    "not_via_scheduler",
    "view_staleness_max_s",
    "view_fresh_after_restart_s",
    "engines_listed_after_restart_s",
    "subscriber_connections_cut",
    "resubscribed_after_s",
    "checks_with_no_subscriber",
    "streams_on_target_seen_before_kill",
    "envoy_retries",
    "ext_proc_counters",
    "scheduler_unreachable_samples",
)  # the figures listed under each fault in report.md, when present


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# bench faults",
        "",
        f"Wall time {result['wall_seconds']:.0f} s. Command: `{result.get('command') or 'pilotfish bench faults'}`.",
        "",
        "One fault per fresh stack, injected by PID, under an open-loop load of streamed completions "
        f"({result['settings']['rate']:g}/s, {result['settings']['max_tokens']} tokens; "
        f"{result['settings']['stream_tokens']} in engine-kill-midstream). Engine faults hit {TARGET_ENGINE}. "
        "Detect/recover as defined in bench/faults.py's docstring: engines, fault → last pick of it while down, "
        "and back → first good pick; components, kill → first request served around it, and restart → last "
        "request not routed by the scheduler. Route `(none)`: the response carried no x-pilotfish-route, so "
        "Envoy's default pool served it (no ext_proc) or the ext_proc answered it itself (a refusal).",
        "",
        "| fault | mode | sent | ok | failed | incomplete | routed to faulty after 1 s (client / scheduler) "
        "| detect s | recover s | account drained | goals |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---|",
    ]
    for e in result["faults"]:
        if not e["applies"]:
            lines.append(f"| {e['fault']} | {e['mode']} | - | - | - | - | - | - | - | - | does not apply |")
            continue
        routed = (
            f"{e['routed_to_faulty_after_1s']} / {_show(e['dispatched_to_faulty_after_1s'])}"
            if "routed_to_faulty_after_1s" in e
            else "-"
        )
        lines.append(
            f"| {e['fault']} | {e['mode']} | {e['sent']} | {e['ok']} | {e['failed']} | {e['incomplete_streams']} "
            f"| {routed} | {_show(e['detect_s'])} | {_show(e['recover_s'])} "
            f"| {'yes' if e['account_after']['drained'] else 'NO'} "
            f"| {sum(g['met'] for g in e['goals'])} of {len(e['goals'])} met |"
        )
    lines.append("")
    for e in result["faults"]:
        lines += [f"## {e['fault']} ({e['mode']} mode)", "", f"What: {e['what']}. Models: {e['models']}.", ""]
        if not e["applies"]:
            lines += [f"Not run: {e['reason']}", ""]
            continue
        lines.append(f"Wall time {e['wall_seconds']} s; timeline: `{e['timeline_png'] or 'no PNG (matplotlib?)'}`.")
        lines.append("")
        lines.append("Events: " + "; ".join(f"{ev['t']:.2f} s {ev['what']}" for ev in e["events"]) + ".")
        lines.append("")
        errors = ", ".join(f"{n} x `{k}`" for k, n in e["failed_by_error"].items()) or "none"
        lines.append(f"Sent {e['sent']}, ok {e['ok']}, failed {e['failed']}: {errors}. "
                     f"Skipped by the client's in-flight cap: {e['skipped_by_client_cap']}. "
                     f"Routes: {', '.join(f'{k} {v}' for k, v in e['routes'].items())}.")  # fmt: skip
        lines.append("")
        keys = DETAIL_KEYS
        lines += [f"- {k}: {_show(e[k])}" for k in keys if k in e]
        d = e["account_after"]
        lines.append(f"- account after the load: drained {d['drained']} in {d['seconds']} s (account "
                     f"{_show(d['account'])}, in flight {_show(d['inflight_requests'])}, unconfirmed "
                     f"{_show(d['account_entries'])})")  # fmt: skip
        lines.append("")
        lines += [f"- goal: {g['goal']}: **{'met' if g['met'] else 'NOT met'}** ({g['figure']})" for g in e["goals"]]
        lines.append("")
    soak = result.get("soak")
    if soak:
        lines += [
            f"## Soak: {soak['seconds']:g} s at {soak['rate']:g}/s (lite mode)",
            "",
            f"Sent {soak['sent']}, ok {soak['ok']}, failed {soak['failed']}; account drained "
            f"{soak['account_after']['drained']}. Plot (RSS, Envoy's allocator, requests in flight): "
            f"`{soak['rss_png'] or 'none'}`.",
            "",
            *render_memory(soak),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_timeline(entry: dict[str, Any], raw: dict[str, Any], path: Path) -> str:
    """requests a second (by second sent) ok and failed, picks of the faulty engine, the fault
    shaded; the file's name, or "" without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return ""
    engine = TARGET_ENGINE if entry["kind"] == "engine" else ""
    rows = per_second(raw["records"], engine)[:-1]  # the last second is cut short by the stop
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ts = [r["t"] + 0.5 for r in rows]
    ax.plot(ts, [r["ok"] for r in rows], color="tab:green", label="ok /s", drawstyle="steps-mid")
    ax.plot(ts, [r["failed"] for r in rows], color="tab:red", label="failed /s", drawstyle="steps-mid")
    if engine:
        ax.plot(ts, [r["picked"] for r in rows], color="tab:blue", ls="--", label=f"picked {engine} /s")
    else:
        ax.plot(ts, [r["around"] for r in rows], color="tab:purple", ls="--", label="not via the scheduler /s")
    for i, w in enumerate(raw["windows"]):
        ax.axvspan(w.start, w.back, color="tab:orange", alpha=0.2, label="fault" if i == 0 else None)
        ax.axvline(w.start, color="tab:orange", lw=1)
        ax.axvline(w.restart, color="tab:orange", lw=1, ls="--", label="restart / let go" if i == 0 else None)
    ax.set_xlabel("seconds (request sent)")
    ax.set_ylabel("requests / s")
    ax.set_title(f"{entry['fault']} ({entry['mode']}): sent {entry['sent']}, failed {entry['failed']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def plot_rss(soak: dict[str, Any], path: Path) -> str:
    """The soak's memory timeline (faults_soak.plot_memory); the file's name, or "" without matplotlib."""
    return plot_memory(soak["rss_samples"], soak["inflight_peaks"], path, _pyplot())
