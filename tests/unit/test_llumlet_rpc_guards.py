"""The llumlet's gRPC guards: who may call Abort, Migrate and MigrateIn (core/server.py), and where a
Migrate may send a request (core/destinations.py).

Real llumlets with their real gRPC servers over a fake engine; the CMS verdicts are driven through
`CmsDestinations` with a stand-in for Redis's MGET here, and against a real redis-server in
tests/integration/test_llumlet_rpc_guards.py.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis

from pilotfish.cms import keys
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core import destinations as d
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.server import is_loopback
from tests.unit.test_migration_coordinator import FakeEngine, NullWriter, any_destination

TOKEN = (("authorization", "Bearer s3cret"),)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("llumlet.example", False),
    ],
)
def test_loopback_is_only_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


class Engine(FakeEngine):
    """The fake engine, plus what an abort asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[list[str]] = []

    def abort(self, ids: list[str]) -> list[str]:
        self.aborted.append(ids)
        return ids


@pytest.fixture
def llumlets() -> Iterator[list[Llumlet]]:
    started: list[Llumlet] = []
    yield started
    for llumlet in started:
        llumlet.stop(remove=False)


def start(started: list[Llumlet], host: str, token: str = "") -> tuple[Llumlet, Engine]:
    engine = Engine()
    engine.add("r1", output=3)
    # beyond loopback without TLS or a token the llumlet now refuses to start (pilotfish/security.py):
    # these tests run its degraded mode, which PILOTFISH_INSECURE allows
    cfg = LlumletConfig(cms_url="redis://127.0.0.1:1/0", llumlet_host=host, llumlet_token=token, insecure=True)
    llumlet = Llumlet(cfg, "src", cms_pb2.InstanceMetadata(host="127.0.0.1"), writer=NullWriter(),  # type: ignore[arg-type]
                      abort_handler=engine.abort, migration_adapter=engine,
                      destination_check=any_destination)  # fmt: skip
    llumlet.start()
    started.append(llumlet)
    with llumlet.events() as s:
        s.added("r1", 10)
    return llumlet, engine


def stub_of(llumlet: Llumlet) -> tuple[grpc.Channel, llumlet_pb2_grpc.LlumletStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{llumlet.metadata.llumlet_port}")
    return channel, llumlet_pb2_grpc.LlumletStub(channel)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, llumlet_pb2.MigrateResponse | llumlet_pb2.AbortResponse | cms_pb2.InstanceStatus):
            list(result)  # a stream: its status comes with its end
    return info.value.code()


def migrate_in() -> llumlet_pb2.MigrateInRequest:
    return llumlet_pb2.MigrateInRequest(request_id="x", prompt_token_ids=[1, 2], max_tokens=4)


def test_beyond_loopback_without_a_token_refuses_the_calls_that_act_on_requests(llumlets) -> None:
    llumlet, engine = start(llumlets, "0.0.0.0")
    channel, stub = stub_of(llumlet)
    with channel:
        assert code_of(lambda: stub.Abort(llumlet_pb2.AbortRequest(request_ids=["r1"]), timeout=10)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        migrate = llumlet_pb2.MigrateRequest(
            request_ids=["r1"], destination_instance_id="dst", destination_llumlet_address="127.0.0.1:1"
        )
        assert code_of(lambda: stub.Migrate(migrate, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: stub.MigrateIn(migrate_in(), timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            stub.Abort(llumlet_pb2.AbortRequest(request_ids=["r1"]), timeout=10)
        assert "PILOTFISH_LLUMLET_TOKEN" in (info.value.details() or "")
        # the status is served, without the users' request ids
        status = stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=10)
        assert status.num_waiting == 1 and list(status.admitted_request_ids) == []
    # nothing else changed: no abort reached the engine, the request was not detached, none admitted
    assert engine.aborted == [] and "r1" in engine.requests and engine.admitted == {}
    assert llumlet.rpc_refused == {
        ("Abort", "no_token_beyond_loopback"): 2,
        ("Migrate", "no_token_beyond_loopback"): 1,
        ("MigrateIn", "no_token_beyond_loopback"): 1,
        ("GetStatus", "request_ids_withheld"): 1,
    }


def test_on_loopback_without_a_token_every_call_stays_open(llumlets) -> None:
    llumlet, engine = start(llumlets, "127.0.0.1")
    channel, stub = stub_of(llumlet)
    with channel:
        assert list(stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=10).admitted_request_ids) == ["r1"]
        assert list(stub.Abort(llumlet_pb2.AbortRequest(request_ids=["r1"]), timeout=10).aborted_request_ids) == ["r1"]
    assert engine.aborted == [["r1"]] and not llumlet.rpc_refused


@pytest.mark.parametrize("method", ["GetStatus", "Abort", "MigrateIn"])
def test_a_request_that_is_not_a_protobuf_is_invalid_argument_counted_and_changes_nothing(
    llumlets, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    llumlet, engine = start(llumlets, "127.0.0.1")
    channel, stub = stub_of(llumlet)
    with channel:
        garbage = getattr(channel, "unary_stream" if method == "MigrateIn" else "unary_unary")(
            f"/pilotfish.v1.Llumlet/{method}", request_serializer=lambda raw: raw)
        for _ in range(20):
            assert code_of(lambda: garbage(b"\xff\xff\xff\xff\x0f", timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=10).num_waiting == 1  # still served
    assert llumlet.rpc_refused == {(method, "malformed"): 20}
    assert engine.aborted == [] and "r1" in engine.requests
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # grpc's per-call traceback is gone


def test_a_token_is_required_for_every_call_wherever_it_listens(llumlets) -> None:
    llumlet, engine = start(llumlets, "0.0.0.0", token="s3cret")
    channel, stub = stub_of(llumlet)
    with channel:
        wrong = (("authorization", "Bearer nope"),)
        assert code_of(lambda: stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=10)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        abort = llumlet_pb2.AbortRequest(request_ids=["r1"])
        assert code_of(lambda: stub.Abort(abort, timeout=10, metadata=wrong)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: stub.MigrateIn(migrate_in(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert engine.aborted == [] and engine.admitted == {}
        # with it, the caller is known: the request ids are there
        status = stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=10, metadata=TOKEN)
        assert list(status.admitted_request_ids) == ["r1"]
        reply = stub.Abort(llumlet_pb2.AbortRequest(request_ids=["r1"]), timeout=10, metadata=TOKEN)
        assert list(reply.aborted_request_ids) == ["r1"]
    assert llumlet.rpc_refused == {
        ("GetStatus", "unauthenticated"): 1,
        ("Abort", "unauthenticated"): 1,
        ("MigrateIn", "unauthenticated"): 1,
    }


# ---- the CMS's verdict on a destination --------------------------------------------------------

NOW_S = 1_900_000_000.0
NOW_MS = int(NOW_S * 1000)


class FakeRedis:
    def __init__(self, values: dict[str, bytes], error: Exception | None = None) -> None:
        self.values = values
        self.error = error

    def mget(self, *names: str) -> list[bytes | None]:
        if self.error is not None:
            raise self.error
        return [self.values.get(n) for n in names]


def meta(model: str = "m", port: int = 7001, host: str = "10.0.0.2") -> bytes:
    return cms_pb2.InstanceMetadata(
        instance_id="dst", host=host, http_port=8000, llumlet_port=port, model=model
    ).SerializeToString()


def status(age_ms: int = 1000) -> bytes:
    return cms_pb2.InstanceStatus(instance_id="dst", update_id=1, timestamp_ms=NOW_MS - age_ms).SerializeToString()


def records(meta_raw: bytes | None = None, status_raw: bytes | None = None) -> dict[str, bytes]:
    out = {}
    if meta_raw is not None:
        out[keys.meta_key("c", "dst")] = meta_raw
    if status_raw is not None:
        out[keys.status_key("c", "dst")] = status_raw
    return out


def check(values: dict[str, bytes], error: Exception | None = None) -> d.CmsDestinations:
    return d.CmsDestinations(
        "redis://unused", "c", lambda: "m", max_age_ms=10_000, clock=lambda: NOW_S, client=FakeRedis(values, error)
    )


@pytest.mark.parametrize(
    ("values", "instance", "address", "code", "reason"),
    [
        (records(meta(), status()), "", "10.0.0.2:7001", grpc.StatusCode.INVALID_ARGUMENT, d.NO_ID),
        (records(meta(), status()), "a:b", "10.0.0.2:7001", grpc.StatusCode.INVALID_ARGUMENT, d.NO_ID),
        (records(), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED, d.UNREGISTERED),
        (records(b"\xff\xff", status()), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED, d.BAD_RECORD),
        (records(meta(model="other"), status()), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED,
         d.OTHER_MODEL),
        (records(meta(port=0), status()), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED, d.NO_PORT),
        (records(meta(), status()), "dst", "10.0.0.9:7001", grpc.StatusCode.PERMISSION_DENIED, d.OTHER_ADDRESS),
        (records(meta()), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED, d.NOT_LIVE),
        (records(meta(), status(age_ms=11_000)), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED, d.STALE),
        (records(meta(), status(age_ms=-3_600_000)), "dst", "10.0.0.2:7001", grpc.StatusCode.PERMISSION_DENIED,
         d.BAD_RECORD),
    ],
)  # fmt: skip
def test_a_destination_the_cms_does_not_vouch_for_is_refused(values, instance, address, code, reason) -> None:
    with pytest.raises(d.DestinationRefused) as info:
        check(values)(instance, address)
    assert (info.value.code, info.value.reason) == (code, reason)


class StallOnceRedis:
    """A loopback server speaking just enough RESP3: the first MGET it gets is never answered (a Redis that
    missed the read), every later one finds no records; anything else gets +OK."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.mgets = 0
        self.stalled: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while data := conn.recv(65536):
            buf += data
            while (command := _resp_command(buf)) is not None:
                name, buf = command
                if name == b"HELLO":  # redis-py speaks RESP3: a map with the protocol it got
                    conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                    continue
                if name != b"MGET":
                    conn.sendall(b"+OK\r\n")
                    continue
                self.mgets += 1
                if self.mgets == 1:
                    self.stalled.append(conn)  # held open, never answered
                    return
                conn.sendall(b"*2\r\n_\r\n_\r\n")  # two RESP3 nulls

    def close(self) -> None:
        self.listener.close()
        for conn in self.stalled:
            conn.close()


def _resp_command(buf: bytes) -> tuple[bytes, bytes] | None:
    """(the command's name, what follows it) of the first whole RESP array in `buf`, or None."""
    head, sep, rest = buf.partition(b"\r\n")
    if not sep:
        return None
    parts = []
    for _ in range(int(head[1:])):
        size, sep, rest = rest.partition(b"\r\n")
        if not sep or len(rest) < int(size[1:]) + 2:
            return None
        parts.append(rest[: int(size[1:])])
        rest = rest[int(size[1:]) + 2 :]
    return parts[0].upper(), rest


def test_a_cms_read_that_times_out_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One read Redis misses (2 s) does not refuse the Migrate as CMS_UNREACHABLE: the check reads again on
    a fresh connection and decides on what it finds (here: no records, so not registered)."""
    monkeypatch.setattr(d, "_SOCKET_TIMEOUT_S", 1.0)
    server = StallOnceRedis()
    try:
        check = d.CmsDestinations(f"redis://127.0.0.1:{server.port}", "c", lambda: "m", max_age_ms=10_000)
        with pytest.raises(d.DestinationRefused) as info:
            check("dst", "10.0.0.2:7001")
        assert info.value.reason == d.UNREGISTERED and server.mgets == 2
    finally:
        server.close()


def test_a_registered_live_destination_of_the_model_is_dialled_at_its_registered_address() -> None:
    values = records(meta(), status())
    assert check(values)("dst", "10.0.0.2:7001") == "10.0.0.2:7001"
    assert check(values)("dst", "") == "10.0.0.2:7001"  # no address named: the registered one
    v6 = records(meta(host="fd00::2"), status())
    assert check(v6)("dst", "[fd00::2]:7001") == "[fd00::2]:7001"


def test_an_unreadable_cms_sends_nothing() -> None:
    with pytest.raises(d.DestinationRefused) as info:
        check({}, redis.ConnectionError("gone"))("dst", "10.0.0.2:7001")
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAVAILABLE, d.CMS_UNREACHABLE)


def test_a_refused_destination_leaves_the_request_where_it_runs(llumlets) -> None:
    """Through the coordinator: the refusal answers the Migrate; nothing is detached; counted."""
    engine = Engine()
    engine.add("r1", output=3)
    cfg = LlumletConfig(cms_url="redis://127.0.0.1:1/0")
    llumlet = Llumlet(cfg, "src", cms_pb2.InstanceMetadata(host="127.0.0.1", model="m"), writer=NullWriter(),  # type: ignore[arg-type]
                      migration_adapter=engine, destination_check=check(records()))  # fmt: skip
    llumlet.start()
    llumlets.append(llumlet)
    channel, stub = stub_of(llumlet)
    with channel:
        request = llumlet_pb2.MigrateRequest(
            request_ids=["r1"], destination_instance_id="dst", destination_llumlet_address="10.0.0.2:7001"
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Migrate(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not a registered llumlet" in (info.value.details() or "")
    assert "r1" in engine.requests and engine.relayed == {} and engine.reattached == {}
    assert llumlet.migration is not None and llumlet.migration.refused == {d.UNREGISTERED: 1}
