"""Runs an engine core in real time on the asyncio loop: step, sleep the step's duration,
deliver its tokens. The core's state is owned by this loop alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pilotfish.simulator.engine.base import EngineCore, TokenOutput
from pilotfish.simulator.engine.request import SimRequest

log = logging.getLogger(__name__)


class EngineDriver:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine-steps")
        self._task.add_done_callback(self._report_crash)

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        # a dead step loop would leave every request hanging; say so loudly
        if not task.cancelled() and task.exception() is not None:
            log.critical("engine step loop died", exc_info=task.exception())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, request: SimRequest) -> asyncio.Queue[TokenOutput]:
        """Queue `request`; its tokens arrive on the returned queue, the last one with a finish reason."""
        self.core.add_request(request, asyncio.get_running_loop().time())
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.core.abort_request(request_id, asyncio.get_running_loop().time())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.core.begin_step(loop.time())
            # sleep to the step's end rather than for its duration, so delivery overhead does not
            # stretch every step
            await asyncio.sleep(max(0.0, plan.end - loop.time()))
            for out in self.core.end_step(plan):
                queue = self._streams.get(out.request_id)
                if queue is None:
                    continue
                queue.put_nowait(out)
                if out.finish_reason is not None:
                    del self._streams[out.request_id]
