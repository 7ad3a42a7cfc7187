"""The instance record Redis and etcd store: one schema for the writer and the reader.

Readers decode strictly and bound sizes; a record that fails is skipped with one WARNING per
distinct bad value (not one per poll), and never reaches a consumer.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.discovery.static import Instance

MAX_RECORD_BYTES = 64 * 1024

_Id = Annotated[str, Meta(min_length=1, max_length=253)]


class InstanceRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One instance as stored. `ready=False` is a tombstone: removed on purpose, not expired."""

    instance_id: _Id
    namespace: _Id
    component: _Id
    host: Annotated[str, Meta(min_length=1, max_length=253)]
    port: Annotated[int, Meta(ge=1, le=65535)]
    timestamp_ms: Annotated[int, Meta(ge=0)]  # the writer's wall clock at this write
    update_id: Annotated[int, Meta(ge=0)]  # rises with every write of this instance
    ready: bool = True
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    def to_instance(self) -> Instance:
        return Instance(
            self.instance_id, self.host, self.port, self.namespace, self.component, metadata_snapshot=self.metadata
        )


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(InstanceRecord)


def encode_record(record: InstanceRecord) -> bytes:
    return _encoder.encode(record)


class MalformedRecord(ValueError):
    pass


def decode_record(raw: bytes, namespace: str, component: str, instance_id: str) -> InstanceRecord:
    """Decode and check that the record is the one its key names; MalformedRecord says why not."""
    if len(raw) > MAX_RECORD_BYTES:
        raise MalformedRecord(f"{len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        record = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedRecord(str(exc)) from None
    if (record.namespace, record.component, record.instance_id) != (namespace, component, instance_id):
        raise MalformedRecord(
            f"names {record.namespace}/{record.component}/{record.instance_id}, not the key's "
            f"{namespace}/{component}/{instance_id}"
        )
    return record


class BadRecordLog:
    """Logs each distinct malformed value once, so a bad record polled every second logs one line."""

    def __init__(self, logger: logging.Logger, limit: int = 4096) -> None:
        self._logger = logger
        self._seen: set[tuple[str, bytes]] = set()
        self._limit = limit

    def skip(self, where: str, raw: bytes, reason: str) -> None:
        key = (where, hashlib.blake2b(raw, digest_size=16).digest())
        if key in self._seen:
            return
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(key)
        self._logger.warning("skipping malformed discovery record at %s: %s", where, reason)
