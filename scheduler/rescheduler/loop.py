"""The rescheduling loop: every --rescheduling-interval-ms, plan over the live view and dispatch.

The view is a SchedulerCore's, kept current by its CMS reader (the scheduler's own in colocated
mode, the rescheduler's in standalone mode). Planning reads it without awaiting, so one cycle
plans over one consistent view. A cycle waits for all its Migrate calls; the next starts one
interval after the previous one started, or at once if that one overran: cycles never overlap.
Nothing a cycle raises stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from pilotfish.config import ConfigError
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.rescheduler.dispatcher import MigrationDispatcher
from pilotfish.scheduler.rescheduler.planner import ReschedulingPlanner
from pilotfish.scheduler.rescheduler.telemetry import ReschedulerTelemetry
from pilotfish.scheduler.rescheduler.types import MigrationResult
from pilotfish.security import Security

log = logging.getLogger(__name__)

STOP_TIMEOUT = 5.0


class ReschedulingLoop:
    def __init__(
        self,
        core: SchedulerCore,
        planner: ReschedulingPlanner,
        dispatcher: MigrationDispatcher,
        telemetry: ReschedulerTelemetry,
        *,
        interval_s: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.planner = planner
        self.dispatcher = dispatcher
        self.telemetry = telemetry
        self.interval_s = interval_s
        self.wall_clock = wall_clock
        self.num_cycles = 0
        self.num_errors = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> list[MigrationResult]:
        """One cycle: plan over the view as it is now, dispatch, wait for every answer."""
        async with self._lock:  # a cycle asked for while one runs waits its turn
            instances = self.core.instances()
            pairs = self.planner.plan(instances, self.wall_clock())
            results = await self.dispatcher.dispatch(pairs) if pairs else []
            await self.dispatcher.prune(self.core.instances())
            self.num_cycles += 1
            self.telemetry.cycles.inc()
            return results

    async def run(self, ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Cycle until cancelled; `ready` (the CMS reader's first poll) is awaited first, so the
        first plan sees the whole cluster."""
        if ready is not None:
            await ready()
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a surprise in one cycle must not end rescheduling
                self.num_errors += 1
                log.exception("rescheduling cycle failed; the next one runs as planned")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def start(self, ready: Callable[[], Awaitable[None]] | None = None) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(ready), name="rescheduling-loop")

    async def stop(self) -> None:
        """Cancel the loop (calls in flight are cancelled with it) and close the channels."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task], timeout=STOP_TIMEOUT)
        await self.dispatcher.close()


def build_loop(
    core: SchedulerCore, wall_clock: Callable[[], float] | None = None, security: Security | None = None
) -> ReschedulingLoop:
    """A loop over `core`'s view with the core's config; its counters go on the core's registry.
    `security`: the process's (pilotfish/security.py); by default resolved from the core's config."""
    config = core.config
    if security is None:
        security = Security.from_config(config)
    if security.token and config.llumlet_token and config.llumlet_token.encode() != security.token:
        raise ConfigError("--llumlet-token: differs from --auth-token-file's token; drop --llumlet-token")
    telemetry = ReschedulerTelemetry(core.registry)
    dispatcher = MigrationDispatcher(
        telemetry,
        pool_size=config.llumlet_grpc_connection_pool_size,
        timeout_s=config.llumlet_grpc_timeout_seconds,
        token=config.llumlet_token,
        security=security,
    )
    return ReschedulingLoop(
        core,
        ReschedulingPlanner(config),
        dispatcher,
        telemetry,
        interval_s=config.rescheduling_interval_ms / 1000.0,
        wall_clock=wall_clock or core.ctx.wall_clock,
    )
