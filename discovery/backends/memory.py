"""`static:` — a fixed list (the embedded default) plus instances registered in this process.

The same object is registry and discovery, so a single process (tests, `pilotfish up`) can
register and watch without any store. Static instances carry no namespace/component and so
answer every query; registered ones answer their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pilotfish.discovery.api import (
    InstanceEvent,
    InstanceHandle,
    InstanceStatus,
    ServiceDiscovery,
    ServiceRegistry,
)
from pilotfish.discovery.static import Instance
from pilotfish.discovery.view import Emit, View, event_stream


def matches(instance: Instance, namespace: str, component: str) -> bool:
    return instance.namespace in ("", namespace) and instance.component in ("", component)


class _MemoryHandle(InstanceHandle):
    def __init__(self, backend: MemoryBackend, instance: Instance) -> None:
        self._backend = backend
        self._instance = instance
        self._metadata: dict[str, Any] = {}
        self._ready = False

    def instance_id(self) -> str:
        return self._instance.instance_id

    def _current(self) -> Instance:
        i = self._instance
        return Instance(i.instance_id, i.host, i.port, i.namespace, i.component, metadata_snapshot=self._metadata)

    async def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self._metadata = dict(metadata)
        if self._ready:
            self._backend._put(self._current())

    async def set_ready(self, status: InstanceStatus | str | bool) -> None:
        self._ready = InstanceStatus.parse(status) is InstanceStatus.READY
        if self._ready:
            self._backend._put(self._current())
        else:
            self._backend._drop(self._instance)

    async def deregister(self) -> None:
        self._ready = False
        self._backend._drop(self._instance)
        self._backend._handles.discard(self)


class MemoryBackend(ServiceRegistry, ServiceDiscovery):
    def __init__(self, static: list[Instance] | None = None) -> None:
        self._static = list(static or [])
        self._registered: dict[tuple[str, str, str], Instance] = {}
        self._handles: set[_MemoryHandle] = set()
        self._changed = asyncio.Event()
        self._version = 0

    # -- registry ----------------------------------------------------------------------------

    async def register_instance(
        self,
        namespace: str,
        component: str,
        *,
        instance_id: str | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> InstanceHandle:
        if not host or not port:
            raise ValueError("static: registration needs host and port")
        handle = _MemoryHandle(self, Instance(instance_id or f"{host}:{port}", host, port, namespace, component))
        self._handles.add(handle)
        return handle

    def _put(self, instance: Instance) -> None:
        self._registered[(instance.namespace, instance.component, instance.instance_id)] = instance
        self._bump()

    def _drop(self, instance: Instance) -> None:
        if self._registered.pop((instance.namespace, instance.component, instance.instance_id), None):
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        # Wake every watcher at once; each re-reads the (small) set and diffs it.
        self._changed.set()
        self._changed = asyncio.Event()

    # -- discovery ---------------------------------------------------------------------------

    def _snapshot(self, namespace: str, component: str) -> dict[str, Instance]:
        found = {i.instance_id: i for i in self._static if matches(i, namespace, component)}
        for (ns, comp, instance_id), inst in self._registered.items():
            if (ns, comp) == (namespace, component):
                found[instance_id] = inst
        return found

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        snapshot = self._snapshot(namespace, component)
        return [snapshot[k] for k in sorted(snapshot)]

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        async def produce(emit: Emit) -> None:
            view = View()
            while True:
                changed = self._changed
                emit(view.replace(self._snapshot(namespace, component)))
                await changed.wait()

        return event_stream(produce)

    async def close(self) -> None:
        for handle in list(self._handles):
            await handle.deregister()
