"""Where a request goes: the scheduler's choice, or round-robin when the scheduler can't answer.

The gateway keeps its own list of engines (discovery) so a dead or slow scheduler never stops
traffic: each failed or late Schedule call falls back to round-robin, and after enough
consecutive failures a circuit breaker skips the scheduler entirely for a while, then lets one
probe through to detect its recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pilotfish.discovery.static import Instance
from pilotfish.ext_proc.openai import RequestError
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

SCHEDULER = "scheduler"
FALLBACK = "fallback"


@dataclass(slots=True)
class Decision:
    instance_id: str
    address: str
    source: str  # SCHEDULER or FALLBACK
    fallbacks: tuple[str, ...] = ()


class RoundRobin:
    def __init__(self, instances: list[Instance]) -> None:
        self._instances = list(instances)
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self._instances)

    def pick(self) -> Instance:
        if not self._instances:
            raise RequestError(503, "no inference engine is known to the gateway")
        inst = self._instances[self._next % len(self._instances)]
        self._next += 1
        return inst


class CircuitBreaker:
    """Closed until `threshold` consecutive failures; then open for `open_seconds`; then one probe."""

    def __init__(self, threshold: int, open_seconds: float) -> None:
        self.threshold = threshold
        self.open_seconds = open_seconds
        self.failures = 0
        self._open_until = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold

    def allow(self) -> bool:
        if not self.is_open:
            return True
        if self._probing or time.monotonic() < self._open_until:
            return False
        self._probing = True  # half-open: exactly one call finds out whether it recovered
        return True

    def success(self) -> None:
        self.failures = 0
        self._probing = False

    def failure(self) -> None:
        self.failures += 1
        self._probing = False
        if self.failures >= self.threshold:
            self._open_until = time.monotonic() + self.open_seconds


# Scheduler answers that are the client's fault, not the scheduler's: passed on, never retried.
_CLIENT_ERRORS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}


class Router:
    """Schedule, Report and Release against the scheduler, with round-robin fallback."""

    def __init__(
        self,
        scheduler_address: str,
        instances: list[Instance],
        schedule_timeout_s: float,
        report_interval_s: float,
        breaker: CircuitBreaker,
    ) -> None:
        self._round_robin = RoundRobin(instances)
        self._timeout = schedule_timeout_s
        self._report_interval = report_interval_s
        self.breaker = breaker
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        if scheduler_address:
            self._channel = grpc.aio.insecure_channel(scheduler_address)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._pending_reports: dict[str, scheduler_pb2.TokenReport] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()
        self.on_breaker_change: Callable[[bool], None] = lambda is_open: None

    async def choose(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        if self._stub is not None and self.breaker.allow():
            try:
                reply = await self._stub.Schedule(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                if (status := _CLIENT_ERRORS.get(exc.code())) is not None:
                    self._breaker_success()
                    raise RequestError(status, exc.details() or exc.code().name) from None
                self.breaker.failure()
                self.on_breaker_change(self.breaker.is_open)
                log.debug("Schedule failed (%s: %s); routing round-robin", exc.code().name, exc.details())
            else:
                self._breaker_success()
                target = reply.target
                return Decision(
                    target.instance_id, target.address, SCHEDULER, tuple(f.address for f in reply.fallbacks)
                )
        inst = self._round_robin.pick()
        return Decision(inst.instance_id, inst.address, FALLBACK)

    def _breaker_success(self) -> None:
        was_open = self.breaker.is_open
        self.breaker.success()
        if was_open:
            self.on_breaker_change(False)

    def pick_round_robin(self) -> Instance:
        return self._round_robin.pick()

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool) -> None:
        """Queue a cumulative count; the latest per request wins and goes out in the next batch."""
        if self._stub is None:
            return
        self._pending_reports[request_id] = scheduler_pb2.TokenReport(
            request_id=request_id, generated_tokens=generated_tokens, prefill_done=prefill_done
        )
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._report_interval)
        batch, self._pending_reports = list(self._pending_reports.values()), {}
        if batch and self._stub is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Report(scheduler_pb2.ReportRequest(reports=batch), timeout=self._timeout * 5)

    def release(self, request_id: str, reason: int) -> None:
        """Tell the scheduler the request is over; never delays the response path."""
        if self._stub is None:
            return
        self._pending_reports.pop(request_id, None)
        task = asyncio.get_running_loop().create_task(self._release(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, request_id: str, reason: int) -> None:
        assert self._stub is not None
        try:
            await self._stub.Release(
                scheduler_pb2.ReleaseRequest(request_id=request_id, reason=reason), timeout=self._timeout * 5
            )
        except grpc.aio.AioRpcError as exc:
            # The scheduler's staleness expiry reclaims what a lost Release leaves behind.
            log.debug("Release %s failed: %s", request_id, exc.code().name)

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
