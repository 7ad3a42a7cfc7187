"""The processor ends each stream itself once the request needs nothing more from it.

Envoy closes an ext_proc stream with a half-close and a reset at once, and grpc.aio then frees
neither the read that reset cancels nor a final status that fails after it: ~100 bytes of native
memory per request, for good (the soak's steady ext_proc growth). A stream that returns as soon as
its last reply is out sends its OK status first and has no read in flight when the reset comes.
Driven without gRPC or Envoy: the message source fails the test if it is read past the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import Decision
from pilotfish.protos import scheduler_pb2
from tests.unit.test_ext_proc_protocol import (
    COMPLETION,
    SSE,
    STREAMING,
    FakeBackend,
    Mode,
    body,
    headers,
    observed,
    response_body,
    response_headers,
    servicer,
)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
TRAILERS = ep.ProcessingRequest(response_trailers=ep.HttpTrailers())


class ReadPastTheEnd(AssertionError):
    """The processor asked Envoy's stream for a message after the request was over."""


def run_to_the_end(
    svc: ExtProcServicer, messages: list[ep.ProcessingRequest]
) -> tuple[list[ep.ProcessingResponse], int]:
    """The replies, and how many messages the processor read; reading past the last one fails."""
    read = 0

    async def feed() -> AsyncIterator[ep.ProcessingRequest]:
        nonlocal read
        for message in messages:
            read += 1
            yield message
        raise ReadPastTheEnd(f"read past message {len(messages)}: Envoy would have to close this stream")

    async def collect() -> list[ep.ProcessingResponse]:
        return [reply async for reply in svc.Process(feed(), None)]

    return asyncio.run(collect()), read


def stream() -> list[ep.ProcessingRequest]:
    """A streamed response, fresh each time (`observed` marks messages in place)."""
    return [response_headers(), response_body(SSE[0]), response_body(SSE[1]), response_body(SSE[2], end=True)]


@pytest.mark.parametrize("response_mode", [Mode.STREAMED, Mode.FULL_DUPLEX_STREAMED])
def test_a_stream_ends_with_the_reply_to_its_last_body_chunk(response_mode: int) -> None:
    svc, backend, _ = servicer()
    messages = [headers(response_mode=response_mode), body(STREAMING), *stream()]
    replies, read = run_to_the_end(svc, messages)
    assert read == len(messages)
    assert replies[-1].HasField("response_body")
    assert [r for _, r in backend.releases] == [FINISHED]


def test_a_response_that_is_not_a_stream_ends_at_its_headers() -> None:
    svc, backend, _ = servicer()
    replies, _ = run_to_the_end(svc, [headers(), body(COMPLETION), response_headers(200, "application/json")])
    assert replies[-1].response_headers and [r for _, r in backend.releases] == [FINISHED]


def test_a_stream_ended_by_trailers_ends_there() -> None:
    svc, backend, _ = servicer()
    stream = [headers(), body(STREAMING), response_headers(), *map(response_body, SSE), TRAILERS]
    replies, _ = run_to_the_end(svc, stream)
    assert replies[-1].HasField("response_trailers") and [r for _, r in backend.releases] == [FINISHED]


def test_a_request_the_gateway_answers_itself_ends_with_that_answer() -> None:
    svc, backend, _ = servicer()
    replies, _ = run_to_the_end(svc, [headers(subset=[])])
    assert replies[-1].immediate_response.status.code == 503 and backend.scheduled == []


@pytest.mark.parametrize("request_mode", [Mode.BUFFERED, Mode.STREAMED, Mode.FULL_DUPLEX_STREAMED])
def test_skipped_response_bodies_keep_the_stream_open_for_envoys_close(request_mode: int) -> None:
    """Envoy sends no response message in this mode, and answers an OK that comes before the request
    is over with a reset: the stream stays open, unanswered, until Envoy's graceful close."""
    svc, backend, _ = servicer(response_bodies="skip")
    with pytest.raises(ReadPastTheEnd):
        run_to_the_end(svc, [headers(request_mode=request_mode), body(STREAMING)])
    assert backend.releases == []  # the access log releases it, not the stream's end


def test_an_observed_stream_ends_at_its_last_chunk() -> None:
    svc, backend, _ = servicer(response_bodies="observe")
    _, read = run_to_the_end(svc, [observed(m) for m in stream()])
    assert read == 4 and backend.releases == [("gw-1", FINISHED)]


def test_a_stream_read_to_its_first_token_ends_there_unless_every_byte_is_owed() -> None:
    """--response-bodies first-token: the stream ends with the reply to the chunk with the first token, so
    Envoy passes the rest without a message each; in full duplex every byte is owed back, so it reads on."""
    svc, backend, _ = servicer(response_bodies="first-token")
    replies, read = run_to_the_end(svc, [headers(), body(STREAMING), *stream()])
    assert read == 4 and replies[-1].HasField("response_body")  # headers, body, response headers, first chunk
    assert backend.reports == [(backend.scheduled[0].request_id, 1, "")] and backend.releases == []
    svc, backend, _ = servicer(response_bodies="first-token")
    messages = [headers(response_mode=Mode.FULL_DUPLEX_STREAMED), body(STREAMING), *stream()]
    replies, read = run_to_the_end(svc, messages)
    assert read == len(messages) and len(backend.reports) == 1 and backend.releases == []
    assert [r.response_body.response.body_mutation.streamed_response.body for r in replies[-3:]] == SSE


def test_reading_to_the_first_token_needs_the_loop_server() -> None:
    from pilotfish.config import ConfigError
    from pilotfish.ext_proc.config import ExtProcConfig
    from pilotfish.ext_proc.server import ExtProcServer

    with pytest.raises(ConfigError, match="first-token needs --grpc-server loop"):
        ExtProcServer(ExtProcConfig(response_bodies="first-token", grpc_server="grpcio", scheduler_address=""))


def test_a_full_duplex_response_that_is_not_a_stream_is_read_to_its_last_byte() -> None:
    """Envoy may refuse the mode override that turns its body off, and then every byte is owed."""
    svc, _, _ = servicer()
    chunks = [b'{"id": "x", ', b'"choices": []}']
    messages = [
        headers(request_mode=Mode.FULL_DUPLEX_STREAMED, response_mode=Mode.FULL_DUPLEX_STREAMED), body(COMPLETION),
        response_headers(200, "application/json"), response_body(chunks[0]), response_body(chunks[1], end=True),
    ]  # fmt: skip
    replies, read = run_to_the_end(svc, messages)
    assert read == len(messages)
    out = [r.response_body.response.body_mutation.streamed_response for r in replies[-2:]]
    assert [o.body for o in out] == chunks and out[-1].end_of_stream


def test_a_stream_whose_response_is_not_over_keeps_reading() -> None:
    svc, backend, _ = servicer()
    with pytest.raises(ReadPastTheEnd):
        run_to_the_end(svc, [headers(), body(STREAMING), response_headers(), response_body(SSE[0])])
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_CLIENT_ABORT]


class HeldBackend(FakeBackend):
    """A scheduler that holds every Schedule until the test lets it go (its flow-control queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = asyncio.Event()
        self.let_go = asyncio.Event()
        self.cancelled = 0

    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        self.holding.set()
        try:
            await self.let_go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().schedule(request)


def test_a_client_that_leaves_while_the_scheduler_holds_its_request_takes_it_out() -> None:
    """With Envoy's graceful close the client's leaving is only the stream's end (no reset)."""
    backend = HeldBackend()
    svc, _, _ = servicer(backend)

    async def scenario() -> list[ep.ProcessingResponse]:
        async def feed() -> AsyncIterator[ep.ProcessingRequest]:
            yield headers()
            yield body(STREAMING)
            await backend.holding.wait()  # then Envoy half-closes: the client left

        return [reply async for reply in svc.Process(feed(), None)]

    # the bound only keeps a processor that never notices from hanging the suite
    replies = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert backend.cancelled == 1 and backend.scheduled == []
    assert [r for _, r in backend.releases] == [scheduler_pb2.RELEASE_REASON_CLIENT_ABORT]
    assert [r.WhichOneof("response") for r in replies] == ["request_headers"]


def test_a_message_read_while_scheduling_is_handled_next() -> None:
    backend = HeldBackend()
    svc, _, _ = servicer(backend)

    async def scenario() -> list[ep.ProcessingResponse]:
        async def feed() -> AsyncIterator[ep.ProcessingRequest]:
            yield headers()
            yield body(STREAMING)
            await backend.holding.wait()
            backend.let_go.set()
            for message in stream():
                yield message

        return [reply async for reply in svc.Process(feed(), None)]

    replies = asyncio.run(asyncio.wait_for(scenario(), 30))  # a hang guard, as above
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "response_headers"] + [
        "response_body"
    ] * 3
    assert [r for _, r in backend.releases] == [FINISHED]


def test_reading_to_the_first_token_without_an_access_log_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    """Behind a gateway that sends no access log, streams ended at their first token are never released: the
    ext_proc says so once, when they have gone unlogged longer than nearly any answer runs, and not where
    entries come."""
    import logging

    from pilotfish.ext_proc import processor

    now = [0.0]
    for logged in (False, True):
        svc, backend, _ = servicer(response_bodies="first-token")
        svc._clock = lambda: now[0]  # type: ignore[method-assign]
        caplog.clear()
        for step in range(3):
            now[0] = step * processor._NO_ACCESS_LOG_AFTER * 0.6
            run_to_the_end(svc, [headers(), body(STREAMING), *stream()])
            if logged:
                svc.release_from_access_log(backend.scheduled[-1].request_id, FINISHED, "", 300)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "no access-log entry" in r.message]
        assert len(errors) == (0 if logged else 1)
