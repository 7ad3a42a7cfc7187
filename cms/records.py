"""Decode CMS records strictly: bounded size, well-formed protobuf, sane fields.

Records come from Redis, which any process that can reach it may write to (docs/cms-trust.md);
a reader must never crash or be misled by one. `decode_status`/`decode_metadata` raise
`BadRecord` with a one-line message and a short `reason` code; callers log it (rate-limited)
and keep the record they already hold. `implausible` says whether a decoded status claims a
future it cannot have (a timestamp, an epoch or an update_id beyond the reader's clock); such a
record would otherwise pin the instance's view, since every real status after it looks older.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pilotfish.cms.keys import MAX_ID_LENGTH, BadId, check_id
from pilotfish.protos import cms_pb2

MAX_RECORD_BYTES = 256 * 1024
# Admitted ids are meant to be the ones since the last export; a flood is hostile or broken.
MAX_ADMITTED_IDS = 4096
# metadata strings: a DNS name's limit, and generous bounds for the rest
MAX_HOST_LENGTH = 253
MAX_MODEL_LENGTH = 256
MAX_ENDPOINT_LENGTH = 512
# used with fullmatch: `$` would also match before a final "\n", and a host that ends in one
# breaks every header it is put in
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
# ASCII from '!' to '~': what an address may hold anywhere, the scope of an IPv6 one included
# (ipaddress takes "fe80::1%a\nb")
_HOST_CHARS = re.compile(r"[!-~]+")

# BadRecord.reason codes (metric labels; keep the set small and fixed)
OVERSIZE = "oversize"
MALFORMED = "malformed"  # not a protobuf, not a string key
MISMATCH = "instance_mismatch"  # the record names another instance than its key
INVALID = "invalid_field"  # a field out of bounds
# implausible statuses (see `implausible`)
FUTURE_TIMESTAMP = "future_timestamp"
FUTURE_EPOCH = "future_epoch"
UPDATE_ID_JUMP = "update_id_jump"


class BadRecord(ValueError):
    def __init__(self, message: str, reason: str = INVALID) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Rejected:
    """What a reader remembers of a record it refused: never the record itself."""

    instance_id: str
    reason: str
    size: int
    digest: bytes  # blake2b-128 of the bytes read, to skip the same value on the next poll


def digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


def _parse(message: cms_pb2.InstanceStatus | cms_pb2.InstanceMetadata, raw: bytes, what: str) -> None:
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecord(f"{what} record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}", OVERSIZE)
    try:
        message.ParseFromString(raw)
    except DecodeError as exc:
        raise BadRecord(f"{what} record is not a valid protobuf: {exc}", MALFORMED) from None


def decode_status(raw: bytes, expected_instance: str | None = None) -> cms_pb2.InstanceStatus:
    status = cms_pb2.InstanceStatus()
    _parse(status, raw, "status")
    try:
        check_id(status.instance_id, "status instance_id")
    except BadId as exc:
        raise BadRecord(str(exc)) from None
    if expected_instance is not None and status.instance_id != expected_instance:
        raise BadRecord(f"status under key of {expected_instance!r} names instance {status.instance_id!r}", MISMATCH)
    if len(status.admitted_request_ids) > MAX_ADMITTED_IDS:
        raise BadRecord(f"status carries {len(status.admitted_request_ids)} admitted ids (max {MAX_ADMITTED_IDS})")
    if status.total_kv_tokens and status.used_kv_tokens > status.total_kv_tokens:
        raise BadRecord(f"status says {status.used_kv_tokens} KV tokens used of {status.total_kv_tokens}")
    return status


def decode_metadata(raw: bytes, expected_instance: str | None = None) -> cms_pb2.InstanceMetadata:
    meta = cms_pb2.InstanceMetadata()
    _parse(meta, raw, "metadata")
    try:
        check_id(meta.instance_id, "metadata instance_id")
    except BadId as exc:
        raise BadRecord(str(exc)) from None
    if expected_instance is not None and meta.instance_id != expected_instance:
        raise BadRecord(f"metadata under key of {expected_instance!r} names instance {meta.instance_id!r}", MISMATCH)
    if not valid_host(meta.host) or not 0 < meta.http_port < 65536:
        raise BadRecord(f"metadata of {meta.instance_id!r} has no usable address ({meta.host[:80]!r}:{meta.http_port})")
    if meta.llumlet_port > 65535:
        raise BadRecord(f"metadata of {meta.instance_id!r} has llumlet_port {meta.llumlet_port}")
    for name, value, bound in (
        ("model", meta.model, MAX_MODEL_LENGTH),
        ("node_id", meta.node_id, MAX_ID_LENGTH),
        ("unit_id", meta.unit_id, MAX_ID_LENGTH),
        ("kv_events_endpoint", meta.kv_events_endpoint, MAX_ENDPOINT_LENGTH),
        ("kv_events_topic", meta.kv_events_topic, MAX_MODEL_LENGTH),
    ):
        if len(value) > bound or not value.isprintable():
            raise BadRecord(f"metadata of {meta.instance_id!r}: {name} is not 0-{bound} printable characters")
    if meta.infer_type not in cms_pb2.InferType.values():
        raise BadRecord(f"metadata of {meta.instance_id!r} has unknown infer_type {meta.infer_type}")
    if meta.dp_size and meta.dp_rank >= meta.dp_size:
        raise BadRecord(f"metadata of {meta.instance_id!r} has dp_rank {meta.dp_rank} of dp_size {meta.dp_size}")
    return meta


def valid_host(host: str) -> bool:
    """An IPv4 or IPv6 address (brackets allowed) or a DNS name; nothing else may be dialled."""
    if not host or len(host) > MAX_HOST_LENGTH or not _HOST_CHARS.fullmatch(host):
        return False
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return bool(name) and all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


@dataclass(frozen=True, slots=True)
class Bounds:
    """How far ahead of the reader's clock a status may claim to be (docs/cms-trust.md)."""

    max_clock_skew_ms: int = 5000
    max_update_id_jump: int = 1_000_000


def implausible(
    status: cms_pb2.InstanceStatus,
    now_ms: int,
    bounds: Bounds,
    held_epoch: int | None = None,
    held_update_id: int = 0,
) -> str:
    """The reason code a status is refused for, or "" when it is plausible.

    - timestamp_ms or epoch more than the skew ahead of `now_ms` (the reader's wall clock);
    - update_id beyond both the held one (of the same epoch; 0 otherwise) plus
      `max_update_id_jump`, and the reader's clock in microseconds plus the skew: llumlets count
      update_ids from the wall clock in microseconds, simple writers count from 1, and neither
      gets further than that.
    """
    horizon_ms = now_ms + bounds.max_clock_skew_ms
    if status.timestamp_ms > horizon_ms:
        return FUTURE_TIMESTAMP
    if status.epoch > horizon_ms:
        return FUTURE_EPOCH
    base = held_update_id if held_epoch is not None and held_epoch == status.epoch else 0
    if status.update_id > max(base + bounds.max_update_id_jump, horizon_ms * 1000):
        return UPDATE_ID_JUMP
    return ""


def is_newer(candidate: cms_pb2.InstanceStatus, held: cms_pb2.InstanceStatus | None) -> bool:
    """Ordered by (epoch, update_id): a reader keeps a record only if it is newer than the one it
    holds; a newer epoch (a restarted writer) restarts the update_id sequence."""
    if held is None:
        return True
    if candidate.epoch != held.epoch:
        return candidate.epoch > held.epoch
    return candidate.update_id > held.update_id
