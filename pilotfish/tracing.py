"""OpenTelemetry tracing, optional at run time: the W3C trace context across Pilotfish's components.

Off unless a process is given `--otlp-endpoint URL` (every `pilotfish` subcommand takes it) and the
`opentelemetry-sdk` package is installed (`pip install pilotfish[tracing]`); otherwise every
helper here is a no-op that costs one global read. With it, spans go in batches over OTLP/gRPC
(`opentelemetry-exporter-otlp-proto-grpc`) to that endpoint, service name `pilotfish-<command>`.

The trace a client starts (its `traceparent` header) continues through the gateway (ext_proc span,
ext_proc/tracing.py), the scheduler (one span per Schedule with its decision, scheduler/tracing.py:
the context travels in ScheduleRequest.traceparent) and the engine (the upstream request carries
the gateway span's `traceparent`; the simulator makes a span of it, vLLM does with its own
`--otlp-traces-endpoint`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

ENV = "PILOTFISH_OTLP_ENDPOINT"  # the flag's default; `pilotfish up` hands its own to its children

# one tracer provider per process; None: tracing is off
_provider: Any = None
_tracers: dict[str, Any] = {}

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    return _provider is not None


def configure_tracing(endpoint: str = "", service: str = "pilotfish", exporter: Any = None) -> bool:
    """Start tracing to `endpoint` (OTLP/gRPC), or into `exporter` (a SpanExporter; tests pass an
    in-memory one, exported synchronously). False, and tracing stays off, without either or without
    the SDK (a WARNING says so when an endpoint was asked for)."""
    global _provider
    if not endpoint and exporter is None:
        return False
    if not available():
        log.warning("--otlp-endpoint %s: opentelemetry-sdk is not installed (pip install pilotfish[tracing]); "
                    "no traces", endpoint)  # fmt: skip
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("--otlp-endpoint %s: opentelemetry-exporter-otlp-proto-grpc is not installed; no traces",
                        endpoint)  # fmt: skip
            return False
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    shutdown_tracing()
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Flush and stop; tracing is off afterwards."""
    global _provider
    provider, _provider = _provider, None
    _tracers.clear()
    if provider is not None:
        provider.shutdown()


def tracer(name: str) -> Any:
    """The tracer for instrumentation `name`, or None when tracing is off."""
    if _provider is None:
        return None
    t = _tracers.get(name)
    if t is None:
        t = _tracers[name] = _provider.get_tracer(name)
    return t


def parent_context(traceparent: str, tracestate: str = "") -> Any:
    """The OpenTelemetry context a W3C `traceparent` names (None when it is empty or malformed)."""
    if not traceparent or not _TRACEPARENT.match(traceparent.strip().lower()):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent.strip().lower()}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent_of(span: Any) -> str:
    """The W3C `traceparent` that makes `span` the parent of what comes next ("" when not recording)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the span current in this context, for log records; None outside one."""
    if _provider is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


@contextlib.contextmanager
def server_span(instrumentation: str, name: str, traceparent: str = "", tracestate: str = "",
                **attributes: Any) -> Iterator[Any]:  # fmt: skip
    """A SERVER span continuing `traceparent` (a new trace without one); yields None when not tracing."""
    t = tracer(instrumentation)
    if t is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    context = parent_context(traceparent, tracestate)
    with t.start_as_current_span(name, context=context, kind=SpanKind.SERVER, attributes=attributes) as span:
        yield span
