"""The answer's length from the size of a stream read only to its first token (--response-bodies first-token)."""

from __future__ import annotations

import json
import random

import pytest

from pilotfish.ext_proc.answer_size import AnswerSizes
from pilotfish.ext_proc.sse import TokenCounter


def _event(text: str | None, api: str) -> bytes:
    if api == "chat":
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        chunk = {"id": "chatcmpl-0f3a9c", "object": "chat.completion.chunk", "created": 1764300000,
                 "model": "meta-llama/Llama-3.1-8B-Instruct", "choices": [choice]}  # fmt: skip
    else:
        chunk = {"id": "cmpl-0f3a9c", "object": "text_completion", "created": 1764300000, "model": "m",
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("answer", [1, 7, 64, 900])
def test_the_estimate_is_within_a_few_percent_of_the_answer(api: str, answer: int) -> None:
    rng = random.Random(answer)
    words = [" the", " a", " tokenization", ",", " Python", "\n", " 42", " über", "."]
    events = ([_event(None, api)] if api == "chat" else []) + [_event(rng.choice(words), api) for _ in range(answer)]
    body = b"".join(events) + b"data: [DONE]\n\n"
    counter = TokenCounter()
    for event in events:  # read to the first token, as the ext_proc does
        counter.feed(event)
        if counter.tokens:
            break
    sizes = AnswerSizes()
    sizes.read("r", counter.complete_bytes, counter.events, counter.tokens)
    estimate = sizes.estimate("r", len(body))
    assert abs(estimate - answer) <= max(1, 0.05 * answer), estimate
    assert sizes.estimate("r", len(body)) == 0 and len(sizes) == 0  # forgotten once used


def test_what_was_read_is_bounded_and_an_unread_stream_counts_what_it_counted() -> None:
    sizes = AnswerSizes(capacity=2)
    for rid in ("a", "b", "c"):
        sizes.read(rid, 200, 1, 1)
    assert len(sizes) == 2 and sizes.estimate("a", 10_000) == 0  # the oldest went first
    assert sizes.estimate("c", 100) == 1  # a body no longer than what was read adds nothing
    sizes.read("d", 0, 0, 3)  # a stream that ended before any complete event
    assert sizes.estimate("d", 500) == 3
