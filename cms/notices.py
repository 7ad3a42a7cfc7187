"""CMS notices on the writers' channels, and the parser the reader reads them with.

A writer publishes one notice per write on its own channel, `keys.instance_events_channel(cluster,
instance)` (readers take a record only from the channel of the instance it is about):

    "<kind>:<instance>"             look: GET the key (metadata, removals, a large status)
    "status:<instance>:<record>"    the status record itself, the same bytes the writer SET

Carrying the record spares the reader a Redis round trip per engine step (the full-mode scheduler's
largest CPU cost). Only records up to `MAX_INLINE_RECORD` travel inline, so a channel message stays
small; the key is written first either way, so a reader may always GET instead. Instance ids hold
no ':' (keys.check_id), so the first two colons split a notice unambiguously.

`PushParser` reads the subscribed connection's raw bytes (RESP2 or RESP3 pushes): redis-py's own
pub/sub reader costs several awaits and a timeout per message, where this parses every message a
read brought in one pass.
"""

from __future__ import annotations

from pilotfish.cms import keys

# the largest status record sent inline; larger ones are announced plainly and read with a GET
MAX_INLINE_RECORD = 16 * 1024
# a notice without a record: "<kind>:<instance>"
MAX_PLAIN_NOTICE = keys.MAX_ID_LENGTH + 16
MAX_NOTICE = MAX_PLAIN_NOTICE + MAX_INLINE_RECORD
# a bulk string on the subscribed connection longer than this cannot be a notice of ours: it is
# discarded as it arrives, never buffered, and the message carries OVERSIZED in its place
MAX_BULK = MAX_NOTICE + 1024
# aggregate headers we take on the subscribed connection: a message is 3 elements (pmessage 4)
MAX_ELEMENTS = 8
# an incomplete message buffered at most: a pmessage's four bulks, each within MAX_BULK
MAX_PENDING = 4 * (MAX_BULK + 64)


class _Oversized:
    """Stands, in a parsed message, for a bulk over MAX_BULK that was discarded unread."""

    def __repr__(self) -> str:
        return "OVERSIZED"


OVERSIZED = _Oversized()
# what an oversized bulk is replaced with in the parser's buffer: a type byte no RESP reply has
_MARK = b"\x00\r\n"

_STATUS_PREFIX = keys.STATUS.encode() + b":"


class ProtocolError(Exception):
    """The subscribed connection carried something no Redis pub/sub reply looks like."""


class _TooBig(Exception):
    """A bulk over MAX_BULK: its header starts at `at`, its `size` bytes at `payload`."""

    def __init__(self, at: int, payload: int, size: int) -> None:
        self.at, self.payload, self.size = at, payload, size


def pack_command(*parts: bytes) -> bytes:
    """One Redis command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def status_notice(instance_id: str, record: bytes) -> bytes:
    """The notice a status write publishes: the record inline when it is small enough."""
    plain = f"{keys.STATUS}:{instance_id}".encode()
    return plain + b":" + record if len(record) <= MAX_INLINE_RECORD else plain


def split_notice(data: bytes) -> tuple[str, str, bytes | None] | None:
    """(kind, instance id, inline record or None) of a notice, or None when it is not one of ours."""
    if len(data) > MAX_NOTICE:
        return None
    kind, sep, rest = data.partition(b":")
    if not sep:
        return None
    record: bytes | None = None
    if kind == b"status" and data.startswith(_STATUS_PREFIX):
        name, sep, tail = rest.partition(b":")
        if sep:
            rest, record = name, tail
    if len(rest) > MAX_PLAIN_NOTICE:
        return None
    try:
        instance_id = keys.check_id(rest.decode(), "instance id")
        kind_text = kind.decode()
    except (UnicodeDecodeError, keys.BadId):
        return None
    if kind_text not in (keys.META, keys.STATUS):
        return None
    return kind_text, instance_id, record


class PushParser:
    """Incremental RESP2/RESP3 parser of a subscribed connection: `feed` bytes, get whole messages.

    A message is the list of its elements (bytes, int, None, or OVERSIZED). Bounded: a bulk over
    `MAX_BULK` is discarded as its bytes arrive and its message carries OVERSIZED in its place, so
    one publisher's giant message costs neither the buffer nor the connection that every instance's
    notices share; an aggregate over `MAX_ELEMENTS`, which no publisher can cause, raises
    ProtocolError (the caller drops the connection).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._skip = 0  # bytes of an oversized bulk (and its CRLF) still to discard

    def feed(self, data: bytes) -> list[list[object]]:
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return []
            data, self._skip = data[self._skip :], 0
        buf = self._buf + data if self._buf else data
        out: list[list[object]] = []
        pos = 0
        end = len(buf)
        while pos < end:
            try:
                parsed = _parse(buf, pos, 0)
            except _TooBig as big:
                # the bulk becomes a mark, and its message is parsed again from its start
                stop = big.payload + big.size + 2
                self._skip = max(0, stop - end)
                buf = buf[: big.at] + _MARK + buf[stop:]
                end = len(buf)
                if self._skip:
                    break
                continue
            if parsed is None:
                break
            value, pos = parsed
            if isinstance(value, list):
                out.append(value)
        self._buf = buf[pos:]
        if len(self._buf) > MAX_PENDING:  # a frame that can never complete within the bounds
            raise ProtocolError(f"an incomplete reply of over {MAX_PENDING} bytes")
        return out


def _parse(buf: bytes, pos: int, depth: int) -> tuple[object, int] | None:
    """One value at `pos`: (value, position after it), or None if `buf` ends before it does."""
    eol = buf.find(b"\r\n", pos)
    if eol < 0:
        if len(buf) - pos > 64:
            raise ProtocolError("a header line over 64 bytes")
        return None
    kind = buf[pos : pos + 1]
    head = buf[pos + 1 : eol]
    after = eol + 2
    if kind == b"$":
        size = _int(head)
        if size < 0:
            return None, after  # a null bulk
        if size > MAX_BULK:
            raise _TooBig(pos, after, size)
        if len(buf) < after + size + 2:
            return None
        return buf[after : after + size], after + size + 2
    if kind in (b"*", b">"):
        count = _int(head)
        if count > MAX_ELEMENTS or depth > 1:
            raise ProtocolError(f"an aggregate of {count} at depth {depth}")
        items: list[object] = []
        for _ in range(max(count, 0)):
            # a bulk string (every element of a pub/sub message) read here, not by a call per element:
            # the same checks as the "$" case below
            if buf.startswith(b"$", after):
                at = after
                eol = buf.find(b"\r\n", after)
                if eol < 0:
                    if len(buf) - after > 64:
                        raise ProtocolError("a header line over 64 bytes")
                    return None
                size = _int(buf[after + 1 : eol])
                after = eol + 2
                if size < 0:
                    items.append(None)
                    continue
                if size > MAX_BULK:
                    raise _TooBig(at, after, size)
                if len(buf) < after + size + 2:
                    return None
                items.append(buf[after : after + size])
                after += size + 2
                continue
            parsed = _parse(buf, after, depth + 1)
            if parsed is None:
                return None
            item, after = parsed
            items.append(item)
        return items, after
    if kind == b":":
        return _int(head), after
    if kind == b"+":
        return head, after
    if kind == b"_":
        return None, after
    if kind == _MARK[:1]:
        return OVERSIZED, after
    if kind == b"-":
        raise ProtocolError(f"error reply: {head[:200].decode(errors='replace')}")
    raise ProtocolError(f"unexpected reply type {kind!r}")


def _int(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"not a number: {text[:32]!r}") from None
