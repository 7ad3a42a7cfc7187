"""Follow a discovery backend: call `added`/`removed` as instances turn ready or leave.

The gateway (its fallback list, a colocated core) and the lite-mode scheduler both keep their
instance set equal to what discovery reports, through this one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pilotfish.discovery.api import InstanceAddedEvent, ServiceDiscovery
from pilotfish.discovery.config import DiscoveryConfig
from pilotfish.discovery.static import Instance
from pilotfish.discovery.urls import open_discovery, redis_options

log = logging.getLogger(__name__)


def discovery_configured(config: DiscoveryConfig) -> bool:
    """True when --discovery names a backend beyond the empty static default."""
    return config.discovery.strip() not in ("", "static:")


SYNC_RETRY_MAX_SECONDS = 2.0  # the first listing is retried with backoff up to this period


async def follow(
    config: DiscoveryConfig,
    added: Callable[[Instance], None],
    removed: Callable[[str], None],
    synced: Callable[[], None] | None = None,
) -> None:
    """Runs until cancelled; the backend rides out store outages, keeping its last view.

    `synced` is called once, when the picture is whole for the first time: the store answered a
    listing and the watch has reported every instance that listing held (a gateway reports ready
    only then, so it never answers 503 for a fleet it has not read yet).
    """
    discovery = open_discovery(
        config.discovery,
        ttl=config.discovery_ttl_seconds,
        interval=config.discovery_interval_seconds,
        redis_options=redis_options(config),
    )
    async with discovery:
        waiting = await _first_listing(discovery, config) if synced is not None else set()
        if synced is not None and not waiting:
            synced()
        watch = discovery.watch(config.discovery_namespace, config.discovery_component)
        async with contextlib.aclosing(watch) as events:
            async for event in events:
                if isinstance(event, InstanceAddedEvent):
                    added(event.instance)
                else:
                    removed(event.instance.instance_id)
                if waiting:
                    waiting.discard(event.instance.instance_id)
                    if not waiting and synced is not None:
                        synced()


async def _first_listing(discovery: ServiceDiscovery, config: DiscoveryConfig) -> set[str]:
    """The ids the store lists now, retried with backoff until it answers."""
    delay = 0.05
    while True:
        try:
            listed = await discovery.list_instances(config.discovery_namespace, config.discovery_component)
        except Exception as exc:  # a store outage at start: not ready yet, try again
            log.info("discovery not answering yet (%s); retrying in %.2fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, SYNC_RETRY_MAX_SECONDS)
            continue
        return {i.instance_id for i in listed}
