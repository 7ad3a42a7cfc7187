"""Live migration between two simulated engines over HTTP, each with its real llumlet (gRPC) and a
real Redis CMS: the client's one SSE stream gets every token exactly once, in order, wherever it
was computed, and a destination that dies mid-way hands the request back to the source."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest

from pilotfish.protos import llumlet_pb2, llumlet_pb2_grpc
from pilotfish.services import RunningService
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import Fleet, SimEngine, serve_engines
from pilotfish.simulator.tokens import WORDS

pytestmark = pytest.mark.integration

MODEL = "pilotfish-sim"
TIMEOUT_S = 120.0


def engine_config(step_ms: float, max_num_seqs: int = 8) -> EngineConfig:
    return EngineConfig(step_ms=step_ms, prefill_ms_per_token=0, decode_ms_per_token=0, max_num_seqs=max_num_seqs,
                        max_model_len=4096, num_gpu_blocks=2048)  # fmt: skip


async def wait_for(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    """Poll a condition (never a sleep as the wait itself)."""
    async with asyncio.timeout(timeout):
        while not (value := condition()):
            await asyncio.sleep(0.005)
    return value


@dataclass
class Stream:
    """One client's streamed completion, as the client sees it."""

    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    done_markers: int = 0
    errors: list[Any] = field(default_factory=list)
    engine: str = ""

    def assert_complete(self, n: int) -> None:
        assert self.errors == []
        assert len(self.texts) == n, f"{len(self.texts)} tokens, expected {n}"
        # token i's text is WORDS[i % 30]: a lost, duplicated or reordered token breaks the sequence
        assert self.texts == [WORDS[i % len(WORDS)] for i in range(n)]
        assert self.finish_reasons == ["length"] and self.done_markers == 1


async def stream_completion(session: aiohttp.ClientSession, url: str, request_id: str, max_tokens: int,
                            stream: Stream) -> None:  # fmt: skip
    body = {"model": MODEL, "prompt": "tell me a long story " * 8, "max_tokens": max_tokens, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as resp:
        assert resp.status == 200
        stream.engine = resp.headers.get("x-pilotfish-engine", "")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                stream.done_markers += 1
                continue
            event = json.loads(data)
            if "choices" not in event:
                stream.errors.append(event)
                continue
            choice = event["choices"][0]
            if choice["text"]:
                stream.texts.append(choice["text"])
            if choice.get("finish_reason"):
                stream.finish_reasons.append(choice["finish_reason"])


def llumlet_address(engine: SimEngine) -> str:
    return f"{engine.address.host}:{engine.llumlet.metadata.llumlet_port}"


async def migrate(source: SimEngine, destination: SimEngine, **fields: Any) -> llumlet_pb2.MigrateResponse:
    request = llumlet_pb2.MigrateRequest(
        source_instance_id=source.address.engine_id,
        destination_instance_id=destination.address.engine_id,
        destination_llumlet_address=llumlet_address(destination),
        reason="test",
        **fields,
    )

    def call() -> llumlet_pb2.MigrateResponse:
        with grpc.insecure_channel(llumlet_address(source)) as channel:
            return llumlet_pb2_grpc.LlumletStub(channel).Migrate(request, timeout=TIMEOUT_S)

    return await asyncio.to_thread(call)  # the gRPC call blocks; the engines share this loop


def internal_id(engine: SimEngine, request_id: str) -> str:
    return next((rid for rid in engine.core.requests if rid.startswith(f"{request_id}#")), "")  # type: ignore[attr-defined]


async def generation_tokens(session: aiohttp.ClientSession, engine: SimEngine) -> float:
    async with session.get(f"{engine.address.url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")


def idle(engine: SimEngine) -> bool:
    coordinator = engine.llumlet.migration
    status = engine.llumlet.status_now()
    return (
        not engine.core.has_unfinished_requests()
        and coordinator.in_flight() == (0, 0)
        and (status.num_running, status.num_waiting, status.num_migrating_out, status.num_migrating_in) == (0, 0, 0, 0)
    )


async def with_fleet(redis: RunningService, configs: list[EngineConfig],
                     body: Callable[[Fleet, aiohttp.ClientSession], Awaitable[None]]) -> None:  # fmt: skip
    serve = ServeConfig(engines=2, base_port=0, cms_url=redis.url, cms_cluster="migration")
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with serve_engines(serve, configs) as fleet, aiohttp.ClientSession(timeout=timeout) as session:
        await body(fleet, session)


@pytest.mark.parametrize("method", [llumlet_pb2.MIGRATION_METHOD_RECOMPUTE, llumlet_pb2.MIGRATION_METHOD_KV_TRANSFER])
async def test_running_request_moves_and_its_stream_never_breaks(redis_service: RunningService, method: int) -> None:
    n = 200

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        a, b = fleet.engines
        stream = Stream()
        client = asyncio.create_task(stream_completion(session, a.address.url, "run-1", n, stream))
        await wait_for(lambda: len(stream.texts) >= 10, "the first tokens from A")
        rid = internal_id(a, "run-1")
        reply = await migrate(a, b, request_ids=[rid], method=method)
        assert (list(reply.migrated_request_ids), list(reply.failed_request_ids)) == ([rid], []), reply.error
        await asyncio.wait_for(client, TIMEOUT_S)
        stream.assert_complete(n)
        assert stream.engine == "sim-0"  # one HTTP response, from A, start to end
        on_a, on_b = await generation_tokens(session, a), await generation_tokens(session, b)
        assert on_b > 0 and on_a >= 10 and on_a + on_b == n  # B computed the rest, nothing twice
        await wait_for(lambda: idle(a) and idle(b), "both engines idle")
        assert a.llumlet.migration.num_migrated_out == 1 and b.llumlet.migration.num_migrated_in == 1

    await with_fleet(redis_service, [engine_config(5), engine_config(5)], body)


async def test_waiting_request_moves_by_select_rule(redis_service: RunningService) -> None:
    long_n, short_n = 150, 40

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        a, b = fleet.engines
        first, second = Stream(), Stream()
        clients = [asyncio.create_task(stream_completion(session, a.address.url, "busy-1", long_n, first))]
        await wait_for(lambda: len(first.texts) >= 3, "the first request running on A")
        clients.append(asyncio.create_task(stream_completion(session, a.address.url, "wait-1", short_n, second)))
        await wait_for(lambda: any(r.request_id.startswith("wait-1#") for r in a.core.waiting), "a waiting request")
        rid = internal_id(a, "wait-1")
        # first come waiting, one request: the queued one, not the running one
        reply = await migrate(a, b, select_rule=llumlet_pb2.SELECT_RULE_NUM_REQ,
                              select_order=llumlet_pb2.SELECT_ORDER_FCW, select_value=1)  # fmt: skip
        assert list(reply.migrated_request_ids) == [rid], reply.error
        await asyncio.wait_for(asyncio.gather(*clients), TIMEOUT_S)
        first.assert_complete(long_n)
        second.assert_complete(short_n)
        # A computed only the first request; every token of the second came from B
        assert await generation_tokens(session, a) == long_n
        assert await generation_tokens(session, b) == short_n
        await wait_for(lambda: idle(a) and idle(b), "both engines idle")

    await with_fleet(redis_service, [engine_config(5, max_num_seqs=1), engine_config(5)], body)


async def test_destination_dying_mid_migration_hands_the_request_back(redis_service: RunningService) -> None:
    n = 200

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        a, b = fleet.engines
        stream = Stream()
        client = asyncio.create_task(stream_completion(session, a.address.url, "die-1", n, stream))
        await wait_for(lambda: len(stream.texts) >= 10, "the first tokens from A")
        rid = internal_id(a, "die-1")
        reply = await migrate(a, b, request_ids=[rid])
        assert list(reply.migrated_request_ids) == [rid], reply.error
        relayed_from = len(stream.texts)
        await wait_for(lambda: b.core.requests and len(stream.texts) >= relayed_from + 3, "tokens relayed from B")
        await asyncio.to_thread(b.llumlet.stop)  # B's llumlet goes away while it computes the request
        await asyncio.wait_for(client, TIMEOUT_S)
        stream.assert_complete(n)
        assert a.llumlet.migration.num_reattached == 1
        await wait_for(lambda: not b.core.has_unfinished_requests(), "B dropping its copy")
        on_a, on_b = await generation_tokens(session, a), await generation_tokens(session, b)
        # B's tokens that reached the client were not recomputed on A; B may have made a few more that
        # never left it (dropped with the request), so A + B is at least n
        assert on_b >= 3 and on_a + on_b >= n and on_a < n
        await wait_for(lambda: idle(a), "A idle")

    # B is slower, so it is still computing the request when its llumlet stops
    await with_fleet(redis_service, [engine_config(5), engine_config(40)], body)


async def test_request_no_engine_can_continue_ends_with_an_error_event(redis_service: RunningService) -> None:
    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        a, _ = fleet.engines
        stream = Stream()
        client = asyncio.create_task(stream_completion(session, a.address.url, "fail-1", 200, stream))
        await wait_for(lambda: len(stream.texts) >= 5, "the first tokens from A")
        adapter = a.llumlet.migration.adapter
        rid = internal_id(a, "fail-1")
        moving = await asyncio.to_thread(adapter.detach, rid)  # as the coordinator does, from its thread
        assert moving is not None and not a.core.has_unfinished_requests()
        await asyncio.to_thread(adapter.fail, rid, "no engine can continue this request")
        await asyncio.wait_for(client, TIMEOUT_S)
        assert [e["message"] for e in stream.errors] == ["no engine can continue this request"]
        assert stream.done_markers == 1 and stream.finish_reasons == []
        assert stream.texts == [WORDS[i % len(WORDS)] for i in range(len(moving.output_token_ids))]

    await with_fleet(redis_service, [engine_config(5), engine_config(5)], body)


async def test_llumlet_abort_ends_the_clients_stream(redis_service: RunningService) -> None:
    """An Abort from the llumlet (not the client) frees the request and ends its stream with
    finish_reason "abort" and one [DONE], as vLLM ends an aborted request's stream."""
    n = 400

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        a, _ = fleet.engines
        stream = Stream()
        client = asyncio.create_task(stream_completion(session, a.address.url, "abort-1", n, stream))
        await wait_for(lambda: len(stream.texts) >= 5, "the first tokens from A")
        rid = internal_id(a, "abort-1")

        def call() -> llumlet_pb2.AbortResponse:
            with grpc.insecure_channel(llumlet_address(a)) as channel:
                return llumlet_pb2_grpc.LlumletStub(channel).Abort(
                    llumlet_pb2.AbortRequest(request_ids=[rid, "unknown"]), timeout=TIMEOUT_S
                )

        reply = await asyncio.to_thread(call)
        assert list(reply.aborted_request_ids) == [rid]
        await asyncio.wait_for(client, TIMEOUT_S)
        assert stream.finish_reasons == ["abort"] and stream.done_markers == 1 and stream.errors == []
        assert 5 <= len(stream.texts) < n
        assert stream.texts == [WORDS[i % len(WORDS)] for i in range(len(stream.texts))]
        await wait_for(lambda: idle(a), "A idle, the request's blocks freed")

    await with_fleet(redis_service, [engine_config(5), engine_config(5)], body)
