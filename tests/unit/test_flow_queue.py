"""Flow control's queue: strict bands, round robin between flows, eviction, cancels (scheduler/flow/queue.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.config import ConfigError
from pilotfish.scheduler.flow.bands import Band, band_of, parse_model_priorities
from pilotfish.scheduler.flow.queue import FlowQueue, Waiting
from pilotfish.scheduler.view.types import RequestInfo


def w(rid: str, band: Band = Band.STANDARD, flow: str = "", tokens: int = 0) -> Waiting:
    return Waiting(RequestInfo(request_id=rid, model="m", prompt_tokens=tokens), band, flow, 0.0, 10.0)


def drain(q: FlowQueue) -> list[str]:
    out = []
    while (x := q.pop()) is not None:
        out.append(x.req.request_id)
    return out


def test_strict_priority_between_bands() -> None:
    q = FlowQueue()
    for item in (w("s1", Band.SHEDDABLE), w("n1"), w("c1", Band.CRITICAL), w("n2"), w("c2", Band.CRITICAL)):
        q.push(item)
    assert drain(q) == ["c1", "c2", "n1", "n2", "s1"]
    assert len(q) == 0


def test_round_robin_between_flows_a_flood_waits_behind_itself() -> None:
    q = FlowQueue()
    for i in range(5):
        q.push(w(f"flood{i}", flow="flood"))
    q.push(w("quiet0", flow="quiet"))
    q.push(w("quiet1", flow="quiet"))
    assert drain(q) == ["flood0", "quiet0", "flood1", "quiet1", "flood2", "flood3", "flood4"]


def test_a_flow_refused_by_eligible_keeps_its_turn_and_bands_stay_strict() -> None:
    q = FlowQueue()
    for i in range(3):
        q.push(w(f"flood{i}", flow="flood"))
    q.push(w("quiet0", flow="quiet"))
    q.push(w("quiet1", flow="quiet"))
    q.push(w("low", Band.SHEDDABLE, flow="other"))
    not_flood = lambda flow, band: flow != "flood"  # noqa: E731
    assert q.pop(not_flood).req.request_id == "quiet0"
    assert q.pop(not_flood).req.request_id == "quiet1"
    # only the flood waits in the standard band: refused, and the sheddable one may not pass it
    assert q.pop(not_flood) is None
    assert drain(q) == ["flood0", "flood1", "flood2", "low"]


def test_evict_takes_the_newest_of_the_largest_flow_of_the_lowest_band() -> None:
    q = FlowQueue()
    for item in (w("s-a0", Band.SHEDDABLE, "a"), w("s-b0", Band.SHEDDABLE, "b"), w("s-b1", Band.SHEDDABLE, "b"),
                 w("n0"), w("c0", Band.CRITICAL)):
        q.push(item)
    victim = q.evict_for(Band.CRITICAL)
    assert victim is not None and victim.req.request_id == "s-b1"
    assert q.evict_for(Band.SHEDDABLE) is None  # nothing below sheddable
    assert [x.req.request_id for x in (q.evict_for(Band.STANDARD), q.evict_for(Band.STANDARD))] in (
        ["s-a0", "s-b0"], ["s-b0", "s-a0"])
    assert q.evict_for(Band.STANDARD) is None  # only standard and critical left
    assert q.evict_for(Band.CRITICAL) is not None  # a standard one goes for a critical one
    assert drain(q) == ["c0"]


def test_cancel_keeps_counts_exact_and_a_flow_that_comes_back_has_one_turn() -> None:
    q = FlowQueue()
    a0, a1 = w("a0", flow="a"), w("a1", flow="a")
    for item in (a0, a1, w("b0", flow="b"), w("b1", flow="b")):
        q.push(item)
    q.cancel(a0)
    q.cancel(a1)
    assert len(q) == 2 and q.flow_counts(Band.STANDARD) == {"b": 2}
    q.push(w("a2", flow="a"))
    q.push(w("a3", flow="a"))
    assert drain(q) == ["a2", "b0", "a3", "b1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "cancel", "evict"]), st.integers(0, 2), st.integers(0, 3)),
                max_size=80))
def test_invariants_no_request_lost_or_duplicated(ops: list[tuple[str, int, int]]) -> None:
    """Every pushed request leaves exactly once (pop, evict or cancel); counts match what is live;
    bands come out in order."""
    q = FlowQueue()
    live: dict[str, Waiting] = {}
    left: list[str] = []
    n = 0
    for op, b, f in ops:
        band = list(Band)[b]
        if op == "push":
            item = w(f"r{n}", band, f"f{f}", tokens=n + 1)
            n += 1
            q.push(item)
            live[item.req.request_id] = item
        elif op == "pop":
            item = q.pop()
            if item is None:
                assert not live
                continue
            assert min(x.band for x in live.values()) == item.band
            left.append(live.pop(item.req.request_id).req.request_id)
        elif op == "cancel" and live:
            rid = sorted(live)[f % len(live)]
            q.cancel(live.pop(rid))
            left.append(rid)
        elif op == "evict":
            item = q.evict_for(band)
            if item is not None:
                assert item.band > band
                left.append(live.pop(item.req.request_id).req.request_id)
        assert len(q) == len(live)
        assert sorted(x.req.request_id for x in q) == sorted(live)
        by_flow: dict[str, int] = {}
        for x in live.values():
            by_flow[x.flow] = by_flow.get(x.flow, 0) + x.tokens
        assert q.flow_tokens == by_flow
        for bb in Band:
            counts = q.flow_counts(bb)
            assert sum(counts.values()) == q.count(bb) == sum(1 for x in live.values() if x.band == bb)
    assert len(left) == len(set(left))
    assert sorted(drain(q)) == sorted(live)


def test_band_of_request_then_model_then_standard() -> None:
    by_model = parse_model_priorities(["batch-model=sheddable", "chat = critical"])
    assert band_of(int(Band.CRITICAL), "batch-model", by_model) == Band.CRITICAL
    assert band_of(0, "batch-model", by_model) == Band.SHEDDABLE
    assert band_of(0, "chat", by_model) == Band.CRITICAL
    assert band_of(0, "other", by_model) == Band.STANDARD
    assert band_of(99, "other", by_model) == Band.STANDARD  # a newer gateway's value


@pytest.mark.parametrize("entry", ["nomodel", "=critical", "m=urgent"])
def test_bad_model_priority_fails_naming_the_flag(entry: str) -> None:
    with pytest.raises(ConfigError, match="--flow-model-priorities"):
        parse_model_priorities([entry])
