"""The gateway's part of a trace (pilotfish/tracing.py): a span per scheduled request.

With tracing on, the processor (processor.py) keeps a `Trace` per stream from the request headers
(`traceparent`/`tracestate`, which envoy/sidecar.yaml forwards to the ext_proc). Around the Schedule
call it opens `pilotfish.ext_proc.schedule`, a child of the client's context (a new trace when the
client sent none), puts that span's context in ScheduleRequest.traceparent for the scheduler, and
records the decision on it (`pilotfish.engine`, `pilotfish.engine.address`, `pilotfish.route`:
scheduler or fallback). The routing reply then sets `traceparent` (and the client's `tracestate`)
on the upstream request, so the engine's span is a child of the gateway's.

With tracing off, `incoming` answers None and every other helper returns at its first line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from envoy.config.core.v3 import base_pb2

from pilotfish.ext_proc.messages import DESTINATION_HEADER
from pilotfish.tracing import enabled, parent_context, traceparent_of, tracer

if TYPE_CHECKING:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from pilotfish.ext_proc.routing import Decision
    from pilotfish.protos import scheduler_pb2

SPAN = "pilotfish.ext_proc.schedule"
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


class Trace:
    """One request's trace context: what the client sent, and what goes upstream."""

    __slots__ = ("incoming", "outgoing", "stamped", "tracestate")

    def __init__(self, incoming: str, tracestate: str) -> None:
        self.incoming = incoming
        self.tracestate = tracestate
        self.outgoing = ""  # the gateway span's traceparent, once it exists
        self.stamped = False


def incoming(headers: dict[str, str]) -> Trace | None:
    """The request's trace context from its headers; None when this process does not trace."""
    if not enabled():
        return None
    return Trace(headers.get("traceparent", ""), headers.get("tracestate", ""))


@contextlib.contextmanager
def schedule_span(trace: Trace | None, request: scheduler_pb2.ScheduleRequest) -> Iterator[Any]:
    """The gateway's span around one Schedule; sets request.traceparent. Yields None when not tracing."""
    t = tracer("pilotfish.ext_proc") if trace is not None else None
    if t is None or trace is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    context = parent_context(trace.incoming, trace.tracestate)
    with t.start_as_current_span(SPAN, context=context, kind=SpanKind.SERVER) as span:
        trace.outgoing = request.traceparent = traceparent_of(span)
        span.set_attribute("pilotfish.request_id", request.request_id)
        span.set_attribute("pilotfish.model", request.model)
        span.set_attribute("pilotfish.prompt_tokens", request.prompt_tokens)
        yield span


def decided(span: Any, decision: Decision | None) -> None:
    """Record the decision on the gateway's span."""
    if span is None or decision is None:
        return
    span.set_attribute("pilotfish.engine", decision.instance_id)
    span.set_attribute("pilotfish.engine.address", decision.decode_address or decision.address)
    span.set_attribute("pilotfish.route", decision.source)
    span.set_attribute("pilotfish.fallbacks", list(decision.fallbacks))


def stamp(replies: Iterable[ep.ProcessingResponse], trace: Trace | None) -> None:
    """Add `traceparent` (and `tracestate`) to the routing reply's header mutation, once per request."""
    if trace is None or not trace.outgoing or trace.stamped:
        return
    for reply in replies:
        which = reply.WhichOneof("response")
        if which not in ("request_headers", "request_body"):
            continue
        mutation = getattr(reply, which).response.header_mutation
        if not any(h.header.key == DESTINATION_HEADER for h in mutation.set_headers):
            continue  # not the routing reply
        pairs = [("traceparent", trace.outgoing)] + ([("tracestate", trace.tracestate)] if trace.tracestate else [])
        for key, value in pairs:
            mutation.set_headers.append(
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
                )
            )
        trace.stamped = True
        return
