"""The fallback tokenizer the simulator and the gateway share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pilotfish.simulator.tokens import WORDS, fallback_pieces, fallback_token_ids


@given(st.text())
def test_pieces_rejoin_to_the_text(text: str) -> None:
    assert "".join(fallback_pieces(text)) == text
    assert fallback_token_ids(text) == fallback_token_ids(text)


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello world", ["Hello", " world"]),
        ("Hello, world!", ["Hello", ",", " world", "!"]),
        ("year 20245", ["year", " 202", "45"]),
        ("a  b", ["a", "  ", "b"]),
        ("internationalization", ["internatio", "nalization"]),
    ],
)
def test_pieces(text: str, pieces: list[str]) -> None:
    assert fallback_pieces(text) == pieces


def test_generated_words_are_one_token_each() -> None:
    assert all(len(fallback_token_ids(w)) == 1 for w in WORDS)
    assert len(fallback_token_ids("".join(WORDS))) == len(WORDS)
