"""The fallback tokenizer's fast path gives exactly the ids of its definition (regex pieces, crc32)."""

from __future__ import annotations

import zlib

from hypothesis import example, given
from hypothesis import strategies as st

from pilotfish.cms import fallback_tokens
from pilotfish.cms.fallback_tokens import VOCAB, fallback_pieces, fallback_token_ids


def defined_ids(text: str) -> list[int]:
    return [zlib.crc32(p.encode()) % VOCAB for p in fallback_pieces(text)]


# texts that exercise the cut points: words, runs of spaces, other whitespace, digits, punctuation
_ALPHABET = st.sampled_from(
    ["a", "b", "Zq", "abcdefghij", "abcdefghijk", " ", "  ", "\n", "\t", "1", "12345", "_", ",", "é", "²", "\x1c"]
)
_PROSE = st.lists(_ALPHABET, max_size=40).map("".join)


@given(_PROSE)
@example(" word")
@example("word word ")
@example(" \n word")
@example("\n word")
@example(" abcdefghijk")
@example("x abcdefghijk")
@example("x  y")
@example("abcdefghijk lm")
def test_fast_ids_are_the_defined_ids(text: str) -> None:
    assert fallback_token_ids(text) == defined_ids(text)
    assert fallback_token_ids(text) == defined_ids(text)  # again, with its words known


@given(st.text())
def test_fast_ids_are_the_defined_ids_for_any_text(text: str) -> None:
    assert fallback_token_ids(text) == defined_ids(text)


def test_known_words_stop_at_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(fallback_tokens, "_word_ids", {})
    monkeypatch.setattr(fallback_tokens, "MAX_CACHED_WORDS", 3)
    text = " alpha beta gamma delta epsilon"
    assert fallback_token_ids(text) == defined_ids(text)
    assert len(fallback_tokens._word_ids) == 3
    assert fallback_token_ids(text) == defined_ids(text)  # the words past the bound are computed each time
