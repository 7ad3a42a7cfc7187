"""Decode CMS records strictly: bounded size, well-formed protobuf, sane fields.

Records come from Redis, which any process on the network may write to; a reader must never
crash or be misled by one. `decode_status`/`decode_metadata` raise `BadRecord` with a one-line
reason; callers log it once and keep the record they already hold.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from pilotfish.cms.keys import BadId, check_id
from pilotfish.protos import cms_pb2

MAX_RECORD_BYTES = 256 * 1024
# Admitted ids are meant to be the ones since the last export; a flood is hostile or broken.
MAX_ADMITTED_IDS = 4096


class BadRecord(ValueError):
    pass


def _parse(message: cms_pb2.InstanceStatus | cms_pb2.InstanceMetadata, raw: bytes, what: str) -> None:
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecord(f"{what} record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        message.ParseFromString(raw)
    except DecodeError as exc:
        raise BadRecord(f"{what} record is not a valid protobuf: {exc}") from None


def decode_status(raw: bytes, expected_instance: str | None = None) -> cms_pb2.InstanceStatus:
    status = cms_pb2.InstanceStatus()
    _parse(status, raw, "status")
    try:
        check_id(status.instance_id, "status instance_id")
    except BadId as exc:
        raise BadRecord(str(exc)) from None
    if expected_instance is not None and status.instance_id != expected_instance:
        raise BadRecord(f"status under key of {expected_instance!r} names instance {status.instance_id!r}")
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
        raise BadRecord(f"metadata under key of {expected_instance!r} names instance {meta.instance_id!r}")
    if not meta.host or not 0 < meta.http_port < 65536:
        raise BadRecord(f"metadata of {meta.instance_id!r} has no usable address ({meta.host!r}:{meta.http_port})")
    return meta


def is_newer(candidate: cms_pb2.InstanceStatus, held: cms_pb2.InstanceStatus | None) -> bool:
    """Monotonic update_id: a reader keeps a record only if it is newer than the one it holds."""
    return held is None or candidate.update_id > held.update_id
