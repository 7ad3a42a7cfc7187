"""Flow control on the scheduler's listeners: a queued Schedule's acknowledgement and late answer.

A Schedule with queue_timeout_ms > 0 may wait. On a Session (gRPC stream or socket) the scheduler
then answers at once with `queued` (the longest it will hold the request) and later, with the same
seq, the decision or the error; the gateway's deadline for an acknowledged request is that wait,
not its --schedule-timeout-ms. A unary Schedule sends the wait as initial metadata
(`QUEUED_KEY`) and answers when the request leaves the queue. A Session that ends takes its
waiting requests out of the queue (their gateway falls back or is gone); a Release of a waiting
request does too, so an abandoned request is never dispatched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.errors import SchedulerError
from pilotfish.scheduler.flow.controller import MAX_FLOW_LENGTH, Stopping
from pilotfish.scheduler.flow.gate import FlowGate

__all__ = ["MAX_FLOW_LENGTH", "MAX_HOLD_MS", "QUEUED_KEY", "SessionAnswer", "Stopping", "merged", "notice"]

QUEUED_KEY = "pilotfish-queued-ms"
MAX_HOLD_MS = 600_000  # a gateway's queue_timeout_ms is read up to this (the band's wait bounds it anyway)

Reply = Callable[[object], None]
# one Session message answered with an optional reply for a schedule that may wait
AnswerWith = Callable[[scheduler_pb2.SessionRequest, "Reply | None"], "scheduler_pb2.SessionResponse | None"]


def resolve(waiter: asyncio.Future[object] | None) -> Reply | None:
    """A reply that completes `waiter` (a unary Schedule's), unless it is already done (cancelled)."""
    if waiter is None:
        return None

    def reply(outcome: object) -> None:
        if not waiter.done():
            waiter.set_result(outcome)

    return reply


def notice(seq: int, wait_s: float) -> scheduler_pb2.SessionResponse:
    return scheduler_pb2.SessionResponse(seq=seq, queued=scheduler_pb2.QueuedNotice(wait_ms=int(wait_s * 1000) + 1))


def outcome_response(
    seq: int, outcome: object, to_proto: Callable[[object], scheduler_pb2.ScheduleResponse]
) -> scheduler_pb2.SessionResponse | None:
    """The late answer of a queued schedule; None when the scheduler is stopping (the Session's
    end then fails the gateway's waiter, and it falls back, as for any request in flight)."""
    if isinstance(outcome, Stopping):
        return None
    if isinstance(outcome, SchedulerError):
        code = getattr(grpc.StatusCode, outcome.code)
        error = scheduler_pb2.SessionError(code=code.value[0], message=str(outcome))
        return scheduler_pb2.SessionResponse(seq=seq, error=error)
    return scheduler_pb2.SessionResponse(seq=seq, schedule=to_proto(outcome))


class SessionAnswer:
    """One Session's answer with flow control on: waiting schedules are answered later through
    `deliver`; `close` (the Session ended) takes the ones still waiting out of the queue."""

    def __init__(
        self,
        answer_with: AnswerWith,
        gate: FlowGate,
        deliver: Callable[[scheduler_pb2.SessionResponse], None],
        to_proto: Callable[[object], scheduler_pb2.ScheduleResponse],
    ) -> None:
        self._answer_with = answer_with
        self._gate = gate
        self._deliver = deliver
        self._to_proto = to_proto
        self._waiting: set[str] = set()
        self._closed = False

    def __call__(self, message: scheduler_pb2.SessionRequest) -> scheduler_pb2.SessionResponse | None:
        if message.WhichOneof("kind") != "schedule" or not message.schedule.queue_timeout_ms or self._closed:
            return self._answer_with(message, None)
        seq, request_id = message.seq, message.schedule.request_id
        waiting = self._waiting

        def reply(outcome: object) -> None:
            waiting.discard(request_id)
            response = outcome_response(seq, outcome, self._to_proto)
            if response is not None and not self._closed:
                self._deliver(response)

        response = self._answer_with(message, reply)
        if response is not None and response.WhichOneof("kind") == "queued":
            waiting.add(request_id)
        return response

    def close(self) -> None:
        self._closed = True
        waiting, self._waiting = self._waiting, set()
        for request_id in waiting:
            self._gate.cancel(request_id)


_END = object()


async def merged(
    request_iterator: AsyncIterator[scheduler_pb2.SessionRequest],
    answer: Callable[[scheduler_pb2.SessionRequest], scheduler_pb2.SessionResponse | None],
    outbox: asyncio.Queue[object],
) -> AsyncIterator[scheduler_pb2.SessionResponse]:
    """The gRPC Session's replies: at-once answers and late ones (put in `outbox`), in the order
    they were made; ends when the gateway stops writing (its reader's error, if any, is raised)."""

    async def read() -> None:
        try:
            async for message in request_iterator:
                response = answer(message)
                if response is not None:
                    outbox.put_nowait(response)
        finally:
            outbox.put_nowait(_END)

    reader = asyncio.get_running_loop().create_task(read())
    try:
        while (item := await outbox.get()) is not _END:
            yield item  # type: ignore[misc]
        await reader
    finally:
        reader.cancel()
