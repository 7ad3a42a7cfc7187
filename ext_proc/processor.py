"""The ExternalProcessor servicer: one gRPC stream per HTTP request that Envoy proxies.

Request path: headers → body → parse, count prompt tokens → Schedule → route. Where the routing
goes depends on the request body mode Envoy declares in the first message's protocol_config:

- BUFFERED: Envoy waits for the headers reply, then sends the whole body; the routing rides on
  the body reply.
- FULL_DUPLEX_STREAMED (what Envoy Gateway, Istio and Envoy AI Gateway configure for an
  InferencePool's picker): the headers reply is held until the whole body is here, then routes;
  every body byte goes back as a streamed response, or the upstream would get less.
- STREAMED: with send_body_without_waiting_for_header_response, held like full duplex (each
  chunk's reply owed until the route is known); without it, Envoy sends no body before the
  headers reply, so that reply asks for BUFFERED instead (mode_override).

Response path, in any of the three modes: SSE chunks are counted and reported as they pass, and
the request is released exactly once: at the end of the stream, at the response headers of a
response that is not a stream, or when the stream dies. Once nothing more is owed (the response's
last byte or its headers, an answer of the gateway's own), the stream ends from this side with OK
rather than waiting for Envoy's close, whose reset makes grpc.aio leak native memory. Nothing a
client sends chooses the upstream: the request id is the gateway's own, and every fault inside
the processor becomes a clean answer to that request alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.ext_proc import messages, tracing
from pilotfish.ext_proc.answer_size import AnswerSizes
from pilotfish.ext_proc.flow import FlowHeaders, source_address
from pilotfish.ext_proc.openai import (
    ROUTED_PATHS,
    UNSCHEDULED_PATHS,
    RequestError,
    parse_request,
    route_path,
)
from pilotfish.ext_proc.routing import FALLBACK, SCHEDULER, Decision, Router
from pilotfish.ext_proc.sse import TokenCounter, UsageStripper
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.protos import scheduler_pb2

log = logging.getLogger(__name__)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
CLIENT_ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
UPSTREAM_ERROR = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
GATEWAY_ERROR = scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR
_REASON_LABELS = {
    FINISHED: "finished",
    CLIENT_ABORT: "client_abort",
    UPSTREAM_ERROR: "upstream_error",
    GATEWAY_ERROR: "gateway_error",
    scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET: "upstream_reset",
}
# A 429 here may be the engine's (overloaded: its failure, as the access log counts it where it says the engine sent
# it) or a rate-limit filter's after this one, which a client provokes at will: said of no engine, never a success
# either (a success dropped the load and counted for the engine, so an engine refusing everything at once looked
# idle and healthy)
REFUSED = 429


def ended_by_status(status: int) -> int:
    """How a whole (not streamed) response ended, by its status: the engine's failure, a finished request, or
    (a 429 of unknown origin) neither."""
    if status == REFUSED:
        return GATEWAY_ERROR
    return UPSTREAM_ERROR if status >= 500 or status == 0 else FINISHED


def ended_by_stream(counter: TokenCounter) -> int:
    """How a 200 stream that reached its end ended: an engine ends every stream with `data: [DONE]` (vLLM even a
    failed one, after an error event), so one without it was cut short by the engine: its failure. Released as
    finished, an engine answering empty or truncated streams at once looked idle and healthy and drew the traffic."""
    return FINISHED if counter.done else UPSTREAM_ERROR


_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
STREAMED = _Mode.STREAMED
BUFFERED = _Mode.BUFFERED

# A client's x-request-id is kept only as a readable prefix of the gateway's own id, and only
# when it is short and plain: it can never name, merge with or erase another request's load.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

# seconds of streams read to their first token with no access-log entry, after which the missing log is reported
_NO_ACCESS_LOG_AFTER = 300.0
# Where the access log releases (--response-bodies skip or first-token), a stream that ends before its response
# (the client reset while it was scheduled) is released by the access log only if Envoy applied the routing reply:
# a reset that beat the reply to Envoy leaves an entry without the scheduler's tag, and nothing else would release
# the request (the scheduler held its load until its 300 s staleness expiry; any client could pile it up). Such a
# stream waits this long for its entry (sent as the request ends), then is released from here. Bounded: past
# _MAX_AWAITING_LOG waiting at once, a stream is released at its end (a later entry's release finds nothing).
ACCESS_LOG_WAIT_S = 5.0
_MAX_AWAITING_LOG = 65536

_INTERNAL_ERROR = RequestError(500, "the gateway failed on this request; it was not sent to an engine")


def _retrieve(read: asyncio.Future[ep.ProcessingRequest]) -> None:
    """Mark a read-ahead's end (the stream's end, or a call already over) as seen."""
    if not read.cancelled():
        read.exception()


def gateway_request_id(client_id: str | None) -> str:
    """The id the scheduler and the engine know the request by: minted here, unique per stream."""
    minted = uuid.uuid4().hex
    if client_id and _CLIENT_ID.fullmatch(client_id):
        return f"{client_id}.{minted[:16]}"
    return minted


class _Stream:
    """What one HTTP request's processing remembers between messages."""

    __slots__ = (
        "ahead",
        "counter",
        "decision",
        "done",
        "fallback",
        "flow",
        "held",
        "observed",
        "owed",
        "path",
        "rejected",
        "released",
        "request_id",
        "request_mode",
        "response_mode",
        "send_body_early",
        "status",
        "stripper",
        "subset",
        "trace",
    )

    def __init__(self) -> None:
        self.request_mode = BUFFERED
        self.response_mode = STREAMED
        self.send_body_early = False  # STREAMED: Envoy sends body chunks before our headers reply
        self.held: list[bytes] | None = None  # body chunks read while the headers reply is held
        self.owed = 0  # STREAMED and held: chunk replies not yet sent
        self.request_id = ""
        self.path = ""
        self.subset: frozenset[str] | None = None  # the gateway's subset hint; None: no hint
        self.flow: tuple[int, str] = (0, "")  # flow control: band and flow key (ext_proc/flow.py)
        self.decision: Decision | None = None
        self.fallback = ""  # the engine a request with nothing to schedule on went to
        self.counter: TokenCounter | None = None
        self.stripper: UsageStripper | None = None  # set when we asked for usage the client did not
        self.status = 0
        self.released = False
        self.rejected = False  # answered by the gateway itself: whatever else comes is not routed
        self.observed = False  # a stream of the observing filter (--response-bodies observe): it releases
        self.trace: tracing.Trace | None = None  # None: this process does not trace (ext_proc/tracing.py)
        self.done = False  # nothing more to read or answer: the stream ends from this side (Process)
        self.ahead: asyncio.Future[ep.ProcessingRequest] | None = None  # a read made while scheduling


class ExtProcServicer:
    """Envoy's ExternalProcessor service (registered by server.py)."""

    def __init__(
        self,
        router: Router,
        tokenize: Callable[[str], list[int]],
        models: frozenset[str],
        max_body_bytes: int,
        metrics: ExtProcMetrics,
        exact_usage: bool = True,
        prefix_block_size: int = 0,
        destination_fallbacks: int = 0,
        response_bodies: str = "count",
        flow_headers: FlowHeaders | None = None,
        unscheduled_paths: Iterable[str] = UNSCHEDULED_PATHS,
        access_log_wait_s: float = ACCESS_LOG_WAIT_S,
    ) -> None:
        self._unscheduled_paths = frozenset(unscheduled_paths)
        self._prefix_block_size = prefix_block_size
        self._flow_headers = flow_headers or FlowHeaders()
        # --response-bodies: "count" reads them on this stream; "first-token" reads each stream up to its
        # first token (the prefill is done), then ends this stream with OK so Envoy passes the rest without
        # a message per chunk, and releases from the access log with the answer's length estimated from
        # its size (answer_size.py); "skip" (full mode: the llumlets count
        # tokens) asks Envoy for none, and every release comes from Envoy's access log once Envoy has
        # really finished the request; the sidecar then sends no response message either (Envoy tags the
        # response from the routing metadata) and this stream ends with Envoy's graceful close at the
        # request's end, never with an early OK, which Envoy answers with a reset; "observe" leaves
        # counting and releasing to the sidecar's observing filter (_observe)
        self._count_tokens = response_bodies == "count"
        self._first_token_only = response_bodies == "first-token"
        # "observe": the observing filter releases
        self._access_log_releases = response_bodies in ("skip", "first-token")
        # where a retry served the request: from the response headers wherever they come here (at once: the
        # scheduler's engine health counts it against the engine it picked), else from the access log, once
        # the request is over (skip: the sidecar sends no response message)
        self._served_from_access_log = response_bodies == "skip"
        self._answer_sizes = AnswerSizes()
        # when the first stream ended at its first token while no access-log entry had come; a gateway that sends
        # this process no access log never releases such streams (the scheduler only expires them): said once,
        # _NO_ACCESS_LOG_AFTER seconds on, longer than nearly any answer runs
        self._first_unlogged_end: float | None = None
        self._watching_access_log = True  # until an entry comes, or the missing log was reported
        # streams the access log is to release, by request id, while they last: an entry that comes first marks its
        # stream released; and those that ended first, each until its entry comes or the wait runs out
        self._live: dict[str, _Stream] = {}
        self._awaiting_log: dict[str, asyncio.TimerHandle] = {}  # its timer carries the reason
        # released from here with a reason the access log cannot tell; their entries are ignored (oldest forgotten)
        self._released_here: OrderedDict[str, None] = OrderedDict()
        self._access_log_wait_s = access_log_wait_s
        self._clock = time.monotonic
        self._destination_fallbacks = destination_fallbacks
        self._router = router
        self._tokenize = tokenize
        self._models = models
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics
        self._exact_usage = exact_usage

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext | None
    ) -> AsyncIterator[ep.ProcessingResponse]:
        s = _Stream()
        self._metrics.active_streams.inc()
        incoming = aiter(request_iterator)
        try:
            while True:
                try:
                    message = await (s.ahead if s.ahead is not None else anext(incoming))
                except StopAsyncIteration:
                    break
                s.ahead = None
                kind = message.WhichOneof("request")
                if message.observability_mode:  # the filter that only watches response bodies
                    self._observe(s, kind, message)
                    if s.done:
                        return
                    continue
                try:
                    if kind == "response_body":  # first: SSE chunks are most of the messages
                        replies = [self._on_response_body(s, message.response_body)]
                    elif kind == "request_trailers" or (kind == "request_body" and message.request_body.end_of_stream):
                        replies = await self._reading_meanwhile(s, kind, message, incoming)
                    else:
                        replies = await self._on_message(s, kind, message)
                except Exception:
                    replies = self._failed(s, kind, message)
                tracing.stamp(replies, s.trace)  # the routing reply sets traceparent upstream
                for reply in replies:
                    yield reply
                if s.done:
                    # End the stream here, with OK, before Envoy closes it: Envoy's close is a
                    # half-close and a reset at once, and grpc.aio frees neither a read cancelled
                    # by that reset nor a status that fails after it (native memory, ~100 bytes
                    # a request, for good). Envoy takes a server's close as "nothing more to process".
                    return
        finally:
            self._metrics.active_streams.dec()
            self._live.pop(s.request_id, None)
            # The stream ended before the response did: the client went away or the upstream reset
            # (Envoy does not tell the ext_proc which).
            if s.decision is not None and not s.released:
                self._release(s, UPSTREAM_ERROR if s.status >= 500 else CLIENT_ABORT)

    async def _reading_meanwhile(
        self, s: _Stream, kind: str, message: ep.ProcessingRequest, incoming: AsyncIterator[ep.ProcessingRequest]
    ) -> list[ep.ProcessingResponse]:
        """Handle the message that schedules, reading the stream meanwhile: the scheduler may hold
        the request for seconds, and with Envoy's graceful close (envoy/sidecar.yaml) a client that
        leaves shows only as the stream's end (a half-close, no reset that would cancel this task),
        which must take the request out of the scheduler's queue. The read is kept for the next
        message, never cancelled: grpc.aio leaks a cancelled read's native op array."""
        work = asyncio.ensure_future(self._on_message(s, kind, message))
        read = s.ahead = asyncio.ensure_future(anext(incoming))
        read.add_done_callback(_retrieve)  # one still pending at the stream's end is never awaited
        try:
            await asyncio.wait((work, read), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        if not work.done() and read.exception() is not None:  # the stream ended: the client left
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work  # the schedule's own cancel path releases it (CLIENT_ABORT)
            return []
        return await work

    async def _on_message(
        self, s: _Stream, kind: str | None, message: ep.ProcessingRequest
    ) -> list[ep.ProcessingResponse]:
        if kind == "request_headers":
            config = message.protocol_config
            s.request_mode = config.request_body_mode
            s.response_mode = config.response_body_mode
            s.send_body_early = config.send_body_without_waiting_for_header_response
            reply = self._on_request_headers(
                s, message.request_headers, message.metadata_context, source_address(message.attributes)
            )
            return [] if reply is None else [reply]
        if kind == "request_body":
            return await self._on_request_body(s, message.request_body)
        if kind == "response_headers":
            return [self._on_response_headers(s, message.response_headers, message.metadata_context)]
        if kind == "request_trailers":
            # A request that ends in trailers has no end_of_stream body chunk: route on what came.
            replies = await self._finish_held(s, end_of_stream=False) if s.held is not None else []
            return [*replies, messages.CONTINUE_REQUEST_TRAILERS]
        if kind == "response_trailers":
            s.done = True
            if s.counter is not None and not s.released:
                s.counter.finish()
                self._release(s, ended_by_stream(s.counter))
            return [messages.CONTINUE_RESPONSE_TRAILERS]
        return []  # a message kind newer than this gateway: nothing to answer

    # -- request ---------------------------------------------------------------------------------

    def _on_request_headers(
        self, s: _Stream, headers: ep.HttpHeaders, metadata: base_pb2.Metadata, source: str | None = None
    ) -> ep.ProcessingResponse | None:
        h = messages.header_map(headers)
        s.path = route_path(h.get(":path", ""))
        s.request_id = gateway_request_id(h.get(messages.REQUEST_ID_HEADER))
        s.subset = messages.subset_hint(metadata)
        priority, flow, over = self._flow_headers.read(h, source)
        s.flow = (priority, flow)
        if over:
            self._metrics.priority_claims_ignored.inc()
        s.trace = tracing.incoming(h)
        if s.subset is not None and not s.subset:
            return self._reject(s, RequestError(503, "the gateway's subset hint names no endpoint"))
        if s.path in ROUTED_PATHS:
            # what the engine would refuse anyway, refused before it takes a place in the scheduler (a gateway
            # that forwards no :method leaves that to the engine)
            if h.get(":method", "POST") != "POST":
                return self._reject(s, RequestError(405, f"{s.path} takes POST"))
            if headers.end_of_stream:
                return self._reject(s, RequestError(400, f"{s.path} needs a JSON body"))
            if s.request_mode != _Mode.NONE:
                if s.request_mode == FULL_DUPLEX or (s.request_mode == STREAMED and s.send_body_early):
                    s.held = []
                    return None  # held: the body decides where it goes, and Envoy is already sending it
                if s.request_mode == STREAMED:
                    s.request_mode = BUFFERED  # Envoy would send no body before this reply: ask for all of it
                    return messages.CONTINUE_REQUEST_HEADERS_BUFFER_BODY
                return messages.CONTINUE_REQUEST_HEADERS  # the body reply routes
        elif s.path not in self._unscheduled_paths:
            # Only the paths named may pass unscheduled: an engine serves more than the routed paths
            # (other generating endpoints, its admin API, a routed path percent-encoded, which it decodes).
            return self._reject(s, RequestError(404, "the gateway serves no such path"))
        # Nothing to schedule on (GET /v1/models, /health; a gateway that sends no body): any engine.
        try:
            inst = self._router.pick_round_robin(s.subset or frozenset())
        except RequestError as exc:
            return self._reject(s, exc)
        s.fallback = inst.instance_id
        return messages.route_on_headers(inst.address, s.request_id, source=FALLBACK, instance=inst.instance_id)

    async def _on_request_body(self, s: _Stream, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if s.rejected:
            return []  # Envoy sends nothing after an immediate response; should it, nothing routes
        if s.held is not None:
            s.held.append(body.body)
            if s.request_mode == STREAMED:
                s.owed += 1
            size = sum(map(len, s.held))
            if size > self._max_body_bytes:  # Envoy holds no buffer in these modes, so its 413 never fires
                return [self._reject(s, RequestError(413, f"request body exceeds {self._max_body_bytes} bytes"))]
            if not body.end_of_stream:
                return []
            return await self._finish_held(s, end_of_stream=True)
        if s.request_mode == FULL_DUPLEX:  # routed on its headers already: every byte goes back
            return [messages.streamed_request_body(body.body, body.end_of_stream)]
        if s.decision is not None or s.path not in ROUTED_PATHS:
            return [messages.CONTINUE_REQUEST_BODY]  # routed on its headers already
        if not body.end_of_stream:
            if s.request_mode == STREAMED:  # Envoy ignored the override: the route is already chosen
                self._metrics.unroutable_bodies.inc()
                return [messages.CONTINUE_REQUEST_BODY]
            # BUFFERED_PARTIAL, or a body past Envoy's buffer: not all of it is here
            return [self._reject(s, RequestError(413, f"request body exceeds {self._max_body_bytes} bytes"))]
        try:
            new_body = await self._schedule(s, body.body)
        except RequestError as exc:
            return [self._reject(s, exc)]
        decision = s.decision
        assert decision is not None
        destination, prefill = self._destination(decision), self._prefill_of(decision)
        fallbacks = self._fallbacks(decision)
        instance = decision.decode_instance_id or decision.instance_id
        return [
            messages.route_on_body(
                destination, s.request_id, new_body, fallbacks, prefill, decision.source, instance=instance
            )
        ]

    async def _finish_held(self, s: _Stream, end_of_stream: bool) -> list[ep.ProcessingResponse]:
        """The whole body is here: the held headers reply routes, then the body goes on."""
        assert s.held is not None
        chunks, s.held = s.held, None
        whole = b"".join(chunks)
        try:
            new_body = await self._schedule(s, whole)
        except RequestError as exc:
            return [self._reject(s, exc)]
        decision = s.decision
        assert decision is not None
        routed = messages.route_on_headers(
            self._destination(decision), s.request_id, self._fallbacks(decision),
            content_length=None if new_body is None else len(new_body), prefill=self._prefill_of(decision),
            source=decision.source, instance=decision.decode_instance_id or decision.instance_id,
        )  # fmt: skip
        if s.request_mode == FULL_DUPLEX:
            return [routed, messages.streamed_request_body(whole if new_body is None else new_body, end_of_stream)]
        # STREAMED, held: one reply owed per chunk, in order; a rewritten body rides on the first
        owed, s.owed = s.owed, 0
        if new_body is None:
            return [routed, *([messages.CONTINUE_REQUEST_BODY] * owed)]
        return [routed, messages.replace_request_body(new_body), *([messages.replace_request_body(b"")] * (owed - 1))]

    async def _schedule(self, s: _Stream, body: bytes) -> bytes | None:
        """Parse and schedule; sets s.decision. Returns the body to send instead, if it changed."""
        new_body = None
        if len(body) > self._max_body_bytes:
            raise RequestError(413, f"request body of {len(body)} bytes exceeds {self._max_body_bytes}")
        parsed = parse_request(s.path, body)
        if self._models and parsed.model not in self._models:
            raise RequestError(404, f"The model `{parsed.model}` does not exist.", "model")
        if parsed.stream and not parsed.include_usage and self._exact_usage and self._count_tokens:
            new_body = parsed.body_requesting_usage()
            s.stripper = UsageStripper()
        token_ids = parsed.prompt_token_ids
        if token_ids is None:
            token_ids = self._tokenize(parsed.prompt_text)
        block_size = self._prefix_block_size
        request = scheduler_pb2.ScheduleRequest(
            request_id=s.request_id,
            model=parsed.model,
            prompt_tokens=min(len(token_ids), messages.MAX_UINT32),
            prefix_block_hashes=prefix_block_hashes(token_ids, block_size) if block_size else (),
            prefix_block_size=block_size,
            max_tokens=parsed.max_tokens or 0,
            stream=parsed.stream,
            candidate_addresses=sorted(s.subset) if s.subset else (),
            priority=s.flow[0],  # type: ignore[arg-type]
            flow=s.flow[1],
            queue_timeout_ms=self._flow_headers.queue_timeout_ms,
        )
        started = time.perf_counter()
        with tracing.schedule_span(s.trace, request) as span:  # sets request.traceparent when tracing
            try:
                s.decision = await self._router.choose(request)
            except asyncio.CancelledError:  # the client left while the scheduler held the request
                self._router.release(s.request_id, CLIENT_ABORT)  # out of its queue: never dispatched
                raise
            tracing.decided(span, s.decision)
        if self._access_log_releases and s.decision.source == SCHEDULER:
            self._live[s.request_id] = s
        self._metrics.schedule_seconds.observe(time.perf_counter() - started)
        self._metrics.routed.labels(s.decision.source).inc()
        return new_body

    @staticmethod
    def _destination(decision: Decision) -> str:
        """Where the request goes: the decode engine of a prefill/decode pair, else the target."""
        return decision.decode_address or decision.address

    def _fallbacks(self, decision: Decision) -> tuple[str, ...]:
        """The fallbacks the destination list names after the primary (none for a pair)."""
        n = self._destination_fallbacks
        return decision.fallbacks[:n] if n and not decision.decode_address else ()

    @staticmethod
    def _prefill_of(decision: Decision) -> str:
        """The prefill engine a decode engine is told to pull from (llm-d's convention), if any."""
        return decision.address if decision.decode_address else ""

    # -- response --------------------------------------------------------------------------------

    def _on_response_headers(
        self, s: _Stream, headers: ep.HttpHeaders, metadata: base_pb2.Metadata
    ) -> ep.ProcessingResponse:
        h = messages.header_map(headers)
        decision = s.decision
        # with response bodies skipped, the access log reports where it was served (once)
        served = "" if self._served_from_access_log else messages.served_endpoint(metadata)
        if served and decision is not None and served != self._destination(decision):
            # The gateway retried elsewhere: the load moves to where it is served.
            self._metrics.served_elsewhere.inc()
            log.debug("request %s served by %s, not %s", s.request_id, served, self._destination(decision))
            if decision.source == SCHEDULER and not decision.decode_address:
                self._router.report(s.request_id, 0, False, served_address=served)
        try:
            s.status = int(h.get(":status", "0"))
        except ValueError:
            s.status = 0
        stream_body = (
            decision is not None
            and s.status == 200
            and not headers.end_of_stream
            and h.get("content-type", "").startswith("text/event-stream")
        )
        if stream_body:
            if self._count_tokens or self._first_token_only:
                s.counter = s.stripper.counter if s.stripper is not None else TokenCounter()
            else:  # not read: the stream's end comes from Envoy's access log
                stream_body = False
        elif decision is not None:
            # Not a stream: an engine sends a whole response's headers only once it is done (or
            # failed), so nothing more can change the request's load.
            self._release(s, ended_by_status(s.status))
        # Done unless a body comes: none follows an end_of_stream, nor a body this reply turns off
        # (mode NONE), except where Envoy does not take the override: in full duplex (every byte is
        # owed back) and on a stream that sends bodies without waiting for header replies (STREAMED
        # request bodies), where Envoy 1.40 sends the response body anyway. Ending the stream before
        # that body would make Envoy reset it.
        override_taken = s.response_mode != FULL_DUPLEX and not s.send_body_early
        s.done = headers.end_of_stream or (not stream_body and override_taken)
        if decision is None:  # tagged as the routing reply's metadata tags it, where a gateway reads that
            return messages.response_headers_reply(s.fallback, FALLBACK if s.fallback else "", stream_body=False)
        buffered = s.response_mode == BUFFERED
        served_by = decision.decode_instance_id or decision.instance_id
        return messages.response_headers_reply(served_by, decision.source, stream_body, buffered)

    def _on_response_body(self, s: _Stream, body: ep.HttpBody) -> ep.ProcessingResponse:
        s.done = body.end_of_stream
        counter = s.counter
        full_duplex = s.response_mode == FULL_DUPLEX
        if counter is None or s.decision is None or s.released:
            # not counted; full duplex still owes Envoy every byte back
            return (
                messages.streamed_response_body(body.body, body.end_of_stream)
                if full_duplex
                else (messages.CONTINUE_RESPONSE_BODY)
            )
        if self._first_token_only:
            return self._until_first_token(s, counter, body)
        stripper = s.stripper
        out = body.body
        if stripper is not None:
            out = stripper.feed(body.body)
            if body.end_of_stream:
                out += stripper.finish()
        else:
            counter.feed(body.body)
            if body.end_of_stream:
                counter.finish()
        if body.end_of_stream:
            self._release(s, ended_by_stream(counter))
        elif counter.tokens and s.decision.source == SCHEDULER:
            self._router.report(s.request_id, counter.tokens, prefill_done=True)
        if full_duplex:
            return messages.streamed_response_body(out, body.end_of_stream)
        if stripper is None or out == body.body:
            # the chunk passes unchanged (every chunk but the one with the usage event, or one an
            # event straddles): no body mutation for Envoy to apply
            return messages.CONTINUE_RESPONSE_BODY
        return messages.replace_response_body(out)

    def _until_first_token(self, s: _Stream, counter: TokenCounter, body: ep.HttpBody) -> ep.ProcessingResponse:
        """--response-bodies first-token: count up to the first token, report the prefill done, and
        remember what was read for the answer's estimate at the release (the access log's); then this
        stream ends with OK, and Envoy takes the server's close as nothing more to process for the rest
        of the response. In full duplex every byte is owed back, so the stream stays, uncounted."""
        counter.feed(body.body)
        full_duplex = s.response_mode == FULL_DUPLEX
        if body.end_of_stream:  # the whole stream came before (or with) its first token: its end is known here
            counter.finish()
            if not counter.done:  # cut short: the engine's failure, told from here
                self._release_instead_of_access_log(s, UPSTREAM_ERROR)
        if counter.tokens or body.end_of_stream:
            decision = s.decision
            assert decision is not None
            if decision.source == SCHEDULER and not s.released:  # (released from here above: nothing to add)
                if counter.tokens:
                    self._router.report(s.request_id, counter.tokens, prefill_done=True)
                self._answer_sizes.read(s.request_id, counter.complete_bytes, counter.events, counter.tokens)
            s.counter = None
            s.released = True  # the access log releases it
            s.done = body.end_of_stream or not full_duplex
            if s.done and not body.end_of_stream:
                self._metrics.first_token_ends.inc()
                if self._watching_access_log:
                    self._no_access_log_yet()
        if full_duplex:
            return messages.streamed_response_body(body.body, body.end_of_stream)
        return messages.CONTINUE_RESPONSE_BODY

    # -- the observing filter (--response-bodies observe) ---------------------------------------------

    def _observe(self, s: _Stream, kind: str | None, message: ep.ProcessingRequest) -> None:
        """A message of the filter that watches response bodies in observability mode: Envoy expects
        no reply and never waits, so counting costs it nothing per chunk. The request's id and who
        placed it come in the pilotfish metadata the routing filter wrote."""
        try:
            if kind == "response_body":
                counter, body = s.counter, message.response_body
                s.done = body.end_of_stream
                if counter is None or s.released or s.decision is None:
                    return
                counter.feed(body.body)
                if body.end_of_stream:
                    counter.finish()
                    self._release(s, ended_by_stream(counter))
                elif counter.tokens and s.decision.source == SCHEDULER:
                    self._router.report(s.request_id, counter.tokens, prefill_done=True)
            elif kind == "response_headers":
                self._observe_headers(s, message.response_headers, message.metadata_context)
        except Exception:
            self._metrics.gateway_errors.inc()
            log.exception("ext_proc failed observing request %s at %s", s.request_id or "?", kind)

    def _observe_headers(self, s: _Stream, headers: ep.HttpHeaders, metadata: base_pb2.Metadata) -> None:
        route = metadata.filter_metadata.get(messages.ROUTE_METADATA_NAMESPACE)
        if route is None or messages.ROUTE_REQUEST_ID_KEY not in route.fields:
            return  # not routed by this gateway (answered by it, or Envoy's own 404)
        s.observed = True
        s.request_id = route.fields[messages.ROUTE_REQUEST_ID_KEY].string_value
        source = (
            route.fields[messages.ROUTE_SOURCE_KEY].string_value if messages.ROUTE_SOURCE_KEY in route.fields else ""
        )
        s.decision = Decision("", "", source or FALLBACK)
        h = messages.header_map(headers)
        try:
            s.status = int(h.get(":status", "0"))
        except ValueError:
            s.status = 0
        if s.status == 200 and not headers.end_of_stream and h.get("content-type", "").startswith("text/event-stream"):
            s.counter = TokenCounter()
        else:  # a whole response: done
            s.done = True
            self._release(s, ended_by_status(s.status))

    # -- ends ------------------------------------------------------------------------------------

    def _release(self, s: _Stream, reason: int) -> None:
        s.released = True
        if s.counter is not None:
            self._metrics.generated_tokens.inc(s.counter.tokens)
            if s.counter.oversized:
                self._metrics.sse_oversized_events.inc(s.counter.oversized)
        # A round-robin fallback was never scheduled, so the scheduler holds nothing to release; with
        # response bodies skipped or read to the first token, the release comes from Envoy's access log instead.
        if s.decision is None or s.decision.source != SCHEDULER:
            return
        if self._count_tokens or s.observed:
            self._send_release(s.request_id, reason)
        elif self._access_log_releases and s.status == 0 and (
            not self._served_from_access_log or s.request_mode == BUFFERED
        ):
            # ended before any response reached this stream: Envoy may never have taken the routing reply. Not
            # with response bodies skipped and a streamed request body, whose stream Envoy closes right after the
            # routing reply (nothing more is owed it: Envoy's ext_proc_stream_close_optimization) while the
            # request runs on: its entry comes at its end, and a release here would drop its load early
            self._await_access_log(s.request_id, reason)

    def _release_instead_of_access_log(self, s: _Stream, reason: int) -> None:
        """Release with a reason the access log cannot tell (a 200 stream cut short), its entry then ignored."""
        s.released = True
        decision = s.decision
        if decision is None or decision.source != SCHEDULER:
            return
        self._send_release(s.request_id, reason)
        if self._access_log_releases:
            # its entry's release (a success) would end the engine's run of failures that this one adds to
            self._forget_entry(s.request_id)

    def _forget_entry(self, request_id: str) -> None:
        """The request was released from here: its access-log entry, when it comes, releases nothing."""
        self._released_here[request_id] = None
        while len(self._released_here) > _MAX_AWAITING_LOG:
            self._released_here.popitem(last=False)

    def _await_access_log(self, request_id: str, reason: int) -> None:
        """The stream ended unreleased: its access-log entry releases it if it comes within the wait, else this
        (see ACCESS_LOG_WAIT_S)."""
        if len(self._awaiting_log) >= _MAX_AWAITING_LOG:
            self._access_log_never_came(request_id, reason)
            return
        handle = asyncio.get_running_loop().call_later(
            self._access_log_wait_s, self._access_log_never_came, request_id, reason
        )
        self._awaiting_log[request_id] = handle

    def _access_log_never_came(self, request_id: str, reason: int) -> None:
        self._awaiting_log.pop(request_id, None)
        self._metrics.unlogged_releases.inc()
        self._forget_entry(request_id)  # one coming later releases nothing (a release here is the request's one)
        self._send_release(request_id, reason)

    def _no_access_log_yet(self) -> None:
        now = self._clock()
        if self._first_unlogged_end is None:
            self._first_unlogged_end = now
        elif now - self._first_unlogged_end >= _NO_ACCESS_LOG_AFTER:
            self._watching_access_log = False  # said once
            log.error(
                "--response-bodies first-token: streams have ended at their first token for %.0f s and no "
                "access-log entry has come; behind a gateway that sends this process no access log (only "
                "Pilotfish's sidecar does) nothing releases them: use --response-bodies count there",
                now - self._first_unlogged_end,
            )

    def release_from_access_log(
        self, request_id: str, reason: int, served_elsewhere: str = "", body_bytes: int = 0
    ) -> None:
        """Envoy finished a request the scheduler placed (access_log.py); the release path when
        response bodies are skipped or read to the first token only, ignored when the streams themselves
        release. `served_elsewhere`: the engine Envoy's retry served it on instead of the scheduler's pick,
        reported first where the response headers did not report it (the scheduler counts it against the engine
        it picked; the release then goes where it is held). `body_bytes`: the response body's size, which sizes
        the answer of a stream read to its first token."""
        if not self._access_log_releases:
            return
        self._watching_access_log = False
        if self._released_here.pop(request_id, 0) is None:  # (None: it was there)
            return
        awaiting = self._awaiting_log.pop(request_id, None)
        if awaiting is not None:  # its stream ended first: released here, not when the wait runs out
            awaiting.cancel()
        elif (live := self._live.pop(request_id, None)) is not None:
            live.released = True  # the entry came first: its stream's end releases nothing
        if served_elsewhere and self._served_from_access_log:
            self._metrics.served_elsewhere.inc()
            log.debug("request %s served by %s, not its pick", request_id, served_elsewhere)
            self._router.report(request_id, 0, False, served_address=served_elsewhere)
        answer_tokens = self._answer_sizes.estimate(request_id, body_bytes) if self._first_token_only else 0
        if answer_tokens:
            self._metrics.generated_tokens.inc(answer_tokens)
        self._send_release(request_id, reason, answer_tokens)

    def _send_release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        self._metrics.releases.labels(_REASON_LABELS[reason]).inc()
        self._router.release(request_id, reason, answer_tokens)

    def _reject(self, s: _Stream, exc: RequestError) -> ep.ProcessingResponse:
        s.rejected = True
        s.done = True  # Envoy sends nothing after an immediate response
        s.held = None
        self._metrics.rejected.labels(str(exc.status)).inc()
        return messages.immediate(exc.status, exc.body(), f"pilotfish_{exc.status}", exc.retry_after)

    def _failed(self, s: _Stream, kind: str | None, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """A bug met this request: it alone gets a clean answer, logged once, and the stream goes on."""
        self._metrics.gateway_errors.inc()
        log.exception("ext_proc failed on request %s at %s", s.request_id or "?", kind)
        if s.decision is not None and not s.released:
            self._release(s, GATEWAY_ERROR)
        s.counter = None  # stop counting: whatever comes next passes through untouched
        if kind in ("request_headers", "request_body", "request_trailers"):
            return [self._reject(s, _INTERNAL_ERROR)]
        if kind == "response_body" and s.response_mode == FULL_DUPLEX:
            body = message.response_body
            return [messages.streamed_response_body(body.body, body.end_of_stream)]
        if kind == "response_headers":
            return [messages.response_headers_reply("", "", stream_body=False)]
        if kind == "response_trailers":
            return [messages.CONTINUE_RESPONSE_TRAILERS]
        return [messages.CONTINUE_RESPONSE_BODY]
