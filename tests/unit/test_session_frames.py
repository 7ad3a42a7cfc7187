"""The Session socket's framing: whole payloads out of any split of the byte stream, and a bound."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pilotfish.protos.session_frames import FrameError, FrameReader, frame


@given(
    payloads=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
)
def test_any_split_of_the_stream_yields_the_payloads_in_order(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    reader = FrameReader()
    out: list[bytes] = []
    for a, b in itertools.pairwise(points):
        out += reader.feed(stream[a:b])
    assert out == payloads
    assert reader.buffered == 0


def test_a_partial_frame_waits_for_the_rest() -> None:
    reader = FrameReader()
    data = frame(b"hello")
    assert reader.feed(data[:3]) == []
    assert reader.feed(data[3:7]) == []
    assert reader.buffered == 7
    assert reader.feed(data[7:] + frame(b"")) == [b"hello", b""]


def test_an_oversized_length_is_refused_before_its_body_arrives() -> None:
    reader = FrameReader(limit=100)
    assert reader.feed(frame(b"x" * 100)) == [b"x" * 100]
    with pytest.raises(FrameError, match="101 bytes is over the 100-byte limit"):
        reader.feed((101).to_bytes(4, "big"))
