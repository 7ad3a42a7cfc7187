"""`etcd://` — records under one lease per registry, kept alive every TTL/3; Watch plus refresh.

Layout: key `/<prefix>/discovery/<namespace>/<component>/<instance id>`, value an
`InstanceRecord` (JSON), attached to the registry's lease. A killed writer stops its keepalives,
etcd expires the lease and deletes its keys, and every watcher gets the DELETE.

A keepalive that finds the lease gone (expired during a partition, or an etcd restarted without
its data) grants a new lease and rewrites every ready record. Consumers list, then watch from the
next revision, and re-list every interval as reconciliation. After the watch breaks, an instance
missing from the next list is kept for one TTL so writers can re-register into a restarted etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

from pilotfish.discovery.api import InstanceEvent, ServiceDiscovery, StoreUnavailable
from pilotfish.discovery.backends.store_registry import StoreHandle, StoreRegistry
from pilotfish.discovery.etcd_http import EtcdError, EtcdHttp, unb64
from pilotfish.discovery.records import BadRecordLog, MalformedRecord, decode_record
from pilotfish.discovery.static import Instance
from pilotfish.discovery.view import Emit, View, event_stream

log = logging.getLogger(__name__)


def component_prefix(prefix: str, namespace: str, component: str) -> bytes:
    return f"/{prefix}/discovery/{namespace}/{component}/".encode()


class EtcdRegistry(StoreRegistry):
    def __init__(self, endpoints: list[str], *, prefix: str = "pilotfish", ttl: float = 10.0) -> None:
        super().__init__(ttl)
        self._etcd = EtcdHttp(endpoints)
        self._prefix = prefix
        self._lease = 0
        self._lease_lock = asyncio.Lock()

    def _key(self, handle: StoreHandle) -> bytes:
        return component_prefix(self._prefix, handle.namespace, handle.component) + handle.id.encode()

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if not self._lease:
                # etcd counts whole seconds and enforces its own minimum (about 2 s).
                self._lease = await self._etcd.grant(max(1, math.ceil(self.ttl)))
            return self._lease

    async def write(self, handles: list[StoreHandle]) -> None:
        lease = await self._ensure_lease()
        try:
            await asyncio.gather(*(self._etcd.put(self._key(h), h.record(), lease) for h in handles))
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            # The lease expired under us: start a new one and write everything ready again; if a
            # concurrent write already did, put just these under the new lease.
            if not await self._renew_lease(lease):
                lease = await self._ensure_lease()
                await asyncio.gather(*(self._etcd.put(self._key(h), h.record(), lease) for h in handles))

    async def _renew_lease(self, lost: int) -> bool:
        """Replace the lost lease and rewrite every ready record; False if another caller did."""
        async with self._lease_lock:
            if self._lease != lost:
                return False
            self._lease = 0
        log.warning("discovery lease %x lost; re-registering %d instances", lost, len(self.ready_handles()))
        lease = await self._ensure_lease()
        await asyncio.gather(*(self._etcd.put(self._key(h), h.record(), lease) for h in self.ready_handles()))
        return True

    async def withdraw(self, handle: StoreHandle) -> None:
        await self._etcd.delete(self._key(handle))

    async def heartbeat(self) -> None:
        if not self._lease:
            if self.ready_handles():
                await self.write(self.ready_handles())
            return
        lease = self._lease
        if await self._etcd.keepalive(lease) <= 0:
            await self._renew_lease(lease)

    async def close_store(self) -> None:
        if self._lease:
            with contextlib.suppress(StoreUnavailable):
                await self._etcd.revoke(self._lease)
            self._lease = 0
        await self._etcd.close()


class EtcdDiscovery(ServiceDiscovery):
    def __init__(
        self, endpoints: list[str], *, prefix: str = "pilotfish", ttl: float = 10.0, interval: float = 1.0
    ) -> None:
        self._etcd = EtcdHttp(endpoints)
        self._prefix = prefix
        self._ttl = ttl
        self._interval = interval
        self._bad = BadRecordLog(log)

    def _decode(self, key: bytes, value: bytes, namespace: str, component: str) -> Instance | None:
        prefix = component_prefix(self._prefix, namespace, component)
        instance_id = key[len(prefix) :].decode(errors="replace")
        try:
            record = decode_record(value, namespace, component, instance_id)
        except MalformedRecord as exc:
            self._bad.skip(key.decode(errors="replace"), value, str(exc))
            return None
        return record.to_instance() if record.ready else None

    async def _list(self, namespace: str, component: str) -> tuple[int, dict[str, Instance]]:
        revision, kvs = await self._etcd.range_prefix(component_prefix(self._prefix, namespace, component))
        found = {}
        for key, value in kvs:
            if (instance := self._decode(key, value, namespace, component)) is not None:
                found[instance.instance_id] = instance
        return revision, found

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        _, found = await self._list(namespace, component)
        return [found[k] for k in sorted(found)]

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        prefix = component_prefix(self._prefix, namespace, component)

        async def produce(emit: Emit) -> None:
            view = View()
            applied = 0  # newest revision applied from the watch stream
            grace_until = 0.0  # monotonic: until then an instance missing from a list is kept
            failing = False

            def keep(_instance_id: str) -> bool:
                return time.monotonic() < grace_until

            async def refresh_every_interval() -> None:
                while True:
                    await asyncio.sleep(self._interval)
                    with contextlib.suppress(StoreUnavailable):
                        revision, found = await self._list(namespace, component)
                        if revision >= applied:  # an older list must not undo newer watch events
                            emit(view.replace(found, keep))

            while True:
                refresher: asyncio.Task[None] | None = None
                compacted = False
                try:
                    # Applied whatever its revision: a restarted etcd counts revisions from 1 again.
                    revision, found = await self._list(namespace, component)
                    emit(view.replace(found, keep))
                    if failing:
                        log.info("etcd discovery recovered")
                        failing = False
                    applied = revision
                    refresher = asyncio.create_task(refresh_every_interval())
                    async for result in self._etcd.watch(prefix, revision + 1):
                        if result.get("canceled") or result.get("compact_revision"):
                            compacted = True  # etcd compacted past our revision: list again
                            break
                        for event in result.get("events", []):
                            kv = event.get("kv", {})
                            key = unb64(kv.get("key"))
                            instance_id = key[len(prefix) :].decode(errors="replace")
                            applied = max(applied, int(kv.get("mod_revision", 0)))
                            if event.get("type") == "DELETE":
                                emit(view.remove(instance_id))
                                continue
                            instance = self._decode(key, unb64(kv.get("value")), namespace, component)
                            emit(view.remove(instance_id) if instance is None else view.upsert(instance))
                    if not compacted:
                        # The stream ended without an error (etcd going away): treat it as a break.
                        raise EtcdError("etcd watch stream closed")
                except StoreUnavailable as exc:
                    if not failing:
                        log.warning("etcd discovery watch broke, keeping %d instances: %s", len(view.instances), exc)
                    failing = True
                    grace_until = time.monotonic() + self._ttl
                    await asyncio.sleep(self._interval)
                finally:
                    if refresher is not None:
                        refresher.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await refresher

        return event_stream(produce)

    async def close(self) -> None:
        await self._etcd.close()
