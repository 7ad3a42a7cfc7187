"""Chained prefix block hashes: the ONE function that turns token ids into prefix-cache keys.

The gateway calls `prefix_block_hashes` on every prompt and sends the result in
`ScheduleRequest.prefix_block_hashes`; the scheduler's prefix index stores and matches the
same values; the llumlet, when it forwards the engine's KV-cache events, re-hashes the token
ids of each stored block with this function (vLLM's own block hashes are process-local and
differ by version, so they are never sent). One definition keeps all three in agreement.

Definition (version 1), for `token_ids` cut into full blocks of `block_size` tokens
(a trailing partial block is not hashed, as an engine does not cache it):

    h[-1] = 0
    h[i]  = uint64 little-endian of BLAKE2b-64(key=b"pilotfish-prefix-v1",
                                               h[i-1] as 8 bytes LE || block i's ids as uint32 LE)

Each hash covers the whole prefix up to the end of its block, so two prompts share hash i
exactly when they share their first (i+1)*block_size tokens (up to 2^-64 collisions).
Stable across processes, hosts and Python versions (no `hash()`, no pickling); about 1 µs
per block with the standard library only. Token ids must fit in 32 bits.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

HASH_KEY = b"pilotfish-prefix-v1"
_U64 = struct.Struct("<Q")


# Tokens per hashed block that the gateway sends and the scheduler expects unless an operator sets
# both: coarser than an engine's block is fine for routing and cheaper to hash.
DEFAULT_BLOCK_SIZE = 64

def prefix_block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids`, first block first.

    `parent` continues a chain (the hash of the block before `token_ids[0]`); 0 starts one.
    Raises ValueError for a block size below 1 or a token id outside [0, 2^32).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    full = len(token_ids) - len(token_ids) % block_size
    if not full:
        return []
    try:
        packed = struct.pack(f"<{full}I", *token_ids[:full])
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2^32)") from None
    step = block_size * 4
    out: list[int] = []
    prev = _U64.pack(parent)
    for start in range(0, len(packed), step):
        digest = blake2b(prev, digest_size=8, key=HASH_KEY)
        digest.update(packed[start : start + step])
        prev = digest.digest()
        out.append(_U64.unpack(prev)[0])
    return out
