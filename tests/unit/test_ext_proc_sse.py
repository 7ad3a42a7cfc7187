"""Token counting over SSE, whatever the chunk boundaries."""

import json

from hypothesis import given
from hypothesis import strategies as st

from pilotfish.ext_proc.sse import TokenCounter


def sse_stream(tokens: int, usage: bool = False, chat: bool = False) -> bytes:
    events = []
    for i in range(tokens):
        choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
        events.append({"id": "x", "choices": [choice]})
    if usage:
        events.append({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def feed_in_pieces(data: bytes, cuts: list[int]) -> TokenCounter:
    counter = TokenCounter()
    points = sorted({c % (len(data) + 1) for c in cuts})
    last = 0
    for p in [*points, len(data)]:
        counter.feed(data[last:p])
        last = p
    counter.finish()
    return counter


@given(tokens=st.integers(0, 40), cuts=st.lists(st.integers(0, 10_000), max_size=30), chat=st.booleans())
def test_count_is_independent_of_chunking(tokens, cuts, chat):
    counter = feed_in_pieces(sse_stream(tokens, chat=chat), cuts)
    assert counter.tokens == tokens
    assert counter.done
    assert not counter.exact


@given(tokens=st.integers(0, 40), cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_usage_chunk_makes_the_count_exact(tokens, cuts):
    counter = feed_in_pieces(sse_stream(tokens, usage=True), cuts)
    assert counter.tokens == tokens
    assert counter.exact


def test_crlf_framing_and_empty_deltas():
    data = (
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\r\n\r\n'
        b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
        b"data: not json\r\n\r\n"
        b"data: [DONE]\r\n\r\n"
    )
    counter = TokenCounter()
    counter.feed(data)
    assert counter.tokens == 1
    assert counter.done


def test_unterminated_last_event_counts_at_finish():
    counter = TokenCounter()
    counter.feed(b'data: {"choices":[{"text":"a"}]}')
    assert counter.tokens == 0
    counter.finish()
    assert counter.tokens == 1
