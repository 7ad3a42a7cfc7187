"""Engine health in the scheduling core (scheduler/health.py): outlier ejection from the gateway's
Release reasons and served-elsewhere reports, growing backoff, probation, health probes, and that
an ejected engine is never picked while a failing one never looks idle."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from pilotfish.config import ConfigError
from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig, probes_enabled, validate
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.health import PASSIVE, PROBE, TRIAL_SECONDS, EngineHealth, HealthProber
from pilotfish.scheduler.view.types import RequestInfo

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
UPSTREAM = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
GATEWAY = scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR
UNSPECIFIED = scheduler_pb2.RELEASE_REASON_UNSPECIFIED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock, **overrides: object) -> SchedulerCore:
    values: dict[str, object] = {
        "instances": ["a=10.0.0.1:8000", "b=10.0.0.2:8000"],
        "model": ["m"],
        "fallback_count": 1,
        "outlier_consecutive_failures": 3,
        "outlier_base_ejection_seconds": 5.0,
        "outlier_max_ejection_seconds": 12.0,
    }
    values.update(overrides)
    return SchedulerCore(SchedulerConfig(**values), clock=clock, rng=random.Random(0))  # type: ignore[arg-type]


_ids = iter(range(1_000_000))


def schedule(core: SchedulerCore) -> tuple[str, str]:
    rid = f"r{next(_ids)}"
    return rid, core.schedule(RequestInfo(request_id=rid, model="m", prompt_tokens=4)).target.instance_id


def fail_on(core: SchedulerCore, instance: str, n: int = 1, reason: int = UPSTREAM) -> None:
    """Schedule until `n` requests have landed on `instance`, releasing each with `reason`; the
    others stay held (so the failing engine is the least loaded, as a black hole is)."""
    done = 0
    while done < n:
        rid, target = schedule(core)
        if target == instance:
            core.release(rid, reason)
            done += 1


def succeed_on(core: SchedulerCore, instance: str) -> None:
    while True:
        rid, target = schedule(core)
        if target == instance:
            core.release(rid, FINISHED)
            return


# -- the tracker alone: ejection, backoff, probation, probes -----------------------------------------


@pytest.mark.parametrize(
    ("events", "ejected_after"),
    [
        # consecutive failures eject at the third
        (["f", "f"], False),
        (["f", "f", "f"], True),
        # a success resets the run
        (["f", "f", "s", "f", "f"], False),
        (["f", "f", "s", "f", "f", "f"], True),
        # aborts and gateway errors say nothing of the engine: not events of the tracker at all
        # probes: two failed in a row eject, one success lets back
        (["p-", "p-"], True),
        (["p-", "p+", "p-"], False),
        (["p-", "p-", "p+"], False),
        # a probe success does not end a passive ejection (an engine may answer /health and 5xx)...
        (["f", "f", "f", "p+"], True),
        # ...unless a probe failed during it: the engine was down and is back (restarted)
        (["f", "f", "f", "p-", "p+"], False),
        (["f", "f", "f", "p-", "p+", "f"], True),  # on probation: one failure is enough
    ],
)
def test_ejection_table(events: list[str], ejected_after: bool) -> None:
    clock = Clock()
    health = EngineHealth(3, 5.0, 60.0, probe_failures=2, clock=clock)
    for e in events:
        if e == "f":
            health.failure("a")
        elif e == "s":
            health.success("a")
        else:
            health.probe("a", e == "p+")
    assert health.is_ejected("a") is ejected_after


@pytest.mark.parametrize(
    ("ejections", "seconds"),
    [(1, 5.0), (2, 10.0), (3, 12.0), (4, 12.0)],  # base x count, capped at max
)
def test_backoff_grows_with_each_ejection_in_a_row_and_is_capped(ejections: int, seconds: float) -> None:
    clock = Clock()
    health = EngineHealth(3, 5.0, 12.0, clock=clock)
    for k in range(ejections):
        if k == 0:
            for _ in range(3):
                health.failure("a")
        else:
            health.failure("a")  # on probation: one failure ejects again
        assert health.is_ejected("a")
        start = clock.now
        clock.now = start + (min(5.0 * (k + 1), 12.0)) - 0.001
        health.tick()
        assert health.is_ejected("a"), f"ejection {k + 1} ended early"
        clock.now = start + min(5.0 * (k + 1), 12.0)
        health.tick()
        assert not health.is_ejected("a") and health.on_probation("a")
    assert health.ejections("a")[PASSIVE] == ejections
    assert min(5.0 * ejections, 12.0) == seconds


def test_one_success_on_probation_forgives_every_ejection_before() -> None:
    clock = Clock()
    health = EngineHealth(3, 5.0, 60.0, clock=clock)
    for _ in range(3):
        health.failure("a")
    clock.now += 5
    health.tick()
    health.failure("a")  # probation: ejected again, 10 s
    clock.now += 10
    health.tick()
    assert health.on_probation("a")
    health.success("a")
    assert not health.on_probation("a")
    # forgiven: the next ejection takes three failures again, and lasts the base again
    health.failure("a")
    health.failure("a")
    assert not health.is_ejected("a")
    health.failure("a")
    assert health.is_ejected("a")
    clock.now += 5
    health.tick()
    assert not health.is_ejected("a")


def test_probe_ejection_lasts_until_a_probe_succeeds_then_probation() -> None:
    clock = Clock()
    health = EngineHealth(3, 5.0, 60.0, probe_failures=2, clock=clock)
    health.probe("a", False)
    health.probe("a", False)
    assert health.is_ejected("a") and health.ejections("a")[PROBE] == 1
    clock.now += 3600
    health.tick()
    assert health.is_ejected("a"), "a probe ejection has no timer: only a probe lets it back"
    health.probe("a", True)
    assert not health.is_ejected("a") and health.on_probation("a")
    health.failure("a")  # probation: one upstream failure is enough
    assert health.is_ejected("a") and health.ejections("a")[PASSIVE] == 1


def test_off_when_consecutive_failures_is_zero() -> None:
    health = EngineHealth(0, 5.0, 60.0)
    for _ in range(100):
        assert health.failure("a", "r") == ["r"]  # nothing held either
    assert not health.is_ejected("a")


# -- in the core: not picked, not idle, reasons, served elsewhere -------------------------------------


@pytest.mark.parametrize(
    ("reason", "ejects"),
    [
        (UPSTREAM, True),
        (scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET, True),  # the engine cut a stream mid-response
        (FINISHED, False),
        (ABORT, False),
        (GATEWAY, False),
        (UNSPECIFIED, False),
    ],
)
def test_only_upstream_errors_count_as_failures(reason: int, ejects: bool) -> None:
    core = make_core(Clock())
    fail_on(core, "a", 3, reason)
    assert core.health.is_ejected("a") is ejects


def test_an_ejected_engine_is_not_picked_until_its_ejection_runs_out() -> None:
    clock = Clock()
    core = make_core(clock)
    fail_on(core, "a", 3)
    assert core.health.is_ejected("a")
    picks = [schedule(core) for _ in range(20)]
    assert {target for _, target in picks} == {"b"}
    decision = core.schedule(RequestInfo(request_id="one-more", model="m"))
    assert decision.fallbacks == (), "an ejected engine is no fallback either"
    clock.now += 5.0
    assert schedule(core)[1] == "a", "back on probation, and the least loaded"


def test_every_engine_ejected_picks_among_all_rather_than_refuse() -> None:
    core = make_core(Clock())
    for inst in ("a", "b"):
        for _ in range(3):
            core.health.failure(inst)
    assert core.health.ejected == {"a", "b"}
    assert schedule(core)[1] in {"a", "b"}


def test_a_request_released_as_an_upstream_error_keeps_its_load_until_the_run_ends() -> None:
    clock = Clock()
    core = make_core(clock)
    rid, target = schedule(core)
    assert target == "a"
    core.release(rid, UPSTREAM)
    assert core.load("a").num_requests == 1, "a failed-fast request must not make its engine look idle"
    # the next pick goes to b, not to the failing engine
    assert schedule(core)[1] == "b"
    # a success on a ends the run: the held failure's load goes
    rid2 = "ok"
    core.schedule(RequestInfo(request_id=rid2, model="m"))
    assert core.release(rid2, FINISHED)
    assert core.load("a").num_requests == 0


def test_held_failures_go_when_the_engine_is_ejected_or_after_the_base_ejection_time() -> None:
    clock = Clock()
    core = make_core(clock)
    fail_on(core, "a", 2)
    assert core.load("a").num_requests == 2
    fail_on(core, "a", 1)  # the third ejects: nothing held on an engine nobody picks
    assert core.health.is_ejected("a") and core.load("a").num_requests == 0

    core2 = make_core(clock)
    fail_on(core2, "a", 1)
    assert core2.load("a").num_requests == 1
    clock.now += 5.0
    core2.expire()
    assert core2.load("a").num_requests == 0, "a hold is bounded in time: the account drains"


def test_black_hole_closed_a_dead_engine_takes_a_bounded_number_of_requests() -> None:
    """Every request sent to `a` fails at once (and is released at once); b serves for long. Without
    health, a would take every pick; with it, a takes the three that eject it and no more."""
    clock = Clock()
    core = make_core(clock)
    on_a = 0
    for _ in range(200):
        rid, target = schedule(core)
        if target == "a":
            on_a += 1
            core.release(rid, UPSTREAM)
    assert on_a == 3

    off = make_core(clock, outlier_consecutive_failures=0)
    on_a = 0
    for _ in range(200):
        rid, target = schedule(off)
        if target == "a":
            on_a += 1
            off.release(rid, UPSTREAM)
    assert on_a > 150, "the control: without ejection the dead engine is a black hole"


def test_a_request_served_elsewhere_is_a_failure_of_the_engine_it_was_scheduled_on() -> None:
    """Envoy retried it on the next endpoint: the first failed before its first byte."""
    core = make_core(Clock())
    moved = 0
    while moved < 3:
        rid, target = schedule(core)
        if target == "a":
            assert core.reroute(rid, "10.0.0.2:8000")
            core.release(rid, FINISHED)  # a success of b, where it was served
            moved += 1
            assert core.health.is_ejected("a") is (moved == 3)
    assert not core.health.is_ejected("b")


def test_probe_results_eject_and_let_back_through_the_core() -> None:
    core = make_core(Clock(), health_probe_failures=2)
    core.probe_result("a", False)
    assert not core.health.is_ejected("a")
    core.probe_result("a", False)
    assert core.health.is_ejected("a")
    assert {schedule(core)[1] for _ in range(5)} == {"b"}
    core.probe_result("a", True)
    assert not core.health.is_ejected("a")
    core.probe_result("nobody", False)  # an engine that left: ignored


def test_removing_an_ejected_instance_forgets_it() -> None:
    core = make_core(Clock())
    fail_on(core, "a", 3)
    assert core.remove_instance("a")
    assert core.health.ejected == set()


def test_metrics_count_ejections_and_show_who_is_out() -> None:
    core = make_core(Clock())
    fail_on(core, "a", 3)
    text = generate_latest(core.registry).decode()
    assert 'pilotfish_scheduler_ejections_total{engine="a",reason="upstream_errors"} 1.0' in text
    assert 'pilotfish_scheduler_ejections_total{engine="b",reason="health_probes"} 0.0' in text
    assert 'pilotfish_scheduler_instance_ejected{engine="a"} 1.0' in text
    assert 'pilotfish_scheduler_instance_ejected{engine="b"} 0.0' in text


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "enabled"),
    [
        ({}, True),
        ({"health_probes": "off"}, False),
        ({"enable_full_mode_scheduling": True}, False),
        ({"enable_full_mode_scheduling": True, "health_probes": "on"}, True),
    ],
)
def test_probes_auto_on_in_lite_mode_only(fields: dict[str, object], enabled: bool) -> None:
    assert probes_enabled(SchedulerConfig(**fields)) is enabled  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"health_probes": "sometimes"},
        {"outlier_base_ejection_seconds": 10.0, "outlier_max_ejection_seconds": 5.0},
        {"health_probe_path": "health"},
    ],
)
def test_bad_health_settings_fail_at_start(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        validate(SchedulerConfig(**fields))  # type: ignore[arg-type]


# -- the prober against real HTTP servers on loopback -------------------------------------------------


def test_prober_ejects_an_engine_that_stops_answering_and_lets_it_back() -> None:
    async def run() -> None:
        healthy = {"value": True}

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if healthy["value"] else 503)

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # b's port has nothing listening: refused from the first probe
        from pilotfish.procs import free_port

        config = SchedulerConfig(
            instances=[f"a=127.0.0.1:{port}", f"b=127.0.0.1:{free_port()}"],
            health_probe_interval_seconds=0.05,
            health_probe_timeout_seconds=1.0,
            health_probe_failures=2,
        )
        core = SchedulerCore(config)
        prober = HealthProber(core, config)
        task = asyncio.create_task(prober.run())

        async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
            for _ in range(2000):
                if condition():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(what)

        try:
            await until(lambda: core.health.is_ejected("b"), "b (refusing connections) ejected")
            assert not core.health.is_ejected("a")
            healthy["value"] = False
            await until(lambda: core.health.is_ejected("a"), "a (answering 503) ejected")
            healthy["value"] = True
            await until(lambda: not core.health.is_ejected("a"), "a back after a good probe")
            assert core.health.is_ejected("b")
        finally:
            task.cancel()
            await runner.cleanup()

    asyncio.run(run())


# -- half-open probation: one trial request at a time --------------------------------------------------


def on_probation(clock: Clock, **overrides: object) -> SchedulerCore:
    core = make_core(clock, **overrides)
    fail_on(core, "a", 3)
    clock.now += 5.0
    core.expire()
    assert core.health.on_probation("a") and not core.health.is_ejected("a")
    return core


def test_an_engine_on_probation_takes_one_trial_request_until_a_verdict() -> None:
    clock = Clock()
    core = on_probation(clock)
    trial, target = schedule(core)
    assert target == "a"  # the least loaded takes its trial
    picks = [schedule(core)[1] for _ in range(10)]
    assert set(picks) == {"b"}, "no second request while the trial runs"
    assert not core.health.is_ejected("a")  # passed over, not ejected (the metric says so)
    core.release(trial, FINISHED)  # the trial succeeds: a takes its share again
    assert not core.health.on_probation("a")
    assert schedule(core)[1] == "a"


def test_a_trial_that_fails_ejects_again_and_one_the_client_drops_lets_another_try() -> None:
    clock = Clock()
    core = on_probation(clock)
    trial, _ = schedule(core)
    core.release(trial, ABORT)  # no verdict: the next request may try
    trial, target = schedule(core)
    assert target == "a"
    core.release(trial, UPSTREAM)
    assert core.health.is_ejected("a") and core.health.ejections("a")[PASSIVE] == 2


def test_a_trial_the_engine_passes_on_ends_it_and_one_without_a_verdict_ends_after_a_while() -> None:
    clock = Clock()
    core = on_probation(clock)
    schedule(core)
    core.health.admitted("a")  # a status names it admitted (full mode) or it gives its first token (lite)
    assert schedule(core)[1] == "a" and core.health.on_probation("a")  # the next one is a new trial
    assert schedule(core)[1] == "b"
    clock.now += TRIAL_SECONDS
    core.expire()  # the trial got no verdict in time: another may try
    assert schedule(core)[1] == "a"


def test_an_engine_on_trial_never_lets_an_ejected_one_back_in() -> None:
    """Passed over is not ejected: with a on trial and b ejected, a takes every pick (the all-ejected rule would
    have made b, the dead one, a candidate again)."""
    clock = Clock()
    core = on_probation(clock)
    schedule(core)  # a's trial
    for _ in range(3):
        core.health.failure("b")
    assert core.health.is_ejected("b")
    assert {schedule(core)[1] for _ in range(6)} == {"a"}
