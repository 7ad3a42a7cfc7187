"""The targets of `pilotfish bench realtime`: what each one starts, with which flags, and where the client sends.

Every target starts a fresh simulated fleet (the same `pilotfish sim serve` command line, so the
engines are identical and their prefix caches cold) and then its router, all as children stopped
by PID. Nothing is tuned per target: each router runs its own defaults, and the only flags given
are the ones needed to run at all (ports, worker URLs, log level, the KV-event feed of kv_aware).

Prompt encoding is the one difference in what the client sends, and the engines see the same
tokens either way (the simulator's tokenizer turns the text back into exactly the trace's ids):
- text for every target by default: what real clients send, what sglang-router accepts (it
  answers HTTP 422 to token-id prompts), and what Pilotfish's ext_proc tokenizes exactly;
- token ids for vllm-router's kv_aware: it matches a request's tokens against the engines' KV
  events, and gets tokens either from the request or from the engine's `/tokenize`, which the
  simulator does not serve; with text it would see no tokens and route on load alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "pilotfish-sim"
# where scripts/install-peers.sh puts the peer routers, looked in before PATH
PEERS_VENV = Path(__file__).resolve().parents[1] / ".venv-peers"
START_TIMEOUT = 90.0  # seconds a child may take to answer: a loaded 2-core machine starts Python slowly


@dataclass(frozen=True, slots=True)
class TargetInfo:
    name: str
    family: str  # pilotfish | peer | baseline
    description: str  # the configuration, for the report


# name -> family and configuration; `--targets` takes these names
TARGETS: dict[str, TargetInfo] = {
    t.name: t
    for t in (
        TargetInfo("direct-rr", "baseline", "no router: the client sends request i to engine i mod N itself"),
        TargetInfo(
            "envoy-rr",
            "baseline",
            "Envoy alone: Pilotfish's sidecar bootstrap without its ext_proc filter, round-robin over the "
            "engines (what Envoy costs before Pilotfish adds anything)",
        ),
        TargetInfo(
            "pilotfish-lite",
            "pilotfish",
            "Envoy + ext_proc + scheduler, lite mode, shipped defaults: `predicted-latency` from the "
            "scheduler's own request table, with cache affinity inside its TTFT band",
        ),
        TargetInfo(
            "pilotfish-full",
            "pilotfish",
            "Envoy + ext_proc + scheduler, full mode with a Redis CMS fed by a llumlet in every engine, "
            "shipped defaults: `predicted-latency` from the llumlets' statuses, with cache affinity inside "
            "its TTFT band; response bodies skipped, releases from Envoy's access log",
        ),
        TargetInfo(
            "pilotfish-lite-cache",
            "pilotfish",
            "pilotfish-lite plus --enable-cache-aware-scheduling (no change under the default policy, "
            "which has cache affinity already)",
        ),
        TargetInfo(
            "pilotfish-full-cache",
            "pilotfish",
            "pilotfish-full plus --enable-cache-aware-scheduling (no change under the default policy, "
            "which has cache affinity already)",
        ),
        TargetInfo(
            "pilotfish-lite-count",
            "pilotfish",
            "pilotfish-lite with --response-bodies count: the ext_proc reads every chunk of every stream "
            "(the lite default reads each stream to its first token and sizes the answer at the release)",
        ),
        TargetInfo(
            "pilotfish-lite-grpcio",
            "pilotfish",
            "pilotfish-lite with the ext_proc on grpc.aio's server (--grpc-server grpcio), the transport "
            "before its own loop's",
        ),
        TargetInfo(
            "pilotfish-full-grpcio",
            "pilotfish",
            "pilotfish-full with the ext_proc on grpc.aio's server (--grpc-server grpcio), the transport "
            "before its own loop's",
        ),
        TargetInfo("vllm-router:round_robin", "peer", "vllm-router --policy round_robin, defaults otherwise"),
        TargetInfo(
            "vllm-router:power_of_two",
            "peer",
            "vllm-router --policy power_of_two, defaults otherwise; handicapped here: its load monitor polls "
            "each worker's SGLang-style `/get_load` every 5 s, which the simulator answers 404, so it picks "
            "between two workers without their loads",
        ),
        TargetInfo(
            "vllm-router:cache_aware",
            "peer",
            "vllm-router --policy cache_aware, its defaults (cache threshold 0.3, balance thresholds 64 "
            "absolute / 1.5 relative)",
        ),
        TargetInfo(
            "vllm-router:kv_aware",
            "peer",
            "vllm-router --policy kv_aware fed by every engine's vLLM-format ZMQ KV events "
            "(--kv-event-source per worker, block size 16), defaults otherwise; prompts sent as token ids",
        ),
        TargetInfo(
            "sglang-router:cache_aware",
            "peer",
            "sglang-router launch --policy cache_aware, its defaults (cache threshold 0.3, balance "
            "thresholds 64 / 1.5)",
        ),
    )
}
DEFAULT_TARGETS = (
    "direct-rr",
    "pilotfish-lite",
    "pilotfish-full",
    "pilotfish-full-cache",
    "vllm-router:round_robin",
    "vllm-router:power_of_two",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "sglang-router:cache_aware",
)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The simulated engines every target gets: one `pilotfish sim serve` process, one port each."""

    engines: int
    engine_args: tuple[str, ...]  # profile, KV size, max model length: identical for every target


@dataclass
class Running:
    """A started target: where the client sends, and how."""

    urls: list[str]  # one router URL, or the engines' URLs for direct-rr
    engine_ids: list[str]
    token_id_prompts: bool = False
    router_pids: list[int] = field(default_factory=list)  # router-side processes, for their CPU time
    router_parts: dict[str, int] = field(default_factory=dict)  # component -> pid (Pilotfish: envoy, ext_proc, ...)
    engine_urls: list[str] = field(default_factory=list)  # the engines a peer router was given, in order


def find_executable(flag_value: str, name: str) -> tuple[str, str]:
    """(path, "") for a peer router, or ("", the reason it is skipped)."""
    if flag_value:
        path = Path(flag_value)
        if path.is_file() and os.access(path, os.X_OK):
            return str(path), ""
        return "", f"{flag_value} is not an executable file"
    local = PEERS_VENV / "bin" / name
    if local.is_file():
        return str(local), ""
    found = shutil.which(name)
    if found:
        return found, ""
    return "", f"no {name} executable: pass --{name} PATH, or run scripts/install-peers.sh"


def unavailable(name: str, peers: dict[str, tuple[str, str]]) -> str:
    """Why target `name` cannot run on this machine, or "" when it can; `peers`: router -> (path, reason)."""
    if name.startswith("pilotfish") or name == "envoy-rr":
        from pilotfish.services import MissingBinary, envoy_binary, redis_binary

        try:
            envoy_binary()
            if name.startswith("pilotfish-full"):
                redis_binary()
        except MissingBinary as exc:
            return str(exc)
        return ""
    router = name.partition(":")[0]
    return peers[router][1] if router in peers else ""


def start_target(name: str, fleet: FleetSpec, group: Any, log_dir: Path, peers: dict[str, tuple[str, str]]) -> Running:
    """Start the fleet and target `name`'s router under `group`; returns once the router answers."""
    if name == "direct-rr":
        ports, ids = _start_fleet(fleet, group, log_dir)
        return Running([f"http://127.0.0.1:{p}" for p in ports], ids)
    if name.startswith("pilotfish-"):
        return _start_pilotfish(name, fleet, group, log_dir)
    if name == "envoy-rr":
        return _start_envoy_alone(fleet, group, log_dir)
    router, _, policy = name.partition(":")
    if router == "vllm-router":
        return _start_vllm_router(peers[router][0], policy, fleet, group, log_dir)
    if router == "sglang-router":
        return _start_sglang_router(peers[router][0], policy, fleet, group, log_dir)
    raise ValueError(f"unknown target {name!r}")


def _sim_argv(ports: list[int], fleet: FleetSpec, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pilotfish",
        "sim",
        "serve",
        "--ports",
        ",".join(map(str, ports)),
        "--model",
        MODEL,
        *fleet.engine_args,
        *extra,
    ]


def _start_fleet(
    fleet: FleetSpec, group: Any, log_dir: Path, extra: list[str] | None = None
) -> tuple[list[int], list[str]]:
    from pilotfish.procs import free_port

    ports = [free_port() for _ in range(fleet.engines)]
    sim = group.start("engines", _sim_argv(ports, fleet, extra or []), log_path=log_dir / "engines.log")
    for port in ports:
        sim.wait_port(port, START_TIMEOUT)
    return ports, [f"sim-{i}" for i in range(fleet.engines)]


def _start_envoy_alone(fleet: FleetSpec, group: Any, log_dir: Path) -> Running:
    from pilotfish.envoy_bootstrap import render_plain_proxy, render_sidecar
    from pilotfish.procs import free_port
    from pilotfish.services import start_envoy

    ports, ids = _start_fleet(fleet, group, log_dir)
    listen = free_port()
    engines = [("127.0.0.1", port) for port in ports]
    sidecar = render_sidecar(
        listen_port=listen, admin_port=free_port(), ext_proc_ports=[free_port()], default_endpoints=engines
    )
    # started as the Pilotfish stack starts its Envoy (its default worker count), its default pool only
    service = start_envoy(render_plain_proxy(sidecar), log_dir / "envoy-alone")
    assert service.child is not None
    group.children.append(service.child)
    service.child.wait_port(listen, START_TIMEOUT)
    pid = service.child.pid
    return Running(
        [f"http://127.0.0.1:{listen}"],
        ids,
        router_pids=[pid],
        router_parts={"envoy": pid},
        engine_urls=[f"http://127.0.0.1:{port}" for port in ports],
    )


def _start_pilotfish(name: str, fleet: FleetSpec, group: Any, log_dir: Path) -> Running:
    from pilotfish.services import start_redis
    from pilotfish.stack import StackSpec, start_stack

    full = name.startswith("pilotfish-full")
    spec = StackSpec(
        engines=fleet.engines, model=MODEL, start_timeout=START_TIMEOUT, engine_args=list(fleet.engine_args)
    )
    if name.endswith("-cache"):
        spec.scheduler_args = ["--enable-cache-aware-scheduling"]
    if name.endswith("-grpcio"):
        spec.ext_proc_args = ["--grpc-server", "grpcio"]
    if name.endswith("-count"):
        spec.response_bodies = "count"
    if full:
        redis = start_redis(log_dir / "redis")
        assert redis.child is not None
        group.children.append(redis.child)  # stopped last, after everything that uses it
        spec.cms_url = redis.url
    stack = start_stack(spec, group, log_dir)
    if full:
        _wait_cms(spec.cms_url, spec.cms_cluster, [engine_id for engine_id, _ in stack.engines])
    parts = {n: c.pid for n, c in stack.children.items() if n in ("scheduler", "ext_proc", "envoy")}
    ids = [engine_id for engine_id, _ in stack.engines]
    return Running([stack.base_url], ids, router_pids=list(parts.values()), router_parts=parts)


def _wait_cms(url: str, cluster: str, engine_ids: list[str]) -> None:
    """Until every engine's llumlet has written its status, so the first requests meet a full view."""
    import redis

    from pilotfish.cms import keys
    from pilotfish.procs import wait_until

    client = redis.Redis.from_url(url)
    try:
        wait_until(
            lambda: all(client.exists(keys.status_key(cluster, i)) for i in engine_ids),
            START_TIMEOUT,
            "llumlet statuses in the CMS",
            interval=0.1,
        )
    finally:
        client.close()


def _start_vllm_router(exe: str, policy: str, fleet: FleetSpec, group: Any, log_dir: Path) -> Running:
    from pilotfish.procs import free_port

    extra: list[str] = []
    kv_base = 0
    if policy == "kv_aware":
        kv_base = _free_port_run(fleet.engines)
        extra = ["--kv-events-endpoint", f"tcp://127.0.0.1:{kv_base}"]
    ports, ids = _start_fleet(fleet, group, log_dir, extra)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    port = free_port()
    # a Prometheus port of its own: the default 29000 may belong to someone else on a shared machine
    argv = [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    if policy == "kv_aware":
        for i, url in enumerate(urls):
            argv += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{kv_base + i}"]
        argv += ["--kv-event-model", MODEL]
    router = group.start("vllm-router", argv, log_path=log_dir / "vllm-router.log")
    router.wait_port(port, START_TIMEOUT)
    return Running(
        [f"http://127.0.0.1:{port}"],
        ids,
        token_id_prompts=policy == "kv_aware",
        router_pids=[router.pid],
        engine_urls=urls,
    )


def _start_sglang_router(exe: str, policy: str, fleet: FleetSpec, group: Any, log_dir: Path) -> Running:
    from pilotfish.procs import free_port

    ports, ids = _start_fleet(fleet, group, log_dir)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    port = free_port()
    argv = [
        exe,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
    ]
    router = group.start("sglang-router", argv, log_path=log_dir / "sglang-router.log")
    router.wait_port(port, START_TIMEOUT)
    return Running([f"http://127.0.0.1:{port}"], ids, router_pids=[router.pid], engine_urls=urls)


def _free_port_run(n: int, tries: int = 50) -> int:
    """The first of `n` consecutive free loopback ports (the simulator binds KV events at base + i)."""
    from pilotfish.procs import free_port, port_is_free

    for _ in range(tries):
        base = free_port()
        if base + n < 65536 and all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free ports found")
