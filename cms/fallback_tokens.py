"""The deterministic tokenizer the gateway and the simulated engine share when no tokenizer file
is configured, so the gateway's prompt counts and prefix hashes (prefix_hash.py) agree with the
engine's exactly. Pieces mimic BPE roughly (a word with its leading space is one token, long words
split every 10 letters), giving about as many tokens as a real English tokenizer without loading
one.

Definition: the pieces are `_PIECE.findall(text)` and a piece's id is crc32 of its UTF-8 bytes
modulo VOCAB. `fallback_token_ids` computes exactly that, faster: the gateway tokenizes every
prompt (thousands of pieces) on its event loop, and the regex plus a crc per piece cost it more
than everything else it does for a request.
"""

from __future__ import annotations

import re
import zlib

# Every character falls in exactly one alternative, so the pieces rejoin to the text.
_PIECE = re.compile(r" ?[^\W\d_]{1,10}| ?\d{1,3}| ?[^\w\s]| ?_|\s+")
VOCAB = 100_000  # token ids are below this

# Plain words (1 to 10 letters, str.isalpha: with the space before them, one piece) -> that piece's id,
# filled as words are met. Bounded: past the bound a new word's id is computed every time.
MAX_CACHED_WORDS = 1 << 16
_word_ids: dict[str, int] = {}


def fallback_pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def _piece_ids(text: str) -> list[int]:
    """The definition itself: a crc per regex piece."""
    return [zlib.crc32(p.encode()) % VOCAB for p in _PIECE.findall(text)]


def fallback_token_ids(text: str) -> list[int]:
    """Deterministic token ids for `text` (crc32 of each piece): stable across processes.

    Why the shortcut is exact: a space with no whitespace on either side always starts a piece
    (no piece holds a non-space followed by a space, and a single space goes with what follows
    it), and the regex looks neither behind nor past the end of a piece, so cutting the text at
    such spaces and tokenizing the parts alone gives the same pieces. A part that is a plain word
    is then one piece, " word", whose id a dictionary holds; the rest goes through the regex.
    """
    parts = text.split(" ")
    first = parts[0]
    if not first or not first[-1].isspace():
        ids = list(map(_word_ids.get, parts[1:]))
        if None not in ids:  # every space starts a known plain word: the common case for prose
            return _piece_ids(first) + ids if first else ids  # type: ignore[return-value]
    return _ids_by_parts(parts)


def _ids_by_parts(parts: list[str]) -> list[int]:
    out: list[int] = []
    pending = parts[0]  # text not tokenized yet, starting at a piece boundary
    safe = not pending or not pending[-1].isspace()  # the next space starts a piece
    for part in parts[1:]:
        if safe:
            known = _word_ids.get(part)
            if known is None and part.isalpha() and len(part) <= 10:
                known = zlib.crc32(b" " + part.encode()) % VOCAB
                if len(_word_ids) < MAX_CACHED_WORDS:
                    _word_ids[part] = known
            if known is not None:
                if pending:
                    out += _piece_ids(pending)
                    pending = ""
                out.append(known)
                continue  # a word ends in a letter: the next space is safe again
        pending += " " + part
        safe = bool(part) and not part[-1].isspace()
    if pending:
        out += _piece_ids(pending)
    return out
