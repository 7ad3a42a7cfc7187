"""The endpoint-picker protocol, point by point, through real Envoy configured as each gateway that
hosts an InferencePool picker configures it, and as Pilotfish's own sidecar in every body mode.

Profiles: the sidecar with BUFFERED, STREAMED and FULL_DUPLEX_STREAMED bodies both ways; Istio
(full duplex both ways, override_host on envoy.lb metadata, FailOpen); Envoy AI Gateway (full
duplex both ways, ORIGINAL_DST on the header, metadata dropped, FailClose). Each test runs on each
profile's own stack of two simulated engines, the scheduler, the ext_proc and Envoy.

A canary HTTP server listens on loopback the whole time: no request of any test, whatever its
headers, path, method or body, may ever reach it, nor Envoy's admin.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pilotfish.procs import ChildGroup, free_port, wait_until
from pilotfish.prom_scrape import metric
from pilotfish.stack import Stack, StackSpec, start_stack

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT = aiohttp.ClientTimeout(total=60)
EXT_PROC_RESETS = "cluster.pilotfish_ext_proc.upstream_rq_tx_reset"  # streams Envoy reset on the ext_proc
EXT_PROC_ENDED = "cluster.pilotfish_ext_proc.upstream_rq_completed"  # streams that ended, either way
PROFILES = {
    "sidecar-buffered": {"request_body_mode": "BUFFERED", "response_body_mode": "BUFFERED"},
    "sidecar-streamed": {"request_body_mode": "STREAMED", "response_body_mode": "STREAMED"},
    "sidecar-full-duplex": {"request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED"},
    "istio": {"gateway": "istio", "failure_mode_allow": True},
    "ai-gateway": {"gateway": "ai-gateway", "failure_mode_allow": False},
}
PROFILE_OF: dict[int, str] = {}  # each gateway stack's profile name


class Canary:
    """A loopback server that must never be reached through Envoy; counts every hit."""

    def __init__(self) -> None:
        self.hits = 0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text="canary reached")

    def start(self) -> None:
        import threading

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)

        async def serve() -> None:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(30)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    server = Canary()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=list(PROFILES))
def gw(request: pytest.FixtureRequest, envoy_binary: Path, canary: Canary) -> Iterator[Stack]:
    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-conformance-") as tmp:
        try:
            spec = StackSpec(engines=2, model=MODEL, scheduler_metrics=True, ext_proc_metrics=True,
                             **PROFILES[request.param])  # type: ignore[arg-type]  # fmt: skip
            stack = start_stack(spec, group, Path(tmp))
            PROFILE_OF[id(stack)] = request.param
            yield stack
        finally:
            group.stop_all()
    assert canary.hits == 0, f"{request.param}: a request reached the canary"


def releases(stack: Stack, reason: str | None = None) -> float:
    labels = {"reason": reason} if reason else {}
    return metric(stack.ext_proc_metrics_port, "pilotfish_ext_proc_releases_total", **labels)


def inflight(stack: Stack) -> float:
    return metric(stack.scheduler_metrics_port, "pilotfish_scheduler_inflight_requests")


def hostile_headers(canary: Canary, stack: Stack) -> dict[str, str]:
    """Every header a client could use to choose an upstream, each naming the canary or Envoy's admin."""
    target = f"127.0.0.1:{canary.port}"
    return {
        "x-gateway-destination-endpoint": target,
        "x-gateway-destination-endpoint-subset": target,
        "x-gateway-destination-endpoint-served": target,
        "x-pilotfish-instance": target,
        "x-prefiller-host-port": f"127.0.0.1:{stack.admin_port}",
        "x-request-id": "same-id-for-all",
        "host": target,
    }


async def send(session: aiohttp.ClientSession, stack: Stack, body: dict | bytes, **kw: object) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
    async with session.post(f"{stack.base_url}/v1/completions", data=data, headers=headers, **kw) as resp:
        return resp.status, await resp.read()


def completion(i: int, stream: bool, max_tokens: int = 6) -> dict:
    return {"model": MODEL, "prompt": f"conformance {i} " * 4, "max_tokens": max_tokens, "stream": stream}


# -- 1. routing: every body mode, counted and released once ------------------------------------------


def test_streams_and_whole_responses_arrive_whole_and_release_once_as_finished(gw: Stack, canary: Canary) -> None:
    before, finished = releases(gw), releases(gw, "finished")
    resets, ended = gw.envoy_stat(EXT_PROC_RESETS), gw.envoy_stat(EXT_PROC_ENDED)
    early = metric(gw.ext_proc_metrics_port, "pilotfish_ext_proc_first_token_ends_total")

    async def run() -> list[tuple[int, bytes, bool]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

            async def one(i: int) -> tuple[int, bytes, bool]:
                stream = i % 2 == 0
                status, raw = await send(session, gw, completion(i, stream), headers=hostile_headers(canary, gw))
                return status, raw, stream

            return list(await asyncio.gather(*(one(i) for i in range(12))))

    for status, raw, stream in asyncio.run(run()):
        assert status == 200, raw[:300]
        if stream:
            payloads = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            assert payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1
            texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-1] if json.loads(p).get("choices")]
            assert len(texts) == 6
            assert all("usage" not in json.loads(p) or json.loads(p)["usage"] is None for p in payloads[:-1])
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 6
    wait_until(lambda: releases(gw) - before == 12, 60, "one Release per request")
    assert releases(gw, "finished") - finished == 12  # a whole 200 is finished, not a client abort
    wait_until(lambda: inflight(gw) == 0, 30, "scheduler account draining to zero")
    # every ext_proc stream closed gracefully, on each gateway's bootstrap as on the sidecar's (a reset would
    # leave grpc.aio's op array of the cut read behind), except those the picker stopped reading at their
    # first token (lite behind the sidecar, not in full duplex), which Envoy resets after their OK
    wait_until(lambda: gw.envoy_stat(EXT_PROC_ENDED) - ended >= 12, 30, "every ext_proc stream ended")
    early = metric(gw.ext_proc_metrics_port, "pilotfish_ext_proc_first_token_ends_total") - early
    reads_to_first_token = gw.response_bodies == "first-token" and "full-duplex" not in PROFILE_OF[id(gw)]
    assert early == (6 if reads_to_first_token else 0)
    assert gw.envoy_stat(EXT_PROC_RESETS) - resets == early


# -- 2. identity: a client's id cannot merge or erase load ------------------------------------------


def test_concurrent_requests_with_one_client_id_are_counted_apart(gw: Stack, canary: Canary) -> None:
    async def run() -> list[float]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            seen: list[float] = []
            opened = [
                await session.post(
                    f"{gw.base_url}/v1/completions",
                    json=completion(i, True, max_tokens=4000),
                    headers=hostile_headers(canary, gw),
                )
                for i in range(4)
            ]
            for resp in opened:  # every stream is running: its first event has come
                assert resp.status == 200
                await resp.content.readline()
            await asyncio.to_thread(wait_until, lambda: inflight(gw) == 4, 30, "four requests in flight")
            seen.append(inflight(gw))
            for resp in opened:
                resp.close()  # each client goes away: each request is released on its own
            return seen

    assert asyncio.run(run()) == [4]
    wait_until(lambda: inflight(gw) == 0, 30, "scheduler account draining to zero")


# -- 3. hostile input: a clean 4xx, and the gateway stays up -----------------------------------------


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "pilotfish-sim", "prompt": "x", "max_tokens": 4294967296}', 400),
        (b'{"model": "pilotfish-sim", "prompt": "x", "max_tokens": 18446744073709551616}', 400),
        (b'{"model": "pilotfish-sim", "prompt": "x", "n": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400),
        (b"\xff\xfe not utf-8", 400),
        (b'{"model": "unknown-model", "prompt": "x"}', 404),
    ],
    ids=["max_tokens_2^32", "max_tokens_2^64", "nested_3000", "not_utf8", "unknown_model"],
)
def test_hostile_bodies_get_a_clean_refusal_and_nothing_else_moves(
    gw: Stack, canary: Canary, body: bytes, status: int
) -> None:
    async def run() -> tuple[int, bytes, int]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            got, raw = await send(session, gw, body, headers=hostile_headers(canary, gw))
            after, _ = await send(session, gw, completion(0, False))
            return got, raw, after

    got, raw, after = asyncio.run(run())
    assert got == status and json.loads(raw)["code"] == status
    assert after == 200
    assert gw.children["ext_proc"].exited() is None


# -- 4. nothing behind Envoy but the engines' API ----------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/config_dump", "/quitquitquit", "/stats", "/ready", "/v1/models", "/health"])
def test_no_path_method_or_header_reaches_the_canary_or_envoys_admin(
    gw: Stack, canary: Canary, method: str, path: str
) -> None:
    async def run() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            headers = hostile_headers(canary, gw) | {"x-gateway-destination-endpoint": f"127.0.0.1:{gw.admin_port}"}
            async with session.request(method, gw.base_url + path, headers=headers) as resp:
                return resp.status, await resp.read()

    status, raw = asyncio.run(run())
    assert b"canary reached" not in raw and b"envoy" not in raw.lower()[:2000]
    assert status in (200, 404, 405) or status >= 500
    assert canary.hits == 0
    assert gw.children["envoy"].exited() is None, "POST /quitquitquit through the listener stopped Envoy"


@pytest.mark.parametrize(
    "path",
    ["/v1/%63ompletions", "/v1/chat%2Fcompletions", "/v1/completions/", "/v1/responses", "/v1/load_lora_adapter"],
)
def test_no_other_engine_endpoint_or_spelling_of_a_routed_one_passes_unscheduled(gw: Stack, path: str) -> None:
    """An engine serves more than the two scheduled paths, and decodes a percent-encoded one: each of these
    would generate (or change the engine) past the scheduler and flow control. The gateway refuses them."""
    import yarl

    async def run() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            url = yarl.URL(gw.base_url + path, encoded=True)  # sent as written, not re-quoted
            body = {**completion(0, False), "input": "x", "lora_name": "x", "lora_path": "/tmp"}
            async with session.post(url, json=body) as resp:
                return resp.status, await resp.read()

    before = metric(gw.scheduler_metrics_port, "pilotfish_scheduler_dispatch_total")
    status, raw = asyncio.run(run())
    assert status == 404 and b"no such path" in raw, raw[:300]
    assert metric(gw.scheduler_metrics_port, "pilotfish_scheduler_dispatch_total") == before


# -- 5. the picker down: fail open to the pool only, or fail closed ----------------------------------


def test_with_the_ext_proc_killed_requests_reach_only_the_pool_or_fail(gw: Stack, canary: Canary, request) -> None:
    # last in the module: it kills this profile's ext_proc for good
    os.kill(gw.children["ext_proc"].pid, signal.SIGKILL)
    wait_until(lambda: gw.children["ext_proc"].exited() is not None, 30, "the ext_proc gone")

    async def run() -> list[tuple[int, bytes]]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            out = []
            for i in range(6):
                out.append(await send(session, gw, completion(i, i % 2 == 0), headers=hostile_headers(canary, gw)))
                async with session.get(f"{gw.base_url}/config_dump", headers=hostile_headers(canary, gw)) as resp:
                    out.append((resp.status, await resp.read()))
            return out

    results = asyncio.run(run())
    assert canary.hits == 0
    assert all(b"canary reached" not in raw and b"configs" not in raw for _, raw in results)
    profile = PROFILES[request.node.callspec.params["gw"]]
    fails_open = profile.get("failure_mode_allow", True)  # the sidecar's is on
    full_duplex = "gateway" in profile or profile["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    completions = [status for status, _ in results[::2]]
    if fails_open and not full_duplex:  # the default pool serves
        assert all(status == 200 for status in completions), completions
    elif fails_open:
        # Envoy 1.40 turns fail-open off once full-duplex body bytes were queued for the ext_proc:
        # a request with a body gets 500, never another upstream
        assert all(status == 200 or status >= 500 for status in completions), completions
    else:
        assert all(status >= 500 for status in completions), completions
