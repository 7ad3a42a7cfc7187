"""Release from Envoy's access log: the end of each request as Envoy saw it.

When the gateway does not read response bodies (full mode: the llumlets count tokens), the ext_proc
stream of a request ends with its response headers, long before the response does, so it cannot
say when the request ended. Envoy's gRPC access log can: one entry per request once it is over,
sent on one stream as the request ends (the sidecar asks for no batching, though a message may
hold several entries), with the flags that say how it ended (the client went away, the engine
reset, no connection). The entry carries the gateway's request id (the
x-request-id the ext_proc set) and the `pilotfish` metadata the ext_proc wrote, so only requests
the scheduler placed are released, each exactly once (Envoy logs a request once). It also says
where the request was served (`envoy.lb`), so a retry on a fallback engine is reported as served
elsewhere, just before the release: no response message reaches the ext_proc in this mode.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from pilotfish.ext_proc.messages import (
    DESTINATION_METADATA_NAMESPACE,
    MAX_ADDRESS_CHARS,
    PREFILL_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_METADATA_KEY,
    ROUTE_METADATA_NAMESPACE,
    ROUTE_SOURCE_KEY,
    SERVED_METADATA_KEY,
)
from pilotfish.ext_proc.routing import SCHEDULER
from pilotfish.protos import scheduler_pb2

log = logging.getLogger(__name__)

FINISHED = scheduler_pb2.RELEASE_REASON_FINISHED
CLIENT_ABORT = scheduler_pb2.RELEASE_REASON_CLIENT_ABORT
UPSTREAM_ERROR = scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR
UPSTREAM_RESET = scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET
GATEWAY_ERROR = scheduler_pb2.RELEASE_REASON_GATEWAY_ERROR

_CLIENT_GONE = ("downstream_connection_termination", "downstream_remote_reset", "stream_idle_timeout")
_FROM_UPSTREAM = "via_upstream"  # response_code_details of a response the upstream sent
# an engine's own 429: overloaded or rate-limited, its failure as a 5xx is (where its origin is unknown, on the
# ext_proc stream, neither: processor.py REFUSED)
_ENGINE_REFUSED = 429
_NO_UPSTREAM = ("upstream_connection_failure", "no_healthy_upstream", "upstream_overflow", "upstream_request_timeout")


def release_reason(entry: accesslog_pb2.HTTPAccessLogEntry) -> int:
    """How the request ended, from the entry's response flags, status and its details.

    A 5xx (or a 429) is the engine's failure only where the engine answered it (`via_upstream`) or a flag says the
    upstream failed. Envoy's own 5xx otherwise is the gateway's: a client can provoke one at will (a
    request whose headers fill Envoy's limit fails the routing reply's header mutation, after the
    scheduler placed it), and counted against the engine it would eject healthy engines."""
    flags = entry.common_properties.response_flags
    if any(getattr(flags, name) for name in _CLIENT_GONE):
        return CLIENT_ABORT
    if flags.upstream_remote_reset or flags.upstream_connection_termination:
        return UPSTREAM_RESET
    if any(getattr(flags, name) for name in _NO_UPSTREAM):
        return UPSTREAM_ERROR
    status, from_upstream = entry.response.response_code.value, entry.response.response_code_details == _FROM_UPSTREAM
    if status >= 500 or status == _ENGINE_REFUSED:
        return UPSTREAM_ERROR if from_upstream else GATEWAY_ERROR
    if status == 200 and from_upstream and not entry.response.response_body_bytes:
        # every answer to a completion has a body (a stream ends in `data: [DONE]`): an empty 200 is the engine
        # failing fast, which released as finished made it look idle and healthy (the only sign of it where the
        # gateway reads no response body, in full mode)
        return UPSTREAM_ERROR
    return FINISHED


def placed_by_scheduler(entry: accesslog_pb2.HTTPAccessLogEntry) -> bool:
    """The ext_proc wrote pilotfish.source = scheduler: the scheduler holds this request."""
    ns = entry.common_properties.metadata.filter_metadata.get(ROUTE_METADATA_NAMESPACE)
    if ns is None or ROUTE_SOURCE_KEY not in ns.fields:
        return False
    return ns.fields[ROUTE_SOURCE_KEY].string_value == SCHEDULER


def served_elsewhere(entry: accesslog_pb2.HTTPAccessLogEntry) -> str:
    """The engine that served the request when Envoy retried it away from the one the scheduler picked
    (the override_host policy's served key against the ext_proc's destination); "" otherwise, and for
    a prefill/decode pair, whose decode engine has no fallback to retry on."""
    metadata = entry.common_properties.metadata.filter_metadata
    lb, route = metadata.get(DESTINATION_METADATA_NAMESPACE), metadata.get(ROUTE_METADATA_NAMESPACE)
    if lb is None or route is None or SERVED_METADATA_KEY not in lb.fields or ROUTE_METADATA_KEY not in route.fields:
        return ""
    if PREFILL_HEADER in entry.request.request_headers:
        return ""
    served = lb.fields[SERVED_METADATA_KEY].string_value[:MAX_ADDRESS_CHARS]
    return served if served != route.fields[ROUTE_METADATA_KEY].string_value else ""


class AccessLogReleaser(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's AccessLogService: each finished request the scheduler placed is released once, after
    a served-elsewhere report where Envoy retried it on another engine."""

    def __init__(self, release: Callable[[str, int, str, int], None]) -> None:
        self._release = release
        self.streams = 0  # Envoy's open access-log streams; >0 means releases come from here

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        self.streams += 1
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    self.entry(entry)
        finally:
            self.streams -= 1
        return als_pb2.StreamAccessLogsResponse()

    def entry(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        if entry.common_properties.intermediate_log_entry or not placed_by_scheduler(entry):
            return
        request_id = entry.request.request_headers.get(REQUEST_ID_HEADER, "")
        if request_id:
            self._release(
                request_id, release_reason(entry), served_elsewhere(entry), entry.response.response_body_bytes
            )
