"""Fidelity of bench/peers.py: short decision sequences replayed against choices worked out by hand.

Each expectation is computed from the upstream code the reproduction's docstring cites (the
arithmetic is in the comments), so a change that drifts from upstream fails here.
"""

from __future__ import annotations

import random

import pytest

from pilotfish.bench.peers import (
    DynamoKvRouter,
    LlmdDefaultRouter,
    PowerOfTwoRouter,
    RoundRobinPeer,
    SglangCacheAwareRouter,
    vllm_router_cache_aware,
)
from pilotfish.simulator.cluster import RouteRequest
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.kv_cache import KVBlock
from pilotfish.simulator.engine.scheduler import V1Engine

BS = 16
SHARED = list(range(1000, 1032))  # a 512-token system prompt: 32 blocks every request starts with


def _cores(n: int, blocks: int = 1024) -> list[V1Engine]:
    config = EngineConfig(num_gpu_blocks=blocks, max_model_len=min(8192, blocks * BS))
    return [V1Engine(config) for _ in range(n)]


def _req(rid: str, hashes: list[int], tokens: int | None = None) -> RouteRequest:
    return RouteRequest(rid, tokens if tokens is not None else len(hashes) * BS + 1, 8, hashes, BS)


def _llmd(n: int, blocks: int = 1024) -> tuple[LlmdDefaultRouter, list[V1Engine]]:
    cores = _cores(n, blocks)
    router = LlmdDefaultRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
    router.bind([f"e{i}" for i in range(n)])
    return router, cores


def _gauges(router: LlmdDefaultRouter, k: int, queue: int, kv: float, at: float) -> None:
    router.scrapes[k].history.append((at, queue, kv))


# ---- llm-d: the EPP's default profile (2 queue + 2 KV utilization + 3 prefix, max score) ----------------------


def test_llmd_shared_system_prompt_locks_onto_the_first_holder_until_kv_usage_breaks_it() -> None:
    router, _ = _llmd(4)
    # 32 shared blocks + 5 own + an 8-token partial block: 600 tokens, 38 blocks as the producer hashes them
    first = _req("r0", [*SHARED, 1, 2, 3, 4, 5], tokens=600)
    assert len(router.prefix_hashes(first)) == 38
    # r0: nothing cached anywhere, every engine idle: 2 x 1 + 2 x 1 + 3 x 0 = 4 everywhere, a random pick
    assert router.scores(first, 0.0) == [4.0] * 4
    holder = router.route(first, 0.0)
    # r1: the holder matches the 32 shared blocks: 4 + 3 x 32/38 = 6.526 against 4 elsewhere
    second = _req("r1", [*SHARED, 6, 7, 8, 9, 10], tokens=600)
    assert router.scores(second, 0.0)[holder] == pytest.approx(4 + 3 * 32 / 38)
    assert router.route(second, 0.0) == holder
    # a queue of 5 on the holder, none elsewhere: its queue score drops to 0, still 0 + 2 + 2.526 = 4.526 > 4;
    # a queue of any length costs at most 2, less than the prefix's 2.526: the lock-in is upstream's formula
    _gauges(router, holder, 5, 0.0, 0.1)
    assert router.route(_req("r2", [*SHARED, 11, 12, 13, 14, 15], tokens=600), 0.15) == holder
    _gauges(router, holder, 500, 0.0, 0.2)
    assert router.route(_req("r3", [*SHARED, 16, 17, 18, 19, 20], tokens=600), 0.25) == holder
    # KV usage 30% on the holder as well: 0 + 2 x 0.7 + 2.526 = 3.926 < 4: another engine, at random
    _gauges(router, holder, 500, 0.3, 0.3)
    other = router.route(_req("r4", [*SHARED, 21, 22, 23, 24, 25], tokens=600), 0.35)
    assert other != holder
    # now two engines hold the prefix; the next request goes to the new holder (queue 0, KV 0: 6.526)
    assert router.route(_req("r5", [*SHARED, 26, 27, 28, 29, 30], tokens=600), 0.35) == other


def test_llmd_match_counts_every_holder_of_each_block_until_a_block_nobody_holds() -> None:
    # approximateprefix.matchLongestPrefix: one per holder per block, stop at the first block no server holds
    router, _ = _llmd(3)
    router._record(0, [1, 2, 3])
    router._record(1, [1, 3])  # holds block 3 without block 2 (as LRU eviction can leave it)
    assert router.match([1, 2, 3, 4, 5]) == [3, 2, 0]
    router._record(2, [5])
    assert router.match([1, 2, 3, 4, 5]) == [3, 2, 0]  # block 4 is held by nobody: block 5 never counts
    assert router.match([9, 1]) == [0, 0, 0]


def test_llmd_total_counts_the_partial_block_and_caps_at_256() -> None:
    router, _ = _llmd(2)
    assert len(router.prefix_hashes(_req("a", [1, 2, 3], tokens=48))) == 3  # exact blocks: no partial one
    assert len(router.prefix_hashes(_req("b", [1, 2, 3], tokens=50))) == 4  # 2 more tokens: a partial block
    long = _req("c", list(range(300)), tokens=300 * BS + 5)
    assert len(router.prefix_hashes(long)) == 256  # truncated to maxPrefixBlocks, no partial block after it
    # the same prompt sent twice matches all of its blocks, the partial one included: 3 x 4/4 = 3
    router.route(_req("d", [1, 2, 3], tokens=50), 0.0)
    assert max(router.scores(_req("e", [1, 2, 3], tokens=50), 0.0)) == pytest.approx(4 + 3.0)


def test_llmd_lru_capacity_is_the_engines_gpu_blocks_under_auto_tune() -> None:
    router, _ = _llmd(2, blocks=4)
    assert router.capacity == [4, 4]  # autoTune: vllm:cache_config_info's num_gpu_blocks
    router._record(0, [1, 2, 3, 4, 5, 6])
    assert list(router.lru[0]) == [3, 4, 5, 6]  # least recently used blocks evicted first
    plain = LlmdDefaultRouter(seed=0, auto_tune=False)
    plain.bind(["a"])
    assert plain.capacity == [31250]  # defaultLRUCapacityPerServer


# ---- Dynamo: lowest 1.0 x prefill blocks + decode blocks, ties by indexer tree size ------------------------


def test_dynamo_sequence_and_its_tie_break_by_tree_size() -> None:
    cores = _cores(2)
    router = DynamoKvRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
    router.bind(["a", "b"])
    for i, h in enumerate([100, 101]):  # engine 1 caches two unrelated blocks: its indexer tree is larger
        cores[1].kv.pool.cached[h] = KVBlock(5000 + i, 0, h)
    # r1: 33 tokens, nothing cached: both cost 33/16 + (2 blocks + 1 partial) = 5.0625: a tie; tree sizes 0 < 2
    costs, _ = router.costs(_req("r1", [7, 8]))
    assert costs == [pytest.approx(33 / 16 + 3)] * 2
    assert router.route(_req("r1", [7, 8]), 0.0) == 0
    # r2, the same blocks: engine 0 (33 + 33 prefill tokens, blocks 7, 8 shared + 2 partial) = 66/16 + 4 = 8.125;
    # engine 1: 33/16 + 3 = 5.0625
    costs, _ = router.costs(_req("r2", [7, 8]))
    assert costs == [pytest.approx(66 / 16 + 4), pytest.approx(33 / 16 + 3)]
    assert router.route(_req("r2", [7, 8]), 0.0) == 1
    router.on_progress("r1", 0, 1, 0.1)  # r1's prefill done: engine 0's prefill load is 0 again
    # r3: engine 0 = 33/16 + (2 active + 1 partial + 0 new + 1 partial) = 6.0625, engine 1 the same: tree 0 < 2
    assert router.route(_req("r3", [7, 8]), 0.2) == 0


# ---- sglang-router / vllm-router cache_aware ------------------------------------------------------------------


def test_sglang_cache_aware_sequence() -> None:
    router = SglangCacheAwareRouter(seed=0)
    router.bind(["a", "b", "c"])
    assert router.eviction_interval == 60.0  # sglang-router 0.3.2 router_args.py
    # r1: empty tree, a miss: the least loaded, the first in worker order on a tie (min_by_key)
    assert router.route(_req("r1", [1, 2, 3, 4]), 0.0) == 0
    # r2: 3 of its blocks on worker 0: 48 / 65 = 0.74 > 0.3: worker 0, though it carries the only load
    assert router.decide(_req("r2", [1, 2, 3, 5]), 0.0) == [0]
    assert router.route(_req("r2", [1, 2, 3, 5]), 0.0) == 0
    # r3: a miss: loads [2, 0, 0]: worker 1
    assert router.route(_req("r3", [9]), 0.0) == 1
    # r4: 2 blocks of 49 tokens = 0.65 > 0.3: worker 0; loads become [3, 1, 0]
    assert router.route(_req("r4", [1, 2, 6], tokens=49), 0.0) == 0
    assert router.load == [3, 1, 0]
    # r5: 1 block of 17 matched out of 80 tokens = 0.2 <= 0.3: a miss: the least loaded, worker 2
    assert router.route(_req("r5", [1, 7, 8, 9], tokens=80), 0.0) == 2
    for rid, k in (("r1", 0), ("r2", 0), ("r4", 0)):
        router.on_finish(rid, k, 1.0)
    assert router.load == [0, 1, 1]
    # imbalanced: 70 - 0 > 64 and 70 > 0 x 1.5: the least loaded whatever the prefix
    router.load = [70, 0, 3]
    assert router.decide(_req("r6", [1, 2, 3, 4]), 1.0) == [1]
    # 70 - 10 = 60 is not above 64: balanced, the prefix wins
    router.load = [70, 10, 10]
    assert router.decide(_req("r7", [1, 2, 3, 4]), 1.0) == [0]


def test_sglang_holders_of_the_deepest_match_are_equals_and_order_sets_ties() -> None:
    router = SglangCacheAwareRouter(seed=0)
    router.bind(["a", "b", "c"])
    router._insert(0, [1, 2, 3, 4])
    router._insert(2, [1, 2, 3])
    # deepest match is block 4, held by worker 0 alone; for [1, 2, 3, 9] both 0 and 2 hold the deepest node
    assert router.decide(_req("x", [1, 2, 3, 4]), 0.0) == [0]
    assert sorted(router.decide(_req("y", [1, 2, 3, 9]), 0.0)) == [0, 2]
    # upstream takes the first key of that node's DashMap (unpredictable): the reproduction draws among them
    assert router.route(_req("y", [1, 2, 3, 9]), 0.0) in (0, 2)
    ordered = SglangCacheAwareRouter(seed=0, order=[2, 0, 1])
    ordered.bind(["a", "b", "c"])
    assert ordered.route(_req("z", [5]), 0.0) == 2  # all idle: the first in the router's worker order


def test_sglang_eviction_keeps_the_most_recent_blocks_of_each_tree() -> None:
    # max_tree_size 256 characters = 64 tokens = 4 blocks; eviction every 60 s
    router = SglangCacheAwareRouter(seed=0, max_tree_size_chars=256)
    router.bind(["a", "b"])
    router._insert(0, [1, 2, 3, 4, 5, 6])
    router._evict(59.0)
    assert len(router.trees[0]) == 6  # not yet
    router._evict(61.0)  # the first eviction cycle: least recently used blocks go first
    assert list(router.trees[0]) == [3, 4, 5, 6]


def test_vllm_router_cache_aware_defaults() -> None:
    router = vllm_router_cache_aware()
    assert router.eviction_interval == 120.0 and router.max_tree_tokens == 2**25 // 4  # vllm-router 0.1.17


# ---- round robin and power of two ------------------------------------------------------------------------------


def test_round_robin_counts_every_request_the_router_routes() -> None:
    router = RoundRobinPeer()
    router.bind(["a", "b", "c", "d"])
    picks = [router.route(_req(f"w{i}", []), 0.0) for i in range(4)]  # the bench's 4 warm-up requests
    assert picks == [0, 1, 2, 3]
    assert [router.route(_req(f"r{i}", []), 0.0) for i in range(3)] == [0, 1, 2]


def test_power_of_two_keeps_the_first_draw_unless_the_second_is_less_loaded() -> None:
    router = PowerOfTwoRouter(seed=7)
    router.bind(["a", "b", "c", "d"])
    shadow = random.Random("power-of-two:7")  # the router's own draws, replayed
    router.load = [3, 3, 3, 3]
    a, b = shadow.sample(range(4), 2)
    assert router.route(_req("r1", []), 0.0) == a  # load1 <= load2: the first draw
    router.load = [0, 0, 0, 0]
    router.load[a] = 1
    a, b = shadow.sample(range(4), 2)
    want = b if router.load[b] < router.load[a] else a
    assert router.route(_req("r2", []), 0.0) == want


# ---- the agreement replay of bench realtime --agreement ------------------------------------------------------


def test_agreement_replay_teacher_forces_and_scores_ties_and_draws() -> None:
    from pilotfish.bench.realtime_agreement import power_of_two_probabilities, replay
    from pilotfish.simulator.cluster.metrics import RequestRecord
    from pilotfish.simulator.traces.model import TraceRequest

    # four idle engines: two draws, the first kept on equal loads: uniform
    assert power_of_two_probabilities([0, 0, 0, 0]) == [0.25] * 4
    # engine 0 busy: it wins no pair (the other draw is always less loaded): 0, the rest 1/3 each
    assert power_of_two_probabilities([1, 0, 0, 0]) == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3])
    trace = [
        TraceRequest("a", 0.0, 64, 4, (("sys", 48), ("a", 16))),
        TraceRequest("b", 0.1, 64, 4, (("sys", 48), ("b", 16))),
        TraceRequest("c", 0.2, 64, 4, (("other", 64),)),
    ]
    records = [RequestRecord("a", 2, 0.0, 64, 4), RequestRecord("b", 2, 0.1, 64, 4), RequestRecord("c", 1, 0.2, 64, 4)]
    for rec, end in zip(records, (5.0, 5.0, 5.0), strict=True):
        rec.finished = end
    # warm-ups went to engine 2 (the router's first worker when all are idle)
    out = replay("sglang-router:cache_aware", trace, records, [("w", 2)], 4)  # no URLs: warm-up first
    # a: a miss, all idle: the first in order (2, learnt from the warm-up) -> agree; b: 48 of 64 tokens on 2 -> 2,
    # agree; c: a miss, loads [0, 0, 2, 0]: a tie among 0, 1 and 3, whose order is unknown: 1/3 each, and the
    # real choice (1) is learnt as the next worker in the router's order
    assert out["tie_order"] == [2, 0, 1, 3] and out["learnt_order"] == [2, 1]
    assert (out["determined"], out["determined_agree"], out["ties"], out["tie_real_among_choices"]) == (2, 2, 1, 1)
    assert out["expected_agreement"] == pytest.approx((1 + 1 + 1 / 3) / 3)
    rr = replay("vllm-router:round_robin", trace, records, [("w", 0)] * 4, 4)
    # the warm-ups did not walk a cycle (all on 0): order [0, 1, 2, 3]; the counter stands at 4:
    # predictions 0, 1, 2 against 2, 2, 1
    assert rr["expected_agreement"] == 0.0
    cycle = replay("vllm-router:round_robin", trace, records, [("w", 2), ("w", 3), ("w", 1), ("w", 0)], 4)
    # the warm-ups walked the cycle 2, 3, 1, 0: predictions 2, 3, 1 against 2, 2, 1
    assert cycle["learnt_order"] == [2, 3, 1, 0] and cycle["expected_agreement"] == pytest.approx(2 / 3)
