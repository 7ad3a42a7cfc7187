"""The migration coordinator (vllm_plugin/core/migration.py) against a fake engine adapter.

Each llumlet here is real (its gRPC server, its coordinator, its LoadState); only the engine
behind it is a fake that records what the coordinator asks of it. Where a test needs a
destination that misbehaves on cue, a scripted MigrateIn servicer stands in for the neighbour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.migration_api import MigratingRequest, TokenRelay
from pilotfish.vllm_plugin.core.selection import MigrationCandidate, select_requests

WAIT_S = 30.0


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)
    return value


class NullWriter:
    def write_status(self, status: cms_pb2.InstanceStatus) -> None: ...
    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None: ...
    def remove(self) -> None: ...
    def close(self) -> None: ...


class FakeEngine:
    """A MigrationAdapter over a dict of requests; records every call, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, MigratingRequest] = {}
        self.relayed: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.reattached: dict[str, list[int]] = {}
        self.failed: dict[str, str] = {}
        self.admitted: dict[str, MigratingRequest] = {}
        self.relays: dict[str, TokenRelay] = {}
        self.dropped: list[str] = []
        self.refuse: str | None = None  # admit raises this
        self.reattach_error: str | None = None
        self.relay_error: str | None = None

    def add(self, rid: str, prompt: int = 8, output: int = 2, running: bool = True, arrival: float = 0.0) -> None:
        self.requests[rid] = MigratingRequest(
            rid, list(range(prompt)), [1000 + i for i in range(output)], max_tokens=100,
            sampling_params_json=b'{"stop_after": 50}', arrival_time_ms=int(arrival), running=running,
        )  # fmt: skip

    def candidates(self) -> list[MigrationCandidate]:
        with self.lock:
            return [
                MigrationCandidate(r.request_id, r.arrival_time_ms, r.running,
                                   len(r.prompt_token_ids) + len(r.output_token_ids))
                for r in self.requests.values()
            ]  # fmt: skip

    def detach(self, request_id: str) -> MigratingRequest | None:
        with self.lock:
            r = self.requests.pop(request_id, None)
            if r is None:
                return None
            return MigratingRequest(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids), r.max_tokens,
                                    r.sampling_params_json, r.arrival_time_ms, r.running)  # fmt: skip

    def relay(self, request_id: str, token_ids: list[int], finish_reason: str | None) -> None:
        with self.lock:
            if self.relay_error:
                raise LookupError(self.relay_error)
            assert request_id not in self.finished, "a token after the finish"
            self.relayed.setdefault(request_id, []).extend(token_ids)
            if finish_reason:
                self.finished[request_id] = finish_reason

    def reattach(self, request: MigratingRequest) -> None:
        with self.lock:
            if self.reattach_error:
                raise RuntimeError(self.reattach_error)
            self.reattached[request.request_id] = list(request.output_token_ids)
            self.requests[request.request_id] = request

    def fail(self, request_id: str, error: str) -> None:
        with self.lock:
            self.failed[request_id] = error

    def admit(self, request: MigratingRequest, relay: TokenRelay) -> None:
        with self.lock:
            if self.refuse:
                raise ValueError(self.refuse)
            self.admitted[request.request_id] = request
            self.relays[request.request_id] = relay

    def drop(self, request_id: str) -> None:
        with self.lock:
            self.dropped.append(request_id)


def any_destination(instance_id: str, address: str) -> str:
    """No CMS here: every destination is taken as registered (tests/unit/test_llumlet_rpc_guards.py
    checks the CMS's verdict)."""
    return address


def make_llumlet(instance_id: str, engine: FakeEngine | None, **kw: Any) -> Llumlet:
    cfg = LlumletConfig(cms_url="redis://127.0.0.1:1/0", **kw)
    llumlet = Llumlet(cfg, instance_id, cms_pb2.InstanceMetadata(host="127.0.0.1"), writer=NullWriter(),  # type: ignore[arg-type]
                      migration_adapter=engine, destination_check=any_destination)  # fmt: skip
    llumlet.start()
    return llumlet


def address(llumlet: Llumlet) -> str:
    return f"127.0.0.1:{llumlet.metadata.llumlet_port}"


@pytest.fixture
def started() -> Iterator[list[Any]]:
    """Everything a test starts (llumlets, servers), stopped at the end."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Llumlet):
            thing.stop(remove=False)
        else:
            thing.stop(None)


@pytest.fixture
def source(started: list[Any]) -> tuple[Llumlet, FakeEngine]:
    engine = FakeEngine()
    engine.add("r1", output=3)
    llumlet = make_llumlet("src", engine)
    started.append(llumlet)
    return llumlet, engine


def migrate(llumlet: Llumlet, **fields: Any) -> llumlet_pb2.MigrateResponse:
    with grpc.insecure_channel(address(llumlet)) as channel:
        return llumlet_pb2_grpc.LlumletStub(channel).Migrate(llumlet_pb2.MigrateRequest(**fields), timeout=WAIT_S)


def idle(llumlet: Llumlet) -> bool:
    assert llumlet.migration is not None
    status = llumlet.status_now()
    return llumlet.migration.in_flight() == (0, 0) and (status.num_migrating_out, status.num_migrating_in) == (0, 0)


class ScriptedNeighbour(llumlet_pb2_grpc.LlumletServicer):
    """A destination whose MigrateIn runs `script(request, context)` (a generator of chunks)."""

    def __init__(self, script: Callable[[llumlet_pb2.MigrateInRequest, grpc.ServicerContext], Iterator[Any]]) -> None:
        self.script = script
        self.calls: list[llumlet_pb2.MigrateInRequest] = []

    def MigrateIn(self, request: llumlet_pb2.MigrateInRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        self.calls.append(request)
        return self.script(request, context)


def serve_neighbour(started: list[Any], neighbour: ScriptedNeighbour) -> str:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    llumlet_pb2_grpc.add_LlumletServicer_to_server(neighbour, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    started.append(server)
    return f"127.0.0.1:{port}"


# ---- the accept path ------------------------------------------------------------------------------


def test_accepted_request_streams_through_the_source_in_order(source, started):
    src, src_engine = source
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine)
    started.append(dst)

    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=address(dst), source_instance_id="src",
                    destination_instance_id="dst")  # fmt: skip
    assert (list(reply.migrated_request_ids), list(reply.failed_request_ids), reply.error) == (["r1"], [], "")
    # the destination rebuilt the request exactly as the source had it
    got = dst_engine.admitted["r1"]
    assert (got.prompt_token_ids, got.output_token_ids, got.max_tokens) == (list(range(8)), [1000, 1001, 1002], 100)
    assert (got.sampling_params_json, got.method) == (b'{"stop_after": 50}', "recompute")
    assert "r1" not in src_engine.requests  # detached: computed elsewhere now

    relay = dst_engine.relays["r1"]
    for tokens in ([5], [6, 7], [], [8, 9]):
        relay(tokens, None)
    relay([10], "stop")
    wait_for(lambda: "r1" in src_engine.finished, "the finish relayed to the source")
    assert src_engine.relayed["r1"] == [5, 6, 7, 8, 9, 10]  # each once, in order
    assert src_engine.finished["r1"] == "stop"
    wait_for(lambda: idle(src) and idle(dst), "both coordinators idle")
    assert (src_engine.reattached, src_engine.failed, dst_engine.dropped) == ({}, {}, [])
    assert src.migration.num_migrated_out == 1 and dst.migration.num_migrated_in == 1  # type: ignore[union-attr]


def test_migration_counters_show_requests_in_transit(source, started):
    src, _ = source
    release = threading.Event()

    def slow_accept(request, context):
        release.wait(WAIT_S)
        yield llumlet_pb2.MigrateInChunk(accepted=True)
        yield llumlet_pb2.MigrateInChunk(finish_reason="stop")

    neighbour = serve_neighbour(started, ScriptedNeighbour(slow_accept))
    answer = futures.ThreadPoolExecutor(1).submit(
        migrate, src, request_ids=["r1"], destination_llumlet_address=neighbour
    )
    wait_for(lambda: src.status_now().num_migrating_out == 1, "num_migrating_out while in transit")
    release.set()
    assert list(answer.result(WAIT_S).migrated_request_ids) == ["r1"]
    wait_for(lambda: idle(src), "the source idle")


@pytest.mark.parametrize(
    ("rule", "order", "value"),
    [
        (llumlet_pb2.SELECT_RULE_NUM_REQ, llumlet_pb2.SELECT_ORDER_FCW, 1),
        (llumlet_pb2.SELECT_RULE_NUM_REQ, llumlet_pb2.SELECT_ORDER_LCR, 2),
        (llumlet_pb2.SELECT_RULE_TOKEN, llumlet_pb2.SELECT_ORDER_SR, 20),
        (llumlet_pb2.SELECT_RULE_RATIO, llumlet_pb2.SELECT_ORDER_LR, 0.5),
    ],
)
def test_selection_by_rule_moves_what_select_requests_picks(started, rule, order, value):
    engine = FakeEngine()
    engine.add("w1", output=0, running=False, arrival=1)
    engine.add("w2", output=0, running=False, arrival=2)
    engine.add("a", prompt=4, output=1, arrival=3)
    engine.add("b", prompt=30, output=5, arrival=4)
    engine.add("c", prompt=12, output=1, arrival=5)
    src = make_llumlet("src", engine)
    started.append(src)
    with src.events() as s:
        s.kv_usage(0, 10, 8)  # 80 tokens of KV: RATIO 0.5 is 40 tokens
    expected = select_requests(engine.candidates(), _RULE_NAMES[rule], _ORDER_NAMES[order], value, 80)
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine)
    started.append(dst)

    reply = migrate(src, destination_llumlet_address=address(dst), select_rule=rule, select_order=order,
                    select_value=value)  # fmt: skip
    assert expected and list(reply.migrated_request_ids) == expected
    assert sorted(dst_engine.admitted) == sorted(expected)
    for relay in dst_engine.relays.values():
        relay([], "abort")
    wait_for(lambda: idle(src) and idle(dst), "both coordinators idle")


_RULE_NAMES = {llumlet_pb2.SELECT_RULE_NUM_REQ: "NUM_REQ", llumlet_pb2.SELECT_RULE_TOKEN: "TOKEN",
               llumlet_pb2.SELECT_RULE_RATIO: "RATIO"}  # fmt: skip
_ORDER_NAMES = {llumlet_pb2.SELECT_ORDER_FCW: "FCW", llumlet_pb2.SELECT_ORDER_LCR: "LCR",
                llumlet_pb2.SELECT_ORDER_SR: "SR", llumlet_pb2.SELECT_ORDER_LR: "LR"}  # fmt: skip


def test_token_travels_to_the_destination(started):
    engine = FakeEngine()
    engine.add("r1")
    src = make_llumlet("src", engine, llumlet_token="s3cret")
    started.append(src)
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine, llumlet_token="s3cret")
    started.append(dst)
    with grpc.insecure_channel(address(src)) as channel:
        reply = llumlet_pb2_grpc.LlumletStub(channel).Migrate(
            llumlet_pb2.MigrateRequest(request_ids=["r1"], destination_llumlet_address=address(dst)),
            metadata=(("authorization", "Bearer s3cret"),), timeout=WAIT_S,
        )  # fmt: skip
    assert list(reply.migrated_request_ids) == ["r1"]
    dst_engine.relays["r1"]([], "length")
    wait_for(lambda: engine.finished.get("r1") == "length", "the finish")


# ---- failures: the request always continues somewhere, or ends with an error -------------------------


def test_refused_request_is_reattached_with_its_tokens(source, started):
    src, src_engine = source
    dst_engine = FakeEngine()
    dst_engine.refuse = "no room for it"
    dst = make_llumlet("dst", dst_engine)
    started.append(dst)

    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=address(dst))
    assert (list(reply.migrated_request_ids), list(reply.failed_request_ids)) == ([], ["r1"])
    assert "no room for it" in reply.error
    assert src_engine.reattached == {"r1": [1000, 1001, 1002]}
    assert "r1" in src_engine.requests and src_engine.relayed == {}
    wait_for(lambda: idle(src) and idle(dst), "both coordinators idle")


@pytest.mark.parametrize("destination", ["no_adapter", "closed_port"])
def test_unusable_destination_is_a_failed_migration(source, started, destination):
    src, src_engine = source
    if destination == "no_adapter":
        dst = make_llumlet("dst", None)
        started.append(dst)
        where = address(dst)
    else:
        server = grpc.server(futures.ThreadPoolExecutor(1))
        port = server.add_insecure_port("127.0.0.1:0")  # bound, never started: nothing answers
        where = f"127.0.0.1:{port}"
    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=where)
    assert list(reply.failed_request_ids) == ["r1"] and reply.error
    assert src_engine.reattached == {"r1": [1000, 1001, 1002]}
    wait_for(lambda: idle(src), "the source idle")


def _breaks_after(tokens: list[list[int]], how: str):
    def script(request, context):
        yield llumlet_pb2.MigrateInChunk(accepted=True)
        for chunk in tokens:
            yield llumlet_pb2.MigrateInChunk(token_ids=chunk)
        if how == "error_chunk":
            yield llumlet_pb2.MigrateInChunk(error="the engine crashed")
        elif how == "rpc_error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        # "ends": the stream just stops, with no finish reason

    return script


@pytest.mark.parametrize("how", ["error_chunk", "rpc_error", "ends"])
def test_stream_breaking_midway_reattaches_with_every_relayed_token(source, started, how):
    src, src_engine = source
    neighbour = serve_neighbour(started, ScriptedNeighbour(_breaks_after([[10, 11], [12]], how)))

    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=neighbour)
    assert list(reply.migrated_request_ids) == ["r1"]
    wait_for(lambda: "r1" in src_engine.reattached, "the reattach")
    assert src_engine.relayed["r1"] == [10, 11, 12]
    # the client has seen 1000..1002 from here and 10..12 relayed: the source continues after all six
    assert src_engine.reattached["r1"] == [1000, 1001, 1002, 10, 11, 12]
    assert src_engine.failed == {} and "r1" not in src_engine.finished
    wait_for(lambda: idle(src), "the source idle")


def test_destination_llumlet_stopping_hands_the_request_back(source, started):
    src, src_engine = source
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine)
    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=address(dst))
    assert list(reply.migrated_request_ids) == ["r1"]
    dst_engine.relays["r1"]([20, 21], None)
    wait_for(lambda: src_engine.relayed.get("r1") == [20, 21], "two relayed tokens")
    dst.stop(remove=False)
    wait_for(lambda: "r1" in src_engine.reattached, "the reattach")
    assert src_engine.reattached["r1"] == [1000, 1001, 1002, 20, 21]
    wait_for(lambda: dst_engine.dropped == ["r1"], "the destination dropping its copy")


def test_not_accepted_in_time_is_a_failed_migration(started):
    engine = FakeEngine()
    engine.add("r1")
    src = make_llumlet("src", engine, migration_accept_timeout_ms=200)
    started.append(src)
    gone = threading.Event()

    def silent(request, context):
        context.add_callback(gone.set)
        gone.wait(WAIT_S)
        yield from ()

    neighbour = serve_neighbour(started, ScriptedNeighbour(silent))
    reply = migrate(src, request_ids=["r1"], destination_llumlet_address=neighbour)
    assert list(reply.failed_request_ids) == ["r1"] and "not accepted within" in reply.error
    assert engine.reattached == {"r1": [1000, 1001]}
    wait_for(gone.is_set, "the source cancelling the call")


def test_reattach_impossible_fails_the_request_with_an_error(source, started):
    src, src_engine = source
    src_engine.reattach_error = "the engine is shutting down"
    neighbour = serve_neighbour(started, ScriptedNeighbour(_breaks_after([[10]], "error_chunk")))
    migrate(src, request_ids=["r1"], destination_llumlet_address=neighbour)
    wait_for(lambda: "r1" in src_engine.failed, "the failure")
    assert "the engine is shutting down" in src_engine.failed["r1"]
    assert "the engine crashed" in src_engine.failed["r1"]
    assert src_engine.relayed["r1"] == [10] and src_engine.reattached == {}
    wait_for(lambda: idle(src), "the source idle")


def test_client_gone_cancels_the_destination(source, started):
    src, src_engine = source
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine)
    started.append(dst)
    migrate(src, request_ids=["r1"], destination_llumlet_address=address(dst))
    src_engine.relay_error = "the client went away"
    dst_engine.relays["r1"]([30], None)
    wait_for(lambda: dst_engine.dropped == ["r1"], "the destination dropping the request")
    wait_for(lambda: "r1" in src_engine.failed, "the source ending it")
    assert src_engine.reattached == {}
    wait_for(lambda: idle(src) and idle(dst), "both coordinators idle")


def test_all_tokens_relayed_but_finish_lost_ends_the_request_here(started):
    engine = FakeEngine()
    engine.add("r1", output=2)
    engine.requests["r1"].max_tokens = 4
    src = make_llumlet("src", engine)
    started.append(src)
    neighbour = serve_neighbour(started, ScriptedNeighbour(_breaks_after([[7, 8]], "rpc_error")))
    migrate(src, request_ids=["r1"], destination_llumlet_address=neighbour)
    wait_for(lambda: "r1" in engine.finished, "the finish")
    assert (engine.relayed["r1"], engine.finished["r1"], engine.reattached) == ([7, 8], "length", {})


# ---- bounds -----------------------------------------------------------------------------------------


def test_outgoing_migrations_are_bounded(started):
    engine = FakeEngine()
    for rid in ("r1", "r2", "r3"):
        engine.add(rid)
    src = make_llumlet("src", engine, max_migrations=2)
    started.append(src)
    release = threading.Event()

    def hold(request, context):
        yield llumlet_pb2.MigrateInChunk(accepted=True)
        release.wait(WAIT_S)
        yield llumlet_pb2.MigrateInChunk(finish_reason="stop")

    neighbour = serve_neighbour(started, ScriptedNeighbour(hold))
    reply = migrate(src, request_ids=["r1", "r2", "r3"], destination_llumlet_address=neighbour)
    assert list(reply.migrated_request_ids) == ["r1", "r2"]
    assert list(reply.failed_request_ids) == ["r3"] and "busy" in reply.error
    assert "r3" in engine.requests  # never detached
    with pytest.raises(grpc.RpcError) as exc:
        migrate(src, request_ids=["r3"], destination_llumlet_address=neighbour)
    assert exc.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    release.set()
    wait_for(lambda: idle(src), "the source idle")
    assert engine.finished == {"r1": "stop", "r2": "stop"}
    assert list(migrate(src, request_ids=["r3"], destination_llumlet_address=neighbour).migrated_request_ids) == ["r3"]


def test_incoming_migrations_are_bounded(started):
    engine = FakeEngine()
    engine.add("r1")
    engine.add("r2")
    src = make_llumlet("src", engine)
    started.append(src)
    dst_engine = FakeEngine()
    dst = make_llumlet("dst", dst_engine, max_migrations=1)
    started.append(dst)
    reply = migrate(src, request_ids=["r1", "r2"], destination_llumlet_address=address(dst))
    # both streams open at once: either may be the one the destination takes
    (moved,), (refused,) = reply.migrated_request_ids, reply.failed_request_ids
    assert {moved, refused} == {"r1", "r2"} and "RESOURCE_EXHAUSTED" in reply.error
    assert engine.reattached == {refused: [1000, 1001]}
    dst_engine.relays[moved]([], "stop")
    wait_for(lambda: idle(src) and idle(dst), "both coordinators idle")


# ---- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"request_ids": ["r1"], "source_instance_id": "other"}, "source_instance_id"),
        ({"request_ids": ["r1"], "destination_llumlet_address": ""}, "destination_llumlet_address"),
        ({"request_ids": ["r1"], "destination_instance_id": "src"}, "this instance"),
        ({"request_ids": ["r1"], "destination_llumlet_address": "SELF"}, "this instance"),
        ({}, "request_ids, or a select_rule"),
        ({"select_rule": llumlet_pb2.SELECT_RULE_TOKEN, "select_value": 5}, "select_order"),
        ({"select_rule": 42, "select_order": llumlet_pb2.SELECT_ORDER_SR, "select_value": 5}, "select_rule"),
        ({"select_rule": llumlet_pb2.SELECT_RULE_TOKEN, "select_order": 42, "select_value": 5}, "select_order"),
        ({"select_rule": llumlet_pb2.SELECT_RULE_TOKEN, "select_order": llumlet_pb2.SELECT_ORDER_SR}, "select_value"),
        (
            {
                "select_rule": llumlet_pb2.SELECT_RULE_RATIO,
                "select_order": llumlet_pb2.SELECT_ORDER_SR,
                "select_value": 1.5,
            },
            "fraction",
        ),
        ({"request_ids": ["r1"], "method": 7}, "method"),
        ({"request_ids": ["r"] * 5000}, "max"),
    ],
)
def test_bad_arguments_are_invalid_argument(source, fields, fragment):
    src, engine = source
    fields = {"destination_llumlet_address": "127.0.0.1:1", **fields}
    if fields["destination_llumlet_address"] == "SELF":
        fields["destination_llumlet_address"] = address(src)
    with pytest.raises(grpc.RpcError) as exc:
        migrate(src, **fields)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in exc.value.details()
    assert "r1" in engine.requests  # nothing was detached


def test_unknown_request_fails_without_touching_others(source, started):
    src, engine = source
    reply = migrate(src, request_ids=["nope"], destination_llumlet_address="127.0.0.1:1")
    assert list(reply.failed_request_ids) == ["nope"] and "not migratable" in reply.error
    assert "r1" in engine.requests


def test_migrate_without_an_adapter_is_unimplemented(started):
    llumlet = make_llumlet("plain", None)
    started.append(llumlet)
    with pytest.raises(grpc.RpcError) as exc:
        migrate(llumlet, request_ids=["r1"], destination_llumlet_address="127.0.0.1:1")
    assert exc.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "migration adapter" in exc.value.details()


def test_adapter_assigned_after_construction_enables_migration(started):
    engine = FakeEngine()
    engine.add("r1")
    llumlet = make_llumlet("late", None)
    started.append(llumlet)
    llumlet.migration_adapter = engine  # an adapter that needs the llumlet first, as vLLM's does
    reply = migrate(llumlet, request_ids=["nope"], destination_llumlet_address="127.0.0.1:1")
    assert list(reply.failed_request_ids) == ["nope"]
