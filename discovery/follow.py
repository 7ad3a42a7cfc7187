"""Follow a discovery backend: call `added`/`removed` as instances turn ready or leave.

The gateway (its fallback list, a colocated core) and the lite-mode scheduler both keep their
instance set equal to what discovery reports, through this one loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from pilotfish.discovery.api import InstanceAddedEvent
from pilotfish.discovery.config import DiscoveryConfig
from pilotfish.discovery.static import Instance
from pilotfish.discovery.urls import open_discovery


def discovery_configured(config: DiscoveryConfig) -> bool:
    """True when --discovery names a backend beyond the empty static default."""
    return config.discovery.strip() not in ("", "static:")


async def follow(
    config: DiscoveryConfig, added: Callable[[Instance], None], removed: Callable[[str], None]
) -> None:
    """Runs until cancelled; the backend rides out store outages, keeping its last view."""
    discovery = open_discovery(
        config.discovery, ttl=config.discovery_ttl_seconds, interval=config.discovery_interval_seconds
    )
    async with (
        discovery,
        contextlib.aclosing(discovery.watch(config.discovery_namespace, config.discovery_component)) as events,
    ):
        async for event in events:
            if isinstance(event, InstanceAddedEvent):
                added(event.instance)
            else:
                removed(event.instance.instance_id)
