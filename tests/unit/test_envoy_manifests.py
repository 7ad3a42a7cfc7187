"""The shipped Envoy and Gateway API configs parse, agree with each other, and use real flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pilotfish.cli import build_parser
from pilotfish.envoy_bootstrap import render_sidecar

GATEWAY_API = Path(__file__).resolve().parents[2] / "envoy" / "gateway-api"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((GATEWAY_API / name).read_text()) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_inference_pool_points_at_the_pilotfish_picker():
    docs = documents("inferencepool.yaml")
    (pool,) = by_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"]
    assert all(isinstance(p["number"], int) for p in spec["targetPorts"])
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"  # a picker down must not let a client's header route
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    picker = services[ref["name"]]
    assert ref["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    (route,) = by_kind(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]


def test_the_picker_service_fronts_the_picker_of_the_kubernetes_deployment():
    """The gateway's objects carry no Deployment of their own: the picker is deploy/k8s's, which
    serves TLS (its tests start it from those args); this Service must reach it."""
    docs = documents("inferencepool.yaml")
    assert not by_kind(docs, "Deployment")
    (service,) = by_kind(docs, "Service")
    k8s = [d for d in yaml.safe_load_all((GATEWAY_API.parents[1] / "deploy/k8s/base/picker.yaml").read_text()) if d]
    (picker,) = [d for d in k8s if d["kind"] == "Deployment"]
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    args, unknown = build_parser().parse_known_args(container["args"])
    assert not unknown and args.tls_cert_file  # TLS toward the gateway
    assert service["spec"]["ports"][0]["targetPort"] == args.port
    assert service["spec"]["ports"][0]["appProtocol"] == "http2"


def test_envoy_gateway_policy_buffers_requests_streams_responses_sends_the_address_and_fails_closed():
    docs = documents("envoy-gateway-extension-policy.yaml")
    (policy,) = by_kind(docs, "EnvoyExtensionPolicy")
    ext_proc = policy["spec"]["extProc"][0]
    assert ext_proc["processingMode"]["request"]["body"] == "Buffered"
    # the client's address, which flow control groups fair shares by (ext_proc/flow.py)
    assert ext_proc["processingMode"]["request"]["attributes"] == ["source.address"]
    assert ext_proc["processingMode"]["response"]["body"] == "Streamed"
    assert ext_proc["backendRefs"][0]["name"] == "pilotfish-epp"
    assert ext_proc["failOpen"] is False


def test_envoy_gateway_strips_every_picker_header_before_routing():
    from pilotfish.ext_proc import messages

    (policy,) = by_kind(documents("envoy-gateway-extension-policy.yaml"), "ClientTrafficPolicy")
    removed = set(policy["spec"]["headers"]["earlyRequestHeaders"]["remove"])
    picker_headers = {
        messages.DESTINATION_HEADER,
        messages.SUBSET_METADATA_KEY,
        messages.SERVED_METADATA_KEY,
        messages.PREFILL_HEADER,
        messages.INSTANCE_HEADER,
        messages.ROUTE_SOURCE_HEADER,
    }
    assert picker_headers <= removed


def test_sidecar_bootstrap_renders_to_valid_yaml():
    config = yaml.safe_load(
        render_sidecar(listen_port=1, admin_port=2, ext_proc_ports=[3, 4], default_endpoints=[("127.0.0.1", 5)])
    )
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    ext_proc = clusters["pilotfish_ext_proc"]
    assert "http2_protocol_options" in str(ext_proc["typed_extension_protocol_options"])
    assert len(ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    picked = clusters["picked_endpoint"]
    assert picked["type"] == "ORIGINAL_DST"
    # the address comes from the metadata only the ext_proc writes, never from a header
    assert picked["original_dst_lb_config"] == {"metadata_key": {"key": "pilotfish", "path": [{"key": "destination"}]}}
    # Envoy keeps a cached gRPC client a day, not its default 50 s (the access log's open stream to the
    # ext_proc crashed Envoy 1.40 about a minute after start: bench/RESULTS.md, 2026-11-28)
    assert config["grpc_async_client_manager_config"] == {"max_cached_entry_idle_duration": "86400s"}


def _hcm_and_ext_proc(text: str) -> tuple[dict, dict]:
    listener = yaml.safe_load(text)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    return hcm, ext_proc["typed_config"]


def test_the_client_listener_bounds_streams_windows_and_the_time_to_send_headers():
    """Envoy's edge settings on the listener clients reach: 100 streams and 64 KiB of window per HTTP/2
    connection (its defaults: 2^31-1 streams), and 10 s to send the request headers (a client sending a byte a
    second got 408 at 10 s on `pilotfish up`, against a connection held for good)."""
    text = render_sidecar(listen_port=1, admin_port=2, ext_proc_ports=[3], default_endpoints=[("127.0.0.1", 5)])
    hcm, _ = _hcm_and_ext_proc(text)
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == 100
    assert hcm["http2_protocol_options"]["initial_stream_window_size"] == 65536
    assert hcm["request_headers_timeout"] == "10s"


@pytest.mark.parametrize(
    ("response_body_mode", "observe", "header_mode", "access_log"),
    [("NONE", False, "SKIP", True), ("STREAMED", False, "SEND", False), ("NONE", True, "SEND", False)],
)
def test_skipped_response_bodies_send_the_ext_proc_no_response_message(
    response_body_mode: str, observe: bool, header_mode: str, access_log: bool
) -> None:
    """Response bodies skipped (full mode): releases come from the access log, and the response's
    headers are not sent either; the instance and route tags come from the routing metadata."""
    from pilotfish.ext_proc import messages

    hcm, ext_proc = _hcm_and_ext_proc(
        render_sidecar(
            listen_port=1,
            admin_port=2,
            ext_proc_ports=[3],
            default_endpoints=[("127.0.0.1", 5)],
            response_body_mode=response_body_mode,
            observe_response_bodies=observe,
        )
    )
    assert ext_proc["processing_mode"]["response_header_mode"] == header_mode
    assert bool(hcm["access_log"]) == access_log
    for logger in hcm["access_log"]:
        # each entry is sent as its request ends (no batch to wait for); the timer is only a backstop,
        # since a short one wakes every Envoy thread whether or not anything is buffered
        common = logger["typed_config"]["common_config"]
        assert common["buffer_size_bytes"] == 0
        assert float(common["buffer_flush_interval"].rstrip("s")) >= 1.0
    tags = {
        h["header"]["key"]: h["header"]["value"]
        for h in hcm["route_config"]["virtual_hosts"][0]["response_headers_to_add"]
    }
    namespace, key = messages.ROUTE_METADATA_NAMESPACE, messages.ROUTE_INSTANCE_KEY
    assert tags == {
        messages.INSTANCE_HEADER: f"%DYNAMIC_METADATA({namespace}:{key})%",
        messages.ROUTE_SOURCE_HEADER: f"%DYNAMIC_METADATA({namespace}:{messages.ROUTE_SOURCE_KEY})%",
    }
