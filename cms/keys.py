"""The Redis key layout of the Cluster Metadata Store, in one place for writer and reader.

    pilotfish:<cluster>:meta:<instance>     InstanceMetadata (protobuf), with a TTL
    pilotfish:<cluster>:status:<instance>   InstanceStatus (protobuf), with a TTL
    pilotfish:<cluster>:events              pub/sub channel: "<kind>:<instance>" on every write

A dead llumlet stops refreshing its keys, they expire, and readers drop the instance.
"""

from __future__ import annotations

import re

PREFIX = "pilotfish"
META = "meta"
STATUS = "status"
EVENTS = "events"

# Ids become part of Redis keys and channel messages: keep them printable and bounded.
MAX_ID_LENGTH = 200
_FORBIDDEN = set(" \t\r\n:*?[]")
# the same set as one character class: checked in C, since every notice and record checks an id
_FORBIDDEN_CHAR = re.compile("[" + re.escape("".join(sorted(_FORBIDDEN))) + "]")


class BadId(ValueError):
    pass


def check_id(value: str, what: str) -> str:
    if not value or len(value) > MAX_ID_LENGTH or not value.isprintable() or _FORBIDDEN_CHAR.search(value):
        raise BadId(f"{what} {value!r} must be 1-{MAX_ID_LENGTH} printable characters without spaces, ':' or globs")
    return value


def meta_key(cluster: str, instance_id: str) -> str:
    return f"{PREFIX}:{cluster}:{META}:{instance_id}"


def status_key(cluster: str, instance_id: str) -> str:
    return f"{PREFIX}:{cluster}:{STATUS}:{instance_id}"


def meta_pattern(cluster: str) -> str:
    return f"{PREFIX}:{cluster}:{META}:*"


def status_pattern(cluster: str) -> str:
    return f"{PREFIX}:{cluster}:{STATUS}:*"


def events_channel(cluster: str) -> str:
    """The shared notice channel: anyone allowed to publish there may announce any key, so readers
    only GET what its notices name."""
    return f"{PREFIX}:{cluster}:{EVENTS}"


def instance_events_channel(cluster: str, instance_id: str) -> str:
    """One writer's own notice channel: Redis ACLs can confine each llumlet to publishing on its own
    (`&<this channel>`), so a record a notice carries here is trusted as that instance's."""
    return f"{events_channel(cluster)}:{instance_id}"


def instance_events_pattern(cluster: str) -> str:
    """What readers PSUBSCRIBE to: every writer's own channel (ids hold no glob characters)."""
    return f"{events_channel(cluster)}:*"


def instance_of(key: str | bytes) -> str:
    """The instance id at the end of a meta or status key, for display (a name that is not UTF-8
    shows its bad bytes as U+FFFD): a reader takes ids with `instance_in`, which checks the key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    return text.rsplit(":", 1)[-1]


def instance_in(key: str | bytes, cluster: str, kind: str) -> str:
    """The instance id of a key that is exactly `pilotfish:<cluster>:<kind>:<instance>`, or BadId.

    The SCAN pattern's `*` matches anything, ':' and bytes that are not UTF-8 included, so a key
    found by it may be any name anyone wrote: `meta:x:engine-1` must not pass as another key of
    engine-1's, nor one that does not decode stop the reader."""
    prefix = f"{PREFIX}:{cluster}:{kind}:"
    # bounded before decoding: an id is at most MAX_ID_LENGTH characters of at most 4 bytes
    if len(key) > len(prefix) + 4 * MAX_ID_LENGTH:
        raise BadId(f"key of {len(key)} characters is longer than any {kind} key")
    if isinstance(key, bytes):
        try:
            key = key.decode()
        except UnicodeDecodeError:
            raise BadId(f"key {key[:120]!r} is not UTF-8") from None
    if not key.startswith(prefix):
        raise BadId(f"key {key[:120]!r} is not {prefix}<instance>")
    return check_id(key[len(prefix) :], "instance id of key")
