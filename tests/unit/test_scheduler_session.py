"""The scheduler's Session handler against a fake core: every message gets what the unary call
would give, and nothing a message does ends the stream for the others."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.core import Decision
from pilotfish.scheduler.errors import UnknownModelError
from pilotfish.scheduler.service import SchedulerServicer
from pilotfish.scheduler.view.types import Endpoint, RequestInfo


class FakeCore:
    def __init__(self) -> None:
        self.released: list[tuple[str, int]] = []

    def schedule(self, req: RequestInfo) -> Decision:
        if req.model == "unknown":
            raise UnknownModelError(f"model {req.model!r} is not served here")
        if req.model == "bug":
            raise RuntimeError("a bug in a policy")
        return Decision(Endpoint(req.request_id, "127.0.0.1:1"))

    def report_many(self, reports: Any) -> int:
        raise RuntimeError("a bug in the account")

    def release(self, request_id: str, reason: int = 0, answer_tokens: int = 0) -> bool:
        self.released.append((request_id, answer_tokens))
        return True

    def orphan(self, request_ids: Any) -> None:  # the Session ended with these held
        self.orphaned = list(request_ids)


class FakeContext:
    def __init__(self) -> None:
        self.headers_sent = False

    async def send_initial_metadata(self, metadata: Any) -> None:
        self.headers_sent = True


def schedule(seq: int, model: str) -> scheduler_pb2.SessionRequest:
    req = scheduler_pb2.ScheduleRequest(request_id=f"r{seq}", model=model, prompt_tokens=3)
    return scheduler_pb2.SessionRequest(seq=seq, schedule=req)


async def messages(items: list[scheduler_pb2.SessionRequest]) -> AsyncIterator[scheduler_pb2.SessionRequest]:
    for item in items:
        yield item


async def test_each_message_gets_the_unary_answer_and_the_stream_goes_on() -> None:
    core, context = FakeCore(), FakeContext()
    servicer = SchedulerServicer(core)  # type: ignore[arg-type]
    report = scheduler_pb2.ReportRequest(reports=[scheduler_pb2.TokenReport(request_id="r1", generated_tokens=2)])
    sent = [
        schedule(1, "m"),
        schedule(2, "unknown"),
        schedule(3, "bug"),
        scheduler_pb2.SessionRequest(report=report),  # the core raises: logged, the stream goes on
        scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id="")),  # dropped
        # the answer's length where the gateway learned it only at the end (clamped as a report: here not)
        scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id="r1", generated_tokens=7)),
        scheduler_pb2.SessionRequest(seq=9),  # no kind (a newer gateway's): skipped
        schedule(4, "m"),
    ]
    replies = [r async for r in servicer.Session(messages(sent), context)]  # type: ignore[arg-type]
    assert context.headers_sent
    assert [r.seq for r in replies] == [1, 2, 3, 4]
    assert replies[0].schedule.target.instance_id == "r1"
    assert (replies[1].error.code, replies[1].error.message) == (
        grpc.StatusCode.NOT_FOUND.value[0],
        "model 'unknown' is not served here",
    )
    assert (replies[2].error.code, replies[2].error.message) == (
        grpc.StatusCode.INTERNAL.value[0],
        "internal scheduler error",
    )
    assert replies[3].schedule.target.instance_id == "r4"
    assert core.released == [("r1", 7)]
