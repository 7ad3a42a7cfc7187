"""PrefixIndex.match against its plain definition: per instance, the leading hashes it holds (view/prefix_index.py)."""

from __future__ import annotations

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


def _replay(ops: list, queries: list[list[int]], scale: int) -> None:
    index = PrefixIndex(default_capacity_blocks=5)
    for kind, instance_id, arg in ops:
        if kind == "dispatch":
            index.record_dispatch(instance_id, arg)
        elif kind == "event":
            stored, removed, cleared = arg
            index.apply_kv_event(instance_id, stored, removed, cleared)
        elif kind == "capacity":
            index.set_capacity(instance_id, arg)
        else:
            index.forget(instance_id)
        for hashes in queries:
            before = {h: set(index._holders[h]) for h in index._holders}
            plain = plain_match(index, hashes, scale)
            assert index.match(hashes, scale) == plain
            assert sorted(index.hit_lengths(hashes, scale)) == sorted(set(plain.values()))
            assert index._holders == before  # a match never changes what it reads
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
