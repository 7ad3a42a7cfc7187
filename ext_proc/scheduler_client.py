"""The remote scheduler over gRPC: Schedule with a deadline, Reports batched, Releases off the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import SCHEDULER, Decision, SchedulerUnavailable
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

# Scheduler answers that are the client's fault, not the scheduler's: passed on, never retried.
_CLIENT_ERRORS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}


class GrpcScheduler:
    def __init__(self, address: str, schedule_timeout_s: float, report_interval_s: float) -> None:
        self._timeout = schedule_timeout_s
        self._report_interval = report_interval_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._pending_reports: dict[str, scheduler_pb2.TokenReport] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        try:
            reply = await self._stub.Schedule(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if (status := _CLIENT_ERRORS.get(exc.code())) is not None:
                raise RequestError(status, exc.details() or exc.code().name) from None
            raise SchedulerUnavailable(f"{exc.code().name}: {exc.details()}") from None
        target = reply.target
        return Decision(target.instance_id, target.address, SCHEDULER, tuple(f.address for f in reply.fallbacks))

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool) -> None:
        """Queue a cumulative count; the latest per request wins and goes out in the next batch."""
        self._pending_reports[request_id] = scheduler_pb2.TokenReport(
            request_id=request_id, generated_tokens=generated_tokens, prefill_done=prefill_done
        )
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._report_interval)
        batch, self._pending_reports = list(self._pending_reports.values()), {}
        if batch:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Report(scheduler_pb2.ReportRequest(reports=batch), timeout=self._timeout * 5)

    def release(self, request_id: str, reason: int) -> None:
        """Tell the scheduler the request is over; never delays the response path."""
        self._pending_reports.pop(request_id, None)
        task = asyncio.get_running_loop().create_task(self._release(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, request_id: str, reason: int) -> None:
        try:
            await self._stub.Release(
                scheduler_pb2.ReleaseRequest(request_id=request_id, reason=reason), timeout=self._timeout * 5
            )
        except grpc.aio.AioRpcError as exc:
            # The scheduler's staleness expiry reclaims what a lost Release leaves behind.
            log.debug("Release %s failed: %s", request_id, exc.code().name)

    def instance_added(self, instance: object) -> None:
        """The remote scheduler discovers instances itself."""

    def instance_removed(self, instance_id: str) -> None:
        """The remote scheduler discovers instances itself."""

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._channel.close()
