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

The index is kept in plain dicts of ints and strings, which Python's collector never tracks, so its
size costs the collector nothing: a block one instance holds maps to that id, only blocks two or more
hold have a set, and an instance's blocks map to when it last stored them, its stores queued oldest
first for the eviction. With a set per block and an OrderedDict per instance, 256 engines of 30,000
blocks each (one Llama-3-8B's cache on an 80 GB GPU) were 5.8 million objects for the collector, whose
full pass took 1.5 s while the scheduler's loop stood still; it takes 48 ms now, in half the memory.

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
from itertools import compress, filterfalse, repeat
from operator import eq

# a match is kept when its first block has at least this many holders: below, making it costs about as much
# as finding it kept (a lookup per block)
_KEEP_FROM = 8
# the matches kept, and the hits they may hold in all (an entry per instance with a hit): a few MB
_KEPT_MATCHES = 1024
_KEPT_HITS = 65536


class PrefixIndex:
    def __init__(self, default_capacity_blocks: int = 65536) -> None:
        self.default_capacity = default_capacity_blocks
        # block -> its one holder's id (ints and strings: a dict the collector never tracks), and block -> the
        # ids of its holders from two on; a block is in one of them or in neither
        self._one: dict[int, str] = {}
        self._many: dict[int, set[str]] = {}
        # instance -> its blocks, each with the tick of its last store there (ticks only grow: a store is one)
        self._blocks: dict[str, dict[int, int]] = {}
        # instance -> its stores, oldest first (`_Stores`)
        self._stores: dict[str, _Stores] = {}
        self._tick = 0
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
        return len(self._one) + len(self._many)

    def held_blocks(self) -> list[int]:
        """Every block some instance holds."""
        return [*self._one, *self._many]

    def holders(self, h: int) -> set[str]:
        """The instances holding block `h` (a new set)."""
        one = self._one.get(h)
        return {one} if one is not None else set(self._many.get(h, ()))

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
        self._stores.pop(instance_id, None)
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
        one = self._one.get(hashes[0])
        if one is not None:  # one holder: its own blocks tell
            return self._match_one(one, hashes, scale)
        first = self._many.get(hashes[0])
        if not first:  # nobody holds the first block (a unique prompt): no hit
            return {}, {}
        if len(first) < _KEEP_FROM:
            # a few holders (a conversation's own turns): made again for about what finding a kept one costs
            return self._match(hashes, scale, first)
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
        hits, lengths = self._match(held, scale, first)
        kept_matches = self._kept
        if kept is not None:
            self._kept_hits -= len(kept[1])
            kept_matches.move_to_end(key)  # made again: kept as the newest
        kept_matches[key] = (stamp, hits, lengths)
        self._kept_hits += len(hits)
        while len(kept_matches) > 1 and (self._kept_hits > _KEPT_HITS or len(kept_matches) > _KEPT_MATCHES):
            self._kept_hits -= len(kept_matches.popitem(last=False)[1][1])
        return hits, lengths

    def _match(
        self, hashes: tuple[int, ...], scale: int, alive: set[str]
    ) -> tuple[dict[str, int], dict[int, int]]:
        """`match` computed, given the holders of the chain's first block (two or more: `_kept_match` looked
        them up). A match passes over them (dozens to hundreds of a shared prefix), so the work stays in set
        operations and `dict.fromkeys`, never a Python loop per holder, and the holders' sets are read, never
        copied: the holders of a block are usually all holders of the one before it too (chained hashes), and
        then the subset test alone tells who stops there."""
        one_of, many_of = self._one, self._many
        hits: dict[str, int] = {}
        lengths: dict[int, int] = {}  # hit -> instances with it
        depth = len(hashes)
        for d in range(1, depth):
            nxt = many_of.get(hashes[d])
            if nxt is None:
                lone = one_of.get(hashes[d])
                if lone is None:
                    depth = d
                    break
                nxt = {lone}
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

    def _match_one(self, holder: str, hashes: tuple[int, ...], scale: int) -> tuple[dict[str, int], dict[int, int]]:
        """`_match` where the first block has one holder: the leading blocks it holds, from its own."""
        held = self._blocks[holder]
        depth = 1
        for h in hashes[1:]:
            if h not in held:
                break
            depth += 1
        hit = depth * scale
        return {holder: hit}, {hit: 1}

    def _store(self, instance_id: str, hashes: Iterable[int]) -> None:
        chain = hashes if isinstance(hashes, tuple) else tuple(hashes)
        if not chain:
            return
        held = self._blocks.get(instance_id)
        if held is None:
            held = self._blocks[instance_id] = {}
            self._stores[instance_id] = _Stores()
        else:
            items = self._stores[instance_id].items
            # the newest store again, every block of it still held (a retry, the same prompt to the same engine):
            # already the most recently stored, so nothing changes
            if items and items[-1][1] == chain and all(map(held.__contains__, chain)):
                return
        # every block stamped with this store, and those new here (each once), in C: a chain can be thousands
        self._tick += 1
        stamped = dict.fromkeys(chain, self._tick)
        fresh = list(filterfalse(held.__contains__, stamped))
        if len(stamped) < len(chain):  # a block named twice: its place in the order is its last one
            chain = tuple(reversed(dict.fromkeys(reversed(chain))))
        held.update(stamped)
        stores = self._stores[instance_id]
        stores.append(self._tick, chain)
        if len(fresh) < len(chain):  # some were held: their earlier entries went stale, to be tidied
            stores.tidy(held, 2 * len(chain))
        if fresh:
            one, many, changed = self._one, self._many, self._changed
            self._version += 1
            version = self._version
            for h in fresh:
                other = one.pop(h, None)
                if other is not None:  # (another's: this instance did not hold it)
                    many[h] = {other, instance_id}
                else:
                    holders = many.get(h)
                    if holders is None:
                        one[h] = instance_id
                    else:
                        holders.add(instance_id)
                changed[h] = version
        self._trim(instance_id)

    def _trim(self, instance_id: str) -> None:
        """Drop the least recently stored blocks past the instance's capacity."""
        held = self._blocks.get(instance_id)
        if held is None:
            return
        capacity = self._capacity.get(instance_id, self.default_capacity)
        if len(held) > capacity:
            for h in self._stores[instance_id].evict(held, len(held) - capacity):
                self._unhold(h, instance_id)

    def _unhold(self, h: int, instance_id: str) -> None:
        self._version += 1
        if self._one.get(h) == instance_id:
            del self._one[h], self._changed[h]
            return
        holders = self._many.get(h)
        if holders is None:
            return
        holders.discard(instance_id)
        if len(holders) == 1:  # back to the plain dict
            del self._many[h]
            self._one[h] = holders.pop()
        self._changed[h] = self._version


class _Stores:
    """One instance's stores, oldest first: the eviction's order (least recently stored first, as an
    OrderedDict moved to its end on each store would give, and a block named twice in one store at its last
    place). Each store is (its tick, its blocks); an entry whose block was stored again later, or dropped, is
    stale (the block's tick in `held` is not the store's) and skipped. Stale entries are dropped a bounded
    amount at a time (`tidy`), so no store pays for a pass over them all. A list (with the index of its
    oldest live store) of tuples of ints: what the collector walks is one entry per store, not per block."""

    __slots__ = ("cursor", "head", "items", "queued")

    def __init__(self) -> None:
        self.items: list[tuple[int, tuple[int, ...]]] = []
        self.head = 0  # the oldest store not evicted whole
        self.cursor = 0  # where `tidy` goes on
        self.queued = 0  # blocks in the stores from `head` on, stale ones included

    def append(self, tick: int, chain: tuple[int, ...]) -> None:
        self.items.append((tick, chain))
        self.queued += len(chain)

    def evict(self, held: dict[int, int], count: int) -> list[int]:
        """Drop the `count` least recently stored blocks from `held`; returns them."""
        items, head, dropped = self.items, self.head, []
        while len(dropped) < count and head < len(items):
            tick, chain = items[head]
            for i, h in enumerate(chain):
                if len(dropped) >= count:  # the rest of this store stays, oldest still
                    items[head] = (tick, chain[i:])
                    self.queued -= i
                    break
                if held.get(h) == tick:
                    del held[h]
                    dropped.append(h)
            else:
                self.queued -= len(chain)
                head += 1
        self.cursor = max(self.cursor, head)
        if head > 64 and head * 2 > len(items):  # the evicted stores' slots, given back now and then
            del items[:head]
            self.cursor -= head
            head = 0
        self.head = head
        return dropped

    def tidy(self, held: dict[int, int], budget: int) -> None:
        """Drop the stale entries of about `budget` blocks' worth of stores, from where the last call stopped,
        while the stores hold more than twice the blocks held (and a little)."""
        items = self.items
        while budget > 0 and self.queued > 2 * len(held) + 64:
            if self.cursor >= len(items):
                # a lap done: the stores left empty go, and the next lap starts at the oldest
                items[self.head:] = [item for item in items[self.head:] if item[1]]
                self.cursor = self.head
                if self.cursor >= len(items):
                    return
            tick, chain = items[self.cursor]
            # the blocks whose last store this is, in C
            live = tuple(compress(chain, map(eq, repeat(tick), map(held.get, chain))))
            if len(live) < len(chain):
                items[self.cursor] = (tick, live)
                self.queued -= len(chain) - len(live)
            budget -= len(chain) or 1
            self.cursor += 1
