"""The simulated engine's prompt tokens and generated text.

Without a tokenizer file it uses `fallback_token_ids` (cms/fallback_tokens.py), the same function
the gateway uses, so the gateway's prompt count and prefix hashes agree with the engine's exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pilotfish.cms.fallback_tokens import VOCAB, fallback_pieces, fallback_token_ids

__all__ = ["WORDS", "Tokenizer", "fallback_pieces", "fallback_token_ids", "load_tokenizer", "render_chat"]

# Generated text cycles through these; each is one fallback token, so a conversation that sends
# an answer back as its next prompt counts it as the same number of tokens.
WORDS = (
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as",
    " was", " with", " be", " by", " on", " not", " he", " this", " are", " or",
    " his", " from", " at", " which", " but", " have", " an", " had", " they", " you",
)  # fmt: skip


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """A fixed chat template: the prompt a chat request stands for, before tokenizing."""
    parts = []
    for message in messages:
        parts.append(f"<|{message.get('role', 'user')}|>\n{message_text(message)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def generated_word(index: int) -> str:
    return WORDS[index % len(WORDS)]


def generated_token_id(index: int) -> int:
    # above the fallback vocabulary, so generated tokens never collide with prompt pieces
    return VOCAB + index % len(WORDS)


# the engine's step loop looks a token up instead of calling: GENERATED_TOKEN_IDS[index % NUM_GENERATED]
NUM_GENERATED = len(WORDS)
GENERATED_TOKEN_IDS = tuple(generated_token_id(i) for i in range(NUM_GENERATED))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class FallbackTokenizer:
    def encode(self, text: str) -> list[int]:
        return fallback_token_ids(text)


class FileTokenizer:
    """A Hugging Face `tokenizers` file (tokenizer.json)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from pilotfish.config import ConfigError

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception for every failure
            raise ConfigError(f"--tokenizer-path {path}: cannot load tokenizer: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(path: str | None) -> Tokenizer:
    return FileTokenizer(path) if path else FallbackTokenizer()
