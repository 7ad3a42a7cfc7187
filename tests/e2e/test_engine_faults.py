"""Engine faults through the real stack (each simulated engine its own process, the scheduler,
the ext_proc, real Envoy): a killed engine is ejected after a bounded number of failures and
probed back in once it restarts; a request whose engine refuses the connection is retried on the
scheduler's next endpoint and succeeds; a stream cut after its first bytes is not retried.

Everything is counted, never timed: each wait is on a condition, and bounds are counts of
requests (at most the CONCURRENCY a client keeps in flight)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from pilotfish.procs import ChildGroup, wait_until
from pilotfish.prom_scrape import metric
from pilotfish.stack import Stack, StackSpec, start_stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=60)
CONCURRENCY = 8


def sched(stack: Stack, name: str, **labels: str) -> float:
    return metric(stack.scheduler_metrics_port, name, **labels)


def ejected(stack: Stack, instance: str) -> bool:
    return sched(stack, "pilotfish_scheduler_instance_ejected", engine=instance) == 1


def dispatched(stack: Stack, instance: str) -> float:
    return sched(stack, "pilotfish_scheduler_dispatch_total", engine=instance)


def engine_requests(stack: Stack, instance: str) -> float:
    """Requests the engine itself finished (vLLM's counter), whatever routed them there."""
    port = dict(stack.engines)[instance]
    return metric(port, "vllm:request_success_total")


def kill(stack: Stack, instance: str) -> None:
    os.kill(stack.children[f"engine {instance}"].pid, signal.SIGKILL)


def restart(stack: Stack, group: ChildGroup, instance: str) -> None:
    child = stack.children[f"engine {instance}"]
    child.proc.wait()
    stack.children[child.name] = new = group.respawn(child)
    new.wait_port(dict(stack.engines)[instance])


@dataclass
class Load:
    """CONCURRENCY clients, each sending one short stream after another until stopped."""

    stack: Stack
    ok: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    stop: bool = False

    async def client(self, session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while not self.stop:
            i += 1
            body = {"model": MODEL, "prompt": f"client {k} request {i} " * 3, "max_tokens": 4, "stream": True}
            try:
                async with session.post(f"{self.stack.base_url}/v1/completions", json=body) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        self.failed[f"{resp.status} {raw[:60]!r}"] += 1
                    elif not raw.rstrip().endswith(b"data: [DONE]"):
                        self.failed["stream cut"] += 1
                    else:
                        self.ok += 1
            except aiohttp.ClientError as exc:
                self.failed[type(exc).__name__] += 1

    @property
    def done(self) -> int:
        return self.ok + sum(self.failed.values())


@pytest.fixture
def faults(envoy_binary: Path) -> Iterator[tuple[Callable[..., Stack], ChildGroup]]:
    """`make_stack` with its ChildGroup, so a test can start a killed engine again in its place."""
    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-faults-") as tmp:

        def start(**fields: object) -> Stack:
            return start_stack(StackSpec(**fields), group, Path(tmp))  # type: ignore[arg-type]

        try:
            yield start, group
        finally:
            group.stop_all()


async def until(condition, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Wait on a condition read in a thread (a metric scrape), never on a sleep's length."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(condition):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_a_killed_engine_is_ejected_after_bounded_failures_and_probed_back_in(faults) -> None:
    make_stack, group = faults
    # A long passive ejection, so nothing but a probe lets the engine back during the test.
    stack: Stack = make_stack(
        engines=2, separate_engines=True, scheduler_metrics=True, ext_proc_metrics=True,
        scheduler_args=["--outlier-base-ejection-seconds", "600", "--outlier-max-ejection-seconds", "600",
                        "--health-probe-interval-seconds", "0.5"],
    )  # fmt: skip
    load = Load(stack)

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            clients = [asyncio.create_task(load.client(session, k)) for k in range(CONCURRENCY)]
            try:
                await until(lambda: dispatched(stack, "sim-1") >= 10 and dispatched(stack, "sim-0") >= 10, "warm-up")
                assert not load.failed, load.failed
                kill(stack, "sim-1")
                await until(lambda: ejected(stack, "sim-1"), "sim-1 ejected")
                at_ejection = await asyncio.to_thread(dispatched, stack, "sim-1")
                done_at_ejection = load.done
                await until(lambda: load.done >= done_at_ejection + 100, "100 more requests")
                # not one of those 100 went to the dead engine
                assert await asyncio.to_thread(dispatched, stack, "sim-1") == at_ejection
                failed_while_dead = sum(load.failed.values())
                # Back: the engine restarts on its port, a probe finds it, it serves again.
                await asyncio.to_thread(restart, stack, group, "sim-1")
                await until(lambda: not ejected(stack, "sim-1"), "sim-1 probed back in")
                served = await asyncio.to_thread(engine_requests, stack, "sim-1")
                await until(lambda: engine_requests(stack, "sim-1") >= served + 5, "sim-1 serving again")
            finally:
                load.stop = True
                await asyncio.gather(*clients)
        # Only streams in flight on sim-1 when it died may fail (they had their first bytes, so no
        # retry); every request that found it refusing connections was retried on sim-0.
        assert failed_while_dead <= CONCURRENCY, load.failed
        assert set(load.failed) <= {"stream cut", "ClientPayloadError"}, load.failed
        assert sum(load.failed.values()) == failed_while_dead, "no failure after the restart"

    asyncio.run(run())
    wait_until(lambda: sched(stack, "pilotfish_scheduler_inflight_requests") == 0, 30, "the account drains")


async def complete(session: aiohttp.ClientSession, stack: Stack, i: int) -> tuple[int, str, bytes]:
    body = {"model": MODEL, "prompt": f"retry {i} " * 3, "max_tokens": 4, "stream": True}
    async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
        return resp.status, resp.headers.get("x-pilotfish-instance", ""), await resp.read()


def test_a_request_whose_engine_refuses_the_connection_is_retried_on_the_next_endpoint(faults) -> None:
    """sim-0 is dead and nothing has told the scheduler (no probes): sequential requests go to it
    (an id tie picks sim-0), Envoy finds the connection refused and sends each to the scheduler's
    next endpoint, sim-1, where it succeeds; the served-elsewhere reports then eject sim-0."""
    make_stack, _ = faults
    stack: Stack = make_stack(
        engines=2, separate_engines=True, scheduler_metrics=True, ext_proc_metrics=True,
        scheduler_args=["--health-probes", "off", "--outlier-consecutive-failures", "3",
                        "--outlier-base-ejection-seconds", "600", "--outlier-max-ejection-seconds", "600"],
    )  # fmt: skip
    kill(stack, "sim-0")
    stack.children["engine sim-0"].proc.wait()
    retries = stack.envoy_stat("cluster.picked_pool.upstream_rq_retry")
    to_dead, served_by_1 = dispatched(stack, "sim-0"), engine_requests(stack, "sim-1")

    async def run() -> list[tuple[int, str, bytes]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return [await complete(session, stack, i) for i in range(8)]

    results = asyncio.run(run())
    for status, _, raw in results:
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), (status, raw[-200:])
    sent_to_dead = dispatched(stack, "sim-0") - to_dead
    assert sent_to_dead >= 3, "the scheduler did not pick the dead engine: nothing was retried"
    # every request the scheduler sent to the dead engine was retried once, and none other was
    assert stack.envoy_stat("cluster.picked_pool.upstream_rq_retry") - retries == sent_to_dead
    assert metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_served_elsewhere_total") == sent_to_dead
    wait_until(lambda: engine_requests(stack, "sim-1") - served_by_1 == len(results), 30, "sim-1 served all")
    assert ejected(stack, "sim-0"), "three served-elsewhere reports in a row eject the engine"
    assert sent_to_dead < len(results), "once ejected, sim-0 is not picked"
    wait_until(lambda: sched(stack, "pilotfish_scheduler_inflight_requests") == 0, 30, "the account drains")


def test_a_stream_cut_after_its_first_bytes_is_not_retried(faults) -> None:
    make_stack, _ = faults
    stack: Stack = make_stack(
        engines=2, separate_engines=True, scheduler_metrics=True, ext_proc_metrics=True,
        scheduler_args=["--health-probes", "off"],
    )  # fmt: skip
    attempts = stack.envoy_stat("cluster.picked_pool.upstream_rq_total")
    retries = stack.envoy_stat("cluster.picked_pool.upstream_rq_retry")
    served = {name: engine_requests(stack, name) for name, _ in stack.engines}

    async def run() -> tuple[str, bytes, str]:
        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 5000, "stream": True}
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(f"{stack.base_url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            instance = resp.headers["x-pilotfish-instance"]
            got = await resp.content.readuntil(b"\n\n")  # the first event: bytes reached the client
            assert got.startswith(b"data: ")
            kill(stack, instance)
            try:
                got += await resp.content.read()
                error = ""
            except aiohttp.ClientPayloadError as exc:
                error = type(exc).__name__
            return instance, got, error

    instance, got, error = asyncio.run(run())
    assert error or not got.rstrip().endswith(b"data: [DONE]"), "the stream should have been cut"
    assert b"data: [DONE]" not in got
    assert stack.envoy_stat("cluster.picked_pool.upstream_rq_total") - attempts == 1, "one attempt, no retry"
    assert stack.envoy_stat("cluster.picked_pool.upstream_rq_retry") == retries
    other = next(name for name, _ in stack.engines if name != instance)
    assert engine_requests(stack, other) == served[other], "nothing was sent to the other engine"
    wait_until(lambda: sched(stack, "pilotfish_scheduler_inflight_requests") == 0, 30, "released once")
