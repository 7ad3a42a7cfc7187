"""The writer side shared by the Redis and etcd backends: handles hold the desired state, the
registry writes it and heartbeats it in one background loop.

A write that fails raises StoreUnavailable but the desired state stays, so the next heartbeat
writes it again: an instance set ready during an outage appears once the store is back, and a
store that restarted empty is refilled within one heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import msgspec

from pilotfish.discovery.api import InstanceHandle, InstanceStatus, ServiceRegistry, StoreUnavailable
from pilotfish.discovery.records import MAX_RECORD_BYTES, InstanceRecord, encode_record

log = logging.getLogger(__name__)


class StoreHandle(InstanceHandle):
    def __init__(
        self, registry: StoreRegistry, namespace: str, component: str, instance_id: str, host: str, port: int
    ) -> None:
        self._registry = registry
        self.namespace, self.component, self.id = namespace, component, instance_id
        self.host, self.port = host, port
        self.metadata: dict[str, Any] = {}
        self.ready = False
        self._update_id = 0

    def instance_id(self) -> str:
        return self.id

    def record(self, ready: bool | None = None) -> bytes:
        """The record to write now: a fresh timestamp and the next update id."""
        self._update_id += 1
        return encode_record(
            InstanceRecord(
                instance_id=self.id,
                namespace=self.namespace,
                component=self.component,
                host=self.host,
                port=self.port,
                timestamp_ms=int(time.time() * 1000),
                update_id=self._update_id,
                ready=self.ready if ready is None else ready,
                metadata=self.metadata,
            )
        )

    async def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        data = dict(metadata)
        try:
            size = len(msgspec.json.encode(data))
        except (TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"metadata is not JSON-serialisable: {exc}") from None
        if size > MAX_RECORD_BYTES // 2:
            raise ValueError(f"metadata is {size} bytes encoded; at most {MAX_RECORD_BYTES // 2}")
        self.metadata = data
        if self.ready:
            await self._registry.write([self])

    async def set_ready(self, status: InstanceStatus | str | bool) -> None:
        ready = InstanceStatus.parse(status) is InstanceStatus.READY
        was, self.ready = self.ready, ready
        if ready:
            self._registry.pending_withdrawals.discard(self)
            await self._registry.write([self])
        elif was:
            await self._registry.withdraw_or_retry(self)

    async def deregister(self) -> None:
        was, self.ready = self.ready, False
        self._registry.forget(self)
        if was:
            await self._registry.withdraw_or_retry(self)


class StoreRegistry(ServiceRegistry):
    def __init__(self, ttl: float, heartbeat_interval: float | None = None) -> None:
        self.ttl = ttl
        self.heartbeat_interval = heartbeat_interval or ttl / 3
        self.handles: dict[tuple[str, str, str], StoreHandle] = {}
        # Withdrawals that failed: retried every heartbeat, or an etcd key would live on under a
        # lease we keep alive.
        self.pending_withdrawals: set[StoreHandle] = set()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._failing = False

    async def register_instance(
        self,
        namespace: str,
        component: str,
        *,
        instance_id: str | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> InstanceHandle:
        if not namespace or not component:
            raise ValueError("namespace and component must not be empty")
        if not host or not port or not 0 < port < 65536:
            raise ValueError("registration needs the host and port consumers route to")
        key = (namespace, component, instance_id or f"{host}:{port}")
        if key in self.handles:
            raise ValueError(f"instance {key[2]!r} is already registered in {namespace}/{component}")
        handle = StoreHandle(self, *key, host, port)
        self.handles[key] = handle
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        return handle

    def forget(self, handle: StoreHandle) -> None:
        self.handles.pop((handle.namespace, handle.component, handle.id), None)

    def ready_handles(self) -> list[StoreHandle]:
        return [h for h in self.handles.values() if h.ready]

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                for handle in list(self.pending_withdrawals):
                    await self.withdraw(handle)
                    self.pending_withdrawals.discard(handle)
                await self.heartbeat()
            except StoreUnavailable as exc:
                if not self._failing:
                    log.warning("discovery heartbeat failed, retrying every %.1fs: %s", self.heartbeat_interval, exc)
                self._failing = True
                continue
            if self._failing:
                log.info("discovery heartbeat recovered")
            self._failing = False

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        for handle in list(self.handles.values()):
            try:
                await handle.deregister()
            except StoreUnavailable as exc:
                log.warning("could not withdraw %s on close (it expires within the TTL): %s", handle.id, exc)
        await self.close_store()

    async def withdraw_or_retry(self, handle: StoreHandle) -> None:
        try:
            await self.withdraw(handle)
        except StoreUnavailable:
            self.pending_withdrawals.add(handle)
            raise
        self.pending_withdrawals.discard(handle)

    @abstractmethod
    async def write(self, handles: list[StoreHandle]) -> None:
        """Write these (ready) handles' records now; StoreUnavailable on failure."""

    @abstractmethod
    async def withdraw(self, handle: StoreHandle) -> None:
        """Remove the handle's record now, so consumers drop it without waiting for the TTL."""

    @abstractmethod
    async def heartbeat(self) -> None:
        """Keep every ready handle alive for another TTL."""

    @abstractmethod
    async def close_store(self) -> None: ...
