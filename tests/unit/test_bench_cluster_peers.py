"""The peers' policies in bench/peers.py and the oracle: each formula on hand-built engine states."""

from __future__ import annotations

import pytest

from pilotfish.bench.cluster_oracle import OracleRouter, predicted_ttft
from pilotfish.bench.peers import (
    DynamoKvRouter,
    LlmdDefaultRouter,
    PowerOfTwoRouter,
    SglangCacheAwareRouter,
    cached_prefix_blocks,
)
from pilotfish.simulator.cluster import RouteRequest
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.kv_cache import KVBlock
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.virtual import VirtualEngine

BS = 16


def _cores(n: int) -> list[V1Engine]:
    return [V1Engine(EngineConfig(num_gpu_blocks=1024, max_model_len=8192)) for _ in range(n)]


def _cache(core: V1Engine, hashes: list[int]) -> None:
    for i, h in enumerate(hashes):
        core.kv.pool.cached[h] = KVBlock(10_000 + i, 0, h)


def _req(rid: str, hashes: list[int], tokens: int | None = None) -> RouteRequest:
    return RouteRequest(rid, tokens if tokens is not None else len(hashes) * BS + 1, 8, hashes, BS)


def test_cached_prefix_blocks_stops_at_the_first_miss() -> None:
    (core,) = _cores(1)
    _cache(core, [1, 2, 4])
    assert cached_prefix_blocks(core, [1, 2, 3, 4]) == 2
    assert cached_prefix_blocks(core, [1, 2, 3, 4], limit=1) == 1
    assert cached_prefix_blocks(core, [9, 1]) == 0


def test_power_of_two_takes_the_less_loaded_of_its_two_draws() -> None:
    router = PowerOfTwoRouter(seed=3)
    router.bind(["a", "b"])
    router.load = [5, 0]
    assert router.route(_req("r", []), 0.0) == 1  # with two engines both are drawn
    assert router.load == [5, 1]
    router.on_finish("r", 1, 1.0)
    assert router.load == [5, 0]


@pytest.mark.parametrize(
    ("queues", "kv", "lru", "want"),
    [
        # equal queues and KV: the prefix scorer (weight 3) decides
        ([0, 0, 0], [0.1, 0.1, 0.1], {2: [1, 2, 3, 4]}, 2),
        # no prefix anywhere: queue (2 x normalized) beats KV (2 x (1 - usage)) differences below 1
        ([4, 0, 2], [0.0, 0.4, 0.0], {}, 1),
        # a full prefix match (+3) outweighs the longest queue (-2) on the same engine
        ([9, 0, 0], [0.0, 0.0, 0.0], {0: [1, 2, 3, 4]}, 0),
        # half a prefix (+1.5) does not outweigh it
        ([9, 0, 0], [0.0, 0.0, 0.0], {0: [1, 2]}, None),
    ],
)
def test_llmd_default_profile_scores(queues: list[int], kv: list[float], lru: dict[int, list[int]],
                                     want: int | None) -> None:
    cores = _cores(3)
    router = LlmdDefaultRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
        router.scrapes[i].history.append((0.0, queues[i], kv[i]))
    router.bind(["a", "b", "c"])
    for k, hashes in lru.items():
        router._record(k, hashes)
    got = router.route(_req("r", [1, 2, 3, 4]), 0.06)
    if want is None:
        assert got in (1, 2)
    else:
        assert got == want


def test_llmd_reads_the_gauges_of_the_last_scrape_tick_not_the_present() -> None:
    (core,) = _cores(1)
    router = LlmdDefaultRouter(seed=0)
    router.observe_engine(0, core)
    scrape = router.scrapes[0]
    scrape.history.extend([(0.01, 3, 0.2), (0.07, 9, 0.9)])
    assert scrape.at(0.05) == (3, 0.2)  # the step that ended at 0.07 is not yet scraped at tick 0.05
    assert scrape.at(0.10) == (9, 0.9)


def test_dynamo_cost_is_uncached_prefill_blocks_plus_active_blocks() -> None:
    cores = _cores(2)
    router = DynamoKvRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
    router.bind(["a", "b"])
    _cache(cores[1], [1, 2, 3])
    # engine 1 holds 3 of 4 blocks: cost 1 x (1 block + 1 token)/16 + 5 blocks vs 1 x 65/16 + 5 on engine 0
    assert router.route(_req("r1", [1, 2, 3, 4]), 0.0) == 1
    assert router.prefill_tokens == [0, 17]
    # engine 1 now carries active blocks and prefill: an unrelated request goes to engine 0
    assert router.route(_req("r2", [7, 8]), 0.0) == 0
    router.on_progress("r1", 1, 1, 0.1)
    assert router.prefill_tokens[1] == 0
    router.on_finish("r1", 1, 0.2)
    assert router.block_refs[1] == {} and router.partial_blocks[1] == 0
    assert router.holders == {h: {0} for h in (7, 8)}


def test_dynamo_costs_count_held_blocks_as_the_per_worker_definition() -> None:
    """The holders map gives each worker's held share of a request's hashes exactly as a scan of that
    worker's block_refs would, through overlapping, repeated and finished requests."""
    import random

    rng = random.Random(7)
    cores = _cores(4)
    router = DynamoKvRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
    router.bind(["a", "b", "c", "d"])
    live: list[str] = []
    for n in range(300):
        hashes = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]  # repeats and overlaps on purpose
        request = _req(f"r{n}", hashes, rng.randrange(1, 300))
        costs, news = router.costs(request)
        for k in range(4):
            refs = router.block_refs[k]
            new_blocks = sum(1 for h in hashes if h not in refs) + (1 if request.prompt_tokens % BS else 0)
            want = (router.prefill_tokens[k] + news[k]) / BS + len(refs) + router.partial_blocks[k] + new_blocks
            assert costs[k] == want
        k = router.route(request, 0.0)
        live.append(request.request_id)
        if live and rng.random() < 0.45:
            gone = live.pop(rng.randrange(len(live)))
            router.on_finish(gone, router.requests[gone][0], 0.0)
        assert router.holders == {h: {k for k in range(4) if h in router.block_refs[k]}
                                  for h in set().union(*router.block_refs)}


def test_sglang_balances_when_imbalanced_else_follows_the_prefix() -> None:
    router = SglangCacheAwareRouter(seed=0)
    router.bind(["a", "b", "c"])
    router._insert(0, [1, 2, 3, 4])
    # balanced, match rate 64/65 > 0.3: the holder of the prefix
    assert router.route(_req("r1", [1, 2, 3, 4]), 0.0) == 0
    # balanced, no match: the least-loaded worker (engines 1 and 2 carry nothing; the first of them)
    assert router.route(_req("r2", [9, 9, 9]), 0.0) == 1
    # imbalanced (100 - 0 > 64 and 100 > 0 x 1.5): the least loaded, whatever the prefix
    router.load = [100, 50, 0]
    assert router.route(_req("r3", [1, 2, 3, 4]), 0.0) == 2
    # a short match below the 0.3 threshold: the least loaded, the first in worker order on a tie
    # (sglang-router 0.3.2 sends a miss by load; it used to go to the smallest tree)
    router.load = [1, 1, 1]
    assert router.route(_req("r4", [1, 5, 6, 7], tokens=200), 0.0) == 0


def test_oracle_prefers_the_cached_idle_engine_and_counts_the_queue() -> None:
    cores = _cores(2)
    engines = [VirtualEngine(c) for c in cores]
    router = OracleRouter(seed=0)
    for i, core in enumerate(cores):
        router.observe_engine(i, core)
    router.attach_engines(engines)
    router.bind(["a", "b"])
    hashes = list(range(1, 33))
    _cache(cores[1], hashes)
    request = _req("r", hashes)
    assert predicted_ttft(cores[1], engines[1], request, 0.0) < predicted_ttft(cores[0], engines[0], request, 0.0)
    assert router.route(request, 0.0) == 1
    # a long queue on the cached engine outweighs its hit
    cores[1].add_request(SimRequest("q", list(range(6000)), 8), 0.0)
    assert router.route(_req("r2", hashes), 0.0) == 0
