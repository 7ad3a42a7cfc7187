"""Flow keys grouped by the client's address (scheduler/flow/groups.py, ext_proc/flow.py): shares and queue
turns go to groups first, so a client that keeps many tenant ids alive gets one group's, not one per id."""

from __future__ import annotations

import random

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from prometheus_client import generate_latest

from pilotfish.ext_proc.flow import FlowHeaders, flow_of, group_of_address, source_address
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import Decision, SchedulerCore
from pilotfish.scheduler.flow import Band, FlowController, FlowGate, FlowQueue, Waiting
from pilotfish.scheduler.flow.groups import by_group, group_of, joined
from pilotfish.scheduler.flow.newcomers import NEWCOMERS, Newcomers
from pilotfish.scheduler.view.types import RequestInfo

STD = int(Band.STANDARD)


def test_a_key_names_its_group_and_an_ungrouped_key_is_in_the_empty_one() -> None:
    assert group_of(joined("g1", "tenant")) == "g1" and joined("g1", "tenant") == "g1:tenant"
    assert group_of("tenant") == "" and joined("", "tenant") == "tenant"


def test_flows_are_listed_by_group_in_the_order_given() -> None:
    assert by_group(["g1:a", "b", "g2:c", "g1:d"]) == {"g1": ["g1:a", "g1:d"], "": ["b"], "g2": ["g2:c"]}


# -- the queue -----------------------------------------------------------------------------------------


def w(rid: str, flow: str, band: Band = Band.STANDARD) -> Waiting:
    return Waiting(RequestInfo(request_id=rid, model="m", prompt_tokens=1), band, flow, 0.0, 10.0)


def drain(q: FlowQueue) -> list[str]:
    out = []
    while (x := q.pop()) is not None:
        out.append(x.req.request_id)
    return out


def client_and_tenant(grouped: bool) -> FlowQueue:
    """A client's 4 ids with 3 requests each, then a tenant's 3, from another address when `grouped`."""
    q = FlowQueue()
    for i in range(4):
        for j in range(3):
            q.push(w(f"c{i}.{j}", joined("client" if grouped else "", f"id{i}")))
    for j in range(3):
        q.push(w(f"t.{j}", joined("tenant" if grouped else "", "t")))
    return q


def test_the_queue_turns_go_round_the_groups_then_round_a_groups_flows() -> None:
    assert drain(client_and_tenant(grouped=True))[:7] == ["c0.0", "t.0", "c1.0", "t.1", "c2.0", "t.2", "c3.0"]
    # ungrouped, each of the client's ids takes a turn before the tenant's next request
    assert drain(client_and_tenant(grouped=False))[:7] == ["c0.0", "c1.0", "c2.0", "c3.0", "t.0", "c0.1", "c1.1"]


def test_a_group_per_flow_pops_as_flows_counted_alone() -> None:
    """Random pushes, pops (some flows refused) and cancels on two queues, one with each flow in a group of
    its own: the same requests leave in the same order."""
    rng = random.Random(7)
    plain, grouped = FlowQueue(), FlowQueue()
    live: dict[str, tuple[Waiting, Waiting]] = {}
    out_plain: list[str] = []
    out_grouped: list[str] = []
    for n in range(3000):
        op = rng.random()
        if op < 0.5:
            f, band = f"f{rng.randrange(6)}", rng.choice([Band.CRITICAL, Band.STANDARD, Band.SHEDDABLE])
            a, b = w(f"r{n}", f, band), w(f"r{n}", joined(f"g{f}", f), band)
            plain.push(a)
            grouped.push(b)
            live[f"r{n}"] = (a, b)
        elif op < 0.85:
            refused = f"f{rng.randrange(6)}"
            a = plain.pop(lambda flow, band, no=refused: flow != no)
            b = grouped.pop(lambda flow, band, no=refused: flow.partition(":")[2] != no)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                out_plain.append(a.req.request_id)
                out_grouped.append(b.req.request_id)
                live.pop(a.req.request_id)
        elif live:
            rid = rng.choice(sorted(live))
            a, b = live.pop(rid)
            plain.cancel(a)
            grouped.cancel(b)
    assert out_grouped == out_plain and len(out_plain) > 500


def test_a_full_queue_sheds_from_the_group_that_holds_most() -> None:
    """A client's 4 ids hold 2 sheddable requests each, a tenant's one id 3: the tenant's flow is the largest,
    the client's group is."""
    q = FlowQueue()
    for i in range(4):
        for j in range(2):
            q.push(w(f"c{i}.{j}", joined("client", f"id{i}"), Band.SHEDDABLE))
    for j in range(3):
        q.push(w(f"t.{j}", joined("tenant", "t"), Band.SHEDDABLE))
    evicted = q.evict_for(Band.STANDARD)
    assert evicted is not None and group_of(evicted.flow) == "client"


# -- the controller ------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LITE = {"flow_lite_max_requests": 0, "flow_lite_max_tokens": 1000}  # saturated at 1,000 tokens in flight


def controller(clock: Clock, **fields: object) -> FlowController:
    """Flow control on two lite engines, every tenant id established at once, on `clock`."""
    config = SchedulerConfig(instances=["a:1", "b:2"], model=["m"], enable_flow_control=True,
                             flow_established_after_ms=0, **{**LITE, **fields})  # type: ignore[arg-type]  # fmt: skip
    core = SchedulerCore(config, clock=clock, rng=random.Random(0))
    gate = FlowGate.from_config(core, config)
    assert gate is not None
    gate.controller._clock = clock
    return gate.controller


def submitted(flow: FlowController, rid: str, key: str, tokens: int) -> None:
    """A request of `tokens` prompt tokens for flow `key`, dispatched at once."""
    r = RequestInfo(request_id=rid, model="m", prompt_tokens=tokens)
    assert isinstance(flow.submit(r, STD, key, 5.0, lambda o: None), Decision)


@pytest.mark.parametrize("grouped", [True, False])
def test_a_client_keeping_many_ids_alive_is_over_its_share_not_the_tenant(grouped: bool) -> None:
    """A tenant holds 60 tokens; a client keeps 8 ids alive, 30 tokens each (240). Grouped by address, the
    client's group holds 240 of 300 against half, and its ids are over their share. Counted as flows alone,
    each id holds under 1/9 and the tenant, at 60, is the one over its share (and held back)."""
    flow = controller(Clock())
    tenant = joined("tenant-address" if grouped else "", "t")
    submitted(flow, "t0", tenant, 30)
    submitted(flow, "t1", tenant, 30)
    ids = [joined("client-address" if grouped else "", f"id{i}") for i in range(8)]
    for i, key in enumerate(ids):
        submitted(flow, f"c{i}", key, 30)
    assert flow.over_share_flows() == (set(ids) if grouped else {tenant})
    text = generate_latest(flow.core.registry).decode()  # type: ignore[attr-defined]
    assert f"pilotfish_scheduler_flow_over_share_groups {1.0 if grouped else 0.0}" in text


def test_ids_not_yet_established_wait_in_their_groups_newcomers() -> None:
    ids = Newcomers(after_s=1.0)
    assert ids.flow("g1:id", 0.0) == "g1:~newcomers" and ids.flow("g2:id", 0.0) == "g2:~newcomers"
    assert ids.flow("id", 0.0) == NEWCOMERS
    assert ids.flow("g1:", 0.0) == "g1:"  # a group's default flow (no tenant header) is always itself
    assert ids.flow("g1:id", 1.0) == "g1:id"


# -- the gateway ---------------------------------------------------------------------------------------


def test_an_address_is_grouped_by_its_ip_and_an_ipv6_one_by_its_64() -> None:
    assert group_of_address("10.0.0.1:4000") == group_of_address("10.0.0.1:5000") == group_of_address("10.0.0.1")
    assert group_of_address("10.0.0.1:4000") != group_of_address("10.0.0.2:4000")
    assert group_of_address("[2001:db8::1]:443") == group_of_address("[2001:db8::ffff:1]:443")  # one /64
    assert group_of_address("[2001:db8::1]:443") != group_of_address("[2001:db8:0:1::1]:443")
    assert group_of_address("[::ffff:10.0.0.1]:80") == group_of_address("10.0.0.1:80")  # IPv4-mapped
    assert len(group_of_address("10.0.0.1:1")) == 16  # a hash: the address itself never leaves the gateway
    for odd in (None, "", "not an address", "/run/envoy.sock", "[2001:db8::1", "1" * 100):
        assert group_of_address(odd) == ""


def test_the_groups_of_addresses_seen_are_kept_bounded() -> None:
    from pilotfish.ext_proc import flow as gateway_flow

    first = group_of_address("10.1.0.0:1")
    for i in range(gateway_flow._MAX_CACHED_GROUPS + 10):
        group_of_address(f"10.2.{i // 256}.{i % 256}:1")
        assert len(gateway_flow._groups) <= gateway_flow._MAX_CACHED_GROUPS
    assert group_of_address("10.1.0.0:2") == first  # forgotten or not, the same group


def request_headers(address: str | None) -> ep.ProcessingRequest:
    message = ep.ProcessingRequest()
    if address is not None:
        fields = struct_pb2.Struct()
        fields.update({"source.address": address})
        message.attributes["envoy.filters.http.ext_proc"].CopyFrom(fields)
    return message


def test_the_gateway_prefixes_the_flow_with_the_clients_group_unless_told_not_to() -> None:
    headers = {"x-tenant-id": "acme"}
    source = source_address(request_headers("192.0.2.7:31000").attributes)
    assert source == "192.0.2.7:31000"
    _, flow, _ = FlowHeaders().read(headers, source)
    assert flow == f"{group_of_address('192.0.2.7')}:{flow_of('acme')}"
    _, flow, _ = FlowHeaders(groups="none").read(headers, source)
    assert flow == flow_of("acme")
    # no attribute (a gateway whose Envoy does not send it): the flow as before
    assert source_address(request_headers(None).attributes) is None
    assert FlowHeaders().read(headers, None)[1] == flow_of("acme")


def test_one_group_or_a_group_per_flow_is_judged_as_flows_counted_alone() -> None:
    """Three controllers take the same requests and releases from 5 tenants: with no groups, all in one group,
    and each tenant in a group of its own. After every step the same tenants are over their share, and
    every tenant's bounds are scaled alike."""
    clock = Clock()
    keyings = (lambda t: t, lambda t: joined("one", t), lambda t: joined(f"g{t}", t))
    flows = [controller(clock, flow_lite_max_tokens=100_000) for _ in keyings]
    rng = random.Random(3)
    tenants = [f"t{i}" for i in range(5)]
    held: list[str] = []
    judged = loosened = 0
    for n in range(600):
        clock.now += rng.expovariate(20.0)
        tenant = tenants[min(rng.randrange(8), 4)]  # t4 sends half the requests
        if held and rng.random() < 0.45:
            rid = held.pop(rng.randrange(len(held)))
            for flow in flows:
                flow.core.release(rid)  # type: ignore[attr-defined]
        else:
            r = RequestInfo(request_id=f"r{n}", model="m", prompt_tokens=rng.randrange(10, 400))
            for flow, key in zip(flows, keyings, strict=True):
                assert isinstance(flow.submit(r, STD, key(tenant), 0.0, lambda o: None), Decision)
            held.append(r.request_id)
        overs = [{k.rpartition(":")[2] for k in flow.over_share_flows()} for flow in flows]
        assert overs[1] == overs[0] and overs[2] == overs[0]
        scales = [[flow.scales(key(t)) for t in tenants] for flow, key in zip(flows, keyings, strict=True)]
        assert scales[1] == scales[0] and scales[2] == scales[0]
        judged += bool(overs[0])
        loosened += any(prefill > 1.0 for _, prefill in scales[0])
    assert judged > 100 and loosened > 100  # the comparison saw tenants over their share, and the others let in


@pytest.mark.parametrize(
    ("args", "asked"),
    [
        ([], ["source.address"]),
        (["--flow-groups", "source"], ["source.address"]),
        (["--flow-groups", "none"], []),
        (["--flow-groups=none"], []),
    ],
)
def test_the_stack_asks_envoy_for_the_address_only_when_the_gateway_groups_by_it(args: list[str], asked: list) -> None:
    import yaml

    from pilotfish.stack import StackSpec, _bootstrap

    text = _bootstrap(StackSpec(ext_proc_args=args), 10000, 10001, 10002, [("127.0.0.1", 10003)], None)
    hcm = yaml.safe_load(text)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    xp = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert xp["typed_config"]["request_attributes"] == asked


def test_an_idle_id_of_a_group_over_its_share_is_over_its_share_too() -> None:
    """A client's group is over its share: an id of it with nothing in flight yet gets the over-share bounds
    (else every fresh id would be a way round the group's share); a fresh id of another address does not."""
    flow = controller(Clock())
    for rid, key in (("t0", "tenant-address:t"), *((f"c{i}", f"client-address:id{i}") for i in range(4))):
        submitted(flow, rid, key, 30)
    assert flow.over_share("client-address:id9")  # idle, but its address holds 120 of 150
    assert not flow.over_share("tenant-address:other")
    assert flow.scales("client-address:id9")[0] == flow.settings.over_share_bound


def test_a_flow_over_its_share_within_its_group_lets_no_one_else_in() -> None:
    """Neither address is over its share (150 tokens each), but one of the client's two ids holds 120 of its
    address's 150: that id is held to the over-share bounds, and nobody gets the looser under-share bound
    (which lets a light tenant in beside a flood): the client's other id is no flood's neighbour."""
    flow = controller(Clock())
    for rid, key, tokens in (("t", "tenant:t", 150), ("c0", "client:id0", 120), ("c1", "client:id1", 30)):
        submitted(flow, rid, key, tokens)
    assert flow.over_share_flows() == {"client:id0"}
    assert flow.scales("client:id0") == (flow.settings.over_share_bound, 1.0)
    assert flow.scales("client:id1") == flow.scales("tenant:t") == (1.0, 1.0)
