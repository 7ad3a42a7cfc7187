"""Prompt token counting: a real tokenizer when one is configured, else an estimate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def estimate_tokens(text: str) -> int:
    """About four characters per token for English text (OpenAI's rule of thumb)."""
    return max(1, (len(text) + 3) // 4)


def token_counter(tokenizer_path: str) -> Callable[[str], int]:
    """The counting function for the configured tokenizer; never downloads anything."""
    if not tokenizer_path:
        return estimate_tokens
    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer-path {tokenizer_path}: no tokenizer.json there")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count
