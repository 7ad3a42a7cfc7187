"""The llumlet-Migrate attack, replayed against a real redis-server: a Migrate that names a fake
llumlet is refused before anything is detached or sent; the CMS's real destination still works.

Real llumlets (their gRPC servers, their CMS writers into Redis, their coordinators) over fake
engines; the fake llumlet is a real gRPC server that records every call it gets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from tests.unit.test_migration_coordinator import FakeEngine, ScriptedNeighbour, serve_neighbour

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def accept_everything(request: llumlet_pb2.MigrateInRequest, context: grpc.ServicerContext) -> Iterator[Any]:
    yield llumlet_pb2.MigrateInChunk(accepted=True)
    yield llumlet_pb2.MigrateInChunk(token_ids=[666], finish_reason="stop")


class Recorder(ScriptedNeighbour):
    """The fake llumlet: accepts whatever comes and remembers who sent what, token included."""

    def __init__(self) -> None:
        super().__init__(accept_everything)
        self.metadata: list[tuple[Any, ...]] = []

    def MigrateIn(self, request: llumlet_pb2.MigrateInRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        self.metadata.append(tuple(context.invocation_metadata()))
        return super().MigrateIn(request, context)


@pytest.fixture
def started() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Llumlet):
            thing.stop()
        else:
            thing.stop(None)


def llumlet(url: str, started: list[Any], instance: str, engine: FakeEngine, model: str = "m") -> Llumlet:
    cfg = LlumletConfig(cms_url=url, cluster="t", llumlet_token=TOKEN, ttl_ms=5000, refresh_ms=500)
    meta = cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=8000, model=model)
    out = Llumlet(cfg, instance, meta, migration_adapter=engine)
    out.start()
    started.append(out)
    return out


def address(of: Llumlet) -> str:
    return f"127.0.0.1:{of.metadata.llumlet_port}"


def migrate(source: Llumlet, **fields: Any) -> llumlet_pb2.MigrateResponse:
    with grpc.insecure_channel(address(source)) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        return stub.Migrate(llumlet_pb2.MigrateRequest(source_instance_id="src", **fields), timeout=30, metadata=AUTH)


def refused(source: Llumlet, **fields: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        migrate(source, **fields)
    return info.value


def register(url: str, instance: str, host_port: str, model: str = "m", age_ms: int = 0) -> None:
    """Forge a CMS registration the way a llumlet writes one (what an attacker with CMS write access
    could do; docs/cms-trust.md's ACLs are what stop that)."""
    host, _, port = host_port.rpartition(":")
    writer = CmsWriter(url, "t", instance, ttl_ms=60_000)
    writer.write_metadata(
        cms_pb2.InstanceMetadata(instance_id=instance, host=host, http_port=8000, llumlet_port=int(port), model=model)
    )
    stamp = time.time_ns() // 1_000_000 - age_ms
    writer.write_status(cms_pb2.InstanceStatus(instance_id=instance, update_id=1, timestamp_ms=stamp))
    writer.close()


def test_migrate_to_a_fake_llumlet_is_refused_and_nothing_reaches_it(redis_service, started) -> None:
    url = redis_service.url
    src_engine, dst_engine = FakeEngine(), FakeEngine()
    src_engine.add("r1", output=130)
    src_engine.add("r2", output=130)
    src = llumlet(url, started, "src", src_engine)
    dst = llumlet(url, started, "dst", dst_engine)
    fake = Recorder()
    fake_address = serve_neighbour(started, fake)

    # (1) the attack as demonstrated: an unregistered destination
    error = refused(
        src, request_ids=["r1", "r2"], destination_instance_id="evil", destination_llumlet_address=fake_address
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "not a registered llumlet" in error.details()
    # (2) a real destination's id with the fake's address
    error = refused(src, request_ids=["r1"], destination_instance_id="dst", destination_llumlet_address=fake_address)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "registered at" in error.details()
    # (3) no destination id at all
    error = refused(src, request_ids=["r1"], destination_llumlet_address=fake_address)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    # (4) registered at the fake's address, but for another model / with a status long gone stale / no status
    register(url, "other-model", fake_address, model="x")
    register(url, "stale", fake_address, age_ms=60_000)
    host, _, port = fake_address.rpartition(":")
    meta_only = CmsWriter(url, "t", "meta-only", ttl_ms=60_000)
    meta_only.write_metadata(cms_pb2.InstanceMetadata(instance_id="meta-only", host=host, http_port=8000,
                                                      llumlet_port=int(port), model="m"))  # fmt: skip
    meta_only.close()
    for instance, said in (("other-model", "serves model 'x'"), ("stale", "old"), ("meta-only", "not live")):
        error = refused(
            src, request_ids=["r1"], destination_instance_id=instance, destination_llumlet_address=fake_address
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and said in error.details(), (instance, error)

    # nothing reached the fake llumlet (no call, so neither the tokens nor the cluster's token), and
    # the users' requests never left their engine
    assert fake.calls == [] and fake.metadata == []
    assert sorted(src_engine.requests) == ["r1", "r2"] and src_engine.relayed == {} and src_engine.reattached == {}
    assert src.migration is not None
    assert src.migration.refused == {
        "unregistered": 1, "address_mismatch": 1, "no_destination_id": 1, "other_model": 1, "stale": 1, "not_live": 1,
    }  # fmt: skip

    # the CMS's real destination: migrates as before, the token going only there
    reply = migrate(src, request_ids=["r1"], destination_instance_id="dst", destination_llumlet_address=address(dst))
    assert list(reply.migrated_request_ids) == ["r1"], reply.error
    assert "r1" in dst_engine.admitted and fake.calls == []
