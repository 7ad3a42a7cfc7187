"""`redis://` — records with an embedded timestamp in one hash per (namespace, component).

Layout: hash `<prefix>:discovery:<namespace>:<component>`, field = instance id, value = an
`InstanceRecord` (JSON). Writers rewrite their records every TTL/3; `ready=false` is a tombstone
written on purpose. Consumers poll the hash every interval and drop records older than the TTL,
deleting them compare-and-delete so a fresh write is never lost.

Restart: an instance missing from the hash (a restarted, empty Redis) is kept until its last
timestamp plus the TTL, and for one TTL after the store comes back, so writers have a full TTL to
re-register before anyone drops them. Only a tombstone or a stale record removes at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pilotfish.discovery.api import InstanceEvent, ServiceDiscovery, StoreUnavailable
from pilotfish.discovery.backends.store_registry import StoreHandle, StoreRegistry
from pilotfish.discovery.records import BadRecordLog, InstanceRecord, MalformedRecord, decode_record
from pilotfish.discovery.static import Instance
from pilotfish.discovery.view import Emit, View, event_stream

log = logging.getLogger(__name__)

_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# Delete a field only if it still holds the value we judged stale.
_DELETE_IF_UNCHANGED = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def hash_key(prefix: str, namespace: str, component: str) -> str:
    return f"{prefix}:discovery:{namespace}:{component}"


def connect(url: str, options: dict[str, Any] | None = None) -> aioredis.Redis:
    """`options`: the password and rediss:// files (pilotfish/security.py's `redis_options`)."""
    # Timeouts bound a hung call; redis-py's default retry reconnects after a server restart.
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0, **(options or {}))


class RedisRegistry(StoreRegistry):
    def __init__(
        self, url: str, *, prefix: str = "pilotfish", ttl: float = 10.0, redis_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(ttl)
        self._redis = connect(url, redis_options)
        self._prefix = prefix

    def _key(self, handle: StoreHandle) -> str:
        return hash_key(self._prefix, handle.namespace, handle.component)

    async def write(self, handles: list[StoreHandle]) -> None:
        if not handles:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for handle in handles:
                    pipe.hset(self._key(handle), handle.id, handle.record())
                await pipe.execute()
        except _ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from None

    async def withdraw(self, handle: StoreHandle) -> None:
        try:
            await self._redis.hset(self._key(handle), handle.id, handle.record(ready=False))
        except _ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from None

    async def heartbeat(self) -> None:
        await self.write(self.ready_handles())

    async def close_store(self) -> None:
        await self._redis.aclose()


class _Poll:
    """One HGETALL, sorted into live instances, tombstones and stale records."""

    def __init__(self) -> None:
        self.live: dict[str, InstanceRecord] = {}
        self.tombstones: set[str] = set()
        self.stale: set[str] = set()


class RedisDiscovery(ServiceDiscovery):
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "pilotfish",
        ttl: float = 10.0,
        interval: float = 1.0,
        redis_options: dict[str, Any] | None = None,
    ) -> None:
        self._redis = connect(url, redis_options)
        self._prefix = prefix
        self._ttl_ms = ttl * 1000
        self._ttl = ttl
        self._interval = interval
        self._bad = BadRecordLog(log)
        self._gc_script = self._redis.register_script(_DELETE_IF_UNCHANGED)

    async def _poll(self, namespace: str, component: str) -> _Poll:
        key = hash_key(self._prefix, namespace, component)
        try:
            raw = await self._redis.hgetall(key)
        except _ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from None
        now_ms = time.time() * 1000
        poll = _Poll()
        expired: list[tuple[bytes, bytes]] = []
        for field, value in raw.items():
            instance_id = field.decode(errors="replace")
            try:
                record = decode_record(value, namespace, component, instance_id)
            except MalformedRecord as exc:
                self._bad.skip(f"{key} {instance_id!r}", value, str(exc))
                continue
            if now_ms - record.timestamp_ms > self._ttl_ms:
                poll.stale.add(instance_id)
                expired.append((field, value))
            elif not record.ready:
                poll.tombstones.add(instance_id)
            else:
                poll.live[instance_id] = record
        for field, value in expired:
            try:
                await self._gc_script(keys=[key], args=[field, value])
            except _ERRORS:
                break  # the next poll tries again
        return poll

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        poll = await self._poll(namespace, component)
        return [poll.live[k].to_instance() for k in sorted(poll.live)]

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        async def produce(emit: Emit) -> None:
            view = View()
            last_ms: dict[str, int] = {}  # newest timestamp seen per instance
            grace_until = 0.0  # monotonic: until then a missing instance is kept (store came back)
            failing = False
            while True:
                try:
                    poll = await self._poll(namespace, component)
                except StoreUnavailable as exc:
                    if not failing:
                        log.warning("redis discovery poll failed, keeping %d instances: %s", len(view.instances), exc)
                    failing = True
                    await asyncio.sleep(self._interval)
                    continue
                if failing:
                    log.info("redis discovery poll recovered")
                    grace_until = time.monotonic() + self._ttl
                    failing = False
                now_ms = time.time() * 1000
                for instance_id, record in poll.live.items():
                    last_ms[instance_id] = max(record.timestamp_ms, last_ms.get(instance_id, 0))

                def keep(
                    instance_id: str, poll: _Poll = poll, now_ms: float = now_ms, grace: float = grace_until
                ) -> bool:
                    if instance_id in poll.tombstones or instance_id in poll.stale:
                        return False
                    fresh = now_ms - last_ms.get(instance_id, 0) <= self._ttl_ms
                    return fresh or time.monotonic() < grace

                emit(view.replace({k: r.to_instance() for k, r in poll.live.items()}, keep))
                for instance_id in list(last_ms):
                    if instance_id not in view.instances:
                        del last_ms[instance_id]
                await asyncio.sleep(self._interval)

        return event_stream(produce)

    async def close(self) -> None:
        await self._redis.aclose()
