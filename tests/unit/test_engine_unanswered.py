"""Lite mode finds an engine whose HTTP side takes streamed requests and answers none while its /health answers
(the prober's signal): the ext_proc reports each stream's first token, and an engine that gives none at all for
--engine-first-token-seconds while the others give theirs counts each such request against it; two in a row
eject it. Nothing is judged where the gateway reports no first tokens, nor non-streamed requests (their answer
comes whole, at its end)."""

from __future__ import annotations

import random

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.health import UNADMITTED
from pilotfish.scheduler.view.types import RequestInfo
from tests.unit.test_scheduler_health import Clock

DUE_S = 30.0
FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED


def lite(clock: Clock, **overrides: object) -> SchedulerCore:
    values: dict[str, object] = {"instances": ["a=10.0.0.1:8000", "b=10.0.0.2:8000"], "model": ["m"]}
    values.update(overrides)
    return SchedulerCore(SchedulerConfig(**values), clock=clock, rng=random.Random(0))  # type: ignore[arg-type]


ADDRESSES = {"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"}


class Traffic:
    """Requests sent to a chosen engine (the gateway's subset hint), each held until the test answers it."""

    def __init__(self, core: SchedulerCore, clock: Clock) -> None:
        self.core, self.clock, self.n = core, clock, 0

    def to(self, engine: str, stream: bool = True) -> str:
        self.n += 1
        rid = f"r{self.n}"
        subset = frozenset({ADDRESSES[engine]})
        decision = self.core.schedule(RequestInfo(rid, "m", prompt_tokens=8, stream=stream, candidate_addresses=subset))
        assert decision.target.instance_id == engine
        return rid

    def wait(self, seconds: float, answering: str = "b") -> None:
        """`seconds` pass in 1 s beats; each beat one request to `answering` gets its first token and ends."""
        for _ in range(int(seconds)):
            self.clock.now += 1
            rid = self.to(answering)
            self.core.report(rid, 1, prefill_done=True)
            self.core.release(rid, FINISHED)
            self.core.expire()


def ejections(core: SchedulerCore, name: str = "a") -> int:
    return core.health.ejections(name)[UNADMITTED]


def test_an_engine_that_answers_no_stream_is_ejected_after_two() -> None:
    clock = Clock()
    core = lite(clock)
    traffic = Traffic(core, clock)
    traffic.to("a")
    traffic.wait(1)
    traffic.to("a")
    traffic.wait(DUE_S - 1)
    assert not core.health.is_ejected("a")  # the first is due, not yet the second
    traffic.wait(2)
    assert core.health.is_ejected("a") and ejections(core) == 1


def test_an_engine_that_gives_first_tokens_is_never_judged_however_long_its_requests_wait() -> None:
    clock = Clock()
    core = lite(clock)
    traffic = Traffic(core, clock)
    waiting = [traffic.to("a") for _ in range(3)]  # queued behind a long prefill
    for _ in range(int(3 * DUE_S)):
        traffic.wait(1)
        rid = traffic.to("a")  # a gives first tokens all along, to requests sent later
        core.report(rid, 1, prefill_done=True)
    assert all(core._lrs.get(rid) is not None for rid in waiting) and ejections(core) == 0


def test_a_busy_engine_that_finishes_requests_is_not_judged() -> None:
    """Its KV full of long answers, new streams wait there past the period with no first token while the other
    engine gives them; its answers finishing say it works."""
    clock = Clock()
    core = lite(clock)
    traffic = Traffic(core, clock)
    running = [traffic.to("a") for _ in range(20)]
    for rid in running:
        core.report(rid, 1, prefill_done=True)
    queued = [traffic.to("a") for _ in range(2)]
    for _ in range(int(3 * DUE_S / 5)):
        traffic.wait(5)
        core.release(running.pop(), FINISHED)  # one answer ends every 5 s; the queued ones still wait
    assert all(core._lrs.get(rid) is not None for rid in queued) and ejections(core) == 0


def test_non_streamed_requests_are_not_judged() -> None:
    clock = Clock()
    core = lite(clock)
    traffic = Traffic(core, clock)
    traffic.to("a", stream=False), traffic.to("a", stream=False)  # long answers that come whole at the end
    traffic.wait(3 * DUE_S)
    assert ejections(core) == 0


def test_nothing_is_judged_where_the_gateway_reports_no_first_tokens() -> None:
    clock = Clock()
    core = lite(clock)
    for _ in range(4):
        core.schedule(RequestInfo(f"q{_}", "m", prompt_tokens=8, stream=True))
    for _ in range(int(3 * DUE_S)):
        clock.now += 1
        core.expire()
    assert ejections(core) == 0 and ejections(core, "b") == 0


def test_zero_turns_the_rule_off() -> None:
    clock = Clock()
    core = lite(clock, engine_first_token_seconds=0.0)
    traffic = Traffic(core, clock)
    traffic.to("a"), traffic.to("a")
    traffic.wait(3 * DUE_S)
    assert ejections(core) == 0
