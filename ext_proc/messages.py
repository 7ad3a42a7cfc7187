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
# Pilotfish's own Envoy config routes on this (ORIGINAL_DST metadata_key): the primary alone, in a
# namespace only the ext_proc writes, so no client header can ever take part in routing.
ROUTE_METADATA_NAMESPACE = "pilotfish"
ROUTE_METADATA_KEY = "destination"
# Who chose the engine (scheduler or fallback), for Envoy's access log: only the scheduler's picks
# are released from it (access_log.py).
ROUTE_SOURCE_KEY = "source"
# The gateway's request id, for the filter that observes response bodies (--response-bodies observe).
ROUTE_REQUEST_ID_KEY = "request_id"
# The instance the scheduler named: envoy/sidecar.yaml tags each response with it (x-pilotfish-instance)
# and with the source (x-pilotfish-route) from this metadata, so no response message needs to reach the
# ext_proc for them.
ROUTE_INSTANCE_KEY = "instance"
# The gateway's subset hint: the pick must come from these endpoints.
SUBSET_METADATA_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_METADATA_KEY = "x-gateway-destination-endpoint-subset"
# llm-d's prefill/decode convention: the decode engine's side reads its prefill engine here.
PREFILL_HEADER = "x-prefiller-host-port"
MAX_SUBSET_ENTRIES = 4096
MAX_ADDRESS_CHARS = 262  # "[" + IPv6 with zone + "]:" + port, with room; longer is not an address
MAX_UINT32 = 2**32 - 1
REQUEST_ID_HEADER = "x-request-id"
# Added to responses so a client (and the end-to-end tests) can see who chose the engine.
INSTANCE_HEADER = "x-pilotfish-instance"
ROUTE_SOURCE_HEADER = "x-pilotfish-route"

_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD

CONTINUE_REQUEST_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse()))
CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse()))
CONTINUE_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))
CONTINUE_REQUEST_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
# STREAMED request bodies without send_body_without_waiting_for_header_response: Envoy sends no
# body before this reply, so the reply asks for the whole body at once (honoured where the filter
# has allow_mode_override).
CONTINUE_REQUEST_HEADERS_BUFFER_BODY = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(response=ep.CommonResponse()),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED),
)


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Envoy sends values in `raw_value` (bytes); older builds used `value`."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _set_headers(pairs: list[tuple[str, str]], remove: tuple[str, ...] = ()) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in pairs
        ],
        remove_headers=remove,
    )


def _routing_mutation(
    address: str, request_id: str, fallbacks: tuple[str, ...], content_length: int | None, prefill: str
) -> ep.HeaderMutation:
    """The routing headers. The engine side reads x-prefiller-host-port, so the picker owns it: set for
    a prefill/decode pair, removed otherwise, whatever the client sent (as llm-d's picker does)."""
    headers = [(DESTINATION_HEADER, destination_list(address, fallbacks)), (REQUEST_ID_HEADER, request_id)]
    if content_length is not None:
        headers.append(("content-length", str(content_length)))
    if prefill:
        headers.append((PREFILL_HEADER, prefill))
    return _set_headers(headers, () if prefill else (PREFILL_HEADER,))


def destination_list(address: str, fallbacks: tuple[str, ...] = ()) -> str:
    """The endpoint-picker protocol's destination value: primary first, then the fallbacks in order.
    Header and envoy.lb metadata carry the same value, as the protocol requires."""
    return ",".join((address, *fallbacks)) if fallbacks else address


def _destination_metadata(
    address: str, fallbacks: tuple[str, ...] = (), source: str = "", request_id: str = "", instance: str = ""
) -> struct_pb2.Struct:
    """envoy.lb metadata (the Inference Extension's), and Pilotfish's own route key: the primary alone.

    The top-level key of dynamic_metadata is the namespace Envoy files it under.
    """
    metadata = struct_pb2.Struct()
    ns = metadata.fields[DESTINATION_METADATA_NAMESPACE].struct_value  # field by field: 4x cheaper than update()
    ns.fields[DESTINATION_HEADER].string_value = destination_list(address, fallbacks)
    route = metadata.fields[ROUTE_METADATA_NAMESPACE].struct_value
    route.fields[ROUTE_METADATA_KEY].string_value = address
    if source:
        route.fields[ROUTE_SOURCE_KEY].string_value = source
    if request_id:
        route.fields[ROUTE_REQUEST_ID_KEY].string_value = request_id
    if instance:
        route.fields[ROUTE_INSTANCE_KEY].string_value = instance
    return metadata


def served_endpoint(metadata: base_pb2.Metadata) -> str:
    """The endpoint that actually served the request, when the gateway reports one."""
    namespace = metadata.filter_metadata.get(DESTINATION_METADATA_NAMESPACE)
    if namespace is None or SERVED_METADATA_KEY not in namespace.fields:
        return ""
    return namespace.fields[SERVED_METADATA_KEY].string_value[:MAX_ADDRESS_CHARS]


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The gateway's subset hint: the endpoints the pick must come from; None when there is none.

    The protocol's value is a list of "ip:port" strings; a comma-separated string is read too.
    An entry without a port stands for every engine at that IP. Bounded: the first
    MAX_SUBSET_ENTRIES entries of at most MAX_ADDRESS_CHARS each; anything else is skipped, so a
    hint of nothing usable is an empty subset (and the request gets 503).
    """
    namespace = metadata.filter_metadata.get(SUBSET_METADATA_NAMESPACE)
    if namespace is None or SUBSET_METADATA_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_METADATA_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values[:MAX_SUBSET_ENTRIES] if v.HasField("string_value")]
    elif kind == "string_value":
        entries = value.string_value[: MAX_SUBSET_ENTRIES * MAX_ADDRESS_CHARS].split(",")[:MAX_SUBSET_ENTRIES]
    else:
        entries = []
    return frozenset(e.strip() for e in entries if 0 < len(e.strip()) <= MAX_ADDRESS_CHARS)


def route_on_headers(
    address: str,
    request_id: str,
    fallbacks: tuple[str, ...] = (),
    *,
    content_length: int | None = None,
    prefill: str = "",
    source: str = "",
    instance: str = "",
) -> ep.ProcessingResponse:
    """Route by answering the request headers: a bodiless request, or a streamed one whose headers
    reply was held back until its body was read (`content_length` when the body was rewritten)."""
    common = ep.CommonResponse(
        header_mutation=_routing_mutation(address, request_id, fallbacks, content_length, prefill),
        clear_route_cache=True,
    )
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=common),
        dynamic_metadata=_destination_metadata(address, fallbacks, source, request_id, instance),
    )


def _streamed(body: bytes, end_of_stream: bool) -> ep.BodyResponse:
    mutation = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))
    return ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))


def streamed_request_body(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: Envoy drained the chunks it sent us; this is the body the upstream gets."""
    return ep.ProcessingResponse(request_body=_streamed(body, end_of_stream))


def streamed_response_body(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED responses: each chunk Envoy sent us, passed on (or its replacement)."""
    return ep.ProcessingResponse(response_body=_streamed(body, end_of_stream))


def replace_request_body(body: bytes) -> ep.ProcessingResponse:
    """STREAMED request bodies: this chunk becomes `body` (empty: dropped)."""
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=body)))
    )


def route_on_body(
    address: str,
    request_id: str,
    new_body: bytes | None = None,
    fallbacks: tuple[str, ...] = (),
    prefill: str = "",
    source: str = "",
    instance: str = "",
) -> ep.ProcessingResponse:
    """Route a request after its buffered body was read: the header mutation rides on the body reply."""
    content_length = None if new_body is None else len(new_body)
    common = ep.CommonResponse(
        header_mutation=_routing_mutation(address, request_id, fallbacks, content_length, prefill),
        clear_route_cache=True,
    )
    if new_body is not None:
        common.body_mutation.body = new_body
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=common),
        dynamic_metadata=_destination_metadata(address, fallbacks, source, request_id, instance),
    )


def replace_response_body(body: bytes) -> ep.ProcessingResponse:
    """Pass on `body` instead of the chunk Envoy sent (usage stripping)."""
    return ep.ProcessingResponse(
        response_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=body)))
    )


def immediate(status: int, body: bytes, details: str, retry_after: int = 0) -> ep.ProcessingResponse:
    """Answer the client directly; the request never reaches an engine. `retry_after` (seconds)
    goes out as Retry-After, on a 429 or 503 the client may retry."""
    headers = [("content-type", "application/json")]
    if retry_after:
        headers.append(("retry-after", str(retry_after)))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_set_headers(headers),
            body=body,
            details=details,
        )
    )


@lru_cache(maxsize=4096)  # a handful of engines x two sources x three modes; replies are never mutated
def response_headers_reply(
    instance_id: str, source: str, stream_body: bool, buffered: bool = False
) -> ep.ProcessingResponse:
    """Tag the response with the routing decision; stop body streaming unless it is SSE.

    `buffered`: the filter buffers response bodies, which would hold every token of a stream until
    its end; a stream asks for STREAMED instead (honoured where the filter allows mode overrides;
    elsewhere the whole stream is counted at its end).
    """
    if instance_id or source:
        reply = ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(
                    header_mutation=_set_headers([(INSTANCE_HEADER, instance_id), (ROUTE_SOURCE_HEADER, source)])
                )
            )
        )
    else:  # nothing to say: whatever the gateway's route set stays (an empty value would overwrite it)
        reply = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
    if not stream_body:
        reply.mode_override.CopyFrom(
            processing_mode_pb2.ProcessingMode(response_body_mode=processing_mode_pb2.ProcessingMode.NONE)
        )
    elif buffered:
        reply.mode_override.CopyFrom(
            processing_mode_pb2.ProcessingMode(response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED)
        )
    return reply
