"""The ext_proc on its loop gRPC server, driven as Envoy drives it: nothing is left behind.

Each request's stream ends in one of the ways Envoy ends them (an answer the gateway gives itself,
a response streamed to its end, a client gone mid-stream); after all of them the process holds no
task, call or stream it did not hold before. A grpc.aio client plays Envoy's part.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.server import ExtProcServer
from pilotfish.grpc_loop import LoopGrpcServer
from pilotfish.procs import free_port, wait_until_async

Mode = processing_mode_pb2.ProcessingMode
TIMEOUT = 30.0
ROUNDS = 20


def request_headers(request_id: str) -> ep.ProcessingRequest:
    pairs = [(":path", "/v1/completions"), (":method", "POST"), ("x-request-id", request_id)]
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map))
    message.protocol_config.request_body_mode = Mode.BUFFERED
    message.protocol_config.response_body_mode = Mode.STREAMED
    return message


def request_body(model: str) -> ep.ProcessingRequest:
    data = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2, "stream": True}).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True))


def response_headers() -> ep.ProcessingRequest:
    pairs = [(":status", "200"), ("content-type", "text/event-stream")]
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map))


def response_body(data: bytes, end: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=end))


async def refused(stub: ep_grpc.ExternalProcessorStub, i: int) -> None:
    """An unknown model: the gateway answers 404 itself, then Envoy half-closes."""
    call = stub.Process()
    await call.write(request_headers(f"refused-{i}"))
    assert (await call.read()).HasField("request_headers")
    await call.write(request_body("not-served"))
    reply = await call.read()
    assert reply.immediate_response.status.code == 404
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def routed(stub: ep_grpc.ExternalProcessorStub, request_id: str) -> Any:
    """A stream routed by the gateway whose response headers came back: its body is next."""
    call = stub.Process()
    await call.write(request_headers(request_id))
    await call.read()
    await call.write(request_body("m"))
    assert (await call.read()).HasField("request_body")
    await call.write(response_headers())
    await call.read()
    return call


async def streamed(stub: ep_grpc.ExternalProcessorStub, i: int) -> None:
    """Routed, then a streamed response to its end."""
    call = await routed(stub, f"streamed-{i}")
    await call.write(response_body(b'data: {"choices":[{"text":"a"}]}\n\n', end=False))
    await call.read()
    await call.write(response_body(b"data: [DONE]\n\n", end=True))
    await call.read()
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def client_gone(stub: ep_grpc.ExternalProcessorStub, i: int) -> None:
    """Routed, then the client leaves mid-stream: Envoy cancels the ext_proc stream."""
    call = await routed(stub, f"gone-{i}")
    call.cancel()


async def test_no_task_call_or_stream_outlives_its_request() -> None:
    config = ExtProcConfig(port=free_port(), scheduler_address="", instances=["e0=127.0.0.1:9"], model=["m"])
    server = ExtProcServer(config)
    assert isinstance(server.server, LoopGrpcServer)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = ep_grpc.ExternalProcessorStub(channel)
        await asyncio.wait_for(refused(stub, -1), TIMEOUT)  # the first connection and its tasks, then the baseline
        baseline = len(asyncio.all_tasks())
        for i in range(ROUNDS):
            await asyncio.wait_for(asyncio.gather(refused(stub, i), streamed(stub, i), client_gone(stub, i)), TIMEOUT)
        loop_server = server.server

        def settled() -> bool:
            streams = sum(len(conn.streams) for conn in loop_server._connections)
            return not loop_server._calls and streams == 0 and len(asyncio.all_tasks()) <= baseline

        await wait_until_async(settled, TIMEOUT, "every call, stream and task of the finished requests gone")
        assert server.metrics.active_streams._value.get() == 0
        # Envoy's ways of ending streams are not refusals; a call to no method is, on /metrics
        registry = server.metrics.registry
        assert registry.get_sample_value("pilotfish_ext_proc_grpc_refused_total", {"reason": "unknown_method"}) is None
        unknown = channel.unary_unary("/envoy.service.ext_proc.v3.ExternalProcessor/Nothing")
        try:
            await asyncio.wait_for(unknown(b""), TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
        counted = registry.get_sample_value("pilotfish_ext_proc_grpc_refused_total", {"reason": "unknown_method"})
        assert counted == 1
    finally:
        await channel.close()
        await server.stop(0.5)
