"""Static discovery: instances named on the command line as `id=host:port` or `host:port`.

The embedded default and the gateway's own fallback list use it; the Redis, etcd and
Kubernetes backends (`pilotfish.discovery.backends`) yield the same `Instance` records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class MetadataUnavailable(ConnectionError):
    """An instance's /metadata endpoint could not be read; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Instance:
    instance_id: str
    host: str
    port: int
    # "" matches any namespace/component: a static list serves every query.
    namespace: str = ""
    component: str = ""
    # What metadata() returns: the snapshot a record carried (static, file, Redis, etcd) ...
    metadata_snapshot: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    # ... or where the instance serves it itself (Kubernetes: no store holds metadata).
    metadata_url: str | None = field(default=None, compare=False, repr=False)

    @property
    def address(self) -> str:
        """`host:port` (`[v6]:port`), the value of x-gateway-destination-endpoint."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def metadata(self, timeout: float = 2.0) -> dict[str, Any]:
        """The instance's metadata: the record's copy, or a GET of its `/metadata` endpoint."""
        if self.metadata_url is None:
            return dict(self.metadata_snapshot or {})
        from pilotfish.discovery.httpget import get_json_object

        return await get_json_object(self.metadata_url, timeout)

    def same_as(self, other: Instance) -> bool:
        """Equal including the metadata: an update that a watcher must hear about."""
        return (
            self == other
            and self.metadata_url == other.metadata_url
            and dict(self.metadata_snapshot or {}) == dict(other.metadata_snapshot or {})
        )


def parse_instance(spec: str) -> Instance:
    """`id=host:port` or `host:port` (the id is then the address); ValueError names the problem."""
    text = spec.strip()
    instance_id, sep, address = text.partition("=")
    if not sep:
        instance_id, address = text, text
    host, colon, port_text = address.rpartition(":")
    if not colon or not host or not instance_id.strip():
        raise ValueError(f"instance {spec!r} is not id=host:port or host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"instance {spec!r} has a port that is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"instance {spec!r} has port {port} outside 1-65535")
    return Instance(instance_id.strip(), host.strip("[]"), port)


def parse_instances(specs: list[str]) -> list[Instance]:
    instances = [parse_instance(s) for s in specs]
    seen: set[str] = set()
    for inst in instances:
        if inst.instance_id in seen:
            raise ValueError(f"instance id {inst.instance_id!r} is listed twice")
        seen.add(inst.instance_id)
    return instances


def in_subset(address: str, subset: frozenset[str]) -> bool:
    """Whether the engine at `address` ("host:port") is one a subset hint allows: named with its
    port, or by its host alone (a hint entry without a port stands for every engine there)."""
    return address in subset or address.rpartition(":")[0].strip("[]") in subset
