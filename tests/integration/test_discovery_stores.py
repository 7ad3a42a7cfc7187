"""Redis and etcd discovery against the real servers: every test runs on both backends.

Waits are on conditions with generous timeouts; nothing asserts a wall-clock duration.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from pilotfish import services
from pilotfish.discovery import InstanceRemovedEvent, open_discovery, open_registry
from pilotfish.discovery.records import InstanceRecord, encode_record
from pilotfish.discovery.testing import Watcher, wait_for
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

NS, COMP = "test", "engine"
TTL = 2.0  # etcd's smallest lease
INTERVAL = 0.2


@dataclass
class Store:
    kind: str
    service: RunningService
    tmp_path: Path
    started: list[RunningService] = field(default_factory=list)

    @property
    def url(self) -> str:
        if self.kind == "redis":
            return self.service.url
        return "etcd://" + self.service.url.removeprefix("http://")

    def restart(self) -> None:
        """Stop the server and start an empty one on the same port (Redis without persistence,
        etcd with a new data dir: every record and lease is gone)."""
        port = self.service.port
        self.service.stop()
        work = self.tmp_path / f"{self.kind}-restart-{len(self.started)}"
        start = services.start_redis if self.kind == "redis" else services.start_etcd
        self.service = start(work, port)
        self.started.append(self.service)

    async def put_raw(self, instance_id: str, value: bytes) -> None:
        """Write a value straight into the store, as a broken or hostile writer would."""
        if self.kind == "redis":
            client = aioredis.Redis.from_url(self.service.url)
            try:
                await client.hset(f"pilotfish:discovery:{NS}:{COMP}", instance_id, value)
            finally:
                await client.aclose()
            return
        key = f"/pilotfish/discovery/{NS}/{COMP}/{instance_id}".encode()
        body = {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()}
        async with (
            aiohttp.ClientSession(trust_env=False) as session,
            session.post(self.service.url + "/v3/kv/put", json=body) as response,
        ):
            assert response.status == 200, await response.text()


@pytest.fixture(params=["redis", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    service = request.getfixturevalue(f"{request.param}_service")
    if service.child is None:
        pytest.skip("restart on the same port needs a local server, not a container")
    s = Store(request.param, service, tmp_path)
    yield s
    for extra in s.started:
        extra.stop()


def record(instance_id: str, port: int, **overrides: object) -> bytes:
    fields: dict[str, object] = dict(
        instance_id=instance_id, namespace=NS, component=COMP, host="127.0.0.1", port=port,
        timestamp_ms=int(__import__("time").time() * 1000), update_id=1,
    )  # fmt: skip
    fields.update(overrides)
    return encode_record(InstanceRecord(**fields))  # type: ignore[arg-type]


async def _watchers(url: str, n: int) -> tuple[list, list[Watcher]]:
    discoveries = [open_discovery(url, ttl=TTL, interval=INTERVAL) for _ in range(n)]
    return discoveries, [Watcher(d, NS, COMP) for d in discoveries]


async def _close(discoveries: list, watchers: list[Watcher]) -> None:
    for w in watchers:
        await w.close()
    for d in discoveries:
        await d.close()


async def test_added_and_removed_reach_every_watcher(store: Store) -> None:
    discoveries, watchers = await _watchers(store.url, 3)
    registry = open_registry(store.url, ttl=TTL)
    try:
        handles = []
        for n in range(3):
            handle = await registry.register_instance(NS, COMP, host="127.0.0.1", port=9000 + n)
            await handle.set_metadata({"model": "m", "rank": n})
            await handle.set_ready("ready")
            handles.append(handle)
        want = {"127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"}
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == want, "all three instances in every watcher")
        assert await watchers[0].instances["127.0.0.1:9001"].metadata() == {"model": "m", "rank": 1}
        listed = await discoveries[0].list_instances(NS, COMP)
        assert [(i.instance_id, i.address) for i in listed] == [(i, i) for i in sorted(want)]

        await handles[1].set_ready("not_ready")
        await handles[2].deregister()
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == {"127.0.0.1:9000"}, "not-ready and deregistered instances gone")

        await handles[1].set_metadata({"model": "m2"})  # metadata of a ready instance is an update
        await handles[1].set_ready(True)
        for w in watchers:
            await wait_for(lambda w=w: "127.0.0.1:9001" in w.ids(), "instance ready again")
        assert await watchers[2].instances["127.0.0.1:9001"].metadata() == {"model": "m2"}
        # another namespace/component is not ours
        other = await registry.register_instance(NS, "prefill", host="127.0.0.1", port=9100)
        await other.set_ready("ready")
        assert {i.instance_id for i in await discoveries[1].list_instances(NS, "prefill")} == {"127.0.0.1:9100"}
        assert all("127.0.0.1:9100" not in w.ids() for w in watchers)
    finally:
        await registry.close()
    for w in watchers:  # close() withdraws what it registered
        await wait_for(lambda w=w: w.ids() == set(), "registry close withdraws its instances")
    await _close(discoveries, watchers)


class CycleSpy:
    """Records what each of a consumer's cycles (a Redis poll, an etcd re-list) saw, in order.

    It counts cycles instead of timing them, so "within two intervals" is checked without a clock.
    """

    def __init__(self, discovery: object, kind: str) -> None:
        name = "_poll" if kind == "redis" else "_list"
        inner = getattr(discovery, name)
        self.seen: list[set[str]] = []

        async def spy(namespace: str, component: str) -> object:
            result = await inner(namespace, component)
            self.seen.append(set(result.live) if kind == "redis" else set(result[1]))
            return result

        setattr(discovery, name, spy)


async def test_changes_reach_every_watcher_within_two_intervals(store: Store) -> None:
    discoveries = [open_discovery(store.url, ttl=TTL, interval=INTERVAL) for _ in range(3)]
    spies = [CycleSpy(d, store.kind) for d in discoveries]
    watchers = [Watcher(d, NS, COMP) for d in discoveries]
    registry = open_registry(store.url, ttl=TTL)
    try:
        handle = await registry.register_instance(NS, COMP, instance_id="x", host="127.0.0.1", port=9000)
        for action, present in [(handle.set_ready, True), (handle.deregister, False)]:
            marks = [len(s.seen) for s in spies]  # cycles finished before the write
            await (action("ready") if present else action())
            for w in watchers:
                await wait_for(lambda w=w, present=present: ("x" in w.ids()) == present, f"x present={present}")
            for spy, mark in zip(spies, marks, strict=True):
                await wait_for(lambda spy=spy, mark=mark: len(spy.seen) >= mark + 2, "two more cycles")
                # A cycle already running at the write may miss it; the next one, started after it, may not.
                first = next(i for i in range(mark, len(spy.seen)) if ("x" in spy.seen[i]) == present)
                assert first <= mark + 1, f"change first seen {first - mark + 1} cycles after the write"
    finally:
        await registry.close()
        await _close(discoveries, watchers)


async def test_a_writer_that_stops_heartbeating_expires_within_the_ttl(store: Store) -> None:
    discoveries, watchers = await _watchers(store.url, 1)
    registry = open_registry(store.url, ttl=TTL)
    handle = await registry.register_instance(NS, COMP, instance_id="doomed", host="127.0.0.1", port=9000)
    await handle.set_ready("ready")
    await wait_for(lambda: watchers[0].ids() == {"doomed"}, "instance listed")
    # Simulate a crash: the heartbeat stops and nothing is withdrawn.
    registry._heartbeat_task.cancel()  # type: ignore[attr-defined]
    await wait_for(lambda: watchers[0].ids() == set(), "expired instance removed", timeout=TTL * 10)
    assert await discoveries[0].list_instances(NS, COMP) == []
    await _close(discoveries, watchers)
    registry.handles.clear()  # type: ignore[attr-defined]
    await registry.close()


async def test_a_restarted_store_is_survived(store: Store) -> None:
    discoveries, watchers = await _watchers(store.url, 2)
    registry = open_registry(store.url, ttl=TTL)
    try:
        for n in range(3):
            handle = await registry.register_instance(NS, COMP, host="127.0.0.1", port=9000 + n)
            await handle.set_ready("ready")
        want = {f"127.0.0.1:{9000 + n}" for n in range(3)}
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == want, "instances listed before the restart")

        store.restart()  # an empty store on the same port

        # Writers re-register into the new store ...
        fresh = open_discovery(store.url, ttl=TTL, interval=INTERVAL)
        listed: set[str] = set()

        async def poll() -> None:
            nonlocal listed
            try:
                listed = {i.instance_id for i in await fresh.list_instances(NS, COMP)}
            except ConnectionError:
                listed = set()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while listed != want:
            assert loop.time() < deadline, f"writers did not re-register: {listed}"
            await poll()
            await asyncio.sleep(INTERVAL)
        await fresh.close()
        # ... and a new registration after the restart reaches the old watchers.
        late = await registry.register_instance(NS, COMP, instance_id="late", host="127.0.0.1", port=9010)
        await late.set_ready("ready")
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == want | {"late"}, "post-restart instance reaches watchers")
        # Nobody lost an instance on the way.
        for w in watchers:
            assert not [e for e in w.events if isinstance(e, InstanceRemovedEvent)]
    finally:
        await registry.close()
        await _close(discoveries, watchers)


async def test_two_hundred_concurrent_registrations_are_all_listed(store: Store) -> None:
    discoveries, watchers = await _watchers(store.url, 1)
    registries = [open_registry(store.url, ttl=TTL) for _ in range(4)]  # four writers at once

    async def register(n: int) -> None:
        handle = await registries[n % 4].register_instance(
            NS, COMP, instance_id=f"i{n:03d}", host="127.0.0.1", port=10000 + n
        )
        await handle.set_metadata({"n": n})
        await handle.set_ready("ready")

    try:
        await asyncio.gather(*(register(n) for n in range(200)))
        want = {f"i{n:03d}" for n in range(200)}
        listed = await discoveries[0].list_instances(NS, COMP)
        assert {i.instance_id for i in listed} == want
        assert {i.port for i in listed} == {10000 + n for n in range(200)}
        await wait_for(lambda: watchers[0].ids() == want, "all 200 in the watcher")
    finally:
        for r in registries:
            await r.close()
    await wait_for(lambda: watchers[0].ids() == set(), "all 200 withdrawn")
    await _close(discoveries, watchers)


BAD_VALUES: list[tuple[str, Callable[[], bytes]]] = [
    ("bad-json", lambda: b"{not json"),
    ("bad-binary", lambda: b"\xff\xfe\x00garbage"),
    ("bad-type", lambda: b'{"instance_id": 5}'),
    ("bad-port", lambda: record("bad-port", 70000)),
    ("bad-id", lambda: record("someone-else", 9000)),  # names another instance than its key
    ("bad-huge", lambda: record("bad-huge", 9000, metadata={"x": "y" * 100_000})),
]


async def test_malformed_records_are_skipped_with_a_log_line(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pilotfish.discovery")
    for instance_id, value in BAD_VALUES:
        await store.put_raw(instance_id, value())
    await store.put_raw("good", record("good", 9000))
    discovery = open_discovery(store.url, ttl=TTL, interval=INTERVAL)
    assert [i.instance_id for i in await discovery.list_instances(NS, COMP)] == ["good"]
    watcher = Watcher(discovery, NS, COMP)
    await wait_for(lambda: watcher.ids() == {"good"}, "the good record, alone")
    # A bad write while watching is skipped too, and the consumer keeps going.
    await store.put_raw("bad-late", b"[]")
    await store.put_raw("good-late", record("good-late", 9001))
    await wait_for(lambda: watcher.ids() == {"good", "good-late"}, "a later good record")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for instance_id, _ in [*BAD_VALUES, ("bad-late", None)]:
        assert instance_id in logged, f"no log line for {instance_id}"
    await watcher.close()
    await discovery.close()


async def test_etcd_lease_loss_re_registers(etcd_service: RunningService) -> None:
    url = "etcd://" + etcd_service.url.removeprefix("http://")
    discovery = open_discovery(url, ttl=TTL, interval=INTERVAL)
    watcher = Watcher(discovery, NS, COMP)
    registry = open_registry(url, ttl=TTL)
    try:
        handle = await registry.register_instance(NS, COMP, instance_id="x", host="127.0.0.1", port=9000)
        await handle.set_ready("ready")
        await wait_for(lambda: watcher.ids() == {"x"}, "registered")
        # The lease vanishes (as after a partition longer than the TTL): etcd deletes the key.
        async with (
            aiohttp.ClientSession(trust_env=False) as session,
            session.post(etcd_service.url + "/v3/lease/revoke", json={"ID": str(registry._lease)}) as response,  # type: ignore[attr-defined]
        ):
            assert response.status == 200
        await wait_for(lambda: any(isinstance(e, InstanceRemovedEvent) for e in watcher.events), "the DELETE")
        await wait_for(lambda: watcher.ids() == {"x"}, "re-registered under a new lease")
    finally:
        await registry.close()
        await watcher.close()
        await discovery.close()
