"""Prometheus counters of the rescheduler, on the registry of the process it runs in.

| series | what |
|---|---|
| `rescheduling_cycles_count_total` | planning cycles run |
| `rescheduling_attempted_count_total{policy}` | migration pairs dispatched (Migrate calls asked for) |
| `rescheduling_failed_count_total{policy,reason}` | pairs that failed, by reason (below) |
| `rescheduling_migrated_requests_count_total{policy}` | requests the llumlets report migrated |

Failure reasons: `timeout`; a gRPC status code in lower case (`unavailable`, `unimplemented`, ...);
`rejected` (the llumlet answered with an error and moved nothing); `no_source_address`,
`no_destination_address` (CMS metadata without a llumlet port).

The names are the spec's (`rescheduling_failed_count`); Prometheus adds `_total` to a counter.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ReschedulerTelemetry:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cycles = Counter("rescheduling_cycles_count", "Rescheduling cycles run.", registry=registry)
        self.attempted = Counter(
            "rescheduling_attempted_count", "Migration pairs dispatched, by policy.", ["policy"], registry=registry
        )
        self.failed = Counter(
            "rescheduling_failed_count",
            "Migration pairs that failed, by policy and reason.",
            ["policy", "reason"],
            registry=registry,
        )
        self.migrated = Counter(
            "rescheduling_migrated_requests_count",
            "Requests the source llumlets report migrated, by policy.",
            ["policy"],
            registry=registry,
        )
