"""Which instance holds which prefix blocks: the input of cache-aware scheduling.

Keys are the chained block hashes of `pilotfish.cms.prefix_hash` (each one names a whole
prefix), so the hit length of a request on an instance is the number of leading hashes of
the request that the instance holds. Two feeds:

- dispatch decisions (`record_dispatch`): the target will cache the prompt's blocks; this is
  all lite mode has, and it keeps full mode right between KV events;
- engine KV events (`apply_kv_event`, full mode): blocks stored and evicted as the engine
  reports them; the scheduler's subscriber (view/kv_events.py) calls it with hashes re-computed
  by `prefix_block_hashes` from the stored blocks' token ids (the virtual-time benchmark feeds
  the simulator's own hashes, which its requests carry too).

Per-instance memory is bounded: each instance keeps its most recently used `capacity` blocks
(its KV cache cannot hold more), the oldest dropped first.

The last match is kept with the index's version (bumped whenever a block's holders change), so the
cache metrics and the load index of one decision, which ask for the same request's match several times,
compute it once. A request's whole chain rarely recurs (it names its own prompt's blocks), but the part of
it anyone holds does: every request behind one system prompt stops matching at its first own block. So
matches of a widely held first block are kept by that held part, with the newest change version among its
blocks (each block remembers when its holders last changed), and reused while it stands: a lookup per block
instead of a dict of every holder per decision. No holder change touches the kept matches (keeping them
per chain and updating them on each change cost 6x the CPU of a 64-engine Mooncake cell).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

# a match is kept when its first block has at least this many holders: below, making it costs about as much
# as finding it kept (a lookup per block)
_KEEP_FROM = 8
# the matches kept, and the hits they may hold in all (an entry per instance with a hit): a few MB
_KEPT_MATCHES = 1024
_KEPT_HITS = 65536


class PrefixIndex:
    def __init__(self, default_capacity_blocks: int = 65536) -> None:
        self.default_capacity = default_capacity_blocks
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # the last match: (block hashes, scale), its hits, its distinct hit lengths, the version it was made at
        self._last: tuple[tuple[tuple[int, ...], int], dict[str, int], dict[int, int], int] | None = None
        self._version = 0  # bumped whenever a block's holders change
        # the version at which each held block's holders last changed (a block held again after it was dropped
        # gets a later one, so no stamp of it is ever reused)
        self._changed: dict[int, int] = {}
        # matches kept by the held part of their chain: (blocks, scale) -> (the newest change version among those
        # blocks, hits, hit lengths); bounded in matches and in the hits they hold, oldest dropped first
        # (an OrderedDict: dropping the oldest of a plain dict scans the slots its earlier drops left)
        self._kept: OrderedDict[tuple[tuple[int, ...], int], tuple[int, dict[str, int], dict[int, int]]] = OrderedDict()
        self._kept_hits = 0

    def __len__(self) -> int:
        """Distinct block hashes held by any instance."""
        return len(self._holders)

    def blocks_of(self, instance_id: str) -> int:
        held = self._blocks.get(instance_id)
        return len(held) if held else 0

    def capacity_of(self, instance_id: str) -> int:
        """Blocks remembered for the instance: its KV capacity when known, else the default."""
        return self._capacity.get(instance_id, self.default_capacity)

    def set_capacity(self, instance_id: str, blocks: int) -> None:
        """The instance's KV capacity in blocks (from its metadata); 0 keeps the default."""
        if blocks > 0:
            self._capacity[instance_id] = blocks
            self._trim(instance_id)

    def record_dispatch(self, instance_id: str, hashes: Sequence[int]) -> None:
        """The request with these prefix hashes went to `instance_id`: it will hold them."""
        if hashes:
            self._store(instance_id, hashes)

    def apply_kv_event(
        self,
        instance_id: str,
        stored: Sequence[int] = (),
        removed: Iterable[int] = (),
        cleared: bool = False,
    ) -> None:
        """An engine KV-cache event: `cleared` drops everything first, then `removed`, then `stored`.

        What view/kv_events.py feeds (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, with
        hashes re-computed by `prefix_block_hashes`); safe with unknown or repeated hashes.
        """
        if cleared:
            self.drop_instance(instance_id)
        held = self._blocks.get(instance_id)
        if held is not None:
            for h in removed:
                if h in held:
                    del held[h]
                    self._unhold(h, instance_id)
        if stored:
            self._store(instance_id, stored)

    def drop_instance(self, instance_id: str) -> None:
        held = self._blocks.pop(instance_id, None)
        if held:
            for h in held:
                self._unhold(h, instance_id)

    def forget(self, instance_id: str) -> None:
        """The instance left the cluster: its blocks and its capacity."""
        self.drop_instance(instance_id)
        self._capacity.pop(instance_id, None)

    def match(self, hashes: Sequence[int], scale: int = 1) -> dict[str, int]:
        """Leading blocks of `hashes` each instance holds, times `scale` (a block's tokens, say); instances
        with no hit are absent. Read it before the index changes, never change it."""
        return self._matched(hashes, scale)[0]

    def hit_lengths(self, hashes: Sequence[int], scale: int = 1) -> Collection[int]:
        """The distinct values of `match(hashes, scale)`, without a pass over its instances (counted as the
        match is made)."""
        return self._matched(hashes, scale)[1].keys()

    def _matched(self, hashes: Sequence[int], scale: int) -> tuple[dict[str, int], dict[int, int]]:
        if not hashes:
            return {}, {}
        chain = (hashes if isinstance(hashes, tuple) else tuple(hashes), scale)
        last = self._last
        if last is not None and last[3] == self._version and last[0] == chain:
            return last[1], last[2]
        hits, lengths = self._kept_match(chain[0], scale)
        self._last = (chain, hits, lengths, self._version)
        return hits, lengths

    def _kept_match(self, hashes: tuple[int, ...], scale: int) -> tuple[dict[str, int], dict[int, int]]:
        """`_match`, kept by the part of the chain anyone holds. A match reads no block past the first one
        nobody holds, so requests that share a held prefix and then diverge (a system prompt, then unique
        turns) share one match while those blocks' holders stand; with every instance holding the prompt,
        making it again is a dict of every instance per decision. Versions only grow, so the newest change
        version among the held blocks is unchanged exactly while none of them changed."""
        first = self._holders.get(hashes[0])
        if not first:  # nobody holds the first block (a unique prompt): no hit
            return {}, {}
        if len(first) < _KEEP_FROM:
            # a few holders (a conversation's own turns): made again for about what finding a kept one costs
            return self._match(hashes, scale)
        changed = self._changed
        # each block's change version, in C; the held part ends at the first block nobody holds
        versions = list(map(changed.get, hashes))
        held = hashes
        try:
            end = versions.index(None)
        except ValueError:  # every block held
            stamp = max(versions)
        else:
            held, stamp = hashes[:end], max(versions[:end])
        key = (held, scale)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == stamp:
            return kept[1], kept[2]
        hits, lengths = self._match(held, scale)
        kept_matches = self._kept
        if kept is not None:
            self._kept_hits -= len(kept[1])
            kept_matches.move_to_end(key)  # made again: kept as the newest
        kept_matches[key] = (stamp, hits, lengths)
        self._kept_hits += len(hits)
        while len(kept_matches) > 1 and (self._kept_hits > _KEPT_HITS or len(kept_matches) > _KEPT_MATCHES):
            self._kept_hits -= len(kept_matches.popitem(last=False)[1][1])
        return hits, lengths

    def _match(self, hashes: tuple[int, ...], scale: int) -> tuple[dict[str, int], dict[int, int]]:
        """`match` computed. A match passes over the holders of the chain's first block (dozens to hundreds
        of a shared prefix), so the work stays in set operations and `dict.fromkeys`, never a Python loop
        per holder, and the holders' sets are read, never copied: the holders of a block are usually all
        holders of the one before it too (chained hashes), and then the subset test alone tells who stops
        there."""
        holders_of = self._holders
        alive = holders_of.get(hashes[0])
        if not alive:
            return {}, {}
        hits: dict[str, int] = {}
        lengths: dict[int, int] = {}  # hit -> instances with it
        depth = len(hashes)
        for d in range(1, depth):
            nxt = holders_of.get(hashes[d])
            if not nxt:
                depth = d
                break
            if nxt <= alive:
                if len(nxt) < len(alive):
                    hits.update(dict.fromkeys(alive - nxt, d * scale))
                    lengths[d * scale] = len(alive) - len(nxt)
                    alive = nxt
                continue
            still = alive & nxt
            if len(still) < len(alive):
                hits.update(dict.fromkeys(alive - still, d * scale))
                lengths[d * scale] = len(alive) - len(still)
                if not still:
                    return hits, lengths
                alive = still
        lengths[depth * scale] = len(alive)
        if not hits:  # the usual answer: every holder of the first block holds them all
            return dict.fromkeys(alive, depth * scale), lengths
        hits.update(dict.fromkeys(alive, depth * scale))
        return hits, lengths

    def _store(self, instance_id: str, hashes: Iterable[int]) -> None:
        held = self._blocks.get(instance_id)
        if held is None:
            held = self._blocks[instance_id] = OrderedDict()
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                holders = self._holders.get(h)
                if holders is None:
                    self._holders[h] = {instance_id}
                else:
                    holders.add(instance_id)
                self._version += 1
                self._changed[h] = self._version
        self._trim(instance_id)

    def _trim(self, instance_id: str) -> None:
        held = self._blocks.get(instance_id)
        if not held:
            return
        capacity = self._capacity.get(instance_id, self.default_capacity)
        while len(held) > capacity:
            h, _ = held.popitem(last=False)
            self._unhold(h, instance_id)

    def _unhold(self, h: int, instance_id: str) -> None:
        self._version += 1
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if holders:
                self._changed[h] = self._version
            else:
                del self._holders[h], self._changed[h]
