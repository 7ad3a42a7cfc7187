"""Flow ids counted apart only once established (scheduler/flow/newcomers.py), alone and in the controller:
a client that sends a new tenant id with every request gets one turn and one share, not one per id."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import Decision, SchedulerCore
from pilotfish.scheduler.flow import Band, FlowController
from pilotfish.scheduler.flow.newcomers import NEWCOMERS, Newcomers
from pilotfish.scheduler.view.types import RequestInfo

STD = int(Band.STANDARD)


def test_an_id_used_once_per_request_is_never_its_own_flow() -> None:
    ids = Newcomers(after_s=1.0)
    flows = {ids.flow(f"rotated-{i}", now=i * 0.5) for i in range(100)}
    assert flows == {NEWCOMERS} and ids.folded == 100 and len(ids) == 0


def test_an_id_seen_again_after_the_wait_is_its_own_flow_from_then_on() -> None:
    ids = Newcomers(after_s=1.0)
    assert ids.flow("tenant", 10.0) == NEWCOMERS
    assert ids.flow("tenant", 10.9) == NEWCOMERS  # too soon: a burst of one id is not a tenant yet
    assert ids.flow("tenant", 11.0) == "tenant"
    assert ids.flow("tenant", 11.0) == "tenant" and len(ids) == 1 and ids.folded == 2


def test_the_default_flow_and_a_zero_wait_count_every_id_as_given() -> None:
    assert Newcomers(after_s=1.0).flow("", 0.0) == ""
    off = Newcomers(after_s=0.0)
    assert [off.flow(f"id{i}", 0.0) for i in range(3)] == ["id0", "id1", "id2"] and off.folded == 0


def test_ids_used_once_cannot_push_out_an_established_tenant() -> None:
    ids = Newcomers(after_s=1.0, max_candidates=8, max_established=8)
    ids.flow("tenant", 0.0)
    assert ids.flow("tenant", 2.0) == "tenant"
    for i in range(1000):  # a rotating client floods the candidates
        assert ids.flow(f"rotated-{i}", 2.0 + i / 1000) == NEWCOMERS
    assert ids.flow("tenant", 3.5) == "tenant"


def test_a_tenant_that_keeps_sending_outlives_ids_used_once_among_the_candidates() -> None:
    ids = Newcomers(after_s=1.0, max_candidates=4)
    for step in range(5):  # the tenant's request, then three ids used once, every 0.2 s
        assert ids.flow("tenant", step * 0.2) == NEWCOMERS
        for i in range(3):
            ids.flow(f"rotated-{step}-{i}", step * 0.2)
    assert ids.flow("tenant", 1.0) == "tenant"  # its first sighting was kept: established after 1 s


def test_established_ids_are_bounded_least_recently_seen_first() -> None:
    ids = Newcomers(after_s=1.0, max_established=2)
    for name in ("a", "b", "c"):
        ids.flow(name, 0.0)
    ids.flow("a", 1.0)
    ids.flow("b", 1.0)
    ids.flow("a", 1.5)  # a used more lately than b
    ids.flow("c", 2.0)  # c established: b, the least recently seen, is forgotten
    assert len(ids) == 2
    assert ids.flow("b", 2.0) == NEWCOMERS and ids.flow("a", 2.0) == "a"


# -- in the controller -------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lite(clock: Clock, after_ms: float) -> tuple[SchedulerCore, FlowController]:
    """Two lite engines of one request each; flow ids established after `after_ms`."""
    config = SchedulerConfig(instances=["a:1", "b:2"], model=["m"], enable_flow_control=True,
                             flow_lite_max_requests=1, flow_established_after_ms=after_ms)  # fmt: skip
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    return core, FlowController(core, config, clock=clock)


def req(rid: str) -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", prompt_tokens=10)


def rotation_order(after_ms: float) -> list[str]:
    """Tenant A sends a request, then another 2 s later (established by then); a rotating client queues
    four requests, each with a new id; then A queues two more. The order they leave the queue in."""
    clock = Clock()
    core, flow = lite(clock, after_ms)
    order: list[str] = []

    def reply(rid: str):
        return lambda outcome: order.append(rid) if isinstance(outcome, Decision) else None

    for rid in ("a0", "busy"):
        assert isinstance(flow.submit(req(rid), STD, "tenant-a", 5.0, reply(rid)), Decision)
    clock.now += 2
    for i in range(4):
        assert flow.submit(req(f"r{i}"), STD, f"rotated-{i}", 5.0, reply(f"r{i}")) is None
    for i in (1, 2):
        assert flow.submit(req(f"a{i}"), STD, "tenant-a", 5.0, reply(f"a{i}")) is None
    for rid in ("a0", "busy", "r0", "a1", "r1", "a2", "r2"):
        core.release(rid)
        flow.drain()
    return order


def test_a_client_rotating_ids_gets_one_turn_not_one_per_id() -> None:
    assert rotation_order(1000.0) == ["r0", "a1", "r1", "a2", "r2", "r3"]
    # counted as given, every rotated id took a turn before the tenant's second request
    assert rotation_order(0.0) == ["r0", "r1", "r2", "r3", "a1"]


@pytest.mark.parametrize(("after_ms", "over"), [(1000.0, {NEWCOMERS}), (0.0, {"tenant-a"})])
def test_a_rotating_flood_is_the_flow_over_its_share_not_the_tenant(after_ms: float, over: set[str]) -> None:
    """The tenant sends three requests of 30 tokens (its first before it is established), a rotating
    client four, each with a new id. Counted as given, the tenant holds 90 of 210 tokens against 1/5 of
    them per flow and is the one over its share; folded, the newcomers hold 150 of 210 and are."""
    from pilotfish.scheduler.flow import FlowGate

    clock = Clock()
    config = SchedulerConfig(instances=["a:1", "b:2"], model=["m"], enable_flow_control=True,
                             flow_lite_max_requests=0, flow_lite_max_tokens=1000,
                             flow_established_after_ms=after_ms)  # fmt: skip
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    gate = FlowGate.from_config(core, config)
    assert gate is not None
    flow = gate.controller
    flow._clock = clock

    def submit(rid: str, flow_id: str) -> None:
        r = RequestInfo(request_id=rid, model="m", prompt_tokens=30)
        assert isinstance(flow.submit(r, STD, flow_id, 5.0, lambda o: None), Decision)

    submit("a0", "tenant-a")
    clock.now += 2
    submit("a1", "tenant-a")
    submit("a2", "tenant-a")
    for i in range(4):
        submit(f"r{i}", f"rotated-{i}")
    assert flow.over_share_flows() == over
    if after_ms:
        assert flow.flow_tokens() == {"tenant-a": 60, NEWCOMERS: 150}
    text = generate_latest(core.registry).decode()
    assert f"pilotfish_scheduler_flow_newcomer_requests_total {5.0 if after_ms else 0.0}" in text
    assert f"pilotfish_scheduler_flow_established_flows {1.0 if after_ms else 0.0}" in text
