"""The CMS reader's notices from a channel it has seen before take a shorter path with the same outcome."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.cms import keys
from pilotfish.cms.notices import MAX_NOTICE
from pilotfish.cms.reader import NOTICE_SENDER, CmsReader, _Subscription
from pilotfish.protos import cms_pb2
from tests.unit.test_cms_validation import _Sink

CLUSTER = "c"


Sink = _Sink  # the reader's view, recording what it is handed (statuses whole, refusals)


class _Previous(asyncio.BaseProtocol):
    pass


def pmessage(channel_instance: str, data: bytes) -> bytes:
    channel = keys.instance_events_channel(CLUSTER, channel_instance).encode()
    parts = [b"pmessage", keys.instance_events_pattern(CLUSTER).encode(), channel, data]
    return b"*4\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def record(instance_id: str, update_id: int) -> bytes:
    return cms_pb2.InstanceStatus(instance_id=instance_id, update_id=update_id).SerializeToString()


def outcome(sub: _Subscription, sink: Sink, reader: CmsReader, frame: bytes) -> tuple[object, ...]:
    """What one notice did: statuses handed over, refusals, keys left to GET, notices counted."""
    before = (len(sink.statuses), len(sink.refused), reader.num_notices, reader.num_bad_records)
    sub.to_read = {}
    sub.data_received(frame)
    assert sub.ended is None
    return (
        [(status.instance_id, status.update_id) for status in sink.statuses[before[0] :]],
        sink.refused[before[1] :],
        dict(sub.to_read),
        reader.num_notices - before[2],
        reader.num_bad_records - before[3],
    )


def reader_pair(notice_records: bool) -> list[tuple[_Subscription, Sink, CmsReader]]:
    """A reader that has taken one notice on sim-0's channel (its id checked), and a fresh one."""
    pair = []
    for warm in (True, False):
        sink = Sink()
        reader = CmsReader("redis://127.0.0.1:1/0", CLUSTER, sink, notice_records=notice_records)
        sub = _Subscription(reader, _Previous())
        if warm:
            outcome(sub, sink, reader, pmessage("sim-0", b"status:sim-0:" + record("sim-0", 1)))
            # a new record each time below: the reader skips a value identical to the one it handed over
            assert b"sim-0" in reader._senders
        pair.append((sub, sink, reader))
    return pair


NOTICES = [
    b"status:sim-0:" + record("sim-0", 2),  # the usual one
    b"status:sim-0:",  # an empty record: refused as malformed either way
    b"status:sim-0:" + record("sim-1", 2),  # a record naming another instance than its channel's
    b"status:sim-1:" + record("sim-1", 2),  # a notice about another instance: refused as its sender
    b"status:sim-0",  # plain: GET the key
    b"meta:sim-0",
    b"status:sim-0:" + b"x" * MAX_NOTICE,  # over the bound: no notice of ours
    b"status:sim-00:" + record("sim-00", 2),  # the channel's id is a prefix of the notice's
    b"status:sim-0::" + record("sim-0", 2),
]


@pytest.mark.parametrize("notice_records", [True, False])
@pytest.mark.parametrize("data", NOTICES)
def test_a_known_channel_gives_what_a_first_notice_does(data: bytes, notice_records: bool) -> None:
    (warm, warm_sink, warm_reader), (cold, cold_sink, cold_reader) = reader_pair(notice_records)
    warm_out = outcome(warm, warm_sink, warm_reader, pmessage("sim-0", data))
    cold_out = outcome(cold, cold_sink, cold_reader, pmessage("sim-0", data))
    assert warm_out == cold_out


def test_a_known_channel_still_refuses_a_notice_about_another_instance() -> None:
    (sub, sink, reader), _ = reader_pair(True)
    about_another = pmessage("sim-0", b"status:sim-1:" + record("sim-1", 5))
    statuses, refused, to_read, counted, _ = outcome(sub, sink, reader, about_another)
    assert (statuses, refused, to_read, counted) == ([], [("sim-1", NOTICE_SENDER)], {}, 1)
    statuses, refused, *_ = outcome(sub, sink, reader, pmessage("sim-0", b"status:sim-0:" + record("sim-0", 6)))
    assert (statuses, refused) == ([("sim-0", 6)], [])


@settings(max_examples=200, deadline=None)
@given(
    tail=st.binary(max_size=64),
    head=st.sampled_from(
        [b"status:sim-0:", b"status:sim-0", b"meta:sim-0", b"status:", b"", b"status:sim-", b"x:sim-0:"]
    ),
    notice_records=st.booleans(),
)
def test_any_notice_on_a_known_channel_gives_what_a_first_notice_does(
    tail: bytes, head: bytes, notice_records: bool
) -> None:
    (warm, warm_sink, warm_reader), (cold, cold_sink, cold_reader) = reader_pair(notice_records)
    frame = pmessage("sim-0", head + tail)
    assert outcome(warm, warm_sink, warm_reader, frame) == outcome(cold, cold_sink, cold_reader, frame)


class _ScanPipeline:
    """redis-py's pipeline as `_scan` uses it: SCAN pages served from a fixed table per pattern."""

    def __init__(self, pages: dict[str, list[list[bytes]]], log: list[list[tuple[str, int]]]) -> None:
        self._pages, self._log, self._queued = pages, log, []

    def scan(self, cursor: int, match: str, count: int) -> None:
        self._queued.append((match, cursor))

    async def execute(self) -> list[tuple[int, list[bytes]]]:
        self._log.append(list(self._queued))
        replies = []
        for match, cursor in self._queued:
            pages = self._pages[match]
            replies.append((cursor + 1 if cursor + 1 < len(pages) else 0, pages[cursor]))
        return replies


def test_the_scans_of_both_patterns_share_round_trips_until_each_cursor_ends() -> None:
    pages = {"m*": [[b"m1"], [b"m2", b"m3"], []], "s*": [[b"s1", b"s2"]]}
    log: list[list[tuple[str, int]]] = []

    class Client:
        def pipeline(self, transaction: bool) -> _ScanPipeline:
            return _ScanPipeline(pages, log)

    reader = CmsReader("redis://127.0.0.1:1/0", CLUSTER, Sink())
    reader._client = Client()
    found = asyncio.run(reader._scan("m*", "s*"))
    assert found == [[b"m1", b"m2", b"m3"], [b"s1", b"s2"]]
    # each pattern asked again only while its cursor is not back at 0
    assert log == [[("m*", 0), ("s*", 0)], [("m*", 1)], [("m*", 2)]]


def test_an_oversized_or_malformed_notice_is_refused_and_the_subscription_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from pilotfish.cms.notices import MAX_BULK

    sink = Sink()
    reader = CmsReader("redis://127.0.0.1:1/0", CLUSTER, sink)
    sub = _Subscription(reader, _Previous())
    caplog.set_level(logging.WARNING)
    huge = pmessage("sim-0", b"status:sim-0:" + b"x" * (MAX_BULK + 3000))
    stream = pmessage("sim-1", b"status:sim-1:" + record("sim-1", 1))
    for _ in range(200):  # a stream of them on sim-0's own channel, cut where the reads fall
        stream += huge + pmessage("sim-0", b"nonsense")
    stream += pmessage("sim-1", b"status:sim-1:" + record("sim-1", 2))
    for i in range(0, len(stream), 4096):
        sub.data_received(stream[i : i + 4096])
        assert sub.ended is None  # the connection every instance's notices share stays up
    # the other instance's notices all arrive
    assert [(s.instance_id, s.update_id) for s in sink.statuses] == [("sim-1", 1), ("sim-1", 2)]
    assert reader.refused_by_reason == {"oversize": 200, "malformed": 200}
    assert sink.refused.count(("sim-0", "oversize")) == 200
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per instance and reason, rate-limited
