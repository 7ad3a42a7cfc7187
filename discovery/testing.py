"""Helpers for tests of discovery and of its consumers: a background watcher and a condition wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from pilotfish.discovery.api import InstanceAddedEvent, InstanceEvent, ServiceDiscovery
from pilotfish.discovery.static import Instance


async def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class Watcher:
    """Consumes `discovery.watch(namespace, component)` in a task; `instances` is its current view."""

    def __init__(self, discovery: ServiceDiscovery, namespace: str, component: str) -> None:
        self.instances: dict[str, Instance] = {}
        self.events: list[InstanceEvent] = []
        self.error: BaseException | None = None
        self._task = asyncio.create_task(self._run(discovery, namespace, component))

    async def _run(self, discovery: ServiceDiscovery, namespace: str, component: str) -> None:
        try:
            async with contextlib.aclosing(discovery.watch(namespace, component)) as events:
                async for event in events:
                    self.events.append(event)
                    if isinstance(event, InstanceAddedEvent):
                        self.instances[event.instance.instance_id] = event.instance
                    else:
                        self.instances.pop(event.instance.instance_id, None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
            raise

    def ids(self) -> set[str]:
        if self.error is not None:
            raise AssertionError(f"watcher died: {self.error!r}")
        return set(self.instances)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
