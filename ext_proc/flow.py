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
- Group: with --flow-groups source (the default), the flow key is `<group>:<flow>`, where the group is
  the hash of the client's address as Envoy saw the connection (Envoy's `source.address` attribute,
  which the shipped sidecar asks for; an IPv6 address counts by its /64, what one host is usually
  given). The scheduler splits shares between groups first, then between a group's flows, so a client
  that keeps many tenant ids alive shares one address's share. A client cannot choose its address the
  way it chooses a header: the sidecar sets `use_remote_address` (with `xff_num_trusted_hops: 0`), so
  `source.address` is the connection's, never a client's X-Forwarded-For, which Envoy's default would
  take. Behind a proxy every request has the proxy's address: one group, the flows as without groups
  (raise `xff_num_trusted_hops` to the trusted proxies in front, which append the client's address).
  `--flow-groups none` where the flow header comes from an authenticating layer and should alone
  decide the shares.
- Hold: --schedule-queue-timeout-ms (0: the scheduler answers at once, as without flow control).

The shipped Envoy sidecar forwards these two default header names to the ext_proc (its
forward_rules allowlist); other names must be added there. The sidecar strips client `x-pilotfish-*`
and `x-gateway-*` headers, so neither default is in those namespaces.
"""

from __future__ import annotations

import hashlib
import ipaddress
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


GROUP_SEPARATOR = ":"  # scheduler/flow/groups.py's; not a hex digit
ENVOY_ATTRIBUTES = "envoy.filters.http.ext_proc"  # the key Envoy sends request_attributes under
SOURCE_ATTRIBUTE = "source.address"
_MAX_ADDRESS_LENGTH = 64  # longer than any IP and port


def _hashed(text: str) -> str:
    """What leaves the gateway instead of a client's header value or address: 16 hex digits."""
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


def flow_of(value: str | None) -> str:
    """The flow key sent for a header value: its hash, never the value; "" without one."""
    return _hashed(value) if value else ""


_groups: dict[str, str] = {}  # host -> its group: a client sends many requests from one address
_MAX_CACHED_GROUPS = 4096


def group_of_address(address: str | None) -> str:
    """The group of a client address as Envoy writes it (`ip:port`, `[ipv6]:port`, or a bare IP): the hash
    of the IPv4 address, or of the /64 of an IPv6 one; "" for anything else (a pipe, nothing)."""
    if not address or len(address) > _MAX_ADDRESS_LENGTH:
        return ""
    host = address
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    group = _groups.get(host)
    if group is None:
        group = _group_of_host(host)
        if len(_groups) >= _MAX_CACHED_GROUPS:
            _groups.clear()  # bounded: many addresses only cost the parse again
        _groups[host] = group
    return group


def _group_of_host(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address):
        key = str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else str(ipaddress.IPv6Network((ip, 64), strict=False))
    else:
        key = str(ip)
    return _hashed(key)


@dataclass(frozen=True, slots=True)
class FlowHeaders:
    priority_header: str = "x-request-priority"
    flow_header: str = "x-tenant-id"
    queue_timeout_ms: int = 0
    max_claim: str = "standard"  # the highest band the header may claim (--client-priority-max)
    groups: str = "source"  # --flow-groups: "source" (the client's address) or "none"

    def read(self, headers: Mapping[str, str], source: str | None = None) -> tuple[int, str, bool]:
        """(priority, flow, whether the header claimed a band above `max_claim`) of a request's headers and
        its client's address (`source`); such a claim is sent as unspecified."""
        priority = priority_of(headers.get(self.priority_header))
        over = priority != scheduler_pb2.PRIORITY_UNSPECIFIED and priority < _BANDS[self.max_claim]
        flow = flow_of(headers.get(self.flow_header))
        if self.groups == "source":
            group = group_of_address(source)
            if group:
                flow = f"{group}{GROUP_SEPARATOR}{flow}"
        return (scheduler_pb2.PRIORITY_UNSPECIFIED if over else priority), flow, over


def source_address(attributes: Mapping[str, object]) -> str | None:
    """The client's address among a ProcessingRequest's attributes (a map of Structs), if Envoy sent it."""
    fields = attributes.get(ENVOY_ATTRIBUTES)
    if fields is None:
        return None
    value = fields.fields.get(SOURCE_ATTRIBUTE)  # type: ignore[attr-defined]
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value
