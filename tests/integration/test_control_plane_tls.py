"""Every control-plane link, refused without credentials and served with them (pilotfish/security.py).

Real servers on loopback, certificates made in the test (`cryptography`): the scheduler's gRPC port
and Session socket driven by the gateway's real client (GrpcScheduler), a llumlet's gRPC server
driven by the rescheduler's real dispatcher (and the source llumlet's MigrateIn to the destination),
a real redis-server with requirepass and with TLS, and /metrics. Certificates rotated on disk are
served to the next connection without a restart. A listener beyond loopback without TLS or a token
refuses to start (the bind to 0.0.0.0 is on a free port; nothing is sent beyond loopback).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from pilotfish.cms import keys
from pilotfish.cms.reader import CmsReader
from pilotfish.cms.writer import CmsWriter
from pilotfish.config import ConfigError
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.routing import SCHEDULER, SchedulerUnavailable
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.procs import free_port, wait_until_async
from pilotfish.protos import cms_pb2, scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.rescheduler.dispatcher import MigrationDispatcher
from pilotfish.scheduler.rescheduler.telemetry import ReschedulerTelemetry
from pilotfish.scheduler.rescheduler.types import MigrationPair
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView
from pilotfish.security import Security
from pilotfish.services import RedisTls, redis_binary, start_redis
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet import Llumlet

pytest.importorskip("cryptography", reason="the test extra's cryptography package makes the certificates")

from pilotfish.security_testing import Pki, issue, make_ca, make_pki, serial_of_der
from tests.unit.test_migration_coordinator import FakeEngine, NullWriter, any_destination

pytestmark = pytest.mark.integration

INSTANCES = ["e0=127.0.0.1:8001", "127.0.0.1:8002"]
TIMEOUT = 30.0  # a loaded machine's bound; passing runs return as soon as the condition holds
TOKEN = "s3cret-token-for-the-test"


@dataclass(frozen=True)
class Creds:
    pki: Pki
    token_file: Path
    wrong_token_file: Path

    def server(self, **kw: Any) -> dict[str, Any]:
        """Config fields of a server with mutual TLS and the token."""
        return {"tls_cert_file": str(self.pki.cert), "tls_key_file": str(self.pki.key),
                "tls_ca_file": str(self.pki.ca), "auth_token_file": str(self.token_file), **kw}  # fmt: skip

    def client(self, *, cert: bool = True, token: bool = True, wrong_token: bool = False) -> Security:
        """A client's security: the CA, and as asked its certificate and the token."""
        pki = self.pki
        value = b"not-the-token" if wrong_token else TOKEN.encode() if token else b""
        if cert:
            return Security(cert=str(pki.client_cert), key=str(pki.client_key), ca=str(pki.ca), token=value)
        return Security(ca=str(pki.ca), token=value)


@pytest.fixture
def creds(tmp_path: Path) -> Creds:
    pki = make_pki(tmp_path / "pki")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    return Creds(pki, token_file, wrong)


def schedule_request(request_id: str) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=request_id, model="m", prompt_tokens=10)


def auth_refused(registry: Any, listener: str) -> float:
    labels = {"listener": listener, "reason": "unauthenticated"}
    return registry.get_sample_value("pilotfish_auth_refused_total", labels) or 0.0


@pytest.fixture
async def scheduler(creds: Creds) -> AsyncIterator[SchedulerServer]:
    config = SchedulerConfig(instances=INSTANCES, model=["m"], port=free_port(), session_port=free_port(),
                             metrics_port=free_port(), **creds.server())  # fmt: skip
    server = SchedulerServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=1)


def client_of(server: SchedulerServer, security: Security | None, *, socket: bool, session: bool = True,
              timeout: float = TIMEOUT) -> GrpcScheduler:  # fmt: skip
    session_address = f"127.0.0.1:{server.session_port}" if socket else ""
    return GrpcScheduler(f"127.0.0.1:{server.port}", timeout, 0.01, session=session,
                         session_address=session_address, security=security)  # fmt: skip


# ---- gateway -> scheduler: gRPC (Session stream and unary) and the Session socket ----------------


@pytest.mark.parametrize("transport", ["socket", "grpc_session", "grpc_unary"])
async def test_scheduler_serves_the_gateway_with_its_certificate_and_token(
    scheduler: SchedulerServer, creds: Creds, transport: str
) -> None:
    client = client_of(scheduler, creds.client(), socket=transport == "socket", session=transport != "grpc_unary")
    try:
        decision = await client.schedule(schedule_request("r1"))
        assert decision.source == SCHEDULER and decision.address in ("127.0.0.1:8001", "127.0.0.1:8002")
        client.report("r1", 5, True)
        client.release("r1", scheduler_pb2.RELEASE_REASON_FINISHED)
        await wait_until_async(lambda: scheduler.core.account_size == 0, TIMEOUT, "the release over TLS")
    finally:
        await client.close()
    if transport == "socket":
        assert scheduler._servicer.stats.session_closed["unauthenticated"] == 0


@pytest.mark.parametrize("transport", ["socket", "grpc_session", "grpc_unary"])
@pytest.mark.parametrize("missing", ["token", "wrong_token", "client_certificate", "tls"])
async def test_scheduler_refuses_a_gateway_without_credentials(
    scheduler: SchedulerServer, creds: Creds, transport: str, missing: str
) -> None:
    security = {
        "token": creds.client(token=False),
        "wrong_token": creds.client(wrong_token=True),
        "client_certificate": creds.client(cert=False),
        "tls": None,  # plaintext
    }[missing]
    refused_before = auth_refused(scheduler.core.registry, "scheduler_grpc")
    client = client_of(scheduler, security, socket=transport == "socket", session=transport != "grpc_unary",
                       timeout=5.0)  # fmt: skip
    try:
        with pytest.raises(SchedulerUnavailable):
            await client.schedule(schedule_request("x1"))
    finally:
        await client.close()
    assert scheduler.core.account_size == 0  # nothing reached the core
    if missing in ("token", "wrong_token"):  # the TLS handshake passed: the token check refused, counted
        if transport == "socket":
            closed = scheduler._servicer.stats.session_closed
            await wait_until_async(lambda: closed["unauthenticated"] == 1, TIMEOUT, "the socket's refusal")
            assert auth_refused(scheduler.core.registry, "scheduler_session") == 1
        else:
            assert auth_refused(scheduler.core.registry, "scheduler_grpc") == refused_before + 1


async def test_token_alone_on_loopback_plaintext(creds: Creds) -> None:
    config = SchedulerConfig(instances=INSTANCES, model=["m"], port=free_port(), session_port=free_port(),
                             auth_token_file=str(creds.token_file))  # fmt: skip
    server = SchedulerServer(config)
    await server.start()
    try:
        for socket in (True, False):
            good = client_of(server, Security(token=TOKEN.encode()), socket=socket)
            bad = client_of(server, Security(), socket=socket, timeout=5.0)
            try:
                assert (await good.schedule(schedule_request(f"ok-{socket}"))).source == SCHEDULER
                with pytest.raises(SchedulerUnavailable):
                    await bad.schedule(schedule_request(f"no-{socket}"))
            finally:
                await good.close()
                await bad.close()
        assert server.core.account_size == 2  # the two with the token, none without
    finally:
        await server.stop(grace=1)


# ---- metrics ----------------------------------------------------------------------------------------


def _get(url: str, context: ssl.SSLContext, token: str = "") -> int:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=TIMEOUT) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_metrics_need_the_token_over_tls(scheduler: SchedulerServer, creds: Creds) -> None:
    context = creds.client().client_ssl_context()
    assert context is not None
    url = f"https://127.0.0.1:{scheduler.metrics_port}/metrics"
    assert await asyncio.to_thread(_get, url, context) == 401
    assert await asyncio.to_thread(_get, url, context, "wrong") == 401
    assert await asyncio.to_thread(_get, url, context, TOKEN) == 200
    assert auth_refused(scheduler.core.registry, "metrics") == 2
    no_cert = creds.client(cert=False).client_ssl_context()
    assert no_cert is not None
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        await asyncio.to_thread(_get, url, no_cert, TOKEN)  # mutual TLS: no client certificate, no answer


# ---- certificate rotation -----------------------------------------------------------------------------


def presented_serial(port: int, context: ssl.SSLContext) -> int:
    import socket as socket_module

    with (
        socket_module.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return serial_of_der(der)


def replace_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def test_a_rotated_certificate_is_served_without_a_restart(tmp_path: Path, creds: Creds) -> None:
    """Server certificate files rewritten in place: the next handshake on the gRPC port, the Session
    socket and /metrics presents the new certificate, and the gateway's client is served with it."""
    dir = tmp_path / "rotating"
    dir.mkdir()
    ca_key, ca_cert, ca = make_ca(dir)
    cert, key = issue(ca_key, ca_cert, dir, "server")
    client_cert, client_key = issue(ca_key, ca_cert, dir, "gateway")
    config = SchedulerConfig(instances=INSTANCES, model=["m"], port=free_port(), session_port=free_port(),
                             metrics_port=free_port(), tls_cert_file=str(cert), tls_key_file=str(key),
                             tls_ca_file=str(ca))  # fmt: skip
    server = SchedulerServer(config)
    await server.start()
    gateway = Security(cert=str(client_cert), key=str(client_key), ca=str(ca))
    context = gateway.client_ssl_context()
    assert context is not None
    ports = (server.port, server.session_port, server.metrics_port)
    try:
        before = {await asyncio.to_thread(presented_serial, p, context) for p in ports}
        assert len(before) == 1
        new_cert, new_key = issue(ca_key, ca_cert, dir, "server-rotated")
        replace_atomically(key, new_key.read_bytes())
        replace_atomically(cert, new_cert.read_bytes())
        after = {await asyncio.to_thread(presented_serial, p, context) for p in ports}
        assert len(after) == 1 and after != before  # the same new certificate everywhere, no restart
        for socket in (True, False):
            client = client_of(server, gateway, socket=socket)
            try:
                assert (await client.schedule(schedule_request(f"rot-{socket}"))).source == SCHEDULER
            finally:
                await client.close()
    finally:
        await server.stop(grace=1)


# ---- scheduler/rescheduler -> llumlet gRPC, and llumlet -> llumlet ---------------------------------------


@pytest.fixture
def llumlets() -> Iterator[list[Llumlet]]:
    started: list[Llumlet] = []
    yield started
    for llumlet in reversed(started):
        llumlet.stop(remove=False)


def start_llumlet(started: list[Llumlet], instance_id: str, engine: FakeEngine, **kw: Any) -> Llumlet:
    cfg = LlumletConfig(cms_url="redis://127.0.0.1:1/0", **kw)
    llumlet = Llumlet(cfg, instance_id, cms_pb2.InstanceMetadata(host="127.0.0.1"), writer=NullWriter(),  # type: ignore[arg-type]
                      migration_adapter=engine, destination_check=any_destination)  # fmt: skip
    llumlet.start()
    started.append(llumlet)
    return llumlet


def view(instance_id: str, llumlet: Llumlet) -> InstanceView:
    v = InstanceView(Endpoint(instance_id, "127.0.0.1:8000", InferType.DECODE))
    v.llumlet_address = f"127.0.0.1:{llumlet.metadata.llumlet_port}"
    return v


async def test_rescheduler_migrates_through_llumlets_over_mutual_tls_with_the_token(
    creds: Creds, llumlets: list[Llumlet]
) -> None:
    from prometheus_client import CollectorRegistry

    src_engine, dst_engine = FakeEngine(), FakeEngine()
    src_engine.add("r1")
    src = start_llumlet(llumlets, "src", src_engine, **creds.server())
    dst = start_llumlet(llumlets, "dst", dst_engine, **creds.server())
    pair = MigrationPair(view("src", src), view("dst", dst), "decode_load", "NUM_REQ", "SR", 1.0)

    for security, reason in (
        (None, "unavailable"),  # plaintext to a TLS server
        (creds.client(cert=False), "unavailable"),  # no client certificate: the handshake fails
        (creds.client(token=False), "unauthenticated"),
        (creds.client(wrong_token=True), "unauthenticated"),
    ):
        dispatcher = MigrationDispatcher(ReschedulerTelemetry(CollectorRegistry()), timeout_s=10, security=security)
        try:
            (result,) = await dispatcher.dispatch([pair])
        finally:
            await dispatcher.close()
        assert (result.reason, result.migrated) == (reason, ()), security
    assert src.rpc_refused[("Migrate", "unauthenticated")] == 2
    assert "r1" in src_engine.requests and dst_engine.admitted == {}  # nothing moved

    dispatcher = MigrationDispatcher(ReschedulerTelemetry(CollectorRegistry()), timeout_s=10, security=creds.client())
    try:
        (result,) = await dispatcher.dispatch([pair])
    finally:
        await dispatcher.close()
    # the source's MigrateIn to the destination went over mutual TLS with the token too
    assert result.ok and result.migrated == ("r1",), result
    assert sorted(dst_engine.admitted) == ["r1"]
    dst_engine.relays["r1"]([], "length")
    await wait_until_async(lambda: src_engine.finished.get("r1") == "length", TIMEOUT, "the relayed finish")


def test_a_llumlet_with_tls_refuses_a_plaintext_destination_call(creds: Creds, llumlets: list[Llumlet]) -> None:
    """A source with TLS dials its destination with TLS: a plaintext llumlet never gets the token."""
    src_engine = FakeEngine()
    src_engine.add("r1")
    src = start_llumlet(llumlets, "src", src_engine, **creds.server())
    plain_engine = FakeEngine()
    plain = start_llumlet(llumlets, "plain", plain_engine)
    with grpc.secure_channel(f"127.0.0.1:{src.metadata.llumlet_port}", creds.client().channel_credentials()) as ch:
        from pilotfish.protos import llumlet_pb2, llumlet_pb2_grpc

        reply = llumlet_pb2_grpc.LlumletStub(ch).Migrate(
            llumlet_pb2.MigrateRequest(request_ids=["r1"], destination_instance_id="plain",
                                       destination_llumlet_address=f"127.0.0.1:{plain.metadata.llumlet_port}"),
            metadata=creds.client().metadata, timeout=TIMEOUT,
        )  # fmt: skip
    assert list(reply.failed_request_ids) == ["r1"] and plain_engine.admitted == {}
    assert "r1" in src_engine.requests  # reattached on the source


# ---- llumlet and scheduler -> Redis --------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.meta: dict[str, cms_pb2.InstanceMetadata] = {}
        self.update_ids: list[int] = []

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        self.meta[meta.instance_id] = meta
        return True

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        self.update_ids.append(status.update_id)
        return True

    def status_gone(self, instance_id: str) -> None: ...

    def remove(self, instance_id: str) -> bool:
        return self.meta.pop(instance_id, None) is not None

    def known(self) -> set[str]:
        return set(self.meta)


@pytest.fixture
def redis_server_binary() -> Path:
    try:
        return redis_binary()
    except Exception as exc:  # pragma: no cover - CI installs it
        if os.environ.get("CI"):
            raise
        pytest.skip(f"redis-server: {exc}")


async def read_back(url: str, options: dict[str, Any], writer: CmsWriter | None = None) -> Sink:
    """A CMS reader with `options` until it has the metadata written (or raises on timeout); with
    `writer`, then also a status written after that, which only its notice brings (no second poll)."""
    sink = Sink()
    reader = CmsReader(url, "t", sink, poll_interval=0.2 if writer is None else 3600.0, redis_options=options)
    task = asyncio.create_task(reader.run())
    try:
        await wait_until_async(lambda: "e1" in sink.meta, TIMEOUT, "the reader applying the metadata")
        if writer is not None:
            client = redis.Redis.from_url(url, **options)
            await wait_until_async(
                lambda: client.pubsub_numsub(keys.events_channel("t"))[0][1] == 1, TIMEOUT, "the subscription"
            )
            writer.write_status(cms_pb2.InstanceStatus(instance_id="e1", update_id=2, timestamp_ms=2))
            await wait_until_async(lambda: 2 in sink.update_ids, TIMEOUT, "a status through its notice")
            client.close()
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=5)
    return sink


def meta() -> cms_pb2.InstanceMetadata:
    return cms_pb2.InstanceMetadata(instance_id="e1", host="127.0.0.1", http_port=8000, model="m", update_id=1,
                                    timestamp_ms=1)  # fmt: skip


async def test_redis_with_a_password(redis_server_binary: Path, tmp_path: Path) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("pw-" + os.urandom(8).hex() + "\n")
    service = start_redis(tmp_path / "redis", password_file=password_file)
    try:
        assert password_file.read_text().strip() not in " ".join(service.child.argv)  # type: ignore[union-attr]
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            CmsWriter(service.url, "t", "e1", 5000).write_metadata(meta())
        cfg = LlumletConfig(cms_url=service.url, redis_password_file=str(password_file))
        security = Security.from_config(cfg)
        writer = CmsWriter(service.url, "t", "e1", 5000, redis_options=security.redis_options(service.url))
        writer.write_metadata(meta())
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e1", update_id=1, timestamp_ms=1))
        # the scheduler's reader, with the password from the same kind of file
        sink = await read_back(service.url, security.redis_options(service.url), writer)
        assert sink.meta["e1"].model == "m"
        # and without it, nothing: the reader counts Redis errors and applies nothing
        bare = Sink()
        reader = CmsReader(service.url, "t", bare, poll_interval=0.2)
        task = asyncio.create_task(reader.run())
        await wait_until_async(lambda: reader.num_redis_errors >= 2, TIMEOUT, "the reader's refused polls")
        task.cancel()
        await asyncio.wait([task], timeout=5)
        assert bare.meta == {}
        # discovery's Redis backend takes the same options
        from pilotfish.discovery.api import StoreUnavailable
        from pilotfish.discovery.urls import open_discovery

        async with open_discovery(service.url, redis_options=security.redis_options(service.url)) as found:
            assert await found.list_instances("pilotfish", "engine") == []
        async with open_discovery(service.url) as refused:
            with pytest.raises(StoreUnavailable):
                await refused.list_instances("pilotfish", "engine")
    finally:
        service.stop()


async def test_rediss_with_client_certificates(redis_server_binary: Path, tmp_path: Path, creds: Creds) -> None:
    pki = creds.pki
    service = start_redis(tmp_path / "redis-tls", tls=RedisTls(pki.cert, pki.key, pki.ca))
    try:
        assert service.url.startswith("rediss://")
        good = creds.client()
        writer = CmsWriter(service.url, "t", "e1", 5000, redis_options=good.redis_options(service.url))
        writer.write_metadata(meta())
        writer.write_status(cms_pb2.InstanceStatus(instance_id="e1", update_id=1, timestamp_ms=1))
        sink = await read_back(service.url, good.redis_options(service.url), writer)
        assert sink.meta["e1"].host == "127.0.0.1"
        no_cert = creds.client(cert=False)
        with pytest.raises(redis.ConnectionError):  # tls-auth-clients: no client certificate, no session
            CmsWriter(service.url, "t", "e2", 5000, redis_options=no_cert.redis_options(service.url)).write_metadata(
                meta()
            )
        plain = service.url.replace("rediss://", "redis://")
        with pytest.raises(redis.ConnectionError):
            CmsWriter(plain, "t", "e3", 5000).write_metadata(meta())
    finally:
        service.stop()


# ---- beyond loopback: refused without credentials, allowed with --insecure -----------------------------


async def test_scheduler_beyond_loopback_refuses_to_start_without_tls_or_a_token(
    creds: Creds, caplog: pytest.LogCaptureFixture
) -> None:
    config = SchedulerConfig(instances=INSTANCES, host="0.0.0.0", port=free_port())
    with pytest.raises(ConfigError) as info:
        SchedulerServer(config)
    message = str(info.value)
    assert "\n" not in message and "--host: 0.0.0.0" in message and "--auth-token-file" in message
    assert "--tls-cert-file" in message and "--insecure" in message

    for fields in ({"insecure": True}, {"auth_token_file": str(creds.token_file)},
                   {"tls_cert_file": str(creds.pki.cert), "tls_key_file": str(creds.pki.key)}):  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pilotfish.security"):
            server = SchedulerServer(SchedulerConfig(instances=INSTANCES, host="0.0.0.0", port=free_port(), **fields))
            await server.start()
            await server.stop(grace=0)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        if fields.get("insecure"):
            assert any("--insecure" in r.getMessage() for r in warned)
        elif "tls_cert_file" in fields:  # TLS without client certificates or a token: said so
            assert any("any peer" in r.getMessage() for r in warned)
        else:
            assert warned == []


async def test_ext_proc_and_llumlet_beyond_loopback_refuse_without_credentials(
    creds: Creds, llumlets: list[Llumlet]
) -> None:
    with pytest.raises(ConfigError, match=r"--host: 0\.0\.0\.0 is beyond loopback"):
        ExtProcServer(ExtProcConfig(host="0.0.0.0", port=free_port(), scheduler_address=""))
    allowed = ExtProcServer(ExtProcConfig(host="0.0.0.0", port=free_port(), scheduler_address="", insecure=True))
    await allowed.start()
    await allowed.stop(0)
    refusal = r"PILOTFISH_LLUMLET_HOST: 0\.0\.0\.0 is beyond loopback.*PILOTFISH_AUTH_TOKEN_FILE"
    with pytest.raises(ConfigError, match=refusal):
        start_llumlet(llumlets, "open", FakeEngine(), llumlet_host="0.0.0.0")
    with_token = start_llumlet(llumlets, "tok", FakeEngine(), llumlet_host="0.0.0.0",
                               auth_token_file=str(creds.token_file))  # fmt: skip
    assert with_token.metadata.llumlet_port > 0


def test_cli_refusal_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pilotfish", "scheduler", "--host", "0.0.0.0", "--port", str(free_port()),
         "--instances", "127.0.0.1:8001"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pilotfish scheduler: error: --host: 0.0.0.0 is beyond loopback")
