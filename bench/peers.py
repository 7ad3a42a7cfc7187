"""Peers' published routing policies, reimplemented from their formulas for the virtual-time cluster.

Each router states in its docstring the file its formula and defaults come from. Nothing here is
tuned: every constant is the peer's own default. Where the simulator gives a peer something it
would have to approximate in production (the exact KV events, say), the docstring says so.

A router that needs to read the engines (as a metrics scrape or a KV-event feed would) has
`observe_engine(index, core)`, which the harness hands to `ClusterSim(observers=...)`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque

from pilotfish.simulator.cluster import Router, RouteRequest
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.scheduler import V1Engine


def cached_prefix_blocks(core: V1Engine, hashes: list[int], limit: int | None = None) -> int:
    """Leading blocks of `hashes` the engine's prefix cache holds right now (what KV events tell)."""
    cached = core.kv.pool.cached
    n = 0
    for h in hashes if limit is None else hashes[:limit]:
        if h not in cached:
            break
        n += 1
    return n


def pick_min(values: list[float], rng: random.Random) -> int:
    """Index of the lowest value; ties broken at random (the peers shuffle or sample among equals)."""
    best = min(values)
    ties = [i for i, v in enumerate(values) if v == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class _Outstanding(Router):
    """Requests this router dispatched and has not yet seen finish, per engine (a router-local load)."""

    def __init__(self) -> None:
        self.load: list[int] = []

    def bind(self, engine_ids: list[str]) -> None:
        self.load = [0] * len(engine_ids)

    def on_finish(self, request_id: str, engine: int, now: float) -> None:
        self.load[engine] -= 1


class PowerOfTwoRouter(_Outstanding):
    """Power of two choices: two engines drawn at random, the one with fewer outstanding requests wins.

    sgl-project/sglang `sgl-router/src/policies/power_of_two.rs`: two distinct workers sampled
    uniformly, the lower `load()` (the router's own in-flight count) chosen, the first on a tie.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(f"power-of-two:{seed}")

    def route(self, request: RouteRequest, now: float) -> int:
        n = len(self.load)
        if n == 1:
            pick = 0
        else:
            a, b = self.rng.sample(range(n), 2)
            pick = b if self.load[b] < self.load[a] else a
        self.load[pick] += 1
        return pick


# ---- llm-d / Gateway API Inference Extension ---------------------------------------------------------


class _Scrape(EngineObserver):
    """An engine's `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` after each step, with its time."""

    def __init__(self, core: V1Engine) -> None:
        self.core = core
        self.history: deque[tuple[float, int, float]] = deque([(0.0, 0, 0.0)])

    def step_finished(
        self, now: float, duration: float, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int
    ) -> None:
        # vLLM refreshes these gauges once per step, so a scrape sees the state after the last step
        self.history.append((now + duration, len(self.core.waiting), self.core.kv.usage()))

    def at(self, t: float) -> tuple[int, float]:
        """The gauges as a scrape at time `t` reads them (calls come with `t` non-decreasing)."""
        h = self.history
        while len(h) > 1 and h[1][0] <= t:
            h.popleft()
        return (h[0][1], h[0][2]) if h[0][0] <= t else (0, 0.0)


class LlmdDefaultRouter(Router):
    """The Gateway API Inference Extension / llm-d endpoint picker's default scheduling profile.

    score = 2 * queue + 2 * kv-cache-utilization + 3 * prefix-cache, highest score wins:
    - queue scorer (`pkg/epp/scheduling/framework/plugins/scorer/queue.go`):
      (max_q - q) / (max_q - min_q) over the candidates' waiting-queue sizes, 1 when all are equal;
    - KV-cache utilization scorer (`.../scorer/kvcache_utilization.go`): 1 - KV cache usage;
    - prefix-cache scorer (`.../plugins/multi/prefix/plugin.go`): matched prefix blocks / request
      blocks, from the picker's own LRU index of the prefixes it sent to each server
      (DefaultMaxPrefixBlocksToMatch 256, DefaultLRUCapacityPerServer 31250); blocks here are the
      engine's 16-token blocks (vLLM's default block size, the plugin's hashing unit);
    - max-score picker (`.../picker/max_score_picker.go`): the highest total, ties at random;
    - weights 2/2/3: the default profile of llm-d's `gaie-inference-scheduling` values and the
      GIE `default-plugins` config;
    - metrics refreshed every 50 ms (`--refresh-metrics-interval`, default 50ms in
      `cmd/epp/runner`): queue and KV figures are those of the last scrape tick, each tick reading
      the gauges as vLLM left them after its last step.
    """

    def __init__(self, seed: int = 0, *, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 prefix_weight: float = 3.0, scrape_interval: float = 0.05, max_prefix_blocks: int = 256,
                 lru_capacity_per_server: int = 31250) -> None:
        self.rng = random.Random(f"llm-d:{seed}")
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self.scrape_interval = scrape_interval
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity = lru_capacity_per_server
        self.scrapes: dict[int, _Scrape] = {}
        self.lru: list[OrderedDict[int, None]] = []

    def observe_engine(self, index: int, core: V1Engine) -> None:
        scrape = _Scrape(core)
        core.add_observer(scrape)
        self.scrapes[index] = scrape

    def bind(self, engine_ids: list[str]) -> None:
        self.lru = [OrderedDict() for _ in engine_ids]

    def route(self, request: RouteRequest, now: float) -> int:
        n = len(self.lru)
        tick = math.floor(now / self.scrape_interval) * self.scrape_interval if self.scrape_interval > 0 else now
        gauges = [self.scrapes[k].at(tick) for k in range(n)]
        queues = [g[0] for g in gauges]
        lo, hi = min(queues), max(queues)
        hashes = request.block_hashes[:self.max_prefix_blocks]
        total = len(hashes)
        wq, wk, wp = self.weights
        scores: list[float] = []
        for k in range(n):
            queue_score = 1.0 if hi == lo else (hi - queues[k]) / (hi - lo)
            kv_score = 1.0 - gauges[k][1]
            matched = 0
            lru = self.lru[k]
            for h in hashes:
                if h not in lru:
                    break
                matched += 1
            prefix_score = matched / total if total else 0.0
            # negated: pick_min picks the highest score
            scores.append(-(wq * queue_score + wk * kv_score + wp * prefix_score))
        pick = pick_min(scores, self.rng)
        self._record(pick, hashes)
        return pick

    def _record(self, k: int, hashes: list[int]) -> None:
        # the plugin's PreRequest: the chosen server now holds the request's prefix blocks (LRU)
        lru = self.lru[k]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.lru_capacity:
            lru.popitem(last=False)


# ---- Dynamo ---------------------------------------------------------------------------------------------


class DynamoKvRouter(Router):
    """NVIDIA Dynamo's KV router cost: lowest `overlap_score_weight * prefill_blocks + decode_blocks`.

    ai-dynamo/dynamo `lib/llm/src/kv_router/scheduler.rs` (`DefaultWorkerSelector::select_worker`)
    and `docs/router/kv_cache_routing.md`: for each worker, prefill_blocks = (the worker's active
    prefill tokens + this request's tokens not cached there) / block_size, decode_blocks = the
    active blocks the worker would hold with this request; `--kv-overlap-score-weight` 1.0 and
    `--router-temperature` 0.0 (deterministic lowest cost; ties at random). Active prefill tokens
    and blocks are the router's own account (`ActiveSequences`): added at dispatch, prefill
    tokens dropped at the first token, blocks at the end, shared prefix blocks counted once.
    The cached overlap comes from KV events (`KvIndexer`); here the events arrive instantly and
    exactly, which favours Dynamo over a real deployment.
    """

    def __init__(self, seed: int = 0, *, overlap_score_weight: float = 1.0) -> None:
        self.rng = random.Random(f"dynamo:{seed}")
        self.weight = overlap_score_weight
        self.cores: dict[int, V1Engine] = {}
        self.prefill_tokens: list[int] = []
        self.block_refs: list[dict[int, int]] = []  # per worker: block hash -> active requests holding it
        self.partial_blocks: list[int] = []  # per worker: requests whose last block is partial (never shared)
        self.requests: dict[str, tuple[int, int, list[int], bool]] = {}  # id -> (worker, prefill, hashes, partial)

    def observe_engine(self, index: int, core: V1Engine) -> None:
        self.cores[index] = core

    def bind(self, engine_ids: list[str]) -> None:
        n = len(engine_ids)
        self.prefill_tokens = [0] * n
        self.block_refs = [{} for _ in range(n)]
        self.partial_blocks = [0] * n

    def route(self, request: RouteRequest, now: float) -> int:
        bs = request.block_size
        isl = request.prompt_tokens
        hashes = request.block_hashes
        partial = isl % bs != 0
        costs: list[float] = []
        news: list[int] = []
        for k in range(len(self.prefill_tokens)):
            overlap = cached_prefix_blocks(self.cores[k], hashes)
            new_tokens = max(isl - overlap * bs, 0)
            prefill_blocks = (self.prefill_tokens[k] + new_tokens) / bs
            refs = self.block_refs[k]
            new_blocks = sum(1 for h in hashes if h not in refs) + (1 if partial else 0)
            decode_blocks = len(refs) + self.partial_blocks[k] + new_blocks
            costs.append(self.weight * prefill_blocks + decode_blocks)
            news.append(new_tokens)
        pick = pick_min(costs, self.rng)
        self.prefill_tokens[pick] += news[pick]
        refs = self.block_refs[pick]
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
        self.partial_blocks[pick] += 1 if partial else 0
        self.requests[request.request_id] = (pick, news[pick], hashes, partial)
        return pick

    def on_progress(self, request_id: str, engine: int, generated_tokens: int, now: float) -> None:
        entry = self.requests.get(request_id)
        if entry is not None and entry[1]:
            self.prefill_tokens[entry[0]] -= entry[1]  # prefill done: its tokens leave the prefill load
            self.requests[request_id] = (entry[0], 0, entry[2], entry[3])

    def on_finish(self, request_id: str, engine: int, now: float) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        k, prefill, hashes, partial = entry
        self.prefill_tokens[k] -= prefill
        refs = self.block_refs[k]
        for h in hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
        self.partial_blocks[k] -= 1 if partial else 0


# ---- SGLang router ---------------------------------------------------------------------------------------


class SglangCacheAwareRouter(_Outstanding):
    """SGLang router's `cache_aware` policy: balance thresholds first, then prefix match over a radix tree.

    sgl-project/sglang `sgl-router/src/policies/cache_aware.rs`, defaults from
    `sgl-router/py_src/sglang_router/launch_router.py` (the CLI an operator runs):
    - loads are the router's own in-flight counts; the system is imbalanced when
      max - min > balance_abs_threshold (64) AND max > min * balance_rel_threshold (1.5): then the
      least-loaded worker wins (and the tree still records the request there);
    - otherwise the approximate tree of what was sent to each worker gives the longest prefix
      match; match rate = matched / prompt length; above cache_threshold (0.3) the matching
      worker wins, else the worker with the smallest tree;
    - every eviction_interval_secs (120) each worker's tree is cut back, least recently used
      first, to max_tree_size (2**26). The tree holds characters; here it holds the engine's
      16-token blocks, and the size limit is converted at 4 characters per token.
    A tie in match length goes to the worker that most recently received that prefix.
    """

    def __init__(self, seed: int = 0, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval: float = 120.0,
                 max_tree_size_chars: int = 2**26, chars_per_token: int = 4) -> None:
        super().__init__()  # `seed` unused: the policy draws no random numbers (kept for one factory shape)
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.eviction_interval = eviction_interval
        self.max_tree_tokens = max_tree_size_chars // chars_per_token
        self.trees: list[OrderedDict[int, None]] = []  # per worker: block hash, least recently used first
        self.block_size = 16
        self._next_eviction = eviction_interval
        self._stamps: dict[tuple[int, int], int] = {}  # (worker, block) -> insertion counter, for ties
        self._clock = 0

    def bind(self, engine_ids: list[str]) -> None:
        super().bind(engine_ids)
        self.trees = [OrderedDict() for _ in engine_ids]

    def route(self, request: RouteRequest, now: float) -> int:
        self.block_size = request.block_size
        self._evict(now)
        load = self.load
        hi, lo = max(load), min(load)
        hashes = request.block_hashes
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            pick = min(range(len(load)), key=load.__getitem__)
        else:
            pick = self._cache_pick(request, hashes)
        self._insert(pick, hashes)
        load[pick] += 1
        return pick

    def _cache_pick(self, request: RouteRequest, hashes: list[int]) -> int:
        matched = 0
        candidates = list(range(len(self.trees)))
        for h in hashes:
            have = [k for k in candidates if h in self.trees[k]]
            if not have:
                break
            candidates = have
            matched += 1
        rate = matched * request.block_size / request.prompt_tokens if request.prompt_tokens else 0.0
        if matched and rate > self.cache_threshold:
            last = hashes[matched - 1]
            # the most recent holder: its entry for the last matched block is the newest
            return max(candidates, key=lambda k: self._recency(k, last))
        return min(range(len(self.trees)), key=lambda k: len(self.trees[k]))

    def _recency(self, k: int, h: int) -> int:
        return self._stamps.get((k, h), 0)

    def _insert(self, k: int, hashes: list[int]) -> None:
        tree = self.trees[k]
        self._clock += 1
        for h in hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
            self._stamps[(k, h)] = self._clock

    def _evict(self, now: float) -> None:
        if self.eviction_interval <= 0 or now < self._next_eviction:
            return
        while self._next_eviction <= now:
            self._next_eviction += self.eviction_interval
        limit = max(self.max_tree_tokens // self.block_size, 1)
        for k, tree in enumerate(self.trees):
            while len(tree) > limit:
                h, _ = tree.popitem(last=False)
                self._stamps.pop((k, h), None)
