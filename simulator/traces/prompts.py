"""Token ids and prompt text for trace segments, consistent with the fallback tokenizer.

A segment's tokens are words drawn from a fixed pool by a PRNG seeded with the segment key, so
the same key always gives the same tokens. Every pool word is one fallback-tokenizer piece that
starts with a space, so the text of a prompt (its segments' words joined) tokenizes back to
exactly `prompt_token_ids`: an HTTP replay through the simulator builds the same prefixes,
block hashes and cache hits as the virtual-time cluster. Real tokenizers split the words
differently, but equal segments still give equal text prefixes.
"""

from __future__ import annotations

import functools
import random
import sys
import zlib
from array import array
from operator import itemgetter

from pilotfish.simulator.tokens import fallback_token_ids
from pilotfish.simulator.traces.model import Segment, TraceRequest

_POOL_SIZE = 4096  # a power of two: a PRNG's 16-bit draw masks into it
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _build_pool() -> tuple[tuple[str, ...], tuple[int, ...]]:
    rng = random.Random("pilotfish-trace-words")
    words: list[str] = []
    ids: list[int] = []
    seen: set[int] = set()
    while len(words) < _POOL_SIZE:
        word = " " + "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 9)))
        (token,) = fallback_token_ids(word)
        if token in seen:  # distinct ids, so distinct segments rarely collide
            continue
        seen.add(token)
        words.append(word)
        ids.append(token)
    return tuple(words), tuple(ids)


_WORDS, _IDS = _build_pool()


_CHUNK = 512  # Mooncake's block: one chunk per hash id, cached whole, so a partial last block is its prefix


# the pool's mask (4,095) applied to a 16-bit draw touches only its high byte: each high byte goes through this table
_HIGH_BYTE_MASKED = bytes(b & ((_POOL_SIZE - 1) >> 8) for b in range(256))
_HIGH_BYTE = 1 if sys.byteorder == "little" else 0  # where a native 16-bit draw keeps its high byte


def _chunk_indices(key: str, index: int, count: int = _CHUNK) -> array:
    """The pool indices of the chunk's first `count` tokens. The PRNG's bytes come 32 bits at a time, lowest
    first, so the bytes of whole words are a prefix of the whole chunk's: a short segment (a trace with small
    blocks: 16 tokens a hash id) draws only what it uses, the same tokens."""
    seed = key if index == 0 else f"{key}/{index}"
    # each native 16-bit draw masked into the pool, its high byte through a table in C (a loop per draw was
    # four fifths of the cost: a bench matrix's traces draw tens of thousands of chunks)
    draws = bytearray(random.Random(seed).randbytes(4 * ((count + 1) // 2)))
    draws[_HIGH_BYTE::2] = draws[_HIGH_BYTE::2].translate(_HIGH_BYTE_MASKED)
    out = array("H", draws)
    del out[count:]
    return out


@functools.lru_cache(maxsize=32768)
def _chunk_ids(key: str, index: int) -> tuple[int, ...]:
    # cached: a trace's prompts are mostly shared blocks, and a cluster run rebuilds them per request. The pool's
    # ids picked by one itemgetter of the chunk's indices (a tuple of them, as _CHUNK > 1), in C
    return itemgetter(*_chunk_indices(key, index))(_IDS)


@functools.lru_cache(maxsize=65536)
def _head_ids(key: str, length: int) -> tuple[int, ...]:
    """The first `length` (under a chunk) token ids of the key: its first chunk's, drawn alone."""
    ids = _IDS
    return tuple([ids[i] for i in _chunk_indices(key, 0, length)])


def _chunks(length: int) -> range:
    return range((length + _CHUNK - 1) // _CHUNK)


def segment_token_ids(segment: Segment) -> list[int]:
    # chunk by chunk, so a segment's tokens are a prefix of the same key's longer segments
    key, length = segment
    if length < _CHUNK:
        return list(_head_ids(key, length))
    out: list[int] = []
    for c in _chunks(length):
        out.extend(_chunk_ids(key, c))
    del out[length:]
    return out


def segment_text(segment: Segment) -> str:
    key, length = segment
    words = _WORDS
    indices: list[int] = []
    for c in _chunks(length):
        indices.extend(_chunk_indices(key, c, min(_CHUNK, length - c * _CHUNK)))
    return "".join(words[i] for i in indices[:length])


def prompt_token_ids(request: TraceRequest) -> list[int]:
    return segments_token_ids(request.segments)


def segments_token_ids(segments: tuple[Segment, ...]) -> list[int]:
    """The token ids of a prompt made of `segments` (a prompt's are a function of its segments alone)."""
    out: list[int] = []
    for key, length in segments:
        if length == _CHUNK:
            out.extend(_chunk_ids(key, 0))  # the common Mooncake block, without a copy
        elif length < _CHUNK:
            out.extend(_head_ids(key, length))
        else:
            out.extend(segment_token_ids((key, length)))
    return out


def prompt_text(request: TraceRequest) -> str:
    """Text whose fallback token ids are `prompt_token_ids(request)`; for replay over HTTP."""
    return "".join(segment_text(s) for s in request.segments)


def check_round_trip(request: TraceRequest) -> bool:
    return fallback_token_ids(prompt_text(request)) == prompt_token_ids(request)


def stable_key(*parts: object) -> str:
    """A segment key; a crc keeps keys short when parts are long."""
    text = ":".join(str(p) for p in parts)
    return text if len(text) <= 64 else f"{text[:32]}~{zlib.crc32(text.encode()):08x}"
