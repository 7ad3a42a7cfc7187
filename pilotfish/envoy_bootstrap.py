"""Render envoy/sidecar.yaml for given ports: the one place the gateway's Envoy config is filled in."""

from __future__ import annotations

import json
from string import Template

from pilotfish.envoy_binary import config_path

BODY_MODES = ("BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED")
# The gateways that host an InferencePool picker, as the bootstrap each generates (envoy/gateways/).
GATEWAYS = ("istio", "ai-gateway")


def _endpoints(addresses: list[tuple[str, int]]) -> str:
    # JSON is YAML: a flow list drops into the template at any indentation.
    return json.dumps(
        [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in addresses]
    )


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
) -> str:
    """The sidecar bootstrap: listener, ext_proc filter (one or more ext_proc processes), clusters.

    Body modes are BUFFERED, STREAMED or FULL_DUPLEX_STREAMED each way (measured side by side by
    `pilotfish bench gateway`). A STREAMED request body is sent without waiting for the headers
    reply, so the ext_proc can hold that reply until the body has chosen the engine.
    """
    for name, mode in (("request_body_mode", request_body_mode), ("response_body_mode", response_body_mode)):
        if mode not in BODY_MODES:
            raise ValueError(f"{name} {mode!r}: expected one of {', '.join(BODY_MODES)}")
    template = Template(config_path("sidecar.yaml").read_text())
    return template.substitute(
        listen_host=listen_host,
        listen_port=listen_port,
        admin_port=admin_port,
        max_body_bytes=max_body_bytes,
        ext_proc_timeout=f"{ext_proc_timeout_s}s",
        request_body_mode=request_body_mode,
        response_body_mode=response_body_mode,
        send_body_early="true" if request_body_mode == "STREAMED" else "false",
        # In full duplex a body that ends in trailers has no end_of_stream chunk: the ext_proc must
        # see the trailers to know it is complete (Envoy refuses the config otherwise).
        request_trailer_mode="SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        response_trailer_mode="SEND" if response_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        ext_proc_endpoints=_endpoints([("127.0.0.1", p) for p in ext_proc_ports]),
        default_endpoints=_endpoints(default_endpoints),
    )


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
