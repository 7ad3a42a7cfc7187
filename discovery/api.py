"""The contracts every backend satisfies: ServiceRegistry (writers) and ServiceDiscovery (readers).

The shape follows `../shared/spec/k8s-endpoint-discovery.md`: a registry hands out one
`InstanceHandle` per instance; discovery lists instances and streams added/removed events.
Everything is asyncio.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pilotfish.discovery.static import Instance


class StoreUnavailable(ConnectionError):
    """The backing store (Redis, etcd, the Kubernetes API) did not answer; callers may retry."""


class InstanceStatus(enum.Enum):
    READY = "ready"
    NOT_READY = "not_ready"

    @classmethod
    def parse(cls, value: InstanceStatus | str | bool) -> InstanceStatus:
        """Accepts the enum, True/False, or "ready"/"not_ready" (a string is the usual form)."""
        if isinstance(value, InstanceStatus):
            return value
        if isinstance(value, bool):
            return cls.READY if value else cls.NOT_READY
        text = str(value).strip().lower().replace("-", "_")
        for status in cls:
            if status.value == text:
                return status
        raise ValueError(f"instance status {value!r} is not 'ready' or 'not_ready'")


@dataclass(frozen=True, slots=True)
class InstanceAddedEvent:
    """The instance is ready for traffic; an Added for an id already known replaces it (new address
    or metadata)."""

    instance: Instance


@dataclass(frozen=True, slots=True)
class InstanceRemovedEvent:
    """The instance left, turned not ready, or expired."""

    instance: Instance


InstanceEvent = InstanceAddedEvent | InstanceRemovedEvent


class InstanceHandle(ABC):
    """One registered instance, owned by the process that registered it."""

    @abstractmethod
    def instance_id(self) -> str:
        """The unique id of this instance in its registry."""

    @abstractmethod
    async def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Replace the instance's metadata (a JSON-serialisable mapping)."""

    @abstractmethod
    async def set_ready(self, status: InstanceStatus | str | bool) -> None:
        """Mark the instance ready (discoverable) or not ready (removed from every view)."""

    @abstractmethod
    async def deregister(self) -> None:
        """Remove the instance now and stop heartbeating it; the handle is spent."""


class ServiceRegistry(ABC):
    """The writer side. `close()` deregisters every handle it gave out."""

    @abstractmethod
    async def register_instance(
        self,
        namespace: str,
        component: str,
        *,
        instance_id: str | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> InstanceHandle:
        """Register an instance, not yet ready. Store backends need `host` and `port` (the
        address consumers route to); `instance_id` defaults to `host:port` there, and to the
        pod name on Kubernetes."""

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> ServiceRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ServiceDiscovery(ABC):
    """The reader side."""

    @abstractmethod
    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        """The instances ready now, sorted by id."""

    @abstractmethod
    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        """Added for every instance ready now, then Added/Removed as the set changes; runs until
        closed (`contextlib.aclosing`) and rides out store outages, keeping its last view."""

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> ServiceDiscovery:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
