"""Peers' published routing policies, reimplemented from their source for the virtual-time cluster.

Each router cites in its docstring the repository, path and version (tag or commit) it follows,
and says what cannot be reproduced exactly and why. Nothing here is tuned: every constant is the
peer's own shipped default. tests/unit/test_bench_peers_fidelity.py replays a short decision
sequence against each, with the expected choices worked out by hand from that upstream code, and
`pilotfish bench realtime --agreement` compares the reproductions of sglang-router and
vllm-router with the real routers on the same requests.

Routers whose choice the agreement check replays split `route` into `decide` (the set of choices
the policy considers equal, without changing state) and `commit` (the state update for the engine
the request went to), so a replay can feed them the real router's choice ("teacher forcing").

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

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        self.load[engine] -= 1


class PowerOfTwoRouter(_Outstanding):
    """Power of two choices: two engines drawn at random, the one with fewer outstanding requests wins.

    sgl-project/sglang `sgl-model-gateway/src/policies/power_of_two.rs` (commit 065f331; before the
    rename `sgl-router/src/policies/power_of_two.rs`): two distinct workers drawn uniformly,
    `load1 <= load2` keeps the first draw. Not exact: upstream prefers the token loads its
    LoadMonitor polls from SGLang workers' `/get_load` (every `load_check_interval_secs`) and falls
    back to the router's own in-flight count; here it is always the in-flight count, as in front of
    vLLM engines, which do not serve `/get_load`. Its draws are random, so only distributions can
    be compared with the real router.
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
    """The llm-d endpoint picker (EPP) with its shipped default configuration.

    Source: llm-d/llm-d-inference-scheduler at commit 520af478 (main after tag v0.8.0, May 2026;
    GIE's EPP has been merged into that repository, so one tree holds every file below):
    - `pkg/epp/config/loader/defaults.go` (`loadDefaultConfig`, what the EPP runs with no config
      file) and the Helm chart's `config/charts/epplib/templates/_config.yaml`
      (`default-plugins.yaml`): one profile, `queue-scorer` weight 2,
      `kv-cache-utilization-scorer` weight 2, `prefix-cache-scorer` weight 3, no filter, the
      `max-score-picker`;
    - `pkg/epp/scheduling/scheduler_profile.go`: score = sum of weight x scorer score, each score
      clamped to [0, 1];
    - `.../scheduling/scorer/queuedepth/queue.go`: (max_q - q) / (max_q - min_q) over the
      candidates' `vllm:num_requests_waiting`, 1 for all when they are equal;
    - `.../scheduling/scorer/kvcacheutilization/kvcache_utilization.go`: 1 - `vllm:kv_cache_usage_perc`;
    - `.../scheduling/scorer/prefix/plugin.go`: matched blocks / total blocks of the request, both
      from `.../requestcontrol/dataproducer/approximateprefix/` (`plugin.go`, `indexer.go`,
      `hashing.go`, `types.go`), the producer injected by default: the prompt cut into blocks of
      16 tokens (`defaultBlockSizeTokens`, auto-tuned from the engine's block size), chained
      hashes, at most 256 blocks (`defaultMaxPrefixBlocks`), a trailing partial block hashed and
      counted too; `matchLongestPrefix` walks the request's blocks in order, adds one to every
      server that holds the block, and stops at the first block that *no* server holds; the
      chosen server's LRU (capacity: the engine's `num_gpu_blocks` from `vllm:cache_config_info`
      under the default `autoTune`, else 31,250) records every block of the request in
      `PreRequest`, before the response;
    - `.../scheduling/picker/maxscore/picker.go`: shuffle, then the highest total (ties at random);
    - `pkg/epp/server/options.go`: metrics refreshed every 50 ms (`--refresh-metrics-interval`).

    What this cannot reproduce exactly, and why:
    - upstream hashes prompt *characters*, 4 per token (`averageCharactersPerToken`), so a block
      is 64 characters of the request body; here a block is the engine's 16 tokens, which is the
      same unit only where text averages 4 characters a token. The trailing partial block's hash
      is a stand-in (its length and the last full block), since the simulator's request carries
      no token content: two prompts that differ only inside their last partial block look equal;
    - each pod is scraped on its own 50 ms ticker; here every engine is read at the same ticks.

    On a shared prefix (every request starts with the same system prompt) this configuration
    sends work to the engines that already hold the prefix until the others' lead in queue and
    KV-cache scores (at most 2 + 2) beats the holders' prefix score (3 x matched / total): with a
    512-token system prompt and a short turn the holders score about 2.5 more, and the queue
    score alone is worth at most 2 however long the queue. That lock-in is upstream's formula,
    not a bug of this reproduction; the fidelity test replays it.
    """

    def __init__(self, seed: int = 0, *, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 prefix_weight: float = 3.0, scrape_interval: float = 0.05, max_prefix_blocks: int = 256,
                 lru_capacity_per_server: int = 31250, auto_tune: bool = True) -> None:
        self.rng = random.Random(f"llm-d:{seed}")
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self.scrape_interval = scrape_interval
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity = lru_capacity_per_server
        self.auto_tune = auto_tune
        self.scrapes: dict[int, _Scrape] = {}
        self.lru: list[OrderedDict[int, None]] = []
        self.capacity: list[int] = []

    def observe_engine(self, index: int, core: V1Engine) -> None:
        scrape = _Scrape(core)
        core.add_observer(scrape)
        self.scrapes[index] = scrape

    def bind(self, engine_ids: list[str]) -> None:
        self.lru = [OrderedDict() for _ in engine_ids]
        self.capacity = []
        for k in range(len(engine_ids)):
            scrape = self.scrapes.get(k)
            blocks = scrape.core.kv.pool.num_blocks if (self.auto_tune and scrape is not None) else 0
            self.capacity.append(blocks if blocks > 0 else self.lru_capacity)

    def prefix_hashes(self, request: RouteRequest) -> list[int]:
        """The request's block hashes as the producer makes them: full blocks, then a partial one, at most 256."""
        hashes = list(request.block_hashes[:self.max_prefix_blocks])
        if len(hashes) < self.max_prefix_blocks and request.prompt_tokens % request.block_size:
            last = hashes[-1] if hashes else 0
            hashes.append(hash(("llm-d-partial", last, request.prompt_tokens % request.block_size)))
        return hashes

    def match(self, hashes: list[int]) -> list[int]:
        """`matchLongestPrefix`: per server, blocks held among the leading blocks some server holds."""
        res = [0] * len(self.lru)
        for h in hashes:
            holders = [k for k, lru in enumerate(self.lru) if h in lru]
            if not holders:
                break
            for k in holders:
                res[k] += 1
        return res

    def scores(self, request: RouteRequest, now: float) -> list[float]:
        """Each engine's weighted total, as the profile sums it."""
        n = len(self.lru)
        tick = math.floor(now / self.scrape_interval) * self.scrape_interval if self.scrape_interval > 0 else now
        gauges = [self.scrapes[k].at(tick) for k in range(n)]
        queues = [g[0] for g in gauges]
        lo, hi = min(queues), max(queues)
        hashes = self.prefix_hashes(request)
        total = len(hashes)
        matched = self.match(hashes)
        wq, wk, wp = self.weights
        out = []
        for k in range(n):
            queue_score = 1.0 if hi == lo else (hi - queues[k]) / (hi - lo)
            kv_score = min(max(1.0 - gauges[k][1], 0.0), 1.0)
            prefix_score = matched[k] / total if total else 0.0
            out.append(wq * queue_score + wk * kv_score + wp * prefix_score)
        return out

    def route(self, request: RouteRequest, now: float) -> int:
        scores = self.scores(request, now)
        pick = pick_min([-s for s in scores], self.rng)  # the highest score; ties at random
        self._record(pick, self.prefix_hashes(request))
        return pick

    def _record(self, k: int, hashes: list[int]) -> None:
        # the producer's PreRequest: the chosen server now holds the request's blocks (LRU)
        lru = self.lru[k]
        capacity = self.capacity[k] if k < len(self.capacity) else self.lru_capacity
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > capacity:
            lru.popitem(last=False)


# ---- Dynamo ---------------------------------------------------------------------------------------------


class DynamoKvRouter(Router):
    """NVIDIA Dynamo's KV router: lowest `overlap_score_weight * prefill_blocks + decode_blocks`.

    Source: ai-dynamo/dynamo `DefaultWorkerSelector::select_worker` in
    `lib/kv-router/src/scheduling/selector.rs` (earlier `lib/llm/src/kv_router/scheduler.rs`), in
    the form it had through the 0.x releases: logit = overlap_score_weight x prefill_tokens /
    block_size + decode_blocks, where the scheduler's `ActiveSequences` give, per worker,
    prefill_tokens = the worker's active prefill tokens + this request's tokens not cached there,
    and decode_blocks = the blocks the worker would hold with this request (shared prefix blocks
    counted once); `--kv-overlap-score-weight` 1.0 and `--router-temperature` 0.0, which takes the
    lowest logit; among several at the lowest, the one whose indexer tree (blocks the KV events
    say it caches) is smallest, and a random one if those are equal too. Active prefill tokens
    leave at the first token, blocks at the end. Docs: `docs/router/kv_cache_routing.md`.

    What this cannot reproduce exactly, and why:
    - the cached overlap and tree sizes come from KV events (`KvIndexer`); here they are read
      from the engine's cache at the instant of the decision, exact and without delay, which
      favours Dynamo over a real deployment;
    - Dynamo's current main (commit 01690d4 of `selector.rs`) has since reshaped the logit
      (`overlap_score_credit` with a load-dependent decay, `prefill_load_scale`, a per-request
      decode weight); this reproduction keeps the older published form above, whose defaults the
      Dynamo docs still describe. No Dynamo router runs here, so there is no agreement check.
    """

    def __init__(self, seed: int = 0, *, overlap_score_weight: float = 1.0) -> None:
        self.rng = random.Random(f"dynamo:{seed}")
        self.weight = overlap_score_weight
        self.cores: dict[int, V1Engine] = {}
        self.prefill_tokens: list[int] = []
        self.block_refs: list[dict[int, int]] = []  # per worker: block hash -> active requests holding it
        # block hash -> the workers whose block_refs hold it: a request's held blocks per worker
        # in one pass over its hashes, not one per worker (64 x a long prompt's hashes per decision)
        self.holders: dict[int, set[int]] = {}
        self.partial_blocks: list[int] = []  # per worker: requests whose last block is partial (never shared)
        self.requests: dict[str, tuple[int, int, list[int], bool]] = {}  # id -> (worker, prefill, hashes, partial)

    def observe_engine(self, index: int, core: V1Engine) -> None:
        self.cores[index] = core

    def bind(self, engine_ids: list[str]) -> None:
        n = len(engine_ids)
        self.prefill_tokens = [0] * n
        self.block_refs = [{} for _ in range(n)]
        self.partial_blocks = [0] * n

    def costs(self, request: RouteRequest) -> tuple[list[float], list[int]]:
        """Each worker's logit, and the request's uncached tokens there."""
        bs = request.block_size
        isl = request.prompt_tokens
        hashes = request.block_hashes
        partial = isl % bs != 0
        costs: list[float] = []
        news: list[int] = []
        held = [0] * len(self.prefill_tokens)  # per worker: the request's hashes its block_refs hold
        holders = self.holders
        for h in hashes:
            workers = holders.get(h)
            if workers:
                for k in workers:
                    held[k] += 1
        for k in range(len(self.prefill_tokens)):
            overlap = cached_prefix_blocks(self.cores[k], hashes)
            new_tokens = max(isl - overlap * bs, 0)
            prefill_blocks = (self.prefill_tokens[k] + new_tokens) / bs
            refs = self.block_refs[k]
            new_blocks = len(hashes) - held[k] + (1 if partial else 0)  # the hashes refs lacks
            decode_blocks = len(refs) + self.partial_blocks[k] + new_blocks
            costs.append(self.weight * prefill_blocks + decode_blocks)
            news.append(new_tokens)
        return costs, news

    def route(self, request: RouteRequest, now: float) -> int:
        costs, news = self.costs(request)
        best = min(costs)
        tied = [k for k, c in enumerate(costs) if c == best]
        if len(tied) > 1:  # the smallest indexer tree, then at random
            sizes = {k: len(self.cores[k].kv.pool.cached) for k in tied}
            smallest = min(sizes.values())
            tied = [k for k in tied if sizes[k] == smallest]
        pick = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        hashes = request.block_hashes
        partial = request.prompt_tokens % request.block_size != 0
        self.prefill_tokens[pick] += news[pick]
        refs = self.block_refs[pick]
        holders = self.holders
        for h in hashes:
            count = refs.get(h, 0)
            if not count:
                holders.setdefault(h, set()).add(pick)
            refs[h] = count + 1
        self.partial_blocks[pick] += 1 if partial else 0
        self.requests[request.request_id] = (pick, news[pick], hashes, partial)
        return pick

    def on_progress(self, request_id: str, engine: int, generated_tokens: int, now: float) -> None:
        entry = self.requests.get(request_id)
        if entry is not None and entry[1]:
            self.prefill_tokens[entry[0]] -= entry[1]  # prefill done: its tokens leave the prefill load
            self.requests[request_id] = (entry[0], 0, entry[2], entry[3])

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        k, prefill, hashes, partial = entry
        self.prefill_tokens[k] -= prefill
        refs = self.block_refs[k]
        holders = self.holders
        for h in hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
                workers = holders[h]
                workers.discard(k)
                if not workers:
                    del holders[h]
        self.partial_blocks[k] -= 1 if partial else 0


# ---- SGLang router and vllm-router ---------------------------------------------------------------------------


class SglangCacheAwareRouter(_Outstanding):
    """sglang-router's `cache_aware` policy: balance thresholds first, then the prefix match over a radix tree.

    Source: sgl-project/sglang `sgl-model-gateway/src/policies/cache_aware.rs` and `tree.rs`
    (the SGLang Model Gateway, shipped on PyPI as sglang-router; before it was renamed,
    `sgl-router/src/policies/`), defaults from sglang-router 0.3.2's `sglang_router/router_args.py`
    (the version scripts/install-peers.sh installs; its wheel's symbols name the same files):
    - loads are the router's own in-flight counts; the system is imbalanced when
      max - min > balance_abs_threshold (64) AND max > min x balance_rel_threshold (1.5): then the
      least-loaded worker wins (`min_by_key` over the workers: the first in the router's worker
      order on a tie), and the tree still records the request there;
    - otherwise the tree shared by all workers gives the longest prefix match; match rate =
      matched / prompt length; above cache_threshold (0.3) a worker holding the deepest matched
      node wins; at or below it, the least-loaded worker, as in the imbalanced case;
    - every eviction_interval_secs (60 in 0.3.2) each worker's share of the tree is cut back,
      least recently used leaves first, to max_tree_size (2**26 characters).
    vllm-router (a fork of the same router; `vllm_router/router_args.py` of 0.1.17) runs the same
    policy with eviction every 120 s and 2**25 characters: `vllm_router_cache_aware()`.

    What this cannot reproduce exactly, and why:
    - the tree holds characters of the request text; here it holds the engine's 16-token blocks,
      and the size limit is converted at 4 characters a token; a match ends at a block boundary
      where upstream's ends at a character;
    - which holder of the deepest node wins is "the first key" of that node's DashMap, whose
      order depends on per-map random hash keys: fixed within one router process, not
      predictable from outside. Here it is a seeded random choice among the holders, and
      `decide` returns every holder so a replay can tell a tie from a disagreement;
    - the order of `min_by_key` among equally loaded workers is the router's worker order, which
      for sglang-router 0.3.2 is not the order of `--worker-urls` (a probe with four idle
      workers sent every request to the third); `order` sets it, identity by default.

    Earlier versions of this reproduction sent a miss to the worker with the smallest tree and
    broke holder ties by recency; sglang-router 0.3.2 and vllm-router 0.1.17 both send a miss to
    the least-loaded worker (checked against the real routers: `bench realtime --agreement`).
    """

    def __init__(self, seed: int = 0, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval: float = 60.0,
                 max_tree_size_chars: int = 2**26, chars_per_token: int = 4,
                 order: list[int] | None = None) -> None:
        super().__init__()
        self.rng = random.Random(f"sglang:{seed}")
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.eviction_interval = eviction_interval
        self.max_tree_tokens = max_tree_size_chars // chars_per_token
        self.trees: list[OrderedDict[int, None]] = []  # per worker: block hash, least recently used first
        self.block_size = 16
        self.order = order
        self.last_reason = ""  # what the last `decide` went by: imbalanced, hit or miss
        self._next_eviction = eviction_interval

    def bind(self, engine_ids: list[str]) -> None:
        super().bind(engine_ids)
        self.trees = [OrderedDict() for _ in engine_ids]
        if self.order is None or sorted(self.order) != list(range(len(engine_ids))):
            self.order = list(range(len(engine_ids)))

    def _least_loaded(self) -> int:
        assert self.order is not None
        return min(self.order, key=self.load.__getitem__)  # the first in worker order on a tie

    def decide(self, request: RouteRequest, now: float) -> list[int]:
        """The workers the policy would pick from, as equals (one unless several hold the deepest match)."""
        self.block_size = request.block_size
        self._evict(now)
        load = self.load
        hi, lo = max(load), min(load)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            self.last_reason = "imbalanced"
            return [self._least_loaded()]
        matched = 0
        holders = list(range(len(self.trees)))
        for h in request.block_hashes:
            have = [k for k in holders if h in self.trees[k]]
            if not have:
                break
            holders = have
            matched += 1
        rate = matched * request.block_size / request.prompt_tokens if request.prompt_tokens else 0.0
        if matched and rate > self.cache_threshold:
            self.last_reason = "hit"
            return holders
        self.last_reason = "miss"
        return [self._least_loaded()]

    def commit(self, request: RouteRequest, k: int, now: float) -> None:
        """The request went to worker k: its tree records the prompt, its load counts one more."""
        tree = self.trees[k]
        for h in request.block_hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
        self.load[k] += 1

    def route(self, request: RouteRequest, now: float) -> int:
        choices = self.decide(request, now)
        pick = choices[0] if len(choices) == 1 else self.rng.choice(choices)
        self.commit(request, pick, now)
        return pick

    def _insert(self, k: int, hashes: list[int]) -> None:
        """Record `hashes` in worker k's tree without a dispatch (tests build trees with it)."""
        tree = self.trees[k]
        for h in hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None

    def _evict(self, now: float) -> None:
        if self.eviction_interval <= 0 or now < self._next_eviction:
            return
        while self._next_eviction <= now:
            self._next_eviction += self.eviction_interval
        limit = max(self.max_tree_tokens // self.block_size, 1)
        for tree in self.trees:
            while len(tree) > limit:
                tree.popitem(last=False)


def vllm_router_cache_aware(seed: int = 0, order: list[int] | None = None) -> SglangCacheAwareRouter:
    """vllm-router 0.1.17's `cache_aware`: the SGLang policy with its own defaults (120 s, 2**25 characters)."""
    return SglangCacheAwareRouter(seed, eviction_interval=120.0, max_tree_size_chars=2**25, order=order)


class RoundRobinPeer(Router):
    """vllm-router's and sglang-router's `round_robin`: a counter over the workers, every request counted.

    Source: sgl-project/sglang `sgl-model-gateway/src/policies/round_robin.rs` (vllm-router forks
    it): worker index = counter % workers, the counter incremented for every request the router
    routes (warm-up requests included), starting at 0. The cycle runs over the router's own worker
    list, whose order is not that of `--worker-urls` (vllm-router 0.1.17 cycled 3, 0, 2, 1 over
    four engines in one run, 0, 1, 3, 2 in another); `order` sets it, identity by default.
    """

    def __init__(self, seed: int = 0, order: list[int] | None = None) -> None:
        self.counter = 0
        self.n = 1
        self.order = order

    def bind(self, engine_ids: list[str]) -> None:
        self.n = len(engine_ids)
        if self.order is None or sorted(self.order) != list(range(self.n)):
            self.order = list(range(self.n))

    def decide(self, request: RouteRequest, now: float) -> list[int]:
        assert self.order is not None
        return [self.order[self.counter % self.n]]

    def commit(self, request: RouteRequest, k: int, now: float) -> None:
        self.counter += 1

    def route(self, request: RouteRequest, now: float) -> int:
        (pick,) = self.decide(request, now)
        self.commit(request, pick, now)
        return pick
