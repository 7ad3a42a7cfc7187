"""Envoy -> ext_proc over TLS and with the token: the sidecar render_sidecar writes, real traffic.

Real Envoy (the rendered sidecar), the real ext_proc and scheduler (in this process), one engine (a
few lines of aiohttp answering the OpenAI API), certificates made in the test (`cryptography`).
Each case starts the ext_proc as the security settings say (the token; TLS as the Kubernetes picker
runs it, without client certificates; mutual TLS; both) and sends a request through a sidecar
rendered with the matching credentials: the ext_proc routes it (its route header says `scheduler`)
and refuses nothing. Through a sidecar rendered without them, Envoy's ext_proc calls are refused
and the sidecar fails open to its default pool: the response carries no route header from the
ext_proc, and a token refusal is counted in the ext_proc's pilotfish_auth_refused_total. With
response bodies skipped, the release reaches the scheduler through Envoy's gRPC access log, which
carries the token too. The envoy binary validates every rendered bootstrap first.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pilotfish.envoy_bootstrap import render_sidecar
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.messages import ROUTE_SOURCE_HEADER
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.procs import free_port, wait_until_async
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.services import RunningService, http_call, start_envoy

pytest.importorskip("cryptography", reason="the test extra's cryptography package makes the certificates")

from pilotfish.security_testing import Pki, make_pki

pytestmark = pytest.mark.integration

MODEL = "m"
TOKEN = "sidecar-token-for-the-test"
TIMEOUT = 30.0
CASES = {
    # ext_proc (and scheduler) settings -> what the sidecar needs to get through
    "token": {"token": True},
    "tls": {"tls": True, "client_auth": False},  # the picker behind a gateway: no client certificate
    "mutual-tls": {"tls": True, "client_auth": True},
    "mutual-tls-and-token": {"tls": True, "client_auth": True, "token": True},
}


@dataclass(frozen=True)
class Creds:
    pki: Pki
    token_file: Path


@pytest.fixture
def creds(tmp_path: Path) -> Creds:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return Creds(make_pki(tmp_path / "pki"), token_file)


def security_fields(creds: Creds, case: dict[str, bool]) -> dict[str, Any]:
    """The ext_proc's (and its scheduler's) security settings for a case."""
    fields: dict[str, Any] = {}
    if case.get("token"):
        fields["auth_token_file"] = str(creds.token_file)
    if case.get("tls"):
        fields.update(tls_cert_file=str(creds.pki.cert), tls_key_file=str(creds.pki.key), tls_ca_file=str(creds.pki.ca))
    return fields


def sidecar_credentials(creds: Creds, case: dict[str, bool]) -> dict[str, Any]:
    """render_sidecar's arguments that get through to an ext_proc set up as `case`."""
    kwargs: dict[str, Any] = {}
    if case.get("token"):
        kwargs["ext_proc_auth_token_file"] = creds.token_file
    if case.get("tls"):
        kwargs["ext_proc_tls_ca_file"] = creds.pki.ca
        if case.get("client_auth"):
            kwargs.update(ext_proc_tls_cert_file=creds.pki.client_cert, ext_proc_tls_key_file=creds.pki.client_key)
    return kwargs


async def _completion(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({
        "id": "cmpl-1", "object": "text_completion", "model": body.get("model", MODEL),
        "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    })  # fmt: skip


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """One engine answering /v1/completions and /health on loopback; its host:port."""
    app = web.Application()
    app.router.add_post("/v1/completions", _completion)
    app.router.add_get("/health", _health)  # the scheduler's health probes
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass
class Stack:
    scheduler: SchedulerServer
    ext_proc: ExtProcServer

    def refused(self) -> float:
        labels = {"listener": "ext_proc_grpc", "reason": "unauthenticated"}
        return self.ext_proc.metrics.registry.get_sample_value("pilotfish_auth_refused_total", labels) or 0.0


async def start_stack(
    engine: str, security: dict[str, Any], *, client_auth: bool = True, response_bodies: str = "count"
) -> Stack:
    """The scheduler and the ext_proc on loopback, both with `security` (the ext_proc dials its
    scheduler with the same settings, as in the Kubernetes manifests); `client_auth`: False, the
    ext_proc's listener asks for no client certificate (--tls-no-client-auth)."""
    scheduler = SchedulerServer(SchedulerConfig(instances=[engine], model=[MODEL], port=free_port(), **security))
    await scheduler.start()
    ext_proc = ExtProcServer(
        ExtProcConfig(port=free_port(), metrics_port=free_port(), instances=[engine], model=[MODEL],
                      scheduler_address=f"127.0.0.1:{scheduler.port}", response_bodies=response_bodies,
                      tls_no_client_auth=not client_auth, **security)
    )  # fmt: skip
    await ext_proc.start()
    return Stack(scheduler, ext_proc)


async def stop_stack(stack: Stack) -> None:
    await stack.ext_proc.stop(0)
    await stack.scheduler.stop(grace=0)


def validate(envoy_binary: Path, bootstrap: str, path: Path) -> None:
    path.write_text(bootstrap)
    path.chmod(0o600)
    proc = subprocess.run(
        [str(envoy_binary), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def sidecar(
    envoy_binary: Path, work: Path, engine: str, ext_proc_port: int, *, response_body_mode: str = "STREAMED", **kw: Any
) -> tuple[RunningService, int]:
    host, _, port = engine.rpartition(":")
    listen = free_port()
    bootstrap = render_sidecar(listen_port=listen, admin_port=0, ext_proc_ports=[ext_proc_port],
                               default_endpoints=[(host, int(port))], response_body_mode=response_body_mode,
                               **kw)  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    validate(envoy_binary, bootstrap, work / "validate.yaml")
    return start_envoy(bootstrap, work), listen


async def complete(listen: int) -> tuple[int, str]:
    """One completion through the sidecar: (status, the ext_proc's route header or '')."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
        session.post(
            f"http://127.0.0.1:{listen}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1}
        ) as response,
    ):
        await response.read()
        return response.status, response.headers.get(ROUTE_SOURCE_HEADER, "")


def envoy_stat(envoy: RunningService, name: str) -> int:
    status, body = http_call(f"{envoy.url}/stats?filter=^{name}$")
    assert status == 200
    values = [int(line.split(":")[1]) for line in body.decode().splitlines() if line.startswith(f"{name}:")]
    return values[0] if values else 0


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_sidecar_reaches_a_secured_ext_proc_only_with_its_credentials(
    envoy_binary: Path, tmp_path: Path, creds: Creds, engine: str, case: str
) -> None:
    settings = CASES[case]
    stack = await start_stack(engine, security_fields(creds, settings), client_auth=settings.get("client_auth", True))
    try:
        envoy, listen = sidecar(envoy_binary, tmp_path / "with", engine, stack.ext_proc.port,
                                **sidecar_credentials(creds, settings))  # fmt: skip
        try:
            for _ in range(3):
                assert await complete(listen) == (200, "scheduler")
            assert stack.refused() == 0
            if settings.get("tls"):  # Envoy's ext_proc connection is TLS
                assert envoy_stat(envoy, "cluster.pilotfish_ext_proc.ssl.handshake") >= 1
        finally:
            envoy.stop()

        envoy, listen = sidecar(envoy_binary, tmp_path / "without", engine, stack.ext_proc.port)
        try:
            # refused: failure_mode_allow sends the request to the default pool, without the ext_proc
            assert await complete(listen) == (200, "")
            if settings.get("token") and not settings.get("tls"):
                await wait_until_async(lambda: stack.refused() >= 1, TIMEOUT, "the refusal counted")
        finally:
            envoy.stop()
        if settings.get("tls"):
            # TLS with only some of the credentials: no client certificate, or no token
            partial = {"ext_proc_tls_ca_file": creds.pki.ca}
            envoy, listen = sidecar(envoy_binary, tmp_path / "partial", engine, stack.ext_proc.port, **partial)
            try:
                expected = "" if settings["client_auth"] or settings.get("token") else "scheduler"
                assert await complete(listen) == (200, expected)
            finally:
                envoy.stop()
    finally:
        await stop_stack(stack)


async def test_the_access_log_carries_the_token_too(
    envoy_binary: Path, tmp_path: Path, creds: Creds, engine: str
) -> None:
    """Response bodies skipped: each request is released from Envoy's gRPC access log, a second
    gRPC service on the ext_proc cluster, which must send the token as the ext_proc filter does."""
    security = security_fields(creds, {"token": True})
    stack = await start_stack(engine, security, response_bodies="skip")  # the sidecar's NONE mode
    try:
        envoy, listen = sidecar(envoy_binary, tmp_path / "skip", engine, stack.ext_proc.port,
                                response_body_mode="NONE", ext_proc_auth_token_file=creds.token_file)  # fmt: skip
        try:
            for _ in range(3):
                assert await complete(listen) == (200, "scheduler")
            # released from the access log: the scheduler's account of the requests drains
            await wait_until_async(lambda: stack.scheduler.core.account_size == 0, TIMEOUT, "releases from the log")
            assert stack.refused() == 0, "the access log's stream was refused"
        finally:
            envoy.stop()
    finally:
        await stop_stack(stack)


def test_without_credentials_the_bootstrap_is_the_template_unchanged(creds: Creds) -> None:
    """`pilotfish up` and the stacks on loopback render exactly what they did."""
    kwargs: dict[str, Any] = {"listen_port": 18080, "admin_port": 19901, "ext_proc_ports": [50061],
                              "default_endpoints": [("127.0.0.1", 8001)]}  # fmt: skip
    plain = render_sidecar(**kwargs)
    assert "transport_socket" not in plain and "initial_metadata" not in plain
    secured = render_sidecar(**kwargs, ext_proc_tls_ca_file=creds.pki.ca, ext_proc_auth_token_file=creds.token_file)
    assert "transport_socket" in secured and f"Bearer {TOKEN}" in secured
    with pytest.raises(ValueError, match="ext_proc_tls_ca_file"):
        render_sidecar(**kwargs, ext_proc_tls_cert_file=creds.pki.client_cert, ext_proc_tls_key_file=creds.pki.key)
