"""PrefixIndex.match against its plain definition: per instance, the leading hashes it holds (view/prefix_index.py)."""

from __future__ import annotations

from collections import OrderedDict
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.scheduler.view import prefix_index
from pilotfish.scheduler.view.prefix_index import PrefixIndex

INSTANCES = ["a", "b", "c", "d", "e"]
# few distinct hashes, so that chains share blocks, holders nest or not, and evictions cut chains
hashes_st = st.lists(st.integers(0, 7), min_size=0, max_size=6)
op_st = st.one_of(
    st.tuples(st.just("dispatch"), st.sampled_from(INSTANCES), hashes_st),
    st.tuples(st.just("event"), st.sampled_from(INSTANCES), st.tuples(hashes_st, hashes_st, st.booleans())),
    st.tuples(st.just("capacity"), st.sampled_from(INSTANCES), st.integers(1, 6)),
    st.tuples(st.just("forget"), st.sampled_from(INSTANCES), st.none()),
)


def plain_match(index: PrefixIndex, hashes: list[int], scale: int) -> dict[str, int]:
    hits = {}
    for instance_id in INSTANCES:
        held = index._blocks.get(instance_id, {})
        depth = 0
        while depth < len(hashes) and hashes[depth] in held:
            depth += 1
        if depth:
            hits[instance_id] = depth * scale
    return hits


@settings(max_examples=300, deadline=None)
@given(
    st.lists(op_st, max_size=25),
    st.lists(hashes_st, min_size=1, max_size=4),
    st.sampled_from([1, 16]),
)
def test_match_is_the_leading_blocks_each_instance_holds(ops: list, queries: list[list[int]], scale: int) -> None:
    """The last match kept included: each query is asked again (twice) after every change."""
    _replay(ops, queries, scale)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(op_st, max_size=25),
    st.lists(hashes_st, min_size=1, max_size=4),
    st.sampled_from([1, 16]),
)
def test_kept_matches_are_the_leading_blocks_each_instance_holds(
    ops: list, queries: list[list[int]], scale: int
) -> None:
    """The same with every match kept (a first block of one holder is enough here), and few kept."""
    with mock.patch.object(prefix_index, "_KEEP_FROM", 1), mock.patch.object(prefix_index, "_KEPT_MATCHES", 3):
        _replay(ops, queries, scale)


class LruModel:
    """What each instance holds, by the plain definition: its most recently stored `capacity` blocks, a block
    stored again moving to the newest end (an OrderedDict per instance, as the index kept them before)."""

    def __init__(self, capacity: int) -> None:
        self.default = capacity
        self.capacity: dict[str, int] = {}
        self.held: dict[str, OrderedDict[int, None]] = {}

    def store(self, instance_id: str, hashes: list[int]) -> None:
        held = self.held.setdefault(instance_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        self.trim(instance_id)

    def trim(self, instance_id: str) -> None:
        held = self.held.get(instance_id, OrderedDict())
        while len(held) > self.capacity.get(instance_id, self.default):
            held.popitem(last=False)

    def apply(self, kind: str, instance_id: str, arg: object) -> None:
        if kind == "dispatch":
            if arg:
                self.store(instance_id, arg)  # type: ignore[arg-type]
        elif kind == "event":
            stored, removed, cleared = arg  # type: ignore[misc]
            if cleared:
                self.held.pop(instance_id, None)
            for h in removed:
                self.held.get(instance_id, {}).pop(h, None)
            if stored:
                self.store(instance_id, stored)
        elif kind == "capacity":
            if arg:
                self.capacity[instance_id] = arg  # type: ignore[assignment]
                self.trim(instance_id)
        else:
            self.held.pop(instance_id, None)
            self.capacity.pop(instance_id, None)


def _replay(ops: list, queries: list[list[int]], scale: int) -> None:
    index = PrefixIndex(default_capacity_blocks=5)
    model = LruModel(5)
    for kind, instance_id, arg in ops:
        model.apply(kind, instance_id, arg)
        if kind == "dispatch":
            index.record_dispatch(instance_id, arg)
        elif kind == "event":
            stored, removed, cleared = arg
            index.apply_kv_event(instance_id, stored, removed, cleared)
        elif kind == "capacity":
            index.set_capacity(instance_id, arg)
        else:
            index.forget(instance_id)
        # the blocks each instance holds are the model's: the least recently stored dropped first
        assert {i: set(held) for i, held in index._blocks.items() if held} == {
            i: set(held) for i, held in model.held.items() if held
        }
        for hashes in queries:
            before = {h: index.holders(h) for h in index.held_blocks()}
            # each block's holders are the instances that hold it, a lone one kept in the plain dict
            assert before == {h: {i for i, held in index._blocks.items() if h in held} for h in before}
            assert all(len(v) > 1 for v in index._many.values()) and not index._one.keys() & index._many.keys()
            plain = plain_match(index, hashes, scale)
            assert index.match(hashes, scale) == plain
            assert sorted(index.hit_lengths(hashes, scale)) == sorted(set(plain.values()))
            assert {h: index.holders(h) for h in index.held_blocks()} == before  # a match never changes what it reads
            assert index.match(hashes, scale) == plain  # asked again: the kept one, still right


def test_the_last_match_is_reused_only_while_no_holder_changed() -> None:
    index = PrefixIndex()
    index.record_dispatch("a", [1, 2, 3])
    first = index.match([1, 2, 3])
    assert first == {"a": 3} and index.match((1, 2, 3)) is first  # kept: the same dict, list or tuple
    assert index.match([1, 2, 3], 16) == {"a": 48}  # another scale is another match
    index.record_dispatch("b", [1, 2])
    assert index.match([1, 2, 3]) == {"a": 3, "b": 2}
    index.record_dispatch("a", [1, 2])  # holds them already: nothing changed, the match stands
    again = index.match([1, 2, 3])
    assert index.match([1, 2, 3]) is again
    index.apply_kv_event("a", removed=[2])
    assert index.match([1, 2, 3]) == {"a": 1, "b": 2}
    index.forget("b")
    assert index.match([1, 2, 3]) == {"a": 1}


def _widely_held(index: PrefixIndex, blocks: list[int], holders: int) -> None:
    for k in range(holders):
        index.record_dispatch(f"i{k}", blocks)


def test_requests_that_share_a_held_prefix_and_then_diverge_share_its_kept_match() -> None:
    index = PrefixIndex()
    _widely_held(index, [1, 2, 3], prefix_index._KEEP_FROM)
    first = index.match([1, 2, 3, 100], 16)
    assert first == {f"i{k}": 48 for k in range(prefix_index._KEEP_FROM)}
    index.record_dispatch("i0", [1, 2, 3, 100])  # the suffix is new, the shared blocks' holders stand
    assert index.match([1, 2, 3, 200], 16) is first
    # a holder change of a shared block: made again
    index.apply_kv_event("i1", removed=[2])
    again = index.match([1, 2, 3, 300], 16)
    assert again is not first and again["i1"] == 16 and again["i0"] == 48
    # a block past the held part gains a holder: the chain's held part is another, and so is its match
    index.record_dispatch("i2", [1, 2, 3, 300])
    assert index.match([1, 2, 3, 300], 16) == {**again, "i2": 64}


def test_the_kept_matches_are_bounded() -> None:
    index = PrefixIndex()
    with mock.patch.object(prefix_index, "_KEPT_MATCHES", 2):
        for chain in ([1, 2], [3, 4], [5, 6]):
            _widely_held(index, chain, prefix_index._KEEP_FROM)
            index.match(chain)
        assert [blocks for blocks, _ in index._kept] == [(3, 4), (5, 6)]
    with mock.patch.object(prefix_index, "_KEPT_HITS", prefix_index._KEEP_FROM):
        index.match([1, 2])
        assert [blocks for blocks, _ in index._kept] == [(1, 2)]
        assert index._kept_hits == prefix_index._KEEP_FROM


def test_many_stores_keep_the_lru_order_and_a_bounded_queue() -> None:
    """Chains stored again and again (the queue's stale entries dropped a bit at a time as they pile up),
    evicted past a capacity: the blocks held stay the plain LRU's, and the queue stays within a few times what
    is held."""
    import random

    rng = random.Random(7)
    index, model = PrefixIndex(default_capacity_blocks=40), LruModel(40)
    chains = [[rng.getrandbits(32) for _ in range(rng.randrange(1, 12))] for _ in range(30)]
    most = 0
    for step in range(3000):
        instance_id = rng.choice(INSTANCES[:3])
        if step % 97 == 0:
            op = ("capacity", instance_id, rng.randrange(5, 60))
            index.set_capacity(instance_id, op[2])
        elif step % 53 == 0:
            op = ("event", instance_id, ((), rng.choice(chains)[:2], False))
            index.apply_kv_event(instance_id, (), op[2][1])
        else:
            op = ("dispatch", instance_id, rng.choice(chains))
            index.record_dispatch(instance_id, op[2])
        model.apply(*op)
        assert set(index._blocks.get(instance_id, ())) == set(model.held.get(instance_id, ()))
        stores = index._stores.get(instance_id)
        if stores is not None:
            assert stores.queued == sum(len(chain) for _, chain in stores.items[stores.head:])
            assert stores.queued <= 3 * len(index._blocks[instance_id]) + 200
            most = max(most, stores.queued)
    assert most > 64  # stale entries came, and were tidied


def test_blocks_held_cost_the_collector_nothing() -> None:
    """Python's collector walks every object it tracks on a full pass, with the scheduler's loop stopped. The
    index's blocks are ints in plain dicts it never tracks: tens of thousands of blocks add a few objects,
    not one a block (a set per block and an OrderedDict per instance made a full pass 1.5 s at 256 engines
    of 30,000 blocks)."""
    import gc
    import random

    rng = random.Random(3)
    gc.collect()
    before = len(gc.get_objects())
    index = PrefixIndex(default_capacity_blocks=4000)
    shared = [rng.getrandbits(64) for _ in range(32)]  # a prompt every instance holds: a set per block of it
    for k in range(8):
        for _ in range(60):
            index.record_dispatch(f"i{k}", [*shared[: rng.randrange(1, 33)],
                                            *(rng.getrandbits(64) for _ in range(100))])
    gc.collect()
    gc.collect()  # (a store's tuple of tuples is let go by the collector over two passes)
    assert len(index) > 30_000
    assert not gc.is_tracked(index._one) and not any(gc.is_tracked(held) for held in index._blocks.values())
    assert len(gc.get_objects()) - before < 1000


def test_the_same_chain_stored_again_changes_nothing() -> None:
    """A retry (the same prompt to the same engine) is already the most recently stored: the queue does not
    grow, and the order is the plain LRU's."""
    index, model = PrefixIndex(default_capacity_blocks=6), LruModel(6)
    for op in [("dispatch", "a", [1, 2, 3]), ("dispatch", "a", [4]), ("dispatch", "a", [4]),
               ("dispatch", "a", [1, 2, 3]), ("dispatch", "a", [1, 2, 3]), ("dispatch", "a", [5, 6, 7])]:
        index.record_dispatch(op[1], op[2])  # type: ignore[arg-type]
        model.apply(*op)
        assert set(index._blocks["a"]) == set(model.held["a"])
    assert set(index._blocks["a"]) == {1, 2, 3, 5, 6, 7}  # 4 was the least recently stored
    assert index._stores["a"].queued <= 7
