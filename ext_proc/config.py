"""Every ext_proc setting and its default, once; flags, YAML keys and the README table derive from it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pilotfish.cms.prefix_hash import DEFAULT_BLOCK_SIZE
from pilotfish.discovery.config import DiscoveryConfig
from pilotfish.ext_proc.openai import UNSCHEDULED_PATHS


class ExtProcConfig(DiscoveryConfig, kw_only=True, forbid_unknown_fields=True):
    """The gateway's own engine list (for fallback routing) comes from --instances and, when it
    is not the default static:, from --discovery, watched live."""

    host: Annotated[str, Meta(description="address the gRPC server binds")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535, description="gRPC port Envoy's ext_proc filter connects to")] = 50061
    grpc_server: Annotated[
        Literal["loop", "grpcio"],
        Meta(
            description="loop: the gRPC server runs in the ext_proc's own event loop (pilotfish/grpc_loop.py), "
            "about half the CPU per request of grpcio; grpcio: grpc.aio's server, whose core hands every "
            "event between its threads and the loop"
        ),
    ] = "loop"
    scheduler_address: Annotated[
        str, Meta(description="host:port of the scheduler's gRPC service; empty routes round-robin only")
    ] = "127.0.0.1:50051"
    colocated_scheduling: Annotated[
        bool,
        Meta(
            description="run the scheduler's core inside this process (no gRPC hop; each ext_proc process then "
            "keeps its own load view); --scheduler-address is ignored"
        ),
    ] = False
    scheduler_config: Annotated[
        str, Meta(description="YAML of scheduler settings (pilotfish scheduler's flag names) for colocated scheduling")
    ] = ""
    instances: Annotated[
        list[str],
        Meta(description="engines the gateway knows itself, for fallback routing: id=host:port or host:port"),
    ] = []
    model: Annotated[list[str], Meta(description="served model names; other models get 404 (empty: any model)")] = []
    scheduler_session: Annotated[
        bool,
        Meta(
            description="send Schedule, Report and Release to the remote scheduler as messages on one Session "
            "stream (false: a unary gRPC call each, as to a scheduler without Session)"
        ),
    ] = True
    scheduler_session_address: Annotated[
        str,
        Meta(
            description="host:port of the scheduler's plain Session socket (its --session-port): the same "
            "messages as the gRPC Session stream without HTTP/2, a shorter round trip (empty: the gRPC stream)"
        ),
    ] = ""
    schedule_timeout_ms: Annotated[
        float, Meta(gt=0, description="deadline of one Schedule call; past it the request is routed round-robin")
    ] = 200.0
    schedule_queue_timeout_ms: Annotated[
        int,
        Meta(
            ge=0,
            le=600_000,
            description="flow control: how long the scheduler may hold a request in its queue; once it says a "
            "request waits, this (not --schedule-timeout-ms) bounds the wait. Keep it below Envoy's ext_proc "
            "message timeout (the sidecar's is 5 s); 0: the scheduler answers at once",
        ),
    ] = 3000
    priority_header: Annotated[
        str,
        Meta(
            description="flow control: the request header naming its band (critical, standard, sheddable; "
            "anything else: the scheduler's default for the model)"
        ),
    ] = "x-request-priority"
    client_priority_max: Annotated[
        Literal["critical", "standard", "sheddable"],
        Meta(
            description="flow control: the highest band the priority header may claim; a higher claim is "
            "ignored (the request gets its model's band) and counted. critical only where a trusted layer in "
            "front of Envoy sets the header: clients set it otherwise"
        ),
    ] = "standard"
    flow_header: Annotated[
        str,
        Meta(
            description="flow control: the request header whose value keys fair shares (a tenant, or "
            "authorization for API keys); only its hash is sent, never logged"
        ),
    ] = "x-tenant-id"
    flow_groups: Annotated[
        Literal["source", "none"],
        Meta(
            description="flow control: source splits fair shares between client addresses first (Envoy's "
            "source.address; an IPv6 address by its /64), then between the flows of each, so a client keeping "
            "many tenant ids alive shares one address's share; none where an authenticating layer sets the "
            "flow header"
        ),
    ] = "source"
    report_interval_ms: Annotated[
        float, Meta(gt=0, description="how often streamed token counts are reported to the scheduler, batched")
    ] = 50.0
    max_body_bytes: Annotated[int, Meta(ge=1024, description="largest request body accepted; larger gets 413")] = (
        4 * 1024 * 1024
    )
    unscheduled_paths: Annotated[
        list[str],
        Meta(
            description="paths sent to any engine without scheduling, compared exactly (query string aside); "
            "/v1/completions and /v1/chat/completions are scheduled, and every other path gets 404"
        ),
    ] = msgspec.field(default_factory=lambda: list(UNSCHEDULED_PATHS))
    breaker_failures: Annotated[
        int, Meta(ge=1, description="consecutive scheduler failures that open the circuit breaker")
    ] = 3
    breaker_open_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="how long an open breaker skips the scheduler before probing it again (one request "
            "per period then waits out --schedule-timeout-ms; short, so a restarted scheduler is used again "
            "within about a second)",
        ),
    ] = 0.5
    tokenizer_path: Annotated[
        str, Meta(description="local tokenizer.json (or its folder) for exact prompt token counts (empty: estimate)")
    ] = ""
    tokenizer_name: Annotated[
        str, Meta(description="an installed package that ships a tokenizer.json: package or package:path/in/it")
    ] = ""
    exact_usage: Annotated[
        bool,
        Meta(
            description="add stream_options.include_usage to streaming requests so generated-token counts are "
            "exact; the extra usage chunk is removed before a client that did not ask for it sees it"
        ),
    ] = True
    metrics_port: Annotated[int, Meta(ge=0, le=65535, description="Prometheus /metrics port (0: off)")] = 0
    prefix_block_size: Annotated[
        int,
        Meta(
            ge=0,
            description="tokens per prefix block hashed for the scheduler's prefix index (cms/prefix_hash.py); "
            "coarser than the engine's block is fine for routing and cheaper; 0: no hashes",
        ),
    ] = DEFAULT_BLOCK_SIZE
    destination_fallbacks: Annotated[
        int,
        Meta(
            ge=0,
            le=16,
            description="fallback engines listed after the primary in x-gateway-destination-endpoint and its "
            "envoy.lb metadata (the same value in both, as the endpoint-picker protocol requires); 0 suits "
            "every gateway, ORIGINAL_DST clusters included, which read one address; a gateway that routes "
            "with Envoy's override_host policy (Istio) retries down a longer list",
        ),
    ] = 0
    response_bodies: Annotated[
        Literal["count", "first-token", "observe", "skip"],
        Meta(
            description="count: read streamed response bodies to count generated tokens and release each request "
            "at its stream's end (any gateway); first-token: read each stream up to its first token only (the "
            "prefill is done), then let Envoy pass the rest without a message per chunk, and release from "
            "Envoy's access log with the answer's length estimated from the response's size (the sidecar sends "
            "the access log to this process; lite mode's default there); observe: the same counts as count from "
            "a second Envoy filter in observability mode (the sidecar's), which sends each chunk without waiting "
            "for a reply, but the usage chunk cannot be added and removed, so tokens are counted per event unless "
            "the client asked for usage; skip: leave response bodies alone (full mode: the llumlets count "
            "tokens; the sidecar then asks Envoy for none), and release each request from Envoy's access log, "
            "which the sidecar sends to this process"
        ),
    ] = "count"
