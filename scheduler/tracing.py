"""The scheduler's span per Schedule, continuing the gateway's trace (pilotfish/tracing.py).

Off (one global read, then the core) unless the process traces. The span is
`pilotfish.scheduler.schedule`, child of the context in ScheduleRequest.traceparent, with the
decision as attributes: `pilotfish.engine` and `pilotfish.engine.address` (the target),
`pilotfish.fallbacks`, `pilotfish.decode_engine` (prefill/decode pairs), the request's id, model and
prompt tokens; a refusal (no instance, a bound) ends it with an error status and the exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pilotfish.tracing import parent_context, tracer

if TYPE_CHECKING:
    from pilotfish.scheduler.core import Decision
    from pilotfish.scheduler.view.types import RequestInfo

SPAN = "pilotfish.scheduler.schedule"


def schedule_traced(schedule: Callable[[RequestInfo], Decision], req: RequestInfo, traceparent: str) -> Decision:
    t = tracer("pilotfish.scheduler")
    if t is None:
        return schedule(req)
    from opentelemetry.trace import SpanKind

    with t.start_as_current_span(SPAN, context=parent_context(traceparent), kind=SpanKind.SERVER) as span:
        span.set_attribute("pilotfish.request_id", req.request_id)
        span.set_attribute("pilotfish.model", req.model)
        span.set_attribute("pilotfish.prompt_tokens", req.prompt_tokens)
        decision = schedule(req)
        span.set_attribute("pilotfish.engine", decision.target.instance_id)
        span.set_attribute("pilotfish.engine.address", decision.target.address)
        span.set_attribute("pilotfish.fallbacks", [e.instance_id for e in decision.fallbacks])
        if decision.decode_target is not None:
            span.set_attribute("pilotfish.decode_engine", decision.decode_target.instance_id)
        return decision
