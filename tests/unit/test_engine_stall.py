"""Full mode finds a hung engine: its statuses keep coming, fresh, while requests sit on it and its step count
stands still (the llumlet refreshes its record whatever the engine does; vLLM's /health asks whether the engine
process lives, not whether it steps). Out after --engine-stall-seconds, back on probation once it steps."""

from __future__ import annotations

from typing import Any

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.types import RequestInfo
from tests.unit.test_cms_validation import Clocks, core, meta

STALL_S = 30.0


class Engine:
    """One engine's llumlet: a status every `every_s` at the scheduler's wall clock."""

    def __init__(self, c: SchedulerCore, clocks: Clocks, name: str, host: str, **load: Any) -> None:
        self.c, self.clocks, self.name, self.load = c, clocks, name, load
        self.update_id, self.step = 0, 1
        c.apply_metadata(meta(name, host=host))

    def report(self, steps: int = 0, **load: Any) -> None:
        self.update_id += 1
        self.step += steps
        fields = {**self.load, **load}
        self.c.apply_status(cms_pb2.InstanceStatus(
            instance_id=self.name, update_id=self.update_id, timestamp_ms=int(self.clocks.wall * 1000),
            schedulable=True, step_id=self.step, **fields,
        ))  # fmt: skip


def fleet(**kw: Any) -> tuple[SchedulerCore, Clocks, Engine, Engine]:
    clocks = Clocks()
    c = core(clocks, engine_stall_seconds=STALL_S, **kw)
    a = Engine(c, clocks, "a", "10.0.0.1", num_running=2)
    b = Engine(c, clocks, "b", "10.0.0.2", num_running=6, num_waiting=4)  # busier: a wins while it is live
    return c, clocks, a, b


def run(clocks: Clocks, seconds: float, *engines: Engine, steps: tuple[int, ...] = ()) -> None:
    """`seconds` pass in 5 s beats, each engine reporting once a beat with its steps per beat (0: stands still)."""
    for _ in range(int(seconds // 5)):
        clocks.advance(5)
        for engine, n in zip(engines, steps, strict=True):
            engine.report(n)


def target(c: SchedulerCore, rid: str) -> str:
    decision = c.schedule(RequestInfo(rid, "m", prompt_tokens=100))
    c.release(rid)
    return decision.target.instance_id


def ejections(c: SchedulerCore, name: str) -> int:
    return c.health.ejections(name)["stalled"]


def test_an_engine_with_requests_and_no_step_for_the_stall_period_is_out_until_it_steps() -> None:
    c, clocks, a, b = fleet()
    a.report(), b.report()
    assert target(c, "r0") == "a"
    run(clocks, STALL_S - 5, a, b, steps=(0, 3))  # fresh statuses, a's step standing still: not yet
    assert target(c, "r1") == "a" and not c.health.is_ejected("a")
    run(clocks, 5, a, b, steps=(0, 3))
    assert c.health.is_ejected("a") and ejections(c, "a") == 1
    assert target(c, "r2") == "b"
    run(clocks, 60, a, b, steps=(0, 3))  # still hung: still out, ejected once
    assert target(c, "r3") == "b" and ejections(c, "a") == 1
    a.report(steps=1)  # it steps again
    assert not c.health.is_ejected("a") and c.health.on_probation("a")
    assert target(c, "r4") == "a"


def test_an_idle_engine_or_one_that_steps_is_never_stalled() -> None:
    c, clocks, a, b = fleet()
    a.report(num_running=0), b.report()
    run(clocks, 5 * STALL_S, b, steps=(3,))  # a idle: the same step for minutes, and nothing on it
    a.report(num_running=0)
    run(clocks, 5 * STALL_S, a, b, steps=(1, 3))  # a busy and stepping
    assert ejections(c, "a") == 0 and target(c, "r") == "a"


def test_an_engine_stalled_then_idle_is_back_and_a_writer_without_steps_is_not_judged() -> None:
    c, clocks, a, b = fleet()
    a.report(), b.report()
    run(clocks, STALL_S, a, b, steps=(0, 3))
    assert c.health.is_ejected("a")
    a.report(num_running=0)  # its requests ended (aborted): nothing hangs there any more
    assert not c.health.is_ejected("a")
    c2, clocks2, a2, b2 = fleet()
    a2.step = b2.step = 0  # a writer that counts no steps (step_id 0) says nothing of stalls
    a2.report(), b2.report()
    run(clocks2, 3 * STALL_S, a2, b2, steps=(0, 0))
    assert ejections(c2, "a") == 0


def test_the_stall_check_is_off_at_zero() -> None:
    clocks = Clocks()
    c = core(clocks, engine_stall_seconds=0)
    a = Engine(c, clocks, "a", "10.0.0.1", num_running=2)
    a.report()
    run(clocks, 3 * STALL_S, a, steps=(0,))
    assert ejections(c, "a") == 0 and not c.health.is_ejected("a")


def test_requests_waiting_with_none_running_are_no_stall() -> None:
    """A decode engine waiting for a prefill's KV, or a grammar still compiling: requests it cannot schedule
    yet, no step taken, and nothing hung."""
    c, clocks, a, b = fleet()
    a.report(num_running=0, num_waiting=3), b.report()
    run(clocks, 3 * STALL_S, b, steps=(3,))
    a.report(num_running=0, num_waiting=3)
    assert ejections(c, "a") == 0 and not c.health.is_ejected("a")
