"""Chained hashes of full KV blocks: block i's hash covers its tokens and every block before it.

Two requests share block i's hash when their first (i+1)*block_size tokens are equal (and,
barring a 64-bit collision, only then), which is what makes a hash lookup a prefix match.
Python's hash of a tuple of ints is not randomised per process, so the gateway computing the
same hashes gets the same values. The root is a constant, not None: before Python 3.12
hash(None) is an address and differs per run.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> list[int]:
    """Append the hashes of blocks that `token_ids` now fills beyond those already in `hashes`."""
    full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), full):
        # hash_block, inlined: every prompt's blocks are hashed here, a long prompt's by the thousand
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    return extend_block_hashes([], token_ids, block_size)


def extend_block_hashes_from(hashes: list[int], tail: Sequence[int], block_size: int) -> list[int]:
    """`extend_block_hashes` given only the tokens after the blocks `hashes` covers (`tail`)."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(tail) // block_size):
        parent = hash((parent, tuple(tail[i * block_size:(i + 1) * block_size])))  # hash_block, inlined
        hashes.append(parent)
    return hashes
