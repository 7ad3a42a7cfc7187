"""The discovery sidecar: health-check the local engines, register the healthy, remove the rest.

Each cycle checks every endpoint (one per data-parallel rank) concurrently. An endpoint that
passes `success_threshold` checks in a row is set ready; one that fails `failure_threshold` in a
row is set not ready, which removes it from every consumer's view at once. The registry
heartbeats on its own (every TTL/3), so a killed sidecar's instances expire within the TTL; a
stopped one (SIGTERM) withdraws them before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import aiohttp

from pilotfish.config import ConfigError
from pilotfish.discovery.api import InstanceHandle, ServiceRegistry, StoreUnavailable
from pilotfish.discovery.backends.k8s_registry import K8sRegistry
from pilotfish.discovery.config import SidecarConfig, parse_metadata
from pilotfish.discovery.health import Endpoint, HealthState, check
from pilotfish.discovery.static import parse_instance
from pilotfish.discovery.urls import open_registry, redis_options

log = logging.getLogger(__name__)


def endpoints_from_config(config: SidecarConfig) -> list[Endpoint]:
    """Every engine rank to check; ConfigError names a bad --engines entry."""
    if not config.engines:
        raise ConfigError("--engines: name at least one local engine endpoint (host:port)")
    endpoints: list[Endpoint] = []
    for spec in config.engines:
        try:
            engine = parse_instance(spec)
        except ValueError as exc:
            raise ConfigError(f"--engines: {exc}") from None
        named = "=" in spec
        host = config.advertise_host or engine.host
        for rank in range(config.data_parallel_size):
            port = engine.port + rank
            if port > 65535:
                raise ConfigError(f"--engines: {spec!r} rank {rank} would use port {port}")
            if named:
                instance_id = engine.instance_id if config.data_parallel_size == 1 else f"{engine.instance_id}-dp{rank}"
            else:
                instance_id = f"{host}:{port}"
            shown = f"[{engine.host}]" if ":" in engine.host else engine.host
            url = f"http://{shown}:{port}"
            path = "/" + config.health_path.lstrip("/")
            endpoints.append(Endpoint(instance_id, url, url + path, host, port, rank))
    ids = [e.instance_id for e in endpoints]
    if len(set(ids)) != len(ids):
        raise ConfigError("--engines: two endpoints would register the same instance id")
    return endpoints


class Sidecar:
    def __init__(self, config: SidecarConfig, registry: ServiceRegistry, endpoints: list[Endpoint]) -> None:
        self.config = config
        self.registry = registry
        self.endpoints = endpoints
        self.handles: dict[str, InstanceHandle] = {}
        self.health = {e.instance_id: HealthState() for e in endpoints}
        self._extra = parse_metadata(config)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if isinstance(self.registry, K8sRegistry) and len(self.endpoints) > 1:
            raise ConfigError("--discovery k8s: one pod is one instance; run one engine endpoint per pod")
        self._session = aiohttp.ClientSession(trust_env=False)
        for e in self.endpoints:
            handle = await self.registry.register_instance(
                self.config.discovery_namespace,
                self.config.discovery_component,
                instance_id=None if isinstance(self.registry, K8sRegistry) else e.instance_id,
                host=e.host,
                port=e.port,
            )
            metadata: dict[str, Any] = {"data_parallel_rank": e.rank, "engine_url": e.engine_url, **self._extra}
            await handle.set_metadata(metadata)
            self.handles[e.instance_id] = handle

    async def cycle(self) -> None:
        """One round: check every endpoint, then act on the transitions."""
        assert self._session is not None
        timeout = self.config.health_timeout_seconds
        results = await asyncio.gather(*(check(self._session, e.check_url, timeout) for e in self.endpoints))
        for endpoint, healthy in zip(self.endpoints, results, strict=True):
            state = self.health[endpoint.instance_id]
            action = state.record(healthy, self.config.success_threshold, self.config.failure_threshold)
            if action is None:
                continue
            state.registered = action
            log.info(
                "engine %s %s: %s", endpoint.instance_id, "healthy" if action else "unhealthy",
                "registering" if action else f"removing after {state.failures} failed checks",
            )  # fmt: skip
            try:
                await self.handles[endpoint.instance_id].set_ready(action)
            except StoreUnavailable as exc:
                # The handle keeps the wanted state; the registry's heartbeat writes it once the store is back.
                log.warning("engine %s: discovery store unavailable, will retry: %s", endpoint.instance_id, exc)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        log.info(
            "sidecar checking %d engine endpoints every %.1fs, registering to %s as %s/%s",
            len(self.endpoints), self.config.check_interval_seconds, self.config.discovery,
            self.config.discovery_namespace, self.config.discovery_component,
        )  # fmt: skip
        try:
            while not stop.is_set():
                await self.cycle()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.check_interval_seconds)
        finally:
            await self.close()

    async def close(self) -> None:
        await self.registry.close()  # withdraws every registered instance
        if self._session is not None:
            await self._session.close()


async def run_sidecar(config: SidecarConfig) -> int:
    scheme = config.discovery.partition(":")[0].lower()
    if scheme in ("static", "file"):
        raise ConfigError(f"--discovery: the sidecar registers to a store: redis://, etcd:// or k8s:, not {scheme}:")
    endpoints = endpoints_from_config(config)
    registry = open_registry(config.discovery, ttl=config.discovery_ttl_seconds, redis_options=redis_options(config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Sidecar(config, registry, endpoints).run(stop)
    return 0
