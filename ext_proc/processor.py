"""The ExternalProcessor servicer: one gRPC stream per HTTP request that Envoy proxies.

Request path: headers → body → parse, count prompt tokens → Schedule → route by header
mutation. With a BUFFERED body (the default) Envoy waits for the headers reply before it sends
the body, and the routing mutation rides on the body reply; with FULL_DUPLEX_STREAMED (Envoy
says which in the first message's protocol_config) the headers reply is held back until the
whole body is here, then carries the routing, and the body goes back as a streamed response.
Response path: SSE chunks are counted and reported as they pass; the request is released
exactly once — at the end of the stream, or when the stream dies.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.ext_proc import messages
from pilotfish.ext_proc.openai import ROUTED_PATHS, RequestError, parse_request, route_path
from pilotfish.ext_proc.routing import SCHEDULER, Decision, Router
from pilotfish.ext_proc.sse import TokenCounter, UsageStripper
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.protos import scheduler_pb2

log = logging.getLogger(__name__)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
CLIENT_ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
UPSTREAM_ERROR = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
_REASON_LABELS = {FINISHED: "finished", CLIENT_ABORT: "stream_ended_early", UPSTREAM_ERROR: "upstream_error"}
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class _Stream:
    """What one HTTP request's processing remembers between messages."""

    __slots__ = (
        "body",
        "counter",
        "decision",
        "full_duplex",
        "id_in_headers",
        "path",
        "released",
        "request_id",
        "status",
        "stripper",
    )

    def __init__(self) -> None:
        self.full_duplex = False  # FULL_DUPLEX_STREAMED request body: the headers reply waits for the body
        self.body: list[bytes] | None = None  # chunks read so far while the headers reply is held
        self.request_id = ""
        self.id_in_headers = False  # the request carries x-request-id already: no need to set it
        self.path = ""
        self.decision: Decision | None = None
        self.counter: TokenCounter | None = None
        self.stripper: UsageStripper | None = None  # set when we asked for usage the client did not
        self.status = 0
        self.released = False


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        router: Router,
        tokenize: Callable[[str], list[int]],
        models: frozenset[str],
        max_body_bytes: int,
        metrics: ExtProcMetrics,
        exact_usage: bool = True,
        prefix_block_size: int = 0,
    ) -> None:
        self._prefix_block_size = prefix_block_size
        self._router = router
        self._tokenize = tokenize
        self._models = models
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics
        self._exact_usage = exact_usage

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        s = _Stream()
        self._metrics.active_streams.inc()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "response_body":  # first: SSE chunks are most of the messages
                    yield self._on_response_body(s, message.response_body)
                elif kind == "request_headers":
                    s.full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
                    reply = self._on_request_headers(s, message.request_headers)
                    if reply is not None:
                        yield reply
                elif kind == "request_body":
                    if s.full_duplex:
                        for reply in await self._on_streamed_request_body(s, message.request_body):
                            yield reply
                    else:
                        yield await self._on_request_body(s, message.request_body)
                elif kind == "request_trailers" and s.body is not None:
                    # FULL_DUPLEX: trailers, not a body chunk, ended the request; route on what came.
                    for reply in await self._finish_held(s, end_of_stream=False):
                        yield reply
                    yield _continue_for(kind)
                elif kind == "response_headers":
                    yield self._on_response_headers(s, message.response_headers, message.metadata_context)
                else:  # trailers are not requested by our config; answer so Envoy never waits
                    yield _continue_for(kind)
        finally:
            self._metrics.active_streams.dec()
            # The stream ended before the response did: the client went away or the upstream reset
            # (Envoy does not tell the ext_proc which).
            if s.decision is not None and not s.released:
                self._release(s, UPSTREAM_ERROR if s.status >= 500 else CLIENT_ABORT)

    def _on_request_headers(self, s: _Stream, headers: ep.HttpHeaders) -> ep.ProcessingResponse | None:
        h = messages.header_map(headers)
        s.path = route_path(h.get(":path", ""))
        request_id = h.get(messages.REQUEST_ID_HEADER)
        s.id_in_headers = bool(request_id)
        s.request_id = request_id or uuid.uuid4().hex
        if not headers.end_of_stream and s.path in ROUTED_PATHS:
            if s.full_duplex:
                s.body = []
                return None  # held: the body decides where it goes, and Envoy is already sending it
            return messages.CONTINUE_REQUEST_HEADERS  # the body decides where it goes
        # No body to schedule on (GET /v1/models, /health, ...): any engine will do.
        try:
            inst = self._router.pick_round_robin()
        except RequestError as exc:
            return self._reject(exc)
        return messages.route_on_headers(inst.address, s.request_id)

    async def _on_request_body(self, s: _Stream, body: ep.HttpBody) -> ep.ProcessingResponse:
        if s.path not in ROUTED_PATHS:
            # A body on a path we don't schedule: route it like a bodiless request.
            try:
                inst = self._router.pick_round_robin()
            except RequestError as exc:
                return self._reject(exc)
            return messages.route_on_body(inst.address, s.request_id)
        try:
            new_body = await self._schedule(s, body.body)
        except RequestError as exc:
            return self._reject(exc)
        assert s.decision is not None
        request_id = None if s.id_in_headers else s.request_id
        return messages.route_on_body(s.decision.address, request_id, new_body, s.decision.fallbacks)

    async def _on_streamed_request_body(self, s: _Stream, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        """FULL_DUPLEX_STREAMED: every byte Envoy sends must come back, or the upstream gets less."""
        if s.body is None:  # the headers were answered already (a path we don't schedule): echo
            return [messages.streamed_request_body(body.body, body.end_of_stream)]
        s.body.append(body.body)
        size = sum(map(len, s.body))
        if size > self._max_body_bytes:  # Envoy holds no buffer in this mode, so its 413 never fires
            s.body = None
            return [self._reject(RequestError(413, f"request body exceeds {self._max_body_bytes} bytes"))]
        if not body.end_of_stream:
            return []
        return await self._finish_held(s, end_of_stream=True)

    async def _finish_held(self, s: _Stream, end_of_stream: bool) -> list[ep.ProcessingResponse]:
        """The whole body is here: the held headers reply routes, then the body goes on."""
        assert s.body is not None
        whole = b"".join(s.body)
        s.body = None
        try:
            new_body = await self._schedule(s, whole)
        except RequestError as exc:
            return [self._reject(exc)]
        assert s.decision is not None
        return [
            messages.route_on_headers(s.decision.address, s.request_id, s.decision.fallbacks),
            messages.streamed_request_body(whole if new_body is None else new_body, end_of_stream),
        ]

    async def _schedule(self, s: _Stream, body: bytes) -> bytes | None:
        """Parse and schedule; sets s.decision. Returns the body to send instead, if it changed."""
        new_body = None
        if len(body) > self._max_body_bytes:
            raise RequestError(413, f"request body of {len(body)} bytes exceeds {self._max_body_bytes}")
        parsed = parse_request(s.path, body)
        if self._models and parsed.model not in self._models:
            raise RequestError(404, f"The model `{parsed.model}` does not exist.", "model")
        if parsed.stream and not parsed.include_usage and self._exact_usage:
            new_body = parsed.body_requesting_usage()
            s.stripper = UsageStripper()
        token_ids = parsed.prompt_token_ids
        if token_ids is None:
            token_ids = self._tokenize(parsed.prompt_text)
        block_size = self._prefix_block_size
        request = scheduler_pb2.ScheduleRequest(
            request_id=s.request_id,
            model=parsed.model,
            prompt_tokens=len(token_ids),
            prefix_block_hashes=prefix_block_hashes(token_ids, block_size) if block_size else (),
            prefix_block_size=block_size,
            max_tokens=parsed.max_tokens or 0,
            stream=parsed.stream,
        )
        started = time.perf_counter()
        s.decision = await self._router.choose(request)
        self._metrics.schedule_seconds.observe(time.perf_counter() - started)
        self._metrics.routed.labels(s.decision.source).inc()
        return new_body

    def _on_response_headers(
        self, s: _Stream, headers: ep.HttpHeaders, metadata: base_pb2.Metadata
    ) -> ep.ProcessingResponse:
        h = messages.header_map(headers)
        served = messages.served_endpoint(metadata)
        if served and s.decision is not None and served != s.decision.address:
            # The gateway retried elsewhere; the scheduler's account still names the first choice.
            self._metrics.served_elsewhere.inc()
            log.debug("request %s served by %s, not %s", s.request_id, served, s.decision.address)
        try:
            s.status = int(h.get(":status", "0"))
        except ValueError:
            s.status = 0
        decision = s.decision
        stream_body = (
            decision is not None
            and s.status == 200
            and not headers.end_of_stream
            and h.get("content-type", "").startswith("text/event-stream")
        )
        if stream_body:
            s.counter = s.stripper.counter if s.stripper is not None else TokenCounter()
        elif decision is not None and (headers.end_of_stream or s.status != 200):
            # Nothing more will come for this request that could change its load.
            self._release(s, FINISHED if s.status == 200 else UPSTREAM_ERROR)
        if decision is None:
            return messages.response_headers_reply("", "", stream_body=False)
        return messages.response_headers_reply(decision.instance_id, decision.source, stream_body)

    def _on_response_body(self, s: _Stream, body: ep.HttpBody) -> ep.ProcessingResponse:
        counter = s.counter
        if counter is None or s.decision is None or s.released:
            return messages.CONTINUE_RESPONSE_BODY
        stripper = s.stripper
        if stripper is not None:
            out = stripper.feed(body.body)
            if body.end_of_stream:
                out += stripper.finish()
        else:
            counter.feed(body.body)
            if body.end_of_stream:
                counter.finish()
        if body.end_of_stream:
            self._release(s, FINISHED)
        elif counter.tokens and s.decision.source == SCHEDULER:
            self._router.report(s.request_id, counter.tokens, prefill_done=True)
        return messages.replace_response_body(out) if stripper is not None else messages.CONTINUE_RESPONSE_BODY

    def _release(self, s: _Stream, reason: int) -> None:
        s.released = True
        if s.counter is not None:
            self._metrics.generated_tokens.inc(s.counter.tokens)
        # A round-robin fallback was never scheduled, so the scheduler holds nothing to release.
        if s.decision is not None and s.decision.source == SCHEDULER:
            self._metrics.releases.labels(_REASON_LABELS[reason]).inc()
            self._router.release(s.request_id, reason)

    def _reject(self, exc: RequestError) -> ep.ProcessingResponse:
        self._metrics.rejected.labels(str(exc.status)).inc()
        return messages.immediate(exc.status, exc.body(), f"pilotfish_{exc.status}")


def _continue_for(kind: str | None) -> ep.ProcessingResponse:
    if kind == "request_trailers":
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
    if kind == "response_trailers":
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
    return messages.CONTINUE_REQUEST_BODY
