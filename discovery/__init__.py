"""Service discovery: ServiceRegistry/ServiceDiscovery over static, file, Redis, etcd and Kubernetes.

    from pilotfish.discovery import open_discovery, open_registry

    registry = open_registry("redis://127.0.0.1:6379/0")
    handle = await registry.register_instance("pilotfish", "engine", host="10.0.0.5", port=8000)
    await handle.set_metadata({"model": "llama-3-8b"})
    await handle.set_ready("ready")

    discovery = open_discovery("redis://127.0.0.1:6379/0")
    async with contextlib.aclosing(discovery.watch("pilotfish", "engine")) as events:
        async for event in events: ...   # InstanceAddedEvent / InstanceRemovedEvent

See README.md beside this file for what each backend guarantees.
"""

from pilotfish.discovery.api import (
    InstanceAddedEvent,
    InstanceEvent,
    InstanceHandle,
    InstanceRemovedEvent,
    InstanceStatus,
    ServiceDiscovery,
    ServiceRegistry,
    StoreUnavailable,
)
from pilotfish.discovery.static import Instance, MetadataUnavailable, parse_instance, parse_instances
from pilotfish.discovery.urls import open_discovery, open_registry

__all__ = [
    "Instance",
    "InstanceAddedEvent",
    "InstanceEvent",
    "InstanceHandle",
    "InstanceRemovedEvent",
    "InstanceStatus",
    "MetadataUnavailable",
    "ServiceDiscovery",
    "ServiceRegistry",
    "StoreUnavailable",
    "open_discovery",
    "open_registry",
    "parse_instance",
    "parse_instances",
]
