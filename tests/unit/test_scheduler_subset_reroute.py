"""The gateway's subset hint restricts the pick, and a request served elsewhere moves its load."""

from __future__ import annotations

import random

import pytest

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.view.types import RequestInfo

# enough instances that the core keeps a load index: the subset must bypass it, not be ignored by it
INSTANCES = [f"10.0.0.{i}:8000" for i in range(20)]


def make_core() -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(instances=INSTANCES, model=["m"], fallback_count=2), rng=random.Random(0))


def req(request_id: str, subset: frozenset[str] = frozenset(), prompt_tokens: int = 10) -> RequestInfo:
    return RequestInfo(request_id=request_id, model="m", prompt_tokens=prompt_tokens, candidate_addresses=subset)


@pytest.mark.parametrize(
    ("subset", "allowed"),
    [
        (frozenset({"10.0.0.7:8000"}), {"10.0.0.7:8000"}),
        (frozenset({"10.0.0.3:8000", "10.0.0.9:8000"}), {"10.0.0.3:8000", "10.0.0.9:8000"}),
        (frozenset({"10.0.0.5"}), {"10.0.0.5:8000"}),  # an entry without a port: every engine at that IP
        (frozenset({"10.0.0.5:8000", "192.168.9.9:1"}), {"10.0.0.5:8000"}),  # unknown entries are skipped
    ],
)
def test_every_pick_and_fallback_comes_from_the_subset(subset: frozenset[str], allowed: set[str]) -> None:
    core = make_core()
    for i in range(6):
        decision = core.schedule(req(f"r{i}", subset))
        assert decision.target.address in allowed
        assert {e.address for e in decision.fallbacks} <= allowed


def test_a_subset_with_no_eligible_engine_is_refused_not_widened() -> None:
    core = make_core()
    with pytest.raises(NoSchedulableInstanceError, match="subset"):
        core.schedule(req("r", frozenset({"192.168.9.9:8000"})))
    assert core.account_size == 0


def test_a_request_served_elsewhere_moves_its_load_there() -> None:
    core = make_core()
    target = core.schedule(req("r", prompt_tokens=100)).target
    core.report("r", 5, prefill_done=True)
    loads = {
        i.endpoint.address: (i.lrs.num_requests, i.lrs.num_tokens, i.lrs.num_decode_requests) for i in core.instances()
    }
    assert loads[target.address] == (1, 105, 1)
    other = next(a for a in INSTANCES if a != target.address)
    assert core.reroute("r", other)
    moved = {
        i.endpoint.address: (i.lrs.num_requests, i.lrs.num_tokens, i.lrs.num_decode_requests) for i in core.instances()
    }
    assert moved[target.address] == (0, 0, 0) and moved[other] == (1, 105, 1)
    assert core.release("r")
    assert all(i.lrs.num_requests == 0 and i.lrs.num_tokens == 0 for i in core.instances())


@pytest.mark.parametrize(("request_id", "address"), [("unknown", INSTANCES[1]), ("r", "10.9.9.9:1")])
def test_a_reroute_to_an_unknown_request_or_engine_changes_nothing(request_id: str, address: str) -> None:
    core = make_core()
    target = core.schedule(req("r")).target
    assert not core.reroute(request_id, address)
    assert {i.endpoint.address for i in core.instances() if i.lrs.num_requests} == {target.address}
