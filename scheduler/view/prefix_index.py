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

Matches are kept, so that the next request with the same chain (a shared prefix's requests, all of
whose holders hold it) costs a lookup rather than a pass over every holder: a change of a block's
holders marks the instance in each kept match that read the block, and the next match of that chain
re-counts just those instances. At most `MATCHES_KEPT` holder entries in all, the least recently
matched chain dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

# holder entries the kept matches may hold in all (each match is a dict of its holders)
MATCHES_KEPT = 1 << 16

# a kept match: (block hashes, scale)
Chain = tuple[tuple[int, ...], int]


class PrefixIndex:
    def __init__(self, default_capacity_blocks: int = 65536) -> None:
        self.default_capacity = default_capacity_blocks
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # chain -> its match, least recently matched first; block hash -> the kept chains that contain it;
        # chain -> the instances whose holding of one of its blocks changed since (re-counted at its next
        # match); the kept matches' entries in all (one more per match: an empty match is kept too)
        self._matches: dict[Chain, dict[str, int]] = {}
        self._readers: dict[int, set[Chain]] = {}
        self._pending: dict[Chain, set[str]] = {}
        # chain -> how many of its match's instances have each hit (`hit_lengths`)
        self._lengths: dict[Chain, dict[int, int]] = {}
        self._kept = 0

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
        with no hit are absent. The dict is kept for the next match of the same chain, and brought up to
        date then: read it before the index changes, never change it."""
        if not hashes:
            return {}
        chain = (hashes if isinstance(hashes, tuple) else tuple(hashes), scale)
        hits = self._matches.pop(chain, None)
        if hits is None:
            hits, lengths = self._match(chain[0], scale)
            self._keep(chain, hits, lengths)
            return hits
        self._matches[chain] = hits  # the most recently matched last
        pending = self._pending.pop(chain, None)
        if pending:
            self._recount(chain, hits, pending)
            while self._kept > MATCHES_KEPT:  # it grew: the least recently matched go (this one last)
                self._forget_match(next(iter(self._matches)))
        return hits

    def hit_lengths(self, hashes: Sequence[int], scale: int = 1) -> Collection[int]:
        """The distinct values of `match(hashes, scale)`, without a pass over its instances (counted as the
        match is made and re-counted)."""
        hits = self.match(hashes, scale)
        lengths = self._lengths.get((hashes if isinstance(hashes, tuple) else tuple(hashes), scale))
        return lengths.keys() if lengths is not None else set(hits.values())

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

    def _recount(self, chain: Chain, hits: dict[str, int], instance_ids: set[str]) -> None:
        """Bring a kept match up to date for the instances whose holding of its blocks changed."""
        hashes, scale = chain
        blocks, lengths = self._blocks, self._lengths[chain]
        for instance_id in instance_ids:
            held = blocks.get(instance_id)
            depth = 0
            if held:
                for h in hashes:
                    if h not in held:
                        break
                    depth += 1
            old = hits.pop(instance_id, 0)
            if old:
                self._kept -= 1
                if lengths[old] == 1:
                    del lengths[old]
                else:
                    lengths[old] -= 1
            if depth:
                hit = hits[instance_id] = depth * scale
                self._kept += 1
                lengths[hit] = lengths.get(hit, 0) + 1

    def _keep(self, chain: Chain, hits: dict[str, int], lengths: dict[int, int]) -> None:
        """Keep a match; drop the least recently matched past MATCHES_KEPT entries."""
        size = len(hits) + 1
        if size > MATCHES_KEPT:
            return
        while self._kept + size > MATCHES_KEPT:
            self._forget_match(next(iter(self._matches)))
        self._matches[chain] = hits
        self._lengths[chain] = lengths
        self._kept += size
        readers = self._readers
        for h in chain[0]:
            chains = readers.get(h)
            if chains is None:
                readers[h] = {chain}
            else:
                chains.add(chain)

    def _forget_match(self, chain: Chain) -> None:
        self._kept -= len(self._matches.pop(chain)) + 1
        self._pending.pop(chain, None)
        del self._lengths[chain]
        readers = self._readers
        for h in chain[0]:
            chains = readers.get(h)
            if chains is not None:
                chains.discard(chain)
                if not chains:
                    del readers[h]

    def _holding_changed(self, h: int, instance_id: str) -> None:
        """`instance_id` began or stopped holding block `h`: the kept matches that read it re-count it."""
        pending = self._pending
        for chain in self._readers[h]:
            instances = pending.get(chain)
            if instances is None:
                pending[chain] = {instance_id}
            else:
                instances.add(instance_id)

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
                if h in self._readers:
                    self._holding_changed(h, instance_id)
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
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[h]
        if h in self._readers:
            self._holding_changed(h, instance_id)
