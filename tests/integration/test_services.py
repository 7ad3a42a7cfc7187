"""The real servers from pilotfish.services answer, run side by side, and stop without leftovers."""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pilotfish import services
from pilotfish.procs import StartError, free_port, port_answers
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

RunEnvoy = Callable[..., RunningService]


def _direct_response_bootstrap(listen_port: int, body: str) -> str:
    """One listener that answers every request with `body`; start_envoy adds the admin listener."""
    return f"""
static_resources:
  listeners:
  - name: direct
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: direct
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                direct_response: {{status: 200, body: {{inline_string: "{body}"}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_stopped(service: RunningService) -> None:
    """stop() leaves neither the process nor a listener behind (local processes only)."""
    if service.child is None:
        service.stop()
        return
    pid = service.child.pid
    service.stop()
    assert _pid_gone(pid), f"{service.name} PID {pid} still exists after stop()"
    assert not port_answers(service.port), f"{service.name} port {service.port} still answers"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def test_redis_set_get_then_stop(redis_service: RunningService) -> None:
    client = aioredis.from_url(redis_service.url)
    try:
        assert await client.set("pilotfish:test", "value")
        assert await client.get("pilotfish:test") == b"value"
    finally:
        await client.aclose()
    _assert_stopped(redis_service)  # the fixture's teardown stops it again: stop() is idempotent


def test_etcd_put_range_then_stop(etcd_service: RunningService) -> None:
    put = {"key": _b64("pilotfish/test"), "value": _b64("value")}
    status, _ = services.http_call(f"{etcd_service.url}/v3/kv/put", json.dumps(put).encode(), timeout=10)
    assert status == 200
    status, body = services.http_call(
        f"{etcd_service.url}/v3/kv/range", json.dumps({"key": put["key"]}).encode(), timeout=10
    )
    assert status == 200
    kvs = json.loads(body)["kvs"]
    assert [base64.b64decode(kv["value"]) for kv in kvs] == [b"value"]
    _assert_stopped(etcd_service)


def test_envoy_answers_through_its_listener(run_envoy: RunEnvoy) -> None:
    listen = free_port()
    envoy = run_envoy(_direct_response_bootstrap(listen, "hello"))
    assert services.envoy_is_live(envoy.url)
    assert services.http_call(f"http://127.0.0.1:{listen}/anything", timeout=10) == (200, b"hello")
    _assert_stopped(envoy)


def test_two_envoys_run_at_once(run_envoy: RunEnvoy) -> None:
    ports = [free_port(), free_port()]
    envoys = [run_envoy(_direct_response_bootstrap(p, f"envoy-{i}")) for i, p in enumerate(ports)]
    for i, (envoy, port) in enumerate(zip(envoys, ports, strict=True)):
        assert envoy.child is not None and envoy.child.exited() is None
        assert services.http_call(f"http://127.0.0.1:{port}/", timeout=10) == (200, f"envoy-{i}".encode())


def test_envoy_with_a_broken_bootstrap_reports_its_error(envoy_binary: Path, tmp_path: Path) -> None:
    bad = "static_resources: {listeners: [{name: no-address}]}"
    with pytest.raises(StartError, match="address is necessary"):
        services.start_envoy(bad, tmp_path)


def test_redis_that_cannot_bind_reports_its_log(redis_binary: Path, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(StartError, match=r"exited with code \d+ — last output: .*"):
            services.start_redis(tmp_path, port=taken)


def test_missing_binary_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(services.MissingBinary, match="apt-get install no-such-pkg"):
        services._find_binary("pilotfish-no-such-binary", "PILOTFISH_NO_SUCH_BINARY", "apt-get install no-such-pkg")
