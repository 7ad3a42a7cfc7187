"""`pilotfish sidecar` as a real process over simulated engines, registering to real Redis / etcd.

It registers every healthy data-parallel rank, removes the ranks of an engine that stops
answering, expires everything once it is killed (SIGKILL: no goodbye), and withdraws everything
at once when stopped (SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pilotfish.discovery import open_discovery
from pilotfish.discovery.testing import Watcher, wait_for
from pilotfish.procs import Child, free_port, port_is_free
from pilotfish.services import RunningService

pytestmark = pytest.mark.integration

NS, COMP = "test", "engine"
TTL = 2.0


def consecutive_free_ports(n: int) -> int:
    for _ in range(100):
        first = free_port()
        if first + n <= 65535 and all(port_is_free(first + i) for i in range(n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


class Procs:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.children: list[Child] = []

    def start(self, name: str, *args: str) -> Child:
        child = Child(name, [sys.executable, "-m", "pilotfish", *args], log_path=self.tmp_path / f"{name}.log")
        self.children.append(child)
        return child

    def engines(self, name: str, first_port: int, n: int) -> Child:
        ports = ",".join(str(first_port + i) for i in range(n))
        child = self.start(name, "sim", "serve", "--ports", ports, "--engine-id-prefix", name)
        for i in range(n):
            child.wait_port(first_port + i, timeout=60)
        return child

    def sidecar(self, url: str, engines: str, *extra: str) -> Child:
        return self.start(
            "sidecar", "--log-level", "DEBUG", "sidecar",
            "--discovery", url, "--discovery-namespace", NS, "--discovery-component", COMP,
            "--discovery-ttl-seconds", str(TTL), "--check-interval-seconds", "0.2",
            "--health-timeout-seconds", "1", "--failure-threshold", "2",
            "--engines", engines, "--metadata", '{"model": "pilotfish-sim"}', *extra,
        )  # fmt: skip


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    for child in reversed(p.children):
        child.stop()


def store_url(kind: str, service: RunningService) -> str:
    return service.url if kind == "redis" else "etcd://" + service.url.removeprefix("http://")


@pytest.mark.parametrize("kind", ["redis", "etcd"])
async def test_sidecar_registers_healthy_removes_unhealthy_and_expires_when_killed(
    kind: str, request: pytest.FixtureRequest, procs: Procs
) -> None:
    url = store_url(kind, request.getfixturevalue(f"{kind}_service"))
    pa, pb = consecutive_free_ports(2), consecutive_free_ports(2)
    procs.engines("a", pa, 2)
    engines_b = procs.engines("b", pb, 2)
    discoveries = [open_discovery(url, ttl=TTL, interval=0.2) for _ in range(2)]
    discovery = discoveries[0]
    watchers = [Watcher(d, NS, COMP) for d in discoveries]
    sidecar = procs.sidecar(url, f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}", "--data-parallel-size", "2")
    try:
        want = {"a-dp0", "a-dp1", "b-dp0", "b-dp1"}
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == want and sidecar.exited() is None, f"all ranks registered ({kind})")
        b1 = watchers[0].instances["b-dp1"]
        assert (b1.host, b1.port) == ("127.0.0.1", pb + 1)
        meta = await b1.metadata()
        assert meta["data_parallel_rank"] == 1 and meta["model"] == "pilotfish-sim"

        engines_b.stop()  # engine b dies: its ranks fail their health checks
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == {"a-dp0", "a-dp1"}, "the dead engine's ranks removed")

        os.kill(sidecar.pid, signal.SIGKILL)  # no withdrawal: only the TTL removes them
        for w in watchers:
            await wait_for(lambda w=w: w.ids() == set(), "a killed sidecar's instances expire", timeout=TTL * 15)
        assert await discovery.list_instances(NS, COMP) == []
    finally:
        for w in watchers:
            await w.close()
        for d in discoveries:
            await d.close()


async def test_a_stopped_sidecar_withdraws_its_instances(redis_service: RunningService, procs: Procs) -> None:
    port = free_port()
    procs.engines("e", port, 1)
    discovery = open_discovery(redis_service.url, ttl=60, interval=0.2)  # a TTL far beyond the test
    watcher = Watcher(discovery, NS, COMP)
    sidecar = procs.sidecar(redis_service.url, f"127.0.0.1:{port}", "--discovery-ttl-seconds", "60")
    try:
        await wait_for(lambda: watcher.ids() == {f"127.0.0.1:{port}"}, "engine registered")
        sidecar.stop()  # SIGTERM
        assert sidecar.proc.returncode == 0, sidecar._log_tail()
        await wait_for(lambda: watcher.ids() == set(), "withdrawn at once, long before the 60 s TTL", timeout=20)
    finally:
        await watcher.close()
        await discovery.close()
