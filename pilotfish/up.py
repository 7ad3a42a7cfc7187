"""`pilotfish up`: the embedded default — simulated engines, scheduler, ext_proc and Envoy on loopback.

Lite mode with static discovery: no Redis, etcd or Kubernetes (`--full` adds a Redis CMS, which
requires a password made for the run and handed to the children in a file, not on a command line). Every
child serves Prometheus metrics on a loopback port of its own, printed at start with its PID. A
child that dies is restarted on the same ports (pilotfish.supervise); one that keeps dying stops
the stack with exit status 1. Every child runs in its own process group and is stopped by PID, in
reverse start order, on Ctrl-C, on SIGTERM, when the supervisor gives up, and after `--demo`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from pilotfish.config import add_struct_arguments, struct_from_args
from pilotfish.procs import Child, ChildGroup, StartError, port_is_free
from pilotfish.security import env_name, write_secret
from pilotfish.supervise import GaveUp, SuperviseConfig, Supervisor


class UpConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engines: Annotated[int, Meta(ge=1, le=64, description="simulated engines to start")] = 2
    host: Annotated[str, Meta(description="address Envoy's listener binds")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535, description="Envoy's listener: where clients send requests")] = 8080
    model: Annotated[str, Meta(description="model name the simulated engines serve")] = "pilotfish-sim"
    demo: Annotated[bool, Meta(description="send a short workload through Envoy, print a table, and exit")] = False
    full: Annotated[
        bool,
        Meta(description="full mode: start a Redis CMS; each engine's llumlet exports its load there and the "
             "scheduler reads it (needs redis-server; Redis requires a password made for the run, kept in "
             "LOG_DIR/redis/password)"),
    ] = False  # fmt: skip
    demo_requests: Annotated[int, Meta(ge=1, description="requests the demo sends")] = 40
    demo_concurrency: Annotated[int, Meta(ge=1, description="requests the demo keeps in flight")] = 8
    log_dir: Annotated[str, Meta(description="where each child's log goes (empty: a new temporary folder)")] = ""
    start_timeout: Annotated[float, Meta(gt=0, description="seconds each child may take to start answering")] = 60.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the embedded default: engines, scheduler, ext_proc and Envoy on loopback",
        description="Start simulated engines, the scheduler (lite mode, static discovery), the ext_proc "
        "and Envoy on loopback, each with its Prometheus metrics on a port of its own. A child that dies is "
        "restarted on the same ports. Ctrl-C stops everything it started.",
    )
    add_struct_arguments(parser, UpConfig)
    add_struct_arguments(parser, SuperviseConfig)
    parser.set_defaults(run=run)


class _Stopped(Exception):
    pass


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped


def run(args: argparse.Namespace) -> int:
    config = struct_from_args(UpConfig, args)
    supervise = struct_from_args(SuperviseConfig, args)
    from pilotfish.envoy_binary import find_envoy_binary
    from pilotfish.services import LOOPBACK, redis_answers_ping, redis_binary, start_redis
    from pilotfish.stack import StackSpec, start_stack

    find_envoy_binary()  # a missing binary fails here, before anything starts
    if config.full:
        redis_binary()
    if not port_is_free(config.port, config.host):
        raise StartError(f"port {config.port} on {config.host} is in use; choose another with --port")

    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="pilotfish-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    group = ChildGroup(die_with_parent=True)  # a SIGKILLed `up` leaves no child holding its ports
    # Handle SIGINT ourselves too: a shell starts background jobs with SIGINT ignored.
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        spec = StackSpec(
            engines=config.engines,
            model=config.model,
            listen_host=config.host,
            listen_port=config.port,
            start_timeout=config.start_timeout,
            scheduler_metrics=True,
            ext_proc_metrics=True,
            scheduler_ui=True,
        )
        ready: dict[str, Callable[[], bool]] = {}
        if config.full:
            # Redis requires a password made for this run; every child finds it through the file
            # PILOTFISH_REDIS_PASSWORD_FILE names (inherited), never on a command line (pilotfish/security.py)
            redis_dir = log_dir / "redis"
            redis_dir.mkdir(parents=True, exist_ok=True)
            password = secrets.token_urlsafe(32)
            password_file = write_secret(redis_dir / "password", password)
            os.environ[env_name("redis_password_file")] = str(password_file)
            redis = start_redis(redis_dir, die_with_parent=True, password_file=password_file)
            assert redis.child is not None
            group.children.append(redis.child)  # stopped last, after everything that uses it
            ready[redis.child.name] = lambda port=redis.port: redis_answers_ping(port, password=password)
            spec.cms_url = redis.url
        stack = start_stack(spec, group, log_dir)
        ready.update(stack.ready)
        base_url = stack.base_url
        if config.demo:
            return _demo(config, base_url)
        print(
            f"Pilotfish is up ({'full' if config.full else 'lite'} mode): {len(stack.engines)} engines, scheduler, "
            f"ext_proc and Envoy (logs in {log_dir}).\n"
            f"  curl {base_url}/v1/completions -H 'content-type: application/json' "
            f'-d \'{{"model": "{config.model}", "prompt": "hello", "max_tokens": 16}}\'\n'
            f"Live page (scheduler): http://{LOOPBACK}:{stack.scheduler_ui_port}/\n"
            f"{_components(stack.metrics_urls(), group.children)}\n"
            f"A child that dies is restarted on the same ports; more than {supervise.max_restarts} restarts of one "
            f"within {supervise.restart_window_seconds:g}s stop everything. Ctrl-C stops everything.",
            flush=True,
        )
        supervisor = Supervisor(supervise, group.respawn, start_timeout=config.start_timeout)  # type: ignore[arg-type]
        for child in group.children:
            supervisor.watch(child, ready[child.name])
        supervisor.run()  # returns only by raising
    except GaveUp as exc:
        print(f"pilotfish up: error: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, _Stopped):
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        group.stop_all()


def _components(metrics: list[tuple[str, str]], children: list[Child]) -> str:
    """The start-up block operators and tests read: each Prometheus endpoint, each child's PID."""
    width = max(len(name) for name, _ in metrics + [(c.name, "") for c in children])
    lines = ["Prometheus metrics:"]
    lines += [f"  {name:<{width}}  {url}" for name, url in metrics]
    lines.append("Processes:")
    lines += [f"  {child.name:<{width}}  pid {child.pid}" for child in children]
    return "\n".join(lines)


def _demo(config: UpConfig, base_url: str) -> int:
    import asyncio

    from pilotfish.demo import format_table, run_workload

    print(f"Sending {config.demo_requests} requests through Envoy at {base_url} ...", flush=True)
    outcomes = asyncio.run(run_workload(base_url, config.model, config.demo_requests, config.demo_concurrency))
    print(format_table(outcomes))
    served = {o.engine for o in outcomes if o.ok}
    failed = sum(not o.ok for o in outcomes)
    if failed or (config.engines > 1 and len(served) < 2):
        print(f"pilotfish up: error: demo saw {failed} failed requests across {len(served)} engines", file=sys.stderr)
        return 1
    return 0
