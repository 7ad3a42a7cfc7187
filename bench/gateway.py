"""`pilotfish bench gateway`: what the ext_proc hop costs, side by side with Envoy alone.

All arms run in one process tree at once and are measured in interleaved rounds (every phase),
so machine noise hits them alike; figures are reported as differences against Envoy alone, with
the spread over rounds.

- latency: sequential small non-streaming completions through each arm (p50/p99, and what
  the ext_proc adds over Envoy alone);
- throughput: a fixed concurrency for a fixed time, with the CPU time the arm's Envoy, ext_procs
  and remote scheduler used per request (the ext_proc's gives its capacity in requests/s per core,
  independent of what else shares the machine); and the scale-out with 1..--ext-procs ext_procs
  behind the same Envoy;
- body modes (--body-modes): the sidecar with each (request, response) body mode pair, and the
  bootstrap each gateway hosting an InferencePool picker generates (full duplex both ways), all on
  the default deployment's ext_proc (remote scheduler on the Session socket), in the latency and
  throughput phases, the ext_proc messages each takes per request (Envoy's own counters), and
  what a client gets while no ext_proc answers at all;
- streaming: SSE streams against a paced engine (5 ms decode step) through Envoy alone and each
  body mode: the time to first token and the gap between events the ext_proc adds, and its CPU
  per stream (the response body mode decides how many chunks it sees).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.procs import thread_cpu_seconds as _cpu_time

MODEL = "bench-sim"
SIDECAR = "sidecar"
# the response through the sidecar's observing filter (--response-bodies observe), not a body mode
OBSERVE = "OBSERVE"
# STREAMED, read to each stream's first token and released from the access log (--response-bodies first-token)
FIRST = "FIRST"
# response modes made by the ext_proc's --response-bodies: (its ext_procs' name, the flag's value); NONE is full
# mode's, the response bodies skipped and the requests released from Envoy's access log
_RESPONSE_BODIES = {"NONE": ("skip", "skip"), OBSERVE: ("observe", "observe"), FIRST: ("first", "first-token")}
DEFAULT_BODY_MODES = (
    "BUFFERED/STREAMED",
    "STREAMED/STREAMED",
    "FULL_DUPLEX_STREAMED/FULL_DUPLEX_STREAMED",
    "BUFFERED/BUFFERED",
    "BUFFERED/NONE",  # full mode: response bodies skipped, releases from Envoy's access log
    "BUFFERED/OBSERVE",  # lite mode, counted through an observing filter: no reply per chunk
    "BUFFERED/FIRST",  # lite mode behind the sidecar by default: each stream read to its first token
    "istio",
    "ai-gateway",
)


def _grpc_servers() -> tuple[str, tuple[str, ...]]:
    """The ext_proc's --grpc-server default and choices, from its config struct."""
    import typing

    from pilotfish.ext_proc.config import ExtProcConfig

    field_ = next(f for f in msgspec.structs.fields(ExtProcConfig) if f.name == "grpc_server")
    literal = typing.get_args(field_.type)[0]  # Annotated[Literal[...], Meta]
    return field_.default, typing.get_args(literal)


DEFAULT_GRPC_SERVER, GRPC_SERVERS = _grpc_servers()


class GatewayBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    requests: Annotated[int, Meta(ge=1, description="sequential requests per arm per round")] = 300
    rounds: Annotated[int, Meta(ge=1, description="interleaved rounds over all arms, in every phase")] = 3
    concurrency: Annotated[int, Meta(ge=1, description="requests in flight in the throughput phase")] = 16
    seconds: Annotated[float, Meta(gt=0, description="length of each arm's throughput run, per round")] = 1.5
    streams: Annotated[int, Meta(ge=1, description="SSE streams per arm per round in the streaming phase")] = 32
    stream_concurrency: Annotated[int, Meta(ge=1, description="SSE streams in flight at once")] = 4
    stream_tokens: Annotated[int, Meta(ge=2, description="tokens per SSE stream")] = 32
    ext_procs: Annotated[
        int, Meta(ge=1, description="scale-out: measure 1 up to this many ext_procs behind one Envoy")
    ] = 3
    down_requests: Annotated[int, Meta(ge=0, description="requests sent per body mode while no ext_proc answers")] = 50
    body_modes: Annotated[
        list[str],
        Meta(
            description="Envoy ext_proc configurations to compare: REQUEST/RESPONSE body modes of the sidecar "
            "(each BUFFERED, STREAMED or FULL_DUPLEX_STREAMED; the response also NONE: full mode, the ext_proc "
            "skips response bodies and releases from Envoy's access log; OBSERVE: counted by an observing filter; "
            "FIRST: streamed, each stream read to its first token, released from the access log, lite's default), "
            "or a gateway's (istio, ai-gateway); "
            "a sidecar's may add /ungrouped (the ext_proc's --flow-groups none, no client address from Envoy); "
            "@grpcio after either runs that arm's ext_procs on grpc.aio's server instead of the loop's"
        ),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_BODY_MODES))
    tls: Annotated[
        bool,
        Meta(
            description="also measure the default deployment with TLS and a token on every link (Envoy -> "
            "ext_proc, ext_proc -> scheduler's Session socket, mutual TLS; certificates made for the run)"
        ),
    ] = True
    vllm_router: Annotated[
        str, Meta(description="a vllm-router executable (pip install vllm-router) to measure as a peer arm")
    ] = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, GatewayBenchConfig)


@dataclass(frozen=True)
class BodyMode:
    """How Envoy runs the ext_proc: the sidecar with a (request, response) body mode pair, or the
    bootstrap a gateway generates for an InferencePool picker (full duplex both ways)."""

    request: str
    response: str
    gateway: str = SIDECAR
    grpc_server: str = DEFAULT_GRPC_SERVER  # the ext_proc's --grpc-server ("@grpcio" in the label)
    # the ext_proc's --flow-groups none, and no client address from Envoy ("/ungrouped" in the label)
    ungrouped: bool = False

    @property
    def label(self) -> str:
        base = f"{self.request}/{self.response}" if self.gateway == SIDECAR else self.gateway
        if self.ungrouped:
            base += f"/{UNGROUPED}"
        return base if self.grpc_server == DEFAULT_GRPC_SERVER else f"{base}@{self.grpc_server}"


UNGROUPED = "ungrouped"
DEFAULT_MODE = BodyMode("BUFFERED", "STREAMED")  # render_sidecar's default, what `pilotfish up` runs


def parse_body_mode(text: str) -> BodyMode:
    """`REQUEST/RESPONSE` (sidecar body modes) or a gateway name; ConfigError names the flag."""
    from pilotfish.config import ConfigError
    from pilotfish.envoy_bootstrap import BODY_MODES, GATEWAYS

    spec, at, server = text.partition("@")
    if at and server not in GRPC_SERVERS:
        raise ConfigError(f"--body-modes {text!r}: the ext_proc's gRPC server is one of {', '.join(GRPC_SERVERS)}")
    server = server or DEFAULT_GRPC_SERVER
    if spec in GATEWAYS:
        return BodyMode("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", spec, server)
    request, _, response = spec.partition("/")
    response, slash, grouping = response.partition("/")
    if (request in BODY_MODES and response in (*BODY_MODES, "NONE", OBSERVE, FIRST)
            and (not slash or grouping == UNGROUPED)):
        return BodyMode(request, response, grpc_server=server, ungrouped=bool(slash))
    raise ConfigError(
        f"--body-modes {text!r}: expected REQUEST/RESPONSE, each one of {', '.join(BODY_MODES)} (the response "
        f"also NONE, {OBSERVE} or {FIRST}), or a gateway: {', '.join(GATEWAYS)}; either may end in @SERVER, the "
        f"ext_proc's --grpc-server ({', '.join(GRPC_SERVERS)}); a sidecar's may add /{UNGROUPED} before that "
        "(the ext_proc's --flow-groups none, and no client address from Envoy)"
    )


COLOCATED_ARM = "envoy+ext_proc, colocated scheduler"
UNARY_ARM = "envoy+ext_proc, remote scheduler, unary calls (no Session)"
GRPC_SESSION_ARM = "envoy+ext_proc, remote scheduler, gRPC Session stream"
NO_SCHEDULER_ARM = "envoy+ext_proc, no scheduler"
DEFAULT_ARM = "envoy+ext_proc"  # the sidecar's default body modes, remote scheduler on the Session socket
TLS_ARM = "envoy+ext_proc, TLS and a token on every link"
VLLM_ROUTER_ARM = "vllm-router (round_robin)"
DIRECT_ARM = "direct to the engine"


def mode_arm(mode: BodyMode) -> str:
    """The arm that measures `mode` on the default deployment's ext_proc."""
    return DEFAULT_ARM if mode == DEFAULT_MODE else f"envoy+ext_proc, {mode.label}"


def _scale_arm(n: int) -> str:
    return DEFAULT_ARM if n == 1 else f"envoy+{n} ext_procs, remote scheduler"


@dataclass
class Arm:
    name: str
    port: int
    ext_proc_pids: list[int] = field(default_factory=list)
    admin_url: str = ""  # Envoy's admin, for its ext_proc message counters
    scheduler_pid: int = 0  # the remote scheduler these ext_procs call, for its CPU per request
    envoy_pid: int = 0  # for its CPU per request (0: no proxy); a peer router's arm: its process


@dataclass
class Arms:
    load: dict[str, Arm]  # the fast engine: latency and throughput phases
    streaming: dict[str, Arm]  # the paced engine: "envoy", then one per body mode label
    down: dict[str, Arm]  # per body mode label: no ext_proc answering
    modes: dict[str, BodyMode]  # label -> mode, in --body-modes order


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args
    from pilotfish.procs import ChildGroup

    cfg = struct_from_args(GatewayBenchConfig, args)
    modes = {m.label: m for m in map(parse_body_mode, cfg.body_modes)}
    group = ChildGroup()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-gateway-") as tmp:
        try:
            arms = _start(Path(tmp), group, cfg, modes)
            setup_s = time.perf_counter() - started
            print(f"stack up in {setup_s:.0f} s; measuring", file=sys.stderr)
            raw = asyncio.run(_measure(cfg, arms))
        finally:
            group.stop_all()
    raw["phase_seconds"] = {"setup": setup_s, **raw["phase_seconds"], "total": time.perf_counter() - started}
    settings = msgspec.structs.asdict(cfg) | {"out": str(args.out)}
    result = summarise(raw, settings, modes)
    write_report(args.out, "gateway", result, render_markdown(result))
    print(render_markdown(result))
    return 0


# ---------------------------------------------------------------------------------------------- set-up


def _uses(modes: dict[str, BodyMode], response: str) -> bool:
    return any(m.response == response for m in modes.values())


def _bootstrap(
    mode: BodyMode | None, listen: int, ext_proc_ports: list[int], upstream: int, security: dict[str, str] | None = None
) -> str:
    """Envoy's bootstrap for `mode`; None: Envoy alone (the sidecar without its ext_proc filter)."""
    from pilotfish.envoy_bootstrap import render_gateway, render_plain_proxy, render_sidecar
    from pilotfish.procs import free_port

    endpoints = [("127.0.0.1", upstream)]
    if mode is not None and mode.gateway != SIDECAR:
        return render_gateway(
            mode.gateway, listen_port=listen, ext_proc_ports=ext_proc_ports, default_endpoints=endpoints
        )
    sidecar = mode or DEFAULT_MODE
    text = render_sidecar(
        listen_port=listen,
        admin_port=free_port(),  # start_envoy sets the admin address over it
        ext_proc_ports=ext_proc_ports,
        default_endpoints=endpoints,
        request_body_mode=sidecar.request,
        response_body_mode={OBSERVE: "NONE", FIRST: "STREAMED"}.get(sidecar.response, sidecar.response),
        observe_response_bodies=sidecar.response == OBSERVE,
        release_from_access_log=sidecar.response == FIRST,
        client_address=not sidecar.ungrouped,
        **(security or {}),  # type: ignore[arg-type]
    )
    return render_plain_proxy(text) if mode is None else text


def _start(tmp: Path, group: Any, cfg: GatewayBenchConfig, modes: dict[str, BodyMode]) -> Arms:
    from pilotfish.procs import free_port
    from pilotfish.services import start_envoy

    py = [sys.executable, "-m", "pilotfish"]

    def engine(name: str, step_ms: str) -> tuple[int, Any]:
        port = free_port()
        argv = [*py, "sim", "serve", "--ports", str(port), "--model", MODEL, "--engine-id-prefix", name,
                "--step-ms", step_ms, "--prefill-ms-per-token", "0", "--decode-ms-per-token", "0"]  # fmt: skip
        return port, group.start(f"engine-{name}", argv, log_path=tmp / f"{name}.log")

    # fast: answers as soon as the loop turns; paced: a 5 ms decode step, for per-event timing
    (fast, fast_child), (paced, paced_child) = engine("fast", "0.05"), engine("paced", "5")
    fast_child.wait_port(fast)
    paced_child.wait_port(paced)

    sched_port, session_port = free_port(), free_port()
    scheduler = group.start(
        "scheduler",
        [*py, "scheduler", "--port", str(sched_port), "--session-port", str(session_port),
         "--instances", f"fast=127.0.0.1:{fast}", "--model", MODEL],
        log_path=tmp / "scheduler.log",
    )  # fmt: skip
    scheduler.wait_port(sched_port)
    scheduler.wait_port(session_port)
    on_socket = ("--scheduler-session-address", f"127.0.0.1:{session_port}")  # what `pilotfish up` runs

    pending: list[tuple[Any, int]] = []

    def ext_proc(name: str, upstream: str, with_scheduler: bool, *extra: str) -> tuple[int, int]:
        port = free_port()
        argv = [*py, "ext-proc", "--port", str(port), "--instances", upstream, "--model", MODEL,
                "--scheduler-address", f"127.0.0.1:{sched_port}" if with_scheduler else "", *extra]  # fmt: skip
        child = group.start(name, argv, log_path=tmp / f"{name}.log")
        pending.append((child, port))
        return port, child.pid

    on_fast, on_paced = f"fast=127.0.0.1:{fast}", f"paced=127.0.0.1:{paced}"
    # scale[0] is the default deployment's ext_proc: every body mode arm shares it
    scale = [ext_proc(f"ext_proc-{i + 1}", on_fast, True, *on_socket) for i in range(cfg.ext_procs)]
    xp_rr = ext_proc("ext_proc-rr", on_fast, False)
    xp_grpc = ext_proc("ext_proc-grpc-session", on_fast, True)
    xp_unary = ext_proc("ext_proc-unary", on_fast, True, "--no-scheduler-session")
    xp_colo = ext_proc("ext_proc-colocated", on_fast, False, "--colocated-scheduling")
    xp_paced = ext_proc("ext_proc-paced", on_paced, False)
    # the response modes an ext_proc flag makes (not Envoy's body modes): each used gets its own ext_procs, fast
    # and paced
    by_response = {
        response: (
            ext_proc(f"ext_proc-{slug}", on_fast, True, *on_socket, "--response-bodies", flag),
            ext_proc(f"ext_proc-paced-{slug}", on_paced, False, "--response-bodies", flag),
        )
        for response, (slug, flag) in _RESPONSE_BODIES.items()
        if _uses(modes, response)
    }
    # a mode on another gRPC server, or ungrouped, gets its own ext_procs (fast and paced), its response flags kept
    by_label: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
    for label, mode in modes.items():
        if mode.grpc_server != DEFAULT_GRPC_SERVER or mode.ungrouped:
            response = _RESPONSE_BODIES.get(mode.response)
            flags = (*(("--response-bodies", response[1]) if response else ()), "--grpc-server", mode.grpc_server,
                     *(("--flow-groups", "none") if mode.ungrouped else ()))
            slug = re.sub(r"[^\w.-]+", "-", label)
            by_label[label] = (
                ext_proc(f"ext_proc-{slug}", on_fast, True, *on_socket, *flags),
                ext_proc(f"ext_proc-paced-{slug}", on_paced, False, *flags),
            )
    secure: dict[str, str] = {}
    if cfg.tls:  # the same deployment with every link secured: its own scheduler, ext_proc and Envoy
        from pilotfish.security_testing import make_pki

        pki = make_pki(tmp / "pki")
        token = tmp / "token"
        token.write_text(os.urandom(16).hex() + "\n")
        token.chmod(0o600)
        flags = ("--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key), "--tls-ca-file", str(pki.ca),
                 "--auth-token-file", str(token))  # fmt: skip
        tls_port, tls_session = free_port(), free_port()
        scheduler_tls = group.start(
            "scheduler-tls",
            [*py, "scheduler", "--port", str(tls_port), "--session-port", str(tls_session),
             "--instances", f"fast=127.0.0.1:{fast}", "--model", MODEL, *flags],
            log_path=tmp / "scheduler-tls.log",
        )  # fmt: skip
        scheduler_tls.wait_port(tls_session)
        xp_tls = ext_proc("ext_proc-tls", on_fast, True, "--scheduler-address", f"127.0.0.1:{tls_port}",
                          "--scheduler-session-address", f"127.0.0.1:{tls_session}", *flags)  # fmt: skip
        secure = {"ext_proc_tls_ca_file": str(pki.ca), "ext_proc_tls_cert_file": str(pki.client_cert),
                  "ext_proc_tls_key_file": str(pki.client_key), "ext_proc_auth_token_file": str(token)}  # fmt: skip
    for child, port in pending:
        child.wait_port(port)

    def arm(
        name: str,
        xps: list[tuple[int, int]],
        upstream: int = fast,
        mode: BodyMode = DEFAULT_MODE,
        remote: bool = False,
        scheduler_pid: int = 0,
        security: dict[str, str] | None = None,
    ) -> Arm:
        listen = free_port()
        bootstrap = _bootstrap(mode if xps else None, listen, [p for p, _ in xps], upstream, security or {})
        # one worker thread each: the same share of the machine for every arm
        service = start_envoy(bootstrap, tmp / re.sub(r"[^\w.-]+", "-", name), extra_args=["--concurrency", "1"])
        assert service.child is not None
        group.children.append(service.child)
        service.child.wait_port(listen)
        pids = [pid for _, pid in xps if pid]
        scheduler_pid = scheduler_pid or (scheduler.pid if remote else 0)
        return Arm(name, listen, pids, service.url, scheduler_pid, service.child.pid)

    load = {
        "envoy": arm("envoy", []),
        GRPC_SESSION_ARM: arm(GRPC_SESSION_ARM, [xp_grpc], remote=True),
        UNARY_ARM: arm(UNARY_ARM, [xp_unary], remote=True),
        NO_SCHEDULER_ARM: arm(NO_SCHEDULER_ARM, [xp_rr]),
        COLOCATED_ARM: arm(COLOCATED_ARM, [xp_colo]),
    }
    for n in range(1, len(scale) + 1):
        load[_scale_arm(n)] = arm(_scale_arm(n), scale[:n], remote=True)
    if secure:
        load[TLS_ARM] = arm(TLS_ARM, [xp_tls], scheduler_pid=scheduler_tls.pid, security=secure)
    for label, mode in modes.items():
        if mode_arm(mode) not in load:
            own = by_label.get(label, by_response.get(mode.response, (None, None)))[0]
            load[mode_arm(mode)] = arm(mode_arm(mode), [own] if own else scale[:1], mode=mode, remote=True)

    def vllm_router(name: str, engine: int) -> Arm:
        port = free_port()
        router = group.start(
            name,
            [cfg.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{engine}",
             "--policy", "round_robin", "--log-level", "warning",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            log_path=tmp / f"{name}.log",
        )  # fmt: skip
        router.wait_port(port, 60)
        # its one process stands where an arm's Envoy does: the proxy's CPU, compared with Envoy alone's
        return Arm(VLLM_ROUTER_ARM, port, envoy_pid=router.pid)

    if cfg.vllm_router:
        load[VLLM_ROUTER_ARM] = vllm_router("vllm-router", fast)
    load[DIRECT_ARM] = Arm(DIRECT_ARM, fast)  # no proxy: what each proxy adds over the engine itself
    streaming = {"envoy": arm("paced envoy", [], paced)}
    streaming |= {
        label: arm(
            f"paced {label}",
            [by_label.get(label, by_response.get(mode.response, (None, None)))[1] or xp_paced],
            paced,
            mode,
        )
        for label, mode in modes.items()
    }
    if cfg.vllm_router:
        streaming[VLLM_ROUTER_ARM] = vllm_router("vllm-router-paced", paced)
    # No ext_proc listens on `dead`: what a client gets when the ext_proc is gone, per body mode.
    dead = free_port()
    down = {label: arm(f"down {label}", [(dead, 0)], mode=mode) for label, mode in modes.items()}
    return Arms(load, streaming, down, modes)


# ---------------------------------------------------------------------------------------------- measure


def _cpu(arm: Arm) -> dict[str, float]:
    """CPU seconds so far of the arm's Envoy, its ext_procs and its remote scheduler."""
    return {
        "envoy": _cpu_time(arm.envoy_pid) if arm.envoy_pid else 0.0,
        "ext_proc": sum(_cpu_time(p) for p in arm.ext_proc_pids),
        "scheduler": _cpu_time(arm.scheduler_pid) if arm.scheduler_pid else 0.0,
    }


def _cpu_used(arm: Arm, before: dict[str, float]) -> dict[str, float | None]:
    """CPU seconds used since `before`; None for a part the arm does not have."""
    after = _cpu(arm)
    present = {"envoy": arm.envoy_pid, "ext_proc": arm.ext_proc_pids, "scheduler": arm.scheduler_pid}
    return {k: after[k] - before[k] if present[k] else None for k in after}


async def _measure(cfg: GatewayBenchConfig, arms: Arms) -> dict[str, Any]:
    """Raw samples, per arm and per round; `summarise` turns them into the report's figures."""
    import aiohttp

    load = arms.load
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    sbody = {"model": MODEL, "prompt": "hi", "max_tokens": cfg.stream_tokens, "stream": True}
    mode_arms = [name for name in dict.fromkeys(map(mode_arm, arms.modes.values())) if name != DEFAULT_ARM]
    latency_arms = ["envoy", DEFAULT_ARM, GRPC_SESSION_ARM, UNARY_ARM, COLOCATED_ARM, NO_SCHEDULER_ARM, *mode_arms]
    secured = [TLS_ARM] if TLS_ARM in load else []
    peers = [name for name in load if name.startswith("vllm-router")]
    latency_arms += [*secured, *peers, DIRECT_ARM]
    scale_arms = [_scale_arm(n) for n in range(1, cfg.ext_procs + 1)]
    load_arms = ["envoy", COLOCATED_ARM, *scale_arms, GRPC_SESSION_ARM, UNARY_ARM, *mode_arms, *secured, *peers]
    raw: dict[str, Any] = {
        "latency": {a: [] for a in latency_arms},
        "load": {a: [] for a in load_arms},
        "load_ext_procs": {a: len(load[a].ext_proc_pids) for a in load_arms},
        "scale_out": scale_arms,
        "down": {},
        "streams": {a: [] for a in arms.streaming},
        "phase_seconds": {},
    }
    phases = raw["phase_seconds"]
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # warm every path (connections, Envoy's ORIGINAL_DST hosts, ext_proc streams)
        for arm in load.values():
            for _ in range(20):
                await _one(session, arm.port, body)
        for arm in arms.streaming.values():
            await _streams(session, arm.port, sbody | {"max_tokens": 2}, 2, 2)
        phase("warm")

        for k in range(cfg.rounds):
            for name in _rotated(latency_arms, k, cfg.rounds):
                raw["latency"][name].append([await _one(session, load[name].port, body) for _ in range(cfg.requests)])
        phase("latency")

        for k in range(cfg.rounds):
            for name in _rotated(load_arms, k, cfg.rounds):
                raw["load"][name].append(await _load_round(session, load[name], body, cfg))
        phase("throughput")

        # With nothing listening where the ext_proc should be: BUFFERED falls back (failure_mode_allow, then
        # the route-level default destination); full duplex turns failure_mode_allow off once body bytes
        # have gone to the ext_proc, so the client gets Envoy's 500; the gateways fail closed by default.
        for label, arm in arms.down.items():
            statuses: dict[str, int] = {}
            for _ in range(cfg.down_requests):
                status = str(await _status(session, arm.port, body))
                statuses[status] = statuses.get(status, 0) + 1
            raw["down"][label] = statuses
        phase("ext_proc_down")

        for k in range(cfg.rounds):
            for name in _rotated(list(arms.streaming), k, cfg.rounds):
                arm = arms.streaming[name]
                before = _cpu(arm)
                results = await _streams(session, arm.port, sbody, cfg.streams, cfg.stream_concurrency)
                raw["streams"][name].append(
                    {
                        "streams": len(results),
                        "ttft": [ttft for ttft, _ in results],
                        "gaps": [g for _, gaps in results for g in gaps],
                        "cpu": _cpu_used(arm, before),
                    }
                )
        phase("streaming")
    return raw


def _rotated(names: list[str], k: int, rounds: int) -> list[str]:
    """Round k's order: each round starts 1/rounds of the list further on, so no arm is always
    measured right after the same neighbour or at the same point of a round."""
    shift = k * len(names) // rounds
    return names[shift:] + names[:shift]


async def _load_round(session: Any, arm: Arm, body: dict[str, Any], cfg: GatewayBenchConfig) -> dict[str, Any]:
    import resource

    msgs_before = await _ext_proc_messages(session, arm.admin_url if arm.ext_proc_pids else "")
    before = _cpu(arm)
    client_before = resource.getrusage(resource.RUSAGE_SELF)
    done, elapsed = await _saturate(session, arm.port, body, cfg.concurrency, cfg.seconds)
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = _cpu_used(arm, before)
    msgs_after = await _ext_proc_messages(session, arm.admin_url if arm.ext_proc_pids else "")
    return {
        "requests": done,
        "seconds": elapsed,
        "client_cpu": sum(getattr(client_after, f) - getattr(client_before, f) for f in ("ru_utime", "ru_stime")),
        "cpu": cpu,
        # Envoy's counters: ext_proc messages it sent and took back
        "messages_to": msgs_after[0] - msgs_before[0],
        "messages_from": msgs_after[1] - msgs_before[1],
    }


async def _one(session: Any, port: int, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"port {port}: HTTP {resp.status}")
    return time.perf_counter() - start


async def _status(session: Any, port: int, body: dict[str, Any]) -> int:
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        await resp.read()
        return int(resp.status)


async def _ext_proc_messages(session: Any, admin_url: str) -> tuple[int, int]:
    """Envoy's ext_proc counters: messages sent to and received from the ext_proc so far."""
    if not admin_url:
        return 0, 0
    async with session.get(f"{admin_url}/stats?filter=ext_proc.stream_msgs") as resp:
        text = await resp.text()
    counts = dict(line.rsplit(": ", 1) for line in text.splitlines() if ": " in line)
    sent = sum(int(v) for k, v in counts.items() if k.endswith("stream_msgs_sent"))
    received = sum(int(v) for k, v in counts.items() if k.endswith("stream_msgs_received"))
    return sent, received


async def _saturate(
    session: Any, port: int, body: dict[str, Any], concurrency: int, seconds: float
) -> tuple[int, float]:
    import asyncio

    deadline = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await _one(session, port, body)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.perf_counter() - start


async def _streams(
    session: Any, port: int, body: dict[str, Any], count: int, concurrency: int
) -> list[tuple[float, list[float]]]:
    """`count` SSE streams, `concurrency` at a time: (TTFT, gaps between events) of each."""
    import asyncio

    left = count
    results: list[tuple[float, list[float]]] = []

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            results.append(await _stream(session, port, body))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return results


async def _stream(session: Any, port: int, body: dict[str, Any]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    stamps: list[float] = []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"port {port}: HTTP {resp.status}")
        async for line in resp.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"port {port}: a stream with no events")
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]


# ---------------------------------------------------------------------------------------------- report


def _summary(seconds: list[float]) -> dict[str, float]:
    from pilotfish.stats import percentile

    return {
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "mean_ms": sum(seconds) / len(seconds) * 1e3 if seconds else float("nan"),
        "n": len(seconds),
    }


def _per(total: float | None, count: int) -> float | None:
    """`total` seconds per one of `count`, in µs; None when not measured."""
    return None if total is None or not count else total / count * 1e6


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _load_entry(rounds: list[dict[str, Any]], ext_procs: int) -> dict[str, Any]:
    """Throughput and CPU per request of one arm, over its rounds (each a `_load_round`)."""
    done = sum(r["requests"] for r in rounds)
    elapsed = sum(r["seconds"] for r in rounds)
    entry: dict[str, Any] = {
        "requests": done,
        "seconds": elapsed,
        "req_per_s": done / elapsed,
        "round_req_per_s": [r["requests"] / r["seconds"] for r in rounds],
        "client_cpu_share": sum(r["client_cpu"] for r in rounds) / elapsed,
    }
    for part in ("envoy", "ext_proc", "scheduler"):
        if rounds[0]["cpu"][part] is None:
            continue
        entry[f"{part}_cpu_us_per_request"] = _per(sum(r["cpu"][part] for r in rounds), done)
        entry[f"round_{part}_cpu_us_per_request"] = [_per(r["cpu"][part], r["requests"]) for r in rounds]
    if ext_procs:
        cpu = sum(r["cpu"]["ext_proc"] for r in rounds)
        entry["ext_proc_processes"] = ext_procs
        entry["ext_proc_capacity_req_per_s_per_core"] = done / cpu if cpu else float("inf")
        entry["messages_to_ext_proc_per_request"] = sum(r["messages_to"] for r in rounds) / done
        entry["messages_from_ext_proc_per_request"] = sum(r["messages_from"] for r in rounds) / done
    return entry


def _stream_entry(rounds: list[dict[str, Any]], base: dict[str, Any] | None) -> dict[str, Any]:
    """TTFT, gaps between SSE events and CPU per stream of one arm; added over `base` (Envoy alone)."""
    from pilotfish.stats import percentile

    streams = sum(r["streams"] for r in rounds)
    entry: dict[str, Any] = {
        "streams": streams,
        "ttft": _summary([t for r in rounds for t in r["ttft"]]),
        "gap": _summary([g for r in rounds for g in r["gaps"]]),
        "round_ttft_p50_ms": [percentile(r["ttft"], 50) * 1e3 for r in rounds],
        "round_gap_mean_ms": [sum(r["gaps"]) / len(r["gaps"]) * 1e3 for r in rounds],
    }
    for part in ("envoy", "ext_proc"):
        if rounds[0]["cpu"][part] is not None:
            entry[f"{part}_cpu_us_per_stream"] = _per(sum(r["cpu"][part] for r in rounds), streams)
    if base is not None:
        entry["added_ttft_p50_ms"] = entry["ttft"]["p50_ms"] - base["ttft"]["p50_ms"]
        entry["added_ttft_p99_ms"] = entry["ttft"]["p99_ms"] - base["ttft"]["p99_ms"]
        entry["added_gap_mean_ms"] = entry["gap"]["mean_ms"] - base["gap"]["mean_ms"]
        entry["added_gap_p99_ms"] = entry["gap"]["p99_ms"] - base["gap"]["p99_ms"]
        pairs = zip(entry["round_ttft_p50_ms"], base["round_ttft_p50_ms"], strict=True)
        entry["round_added_ttft_p50_ms"] = [a - b for a, b in pairs]
        pairs = zip(entry["round_gap_mean_ms"], base["round_gap_mean_ms"], strict=True)
        entry["round_added_gap_mean_ms"] = [a - b for a, b in pairs]
        entry["envoy_added_cpu_us_per_stream"] = _minus(
            entry.get("envoy_cpu_us_per_stream"), base.get("envoy_cpu_us_per_stream")
        )
    return entry


def summarise(raw: dict[str, Any], settings: dict[str, Any], modes: dict[str, BodyMode]) -> dict[str, Any]:
    """The report's figures from `_measure`'s raw samples (seconds), all differences against Envoy alone."""
    from pilotfish.stats import percentile

    latency: dict[str, dict[str, Any]] = {}
    base_rounds = [percentile(r, 50) * 1e3 for r in raw["latency"]["envoy"]]
    base = _summary([v for r in raw["latency"]["envoy"] for v in r])
    for name, rounds in raw["latency"].items():
        s: dict[str, Any] = _summary([v for r in rounds for v in r])
        s["added_p50_ms"] = s["p50_ms"] - base["p50_ms"]
        s["added_p99_ms"] = s["p99_ms"] - base["p99_ms"]
        s["round_p50_ms"] = [percentile(r, 50) * 1e3 for r in rounds]
        s["round_added_p50_ms"] = [a - b for a, b in zip(s["round_p50_ms"], base_rounds, strict=True)]
        latency[name] = s
    direct = latency.get(DIRECT_ARM)
    over_direct: dict[str, Any] = {}
    if direct is not None:
        for s in latency.values():
            s["over_direct_p50_ms"] = s["p50_ms"] - direct["p50_ms"]
        peer = latency.get(VLLM_ROUTER_ARM)
        if peer is not None and peer["over_direct_p50_ms"] > 0:
            # what the whole hop adds over a direct call, against what vllm-router adds
            over_direct = {
                name: latency[name]["over_direct_p50_ms"] / peer["over_direct_p50_ms"]
                for name in (DEFAULT_ARM, *(mode_arm(m) for m in modes.values()))
                if name in latency
            }

    throughput = {name: _load_entry(rounds, raw["load_ext_procs"][name]) for name, rounds in raw["load"].items()}
    plain_envoy_us = throughput["envoy"]["envoy_cpu_us_per_request"] if "envoy" in throughput else None
    for t in throughput.values():
        added = _minus(t.get("envoy_cpu_us_per_request"), plain_envoy_us)
        t["envoy_added_cpu_us_per_request"] = added
        if "ext_proc_cpu_us_per_request" in t and added is not None:
            # the whole hop: what Envoy spends over Envoy alone, the ext_procs and the remote scheduler
            parts = (added, t["ext_proc_cpu_us_per_request"], t.get("scheduler_cpu_us_per_request") or 0.0)
            t["hop_cpu_us_per_request"] = sum(parts)

    stream_base = _stream_entry(raw["streams"]["envoy"], None)
    streaming = {"envoy": stream_base}
    streaming |= {
        name: _stream_entry(rounds, stream_base) for name, rounds in raw["streams"].items() if name != "envoy"
    }

    body_modes: dict[str, dict[str, Any]] = {}
    for label, mode in modes.items():
        arm = mode_arm(mode)
        lat, t, st = latency[arm], throughput[arm], streaming.get(label, {})
        body_modes[label] = {
            "request": mode.request,
            "response": mode.response,
            "envoy_config": mode.gateway,
            "grpc_server": mode.grpc_server,
            "ungrouped": mode.ungrouped,
            "arm": arm,
            "added_p50_ms": lat["added_p50_ms"],
            "added_p99_ms": lat["added_p99_ms"],
            "round_added_p50_ms": lat["round_added_p50_ms"],
            "envoy_added_cpu_us_per_request": t.get("envoy_added_cpu_us_per_request"),
            "ext_proc_cpu_us_per_request": t.get("ext_proc_cpu_us_per_request"),
            "round_ext_proc_cpu_us_per_request": t.get("round_ext_proc_cpu_us_per_request"),
            "scheduler_cpu_us_per_request": t.get("scheduler_cpu_us_per_request"),
            "hop_cpu_us_per_request": t.get("hop_cpu_us_per_request"),
            "messages_to_ext_proc_per_request": t.get("messages_to_ext_proc_per_request"),
            "messages_from_ext_proc_per_request": t.get("messages_from_ext_proc_per_request"),
            "stream": {
                k: st.get(k)
                for k in (
                    "added_ttft_p50_ms",
                    "added_ttft_p99_ms",
                    "added_gap_mean_ms",
                    "added_gap_p99_ms",
                    "round_added_ttft_p50_ms",
                    "round_added_gap_mean_ms",
                    "ext_proc_cpu_us_per_stream",
                    "envoy_added_cpu_us_per_stream",
                )
            },
            "ext_proc_down": raw["down"].get(label, {}),
        }
    return {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "settings": settings,
        "phase_seconds": raw.get("phase_seconds", {}),
        "body_modes": body_modes,
        "latency": latency,
        "throughput": throughput,
        "scale_out": raw["scale_out"],
        "ext_proc_down": raw["down"],
        "streaming": streaming,
        "over_direct_vs_vllm_router": over_direct,
    }


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _span(values: list[float | None] | None, fmt: str = "+.2f") -> str:
    """min..max over rounds, the spread shown beside a figure."""
    got = [v for v in values or [] if v is not None]
    return f"{min(got):{fmt}}..{max(got):{fmt}}" if got else "-"


def _statuses(statuses: dict[str, int]) -> str:
    return ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items())) or "-"


def _server_note(mode: dict[str, Any]) -> str:
    server = mode.get("grpc_server", DEFAULT_GRPC_SERVER)
    notes = [*([f"ext_proc on {server}"] if server != DEFAULT_GRPC_SERVER else []),
             *(["--flow-groups none"] if mode.get("ungrouped") else [])]
    return f" ({', '.join(notes)})" if notes else ""


def render_markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in r.get("phase_seconds", {}).items())
    lines = [
        "# Gateway benchmark: Envoy alone vs Envoy + Pilotfish ext_proc",
        "",
        f"Machine: {r['machine']['cpus']} CPUs, 1-min load {r['machine']['load_avg_1m']:.2f} at the end. "
        "Every process (client, Envoys, ext_procs, scheduler, engines) shares these cores; each Envoy runs one "
        f"worker thread. {s.get('rounds')} interleaved rounds in every phase; `a..b` is the spread over rounds."
        + (f" Wall time: {phases}." if phases else ""),
        "",
        "`envoy+ext_proc` is what `pilotfish up` runs: the sidecar with BUFFERED request and STREAMED response "
        "bodies, a remote scheduler process reached on its plain Session socket (`--session-port` / "
        "`--scheduler-session-address`). The gRPC Session stream and unary calls are measured beside it.",
        "",
        "## Body modes",
        "",
        "Every mode on the same ext_proc and remote scheduler as `envoy+ext_proc`; a gateway's is the bootstrap it "
        "generates for an InferencePool picker (full duplex both ways; the pool's default failureMode, FailClose). "
        "CPU per request is at "
        f"{s.get('concurrency')} in flight: Envoy's above Envoy alone, the ext_proc's, the scheduler's, and their "
        f"sum (the hop). SSE: {s.get('stream_tokens')}-token streams, {s.get('stream_concurrency')} at a time, "
        "against a 5 ms decode step, ext_proc without scheduler; added against Envoy alone.",
        "",
        "| Envoy config | request / response body | added p50 ms (rounds) | added p99 ms | CPU µs/request: "
        "Envoy + ext_proc + scheduler = hop | messages to / from ext_proc | SSE added TTFT p50 / p99 ms "
        "| SSE added gap mean / p99 ms | SSE ext_proc CPU µs/stream | no ext_proc answering |",
        "|---|---|---:|---:|---|---|---|---|---:|---|",
    ]
    for m in r["body_modes"].values():
        st = m["stream"]
        cpu = (
            f"{_num(m['envoy_added_cpu_us_per_request'])} + {_num(m['ext_proc_cpu_us_per_request'])} + "
            f"{_num(m['scheduler_cpu_us_per_request'])} = **{_num(m['hop_cpu_us_per_request'])}**"
        )
        msgs = (
            f"{_num(m['messages_to_ext_proc_per_request'], '.2f')} / "
            f"{_num(m['messages_from_ext_proc_per_request'], '.2f')}"
        )
        lines.append(
            f"| {m['envoy_config']}{_server_note(m)} | {m['request']} / {m['response']} | **{m['added_p50_ms']:+.2f}** "
            f"({_span(m['round_added_p50_ms'])}) | {m['added_p99_ms']:+.2f} | {cpu} | {msgs} | "
            f"{_num(st['added_ttft_p50_ms'], '+.2f')} / {_num(st['added_ttft_p99_ms'], '+.2f')} | "
            f"{_num(st['added_gap_mean_ms'], '+.3f')} / {_num(st['added_gap_p99_ms'], '+.3f')} | "
            f"{_num(st['ext_proc_cpu_us_per_stream'])} | {_statuses(m['ext_proc_down'])} |"
        )
    lines += [
        "",
        "## Latency (sequential small completions)",
        "",
        "| arm | p50 ms | p99 ms | added p50 ms | added p99 ms | per-round p50 ms | per-round added p50 ms |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, lat in r["latency"].items():
        rounds = ", ".join(f"{v:.2f}" for v in lat["round_p50_ms"])
        added = ", ".join(f"{v:+.2f}" for v in lat["round_added_p50_ms"])
        lines.append(
            f"| {name} | {lat['p50_ms']:.2f} | {lat['p99_ms']:.2f} | {lat['added_p50_ms']:+.2f} | "
            f"{lat['added_p99_ms']:+.2f} | {rounds} | {added} |"
        )
    direct = r["latency"].get(DIRECT_ARM)
    if direct is not None:
        added = ", ".join(
            f"{name} {lat['over_direct_p50_ms']:+.2f}" for name, lat in r["latency"].items() if name != DIRECT_ARM
        )
        lines += ["", f"Added p50 over a direct call to the engine ({direct['p50_ms']:.2f} ms), ms: {added}."]
        if r.get("over_direct_vs_vllm_router"):
            ratios = ", ".join(f"{name} {x:.1f}x" for name, x in r["over_direct_vs_vllm_router"].items())
            lines.append(f"Against what vllm-router adds over a direct call: {ratios}.")
    lines += [
        "",
        f"## Throughput ({s.get('concurrency')} in flight)",
        "",
        "| arm | req/s (rounds) | proxy CPU µs/request: Envoy, or the peer router (above Envoy alone) "
        "| ext_proc CPU µs/request (rounds) "
        "| capacity req/s per core | scheduler CPU µs/request | messages to / from ext_proc |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for name, t in r["throughput"].items():
        xp = t.get("ext_proc_cpu_us_per_request")
        envoy = f"{_num(t.get('envoy_cpu_us_per_request'))} ({_num(t.get('envoy_added_cpu_us_per_request'), '+.0f')})"
        if xp is None:
            lines.append(
                f"| {name} | {t['req_per_s']:.0f} ({_span(t['round_req_per_s'], '.0f')}) | {envoy} | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {name} | {t['req_per_s']:.0f} ({_span(t['round_req_per_s'], '.0f')}) | {envoy} | "
            f"{xp:.0f} ({_span(t['round_ext_proc_cpu_us_per_request'], '.0f')}) | "
            f"{t['ext_proc_capacity_req_per_s_per_core']:.0f} | {_num(t.get('scheduler_cpu_us_per_request'))} | "
            f"{t['messages_to_ext_proc_per_request']:.2f} / {t['messages_from_ext_proc_per_request']:.2f} |"
        )
    base_rps = r["throughput"][r["scale_out"][0]]["req_per_s"]
    lines += [
        "",
        "## Scale-out (remote scheduler)",
        "",
        "| ext_procs | req/s | vs one | ext_proc CPU µs/request |",
        "|---:|---:|---:|---:|",
    ]
    for name in r["scale_out"]:
        t = r["throughput"][name]
        lines.append(
            f"| {t['ext_proc_processes']} | {t['req_per_s']:.0f} | {t['req_per_s'] / base_rps:.2f}x | "
            f"{t['ext_proc_cpu_us_per_request']:.0f} |"
        )
    lines += [
        "",
        f"## No ext_proc answering ({s.get('down_requests')} requests per body mode)",
        "",
        "| body mode | client statuses |",
        "|---|---|",
    ]
    for label, statuses in r["ext_proc_down"].items():
        lines.append(f"| {label} | {_statuses(statuses)} |")
    lines += [
        "",
        "## Streaming (5 ms decode step)",
        "",
        "| arm | streams | TTFT p50 / p99 ms | gap mean / p99 ms | added TTFT p50 ms (rounds) "
        "| added gap mean ms (rounds) | added gap p99 ms "
        "| proxy CPU µs/stream: Envoy, or the peer router (above Envoy alone) | ext_proc CPU µs/stream |",
        "|---|---:|---|---|---|---|---:|---|---:|",
    ]
    for name, st in r["streaming"].items():
        envoy = f"{_num(st.get('envoy_cpu_us_per_stream'))} ({_num(st.get('envoy_added_cpu_us_per_stream'), '+.0f')})"
        lines.append(
            f"| {name} | {st['streams']} | {st['ttft']['p50_ms']:.2f} / {st['ttft']['p99_ms']:.2f} | "
            f"{st['gap']['mean_ms']:.3f} / {st['gap']['p99_ms']:.3f} | "
            f"{_num(st.get('added_ttft_p50_ms'), '+.2f')} ({_span(st.get('round_added_ttft_p50_ms'))}) | "
            f"{_num(st.get('added_gap_mean_ms'), '+.3f')} ({_span(st.get('round_added_gap_mean_ms'), '+.3f')}) | "
            f"{_num(st.get('added_gap_p99_ms'), '+.3f')} | {envoy} | {_num(st.get('ext_proc_cpu_us_per_stream'))} |"
        )
    return "\n".join(lines)
