"""The deterministic tokenizer the gateway and the simulated engine share when no tokenizer file
is configured, so the gateway's prompt counts and prefix hashes (prefix_hash.py) agree with the
engine's exactly. Pieces mimic BPE roughly (a word with its leading space is one token, long words
split every 10 letters), giving about as many tokens as a real English tokenizer without loading
one.
"""

from __future__ import annotations

import re
import zlib

# Every character falls in exactly one alternative, so the pieces rejoin to the text.
_PIECE = re.compile(r" ?[^\W\d_]{1,10}| ?\d{1,3}| ?[^\w\s]| ?_|\s+")
VOCAB = 100_000  # token ids are below this


def fallback_pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def fallback_token_ids(text: str) -> list[int]:
    """Deterministic token ids for `text` (crc32 of each piece): stable across processes."""
    return [zlib.crc32(p.encode()) % VOCAB for p in _PIECE.findall(text)]
