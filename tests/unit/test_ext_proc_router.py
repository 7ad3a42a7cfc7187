"""Router against a fake scheduler, with and without the Session stream: error mapping, deadline
fallback, breaker, batched reports."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pilotfish.discovery.static import Instance
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import FALLBACK, SCHEDULER, CircuitBreaker, Router
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.procs import free_port
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.protos.session_frames import ANSWERED_KEY

INSTANCES = [Instance("a", "127.0.0.1", 1), Instance("b", "127.0.0.1", 2)]


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.answer: grpc.StatusCode | None = None
        self.delay = 0.0
        self.reports: list[scheduler_pb2.ReportRequest] = []
        self.releases: list[str] = []
        self.order: list[str] = []  # "report <id>" and "release <id>", as they arrived

    async def Schedule(self, request, context):
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.answer is not None:
            # as the real scheduler: its own refusals carry the answered trailer
            await context.abort(self.answer, f"fake {self.answer.name}", ((ANSWERED_KEY, "1"),))
        target = scheduler_pb2.Endpoint(instance_id="b", address="127.0.0.1:2")
        return scheduler_pb2.ScheduleResponse(target=target, fallbacks=[scheduler_pb2.Endpoint(address="127.0.0.1:1")])

    async def Report(self, request, context):
        self.reports.append(request)
        self.order += [f"report {r.request_id}" for r in request.reports]
        return scheduler_pb2.ReportResponse()

    async def Release(self, request, context):
        self.releases.append(request.request_id)
        self.order.append(f"release {request.request_id}")
        return scheduler_pb2.ReleaseResponse(found=True)


class SessionFake(FakeScheduler):
    """Serves Session too, answering each schedule in its own task (so a delay holds only that one)."""

    def __init__(self) -> None:
        super().__init__()
        self.session_messages = 0

    async def Session(self, request_iterator, context):
        lock = asyncio.Lock()  # one write at a time on a call
        tasks = set()

        async def answer(seq: int) -> None:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.answer is not None:
                error = scheduler_pb2.SessionError(code=self.answer.value[0], message=f"fake {self.answer.name}")
                reply = scheduler_pb2.SessionResponse(seq=seq, error=error)
            else:
                target = scheduler_pb2.Endpoint(instance_id="b", address="127.0.0.1:2")
                fallbacks = [scheduler_pb2.Endpoint(address="127.0.0.1:1")]
                schedule = scheduler_pb2.ScheduleResponse(target=target, fallbacks=fallbacks)
                reply = scheduler_pb2.SessionResponse(seq=seq, schedule=schedule)
            async with lock:
                await context.write(reply)

        await context.send_initial_metadata(())  # as the real one: the gateway writes after this
        async for message in request_iterator:
            self.session_messages += 1
            kind = message.WhichOneof("kind")
            if kind == "schedule":
                task = asyncio.get_running_loop().create_task(answer(message.seq))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif kind == "report":
                self.reports.append(message.report)
                self.order += [f"report {r.request_id}" for r in message.report.reports]
            elif kind == "release":
                self.releases.append(message.release.request_id)
                self.order.append(f"release {message.release.request_id}")


@pytest.fixture(params=["unary", "session"])
async def fake(request):
    server = grpc.aio.server()
    servicer = FakeScheduler() if request.param == "unary" else SessionFake()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    router = Router(GrpcScheduler(f"127.0.0.1:{port}", 0.5, 0.01), INSTANCES, CircuitBreaker(2, 60))
    yield servicer, router
    await router.close()
    await server.stop(0)


def request(rid: str = "r1") -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=rid, model="m", prompt_tokens=5)


async def test_scheduler_choice_and_fallbacks(fake):
    _, router = fake
    decision = await router.choose(request())
    assert (decision.instance_id, decision.address, decision.source) == ("b", "127.0.0.1:2", SCHEDULER)
    assert decision.fallbacks == ("127.0.0.1:1",)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        # the scheduler's verdict that no engine is eligible: 503 to the client, not a fallback pick
        (grpc.StatusCode.UNAVAILABLE, 503),
    ],
)
async def test_client_errors_pass_through_without_tripping_the_breaker(fake, code, status):
    servicer, router = fake
    servicer.answer = code
    for _ in range(3):
        with pytest.raises(RequestError) as info:
            await router.choose(request())
        assert info.value.status == status
    assert not router.breaker.is_open


async def test_scheduler_bugs_and_late_answers_fall_back_then_open_the_breaker(fake):
    servicer, router = fake
    servicer.answer = grpc.StatusCode.INTERNAL
    assert (await router.choose(request())).source == FALLBACK
    servicer.answer, servicer.delay = None, 2.0  # past the 0.5 s deadline
    assert (await router.choose(request())).source == FALLBACK
    assert router.breaker.is_open
    servicer.delay = 0.0
    # open: the healthy scheduler is not asked until the breaker lets a probe through
    assert (await router.choose(request())).source == FALLBACK


async def test_reports_are_batched_latest_wins_and_release_drops_pending(fake):
    servicer, router = fake
    for tokens in (1, 2, 3):
        router.report("r1", tokens, prefill_done=True)
    router.report("r2", 7, prefill_done=True)
    router.report("r3", 1, prefill_done=True)
    router.release("r3", scheduler_pb2.RELEASE_REASON_FINISHED)
    await router.close()
    sent = [(r.request_id, r.generated_tokens) for batch in servicer.reports for r in batch.reports]
    assert sorted(sent) == [("r1", 3), ("r2", 7)]
    assert servicer.releases == ["r3"]


async def test_a_release_sends_a_pending_served_elsewhere_move_first(fake):
    """The scheduler counts a request served elsewhere as a failure of the engine it scheduled, and
    its release as a success of where it is held: the move must not be dropped, nor come late."""
    servicer, router = fake
    assert (await router.choose(request("r1"))).source == SCHEDULER
    router.report("r1", 0, False, served_address="127.0.0.1:1")
    router.report("r2", 3, prefill_done=True)  # a plain count pending: still dropped by a release
    router.release("r1", scheduler_pb2.RELEASE_REASON_FINISHED)
    router.release("r2", scheduler_pb2.RELEASE_REASON_FINISHED)
    await router.close()
    assert sorted(servicer.order) == ["release r1", "release r2", "report r1"]
    assert servicer.order.index("report r1") < servicer.order.index("release r1")
    moved = [r for batch in servicer.reports for r in batch.reports]
    assert [(r.request_id, r.served_address) for r in moved] == [("r1", "127.0.0.1:1")]


async def test_no_scheduler_configured_routes_round_robin():
    router = Router(None, INSTANCES, CircuitBreaker(1, 1))
    picks = [(await router.choose(request())).instance_id for _ in range(3)]
    assert picks == ["a", "b", "a"]
    await router.close()


async def test_reports_and_releases_ride_the_session_once_it_answers(fake):
    servicer, router = fake
    for rid in ("r1", "r2"):
        assert (await router.choose(request(rid))).source == SCHEDULER
    router.report("r1", 4, prefill_done=True)
    router.release("r2", scheduler_pb2.RELEASE_REASON_FINISHED)
    await router.close()
    assert [(r.request_id, r.generated_tokens) for batch in servicer.reports for r in batch.reports] == [("r1", 4)]
    assert servicer.releases == ["r2"]
    if isinstance(servicer, SessionFake):  # two schedules, the report and the release: no unary call
        assert servicer.session_messages == 4


async def test_concurrent_schedules_on_one_session_each_get_their_own_answer(fake):
    servicer, router = fake
    servicer.delay = 0.05
    decisions = await asyncio.gather(*(router.choose(request(f"r{i}")) for i in range(20)))
    assert [d.source for d in decisions] == [SCHEDULER] * 20
    assert not router.breaker.is_open


async def test_an_unreachable_scheduler_falls_back_rather_than_answering_503():
    """A dead channel's UNAVAILABLE has no answered trailer: route round-robin, never refuse."""
    scheduler = GrpcScheduler(f"127.0.0.1:{free_port()}", 0.5, 0.01, session=False)
    router = Router(scheduler, INSTANCES, CircuitBreaker(5, 60))
    try:
        assert (await router.choose(request())).source == FALLBACK
    finally:
        await router.close()
