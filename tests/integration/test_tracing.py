"""One request's trace: the client's traceparent continued by the ext_proc, the scheduler and the engine.

All three run in this process on real sockets (the scheduler's gRPC server and Session stream, a
simulated engine over HTTP), with an in-memory exporter: the ext_proc span is a child of the client's
span, the scheduler's a child of the ext_proc's (carried in ScheduleRequest.traceparent), and the
engine's a child of the ext_proc's (carried by the traceparent the routing reply sets upstream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish import tracing
from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import CircuitBreaker, Router
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.procs import free_port
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import serve_engines

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pilotfish[tracing])")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
FAST = EngineConfig(step_ms=0.5, prefill_ms_per_token=0, decode_ms_per_token=0, max_model_len=100_000)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure_tracing(service="pilotfish-test", exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, str]]:
    async with serve_engines(ServeConfig(engines=1, base_port=0, default_output_tokens=3), FAST) as fleet:
        address = fleet.engines[0].address
        yield address.engine_id, f"{address.host}:{address.port}"


def headers_message(traceparent: str) -> ep.ProcessingRequest:
    pairs = [(":path", "/v1/completions"), (":method", "POST"), ("x-request-id", "traced-1"),
             ("traceparent", traceparent), ("tracestate", "vendor=1")]  # fmt: skip
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers))
    message.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    return message


async def test_one_trace_across_ext_proc_scheduler_and_engine(
    exporter: InMemorySpanExporter, engine: tuple[str, str]
) -> None:
    engine_id, engine_address = engine
    server = SchedulerServer(SchedulerConfig(port=free_port(), instances=[f"{engine_id}={engine_address}"]))
    await server.start()
    client = GrpcScheduler(f"127.0.0.1:{server.port}", 5.0, 0.01)
    try:
        router = Router(client, [], breaker=CircuitBreaker(3, 1.0))
        svc = ExtProcServicer(router, lambda text: [1] * len(text.split()), frozenset(), 1 << 20, ExtProcMetrics())
        body = json.dumps({"model": "pilotfish-sim", "prompt": "hello there", "max_tokens": 3}).encode()

        answered = asyncio.Event()

        async def feed() -> AsyncIterator[ep.ProcessingRequest]:
            yield headers_message(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
            yield ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            # Envoy keeps the stream open until the response; a stream that ended while the request was
            # being scheduled would be a client that left (the gateway cancels its Schedule)
            await answered.wait()

        replies = []
        async for reply in svc.Process(feed(), None):
            replies.append(reply)
            if reply.HasField("request_body"):
                answered.set()
                break
        upstream = {
            o.header.key: o.header.raw_value.decode()
            for r in replies
            for o in r.request_body.response.header_mutation.set_headers
        }
        assert upstream["x-gateway-destination-endpoint"] == engine_address
        assert upstream["tracestate"] == "vendor=1"
        # what Envoy would send the engine: the routing headers on the client's request
        async with aiohttp.ClientSession() as http, http.post(
            f"http://{engine_address}/v1/completions",
            data=body,
            headers={"content-type": "application/json", "x-request-id": "traced-1",
                     "traceparent": upstream["traceparent"]},
        ) as reply:
            assert reply.status == 200
            await reply.read()
    finally:
        await client.close()
        await server.stop(grace=0)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    gateway = spans["pilotfish.ext_proc.schedule"]
    scheduler = spans["pilotfish.scheduler.schedule"]
    generate = spans["pilotfish.engine.generate"]
    assert {f"{s.context.trace_id:032x}" for s in (gateway, scheduler, generate)} == {CLIENT_TRACE}
    assert gateway.parent is not None and f"{gateway.parent.span_id:016x}" == CLIENT_SPAN
    assert scheduler.parent is not None and scheduler.parent.span_id == gateway.context.span_id
    assert generate.parent is not None and generate.parent.span_id == gateway.context.span_id
    assert upstream["traceparent"] == f"00-{CLIENT_TRACE}-{gateway.context.span_id:016x}-01"
    # the decision, as attributes of both sides' spans
    assert scheduler.attributes["pilotfish.engine"] == engine_id
    assert scheduler.attributes["pilotfish.engine.address"] == engine_address
    assert str(scheduler.attributes["pilotfish.request_id"]).startswith("traced-1.")  # the gateway's own id
    assert gateway.attributes["pilotfish.engine"] == engine_id
    assert gateway.attributes["pilotfish.route"] == "scheduler"
    assert generate.attributes["pilotfish.engine"] == engine_id


async def test_a_request_without_traceparent_starts_a_trace_and_untraced_processes_add_nothing(
    exporter: InMemorySpanExporter,
) -> None:
    from pilotfish.ext_proc import tracing as gateway_tracing
    from pilotfish.protos import scheduler_pb2

    trace = gateway_tracing.incoming({})
    assert trace is not None
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="m")
    with gateway_tracing.schedule_span(trace, request) as span:
        assert span is not None
    assert request.traceparent == trace.outgoing and request.traceparent.startswith("00-")
    assert exporter.get_finished_spans()[0].parent is None
    tracing.shutdown_tracing()
    assert gateway_tracing.incoming({"traceparent": request.traceparent}) is None  # off: no Trace, no span
    untraced = scheduler_pb2.ScheduleRequest(request_id="r", model="m")
    with gateway_tracing.schedule_span(None, untraced) as span:
        assert span is None
    assert untraced.traceparent == ""
    assert tracing.parent_context("not-a-traceparent") is None


def test_no_endpoint_no_tracing() -> None:
    assert not tracing.configure_tracing("")
    assert not tracing.enabled() and tracing.tracer("x") is None
