"""The servicer's message flow per request body mode, driven without gRPC or Envoy."""

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish.discovery.static import parse_instances
from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import CircuitBreaker, Router
from pilotfish.ext_proc.telemetry import ExtProcMetrics

ENGINE = "127.0.0.1:9001"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def servicer(max_body_bytes: int = 1 << 20) -> ExtProcServicer:
    router = Router(None, parse_instances([f"e0={ENGINE}"]), breaker=CircuitBreaker(3, 1.0))
    return ExtProcServicer(router, lambda text: [1] * len(text.split()), frozenset(), max_body_bytes, ExtProcMetrics())


def request_headers(
    path: str, *, full_duplex: bool, request_id: str = "rid-1", end: bool = False, method: str = "POST"
):
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
            base_pb2.HeaderValue(key="x-request-id", raw_value=request_id.encode()),
        ]
    )
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers, end_of_stream=end))
    if full_duplex:
        message.protocol_config.request_body_mode = FULL_DUPLEX
    return message


def body(data: bytes, end: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def run(messages: list[ep.ProcessingRequest], svc: ExtProcServicer | None = None) -> list[ep.ProcessingResponse]:
    svc = svc or servicer()

    async def feed():
        for m in messages:
            yield m

    async def collect():
        return [reply async for reply in svc.Process(feed(), None)]

    return asyncio.run(collect())


def set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


COMPLETION = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 4}).encode()


def test_buffered_routes_on_the_body_reply():
    replies = run([request_headers("/v1/completions", full_duplex=False), body(COMPLETION, end=True)])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    common = replies[1].request_body.response
    assert common.clear_route_cache
    headers = set_headers(common.header_mutation)
    assert headers["x-gateway-destination-endpoint"] == ENGINE
    # the gateway's own id, the client's kept only as a readable prefix
    assert headers["x-request-id"].startswith("rid-1.") and len(headers["x-request-id"]) > len("rid-1.")


def test_full_duplex_holds_the_headers_reply_until_the_body_is_complete():
    half = len(COMPLETION) // 2
    replies = run(
        [
            request_headers("/v1/completions", full_duplex=True),
            body(COMPLETION[:half], end=False),
            body(COMPLETION[half:], end=True),
        ]
    )
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    routed = replies[0].request_headers.response
    assert routed.clear_route_cache
    assert set_headers(routed.header_mutation)["x-gateway-destination-endpoint"] == ENGINE
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == COMPLETION and streamed.end_of_stream


def test_full_duplex_sends_the_rewritten_body_of_a_stream_that_did_not_ask_for_usage():
    stream = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    replies = run([request_headers("/v1/completions", full_duplex=True), body(stream, end=True)])
    sent = json.loads(replies[1].request_body.response.body_mutation.streamed_response.body)
    assert sent["stream_options"]["include_usage"] is True


def test_full_duplex_request_ending_in_trailers_is_routed_and_answered_in_order():
    replies = run(
        [
            request_headers("/v1/completions", full_duplex=True),
            body(COMPLETION, end=False),
            ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
        ]
    )
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "request_trailers"]
    assert not replies[1].request_body.response.body_mutation.streamed_response.end_of_stream


@pytest.mark.parametrize("full_duplex", [False, True])
def test_bad_bodies_get_an_immediate_answer_in_both_modes(full_duplex: bool):
    replies = run([request_headers("/v1/completions", full_duplex=full_duplex), body(b"{not json", end=True)])
    assert replies[-1].immediate_response.status.code == 400


def test_full_duplex_body_over_the_limit_is_refused_without_waiting_for_its_end():
    svc = servicer(max_body_bytes=1024)
    replies = run([request_headers("/v1/completions", full_duplex=True), body(b"x" * 2000, end=False)], svc)
    assert replies[-1].immediate_response.status.code == 413


def test_full_duplex_body_on_a_path_we_do_not_schedule_is_echoed_back():
    replies = run([request_headers("/v1/models", full_duplex=True), body(b"abc", end=True)])
    assert replies[0].request_headers.response.clear_route_cache
    assert replies[1].request_body.response.body_mutation.streamed_response.body == b"abc"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/%63ompletions",  # the engine decodes it to a routed path: it would pass unscheduled
        "/v1/chat%2Fcompletions",
        "/v1/completions/",
        "/v1/responses",  # generates too, through no scheduler and no flow control
        "/v1/embeddings",
        "/v1/load_lora_adapter",  # an engine's admin endpoint under /v1/
        "/other",
    ],
)
def test_a_path_neither_scheduled_nor_named_unscheduled_is_refused_and_reaches_no_engine(path: str) -> None:
    svc = servicer()
    replies = run([request_headers(path, full_duplex=False), body(COMPLETION, end=True)], svc)
    assert [r.WhichOneof("response") for r in replies] == ["immediate_response"]
    assert replies[0].immediate_response.status.code == 404
    assert svc._metrics.rejected.labels("404")._value.get() == 1


def test_the_unscheduled_paths_are_the_operators_choice() -> None:
    router = Router(None, parse_instances([f"e0={ENGINE}"]), breaker=CircuitBreaker(3, 1.0))
    svc = ExtProcServicer(router, lambda text: [1], frozenset(), 1 << 20, ExtProcMetrics(),
                          unscheduled_paths=["/v1/embeddings"])  # fmt: skip
    embeddings = run([request_headers("/v1/embeddings", full_duplex=False, end=True)], svc)
    models = run([request_headers("/v1/models", full_duplex=False, end=True, method="GET")], svc)
    assert set_headers(embeddings[0].request_headers.response.header_mutation)["x-gateway-destination-endpoint"] == (
        ENGINE)
    assert models[0].immediate_response.status.code == 404


@pytest.mark.parametrize(("method", "end", "status"), [("GET", False, 405), ("PUT", False, 405), ("POST", True, 400)])
def test_a_routed_path_the_engine_would_refuse_is_refused_before_it_is_scheduled(
    method: str, end: bool, status: int
) -> None:
    router = Router(None, parse_instances([f"e0={ENGINE}"]), breaker=CircuitBreaker(3, 1.0))
    picks = []
    router.pick_round_robin = lambda subset: picks.append(subset)  # type: ignore[method-assign]
    svc = ExtProcServicer(router, lambda text: [1], frozenset(), 1 << 20, ExtProcMetrics())
    messages = [request_headers("/v1/completions", full_duplex=False, end=end, method=method)]
    replies = run(messages if end else [*messages, body(COMPLETION, end=True)], svc)
    assert replies[0].immediate_response.status.code == status and len(replies) == 1
    assert picks == []


def response_headers_message(status: int = 200) -> ep.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=headers, end_of_stream=True))


def test_a_response_sent_round_robin_is_tagged_with_its_engine_and_route() -> None:
    models = request_headers("/v1/models", full_duplex=False, end=True, method="GET")
    replies = run([models, response_headers_message()])
    assert set_headers(replies[1].response_headers.response.header_mutation) == {
        "x-pilotfish-instance": "e0", "x-pilotfish-route": "fallback"}


def test_a_response_headers_reply_with_nothing_to_say_leaves_the_gateways_headers_alone() -> None:
    from pilotfish.ext_proc import messages

    reply = messages.response_headers_reply("", "", stream_body=False)
    assert not reply.response_headers.response.HasField("header_mutation")
