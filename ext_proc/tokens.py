"""Prompt tokenization: a real tokenizer when one is configured, else a deterministic fallback.

The token ids give the prompt token count and the prefix block hashes the scheduler matches.
Tokenizers come from a local file (`--tokenizer-path`) or from an installed Python package
that ships one (`--tokenizer-name package` or `package:path/inside/it`); nothing is ever
downloaded. Without one, the fallback tokenizer (cms/fallback_tokens.py) is used: exact for
simulated engines, which use it too, an estimate for real ones (about one token per word or
punctuation mark).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path


def packaged_tokenizer(name: str) -> Path:
    """The tokenizer.json inside an installed package; FileNotFoundError names what was tried."""
    package, _, inner = name.partition(":")
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"--tokenizer-name {name}: no installed package {package!r}") from None
    candidate = root.joinpath(inner) if inner else root
    if candidate.is_file():
        return Path(str(candidate))
    found = sorted(Path(str(candidate)).rglob("tokenizer.json")) if Path(str(candidate)).is_dir() else []
    if not found:
        raise FileNotFoundError(f"--tokenizer-name {name}: package {package!r} ships no tokenizer.json")
    return found[0]


def tokenizer(tokenizer_path: str = "", tokenizer_name: str = "") -> Callable[[str], list[int]]:
    """The text -> token ids function for the configured tokenizer."""
    if tokenizer_path and tokenizer_name:
        raise FileNotFoundError("give --tokenizer-path or --tokenizer-name, not both")
    if tokenizer_name:
        path = packaged_tokenizer(tokenizer_name)
    elif tokenizer_path:
        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer-path {tokenizer_path}: no tokenizer.json there")
    else:
        from pilotfish.cms.fallback_tokens import fallback_token_ids

        return fallback_token_ids
    from tokenizers import Tokenizer

    try:
        loaded = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise FileNotFoundError(f"{path} is not a readable tokenizer.json: {exc}") from None

    def encode(text: str) -> list[int]:
        return loaded.encode(text, add_special_tokens=False).ids

    return encode
