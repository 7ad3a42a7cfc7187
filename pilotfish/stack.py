"""Start the whole lite-mode stack on loopback: engines, scheduler, ext_proc, Envoy.

`pilotfish up`, the end-to-end tests and the gateway benchmarks all start it through here, so
they run exactly the same processes with exactly the same flags.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pilotfish.envoy_bootstrap import render_gateway, render_sidecar, write_eds
from pilotfish.procs import Child, ChildGroup, free_port, port_answers, wait_until
from pilotfish.services import LOOPBACK, envoy_binary, envoy_is_live, http_call, start_envoy


@dataclass(slots=True)
class StackSpec:
    engines: int = 2
    model: str = "pilotfish-sim"
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    start_timeout: float = 60.0
    scheduler_metrics: bool = False
    ext_proc_metrics: bool = False
    scheduler_ui: bool = False  # the scheduler's live page (--ui-port), on a free loopback port
    ext_proc_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    # a discovery URL: scheduler (lite mode) and ext_proc learn the engines only from it, and
    # registering them there is the caller's job
    discovery_url: str = ""
    # full mode: a Redis CMS the engines' llumlets write to and the scheduler reads (empty: lite mode)
    cms_url: str = ""
    cms_cluster: str = "pilotfish"
    with_scheduler: bool = True
    engine_args: list[str] = field(default_factory=list)
    # Envoy as Pilotfish's sidecar ("sidecar", with its body modes) or as one of the gateways that
    # host an InferencePool picker (envoy_bootstrap.GATEWAYS), with the pool's failure mode
    gateway: str = "sidecar"
    request_body_mode: str = "BUFFERED"
    # "" = the mode's own: full mode skips response bodies (the llumlets count tokens; releases come
    # from Envoy's access log), lite mode streams them to read each stream's first token
    response_body_mode: str = ""
    # the ext_proc's --response-bodies: "" = the mode's own (the sidecar's: skip in full mode, first-token
    # in lite; another gateway sends the ext_proc no access log: count); "count" reads every chunk,
    # "observe" counts through the sidecar's observing filter
    response_bodies: str = ""
    failure_mode_allow: bool = False
    # the sidecar only: the scheduler's fallbacks the ext_proc lists after the engine it picked
    # (--destination-fallbacks); N > 0 lets Envoy retry a request that failed before its first
    # response byte on the next of them (envoy/sidecar.yaml, picked_pool from an EDS file)
    destination_fallbacks: int = 1
    # each engine its own `sim serve` process (child "engine <id>"), so one can be killed alone;
    # lite mode only (the simulated engines' ids would collide in the CMS)
    separate_engines: bool = False


@dataclass(slots=True)
class Stack:
    engines: list[tuple[str, int]]  # (instance id, port)
    listen_host: str
    listen_port: int
    admin_port: int
    scheduler_port: int
    scheduler_metrics_port: int
    ext_proc_port: int
    ext_proc_metrics_port: int = 0
    children: dict[str, Child] = field(default_factory=dict)
    # by child name: true once that child answers on every port it was started with, so a
    # supervisor knows when a restarted one is back
    ready: dict[str, Callable[[], bool]] = field(default_factory=dict)
    # the sidecar's EDS file of engines for its retries (write_eds rewrites it; empty: none)
    eds_path: str = ""
    scheduler_ui_port: int = 0  # the live page; 0: not served
    response_bodies: str = ""  # the ext_proc's --response-bodies

    @property
    def base_url(self) -> str:
        return f"http://{self.listen_host}:{self.listen_port}"

    def envoy_stat(self, name: str) -> int:
        """One of Envoy's counters or gauges by its admin name (e.g.
        cluster.pilotfish_ext_proc.upstream_rq_tx_reset); 0 when Envoy has none by that name."""
        status, body = http_call(f"http://{LOOPBACK}:{self.admin_port}/stats?filter=^{name}$&format=json", timeout=10)
        if status != 200:
            raise OSError(f"Envoy's admin answered {status} for its stats")
        return sum(int(s.get("value", 0)) for s in json.loads(body)["stats"] if s.get("name") == name)

    def metrics_urls(self) -> list[tuple[str, str]]:
        """(component, URL) of every Prometheus endpoint the stack serves: each engine's
        /metrics, the scheduler's and the ext_proc's where their metrics are on, Envoy's admin."""
        urls = [(f"engine {name}", f"http://{LOOPBACK}:{port}/metrics") for name, port in self.engines]
        if self.scheduler_metrics_port:
            urls.append(("scheduler", f"http://{LOOPBACK}:{self.scheduler_metrics_port}/metrics"))
        if self.ext_proc_metrics_port:
            urls.append(("ext_proc", f"http://{LOOPBACK}:{self.ext_proc_metrics_port}/metrics"))
        urls.append(("envoy", f"http://{LOOPBACK}:{self.admin_port}/stats/prometheus"))
        return urls


def _answering(*ports: int) -> Callable[[], bool]:
    wanted = [port for port in ports if port]
    return lambda: all(port_answers(port) for port in wanted)


def start_stack(spec: StackSpec, group: ChildGroup, log_dir: Path) -> Stack:
    """Start every piece in dependency order, each waited on until it answers on all its ports."""
    envoy_binary()  # fail before starting anything when Envoy is missing
    if spec.separate_engines and spec.cms_url:
        raise ValueError("separate_engines: lite mode only")
    py = [sys.executable, "-m", "pilotfish"]
    engines = [(f"sim-{i}", free_port()) for i in range(spec.engines)]
    scheduler_port = free_port() if spec.with_scheduler else 0
    session_port = free_port() if spec.with_scheduler else 0  # the ext_proc's fast path to the scheduler
    metrics_port = free_port() if spec.scheduler_metrics else 0
    ui_port = free_port() if spec.scheduler_ui and spec.with_scheduler else 0
    ext_proc_port, admin_port = free_port(), free_port()
    ext_proc_metrics_port = free_port() if spec.ext_proc_metrics else 0
    listen_port = spec.listen_port or free_port()
    instances = ",".join(f"{name}=127.0.0.1:{port}" for name, port in engines)

    cms_engine_args = ["--cms-url", spec.cms_url, "--cms-cluster", spec.cms_cluster] if spec.cms_url else []
    ready: dict[str, Callable[[], bool]] = {}

    def wait_ready(child: Child, condition: Callable[[], bool]) -> None:
        ready[child.name] = condition
        wait_until(condition, spec.start_timeout, child.name, alive=child.exited)

    if spec.separate_engines:
        for name, port in engines:
            sim = group.start(
                f"engine {name}",
                [*py, "sim", "serve", "--ports", str(port), "--model", spec.model, *spec.engine_args],
                log_path=log_dir / f"engine-{name}.log",
            )  # fmt: skip
            wait_ready(sim, _answering(port))
    else:
        sim = group.start(
            "engines",
            [*py, "sim", "serve", "--ports", ",".join(str(p) for _, p in engines), "--model", spec.model,
             *cms_engine_args, *spec.engine_args],
            log_path=log_dir / "engines.log",
        )  # fmt: skip
        wait_ready(sim, _answering(*(port for _, port in engines)))
    fallbacks = spec.destination_fallbacks if spec.gateway == "sidecar" else 0
    eds_path = log_dir / "picked-pool-eds.json" if fallbacks else None
    if eds_path is not None:
        write_eds(eds_path, [("127.0.0.1", port) for _, port in engines])

    if spec.with_scheduler:
        # full mode finds the engines in the CMS; lite mode is told them
        if spec.cms_url:
            view_args = ["--enable-full-mode-scheduling", "--redis-url", spec.cms_url]
            view_args += ["--cms-cluster", spec.cms_cluster]
        elif spec.discovery_url:
            view_args = ["--discovery", spec.discovery_url, "--discovery-interval-seconds", "0.2"]
        else:
            view_args = ["--instances", instances]
        scheduler = group.start(
            "scheduler",
            [*py, "scheduler", "--port", str(scheduler_port), "--session-port", str(session_port), *view_args,
             "--model", spec.model, "--metrics-port", str(metrics_port), "--ui-port", str(ui_port),
             *spec.scheduler_args],
            log_path=log_dir / "scheduler.log",
        )  # fmt: skip
        wait_ready(scheduler, _answering(scheduler_port, session_port, metrics_port, ui_port))

    ext_proc = group.start(
        "ext_proc",
        [*py, "ext-proc", "--port", str(ext_proc_port),
         "--scheduler-address", f"127.0.0.1:{scheduler_port}" if spec.with_scheduler else "",
         "--scheduler-session-address", f"127.0.0.1:{session_port}" if spec.with_scheduler else "",
         *(["--discovery", spec.discovery_url, "--discovery-interval-seconds", "0.2"] if spec.discovery_url
           else ["--instances", instances]),
         "--model", spec.model,
         "--metrics-port", str(ext_proc_metrics_port),
         *(["--destination-fallbacks", str(fallbacks)] if fallbacks else []),
         *(["--response-bodies", _response_bodies(spec)] if _response_bodies(spec) != "count" else []),
         *spec.ext_proc_args],
        log_path=log_dir / "ext_proc.log",
    )  # fmt: skip
    wait_ready(ext_proc, _answering(ext_proc_port, ext_proc_metrics_port))

    bootstrap = _bootstrap(
        spec, listen_port, admin_port, ext_proc_port, [("127.0.0.1", port) for _, port in engines], eds_path
    )
    envoy_service = start_envoy(
        bootstrap, log_dir, admin_port, timeout=spec.start_timeout, die_with_parent=group.die_with_parent
    )
    envoy = envoy_service.child
    assert envoy is not None
    group.children.append(envoy)  # stopped with the rest, in reverse start order
    admin_url = envoy_service.url
    wait_ready(envoy, lambda: envoy_is_live(admin_url) and port_answers(listen_port, spec.listen_host))
    return Stack(
        engines, spec.listen_host, listen_port, admin_port, scheduler_port, metrics_port, ext_proc_port,
        ext_proc_metrics_port, {child.name: child for child in group.children}, ready,
        eds_path=str(eds_path) if eds_path else "", scheduler_ui_port=ui_port,
        response_bodies=_response_bodies(spec),
    )  # fmt: skip


def _response_bodies(spec: StackSpec) -> str:
    if spec.response_bodies:
        return spec.response_bodies
    if spec.gateway != "sidecar":  # only the sidecar sends the ext_proc Envoy's access log
        return "count"
    if spec.cms_url:
        return "count" if spec.response_body_mode else "skip"
    # grpc.aio's server leaks what Envoy's reset of an early-ended stream cuts (the ext_proc refuses it)
    return "count" if "grpcio" in spec.ext_proc_args else "first-token"


def _response_body_mode(spec: StackSpec) -> str:
    if spec.response_body_mode:
        return spec.response_body_mode
    return "NONE" if _response_bodies(spec) in ("skip", "observe") else "STREAMED"


def _bootstrap(
    spec: StackSpec,
    listen_port: int,
    admin_port: int,
    ext_proc_port: int,
    engines: list[tuple[str, int]],
    eds_path: Path | None,
) -> str:
    if spec.gateway != "sidecar":
        return render_gateway(
            spec.gateway,
            listen_host=spec.listen_host,
            listen_port=listen_port,
            ext_proc_ports=[ext_proc_port],
            default_endpoints=engines,
            failure_mode_allow=spec.failure_mode_allow,
        )
    return render_sidecar(
        listen_host=spec.listen_host,
        listen_port=listen_port,
        admin_port=admin_port,
        ext_proc_ports=[ext_proc_port],
        default_endpoints=engines,
        request_body_mode=spec.request_body_mode,
        response_body_mode=_response_body_mode(spec),
        observe_response_bodies=_response_bodies(spec) == "observe",
        release_from_access_log=_response_bodies(spec) == "first-token",
        destination_fallbacks=spec.destination_fallbacks,
        eds_path=eds_path or "",
        client_address=_flow_groups(spec) != "none",
    )


def _flow_groups(spec: StackSpec) -> str:
    """The ext_proc's --flow-groups as the stack passes it (its default, source, when not given)."""
    args = spec.ext_proc_args
    for i, arg in enumerate(args):
        if arg == "--flow-groups" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--flow-groups="):
            return arg.split("=", 1)[1]
    return "source"
