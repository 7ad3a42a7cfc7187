"""The ext_proc replies Envoy acts on: routing headers, metadata, body replacement, errors."""

from envoy.config.core.v3 import base_pb2

from pilotfish.ext_proc import messages


def headers_of(mutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def test_header_and_metadata_carry_the_same_ordered_list_and_the_route_key_the_primary():
    reply = messages.route_on_body("10.0.0.1:8000", "rid", fallbacks=("10.0.0.2:8000", "10.0.0.3:8000"))
    common = reply.request_body.response
    assert common.clear_route_cache
    listed = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"
    assert headers_of(common.header_mutation) == {"x-gateway-destination-endpoint": listed, "x-request-id": "rid"}
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == listed
    route = reply.dynamic_metadata.fields["pilotfish"].struct_value
    assert route.fields["destination"].string_value == "10.0.0.1:8000"


def test_a_rewritten_body_carries_its_new_length():
    reply = messages.route_on_body("h:1", "rid", new_body=b'{"a": 1}')
    common = reply.request_body.response
    assert common.body_mutation.body == b'{"a": 1}'
    assert headers_of(common.header_mutation)["content-length"] == "8"


def test_immediate_response_is_json_with_status():
    reply = messages.immediate(429, b'{"x":1}', "shed")
    assert reply.immediate_response.status.code == 429
    assert reply.immediate_response.body == b'{"x":1}'
    assert headers_of(reply.immediate_response.headers) == {"content-type": "application/json"}


def test_served_endpoint_is_read_from_forwarded_metadata():
    metadata = base_pb2.Metadata()
    assert messages.served_endpoint(metadata) == ""
    metadata.filter_metadata["envoy.lb"].fields["x-gateway-destination-endpoint-served"].string_value = "h:2"
    assert messages.served_endpoint(metadata) == "h:2"


def test_non_sse_responses_turn_body_streaming_off():
    assert messages.response_headers_reply("i", "scheduler", stream_body=False).HasField("mode_override")
    assert not messages.response_headers_reply("i", "scheduler", stream_body=True).HasField("mode_override")
