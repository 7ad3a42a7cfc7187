"""Every scheduler setting and its default, once; flags, YAML keys and the README table derive from it."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pilotfish.config import ConfigError


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    scheduling_policy: Annotated[
        str, Meta(description="built-in policy: load-balance, or round-robin (a baseline)")
    ] = "load-balance"
    enable_full_mode_scheduling: Annotated[
        bool,
        Meta(description="full mode (CMS view from the llumlets); not implemented yet, lite mode (LRS) only"),
    ] = False
    dispatch_load_metric: Annotated[
        str, Meta(description="load metric the load-balance policy ranks by; lite mode: num_requests or num_tokens")
    ] = "num_requests"
    dispatch_load_threshold: Annotated[
        float | None,
        Meta(
            description="block instances whose load metric exceeds this; "
            "if all are blocked the fallback pass ignores it (unset = no threshold)"
        ),
    ] = None
    dispatch_top_k: Annotated[
        int, Meta(ge=1, description="pick at random among the K least-loaded instances (1 = always the least)")
    ] = 1
    fallback_count: Annotated[
        int, Meta(ge=0, description="next-best instances returned after the target, for the gateway's retries")
    ] = 2
    instances: Annotated[
        list[str],
        Meta(description="static discovery: engines as host:port or id=host:port (id defaults to host:port)"),
    ] = msgspec.field(default_factory=list)
    model: Annotated[
        list[str],
        Meta(description="served model names; other models get NOT_FOUND (empty = accept any model)"),
    ] = msgspec.field(default_factory=list)
    host: Annotated[str, Meta(description="address the gRPC and metrics servers listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="gRPC port (0 = any free port)")] = 50051
    metrics_port: Annotated[int, Meta(ge=0, le=65535, description="Prometheus /metrics port (0 = off)")] = 0
    request_local_account_staleness_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="drop a held request with no Schedule or Report for this long, "
            "so a lost Release never leaks load",
        ),
    ] = 300.0


def parse_instance(text: str) -> tuple[str, str]:
    """`host:port` or `id=host:port` -> (instance id, address); raises ConfigError naming the flag."""
    instance_id, sep, address = text.strip().rpartition("=")
    if not sep:
        instance_id, address = "", instance_id + address
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--instances: {text!r} is not host:port or id=host:port")
    if sep and not instance_id:
        raise ConfigError(f"--instances: {text!r} has an empty instance id")
    return instance_id or address, address


def validate(config: SchedulerConfig) -> list[tuple[str, str]]:
    """Checks msgspec cannot express; returns the parsed static instances as (id, address)."""
    if config.enable_full_mode_scheduling:
        raise ConfigError(
            "--enable-full-mode-scheduling: full mode is not implemented yet; "
            "run lite mode (--no-enable-full-mode-scheduling)"
        )
    parsed = [parse_instance(text) for text in config.instances]
    seen: set[str] = set()
    for instance_id, _ in parsed:
        if instance_id in seen:
            raise ConfigError(f"--instances: instance id {instance_id!r} appears twice")
        seen.add(instance_id)
    if config.metrics_port and config.metrics_port == config.port:
        raise ConfigError(f"--metrics-port: {config.metrics_port} is also the gRPC --port")
    return parsed
