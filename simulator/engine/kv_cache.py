"""A paged KV cache as vLLM V1 keeps it: a block pool, prefix caching by block hash, LRU eviction.

A block is in use while some request holds it (ref_cnt > 0). A freed block keeps its hash and
stays findable until it is handed out again; free blocks are handed out oldest-freed first, and
a request frees its blocks tail first, so the end of a prompt is evicted before its beginning.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import msgspec

from pilotfish.simulator.engine.block_hash import extend_block_hashes_from
from pilotfish.simulator.engine.request import SimRequest


class KVBlock(msgspec.Struct, eq=False, gc=False):
    """One block: compared by identity. A Struct untracked by the garbage collector (it holds only
    ints): an engine makes up to num_gpu_blocks of them, and as tracked objects a 64-engine cluster's
    two million blocks cost a second of collections; they can never be part of a cycle."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Blocks never used yet are made on demand, so a large cache costs nothing until it fills.
        # They come before every freed block in vLLM's free queue, so they are handed out first.
        self._blocks: list[KVBlock] = []
        self._fresh = 0  # blocks with ids from here on were never handed out
        self._free: OrderedDict[int, KVBlock] = OrderedDict()  # freed blocks, least recently freed first
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding that prefix
        self.num_evictions = 0
        # KV events, when someone publishes them (None: off, nothing recorded). Raw tuples, encoded
        # by the publisher: ("stored", hashes, parent hash or None, token ids) and ("removed", hash)
        self.events: list[tuple] | None = None

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def materialize(self) -> None:
        """Create every block object now; they are still handed out fresh ones first, in id order."""
        self._blocks.extend(KVBlock(i) for i in range(len(self._blocks), self.num_blocks))

    def block(self, block_id: int) -> KVBlock:
        return self._blocks[block_id]

    def take(self, n: int) -> list[KVBlock]:
        """`n` free blocks, each now held once; evicts cached ones when it must."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        # never-used blocks first, in id order, taken as one slice (a long prompt takes hundreds)
        fresh = self._fresh
        num_fresh = min(n, self.num_blocks - fresh)
        blocks = self._blocks
        if len(blocks) < fresh + num_fresh:
            blocks.extend(map(KVBlock, range(len(blocks), fresh + num_fresh)))
        out = blocks[fresh:fresh + num_fresh]
        for block in out:
            block.ref_cnt = 1
        self._fresh = fresh + num_fresh
        for _ in range(n - num_fresh):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.events is not None:
                        self.events.append(("removed", block.block_hash))
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Hold cached blocks for one more request; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> list[int]:
        """Drop one hold on each block, in the given order; returns the ids that became free."""
        freed = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                freed.append(block.block_id)
        return freed

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: int) -> bool:
        """Make a computed full block findable by its hash (the first block with a hash keeps it)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False


class KVCacheManager:
    """Which blocks each request holds, and the prefix-cache lookups for new requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # leading blocks of a request already registered (the scheduler reads it to skip no-op allocations)
        self.num_registered: dict[str, int] = {}

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def computed_blocks(self, request: SimRequest) -> list[KVBlock]:
        """Cached blocks matching the request's leading full blocks.

        At most num_tokens - 1 tokens may hit: the last one is always recomputed so the step
        that finishes the prefill produces logits for the next token, as vLLM does.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = _block_hashes(request, self.block_size)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self, request: SimRequest, num_new_tokens: int, cached: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed (and `cached`) ones.

        Returns the newly taken blocks, or None, holding nothing new, when too few are free.
        """
        held = self.req_blocks.get(request.request_id, [])
        if not cached:
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(held) * self.block_size:
                # the common decode step: the tokens fit in blocks already held
                if self.enable_prefix_caching and total // self.block_size > self.num_registered.get(
                    request.request_id, 0
                ):
                    self._register(request, held, total)
                return []
        cached = cached or []
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed = math.ceil((num_computed + num_new_tokens) / self.block_size) - len(held) - len(cached)
        # cached blocks that sit in the free queue stop being free once this request holds them
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(cached)
        new = self.pool.take(max(needed, 0))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(cached)
        blocks.extend(new)
        self._register(request, blocks, num_computed + num_new_tokens)
        return new

    def _register(self, request: SimRequest, blocks: list[KVBlock], num_tokens: int) -> None:
        # only blocks whose every token is known (prompt or already sampled) can carry a hash
        if not self.enable_prefix_caching:
            return
        full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_registered.get(request.request_id, 0)
        if full <= start:
            return
        hashes = _block_hashes(request, self.block_size)
        events = self.pool.events
        if events is None:
            # BlockPool.register, inlined: a long prompt registers hundreds of blocks at once
            cached = self.pool.cached
            for i in range(start, full):
                block, block_hash = blocks[i], hashes[i]
                if block.block_hash is None and block_hash not in cached:
                    block.block_hash = block_hash
                    cached[block_hash] = block
        else:
            self._register_with_events(request, blocks, hashes, start, full, events)
        self.num_registered[request.request_id] = full

    def _register_with_events(
        self, request: SimRequest, blocks: list[KVBlock], hashes: list[int], start: int, full: int, events: list
    ) -> None:
        # one BlockStored per run of newly cached blocks, as vLLM's cache_full_blocks emits them; a
        # block whose hash another block already holds is not cached, so it is not announced
        run: list[int] = []
        cached = self.pool.cached
        for i in range(start, full + 1):
            if i < full:
                # BlockPool.register, inlined (a long prompt registers hundreds of blocks)
                block, block_hash = blocks[i], hashes[i]
                if block.block_hash is None and block_hash not in cached:
                    block.block_hash = block_hash
                    cached[block_hash] = block
                    run.append(i)
                    continue
            if run:
                first, last = run[0], run[-1]
                parent = hashes[first - 1] if first > 0 else None
                bs = self.block_size
                tokens = request.token_ids_between(first * bs, (last + 1) * bs)
                events.append(("stored", hashes[first:last + 1], parent, tokens))
                run = []

    def free(self, request: SimRequest) -> list[int]:
        """Release every block the request holds, tail first; returns the ids that became free."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        return self.pool.release(blocks[::-1])

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))


def _block_hashes(request: SimRequest, block_size: int) -> list[int]:
    """The request's block hashes, grown to cover every full block of its tokens."""
    hashes = request.block_hashes
    known = len(hashes)
    if known < request.num_tokens // block_size:
        # only the tokens after the hashed blocks, not all of them joined (a long prompt each time)
        extend_block_hashes_from(hashes, request.token_ids_between(known * block_size, request.num_tokens), block_size)
    return hashes
