"""cache_aware selector: cache affinity, bounded by a load band so a shared prefix cannot hot-spot.

Ranking by cached prefix before load (cache-aware load-balance as first designed) locks in: the prefix
index is fed by dispatches, so the first instance to serve a block everyone shares (a system
prompt) has the longest hit for every later request, gets every later request, and is the only
one that ever learns the block. This selector lets a prefix hit move a request only among the
instances whose load is within a band of the least loaded one, as SGLang's cache-aware router
falls back to the shortest queue past its balance thresholds; past the band, load decides.
Once a request with the shared prefix lands elsewhere, the index records that instance as a
holder too, so later requests tie on the hit and spread by load.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pilotfish.scheduler.policy.base import Candidate, IndexWalk, Metric, Selector
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector, smallest
from pilotfish.scheduler.view.types import RequestInfo


class CacheAwareSelector(Selector):
    """`metrics` = [cache metric, load metric, more load metrics...].

    Let L be the first load metric (lower is better) and m its least value among the candidates.
    A candidate is *in band* when L <= max(m + balance_abs_threshold, m * balance_rel_threshold)
    (SGLang's balance test against the least loaded instance; the defaults are the load metric's
    `balance_band`). When the prefix index tells the in-band candidates apart (they do not all hold
    the same cached prefix of this request), the in-band candidates rank by the cache metric, then
    the load metrics, then their stable order, the rest following by load, and the random top-K pick
    stays in band. Otherwise the candidates rank by the load metrics alone, exactly as metric_based
    over them would (same ranking, same random draws): a prompt no instance holds routes as the
    load policy does.

    Bound: the target's load before the dispatch is at most max(m + abs, m * rel) whenever the
    cache metric decides (top_k as in metric_based otherwise), so an instance is never given more
    than the least loaded one's load plus the band, whatever it caches.
    """

    name = "cache_aware"
    index_walk = IndexWalk.BANDED

    def __init__(
        self,
        metrics: Sequence[Metric],
        top_k: int = 1,
        balance_abs_threshold: float | None = None,
        balance_rel_threshold: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if len(metrics) < 2:
            raise ValueError("cache_aware selector needs a cache metric, then at least one load metric")
        cache, *load = metrics
        if not cache.cache_locality:
            raise ValueError(f"cache_aware selector: {cache.name!r} is not a cache-locality metric (put one first)")
        if any(m.cache_locality for m in load):
            raise ValueError("cache_aware selector: only the first metric may be a cache-locality metric")
        if not load[0].lower_is_better:
            raise ValueError(f"cache_aware selector: the band's load metric {load[0].name!r} must be lower-is-better")
        band_abs, band_rel = load[0].balance_band
        self.balance_abs_threshold = float(band_abs if balance_abs_threshold is None else balance_abs_threshold)
        self.balance_rel_threshold = float(band_rel if balance_rel_threshold is None else balance_rel_threshold)
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self._metrics = tuple(metrics)
        self._cache = cache
        self._band_name = load[0].name
        self._signed = [(m.name, m.sign) for m in self._metrics]
        # the load policy alone: ranks, and draws its random top-K pick, as metric_based over `load`
        # (the load index calls it too)
        self.load_ranking = MetricBasedSelector(load, top_k, rng)
        self.top_k = top_k

    @property
    def metrics(self) -> Sequence[Metric]:
        return self._metrics

    def params(self) -> dict[str, Any]:
        return {
            "metrics": [m.name for m in self._metrics],
            "top_k": self.top_k,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
        }

    def band_limit(self, least: float) -> float:
        """The highest load in band, given the least load among the candidates."""
        return max(least + self.balance_abs_threshold, least * self.balance_rel_threshold)

    def select(self, cands: Sequence[Candidate], req: RequestInfo, count: int) -> list[Candidate]:
        hits = self._cache.ctx.prefix_hits(req)
        if not hits:  # nothing cached anywhere: the load policy's answer
            return self.load_ranking.select(cands, req, count)
        band = self._band_name
        loads = [c.values[band] for c in cands]
        limit = self.band_limit(min(loads))
        in_band = [pos for pos, load in enumerate(loads) if load <= limit]
        if not _told_apart(hits, [cands[pos].inst.endpoint.instance_id for pos in in_band]):
            return self.load_ranking.select(cands, req, count)  # the cache tells no in-band instance apart
        signed = self._signed
        if len(signed) == 3:  # the default's (cache, TTFT, TPOT): the keys inline, no list per candidate
            (n0, s0), (n1, s1), (n2, s2) = signed
            keyed = []
            for pos in in_band:
                values = cands[pos].values
                keyed.append(((values[n0] * s0, values[n1] * s1, values[n2] * s2), pos))
        else:
            keyed = [(tuple([cands[pos].values[n] * s for n, s in signed]), pos) for pos in in_band]
        head = [cands[pos] for _, pos in smallest(keyed, max(self.top_k, count))]
        ranked = self.load_ranking.pick(head, len(head))  # the random top-K pick, among in-band candidates only
        if len(ranked) >= count:
            return ranked[:count]
        # the fallbacks after them: the next by load alone
        taken = {id(c) for c in ranked}
        rest = [entry for entry in self.load_ranking.keyed(cands) if id(entry[2]) not in taken]
        return [*ranked, *(c for *_, c in smallest(rest, count - len(ranked)))]


def _told_apart(hits: dict[str, int], instance_ids: list[str]) -> bool:
    """Whether the instances do not all hold the same cached prefix (0 for none)."""
    if len(instance_ids) < 2:
        return False
    first = hits.get(instance_ids[0], 0)
    return any(hits.get(i, 0) != first for i in instance_ids)
