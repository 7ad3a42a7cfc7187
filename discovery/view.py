"""What one watcher believes is live, and the plumbing that turns a producer into an event stream.

Backends feed a `View` snapshots or single changes; the view answers with the events that make
a consumer's picture equal to it. A `watch()` is an async generator over a queue filled by one
producer task, which the generator cancels when the consumer closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from pilotfish.discovery.api import InstanceAddedEvent, InstanceEvent, InstanceRemovedEvent
from pilotfish.discovery.static import Instance

Emit = Callable[[list[InstanceEvent]], None]


class View:
    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}

    def upsert(self, instance: Instance) -> list[InstanceEvent]:
        old = self.instances.get(instance.instance_id)
        if old is not None and old.same_as(instance):
            return []
        self.instances[instance.instance_id] = instance
        return [InstanceAddedEvent(instance)]

    def remove(self, instance_id: str) -> list[InstanceEvent]:
        old = self.instances.pop(instance_id, None)
        return [] if old is None else [InstanceRemovedEvent(old)]

    def replace(
        self, snapshot: Mapping[str, Instance], keep_missing: Callable[[str], bool] = lambda _id: False
    ) -> list[InstanceEvent]:
        """Make the view equal to `snapshot`; an id missing from it stays while `keep_missing(id)`."""
        events: list[InstanceEvent] = []
        for instance_id in sorted(self.instances.keys() - snapshot.keys()):
            if not keep_missing(instance_id):
                events += self.remove(instance_id)
        for instance_id in sorted(snapshot):
            events += self.upsert(snapshot[instance_id])
        return events


async def event_stream(produce: Callable[[Emit], Awaitable[None]]) -> AsyncIterator[InstanceEvent]:
    """Run `produce(emit)` as a task and yield what it emits, until the consumer stops iterating."""
    queue: asyncio.Queue[InstanceEvent | BaseException] = asyncio.Queue()

    def emit(events: list[InstanceEvent]) -> None:
        for event in events:
            queue.put_nowait(event)

    async def run() -> None:
        try:
            await produce(emit)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a producer bug must reach the consumer, not vanish in a task
            queue.put_nowait(exc)

    task = asyncio.create_task(run())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
