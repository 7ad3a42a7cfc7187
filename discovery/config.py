"""Every discovery and sidecar setting and its default, once; flags, YAML keys and README tables
derive from these structs. Components that discover instances subclass `DiscoveryConfig` so the
flags are the same everywhere."""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.config import ConfigError
from pilotfish.security import SecurityConfig


class DiscoveryConfig(SecurityConfig, kw_only=True, forbid_unknown_fields=True):
    """Discovery's flags, after the security flags every component shares (pilotfish/security.py)."""

    discovery: Annotated[
        str,
        Meta(description="where instances are registered and found: static:[LIST], file:PATH, "
             "redis://HOST:PORT/DB, etcd://HOST:PORT[,HOST:PORT], k8s:[?OPTIONS] (see discovery/README.md)"),
    ] = "static:"  # fmt: skip
    discovery_namespace: Annotated[
        str, Meta(min_length=1, description="namespace instances register under and are discovered in")
    ] = "pilotfish"
    discovery_component: Annotated[
        str, Meta(min_length=1, description="component (role) of the instances, e.g. engine, prefill, decode")
    ] = "engine"
    discovery_ttl_seconds: Annotated[
        float,
        Meta(gt=0, description="an instance whose writer stopped heartbeating disappears after this long "
             "(Redis: record age; etcd: lease TTL, whole seconds, at least 2); writers heartbeat every TTL/3"),
    ] = 10.0  # fmt: skip
    discovery_interval_seconds: Annotated[
        float,
        Meta(gt=0, description="consumers' cadence: Redis poll, etcd full refresh, file re-read, retry after errors"),
    ] = 1.0


class SidecarConfig(DiscoveryConfig, kw_only=True, forbid_unknown_fields=True):
    engines: Annotated[
        list[str],
        Meta(description="local engine endpoints to health-check: host:port or id=host:port "
             "(id defaults to ADVERTISE_HOST:port)"),
    ] = msgspec.field(default_factory=list)  # fmt: skip
    data_parallel_size: Annotated[
        int, Meta(ge=1, description="data-parallel ranks per engine: rank r serves on port+r and is its own instance")
    ] = 1
    advertise_host: Annotated[
        str, Meta(description="address registered for consumers to route to (empty: the engine's host)")
    ] = ""
    health_path: Annotated[str, Meta(description="HTTP path that answers 200 while an engine is healthy")] = "/health"
    health_timeout_seconds: Annotated[
        float, Meta(gt=0, description="a health check not answered within this counts as a failure")
    ] = 2.0
    check_interval_seconds: Annotated[float, Meta(gt=0, description="time between health-check cycles")] = 1.0
    failure_threshold: Annotated[
        int, Meta(ge=1, description="consecutive failed checks before a registered instance is removed")
    ] = 3
    success_threshold: Annotated[
        int, Meta(ge=1, description="consecutive passed checks before an instance is registered")
    ] = 1
    metadata: Annotated[
        str, Meta(description='JSON object added to every instance\'s metadata (e.g. {"model": "llama-3-8b"})')
    ] = ""


def parse_metadata(config: SidecarConfig) -> dict[str, Any]:
    if not config.metadata.strip():
        return {}
    try:
        data = json.loads(config.metadata)
    except ValueError as exc:
        raise ConfigError(f"--metadata: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("--metadata: must be a JSON object")
    return data
