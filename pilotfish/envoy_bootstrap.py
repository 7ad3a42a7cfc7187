"""Render envoy/sidecar.yaml for given ports: the one place the gateway's Envoy config is filled in."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from string import Template
from typing import Any

from pilotfish.envoy_binary import config_path

BODY_MODES = ("BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED")
# The gateways that host an InferencePool picker, as the bootstrap each generates (envoy/gateways/).
GATEWAYS = ("istio", "ai-gateway")
# the sidecar's cluster of engines for the override_host policy (retries down the picker's list)
PICKED_POOL = "picked_pool"


def _endpoint_list(addresses: list[tuple[str, int]]) -> list[dict]:
    return [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in addresses]


def _endpoints(addresses: list[tuple[str, int]]) -> str:
    # JSON is YAML: a flow list drops into the template at any indentation.
    return json.dumps(_endpoint_list(addresses))


# Envoy's gRPC access log to the ext_proc: each finished request's entry is sent at once (buffer 0).
# A flush timer is armed on every Envoy thread whether or not anything is buffered: at 50 ms it was
# 20 wake-ups a second per thread, about 2.2 ms of Envoy CPU a second on an idle 2-worker sidecar
# (5.3 against 3.1 ms/s); sent at once, a release also arrives within milliseconds instead of up to
# 50 ms later. The price is one message per request where a batch carried many: about 50 us more per
# request for the hop at 2,000 requests/s (bench/RESULTS.md, 2026-11-28). The 1 s timer is only a
# backstop.
_ACCESS_LOG = {
    "name": "envoy.access_loggers.http_grpc",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": {
            "log_name": "pilotfish",
            "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": "pilotfish_ext_proc"}},
            "buffer_flush_interval": "1s",
            "buffer_size_bytes": 0,
        },
        # the id releases by; the prefill header marks a prefill/decode pair, never reported served elsewhere
        "additional_request_headers_to_log": ["x-request-id", "x-prefiller-host-port"],
    },
}


def _observer_filter(ext_proc_timeout_s: float) -> dict[str, object]:
    """A second ext_proc filter that only watches response bodies: observability mode, so Envoy sends
    each chunk without waiting for (or expecting) a reply; the request's id and who placed it come
    in the pilotfish metadata the first filter wrote."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "pilotfish_ext_proc"}, "timeout": f"{ext_proc_timeout_s}s"},
            "observability_mode": True,
            "failure_mode_allow": True,
            "forward_rules": {"allowed_headers": {"patterns": [{"exact": ":status"}, {"exact": "content-type"}]}},
            "metadata_options": {"forwarding_namespaces": {"untyped": ["pilotfish"]}},
            "processing_mode": {
                "request_header_mode": "SKIP",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def render_sidecar(
    *,
    listen_port: int,
    admin_port: int,
    ext_proc_ports: list[int],
    default_endpoints: list[tuple[str, int]],
    listen_host: str = "127.0.0.1",
    max_body_bytes: int = 4 * 1024 * 1024,
    ext_proc_timeout_s: float = 5.0,
    request_body_mode: str = "BUFFERED",
    response_body_mode: str = "STREAMED",
    observe_response_bodies: bool = False,
    release_from_access_log: bool = False,
    destination_fallbacks: int = 0,
    engines: list[tuple[str, int]] | None = None,
    eds_path: str | Path = "",
    ext_proc_tls_ca_file: str | Path = "",
    ext_proc_tls_cert_file: str | Path = "",
    ext_proc_tls_key_file: str | Path = "",
    ext_proc_tls_server_name: str = "",
    ext_proc_auth_token_file: str | Path = "",
    client_address: bool = True,
) -> str:
    """The sidecar bootstrap: listener, ext_proc filter (one or more ext_proc processes), clusters.

    `client_address` has Envoy send each request's client address (`source.address`) with its headers,
    for the ext_proc's --flow-groups source (its default); False for --flow-groups none.

    Body modes are BUFFERED, STREAMED or FULL_DUPLEX_STREAMED each way (measured side by side by
    `pilotfish bench gateway`). A STREAMED request body is sent without waiting for the headers
    reply, so the ext_proc can hold that reply until the body has chosen the engine.

    Envoy's access log goes to the ext_proc, which releases requests by it, when response bodies are
    not sent (`response_body_mode` NONE without the observing filter) or when
    `release_from_access_log` (the ext_proc's --response-bodies first-token) says so.

    `destination_fallbacks` is the ext_proc's --destination-fallbacks: 0 routes each request to
    its one picked address (ORIGINAL_DST, any engine); N > 0 routes through the override_host
    policy, whose retries (N at most, before any response byte) go down the picker's list. Its
    members are `eds_path` (a file `write_eds` keeps current) when given, else `engines`
    (default: `default_endpoints`) as a static list; an address outside them is not reachable
    that way, so keep them the engines the scheduler may pick.

    An ext_proc started with TLS or a token (pilotfish/security.py) is dialled accordingly, by every
    gRPC call Envoy makes to it (the ext_proc filter and, with response bodies skipped, the access
    log): `ext_proc_tls_ca_file` verifies its certificate, under `ext_proc_tls_server_name` (also
    the SNI; default: the address dialled, 127.0.0.1), and `ext_proc_tls_cert_file` and
    `ext_proc_tls_key_file` are the client certificate an ext_proc with --tls-ca-file requires.
    `ext_proc_auth_token_file` is read now: each call carries `authorization: Bearer <token>`, so the
    rendered text holds the token; write it where only its owner reads it. Without these, the output is
    the template's text unchanged.
    """
    if request_body_mode not in BODY_MODES:
        raise ValueError(f"request_body_mode {request_body_mode!r}: expected one of {', '.join(BODY_MODES)}")
    if response_body_mode not in (*BODY_MODES, "NONE"):
        raise ValueError(f"response_body_mode {response_body_mode!r}: expected NONE or one of {', '.join(BODY_MODES)}")
    if observe_response_bodies and response_body_mode != "NONE":
        raise ValueError("observe_response_bodies: the first filter's response_body_mode must be NONE")
    if destination_fallbacks < 0:
        raise ValueError(f"destination_fallbacks {destination_fallbacks}: expected 0 or more")
    if eds_path:
        pool_type = "EDS"
        members = "eds_cluster_config: " + json.dumps(
            {"eds_config": {"path_config_source": {"path": str(eds_path)}, "resource_api_version": "V3"}}
        )
    else:
        pool_type = "STATIC"
        members = "load_assignment: " + json.dumps(
            {"cluster_name": PICKED_POOL, "endpoints": [{"lb_endpoints": _endpoint_list(engines or default_endpoints)}]}
        )
    skipped = response_body_mode == "NONE" and not observe_response_bodies
    # the ext_proc releases from the access log when it reads no response body, or only each stream's
    # first token (--response-bodies first-token)
    access_log_releases = skipped or release_from_access_log
    template = Template(config_path("sidecar.yaml").read_text())
    text = template.substitute(
        listen_host=listen_host,
        listen_port=listen_port,
        admin_port=admin_port,
        max_body_bytes=max_body_bytes,
        ext_proc_timeout=f"{ext_proc_timeout_s}s",
        request_body_mode=request_body_mode,
        response_body_mode=response_body_mode,
        # response bodies skipped: requests are released from Envoy's access log (ext_proc/access_log.py)
        access_log=json.dumps([_ACCESS_LOG] if access_log_releases else []),
        # ...and then the response needs nothing from the ext_proc: the stream ends with the routing reply
        response_header_mode="SKIP" if skipped else "SEND",
        observer_filter=f"- {json.dumps(_observer_filter(ext_proc_timeout_s))}" if observe_response_bodies else "",
        send_body_early="true" if request_body_mode == "STREAMED" else "false",
        # In full duplex a body that ends in trailers has no end_of_stream chunk: the ext_proc must
        # see the trailers to know it is complete (Envoy refuses the config otherwise).
        request_trailer_mode="SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        response_trailer_mode="SEND" if response_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        ext_proc_endpoints=_endpoints([("127.0.0.1", p) for p in ext_proc_ports]),
        default_endpoints=_endpoints(default_endpoints),
        picked_cluster=PICKED_POOL if destination_fallbacks else "picked_endpoint",
        picked_retries=destination_fallbacks,
        picked_pool_type=pool_type,
        picked_pool_members=members,
        request_attributes=json.dumps(["source.address"] if client_address else []),
    )
    return _secure_ext_proc(
        text,
        ca=str(ext_proc_tls_ca_file),
        cert=str(ext_proc_tls_cert_file),
        key=str(ext_proc_tls_key_file),
        server_name=ext_proc_tls_server_name,
        token_file=str(ext_proc_auth_token_file),
    )


EXT_PROC_CLUSTER = "pilotfish_ext_proc"


def _secure_ext_proc(text: str, *, ca: str, cert: str, key: str, server_name: str, token_file: str) -> str:
    """`text` with TLS on the ext_proc cluster and the token on every gRPC service that calls it."""
    if not (ca or cert or key or server_name or token_file):
        return text
    import yaml

    from pilotfish.security import Security, SecurityConfig

    if (cert or key or server_name) and not ca:
        raise ValueError("ext_proc TLS: ext_proc_tls_ca_file verifies the ext_proc; set it with a certificate or name")
    # the files are checked as the ext_proc's own client would check them (pair, CA, token): errors name them
    security = Security.from_config(
        SecurityConfig(tls_ca_file=ca, tls_cert_file=cert, tls_key_file=key, auth_token_file=token_file), environ={}
    )
    config = yaml.safe_load(text)
    if security.token:
        bearer = "Bearer " + security.token.decode()
        for service in _grpc_services(config):
            if service.get("envoy_grpc", {}).get("cluster_name") == EXT_PROC_CLUSTER:
                service["initial_metadata"] = [{"key": "authorization", "value": bearer}]
    if ca:
        name = server_name or "127.0.0.1"  # the ext_proc endpoints the sidecar dials
        try:
            ipaddress.ip_address(name)
            san = {"san_type": "IP_ADDRESS", "matcher": {"exact": name}}
        except ValueError:
            san = {"san_type": "DNS", "matcher": {"exact": name}}
        common: dict[str, Any] = {
            "alpn_protocols": ["h2"],  # gRPC
            "validation_context": {"trusted_ca": {"filename": ca}, "match_typed_subject_alt_names": [san]},
        }
        if cert:
            common["tls_certificates"] = [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}]
        tls: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": common,
        }
        if server_name:
            tls["sni"] = server_name
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == EXT_PROC_CLUSTER]
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": tls}
    return yaml.safe_dump(config, sort_keys=False)


def _grpc_services(node: Any) -> list[dict[str, Any]]:
    """Every `grpc_service` in a config tree (ext_proc filters, gRPC access logs, ...)."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        for field, value in node.items():
            if field == "grpc_service" and isinstance(value, dict):
                found.append(value)
            found += _grpc_services(value)
    elif isinstance(node, list):
        for item in node:
            found += _grpc_services(item)
    return found


def write_eds(path: str | Path, engines: list[tuple[str, int]], version: str = "") -> None:
    """Write the sidecar's `picked_pool` members for Envoy's file-based EDS, atomically (a rename,
    which is what Envoy watches for), so Envoy swaps them in whole when discovery changes."""
    path = Path(path)
    response = {
        "version_info": version or str(len(engines)),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": PICKED_POOL,
                "endpoints": [{"lb_endpoints": _endpoint_list(engines)}],
            }
        ],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(response))
    os.replace(tmp, path)


def render_gateway(
    gateway: str,
    *,
    listen_port: int,
    ext_proc_ports: list[int],
    default_endpoints: list[tuple[str, int]],
    listen_host: str = "127.0.0.1",
    failure_mode_allow: bool = False,
) -> str:
    """The bootstrap `gateway` (one of GATEWAYS) generates for an InferencePool picked by Pilotfish.

    `failure_mode_allow` is the pool's failureMode: FailOpen (true) or FailClose (false).
    """
    if gateway not in GATEWAYS:
        raise ValueError(f"gateway {gateway!r}: expected one of {', '.join(GATEWAYS)}")
    template = Template(config_path(f"gateways/{gateway}.yaml").read_text())
    return template.substitute(
        listen_host=listen_host,
        listen_port=listen_port,
        failure_mode_allow="true" if failure_mode_allow else "false",
        ext_proc_endpoints=_endpoints([("127.0.0.1", p) for p in ext_proc_ports]),
        default_endpoints=_endpoints(default_endpoints),
    )


def render_plain_proxy(sidecar_yaml: str) -> str:
    """The same bootstrap with the ext_proc filter taken out: Envoy alone, for comparisons."""
    import yaml

    config = yaml.safe_load(sidecar_yaml)
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net_filter in chain["filters"]:
                hcm = net_filter["typed_config"]
                hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "pilotfish_ext_proc"
    ]
    return yaml.safe_dump(config, sort_keys=False)
