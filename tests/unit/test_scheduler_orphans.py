"""A gateway whose Session ends with requests held is gone: its requests are dropped after the
orphan grace unless a report or a release reaches them first (the ext_proc killed mid-load)."""

from __future__ import annotations

import random

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.service import SchedulerServicer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def schedule(seq: int, request_id: str) -> scheduler_pb2.SessionRequest:
    request = scheduler_pb2.ScheduleRequest(request_id=request_id, model="m", prompt_tokens=10)
    return scheduler_pb2.SessionRequest(seq=seq, schedule=request)


def release(request_id: str) -> scheduler_pb2.SessionRequest:
    return scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id=request_id, reason=1))


def held(core: SchedulerCore) -> int:
    return sum(i.lrs.num_requests for i in core.instances())


def make() -> tuple[SchedulerCore, SchedulerServicer, Clock]:
    clock = Clock()
    config = SchedulerConfig(instances=["a:1", "b:2"], model=["m"], orphan_grace_seconds=5.0)
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    return core, SchedulerServicer(core), clock


def test_a_sessions_unreleased_requests_are_dropped_after_the_grace() -> None:
    core, servicer, clock = make()
    answer = servicer.answerer("127.0.0.1")
    for i in range(3):
        assert answer(schedule(i, f"r{i}")).WhichOneof("kind") == "schedule"
    answer(release("r0"))  # released by its gateway: not an orphan
    answer.close()  # the gateway is gone
    assert held(core) == 2
    clock.now += 4.9
    core.expire()
    assert held(core) == 2  # within the grace: still counted (the engines are still serving them)
    clock.now += 0.2
    core.expire()
    assert held(core) == 0


def test_an_orphan_that_is_heard_of_again_is_kept() -> None:
    """A Session that broke while its gateway lives: the gateway's reports keep its requests."""
    core, servicer, clock = make()
    answer = servicer.answerer("127.0.0.1")
    answer(schedule(1, "live"))
    answer(schedule(2, "dead"))
    answer.close()
    clock.now += 1
    core.report("live", 3, prefill_done=True)  # from the same gateway, over a new Session or unary
    clock.now += 10
    core.expire()
    assert held(core) == 1 and core.release("live")


def test_another_sessions_requests_are_untouched() -> None:
    core, servicer, clock = make()
    first, second = servicer.answerer("127.0.0.1"), servicer.answerer("127.0.0.2")
    first(schedule(1, "mine"))
    second(schedule(1, "theirs"))
    first.close()
    clock.now += 10
    core.expire()
    assert held(core) == 1 and core.release("theirs")
