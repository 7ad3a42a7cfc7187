"""The rescheduler's two deployment modes.

- colocated (`--enable-rescheduling`, --colocated-rescheduling-mode on, the default):
  `colocated_loop` gives `pilotfish scheduler` a loop over its own full-mode core, which its CMS
  reader already keeps live;
- standalone (`pilotfish rescheduler`): `ReschedulerService` builds its own full-mode core, fed
  from the CMS exactly as the scheduler's is, runs only the loop, and serves /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

import msgspec

from pilotfish.config import ConfigError
from pilotfish.metrics_http import serve_metrics
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.rescheduler.loop import ReschedulingLoop, build_loop
from pilotfish.scheduler.rescheduler.settings import colocated
from pilotfish.security import Security, register_auth_stats

if TYPE_CHECKING:
    from aiohttp import web

    from pilotfish.cms.reader import CmsReader

log = logging.getLogger(__name__)


def colocated_loop(
    config: SchedulerConfig, core: SchedulerCore, security: Security | None = None
) -> ReschedulingLoop | None:
    """The loop `pilotfish scheduler` runs, or None; raises ConfigError on bad rescheduling flags."""
    return build_loop(core, security=security) if colocated(config) else None


def standalone_config(config: SchedulerConfig) -> SchedulerConfig:
    """`pilotfish rescheduler` is full mode, rescheduling on, standalone, whatever those flags say."""
    if not config.redis_url:
        raise ConfigError("--redis-url: the rescheduler reads the CMS from Redis; give its URL")
    return msgspec.structs.replace(
        config,
        enable_full_mode_scheduling=True,
        enable_rescheduling=True,
        standalone_rescheduling_mode=True,
        colocated_rescheduling_mode=False,
    )


class ReschedulerService:
    """A full-mode core fed from the CMS, the loop over it, and /metrics when --metrics-port is set."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config = standalone_config(config)
        # its /metrics listener and its calls to the llumlets and Redis (pilotfish/security.py)
        self.security = security = Security.from_config(config)
        if config.metrics_port:
            security.check_listener(config.host, "--host")
        self.core = SchedulerCore(config)
        register_auth_stats(self.core.registry, security.stats)
        self.loop = build_loop(self.core, security=security)
        self.metrics_port = 0
        self.reader: CmsReader | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._metrics_runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Raises StartError naming the flag when the metrics port cannot be bound."""
        from pilotfish.cms.reader import CmsReader

        config = self.config
        if config.metrics_port:
            self._metrics_runner = await serve_metrics(
                self.core.registry, config.host, config.metrics_port, security=self.security
            )
            self.metrics_port = config.metrics_port
        assert self.core.cms is not None  # full mode
        self.reader = CmsReader(
            config.redis_url,
            config.cms_cluster,
            self.core.cms,
            config.cms_poll_interval_seconds,
            redis_options=self.security.redis_options(config.redis_url),
            notice_records=config.cms_notice_records,
        )
        self._reader_task = asyncio.create_task(self.reader.run(), name="rescheduler-cms-reader")
        if self.core.cms.follows_discovery:  # CMS metadata admits only engines discovery lists
            self._discovery_task = asyncio.create_task(
                self.core.cms.follow_discovery(config), name="rescheduler-discovery"
            )
        self.loop.start(self.reader.wait_first_poll)

    async def stop(self) -> None:
        await self.loop.stop()
        tasks = (self._reader_task, self._discovery_task)
        self._reader_task = self._discovery_task = None
        for task in tasks:
            if task is not None:
                task.cancel()
                # bounded: the CMS reader may be mid-reconnect to a Redis that is gone
                await asyncio.wait([task], timeout=5.0)
        runner, self._metrics_runner = self._metrics_runner, None
        if runner is not None:
            await runner.cleanup()


async def serve(config: SchedulerConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = ReschedulerService(config)
    try:
        await service.start()
        metrics = f", metrics on :{service.metrics_port}" if service.metrics_port else ""
        interval = service.config.rescheduling_interval_ms
        policies = ",".join(service.config.rescheduling_policies)
        print(f"rescheduler running every {interval} ms ({policies}){metrics}", flush=True)
        await stop.wait()
    finally:
        await service.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_forever(config: SchedulerConfig) -> int:
    """Config errors surface before the loop starts; 0 after a clean stop."""
    config = standalone_config(config)
    ReschedulerService(config)  # builds the core and the planner: every flag is checked here
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config))
    sys.stdout.flush()
    return 0
