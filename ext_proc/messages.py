"""Building and reading Envoy ext_proc messages (xds-protos), kept apart from the routing logic."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

# The Gateway API Inference Extension's names, so Pilotfish is a drop-in endpoint picker.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
# Set by gateways that retry on a fallback endpoint, read back from the forwarded envoy.lb metadata.
SERVED_METADATA_KEY = "x-gateway-destination-endpoint-served"
REQUEST_ID_HEADER = "x-request-id"
# Added to responses so a client (and the end-to-end tests) can see who chose the engine.
INSTANCE_HEADER = "x-pilotfish-instance"
ROUTE_SOURCE_HEADER = "x-pilotfish-route"

_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD

CONTINUE_REQUEST_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse()))
CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse()))
CONTINUE_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Envoy sends values in `raw_value` (bytes); older builds used `value`."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _set_headers(pairs: list[tuple[str, str]]) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in pairs
        ]
    )


def _destination_metadata(address: str, fallbacks: tuple[str, ...] = ()) -> struct_pb2.Struct:
    """envoy.lb metadata: the endpoint list, primary first (the Inference Extension's format).

    The top-level key of dynamic_metadata is the namespace Envoy files it under; the header
    carries the primary alone, since ORIGINAL_DST reads a single address.
    """
    metadata = struct_pb2.Struct()
    ns = metadata.fields[DESTINATION_METADATA_NAMESPACE].struct_value  # field by field: 4x cheaper than update()
    ns.fields[DESTINATION_HEADER].string_value = ",".join((address, *fallbacks)) if fallbacks else address
    return metadata


def served_endpoint(metadata: base_pb2.Metadata) -> str:
    """The endpoint that actually served the request, when the gateway reports one."""
    namespace = metadata.filter_metadata.get(DESTINATION_METADATA_NAMESPACE)
    if namespace is None or SERVED_METADATA_KEY not in namespace.fields:
        return ""
    return namespace.fields[SERVED_METADATA_KEY].string_value


def route_on_headers(address: str, request_id: str, fallbacks: tuple[str, ...] = ()) -> ep.ProcessingResponse:
    """Route by answering the request headers: a bodiless request, or a FULL_DUPLEX_STREAMED one whose
    headers reply was held back until its body was read."""
    common = ep.CommonResponse(
        header_mutation=_set_headers([(DESTINATION_HEADER, address), (REQUEST_ID_HEADER, request_id)]),
        clear_route_cache=True,
    )
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=common),
        dynamic_metadata=_destination_metadata(address, fallbacks),
    )


def streamed_request_body(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: Envoy drained the chunks it sent us; this is the body the upstream gets."""
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
                )
            )
        )
    )


def route_on_body(
    address: str, request_id: str | None, new_body: bytes | None = None, fallbacks: tuple[str, ...] = ()
) -> ep.ProcessingResponse:
    """Route a request after its buffered body was read: the header mutation rides on the body reply.

    `request_id` None: the request already carries its x-request-id (Envoy's or the client's), so
    nothing in the reply is per request and the common case comes from a cache.
    """
    if request_id is None and new_body is None:
        return _cached_route_on_body(address, fallbacks)
    return _route_on_body(address, request_id, new_body, fallbacks)


# Bounded by the engines x their fallback lists; cached replies are shared, never mutated.
@lru_cache(maxsize=4096)
def _cached_route_on_body(address: str, fallbacks: tuple[str, ...]) -> ep.ProcessingResponse:
    return _route_on_body(address, None, None, fallbacks)


def _route_on_body(
    address: str, request_id: str | None, new_body: bytes | None, fallbacks: tuple[str, ...]
) -> ep.ProcessingResponse:
    headers = [(DESTINATION_HEADER, address)]
    if request_id is not None:
        headers.append((REQUEST_ID_HEADER, request_id))
    if new_body is not None:
        headers.append(("content-length", str(len(new_body))))
    common = ep.CommonResponse(header_mutation=_set_headers(headers), clear_route_cache=True)
    if new_body is not None:
        common.body_mutation.body = new_body
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=common), dynamic_metadata=_destination_metadata(address, fallbacks)
    )


def replace_response_body(body: bytes) -> ep.ProcessingResponse:
    """Pass on `body` instead of the chunk Envoy sent (usage stripping)."""
    return ep.ProcessingResponse(
        response_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=body)))
    )


def immediate(status: int, body: bytes, details: str) -> ep.ProcessingResponse:
    """Answer the client directly; the request never reaches an engine."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_set_headers([("content-type", "application/json")]),
            body=body,
            details=details,
        )
    )


@lru_cache(maxsize=4096)  # a handful of engines x two sources x two modes; replies are never mutated
def response_headers_reply(instance_id: str, source: str, stream_body: bool) -> ep.ProcessingResponse:
    """Tag the response with the routing decision; stop body streaming unless it is SSE."""
    reply = ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=_set_headers([(INSTANCE_HEADER, instance_id), (ROUTE_SOURCE_HEADER, source)])
            )
        )
    )
    if not stream_body:
        reply.mode_override.CopyFrom(
            processing_mode_pb2.ProcessingMode(response_body_mode=processing_mode_pb2.ProcessingMode.NONE)
        )
    return reply
