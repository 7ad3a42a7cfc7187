"""Where Envoy's access log releases (--response-bodies skip or first-token), a stream that ends before its
response is released from the ext_proc when its entry does not come: a client reset that beats the routing reply
to Envoy leaves an entry without the scheduler's tag, and the scheduler held such a request's load until its
staleness expiry (300 s; any client could pile it up). The entry, where it comes, still releases exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.procs import wait_until_async
from pilotfish.protos import scheduler_pb2
from tests.unit.test_ext_proc_protocol import (
    STREAMING,
    FakeBackend,
    Mode,
    body,
    headers,
    response_headers,
    run,
    servicer,
)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
CLIENT_ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
WAIT_S = 0.05
LIMIT_S = 10.0  # a loaded machine's bound; a passing run returns as soon as the release comes


async def _stream(svc: ExtProcServicer, backend: FakeBackend, log_while_live: bool) -> None:
    """One request routed, then its stream ends with no response (the client left); with `log_while_live`
    the access-log entry comes between the routing reply and the stream's end."""
    routed = asyncio.Event()

    async def feed() -> AsyncIterator[ep.ProcessingRequest]:
        yield headers()
        yield body(STREAMING)
        await routed.wait()

    async for reply in svc.Process(feed(), None):
        if reply.HasField("request_body"):  # the routing reply
            if log_while_live:
                svc.release_from_access_log(backend.scheduled[0].request_id, FINISHED)
            routed.set()


@pytest.mark.parametrize("bodies", ["first-token", "skip"])
def test_a_stream_that_ends_unlogged_is_released_from_here_after_the_wait(bodies: str) -> None:
    svc, backend, metrics = servicer(response_bodies=bodies, access_log_wait_s=WAIT_S)

    async def scenario() -> None:
        await _stream(svc, backend, log_while_live=False)
        assert backend.releases == []  # not at the stream's end: its entry may still come
        await wait_until_async(lambda: bool(backend.releases), LIMIT_S, "a release")

    asyncio.run(scenario())
    assert backend.releases == [(backend.scheduled[0].request_id, CLIENT_ABORT)]
    assert metrics.unlogged_releases._value.get() == 1


@pytest.mark.parametrize("log_while_live", [False, True])
def test_an_entry_before_or_after_the_streams_end_releases_it_once(log_while_live: bool) -> None:
    svc, backend, metrics = servicer(response_bodies="first-token", access_log_wait_s=WAIT_S)

    async def scenario() -> None:
        await _stream(svc, backend, log_while_live)
        if not log_while_live:
            svc.release_from_access_log(backend.scheduled[0].request_id, FINISHED)
        # a second request's wait running out shows the first one's would have too
        await _stream(svc, backend, log_while_live=False)
        await wait_until_async(lambda: len(backend.releases) == 2, LIMIT_S, "two releases")

    asyncio.run(scenario())
    first, second = (r.request_id for r in backend.scheduled)
    assert backend.releases == [(first, FINISHED), (second, CLIENT_ABORT)]  # the entry's reason, once
    assert metrics.unlogged_releases._value.get() == 1


def test_an_entry_after_the_wait_releases_nothing_more() -> None:
    svc, backend, metrics = servicer(response_bodies="first-token", access_log_wait_s=WAIT_S)

    async def scenario() -> None:
        await _stream(svc, backend, log_while_live=False)
        await wait_until_async(lambda: bool(backend.releases), LIMIT_S, "a release")

    asyncio.run(scenario())
    rid = backend.scheduled[0].request_id
    svc.release_from_access_log(rid, FINISHED)  # late: the request's one release was sent already
    assert backend.releases == [(rid, CLIENT_ABORT)] and metrics.releases.labels("finished")._value.get() == 0


@pytest.mark.parametrize("request_mode", [Mode.STREAMED, Mode.FULL_DUPLEX_STREAMED])
def test_skipping_bodies_a_streamed_request_bodys_stream_ends_at_routing_and_its_entry_releases_it(
    request_mode: int,
) -> None:
    """Envoy closes such a stream right after the routing reply (nothing more is owed it) while the request runs
    on: its end says nothing, and only the entry, at the request's end, releases it."""
    svc, backend, _ = servicer(response_bodies="skip", access_log_wait_s=WAIT_S)
    run(svc, [headers(request_mode=request_mode, early=True), body(STREAMING)])
    rid = backend.scheduled[0].request_id
    assert backend.releases == [] and not svc._awaiting_log  # no wait armed: nothing would release it early
    svc.release_from_access_log(rid, FINISHED)
    assert backend.releases == [(rid, FINISHED)]


def test_reading_to_the_first_token_a_whole_answer_is_left_to_its_entry() -> None:
    """Its response came through Envoy, so the entry will carry the scheduler's tag: nothing waits for it."""
    svc, backend, _ = servicer(response_bodies="first-token", access_log_wait_s=WAIT_S)
    run(svc, [headers(), body(STREAMING), response_headers(200, "application/json")])
    assert backend.releases == [] and not svc._awaiting_log
