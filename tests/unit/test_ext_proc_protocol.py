"""The servicer against hostile input and the endpoint-picker protocol, driven without gRPC or Envoy:
every body mode both ways, the gateway's own request ids, release reasons, the subset hint,
scheduler refusals, a served endpoint that moves the load, prefill/decode pairs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from pilotfish.discovery.static import parse_instances
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import SCHEDULER, CircuitBreaker, Decision, Router
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.protos import scheduler_pb2
from tests.unit.test_ext_proc_processor import run as run_messages
from tests.unit.test_ext_proc_processor import set_headers

Mode = processing_mode_pb2.ProcessingMode
E0, E1, E2 = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"
COMPLETION = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 4}).encode()
STREAMING = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
UPSTREAM_ERROR = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
SSE = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]


@dataclass
class FakeBackend:
    """The scheduler as the router sees it: records what it is told; `refuse` makes Schedule fail."""

    refuse: RequestError | None = None
    crash: bool = False
    decode_address: str = ""
    scheduled: list[scheduler_pb2.ScheduleRequest] = field(default_factory=list)
    reports: list[tuple[str, int, str]] = field(default_factory=list)
    releases: list[tuple[str, int]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)  # each release's answer tokens

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        if self.crash:
            raise ZeroDivisionError("a bug")
        if self.refuse is not None:
            raise self.refuse
        self.scheduled.append(request)
        return Decision("e0", E0, SCHEDULER, (E1, E2), self.decode_address)

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None:
        self.reports.append((request_id, generated_tokens, served_address))

    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        self.releases.append((request_id, reason))
        self.answers.append(answer_tokens)

    def instance_added(self, instance: object) -> None: ...
    def instance_removed(self, instance_id: str) -> None: ...
    async def close(self) -> None: ...


def servicer(
    backend: FakeBackend | None = None, **kwargs: object
) -> tuple[ExtProcServicer, FakeBackend, ExtProcMetrics]:
    backend = backend or FakeBackend()
    router = Router(backend, parse_instances([f"e0={E0}", f"e1={E1}", f"e2={E2}"]), breaker=CircuitBreaker(3, 1.0))
    metrics = ExtProcMetrics()
    tokenize = lambda text: [1] * len(text.split())  # noqa: E731
    return ExtProcServicer(router, tokenize, frozenset(), 1 << 20, metrics, **kwargs), backend, metrics  # type: ignore[arg-type]


def headers(
    path: str = "/v1/completions",
    *,
    request_mode: int = Mode.BUFFERED,
    response_mode: int = Mode.STREAMED,
    early: bool = False,
    request_id: str = "client-id",
    subset: list[str] | str | None = None,
    end: bool = False,
) -> ep.ProcessingRequest:
    pairs = [(":path", path), (":method", "POST")] + ([("x-request-id", request_id)] if request_id else [])
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map, end_of_stream=end))
    message.protocol_config.request_body_mode = request_mode
    message.protocol_config.response_body_mode = response_mode
    message.protocol_config.send_body_without_waiting_for_header_response = early
    if subset is not None:
        value = message.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"
        ]
        if isinstance(subset, str):
            value.string_value = subset
        else:
            value.list_value.extend(subset)
    return message


def body(data: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def response_headers(
    status: int = 200, content_type: str = "text/event-stream", served: str = ""
) -> ep.ProcessingRequest:
    pairs = [(":status", str(status)), ("content-type", content_type)]
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    message = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map))
    if served:
        message.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"
        ].string_value = served
    return message


def response_body(data: bytes, end: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=end))


def run(svc: ExtProcServicer, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    return run_messages(messages, svc)


def routed_headers(replies: list[ep.ProcessingResponse]) -> dict[str, str]:
    """The routing header mutation, wherever the mode put it."""
    for reply in replies:
        for kind in ("request_headers", "request_body"):
            if reply.HasField(kind) and getattr(reply, kind).response.clear_route_cache:
                return set_headers(getattr(reply, kind).response.header_mutation)
    raise AssertionError("no routing reply")


# -- hostile input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        {"model": "m", "prompt": "x", "max_tokens": 2**32},
        {"model": "m", "prompt": "x", "max_tokens": 2**64},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40},
    ],
)
def test_token_limits_past_32_bits_are_refused_with_400(payload: dict) -> None:
    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    svc, backend, _ = servicer()
    replies = run(svc, [headers(path), body(json.dumps(payload).encode())])
    assert replies[-1].immediate_response.status.code == 400
    assert backend.scheduled == []


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED])
def test_json_nested_past_the_decoder_depth_is_refused_with_400(mode: int) -> None:
    deep = b'{"model": "m", "prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    svc, _, _ = servicer()
    replies = run(svc, [headers(request_mode=mode), body(deep)])
    assert replies[-1].immediate_response.status.code == 400
    assert b"nested too deeply" in replies[-1].immediate_response.body


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED])
def test_a_bug_in_the_processor_answers_500_counts_it_and_routes_nothing(mode: int) -> None:
    svc, _, metrics = servicer(FakeBackend(crash=True))
    replies = run(svc, [headers(request_mode=mode), body(COMPLETION)])
    assert replies[-1].immediate_response.status.code == 500
    assert not any(r.HasField("dynamic_metadata") for r in replies)
    assert metrics.gateway_errors._value.get() == 1


# -- request identity ------------------------------------------------------------------------------


def test_the_same_client_id_on_two_requests_gives_two_gateway_ids() -> None:
    svc, backend, _ = servicer()
    for _ in range(2):
        run(svc, [headers(request_id="dup"), body(COMPLETION), response_headers(content_type="application/json")])
    ids = [r.request_id for r in backend.scheduled]
    assert len(set(ids)) == 2 and all(i.startswith("dup.") for i in ids)
    assert sorted(rid for rid, _ in backend.releases) == sorted(ids)


@pytest.mark.parametrize("client_id", ["", "x" * 65, "a b", "../../etc", "ü"])
def test_a_client_id_that_is_long_or_odd_is_not_kept(client_id: str) -> None:
    svc, backend, _ = servicer()
    run(svc, [headers(request_id=client_id), body(COMPLETION)])
    (sent,) = backend.scheduled
    assert len(sent.request_id) == 32
    assert not client_id or client_id not in sent.request_id


# -- release reasons -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason"),
    [(200, scheduler_pb2.RELEASE_REASON_FINISHED), (400, scheduler_pb2.RELEASE_REASON_FINISHED),
     (503, scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR)],
)  # fmt: skip
def test_a_response_that_is_not_a_stream_is_released_at_its_headers(status: int, reason: int) -> None:
    svc, backend, metrics = servicer()
    run(svc, [headers(), body(COMPLETION), response_headers(status, "application/json")])
    assert [r for _, r in backend.releases] == [reason]
    label = "finished" if reason == scheduler_pb2.RELEASE_REASON_FINISHED else "upstream_error"
    assert metrics.releases.labels(label)._value.get() == 1
    assert metrics.releases.labels("client_abort")._value.get() == 0


def test_a_stream_cut_before_its_end_is_released_once_as_client_abort() -> None:
    svc, backend, _ = servicer()
    run(svc, [headers(), body(STREAMING), response_headers(), response_body(SSE[0])])
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_CLIENT_ABORT]


def test_a_stream_ended_by_trailers_is_released_finished_if_it_came_whole() -> None:
    """Trailers end the stream; one without its `data: [DONE]` was cut short by the engine: its failure."""
    trailers = ep.ProcessingRequest(response_trailers=ep.HttpTrailers())
    for events, reason in ((SSE, scheduler_pb2.RELEASE_REASON_FINISHED), (SSE[:1], UPSTREAM_ERROR)):
        svc, backend, _ = servicer()
        replies = run(svc, [headers(), body(STREAMING), response_headers(), *map(response_body, events), trailers])
        assert replies[-1].HasField("response_trailers")
        assert [r for _, r in backend.releases] == [reason]


# -- body modes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("response_mode", [Mode.BUFFERED, Mode.STREAMED, Mode.FULL_DUPLEX_STREAMED])
@pytest.mark.parametrize(
    ("request_mode", "early"),
    [(Mode.BUFFERED, False), (Mode.STREAMED, True), (Mode.FULL_DUPLEX_STREAMED, False)],
)
def test_every_body_mode_routes_counts_and_releases_once(request_mode: int, early: bool, response_mode: int) -> None:
    svc, backend, metrics = servicer()
    half = len(STREAMING) // 2
    request = [headers(request_mode=request_mode, response_mode=response_mode, early=early)]
    if request_mode == Mode.BUFFERED:
        request.append(body(STREAMING))
    else:
        request += [body(STREAMING[:half], end=False), body(STREAMING[half:])]
    if response_mode == Mode.BUFFERED:
        response = [response_body(b"".join(SSE), end=True)]
    else:
        response = [response_body(SSE[0]), response_body(SSE[1]), response_body(SSE[2], end=True)]
    replies = run(svc, [*request, response_headers(), *response])
    assert routed_headers(replies)["x-gateway-destination-endpoint"] == E0
    # a reply per message Envoy sent; full duplex answers the held chunks with one streamed body
    request_replies = 2 if request_mode == Mode.FULL_DUPLEX_STREAMED else len(request)
    assert len(replies) == request_replies + 1 + len(response)
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_FINISHED]
    assert metrics.generated_tokens._value.get() == 2
    passed = replies[-len(response) :]
    if response_mode == Mode.FULL_DUPLEX_STREAMED:  # every byte comes back, the last chunk ends it
        out = [r.response_body.response.body_mutation.streamed_response for r in passed]
        assert b"".join(o.body for o in out) == b"".join(SSE)
        assert [o.end_of_stream for o in out] == [False, False, True]
    sent = json.loads(
        b"".join(
            r.request_body.response.body_mutation.streamed_response.body or r.request_body.response.body_mutation.body
            for r in replies
            if r.HasField("request_body")
        )
        or STREAMING
    )
    assert sent["stream_options"]["include_usage"] is True


def test_an_oversized_event_is_counted_by_its_metric_and_passes_whole() -> None:
    """An upstream event past the SSE bound (1 MiB) is not held: its chunks pass on as they come, it counts as one
    token, and the gateway's metric says so."""
    from pilotfish.ext_proc.sse import MAX_EVENT_BYTES

    svc, backend, metrics = servicer()
    huge = b'data: {"choices":[{"index":0,"text":" b","logprobs":"' + b"x" * (MAX_EVENT_BYTES + 70000) + b'"}]}\n\n'
    pieces = [huge[i : i + 65536] for i in range(0, len(huge), 65536)]
    response = [response_body(SSE[0]), *(response_body(p) for p in pieces), response_body(SSE[2], end=True)]
    replies = run(svc, [headers(), body(STREAMING), response_headers(), *response])
    passed = b"".join(
        r.response_body.response.body_mutation.body if r.response_body.response.HasField("body_mutation") else m
        for r, m in zip(replies[-len(response) :], [SSE[0], *pieces, SSE[2]], strict=True)
    )
    assert passed == SSE[0] + huge + SSE[2]
    assert metrics.generated_tokens._value.get() == 2
    assert metrics.sse_oversized_events._value.get() == 1
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_FINISHED]


def test_streamed_response_chunks_pass_unchanged_but_the_usage_event_is_cut() -> None:
    """The client did not ask for usage (the gateway added it): every chunk passes as Envoy sent it,
    with no body mutation to apply, but the one holding the usage event, which is replaced."""
    svc, backend, metrics = servicer()
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    response = [response_body(SSE[0]), response_body(SSE[1]), response_body(usage + SSE[2], end=True)]
    replies = run(svc, [headers(), body(STREAMING), response_headers(), *response])
    passed = [r.response_body.response for r in replies[-3:]]
    assert [r.HasField("body_mutation") for r in passed] == [False, False, True]
    assert passed[-1].body_mutation.body == SSE[2]
    assert metrics.generated_tokens._value.get() == 2
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_FINISHED]


def test_streamed_request_bodies_without_early_sending_ask_envoy_for_the_whole_body() -> None:
    svc, _, _ = servicer()
    replies = run(svc, [headers(request_mode=Mode.STREAMED), body(COMPLETION)])
    assert replies[0].mode_override.request_body_mode == Mode.BUFFERED
    assert routed_headers(replies)["x-gateway-destination-endpoint"] == E0


def test_a_stream_sending_bodies_early_answers_a_whole_responses_body_before_it_ends() -> None:
    """Envoy does not take the headers reply's mode override on such a stream: it sends the body
    anyway, and a stream the processor had already ended would be reset."""
    svc, backend, _ = servicer()
    whole = b'{"id": "x", "choices": []}'
    replies = run(
        svc,
        [headers(request_mode=Mode.STREAMED, response_mode=Mode.BUFFERED, early=True), body(COMPLETION),
         response_headers(200, "application/json"), response_body(whole, end=True)],
    )  # fmt: skip
    assert replies[-1].HasField("response_body")
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_FINISHED]  # at its headers, once


def test_full_duplex_non_stream_response_bytes_all_come_back() -> None:
    svc, _, _ = servicer()
    chunks = [b'{"id": "x", ', b'"choices": []}']
    replies = run(
        svc,
        [headers(request_mode=Mode.FULL_DUPLEX_STREAMED, response_mode=Mode.FULL_DUPLEX_STREAMED), body(COMPLETION),
         response_headers(200, "application/json"), response_body(chunks[0]), response_body(chunks[1], end=True)],
    )  # fmt: skip
    out = [r.response_body.response.body_mutation.streamed_response for r in replies[-2:]]
    assert [o.body for o in out] == chunks and out[-1].end_of_stream


# -- the rest of the protocol ----------------------------------------------------------------------


@pytest.mark.parametrize("subset", [[], "", ["not an address" * 40]])
def test_an_empty_subset_hint_gets_503(subset: list[str] | str) -> None:
    svc, backend, _ = servicer()
    replies = run(svc, [headers(subset=subset), body(COMPLETION)])
    assert replies[0].immediate_response.status.code == 503
    assert backend.scheduled == []


@pytest.mark.parametrize("subset", [[E1, E2], f"{E1}, {E2}"])
def test_the_subset_hint_reaches_the_scheduler(subset: list[str] | str) -> None:
    svc, backend, _ = servicer()
    run(svc, [headers(subset=subset), body(COMPLETION)])
    assert sorted(backend.scheduled[0].candidate_addresses) == [E1, E2]


def test_the_fallback_pick_stays_inside_the_subset_hint() -> None:
    svc, _, _ = servicer(FakeBackend(crash=False, refuse=None))
    router = Router(None, parse_instances([f"e0={E0}", f"e1={E1}", f"e2={E2}"]), breaker=CircuitBreaker(3, 1.0))
    svc = ExtProcServicer(router, lambda t: [1], frozenset(), 1 << 20, ExtProcMetrics())
    picks = {routed_headers(run(svc, [headers(subset=[E2]), body(COMPLETION)]))["x-gateway-destination-endpoint"]
             for _ in range(4)}  # fmt: skip
    assert picks == {E2}
    replies = run(svc, [headers(subset=["127.0.0.9:1"]), body(COMPLETION)])
    assert replies[-1].immediate_response.status.code == 503


@pytest.mark.parametrize("status", [503, 429])
def test_a_scheduler_refusal_is_the_clients_answer_with_retry_after(status: int) -> None:
    svc, _, _ = servicer(FakeBackend(refuse=RequestError(status, "every engine is filtered out", retry_after=1)))
    replies = run(svc, [headers(), body(COMPLETION)])
    answer = replies[-1].immediate_response
    assert answer.status.code == status and b"filtered out" in answer.body
    assert set_headers(answer.headers)["retry-after"] == "1"


@pytest.mark.parametrize("fallbacks", [0, 2])
def test_header_and_metadata_carry_the_same_list(fallbacks: int) -> None:
    svc, _, _ = servicer(destination_fallbacks=fallbacks)
    replies = run(svc, [headers(), body(COMPLETION)])
    expected = ",".join([E0, E1, E2][: 1 + fallbacks])
    routed = next(r for r in replies if r.HasField("dynamic_metadata"))
    lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert lb.string_value == routed_headers(replies)["x-gateway-destination-endpoint"] == expected
    assert routed.dynamic_metadata.fields["pilotfish"].struct_value.fields["destination"].string_value == E0


def test_a_request_served_elsewhere_moves_its_load_there() -> None:
    svc, backend, metrics = servicer()
    run(svc, [headers(), body(COMPLETION), response_headers(200, "application/json", served=E2)])
    assert backend.reports and backend.reports[0][2] == E2
    assert metrics.served_elsewhere._value.get() == 1


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED])
def test_a_clients_prefill_header_is_removed_when_the_pick_is_not_a_pair(mode: int) -> None:
    svc, _, _ = servicer()
    replies = run(svc, [headers(request_mode=mode), body(COMPLETION)])
    routed = next(r for r in replies if r.HasField("dynamic_metadata"))
    mutation = (routed.request_headers if routed.HasField("request_headers") else routed.request_body).response
    assert "x-prefiller-host-port" in mutation.header_mutation.remove_headers


def test_a_prefill_decode_pair_goes_to_the_decode_engine_told_its_prefill_engine() -> None:
    svc, _, _ = servicer(FakeBackend(decode_address=E2), destination_fallbacks=2)
    routed = routed_headers(run(svc, [headers(), body(COMPLETION)]))
    assert routed["x-gateway-destination-endpoint"] == E2
    assert routed["x-prefiller-host-port"] == E0


def test_subset_hint_entries_are_bounded() -> None:
    from pilotfish.ext_proc import messages

    metadata = base_pb2.Metadata()
    value = metadata.filter_metadata["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"]
    value.list_value.extend([f"10.0.{i // 256}.{i % 256}:8000" for i in range(10_000)])
    value.list_value.values.append(struct_pb2.Value(number_value=1))
    assert len(messages.subset_hint(metadata) or ()) == messages.MAX_SUBSET_ENTRIES


# -- response bodies skipped: releases from Envoy's access log --------------------------------------


def test_skipping_bodies_adds_no_usage_reads_no_body_and_leaves_the_release_to_the_access_log() -> None:
    svc, backend, metrics = servicer(response_bodies="skip")
    replies = run(svc, [headers(), body(STREAMING)])  # the sidecar sends no response message in this mode
    # the body went on unchanged: no usage asked for, since nothing counts it here
    assert not any(r.request_body.response.body_mutation.body for r in replies if r.HasField("request_body"))
    route = replies[1].dynamic_metadata.fields["pilotfish"].struct_value.fields
    assert route["instance"].string_value == "e0" and route["source"].string_value == "scheduler"  # Envoy's tags
    assert backend.releases == []  # not at the routing reply, not when the ext_proc stream ends
    svc.release_from_access_log(backend.scheduled[0].request_id, scheduler_pb2.RELEASE_REASON_FINISHED)
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_FINISHED]
    assert metrics.releases.labels("finished")._value.get() == 1


def test_skipping_bodies_leaves_served_elsewhere_to_the_access_log() -> None:
    """An Envoy that still sends response headers gets its tags, but the move is reported once, from the log."""
    svc, backend, _ = servicer(response_bodies="skip")
    replies = run(svc, [headers(), body(STREAMING), response_headers(served=E1)])
    assert replies[-1].mode_override.response_body_mode == Mode.NONE and backend.reports == []


def test_first_token_mode_reports_served_elsewhere_at_the_response_headers_once() -> None:
    """A retry elsewhere is reported when the response headers come (engine health counts it against the
    engine picked at once, not when a long stream ends), and not again from the access log."""
    svc, backend, metrics = servicer(response_bodies="first-token")
    run(svc, [headers(), body(STREAMING), response_headers(served=E1)])
    rid = backend.scheduled[0].request_id
    assert backend.reports == [(rid, 0, E1)]
    svc.release_from_access_log(rid, scheduler_pb2.RELEASE_REASON_FINISHED, E1, 300)
    assert backend.reports == [(rid, 0, E1)] and len(backend.releases) == 1
    assert metrics.served_elsewhere._value.get() == 1


def test_counting_streams_ignore_the_access_log() -> None:
    svc, backend, _ = servicer()
    run(svc, [headers(), body(COMPLETION), response_headers(200, "application/json")])
    svc.release_from_access_log(backend.scheduled[0].request_id, scheduler_pb2.RELEASE_REASON_FINISHED)
    assert len(backend.releases) == 1  # released once, by its stream


def log_entry(
    flags: tuple[str, ...] = (), status: int = 200, source: str | None = "scheduler", details: str = "via_upstream"
):
    from envoy.data.accesslog.v3 import accesslog_pb2

    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_headers["x-request-id"] = "rid"
    entry.response.response_code.value = status
    entry.response.response_code_details = details
    entry.response.response_body_bytes = 100  # an answer has a body
    for flag in flags:
        setattr(entry.common_properties.response_flags, flag, True)
    if source is not None:
        entry.common_properties.metadata.filter_metadata["pilotfish"].fields["source"].string_value = source
    return entry


@pytest.mark.parametrize(
    ("flags", "status", "details", "reason"),
    [
        ((), 200, "via_upstream", scheduler_pb2.RELEASE_REASON_FINISHED),
        ((), 400, "via_upstream", scheduler_pb2.RELEASE_REASON_FINISHED),
        (("downstream_connection_termination",), 200, "via_upstream", scheduler_pb2.RELEASE_REASON_CLIENT_ABORT),
        (("downstream_remote_reset",), 200, "via_upstream", scheduler_pb2.RELEASE_REASON_CLIENT_ABORT),
        (("upstream_remote_reset",), 200, "via_upstream", scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET),
        (("upstream_connection_termination",), 200, "via_upstream", scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET),
        (("upstream_connection_failure",), 503, "upstream_reset_before_response_started{connection_failure}",
         scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR),
        ((), 503, "via_upstream", scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR),  # the engine's own 503
        ((), 429, "via_upstream", scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR),  # the engine refused: overloaded
        ((), 429, "local_rate_limited", scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR),  # Envoy's own 429
        # Envoy's own answer, no engine involved: a routing reply whose headers overflowed Envoy's limit
        ((), 500, "ext_proc_error_gRPC_error_13{header_mutation_rejected}", scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR),
    ],
)
def test_the_access_log_says_how_a_request_ended(
    flags: tuple[str, ...], status: int, details: str, reason: int
) -> None:
    from pilotfish.ext_proc.access_log import AccessLogReleaser

    released: list[tuple[str, int]] = []
    AccessLogReleaser(lambda rid, why, *_: released.append((rid, why))).entry(log_entry(flags, status, details=details))
    assert released == [("rid", reason)]


def test_the_access_log_takes_an_empty_200_from_the_engine_as_its_failure() -> None:
    """Every answer to a completion has a body; the only sign of an engine failing fast with empty 200s where
    the gateway reads no response body (full mode)."""
    from pilotfish.ext_proc.access_log import release_reason

    entry = log_entry()
    assert release_reason(entry) == scheduler_pb2.RELEASE_REASON_FINISHED
    entry.response.response_body_bytes = 0
    assert release_reason(entry) == scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR


def served_entry(served: str, picked: str = E0, prefill: str = ""):
    entry = log_entry()
    entry.common_properties.metadata.filter_metadata["pilotfish"].fields["destination"].string_value = picked
    lb = entry.common_properties.metadata.filter_metadata["envoy.lb"]
    lb.fields["x-gateway-destination-endpoint-served"].string_value = served
    if prefill:
        entry.request.request_headers["x-prefiller-host-port"] = prefill
    return entry


@pytest.mark.parametrize(
    ("entry", "elsewhere"),
    [
        (served_entry(E1), E1),  # Envoy's retry went to the fallback
        (served_entry(E0), ""),  # served where it was picked
        (log_entry(), ""),  # no served key (ORIGINAL_DST, no fallbacks)
        (served_entry(E1, prefill=E0), ""),  # a prefill/decode pair is never moved
    ],
)
def test_the_access_log_says_where_a_request_was_served(entry, elsewhere: str) -> None:
    from pilotfish.ext_proc.access_log import AccessLogReleaser

    released: list[tuple[str, int, str]] = []
    AccessLogReleaser(lambda *args: released.append(args[:3])).entry(entry)
    assert released == [("rid", scheduler_pb2.RELEASE_REASON_FINISHED, elsewhere)]


class OrderedBackend(FakeBackend):
    """Records reports and releases in one list, in the order they came."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, ...]] = []

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None:
        self.events.append(("report", request_id, served_address))

    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        self.events.append(("release", request_id))


def test_a_request_served_elsewhere_is_reported_moved_before_its_release() -> None:
    backend = OrderedBackend()
    svc, _, metrics = servicer(backend, response_bodies="skip")
    run(svc, [headers(), body(STREAMING)])
    rid = backend.scheduled[0].request_id
    svc.release_from_access_log(rid, scheduler_pb2.RELEASE_REASON_FINISHED, E1)
    assert backend.events == [("report", rid, E1), ("release", rid)]
    assert metrics.served_elsewhere._value.get() == 1


def chat_event(text: str, role: bool = False) -> bytes:
    """One event of a vLLM chat stream: the same envelope every time, one token's text."""
    delta = {"role": "assistant", "content": ""} if role else {"content": text}
    chunk = {"id": "chatcmpl-7d1f", "object": "chat.completion.chunk", "created": 1764300000, "model": "m",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_first_token_mode_reads_a_stream_to_its_first_token_then_ends_and_sizes_the_answer_at_the_release() -> None:
    svc, backend, metrics = servicer(response_bodies="first-token")
    words = ["Hello", ",", " world", " and", " the", " rest", " of", " it", "."]
    events = [chat_event("", role=True)] + [chat_event(words[i % len(words)]) for i in range(200)]
    whole = b"".join(events) + b"data: [DONE]\n\n"
    # the role event, then the first token split across two chunks, then chunks the ext_proc must not need
    first = events[1]
    replies = run(svc, [
        headers(), body(STREAMING), response_headers(),
        response_body(events[0]), response_body(first[:20]), response_body(first[20:]),
        response_body(events[2]), response_body(events[3]),
    ])  # fmt: skip
    rid = backend.scheduled[0].request_id
    assert backend.reports == [(rid, 1, "")]  # the prefill is done: reported at the first token
    # replies to the three chunks up to the first token, then the stream ends: the rest is not read
    assert sum(r.HasField("response_body") for r in replies) == 3
    assert backend.releases == []  # not at the stream's end: the access log releases
    svc.release_from_access_log(rid, scheduler_pb2.RELEASE_REASON_FINISHED, "", len(whole))
    assert backend.releases == [(rid, scheduler_pb2.RELEASE_REASON_FINISHED)]
    assert abs(backend.answers[0] - 200) <= 10, backend.answers  # sized from the body: within 5%
    assert metrics.generated_tokens._value.get() == backend.answers[0]
    svc.release_from_access_log(rid, scheduler_pb2.RELEASE_REASON_FINISHED, "", len(whole))
    assert backend.answers[1] == 0  # what was read is forgotten at the release


def test_first_token_mode_releases_a_whole_response_from_the_access_log_only() -> None:
    svc, backend, _ = servicer(response_bodies="first-token")
    replies = run(svc, [headers(), body(COMPLETION), response_headers(200, "application/json")])
    assert replies[-1].mode_override.response_body_mode == Mode.NONE and backend.releases == []
    svc.release_from_access_log(backend.scheduled[0].request_id, scheduler_pb2.RELEASE_REASON_FINISHED, "", 300)
    assert backend.releases == [(backend.scheduled[0].request_id, scheduler_pb2.RELEASE_REASON_FINISHED)]
    assert backend.answers == [0]  # nothing read, nothing estimated


def test_the_access_log_passes_the_response_body_size() -> None:
    from pilotfish.ext_proc.access_log import AccessLogReleaser

    entry = log_entry()
    entry.response.response_body_bytes = 12345
    released: list[tuple[object, ...]] = []
    AccessLogReleaser(lambda *args: released.append(args)).entry(entry)
    assert released == [("rid", scheduler_pb2.RELEASE_REASON_FINISHED, "", 12345)]


@pytest.mark.parametrize("source", ["fallback", None])
def test_the_access_log_releases_only_what_the_scheduler_placed(source: str | None) -> None:
    from pilotfish.ext_proc.access_log import AccessLogReleaser

    released: list[tuple[str, int]] = []
    AccessLogReleaser(lambda rid, why, *_: released.append((rid, why))).entry(log_entry(source=source))
    assert released == []


# -- the observing filter (--response-bodies observe) ----------------------------------------------


def observed(message: ep.ProcessingRequest, request_id: str = "gw-1", source: str | None = "scheduler"):
    message.observability_mode = True
    if message.HasField("response_headers"):
        route = message.metadata_context.filter_metadata["pilotfish"]
        route.fields["request_id"].string_value = request_id
        if source is not None:
            route.fields["source"].string_value = source
    return message


def test_an_observed_stream_is_counted_reported_and_released_once_with_no_reply() -> None:
    svc, backend, metrics = servicer(response_bodies="observe")
    replies = run(
        svc,
        [observed(response_headers()), observed(response_body(SSE[0])), observed(response_body(SSE[1])),
         observed(response_body(SSE[2], end=True))],
    )  # fmt: skip
    assert replies == []  # observability mode: Envoy expects nothing back
    assert backend.releases == [("gw-1", scheduler_pb2.RELEASE_REASON_FINISHED)]
    assert metrics.generated_tokens._value.get() == 2


@pytest.mark.parametrize(("source", "released"), [("scheduler", 1), ("fallback", 0)])
def test_an_observed_stream_cut_short_is_released_only_if_the_scheduler_placed_it(source: str, released: int) -> None:
    svc, backend, _ = servicer(response_bodies="observe")
    run(svc, [observed(response_headers(), source=source), observed(response_body(SSE[0]))])
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_CLIENT_ABORT] * released


def test_the_routing_stream_leaves_the_release_to_the_observer() -> None:
    svc, backend, _ = servicer(response_bodies="observe")
    replies = run(svc, [headers(), body(STREAMING), response_headers()])
    routed = next(r for r in replies if r.HasField("dynamic_metadata"))
    route = routed.dynamic_metadata.fields["pilotfish"].struct_value
    assert route.fields["request_id"].string_value == backend.scheduled[0].request_id  # the observer's key
    assert backend.releases == []
