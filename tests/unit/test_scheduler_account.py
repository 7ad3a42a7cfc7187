"""The full-mode in-flight account: dispatch raises load at once, engine statuses confirm it away.

The property test drives a model of two engines that admit dispatched requests and export
statuses (admitted ids since the previous export), and delivers those statuses to the core
lost, duplicated and reordered, as pub/sub and polling can. It checks after every step that
the account never double-counts what an applied status confirmed, that a lost confirmation
double-counts for at most the admission grace, that sums match entries and never go
negative, and that nothing leaks once requests are released or expire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.account import InflightAccount
from pilotfish.scheduler.view.types import Endpoint, InferType, InflightLoad, InstanceView, RequestInfo

WALL = 1_700_000_000.0
GRACE = 1.0
STALENESS = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock, **kw: object) -> SchedulerCore:
    values: dict[str, object] = {
        "enable_full_mode_scheduling": True,
        "request_local_account_staleness_seconds": STALENESS,
        "account_admission_grace_seconds": GRACE,
        "instance_staleness_seconds": 1e9,
        "account_admitted_window_ms": 0,  # these writers list each admitted id once
    }
    values.update(kw)
    config = SchedulerConfig(**values)  # type: ignore[arg-type]
    return SchedulerCore(config, clock=clock, wall_clock=lambda: WALL)


def meta(name: str, kind: int = 1, model: str = "m") -> cms_pb2.InstanceMetadata:
    return cms_pb2.InstanceMetadata(
        instance_id=name,
        host="10.0.0.1",
        http_port=8000 + ord(name[-1]) % 100,
        model=model,
        infer_type=kind,
        update_id=1,
    )


def status(name: str, update_id: int, admitted: list[str] = (), **kw: object) -> cms_pb2.InstanceStatus:  # type: ignore[assignment]
    values: dict[str, object] = {"timestamp_ms": int(WALL * 1000), "schedulable": True, "total_kv_tokens": 100_000}
    values.update(kw)
    return cms_pb2.InstanceStatus(
        instance_id=name,
        update_id=update_id,
        admitted_request_ids=list(admitted),
        **values,  # type: ignore[arg-type]
    )


def sums(core: SchedulerCore) -> dict[str, InflightLoad]:
    out = {i.instance_id: InflightLoad() for i in core.instances()}
    for e in core.account:
        load = out[e.inst.instance_id]
        load.requests += e.requests
        load.prefill_tokens += e.prefill_tokens
        load.decode_requests += e.decode_requests
        load.decode_tokens += e.decode_tokens
    return out


# -- examples -------------------------------------------------------------------------------------------


def test_dispatch_raises_inflight_load_and_confirmation_removes_it() -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1, uncomputed_prefill_tokens=0))
    core.schedule(RequestInfo("r1", "m", prompt_tokens=300))
    a = core.instance("a")
    assert a.inflight == InflightLoad(requests=1, prefill_tokens=300, decode_requests=1, decode_tokens=300)
    # the engine admitted r1: its status now counts the 300 tokens, the account drops them
    core.apply_status(status("a", 2, ["r1"], uncomputed_prefill_tokens=300, num_waiting=1))
    assert a.inflight == InflightLoad()
    assert core.account.num_confirmed == 1
    # the request is still held for Release
    assert core.account_size == 1 and core.release("r1")


def test_consecutive_dispatches_spread_before_any_status() -> None:
    clock = Clock()
    core = make_core(clock)
    for name in ("a", "b", "c"):
        core.apply_metadata(meta(name))
        core.apply_status(status(name, 1))
    targets = [core.schedule(RequestInfo(f"r{k}", "m", prompt_tokens=100)).target.instance_id for k in range(6)]
    assert sorted(targets) == ["a", "a", "b", "b", "c", "c"]


def test_release_removes_inflight_at_once() -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1))
    core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    assert core.inflight_size == 1
    assert core.release("r")
    assert core.inflight_size == 0 and core.instance("a").inflight == InflightLoad()
    assert not core.release("r")


def test_unconfirmed_entries_expire_after_the_staleness_period() -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1))
    core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    clock.now += STALENESS - 1
    assert core.expire() == 0 or core.inflight_size == 1
    clock.now += 2
    core.expire()
    assert core.inflight_size == 0 and core.account.num_expired == 1


def test_a_status_gap_confirms_entries_older_than_the_grace() -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1))
    core.schedule(RequestInfo("old", "m", prompt_tokens=10))
    clock.now += GRACE + 0.5
    core.schedule(RequestInfo("young", "m", prompt_tokens=10))
    # statuses 2 and 3 were lost (they named old); 4 arrives
    core.apply_status(status("a", 4))
    assert [e.request_id for e in core.account] == ["young"]
    assert core.account.num_gap_confirmed == 1
    # young reached the grace age without being named: it is taken as admitted too
    clock.now += GRACE
    core.expire()
    assert core.inflight_size == 0


def test_rerouted_request_is_confirmed_by_the_instance_that_admitted_it() -> None:
    clock = Clock()
    core = make_core(clock)
    for name in ("a", "b"):
        core.apply_metadata(meta(name))
        core.apply_status(status(name, 1))
    target = core.schedule(RequestInfo("r", "m", prompt_tokens=10)).target.instance_id
    other = "b" if target == "a" else "a"
    core.apply_status(status(other, 2, ["r"]))  # the gateway fell back to the other instance
    assert core.inflight_size == 0


def test_pd_dispatch_accounts_prefill_and_decode_separately() -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("p", kind=2))
    core.apply_metadata(meta("d", kind=3))
    core.apply_status(status("p", 1))
    core.apply_status(status("d", 1))
    decision = core.schedule(RequestInfo("r", "m", prompt_tokens=100))
    assert (decision.target.instance_id, decision.decode_target.instance_id) == ("p", "d")  # type: ignore[union-attr]
    assert core.instance("p").inflight == InflightLoad(requests=1, prefill_tokens=100)
    assert core.instance("d").inflight == InflightLoad(requests=1, decode_requests=1, decode_tokens=100)
    core.apply_status(status("p", 2, ["r"]))  # prefill admitted; decode still in flight
    assert core.instance("p").inflight == InflightLoad()
    assert core.instance("d").inflight.decode_requests == 1
    core.apply_status(status("d", 2, ["r"]))
    assert core.inflight_size == 0


def test_cached_prefix_is_not_counted_as_prefill_work() -> None:
    clock = Clock()
    core = make_core(clock, enable_cache_aware_scheduling=True)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1))
    core.schedule(RequestInfo("r1", "m", prompt_tokens=64, prefix_block_hashes=(1, 2, 3), prefix_block_size=16))
    core.schedule(RequestInfo("r2", "m", prompt_tokens=64, prefix_block_hashes=(1, 2, 3), prefix_block_size=16))
    # r2's first 48 tokens are cached on a (r1 went there first)
    assert core.instance("a").inflight.prefill_tokens == 64 + 16


def test_account_unit_increments_by_infer_type() -> None:
    account = InflightAccount(10, 1, Clock())
    kinds = (InferType.NEUTRAL, InferType.PREFILL, InferType.DECODE)
    views = {k: InstanceView(Endpoint(k.name, "h:1", k)) for k in kinds}
    for inst in views.values():
        account.dispatch("r", inst, 100, cached_tokens=30)
        account.dispatch("r", inst, 100, cached_tokens=30)  # the same pair twice counts once
    assert views[InferType.NEUTRAL].inflight == InflightLoad(1, 70, 1, 100)
    assert views[InferType.PREFILL].inflight == InflightLoad(1, 70, 0, 0)
    assert views[InferType.DECODE].inflight == InflightLoad(1, 0, 1, 100)
    assert account.release("r") and len(account) == 0


# -- the property: lost, duplicated and reordered statuses ---------------------------------------------


@dataclass
class Engine:
    name: str
    update_id: int = 1
    received: list[str] = field(default_factory=list)  # dispatched here, not yet admitted
    since_export: list[str] = field(default_factory=list)
    admitted_in: dict[str, int] = field(default_factory=dict)  # request -> update_id that named it


steps = st.lists(
    st.one_of(
        st.tuples(st.just("dispatch"), st.integers(10, 500)),
        st.tuples(st.just("admit"), st.integers(0, 1), st.integers(0, 3)),
        st.tuples(st.just("export"), st.integers(0, 1)),
        st.tuples(st.just("admit"), st.integers(0, 1), st.integers(0, 3)),
        st.tuples(st.just("export"), st.integers(0, 1)),
        st.tuples(st.just("export"), st.integers(0, 1)),
        st.tuples(st.just("deliver"), st.integers(0, 50)),  # any status ever exported: dups, reorders
        st.tuples(st.just("poll"), st.integers(0, 1)),  # the newest status, as the poll reads Redis
        st.tuples(st.just("poll"), st.integers(0, 1)),
        st.tuples(st.just("tick"), st.sampled_from([0.01, 0.3, 0.9, 2.5])),
        st.tuples(st.just("tick"), st.sampled_from([0.01, 0.3, 0.9, 2.5])),
        st.tuples(st.just("release"), st.integers(0, 30)),
    ),
    max_size=80,
)


LOST_CONFIRMATION = [
    ("dispatch", 10),
    ("admit", 0, 3),
    ("admit", 1, 3),
    ("export", 0),
    ("export", 1),
    ("export", 0),
    ("export", 1),
    ("poll", 0),
    ("poll", 1),
    ("tick", 2.5),
]


@settings(max_examples=400, deadline=None)
@given(steps=steps, end_by_release=st.booleans())
@example(steps=LOST_CONFIRMATION, end_by_release=True)
@example(steps=[*LOST_CONFIRMATION[:7], ("tick", 0.3), ("poll", 0), ("poll", 1), ("tick", 0.9)], end_by_release=False)
def test_lost_duplicated_reordered_statuses_never_double_count_or_leak(
    steps: list[tuple], end_by_release: bool
) -> None:
    clock = Clock()
    core = make_core(clock)
    engines = [Engine("a"), Engine("b")]
    for e in engines:
        core.apply_metadata(meta(e.name))
        core.apply_status(status(e.name, 1))
    exported: list[cms_pb2.InstanceStatus] = []
    latest: dict[str, cms_pb2.InstanceStatus] = {}
    named_delivered: set[str] = set()
    dispatched: list[str] = []
    applied_update: dict[str, int] = {"a": 1, "b": 1}

    def deliver(s: cms_pb2.InstanceStatus) -> None:
        core.apply_status(s)
        named_delivered.update(s.admitted_request_ids)
        applied_update[s.instance_id] = max(applied_update[s.instance_id], s.update_id)

    for step in steps:
        kind = step[0]
        if kind == "dispatch":
            rid = f"r{len(dispatched)}"
            target = core.schedule(RequestInfo(rid, "m", prompt_tokens=step[1])).target.instance_id
            dispatched.append(rid)
            next(e for e in engines if e.name == target).received.append(rid)
        elif kind == "admit":
            e = engines[step[1]]
            for rid in e.received[: step[2]]:
                e.since_export.append(rid)
            del e.received[: step[2]]
        elif kind == "export":
            e = engines[step[1]]
            e.update_id += 1
            for rid in e.since_export:
                e.admitted_in[rid] = e.update_id
            s = status(e.name, e.update_id, e.since_export)
            e.since_export = []
            exported.append(s)
            latest[e.name] = s
        elif kind == "deliver" and exported:
            deliver(exported[step[1] % len(exported)])
        elif kind == "poll":
            name = engines[step[1]].name
            if name in latest:
                deliver(latest[name])
        elif kind == "tick":
            clock.now += step[1]
        elif kind == "release" and dispatched:
            core.release(dispatched[step[1] % len(dispatched)])
        core.expire()

        # sums match the entries and never go negative
        expected = sums(core)
        for inst in core.instances():
            assert inst.inflight == expected[inst.instance_id]
            assert min(inst.inflight.requests, inst.inflight.prefill_tokens, inst.inflight.decode_tokens) >= 0
        held = {e.request_id for e in core.account}
        # never double-count: a request named by any status the core applied has no entry
        assert not held & named_delivered
        # a confirmation lost to the view double-counts for at most the admission grace
        for entry in core.account:
            e = next(x for x in engines if x.name == entry.inst.instance_id)
            admitted = e.admitted_in.get(entry.request_id)
            if admitted is not None and admitted <= applied_update[e.name]:
                assert clock.now - entry.dispatched_at < GRACE

    # never leak: released requests, or expiry, empty the account
    if end_by_release:
        for rid in dispatched:
            core.release(rid)
    else:
        clock.now += STALENESS + 1
        core.expire()
    assert core.inflight_size == 0
    assert all(i.inflight == InflightLoad() for i in core.instances())


@pytest.mark.parametrize("order", [[1, 2, 3], [3, 2, 1], [2, 3, 1], [1, 1, 3, 3, 2]])
def test_any_delivery_order_of_the_same_statuses_ends_in_the_same_view(order: list[int]) -> None:
    clock = Clock()
    core = make_core(clock)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", 1))
    for k in range(3):
        core.schedule(RequestInfo(f"r{k}", "m", prompt_tokens=10))
    statuses = {
        1: status("a", 2, ["r0"], num_waiting=1),
        2: status("a", 3, ["r1"], num_waiting=2),
        3: status("a", 4, ["r2"], num_waiting=3),
    }
    for k in order:
        core.apply_status(statuses[k])
    assert core.inflight_size == 0
    assert core.instance("a").status.num_waiting == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("skip_ms", "gap"),
    [
        (500, False),  # a time-based update_id jump within the window: the ids are still listed
        (1999, False),
        (2000, True),  # statuses skipped across the whole window: ids may be lost
        (5000, True),
    ],
)
def test_gap_needs_a_skip_longer_than_the_admitted_window(skip_ms: int, gap: bool) -> None:
    clock = Clock()
    core = make_core(clock, account_admitted_window_ms=2000)
    t0 = int(WALL * 1000)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", t0 * 1000, timestamp_ms=t0))  # update_id in µs, as the llumlet writes
    core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    clock.now += GRACE + 1
    t1 = t0 + skip_ms
    core.apply_status(status("a", t1 * 1000, timestamp_ms=t1))
    assert (core.inflight_size == 0) is gap


@pytest.mark.parametrize(
    ("admitted_since", "listed", "gap"),
    [
        (0, [], False),  # an idle engine's refresh, seconds later: nothing admitted, nothing lost
        (2, ["x", "y"], False),  # every id admitted since is listed
        (3, ["x", "y"], True),  # one admitted since was listed only by statuses never read
        (-5, [], True),  # fewer than held: a writer that started over (its export process respawned)
    ],
)
def test_a_counting_writer_says_whether_a_pause_lost_ids(admitted_since: int, listed: list[str], gap: bool) -> None:
    """update_ids are microseconds of wall time, so an idle engine's refresh 3 s later looked like skipped
    statuses and confirmed whatever was in flight there (a server swallowing its requests looked idle again);
    admitted_total tells a pause from a skip."""
    clock = Clock()
    core = make_core(clock, account_admitted_window_ms=2000)
    t0 = int(WALL * 1000)
    core.apply_metadata(meta("a"))
    core.apply_status(status("a", t0 * 1000, timestamp_ms=t0, admitted_total=7))
    core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    clock.now += GRACE + 3
    t1 = t0 + 3000
    core.apply_status(status("a", t1 * 1000, listed, timestamp_ms=t1, admitted_total=7 + admitted_since))
    assert (core.inflight_size == 0) is gap
    # a writer that does not count (no admitted_total) falls back to the update_id jump
    core.apply_status(status("a", (t1 + 2000) * 1000, timestamp_ms=t1 + 2000))
    assert core.inflight_size == 0
