"""The gateway's Prometheus metrics, in a registry of its own (several gateways can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ExtProcMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "pilotfish_ext_proc_routed", "Requests routed, by who chose the engine.", ["route"], registry=self.registry
        )
        self.rejected = Counter(
            "pilotfish_ext_proc_rejected",
            "Requests answered by the gateway itself, by status.",
            ["status"],
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "pilotfish_ext_proc_generated_tokens",
            "Generated tokens counted in streamed responses (with --response-bodies first-token: estimated from "
            "their size).",
            registry=self.registry,
        )
        self.sse_oversized_events = Counter(
            "pilotfish_ext_proc_sse_oversized_events",
            "Response SSE events longer than 1 MiB: counted as one token each unparsed, never held whole.",
            registry=self.registry,
        )
        self.priority_claims_ignored = Counter(
            "pilotfish_ext_proc_priority_claims_ignored",
            "Requests whose priority header claimed a band above --client-priority-max: sent with their model's "
            "band instead.",
            registry=self.registry,
        )
        self.first_token_ends = Counter(
            "pilotfish_ext_proc_first_token_ends",
            "Streams read up to their first token and ended there (--response-bodies first-token): Envoy passes "
            "the rest of each response unwatched, and resets the ext_proc stream after its OK.",
            registry=self.registry,
        )
        self.releases = Counter(
            "pilotfish_ext_proc_releases",
            "Release calls sent to the scheduler, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.unlogged_releases = Counter(
            "pilotfish_ext_proc_unlogged_releases",
            "Requests the access log was to release (--response-bodies skip or first-token) whose stream ended "
            "before their response and whose entry did not come: released by the ext_proc after a wait (a client "
            "reset that beat the routing reply to Envoy leaves an entry Envoy did not tag).",
            registry=self.registry,
        )
        self.schedule_seconds = Histogram(
            "pilotfish_ext_proc_schedule_seconds",
            "Schedule call latency, including fallback decisions.",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
            registry=self.registry,
        )
        self.breaker_open = Gauge(
            "pilotfish_ext_proc_breaker_open", "1 while the breaker skips the scheduler.", registry=self.registry
        )
        self.served_elsewhere = Counter(
            "pilotfish_ext_proc_served_elsewhere",
            "Responses whose x-gateway-destination-endpoint-served differs from the endpoint chosen.",
            registry=self.registry,
        )
        self.gateway_errors = Counter(
            "pilotfish_ext_proc_gateway_errors",
            "Requests the gateway failed on itself (a bug): answered 500 or passed through, never routed by it.",
            registry=self.registry,
        )
        self.unroutable_bodies = Counter(
            "pilotfish_ext_proc_unroutable_bodies",
            "STREAMED request bodies whose route was fixed before the body came (Envoy refused the "
            "BUFFERED override): sent where Envoy's route config sends unpicked requests.",
            registry=self.registry,
        )
        self.active_streams = Gauge(
            "pilotfish_ext_proc_active_streams", "ext_proc streams (HTTP requests) in progress.", registry=self.registry
        )
