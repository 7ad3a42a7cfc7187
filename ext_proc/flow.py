"""What the gateway tells the scheduler's flow control about a request: its band, its flow and how
long the gateway can hold it (scheduler.proto ScheduleRequest priority, flow, queue_timeout_ms).

- Band: the header --priority-header (default `x-request-priority`): `critical`, `standard` or
  `sheddable` (any case). Anything else, or no header, is sent as unspecified, which the scheduler
  reads as its model's band (--flow-model-priorities) or standard: a request is never refused for it.
  A client sets that header, so it may claim at most --client-priority-max (default `standard`): a
  higher claim would let any client jump every queue and never be shed. Such a claim is sent as
  unspecified (the model's band, the operator's choice) and counted. Where a trusted layer in front
  of Envoy sets the header (and drops the client's), `--client-priority-max critical` honours it.
- Flow: the header --flow-header (default `x-tenant-id`; `authorization` keys flows on API keys),
  sent as a 64-bit BLAKE2b hash in hex. The value itself never leaves the gateway and is never
  logged; any length is hashed to the same 16 characters. No header: the default flow.
- Hold: --schedule-queue-timeout-ms (0: the scheduler answers at once, as without flow control).

The shipped Envoy sidecar forwards these two default header names to the ext_proc (its
forward_rules allowlist); other names must be added there. The sidecar strips client `x-pilotfish-*`
and `x-gateway-*` headers, so neither default is in those namespaces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from pilotfish.protos import scheduler_pb2

_BANDS = {
    "critical": scheduler_pb2.PRIORITY_CRITICAL,
    "standard": scheduler_pb2.PRIORITY_STANDARD,
    "sheddable": scheduler_pb2.PRIORITY_SHEDDABLE,
}
_MAX_PRIORITY_LENGTH = 16  # longer than any band name: not one
BAND_NAMES = tuple(_BANDS)  # highest first, as the enum numbers them


def priority_of(value: str | None) -> int:
    """The band a header value names; unspecified (0) for anything else."""
    if not value or len(value) > _MAX_PRIORITY_LENGTH:
        return scheduler_pb2.PRIORITY_UNSPECIFIED
    return _BANDS.get(value.strip().lower(), scheduler_pb2.PRIORITY_UNSPECIFIED)


def flow_of(value: str | None) -> str:
    """The flow key sent for a header value: its hash, never the value; "" without one."""
    if not value:
        return ""
    return hashlib.blake2b(value.encode("utf-8", "replace"), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class FlowHeaders:
    priority_header: str = "x-request-priority"
    flow_header: str = "x-tenant-id"
    queue_timeout_ms: int = 0
    max_claim: str = "standard"  # the highest band the header may claim (--client-priority-max)

    def read(self, headers: Mapping[str, str]) -> tuple[int, str, bool]:
        """(priority, flow, whether the header claimed a band above `max_claim`) of a request's headers;
        such a claim is sent as unspecified."""
        priority = priority_of(headers.get(self.priority_header))
        over = priority != scheduler_pb2.PRIORITY_UNSPECIFIED and priority < _BANDS[self.max_claim]
        return (scheduler_pb2.PRIORITY_UNSPECIFIED if over else priority), flow_of(headers.get(self.flow_header)), over
