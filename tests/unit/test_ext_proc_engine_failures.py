"""An engine that fails fast while answering 200 or 429 must not count as finishing: released as
finished, each such answer dropped the request's load and counted as the engine's success, so an engine that
refuses everything at once (429) or sends empty or truncated streams looked idle and healthy, drew the traffic it
failed and was never ejected (measured: every request of a 30 s fault, in lite and full mode). An engine ends
every stream with `data: [DONE]` (vLLM even a failed one), so a stream without it was cut short."""

from __future__ import annotations

import pytest

from pilotfish.protos import scheduler_pb2
from tests.unit.test_ext_proc_protocol import (
    SSE,
    STREAMING,
    body,
    headers,
    response_body,
    response_headers,
    run,
    servicer,
)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
UPSTREAM_ERROR = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
GATEWAY_ERROR = scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR
WHOLE = b"".join(SSE)


@pytest.mark.parametrize(
    ("chunks", "reason"),
    [
        ([WHOLE], FINISHED),
        ([SSE[0], SSE[1], SSE[2]], FINISHED),
        ([b""], UPSTREAM_ERROR),  # empty
        ([SSE[0]], UPSTREAM_ERROR),  # one token, then the end: no [DONE]
        ([b'data: {"choices": [{"te'], UPSTREAM_ERROR),  # broken off mid-event
    ],
)
def test_a_counted_stream_that_ends_without_its_done_is_the_engines_failure(chunks: list[bytes], reason: int) -> None:
    svc, backend, _ = servicer()
    last = len(chunks) - 1
    response = [response_body(c, i == last) for i, c in enumerate(chunks)]
    run(svc, [headers(), body(STREAMING), response_headers(), *response])
    assert [r for _, r in backend.releases] == [reason]


def test_a_whole_429_read_here_is_no_success_nor_the_engines_failure() -> None:
    """Read on this stream a 429 may be a rate-limit filter's after this one, which a client provokes at will:
    said of no engine (the access log, which knows who sent it, counts the engine's own: below)."""
    for status, reason in ((429, GATEWAY_ERROR), (503, UPSTREAM_ERROR), (400, FINISHED), (200, FINISHED)):
        svc, backend, _ = servicer()
        run(svc, [headers(), body(STREAMING), response_headers(status, "application/json")])
        assert [r for _, r in backend.releases] == [reason], status


@pytest.mark.parametrize("chunk", [b"", SSE[0], b'data: {"choices": [{"te'])
def test_reading_to_the_first_token_a_stream_cut_short_is_released_from_here_and_its_entry_ignored(
    chunk: bytes,
) -> None:
    """The whole response came (end of stream) with no [DONE]: released at once as the engine's failure; the
    access log's entry, which says only 200, then releases nothing (its success would end the engine's run of
    failures)."""
    svc, backend, metrics = servicer(response_bodies="first-token")
    run(svc, [headers(), body(STREAMING), response_headers(), response_body(chunk, True)])
    rid = backend.scheduled[0].request_id
    assert backend.releases == [(rid, UPSTREAM_ERROR)]
    svc.release_from_access_log(rid, FINISHED, "", len(chunk))
    assert backend.releases == [(rid, UPSTREAM_ERROR)]
    assert metrics.releases.labels("upstream_error")._value.get() == 1


def test_reading_to_the_first_token_a_whole_empty_answer_is_left_to_the_access_log() -> None:
    """An answer with no token that still ends in [DONE] (the first token was the end) is the engine's success."""
    svc, backend, _ = servicer(response_bodies="first-token")
    run(svc, [headers(), body(STREAMING), response_headers(), response_body(b"data: [DONE]\n\n", True)])
    assert backend.releases == []
    rid = backend.scheduled[0].request_id
    svc.release_from_access_log(rid, FINISHED, "", 14)
    assert backend.releases == [(rid, FINISHED)]
