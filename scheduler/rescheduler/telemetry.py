"""Prometheus counters of the rescheduler, on the registry of the process it runs in.

| series | what |
|---|---|
| `pilotfish_rescheduling_cycles_total` | planning cycles run |
| `pilotfish_rescheduling_attempted_total{policy}` | migration pairs dispatched (Migrate calls asked for) |
| `pilotfish_rescheduling_failed_total{policy,reason}` | pairs that failed, by reason (below) |
| `pilotfish_rescheduling_migrated_requests_total{policy}` | requests the llumlets report migrated |

Failure reasons: `timeout`; a gRPC status code in lower case (`unavailable`, `unimplemented`, ...);
`rejected` (the llumlet answered with an error and moved nothing); `no_source_address`,
`no_destination_address` (CMS metadata without a llumlet port).

They follow Prometheus's conventions rather than the `rescheduling_<x>_count` of Llumnix: the
`pilotfish_` prefix, and `_total` alone on a counter (`_count` is a histogram's sample suffix).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ReschedulerTelemetry:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cycles = Counter("pilotfish_rescheduling_cycles", "Rescheduling cycles run.", registry=registry)
        self.attempted = Counter(
            "pilotfish_rescheduling_attempted", "Migration pairs dispatched, by policy.", ["policy"], registry=registry
        )
        self.failed = Counter(
            "pilotfish_rescheduling_failed",
            "Migration pairs that failed, by policy and reason.",
            ["policy", "reason"],
            registry=registry,
        )
        self.migrated = Counter(
            "pilotfish_rescheduling_migrated_requests",
            "Requests the source llumlets report migrated, by policy.",
            ["policy"],
            registry=registry,
        )
