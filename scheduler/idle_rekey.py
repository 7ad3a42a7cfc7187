"""Re-key the load index when the server's loop is free, not at the next Schedule.

An instance's change (an engine's status, a dispatch, a release) moves it in the load index, and
the core does that lazily: the next Schedule re-keys every instance changed since the last one
(scheduler/policy/index.py), 37 µs each at 256 engines on a slow host. Engines report every step,
so a full-mode Schedule at 256 engines would find about 8 changed (bench/RESULTS.md, 2026-11-28)
and spend most of its time on them. Here the first change after a re-key schedules one in a
callback of its own on the server's loop; the changes until it runs wait for the same callback.
A loop with free time re-keys there, and a Schedule that comes later finds the index current.
A busy loop does the same work either way, only in another order. The CPU spent is the same,
except when one instance changes twice before a Schedule: then the lazy way re-keys it once.
Engines stepping 30 times a second do that when the fleet gets fewer than 30 Schedules a second,
where the scheduler's CPU is cheap and a Schedule's wait is not. A fleet too small for an index
(scheduler/core.py, INDEX_MIN_INSTANCES) schedules no callback at all.
"""

from __future__ import annotations

import asyncio

from pilotfish.scheduler.core import SchedulerCore


def rekey_when_idle(core: SchedulerCore, loop: asyncio.AbstractEventLoop) -> None:
    """From now on `core`'s changed instances are re-keyed in a callback on `loop` soon after they change."""
    core.on_rekey_due = lambda: loop.call_soon(core.rekey_changed)
    loop.call_soon(core.rekey_changed)  # what changed before: it would not call again until a decision re-keys
