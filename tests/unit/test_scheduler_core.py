"""The scheduling core in lite mode: the LRS account through schedule, report, release and expiry."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig, parse_instance
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NoSchedulableInstanceError,
    UnknownModelError,
)
from pilotfish.scheduler.view.types import Endpoint, InstanceView, RequestInfo

INSTANCES = ["a:1", "b:2", "c:3"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock | None = None, **overrides: object) -> SchedulerCore:
    values: dict[str, object] = {"instances": INSTANCES, "model": ["m"], "fallback_count": 2}
    values.update(overrides)
    return SchedulerCore(SchedulerConfig(**values), clock=clock or Clock(), rng=random.Random(0))  # type: ignore[arg-type]


def req(request_id: str, prompt_tokens: int = 10, model: str = "m") -> RequestInfo:
    return RequestInfo(request_id=request_id, model=model, prompt_tokens=prompt_tokens)


def loads(core: SchedulerCore) -> dict[str, tuple[int, int]]:
    return {i.instance_id: (i.lrs.num_requests, i.lrs.num_tokens) for i in core.instances()}


def test_dispatch_raises_load_at_once() -> None:
    core = make_core()
    decision = core.schedule(req("r1", prompt_tokens=100))
    assert decision.target == Endpoint("a:1", "a:1")
    assert [e.instance_id for e in decision.fallbacks] == ["b:2", "c:3"]
    assert loads(core) == {"a:1": (1, 100), "b:2": (0, 0), "c:3": (0, 0)}
    assert core.account_size == 1


def test_consecutive_schedules_spread_across_instances() -> None:
    core = make_core()
    targets = [core.schedule(req(f"r{i}")).target.instance_id for i in range(6)]
    assert targets == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3"]
    assert {n for n, _ in loads(core).values()} == {2}


def test_num_tokens_metric_balances_tokens() -> None:
    core = make_core(dispatch_load_metric="num_tokens")
    core.schedule(req("big", prompt_tokens=1000))
    core.schedule(req("small1", prompt_tokens=10))
    # b has 10 tokens, c none: c, then b (10 < 1000), and only then a
    assert core.schedule(req("x", prompt_tokens=10)).target.instance_id == "c:3"
    assert core.schedule(req("y", prompt_tokens=10)).target.instance_id == "b:2"


def test_report_advances_tokens_monotonically() -> None:
    core = make_core()
    core.schedule(req("r", prompt_tokens=10))
    assert core.report("r", 5)
    assert core.load("a:1").num_tokens == 15
    assert core.report("r", 3)  # stale, reordered report: ignored
    assert core.load("a:1").num_tokens == 15
    assert core.report("r", 5)  # repeat: harmless
    assert core.load("a:1").num_tokens == 15
    assert core.report("r", 9, prefill_done=True)
    assert core.load("a:1").num_tokens == 19
    assert core.load("a:1").num_decode_requests == 1


def test_prefill_done_marks_decoding_once() -> None:
    core = make_core()
    core.schedule(req("r"))
    core.report("r", 0, prefill_done=True)
    core.report("r", 0, prefill_done=True)
    core.report("r", 4)
    assert core.load("a:1").num_decode_requests == 1
    core.release("r")
    assert core.load("a:1").num_decode_requests == 0


def test_report_many_counts_unknown_ids() -> None:
    core = make_core()
    core.schedule(req("r"))
    assert core.report_many([("r", 1, False), ("nope", 3, True), ("", 1, False)]) == 2
    assert core.report("gone", 1) is False


def test_release_removes_load_at_once_and_twice_is_harmless() -> None:
    core = make_core()
    core.schedule(req("r", prompt_tokens=50))
    core.report("r", 20)
    assert core.release("r") is True
    assert loads(core)["a:1"] == (0, 0)
    assert core.account_size == 0
    assert core.release("r") is False
    assert loads(core)["a:1"] == (0, 0)
    assert core.release("never") is False


def test_released_id_can_be_scheduled_again() -> None:
    core = make_core()
    core.schedule(req("r"))
    core.release("r")
    core.schedule(req("r"))
    assert core.account_size == 1


def test_duplicate_schedule_returns_the_same_decision_counted_once() -> None:
    core = make_core()
    first = core.schedule(req("r", prompt_tokens=10))
    core.schedule(req("other"))
    again = core.schedule(req("r", prompt_tokens=10))
    assert again == first
    assert loads(core) == {"a:1": (1, 10), "b:2": (1, 10), "c:3": (0, 0)}


def test_duplicate_id_for_another_model_is_rejected() -> None:
    core = make_core(model=["m", "n"])
    core.schedule(req("r", model="m"))
    with pytest.raises(DuplicateRequestError, match="already held for model 'm'"):
        core.schedule(req("r", model="n"))
    assert core.account_size == 1


def test_staleness_expiry_drops_unreleased_entries() -> None:
    clock = Clock()
    core = make_core(clock, request_local_account_staleness_seconds=30)
    core.schedule(req("quiet", prompt_tokens=10))
    clock.now += 20
    core.schedule(req("busy", prompt_tokens=10))
    clock.now += 15  # quiet untouched for 35s, busy for 15s
    assert core.expire() == 1
    assert core.account_size == 1
    assert loads(core)["a:1"] == (0, 0)
    assert core.num_expired == 1
    # reports keep a long request alive
    for _ in range(5):
        clock.now += 20
        assert core.report("busy", 1)
        assert core.expire() == 0
    clock.now += 31
    assert core.expire() == 1
    assert loads(core) == {"a:1": (0, 0), "b:2": (0, 0), "c:3": (0, 0)}


def test_schedule_expires_lazily() -> None:
    clock = Clock()
    core = make_core(clock, request_local_account_staleness_seconds=10)
    core.schedule(req("old"))
    clock.now += 11
    # old is gone before the decision, so a:1 is idle again and wins
    assert core.schedule(req("new")).target.instance_id == "a:1"
    assert core.account_size == 1


def test_unknown_model() -> None:
    core = make_core()
    with pytest.raises(UnknownModelError, match=r"model 'x' is not served here \(served: m\)"):
        core.schedule(req("r", model="x"))
    assert core.account_size == 0


def test_no_model_configured_accepts_any() -> None:
    core = make_core(model=[])
    assert core.schedule(req("r", model="anything")).target.instance_id == "a:1"


def test_no_instances() -> None:
    core = make_core(instances=[])
    with pytest.raises(NoSchedulableInstanceError, match="no instance serves model 'm'"):
        core.schedule(req("r"))


def test_empty_request_id() -> None:
    with pytest.raises(InvalidRequestError, match="request_id is required"):
        make_core().schedule(req(""))


def test_top_k_spreads_among_the_least_loaded() -> None:
    core = make_core(dispatch_top_k=2, instances=["a:1", "b:2", "c:3", "d:4"])
    for i in range(200):
        core.schedule(req(f"r{i}"))
        core.release(f"r{i}")
    dispatched = {i.instance_id: i.lrs.num_dispatched for i in core.instances()}
    # with everything idle the best two are a and b; c and d are never reached
    assert dispatched["c:3"] == dispatched["d:4"] == 0
    assert dispatched["a:1"] > 50 and dispatched["b:2"] > 50


def test_fallback_count() -> None:
    assert make_core(fallback_count=0).schedule(req("r")).fallbacks == ()
    assert len(make_core(fallback_count=9).schedule(req("r")).fallbacks) == 2


def test_remove_instance_drops_its_requests() -> None:
    core = make_core()
    core.schedule(req("r1"))
    core.schedule(req("r2"))
    assert core.remove_instance("a:1")
    assert core.account_size == 1
    assert core.release("r1") is False
    assert core.schedule(req("r3")).target.instance_id == "c:3"
    assert not core.remove_instance("a:1")


def test_add_instance_is_picked_up() -> None:
    core = make_core(instances=["a:1"])
    core.schedule(req("r1"))
    core.add_instance(InstanceView(Endpoint("z", "z:9"), models=frozenset({"m"})))
    assert core.schedule(req("r2")).target == Endpoint("z", "z:9")


def test_prometheus_metrics_per_core_registry() -> None:
    first, second = make_core(), make_core()  # two cores in one process must not clash
    first.schedule(req("r"))
    text = generate_latest(first.registry).decode()
    assert 'pilotfish_scheduler_dispatch_total{engine="a:1"} 1.0' in text
    assert 'pilotfish_scheduler_inflight_requests{engine="a:1"} 1.0' in text
    assert "pilotfish_scheduler_account_size 1.0" in text
    assert "pilotfish_scheduler_decision_seconds_count 1.0" in text
    assert "pilotfish_scheduler_account_size 0.0" in generate_latest(second.registry).decode()


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.0.0.1:8000", ("10.0.0.1:8000", "10.0.0.1:8000")),
        ("e0=10.0.0.1:8000", ("e0", "10.0.0.1:8000")),
        ("[::1]:8000", ("[::1]:8000", "[::1]:8000")),
        ("host.local:80", ("host.local:80", "host.local:80")),
    ],
)
def test_parse_instance(text: str, parsed: tuple[str, str]) -> None:
    assert parse_instance(text) == parsed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"instances": ["nohostport"]}, "--instances: 'nohostport' is not host:port"),
        ({"instances": ["h:99999"]}, "--instances: 'h:99999'"),
        ({"instances": ["=h:1"]}, "empty instance id"),
        ({"instances": ["x=h:1", "x=h:2"]}, "instance id 'x' appears twice"),
        ({"enable_full_mode_scheduling": True}, "--instances: full mode takes its instances from the CMS"),
        (
            {"scheduling_policy": "load-balance", "dispatch_load_metric": "kv_cache_usage_ratio_projected"},
            "not available in lite mode",
        ),
        ({"scheduling_policy": "nope"}, "unknown policy 'nope'"),
        ({"port": 9000, "metrics_port": 9000}, "--metrics-port: 9000 is also the gRPC --port"),
    ],
)
def test_bad_config_fails_with_one_line(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        make_core(**overrides)
    assert "\n" not in str(info.value)


# -- invariant: any interleaving keeps counts non-negative and they return to zero ------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("schedule"), st.integers(0, 7), st.integers(0, 500)),
        st.tuples(st.just("report"), st.integers(0, 9), st.integers(0, 300), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 9)),
        st.tuples(st.just("tick"), st.floats(0, 40)),
        st.tuples(st.just("expire")),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, metric=st.sampled_from(["num_requests", "num_tokens"]), top_k=st.integers(1, 3))
def test_account_never_negative_and_empty_after_release(ops: list[tuple], metric: str, top_k: int) -> None:
    clock = Clock()
    core = make_core(
        clock, dispatch_load_metric=metric, dispatch_top_k=top_k, request_local_account_staleness_seconds=60
    )
    for op in ops:
        kind = op[0]
        if kind == "schedule":
            core.schedule(req(f"r{op[1]}", prompt_tokens=op[2]))
        elif kind == "report":
            core.report(f"r{op[1]}", op[2], op[3])
        elif kind == "release":
            core.release(f"r{op[1]}")
        elif kind == "tick":
            clock.now += op[1]
        else:
            core.expire()
        held = {}
        for inst in core.instances():
            lrs = inst.lrs
            assert lrs.num_requests >= 0 and lrs.num_tokens >= 0
            assert 0 <= lrs.num_decode_requests <= lrs.num_requests
            held[inst.instance_id] = lrs.num_requests
        assert sum(held.values()) == core.account_size
    for i in range(10):
        core.release(f"r{i}")
    assert core.account_size == 0
    assert all((i.lrs.num_requests, i.lrs.num_tokens, i.lrs.num_decode_requests) == (0, 0, 0) for i in core.instances())
