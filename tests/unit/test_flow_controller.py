"""Flow control's controller over the real lite-mode core, on a fake clock (scheduler/flow/controller.py)."""

from __future__ import annotations

import random

import pytest

from pilotfish.config import ConfigError
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import Decision, SchedulerCore
from pilotfish.scheduler.errors import SchedulerError
from pilotfish.scheduler.flow import Band, FlowController, Shed
from pilotfish.scheduler.flow.saturation import Saturation
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InstanceView, RequestInfo

CRIT, STD, SHED = int(Band.CRITICAL), int(Band.STANDARD), int(Band.SHEDDABLE)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **overrides: object) -> tuple[SchedulerCore, FlowController]:
    values: dict[str, object] = {
        "instances": ["a:1", "b:2"], "model": ["m"], "enable_flow_control": True, "flow_lite_max_requests": 1,
        # the tenants here send a few requests at once: counted apart from their first (newcomers.py has
        # its own tests below)
        "flow_established_after_ms": 0.0,
    }
    values.update(overrides)
    config = SchedulerConfig(**values)  # type: ignore[arg-type]
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    return core, FlowController(core, config, clock=clock)


def req(rid: str, model: str = "m") -> RequestInfo:
    return RequestInfo(request_id=rid, model=model, prompt_tokens=10)


class Replies:
    def __init__(self) -> None:
        self.got: dict[str, object] = {}
        self.order: list[str] = []

    def to(self, rid: str):
        def reply(outcome: object) -> None:
            assert rid not in self.got, "answered twice"
            self.got[rid] = outcome
            self.order.append(rid)

        return reply


def fill(core: SchedulerCore, flow: FlowController, replies: Replies, n: int = 2) -> None:
    for i in range(n):
        assert isinstance(flow.submit(req(f"busy{i}"), STD, "", 5.0, replies.to(f"busy{i}")), Decision)


def test_dispatched_at_once_while_an_engine_has_room_then_queued_until_a_release() -> None:
    clock = Clock()
    core, flow = make(clock)
    replies = Replies()
    fill(core, flow, replies)
    assert flow.submit(req("w1"), STD, "", 5.0, replies.to("w1")) is None
    assert flow.queued("w1") and core.account_size == 2
    assert flow.drain() == 0  # still saturated: nothing leaves
    core.release("busy1")
    assert flow.drain() == 1
    decision = replies.got["w1"]
    assert isinstance(decision, Decision) and decision.target.instance_id == "b:2"
    assert not flow.queued("w1") and core.account_size == 2


def test_a_request_its_gateway_cannot_hold_goes_to_the_core_at_once() -> None:
    clock = Clock()
    core, flow = make(clock)
    replies = Replies()
    fill(core, flow, replies)
    assert isinstance(flow.submit(req("now"), STD, "", 0.0, replies.to("now")), Decision)
    assert core.account_size == 3


def test_strict_priority_and_fairness_on_dispatch() -> None:
    clock = Clock()
    core, flow = make(clock)
    replies = Replies()
    fill(core, flow, replies)
    for i in range(4):
        flow.submit(req(f"flood{i}"), STD, "tenant-a", 5.0, replies.to(f"flood{i}"))
    flow.submit(req("other0"), STD, "tenant-b", 5.0, replies.to("other0"))
    flow.submit(req("sh0"), SHED, "", 5.0, replies.to("sh0"))
    flow.submit(req("crit0"), CRIT, "", 5.0, replies.to("crit0"))
    order = []
    for rid in ["busy0", "busy1", "crit0", "flood0", "other0", "flood1", "flood2", "flood3", "sh0"]:
        core.release(rid)
        flow.drain()
        order = list(replies.order)
    assert order == ["crit0", "flood0", "other0", "flood1", "flood2", "flood3", "sh0"]


def test_deadlines_shed_standard_and_sheddable_but_dispatch_critical() -> None:
    clock = Clock()
    core, flow = make(clock, flow_standard_max_wait_ms=1000, flow_critical_max_wait_ms=1000,
                      flow_sheddable_max_wait_ms=500)
    replies = Replies()
    fill(core, flow, replies)
    flow.submit(req("std"), STD, "", 5.0, replies.to("std"))
    flow.submit(req("crit"), CRIT, "", 5.0, replies.to("crit"))
    flow.submit(req("sh"), SHED, "", 0.3, replies.to("sh"))  # the gateway's hold is shorter than the band's wait
    assert flow.next_deadline() == pytest.approx(1000.3)
    clock.now += 0.3
    assert flow.expire() == 1
    assert isinstance(replies.got["sh"], Shed) and replies.got["sh"].reason == "deadline"  # type: ignore[attr-defined]
    clock.now += 0.7
    assert flow.expire() == 2
    assert isinstance(replies.got["std"], Shed) and replies.got["std"].code == "RESOURCE_EXHAUSTED"
    assert isinstance(replies.got["crit"], Decision)  # saturated or not: critical is never shed for time
    assert len(flow) == 0 and core.account_size == 3
    assert flow.stats.shed[("standard", "deadline")] == 1
    assert flow.stats.dispatched[("critical", "deadline")] == 1


def test_a_full_queue_sheds_lower_bands_first_and_never_critical_while_they_hold_places() -> None:
    clock = Clock()
    core, flow = make(clock, flow_queue_max_requests=2)
    replies = Replies()
    fill(core, flow, replies)
    flow.submit(req("sh0"), SHED, "", 5.0, replies.to("sh0"))
    flow.submit(req("std0"), STD, "", 5.0, replies.to("std0"))
    with pytest.raises(Shed) as shed:  # the arrival is sheddable and nothing lower waits
        flow.submit(req("sh1"), SHED, "", 5.0, replies.to("sh1"))
    assert shed.value.reason == "queue_full"
    flow.submit(req("crit0"), CRIT, "", 5.0, replies.to("crit0"))  # evicts sh0
    assert isinstance(replies.got["sh0"], Shed) and replies.got["sh0"].reason == "evicted"  # type: ignore[attr-defined]
    flow.submit(req("crit1"), CRIT, "", 5.0, replies.to("crit1"))  # evicts std0
    assert isinstance(replies.got["std0"], Shed)
    with pytest.raises(Shed):  # only critical ones wait: the bound holds
        flow.submit(req("crit2"), CRIT, "", 5.0, replies.to("crit2"))
    assert len(flow) == 2


def test_sheddable_is_shed_at_once_when_the_drain_rate_says_it_would_miss_its_deadline() -> None:
    clock = Clock()
    core, flow = make(clock, flow_queue_max_requests=100, flow_sheddable_max_wait_ms=1000)
    replies = Replies()
    fill(core, flow, replies)
    for i in range(20):  # queue and drain 10 at one every 0.25 s: the rate is known
        flow.submit(req(f"q{i}"), STD, "", 30.0, replies.to(f"q{i}"))
    for i in range(10):
        clock.now += 0.25
        core.release(["busy0", "busy1", *[f"q{j}" for j in range(20)]][i])
        flow.drain()
    assert len(flow) == 10
    with pytest.raises(Shed) as shed:  # 10 ahead at 4 a second: 2.5 s, past its 1 s
        flow.submit(req("late"), SHED, "", 5.0, replies.to("late"))
    assert shed.value.reason == "would_miss_deadline"
    assert flow.submit(req("std"), STD, "", 5.0, replies.to("std")) is None  # standard waits its turn


def test_the_drain_rate_is_the_last_seconds_not_the_lull_before_a_burst() -> None:
    """A queue that drained slowly between bursts (one every 1.3 s) and then fast (ten a second for the
    last second): a sheddable request behind 3 waits about 0.6 s at the last 3 s's rate, within its 1 s;
    over the last 10 s, lull and all, it would be called 1.6 s and shed at once."""
    clock = Clock()
    core, flow = make(clock, flow_queue_max_requests=100, flow_sheddable_max_wait_ms=1000)
    replies = Replies()
    fill(core, flow, replies)
    for i in range(23):
        flow.submit(req(f"q{i}"), STD, "", 60.0, replies.to(f"q{i}"))
    held = ["busy0", "busy1", *[f"q{j}" for j in range(23)]]
    for i, step in enumerate([1.3] * 10 + [0.1] * 10):  # the lull's departures, then the burst's
        clock.now += step
        core.release(held[i])
        flow.drain()
    assert len(flow) == 3
    assert flow.submit(req("burst"), SHED, "", 5.0, replies.to("burst")) is None  # waits, not shed


def test_cancel_leaves_the_queue_and_nobody_is_told_nothing_dispatched() -> None:
    clock = Clock()
    core, flow = make(clock)
    replies = Replies()
    fill(core, flow, replies)
    flow.submit(req("gone"), STD, "", 5.0, replies.to("gone"))
    assert flow.cancel("gone") and not flow.cancel("gone")
    core.release("busy0")
    assert flow.drain() == 0 and "gone" not in replies.got and core.account_size == 1
    assert flow.next_deadline() is None


def test_nothing_bypasses_waiting_requests_and_unknown_models_are_the_cores_answer() -> None:
    clock = Clock()
    core, flow = make(clock)
    replies = Replies()
    fill(core, flow, replies)
    flow.submit(req("first"), STD, "", 5.0, replies.to("first"))
    core.release("busy0")  # room, but no drain has run yet: the arrival must not jump ahead
    assert flow.submit(req("second"), STD, "", 5.0, replies.to("second")) is None
    assert isinstance(replies.got["first"], Decision)
    from pilotfish.scheduler.errors import UnknownModelError

    with pytest.raises(UnknownModelError):
        flow.submit(req("x", model="nope"), STD, "", 5.0, replies.to("x"))


def test_lite_flow_control_needs_a_capacity() -> None:
    with pytest.raises(ConfigError, match="--flow-lite-max"):
        make(Clock(), flow_lite_max_requests=0)


def _full(status: EngineStatus, max_num_seqs: int = 0) -> InstanceView:
    inst = InstanceView(Endpoint("e", "e:1"), max_num_seqs=max_num_seqs)
    inst.status = status
    return inst


@pytest.mark.parametrize(
    ("status", "inflight_prefill", "max_num_seqs", "reason"),
    [
        (EngineStatus(total_kv_tokens=1000), 0, 0, ""),
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=8000), 192, 0, "prefill"),
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=8000), 191, 0, ""),
        (EngineStatus(total_kv_tokens=1000, used_kv_tokens=900, unallocated_tokens=50), 0, 0, "kv"),
        (EngineStatus(total_kv_tokens=1000, used_kv_tokens=900, unallocated_tokens=49), 0, 0, ""),
        (EngineStatus(total_kv_tokens=1000, num_running=250, num_waiting=6), 0, 256, "batch"),
        (EngineStatus(total_kv_tokens=1000, num_running=250, num_waiting=5), 0, 256, ""),
        (EngineStatus(total_kv_tokens=1000, schedulable=False), 0, 0, "no_status"),
    ],
)
def test_full_mode_saturation_table(status: EngineStatus, inflight_prefill: int, max_num_seqs: int,
                                    reason: str) -> None:
    inst = _full(status, max_num_seqs)
    inst.inflight.prefill_tokens = inflight_prefill
    assert Saturation(full_mode=True).reason(inst) == reason


def test_lite_saturation_by_tokens_or_requests() -> None:
    inst = InstanceView(Endpoint("e", "e:1"))
    inst.lrs.num_tokens, inst.lrs.num_requests = 999, 3
    assert Saturation(lite_max_tokens=1000, lite_max_requests=4).reason(inst) == ""
    inst.lrs.num_tokens = 1000
    assert Saturation(lite_max_tokens=1000, lite_max_requests=4).reason(inst) == "tokens"
    inst.lrs.num_tokens, inst.lrs.num_requests = 0, 4
    assert Saturation(lite_max_tokens=1000, lite_max_requests=4).reason(inst) == "requests"


def test_full_mode_only_fresh_engines_are_judged() -> None:
    clock = Clock()
    config = SchedulerConfig(enable_full_mode_scheduling=True, enable_flow_control=True, instance_staleness_seconds=2)
    core = SchedulerCore(config, clock=clock, wall_clock=clock, rng=random.Random(0))
    flow = FlowController(core, config, clock=clock, wall_clock=clock)
    core.apply_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="10.0.0.1", http_port=8000, model="m",
                                                 update_id=1, num_gpu_blocks=100, block_size=16))
    assert not flow.has_room("m")  # no status yet
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=1, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=1600))
    assert flow.has_room("m")
    clock.now += 3
    assert not flow.has_room("m")  # stale: the policy would not pick it


def test_metrics_per_band_flow_and_engine() -> None:
    from prometheus_client import generate_latest

    from pilotfish.scheduler.flow import FlowGate

    clock = Clock()
    config = SchedulerConfig(instances=["a:1"], model=["m"], enable_flow_control=True, flow_lite_max_requests=1,
                             flow_established_after_ms=0)
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    gate = FlowGate.from_config(core, config)
    assert gate is not None
    flow = gate.controller
    flow._clock = clock
    replies = Replies()
    flow.submit(req("busy"), STD, "", 5.0, replies.to("busy"))
    flow.submit(req("w1"), STD, "tenant-a", 5.0, replies.to("w1"))
    flow.submit(req("w2"), SHED, "tenant-b", 5.0, replies.to("w2"))
    text = generate_latest(core.registry).decode()
    assert 'pilotfish_scheduler_flow_queue_requests{band="standard"} 1.0' in text
    assert 'pilotfish_scheduler_flow_queue_flow_requests{band="sheddable",flow="tenant-b"} 1.0' in text
    assert 'pilotfish_scheduler_instance_saturated{instance="a:1",reason="requests"} 1.0' in text
    assert 'pilotfish_scheduler_flow_inflight_tokens{flow="",over_share="0"} 10.0' in text
    clock.now += 0.3
    core.release("busy")
    flow.drain()
    clock.now += 5
    flow.expire()
    text = generate_latest(core.registry).decode()
    assert 'pilotfish_scheduler_flow_dispatched_total{band="standard",how="queued"} 1.0' in text
    assert 'pilotfish_scheduler_flow_shed_total{band="sheddable",reason="deadline"} 1.0' in text
    assert 'pilotfish_scheduler_flow_wait_seconds_bucket{band="standard",le="0.5"} 1.0' in text
    assert 'pilotfish_scheduler_flow_flow_wait_seconds_total{band="standard",flow="tenant-a"} 0.29' in text
    assert 'pilotfish_scheduler_flow_inflight_tokens{flow="tenant-a",over_share="0"} 10.0' in text
    assert 'flow=""' not in text.split("pilotfish_scheduler_flow_inflight_tokens", 1)[1]  # released: gone


def fair(clock: Clock, **overrides: object) -> tuple[SchedulerCore, FlowController]:
    """Two engines of 100 tokens each (lite mode); over its share a flow may fill them to 50."""
    values: dict[str, object] = {"flow_lite_max_requests": 0, "flow_lite_max_tokens": 100, "flow_over_share_bound": 0.5}
    values.update(overrides)
    return make(clock, **values)


def treq(rid: str, tokens: int) -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", prompt_tokens=tokens)


def test_a_flow_over_its_share_of_the_work_in_flight_waits_while_the_others_still_get_room() -> None:
    clock = Clock()
    core, flow = fair(clock)
    replies = Replies()
    for i in range(4):  # the flood alone: judged against the full bounds (60 of 100 per engine)
        assert isinstance(flow.submit(treq(f"b{i}", 30), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    assert flow.flow_tokens() == {"B": 120}
    assert isinstance(flow.submit(treq("a0", 10), STD, "A", 5.0, replies.to("a0")), Decision)
    assert flow.over_share("B") and not flow.over_share("A")
    # B holds 120 of 130 tokens: against 50 per engine it has no room, though 100 would leave some
    assert flow.has_room("m") and not flow.has_room("m", "B")
    assert flow.submit(treq("b4", 30), STD, "B", 5.0, replies.to("b4")) is None
    assert isinstance(flow.submit(treq("a1", 10), STD, "A", 5.0, replies.to("a1")), Decision)
    for i in range(4):  # B's requests finish: within its share again, once the account sees it
        core.release(f"b{i}")
    clock.now += 1
    assert flow.drain() == 1 and isinstance(replies.got["b4"], Decision)
    assert flow.flow_tokens() == {"A": 20, "B": 30}


def full_engine(clock: Clock, **overrides: object) -> tuple[SchedulerCore, FlowController]:
    """Full mode, one engine with a fresh status (nothing queued, KV of 10,000 tokens), a queued-prefill
    bound of 100 tokens."""
    values: dict[str, object] = {"enable_full_mode_scheduling": True, "enable_flow_control": True,
                                 "flow_max_queued_prefill_tokens": 100, "flow_over_share_bound": 0.5,
                                 "flow_established_after_ms": 0.0}
    values.update(overrides)
    config = SchedulerConfig(**values)  # type: ignore[arg-type]
    core = SchedulerCore(config, clock=clock, wall_clock=clock, rng=random.Random(0))
    core.apply_metadata(cms_pb2.InstanceMetadata(instance_id="e0", host="10.0.0.1", http_port=8000, model="m",
                                                 update_id=1, num_gpu_blocks=625, block_size=16))
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=1, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=10_000))
    return core, FlowController(core, config, clock=clock, wall_clock=clock)


@pytest.mark.parametrize(
    ("under_share_bound", "used_kv_tokens", "a_dispatched_at_once"),
    [
        (1.0, 0, False),  # the plain bound: A waits for the flood's 120 queued tokens to drain below 100
        (2.0, 0, True),  # A is judged against 200 queued tokens
        (4.0, 9_500, False),  # the KV bound (0.95) is never relaxed
    ],
)
def test_a_flow_within_its_share_may_queue_more_prefill_while_another_is_over_it(
    under_share_bound: float, used_kv_tokens: int, a_dispatched_at_once: bool
) -> None:
    clock = Clock()
    _, flow = full_engine(clock, flow_under_share_bound=under_share_bound)
    replies = Replies()
    for i in range(2):  # the flood alone, at the plain bound: 120 tokens in flight
        assert isinstance(flow.submit(treq(f"b{i}", 60), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    assert flow.submit(treq("b2", 60), STD, "B", 5.0, replies.to("b2")) is None
    assert flow.scales("B") == (1.0, 1.0)  # one flow alone: the plain bounds
    if used_kv_tokens:  # the engine's KV fills before A arrives
        flow.core.apply_status(cms_pb2.InstanceStatus(  # type: ignore[attr-defined]
            instance_id="e0", update_id=2, timestamp_ms=int(clock.now * 1000), schedulable=True,
            total_kv_tokens=10_000, used_kv_tokens=used_kv_tokens))
    outcome = flow.submit(treq("a0", 10), STD, "A", 5.0, replies.to("a0"))
    assert flow.over_share_flows() == {"B"}
    assert flow.scales("B") == (0.5, 1.0) and flow.scales("A") == (1.0, under_share_bound)
    assert isinstance(outcome, Decision) is a_dispatched_at_once
    assert flow.queued("b2")  # the flood still waits


def test_one_flow_alone_is_never_relaxed() -> None:
    """--flow-under-share-bound applies only beside a flow over its share: a single flow's
    saturation is the plain bounds' (what a lone tenant gets below and past the knee)."""
    clock = Clock()
    _, flow = full_engine(clock, flow_under_share_bound=4.0)
    replies = Replies()
    for i in range(2):
        assert isinstance(flow.submit(treq(f"a{i}", 60), STD, "A", 5.0, replies.to(f"a{i}")), Decision)
    assert flow.submit(treq("a2", 60), STD, "A", 5.0, replies.to("a2")) is None
    assert flow.scales("A") == flow.scales(None) == (1.0, 1.0) and not flow.has_room("m")


def test_fair_share_off_or_one_flow_alone_is_judged_against_the_full_bounds() -> None:
    for overrides, flows in (({"flow_fair_share": False}, ("B", "A")), ({}, ("B", "B"))):
        clock = Clock()
        _, flow = fair(clock, **overrides)
        replies = Replies()
        for i in range(4):
            assert isinstance(flow.submit(treq(f"b{i}", 30), STD, flows[0], 5.0, replies.to(f"b{i}")), Decision)
        assert isinstance(flow.submit(treq("x", 10), STD, flows[1], 5.0, replies.to("x")), Decision)
        assert not flow.over_share("B")
        assert isinstance(flow.submit(treq("b4", 30), STD, "B", 5.0, replies.to("b4")), Decision)


def test_waiting_work_counts_toward_a_flows_share() -> None:
    """A flood held in the queue stays the flow over its share: when an engine has room again the
    lighter flow gets it, though the flood's turn comes first and A has nothing in flight."""
    clock = Clock()
    core, flow = fair(clock, flow_lite_max_tokens=40)
    replies = Replies()
    placed = [flow.submit(treq(f"b{i}", 20), STD, "B", 5.0, replies.to(f"b{i}")) for i in range(4)]
    for i in range(4, 7):  # 20 tokens each: both engines at their 40
        assert flow.submit(treq(f"b{i}", 20), STD, "B", 5.0, replies.to(f"b{i}")) is None
    assert {d.target.instance_id for d in placed[:2]} == {"a:1", "b:2"}  # type: ignore[attr-defined]
    for i in range(2):
        core.release(f"b{i}")  # 20 left on each engine: room at 40, none at 20
    clock.now += 1
    # B: 40 in flight + 60 waiting against A's 30 waiting: over its share, so A leaves first
    assert isinstance(flow.submit(treq("a0", 10), STD, "A", 5.0, replies.to("a0")), Decision)
    assert all(flow.queued(f"b{i}") for i in range(4, 7))
    assert flow.over_share("B") and not flow.over_share("A")


def test_a_flood_stays_over_its_share_while_its_requests_wait_though_it_holds_less() -> None:
    """Held back hard, a flood's work in flight falls below the light flow's; while it still asks for
    more than its share and has requests waiting it stays flagged, so it cannot take the engines back
    at the plain bounds the moment its own requests finish."""
    clock = Clock()
    core, flow = fair(clock)
    replies = Replies()
    for i in range(4):  # the flood alone: 60 tokens per engine
        assert isinstance(flow.submit(treq(f"b{i}", 30), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    assert isinstance(flow.submit(treq("a0", 10), STD, "A", 5.0, replies.to("a0")), Decision)
    assert flow.submit(treq("b4", 30), STD, "B", 5.0, replies.to("b4")) is None  # past its 50
    assert isinstance(flow.submit(treq("a1", 40), STD, "A", 5.0, replies.to("a1")), Decision)
    assert flow.over_share_flows() == {"B"}
    for i in range(4):
        core.release(f"b{i}")
    clock.now += 1
    # B: 30 waiting against A's 50 in flight, but 150 of the 200 tokens asked lately, and waiting
    assert flow.flow_tokens() == {"A": 50}
    assert flow.over_share_flows() == {"B"} and flow.scales("B") == (0.5, 1.0)
    assert flow.drain() == 1 and isinstance(replies.got["b4"], Decision)  # room below 50 again
    assert flow.over_share_flows() == set()  # nothing waiting, 30 in flight against 50


def test_scale_tightens_the_token_bounds_but_not_the_batch_bound_in_full_mode() -> None:
    inst = InstanceView(Endpoint("e", "e:1"))
    inst.lrs.num_tokens, inst.lrs.num_requests = 500, 2
    assert Saturation(lite_max_tokens=1000, lite_max_requests=4).reason(inst) == ""
    assert Saturation(lite_max_tokens=1000).reason(inst, 0.5) == "tokens"
    assert Saturation(lite_max_requests=4).reason(inst, 0.5) == "requests"
    full = Saturation(full_mode=True)
    assert full.reason(_full(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=4096), 0), 0.5) == "prefill"
    assert full.reason(_full(EngineStatus(total_kv_tokens=1000, used_kv_tokens=475), 0), 0.5) == "kv"
    # half the batch is where engines run below the knee: a flow over its share is not held there
    assert full.reason(_full(EngineStatus(total_kv_tokens=1000, num_running=128), 256), 0.5) == ""
    assert full.reason(_full(EngineStatus(total_kv_tokens=1000, num_running=256), 256), 0.5) == "batch"


def test_a_lighter_flow_is_never_over_its_share_though_its_work_in_flight_is_the_larger() -> None:
    """Held back, a flood's work in flight can fall below a lighter flow's; what it asked for lately
    keeps the flag on the flood."""
    clock = Clock()
    core, flow = fair(clock)
    replies = Replies()
    for i in range(6):
        assert isinstance(flow.submit(treq(f"b{i}", 20), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    for i in range(2):
        assert isinstance(flow.submit(treq(f"a{i}", 30), STD, "A", 5.0, replies.to(f"a{i}")), Decision)
    assert flow.over_share("B") and not flow.over_share("A")
    for i in range(5):
        core.release(f"b{i}")
    clock.now += 1
    assert flow.flow_tokens() == {"A": 60, "B": 20}
    assert not flow.over_share("A") and not flow.over_share("B")


def test_arrival_rates_decay_and_forget() -> None:
    from pilotfish.scheduler.flow.controller import ArrivalRates

    rates = ArrivalRates(window_s=5.0)
    rates.add("a", 100, 0.0)
    rates.add("b", 10, 0.0)
    rates.add("a", 100, 5.0)
    got = rates.rates(5.0)
    assert got["a"] == pytest.approx(100 / 2.718281828 + 100, rel=1e-6) and got["b"] == pytest.approx(10 / 2.718281828)
    assert rates.rates(60.0) == {}  # decayed below a token: forgotten


def _stepped(status: EngineStatus, inflight_prefill: int = 0, inflight_requests: int = 0,
             budget: int = 0) -> InstanceView:
    """A full-mode engine with the default profile's step-time fit: 10 ms + 0.11 ms per prefill token
    + 0.03 ms per decoding request + 0.00009 ms per token of their context."""
    from pilotfish.scheduler.view.predictor import StepTimeModel
    from pilotfish.scheduler.view.profile import LatencyProfile

    inst = InstanceView(Endpoint("e", "e:1"), max_num_batched_tokens=budget)
    inst.status = status
    inst.inflight.prefill_tokens, inst.inflight.requests = inflight_prefill, inflight_requests
    inst.step_model = StepTimeModel(LatencyProfile(), 2.0)
    return inst


@pytest.mark.parametrize(
    ("inst", "bound_ms", "over_share", "reason"),
    [
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400)), 54.0, True, "step"),  # 54 ms
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=300), 99), 54.0, True, ""),  # 53.89
        (_stepped(EngineStatus(total_kv_tokens=1000, num_running_decode=100), 0, 100), 16.0, True, "step"),  # 16
        (_stepped(EngineStatus(total_kv_tokens=1000, running_decode_seq_len_sum=100_000)), 19.0, True, "step"),
        # one step computes at most its token budget: 10 + 0.11 x 512 = 66.3 ms, however much is queued
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=8000), 0, 0, 512), 67.0, True, ""),
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=8000), 0, 0, 512), 66.0, True, "step"),
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400)), 54.0, False, ""),  # within share
        (_stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400)), 0.0, True, ""),  # not judged
        (_full(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=4000)), 1.0, True, ""),  # no fit: no bound
    ],
)
def test_over_share_step_bound_table(inst: InstanceView, bound_ms: float, over_share: bool, reason: str) -> None:
    sat = Saturation(full_mode=True, max_queued_prefill_tokens=0, over_share_max_step_ms=bound_ms)
    assert sat.reason(inst, over_share=over_share) == reason


@pytest.mark.parametrize(
    ("bound_ms", "over_share_ms", "scale", "over_share", "reason"),
    [
        (54.0, 0.0, 1.0, False, "step"),  # every flow: the next step, 400 queued tokens, is 54 ms
        (55.0, 0.0, 1.0, False, ""),
        (100.0, 0.0, 0.5, False, "step"),  # the bounds' scale (a flow over its share) scales it: 50 ms
        (100.0, 0.0, 0.6, False, ""),  # 60 ms
        (100.0, 54.0, 1.0, True, "step"),  # over its share: the tighter of the two
        (50.0, 100.0, 1.0, True, "step"),
        (100.0, 54.0, 1.0, False, ""),  # within its share: only the bound for every flow
        (0.0, 54.0, 1.0, True, "step"),
    ],
)
def test_the_step_bound_for_every_flow(
    bound_ms: float, over_share_ms: float, scale: float, over_share: bool, reason: str
) -> None:
    """--flow-max-step-ms: saturated while the engine's predicted next step (10 + 0.11 x 400 ms) reaches the
    bound, for any flow; a flow over its share is held at the tighter of it (scaled) and its own bound."""
    inst = _stepped(EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400))
    sat = Saturation(
        full_mode=True, max_queued_prefill_tokens=0, max_step_ms=bound_ms, over_share_max_step_ms=over_share_ms
    )
    assert sat.reason(inst, scale, over_share=over_share) == reason


def test_the_step_bound_for_every_flow_never_holds_an_engine_with_no_prefill_queued() -> None:
    """A bound under any step the engine takes (1 ms against its 10 ms base) holds back prefill, one at a
    time, but never an engine with none queued, which would leave the fleet taking nothing; the over-share
    bound still counts the decode batch."""
    decoding = _stepped(EngineStatus(total_kv_tokens=1000, num_running=50, num_running_decode=50), 0, 2)
    assert Saturation(full_mode=True, max_step_ms=1.0).reason(decoding) == ""
    assert Saturation(full_mode=True, max_step_ms=1.0).reason(_stepped(EngineStatus(total_kv_tokens=1000))) == ""
    queued = _stepped(EngineStatus(total_kv_tokens=1000, num_running=50, num_running_decode=50), 16, 3)
    assert Saturation(full_mode=True, max_step_ms=1.0).reason(queued) == "step"
    assert Saturation(full_mode=True, over_share_max_step_ms=1.0).reason(decoding, over_share=True) == "step"


def test_the_step_bound_reaches_the_saturation_from_the_flag() -> None:
    config = SchedulerConfig(enable_full_mode_scheduling=True, enable_flow_control=True, flow_max_step_ms=80.0)
    assert Saturation.from_config(config).max_step_ms == 80.0
    assert Saturation.from_config(SchedulerConfig(enable_full_mode_scheduling=True)).max_step_ms == 0.0
    # a flow over its share is judged by the next step it would lengthen, 150 ms, as shipped
    assert Saturation.from_config(SchedulerConfig(enable_full_mode_scheduling=True)).over_share_max_step_ms == 150.0


def test_a_single_flow_waits_while_the_next_step_would_be_long() -> None:
    """--flow-max-step-ms holds even one flow: a request waits while the engine's predicted next step
    reaches the bound, though the token bounds have room, and goes once the engine computed its prefill."""
    clock = Clock()
    core, flow = full_engine(clock, flow_max_queued_prefill_tokens=10_000, flow_max_step_ms=30.0)
    replies = Replies()
    for i in range(2):  # 0, then 100 prompt tokens queued: 10 and 21 ms steps
        assert isinstance(flow.submit(treq(f"b{i}", 100), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    assert flow.submit(treq("b2", 100), STD, "B", 5.0, replies.to("b2")) is None  # 200 queued: over 30 ms
    clock.now += 0.1  # the engine admitted and prefilled both: nothing queued
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=2, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=10_000,
                                             admitted_request_ids=["b0", "b1"]))
    assert flow.drain() == 1 and isinstance(replies.got["b2"], Decision)


def test_a_flow_over_its_share_waits_while_the_next_step_would_be_long() -> None:
    """--flow-over-share-max-step-ms: the flood waits while the engine's predicted next step reaches
    the bound, though its scaled bounds have room; the light flow is dispatched beside it, and the
    flood again once the engine has computed its prefill."""
    clock = Clock()
    core, flow = full_engine(clock, flow_max_queued_prefill_tokens=10_000, flow_over_share_max_step_ms=30.0)
    replies = Replies()
    for i in range(2):  # the flood alone: 200 prompt tokens in flight, a 32 ms step, but one flow is never held
        assert isinstance(flow.submit(treq(f"b{i}", 100), STD, "B", 5.0, replies.to(f"b{i}")), Decision)
    assert isinstance(flow.submit(treq("a0", 10), STD, "A", 5.0, replies.to("a0")), Decision)
    assert flow.over_share_flows() == {"B"} and flow.scales("B") == (0.5, 1.0)  # 5,000 queued tokens allowed
    assert flow.submit(treq("b2", 100), STD, "B", 5.0, replies.to("b2")) is None  # 33.1 ms predicted
    assert isinstance(flow.submit(treq("a1", 10), STD, "A", 5.0, replies.to("a1")), Decision)
    clock.now += 0.1  # the engine admitted and prefilled all of it: nothing queued, a 10 ms step ahead
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=2, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=10_000,
                                             admitted_request_ids=["b0", "b1", "a0", "a1"]))
    assert flow.drain() == 1 and isinstance(replies.got["b2"], Decision)


@pytest.mark.parametrize(
    ("status", "reserve", "headroom_ms", "reason"),
    [
        # 400 queued + a 500-token critical prompt: 10 + 0.11 x 900 = 109 ms
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400), 500.0, 108.9, "headroom"),
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400), 500.0, 109.1, ""),
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400), 0.0, 1.0, ""),  # no critical: not judged
        (EngineStatus(total_kv_tokens=1000, uncomputed_prefill_tokens=400), 500.0, 0.0, ""),  # off
        # nothing queued: room, however long the critical prompt alone would take
        (EngineStatus(total_kv_tokens=1000, num_running_decode=50), 50_000.0, 1.0, ""),
    ],
)
def test_critical_headroom_table(status: EngineStatus, reserve: float, headroom_ms: float, reason: str) -> None:
    sat = Saturation(full_mode=True, max_queued_prefill_tokens=0, critical_headroom_ms=headroom_ms)
    assert sat.reason(_stepped(status), reserve_tokens=reserve) == reason


def test_critical_headroom_reaches_the_saturation_from_the_flag() -> None:
    assert Saturation.from_config(SchedulerConfig(enable_full_mode_scheduling=True)).critical_headroom_ms == 1000.0
    config = SchedulerConfig(enable_full_mode_scheduling=True, flow_critical_headroom_ms=0)
    assert Saturation.from_config(config).critical_headroom_ms == 0.0


def test_standard_requests_leave_room_to_start_a_critical_one_while_critical_requests_arrive() -> None:
    """--flow-critical-headroom-ms 30: with no critical traffic the token bound alone holds (10,000); once a
    critical request arrived, a standard one waits while the engine's queued prefill and a critical prompt
    would take 30 ms, critical ones are still dispatched, and the bound lapses when critical ones stop."""
    clock = Clock()
    core, flow = full_engine(clock, flow_max_queued_prefill_tokens=10_000, flow_critical_headroom_ms=30.0,
                             flow_sheddable_max_wait_ms=10_000)
    replies = Replies()
    for i in range(3):  # 300 prompt tokens queued: no critical request yet, so no headroom kept
        assert isinstance(flow.submit(treq(f"s{i}", 100), STD, "", 5.0, replies.to(f"s{i}")), Decision)
    assert flow.critical_reserve("m") == 0.0
    assert isinstance(flow.submit(treq("c0", 100), CRIT, "", 5.0, replies.to("c0")), Decision)
    assert flow.critical_reserve("m") == 100.0 and flow.critical_reserve("other-model") == 0.0  # per model
    # 400 queued + 100: 10 + 0.11 x 500 = 65 ms predicted, past 30: standard and sheddable wait
    assert flow.submit(treq("s3", 100), STD, "", 5.0, replies.to("s3")) is None
    assert flow.submit(treq("x0", 100), SHED, "", 10.0, replies.to("x0")) is None
    assert _saturated_reasons(flow) == {"e0": "headroom"}
    assert isinstance(flow.submit(treq("c1", 300), CRIT, "", 5.0, replies.to("c1")), Decision)  # past them
    assert flow.critical_reserve("m") == pytest.approx(120.0)  # the mean moves a tenth of the way
    clock.now += 0.1  # the engine admitted and prefilled all of it: nothing queued, room for s3 (one at a time)
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=2, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=10_000,
                                             admitted_request_ids=["s0", "s1", "s2", "c0", "c1"]))
    assert flow.drain() == 1 and isinstance(replies.got["s3"], Decision) and "x0" not in replies.got
    clock.now += 5.1  # no critical request within the 5 s window: the token bound alone again
    core.apply_status(cms_pb2.InstanceStatus(instance_id="e0", update_id=3, timestamp_ms=int(clock.now * 1000),
                                             schedulable=True, total_kv_tokens=10_000))
    assert flow.critical_reserve("m") == 0.0
    assert flow.drain() == 1 and isinstance(replies.got["x0"], Decision)


def _saturated_reasons(flow: FlowController) -> dict[str, str]:
    """instance -> the reason pilotfish_scheduler_instance_saturated gives it ("none": room)."""
    from pilotfish.scheduler.flow.metrics import FlowCollector

    family = next(m for m in FlowCollector(flow).collect() if m.name == "pilotfish_scheduler_instance_saturated")
    return {s.labels["instance"]: s.labels["reason"] for s in family.samples}


def test_the_critical_headroom_counts_what_a_critical_prompt_leaves_to_compute() -> None:
    """The reserve is the critical prompts' prefill on the engine each went to: a prompt the engine holds
    all but 10 tokens of adds 10 to the mean, not its 170."""
    clock = Clock()
    core, flow = full_engine(clock, flow_max_queued_prefill_tokens=10_000, flow_critical_headroom_ms=30.0)
    replies = Replies()
    blocks = tuple(range(1, 11))  # ten 16-token blocks: 160 of the 170 tokens
    for rid in ("c0", "c1"):
        info = RequestInfo(request_id=rid, model="m", prompt_tokens=170, prefix_block_hashes=blocks,
                           prefix_block_size=16)
        assert isinstance(flow.submit(info, CRIT, "", 5.0, replies.to(rid)), Decision)
    assert [e.prefill_tokens for e in core.account.entries_of("c1")] == [10]  # the engine holds c0's blocks
    assert flow.critical_reserve("m") == pytest.approx(0.9 * 170 + 0.1 * 10)


def test_critical_requests_for_a_model_no_engine_serves_leave_no_headroom_entry() -> None:
    clock = Clock()
    _, flow = full_engine(clock, flow_critical_headroom_ms=30.0)
    replies = Replies()
    for i in range(50):  # a critical client naming models nobody serves: each refused, none remembered
        with pytest.raises(SchedulerError):
            info = RequestInfo(request_id=f"x{i}", model=f"no-such-model-{i}", prompt_tokens=100)
            flow.submit(info, CRIT, "", 5.0, replies.to(f"x{i}"))
    assert flow.critical_reserve_on(InstanceView(Endpoint("any", "any:1"))) == 0.0  # serves every model
    assert all(flow.critical_reserve(f"no-such-model-{i}") == 0.0 for i in range(50))
    assert not flow._critical  # nothing kept per name
