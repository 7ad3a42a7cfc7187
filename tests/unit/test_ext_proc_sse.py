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


def _with_a_huge_event(huge: int) -> bytes:
    """A stream whose second event is `huge` bytes (logprobs of every prompt token, say)."""
    big = b'data: {"id": "x", "choices": [{"index": 0, "text": " b", "logprobs": "' + b"x" * huge + b'"}]}\n\n'
    stream = sse_stream(1)
    return stream[: stream.index(b"\n\n") + 2] + big + stream[stream.index(b"\n\n") + 2 :]


@given(cuts=st.lists(st.integers(0, 3 << 20), max_size=40))
def test_an_event_past_the_bound_is_counted_and_not_held(cuts):
    from pilotfish.ext_proc import sse

    stream = _with_a_huge_event(2 * sse.MAX_EVENT_BYTES)
    counter, points, last, held = TokenCounter(), sorted({c % (len(stream) + 1) for c in cuts}), 0, 0
    for p in [*points, len(stream)]:
        for start in range(last, p, 65536):  # Envoy's chunks are at most 64 KiB
            counter.feed(stream[start : min(p, start + 65536)])
            held = max(held, len(counter._tail))
        last = p
    counter.finish()
    assert (counter.tokens, counter.events, counter.oversized, counter.done) == (2, 2, 1, True)
    assert held <= sse.MAX_EVENT_BYTES + 65536  # never the whole event
    assert counter.complete_bytes == len(stream)


@given(cuts=st.lists(st.integers(0, 3 << 20), max_size=40), usage=st.booleans())
def test_the_stripper_passes_an_event_past_the_bound_on_as_it_comes(cuts, usage):
    from pilotfish.ext_proc import sse

    stream = _with_a_huge_event(2 * sse.MAX_EVENT_BYTES)
    if usage:  # the usage event the gateway asked for and the client did not: stripped
        usage_event = b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
        sent = stream.replace(b"data: [DONE]", usage_event + b"data: [DONE]")
    else:
        sent = stream
    stripper = sse.UsageStripper()
    out, points, last, held = [], sorted({c % (len(sent) + 1) for c in cuts}), 0, 0
    for p in [*points, len(sent)]:
        for start in range(last, p, 65536):
            out.append(stripper.feed(sent[start : min(p, start + 65536)]))
            held = max(held, len(stripper._tail))
        last = p
    out.append(stripper.finish())
    assert b"".join(out) == stream  # byte for byte what the client asked for
    assert held <= sse.MAX_EVENT_BYTES + 65536
    assert (stripper.counter.tokens, stripper.counter.exact) == (2, usage)
