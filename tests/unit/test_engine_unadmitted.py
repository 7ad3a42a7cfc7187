"""Full mode finds an engine whose HTTP side takes requests and passes none to its engine (a hung API-server loop,
a proxy in front of it): its llumlet keeps reporting an idle engine and /health answers, so it looks like the
least loaded engine of all. A request its statuses do not list as admitted within --engine-admission-seconds,
while they keep coming and it admits no request at all since, counts against it; two in a row eject it."""

from __future__ import annotations

from typing import Any

from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.health import UNADMITTED
from pilotfish.scheduler.view.account import InflightAccount
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView, RequestInfo
from tests.unit.test_cms_validation import Clocks, core
from tests.unit.test_engine_stall import Engine

ADMISSION_S = 10.0


def fleet(**kw: Any) -> tuple[SchedulerCore, Clocks, Engine, Engine]:
    clocks = Clocks()
    c = core(clocks, **{"engine_admission_seconds": ADMISSION_S, **kw})
    a = Engine(c, clocks, "a", "10.0.0.1")
    b = Engine(c, clocks, "b", "10.0.0.2", num_running=64, num_waiting=64)  # busy: a wins while it looks idle
    a.report(), b.report()
    return c, clocks, a, b


def send(c: SchedulerCore, rid: str) -> str:
    """Schedule a request and keep it open (the gateway holds it until the engine answers)."""
    return c.schedule(RequestInfo(rid, "m", prompt_tokens=100)).target.instance_id


def wait(c: SchedulerCore, clocks: Clocks, seconds: float, *engines: Engine, **admitted: list[str]) -> None:
    """`seconds` pass in 1 s beats; each engine reports every beat (its llumlet's refresh), listing the ids
    `admitted[name]` names; the scheduler's periodic expiry runs each beat."""
    for _ in range(int(seconds)):
        clocks.advance(1)
        for engine in engines:
            engine.report(admitted_request_ids=admitted.get(engine.name, []))
        c.expire()


def ejections(c: SchedulerCore, name: str) -> int:
    return c.health.ejections(name)[UNADMITTED]


def test_an_engine_that_admits_nothing_it_is_sent_is_ejected_and_back_on_probation() -> None:
    c, clocks, a, b = fleet()
    assert send(c, "r0") == "a" and send(c, "r1") == "a"  # a looks idle: both go there, neither is admitted
    wait(c, clocks, ADMISSION_S - 1, a, b)
    assert not c.health.is_ejected("a")  # not yet: the admission period has not passed
    wait(c, clocks, 2, a, b)
    assert c.health.is_ejected("a") and ejections(c, "a") == 1
    assert send(c, "r2") == "b"
    wait(c, clocks, 5, a, b, b=["r2"])  # the backoff (5 s) ends: on probation
    assert not c.health.is_ejected("a") and c.health.on_probation("a")
    c.release("r0"), c.release("r1")  # their clients gave up
    assert send(c, "r3") == "a"
    wait(c, clocks, ADMISSION_S + 1, a, b)  # on probation one unadmitted request ejects it again
    assert c.health.is_ejected("a") and ejections(c, "a") == 2


def test_a_request_sent_before_the_ejection_does_not_eject_it_again_on_probation() -> None:
    """The server recovered while out; a request it swallowed before, judged once it is back, says nothing of it
    since (the ejection's backoff would otherwise double for nothing)."""
    c, clocks, a, b = fleet()
    assert send(c, "r0") == "a" and send(c, "r1") == "a"
    wait(c, clocks, 6, a, b)
    assert send(c, "r2") == "a"  # swallowed too, but due only after the ejection's 5 s
    wait(c, clocks, 5, a, b)
    assert c.health.is_ejected("a") and ejections(c, "a") == 1
    wait(c, clocks, 7, a, b)  # back on probation; r2 judged now
    assert not c.health.is_ejected("a") and ejections(c, "a") == 1


def test_an_engine_that_admits_what_it_is_sent_is_never_ejected_however_long_its_requests_run() -> None:
    c, clocks, a, b = fleet()
    assert send(c, "r0") == "a"
    wait(c, clocks, 1, a, b, a=["r0"])
    assert send(c, "r1") == "a"
    wait(c, clocks, 1, a, b, a=["r0", "r1"])
    wait(c, clocks, 10 * ADMISSION_S, a, b)  # both still running (held open), long past the period
    assert not c.health.is_ejected("a") and ejections(c, "a") == 0


def test_one_slow_request_among_admitted_ones_is_not_held_against_the_engine() -> None:
    """A request the server is slow to pass on for a reason of its own (fetching the images of its prompt): the
    engine admits what is sent after it, so the engine works."""
    c, clocks, a, b = fleet()
    assert send(c, "slow") == "a"
    wait(c, clocks, 1, a, b)
    assert send(c, "r1") == "a"
    wait(c, clocks, 1, a, b, a=["r1"])
    c.release("r1")
    wait(c, clocks, 2 * ADMISSION_S, a, b)
    assert not c.health.is_ejected("a") and ejections(c, "a") == 0


def test_a_server_slow_to_pass_on_every_request_is_load_not_a_failure() -> None:
    """Each request reaches the engine 12 s after it was sent: the engine admits requests all along, so only the
    first (judged before anything was admitted) counts; the ranking sees the rest as load."""
    c, clocks, a, b = fleet()
    assert send(c, "r0") == "a"
    wait(c, clocks, 5, a, b)
    assert send(c, "r1") == "a"
    wait(c, clocks, 6, a, b)  # r0 judged at 10 s: nothing admitted yet, it counts
    wait(c, clocks, 6, a, b, a=["r0"])  # r0 admitted at 12 s; r1, still not, judged at 15 s: not counted
    assert not c.health.is_ejected("a") and ejections(c, "a") == 0
    assert c.account.holds(next(e for e in c.account if e.request_id == "r1"))  # still load on a


def test_one_unadmitted_request_does_not_eject_and_a_served_request_forgets_it() -> None:
    c, clocks, a, b = fleet()
    assert send(c, "slow0") == "a"
    wait(c, clocks, ADMISSION_S + 1, a, b)  # counted once: not enough
    c.release("slow0")
    assert send(c, "r1") == "a"
    wait(c, clocks, 1, a, b, a=["r1"])
    c.release("r1", reason=1)  # served to its end (RELEASE_REASON_FINISHED): the count starts over
    assert send(c, "slow1") == "a"
    wait(c, clocks, ADMISSION_S + 1, a, b)
    assert not c.health.is_ejected("a")
    assert send(c, "slow2") == "a"  # a second in a row ejects it
    wait(c, clocks, ADMISSION_S + 1, a, b)
    assert c.health.is_ejected("a")


def test_an_engine_whose_statuses_stopped_is_left_to_the_staleness_rule() -> None:
    """No status came after the request was sent: nothing says whether the engine admitted it."""
    c, clocks, _, b = fleet(instance_staleness_seconds=1000.0)
    assert send(c, "r0") == "a" and send(c, "r1") == "a"
    wait(c, clocks, 2 * ADMISSION_S, b)  # a's llumlet silent
    assert ejections(c, "a") == 0


def test_zero_turns_the_rule_off() -> None:
    c, clocks, a, b = fleet(engine_admission_seconds=0.0)
    assert send(c, "r0") == "a" and send(c, "r1") == "a"
    wait(c, clocks, 3 * ADMISSION_S, a, b)
    assert ejections(c, "a") == 0


def test_the_account_judges_neutral_and_prefill_entries_once_and_never_decode_ones() -> None:
    """A decode engine gets its request only once a prefill elsewhere is done: its admission may come late."""
    now = [0.0]
    account = InflightAccount(300.0, 1.0, clock=lambda: now[0], overdue_seconds=ADMISSION_S)
    kinds = {"n": InferType.NEUTRAL, "p": InferType.PREFILL, "d": InferType.DECODE}
    views = {k: InstanceView(Endpoint(k, f"10.0.0.{i}:8000", t)) for i, (k, t) in enumerate(kinds.items())}
    for name, inst in views.items():
        account.dispatch(f"r-{name}", inst, 100)
        account.dispatch(f"admitted-{name}", inst, 100)
        account.apply_status(inst, [f"admitted-{name}"], gap=False)
    now[0] = ADMISSION_S - 0.5
    assert account.overdue() == []
    now[0] = ADMISSION_S
    assert sorted(e.request_id for e in account.overdue()) == ["r-n", "r-p"]
    assert account.overdue() == []  # each once
    assert set(account.admitted_at) == {"n", "p", "d"}
