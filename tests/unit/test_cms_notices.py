"""CMS notices: what a status write publishes, how the reader splits it, and the RESP push parser."""

from __future__ import annotations

import pytest

from pilotfish.cms import keys
from pilotfish.cms.notices import (
    MAX_BULK,
    MAX_INLINE_RECORD,
    MAX_NOTICE,
    MAX_PENDING,
    OVERSIZED,
    ProtocolError,
    PushParser,
    split_notice,
    status_notice,
)


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def push(*parts: bytes, resp3: bool = True) -> bytes:
    return (b">%d\r\n" if resp3 else b"*%d\r\n") % len(parts) + b"".join(bulk(p) for p in parts)


def test_a_small_status_travels_inline_and_splits_back() -> None:
    record = b"\x08\x07:\x00\r\n:binary"  # colons and CRLF inside the record are fine
    notice = status_notice("e0", record)
    assert notice == b"status:e0:" + record
    assert split_notice(notice) == (keys.STATUS, "e0", record)


def test_a_large_status_is_announced_plainly() -> None:
    record = b"x" * (MAX_INLINE_RECORD + 1)
    assert status_notice("e0", record) == b"status:e0"
    assert split_notice(b"status:e0") == (keys.STATUS, "e0", None)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"meta:e1", (keys.META, "e1", None)),
        (b"status:e1", (keys.STATUS, "e1", None)),
        (b"status:e1:", (keys.STATUS, "e1", b"")),
        (b"meta:e1:tail", None),  # only statuses carry a record; ':' is no id character
        (b"other:e1", None),
        (b"status", None),
        (b"status:", None),
        (b"status:bad id:x", None),
        (b"status:\xff\xfe:x", None),
        (b"status:" + b"a" * (keys.MAX_ID_LENGTH + 1) + b":x", None),
        (b"status:e1:" + b"x" * MAX_NOTICE, None),
    ],
)
def test_split_notice(data: bytes, expected: tuple[str, str, bytes | None] | None) -> None:
    assert split_notice(data) == expected


@pytest.mark.parametrize("resp3", [True, False])
def test_parser_yields_whole_messages_however_the_bytes_are_cut(resp3: bool) -> None:
    confirm = (b">3\r\n" if resp3 else b"*3\r\n") + bulk(b"subscribe") + bulk(b"ch") + b":1\r\n"
    stream = confirm + push(b"message", b"ch", b"status:a:\r\n\x00", resp3=resp3) + push(b"message", b"ch", b"meta:b")
    want = [[b"subscribe", b"ch", 1], [b"message", b"ch", b"status:a:\r\n\x00"], [b"message", b"ch", b"meta:b"]]
    for cut in range(1, 12):  # every chunking from 1 byte at a time upwards
        parser = PushParser()
        got = []
        for i in range(0, len(stream), cut):
            got += parser.feed(stream[i : i + cut])
        assert got == want, cut


def test_parser_takes_nulls_and_simple_strings() -> None:
    assert PushParser().feed(b"*3\r\n+message\r\n$-1\r\n_\r\n") == [[b"message", None, None]]


@pytest.mark.parametrize(
    "data",
    [
        b"-NOPERM this user has no permissions\r\n",  # a refused SUBSCRIBE
        b"*100\r\n",
        b"?1\r\n",
        b"*x\r\n",
        b"*1\r\n" + b"1" * 100,  # a header line that never ends
    ],
)
def test_parser_refuses_what_no_notice_looks_like(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        PushParser().feed(data)


@pytest.mark.parametrize("resp3", [True, False])
def test_an_oversized_bulk_is_discarded_unbuffered_and_the_stream_goes_on(resp3: bool) -> None:
    big = b"status:e1:" + b"x" * (MAX_BULK + 5000)
    stream = (
        push(b"pmessage", b"p*", b"ch:e0", b"status:e0:a", resp3=resp3)
        + push(b"pmessage", b"p*", b"ch:e1", big, resp3=resp3)
        + push(b"message", b"ch", b"meta:e2", resp3=resp3)
    )
    want = [
        [b"pmessage", b"p*", b"ch:e0", b"status:e0:a"],
        [b"pmessage", b"p*", b"ch:e1", OVERSIZED],
        [b"message", b"ch", b"meta:e2"],
    ]
    for cut in (1, 7, 1000, 4096, len(stream)):
        parser = PushParser()
        got = []
        for i in range(0, len(stream), cut):
            got += parser.feed(stream[i : i + cut])
            assert len(parser._buf) <= 64 + 32  # the big bulk's bytes are never buffered
        assert got == want, cut


def test_a_bulk_over_the_bound_is_refused_before_it_is_buffered() -> None:
    parser = PushParser()
    assert parser.feed(b"$%d\r\n" % (MAX_BULK + 1)) == []
    assert parser.feed(b"y" * MAX_BULK) == [] and parser._buf == b"\x00\r\n"
    assert MAX_PENDING >= 4 * MAX_BULK  # a pmessage's four bulks within the bound may wait whole
