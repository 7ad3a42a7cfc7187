"""metricBasedSelector: rank by a list of metrics, pick at random among the top K."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Any, TypeVar

from pilotfish.scheduler.policy.base import Candidate, IndexWalk, Metric, Selector
from pilotfish.scheduler.view.types import RequestInfo

T = TypeVar("T")


class MetricBasedSelector(Selector):
    """Orders candidates by the first metric, ties by the next, then by their stable order.

    top_k == 1 picks the best; top_k > 1 picks uniformly among the best K, so several
    schedulers (or a burst between load updates) do not all pile onto one instance. The
    fallbacks are the rest of the ranking, best first.
    """

    name = "metric_based"
    index_walk = IndexWalk.RANKED

    def __init__(self, metrics: Sequence[Metric], top_k: int = 1, rng: random.Random | None = None) -> None:
        if not metrics:
            raise ValueError("metric_based selector needs at least one metric")
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self._metrics = tuple(metrics)
        self._signed = [(m.name, m.sign) for m in self._metrics]
        self.top_k = top_k
        self._rng = rng or random.Random()

    @property
    def metrics(self) -> Sequence[Metric]:
        return self._metrics

    def params(self) -> dict[str, Any]:
        return {"metrics": [m.name for m in self._metrics], "top_k": self.top_k}

    def select(self, cands: Sequence[Candidate], req: RequestInfo, count: int) -> list[Candidate]:
        return self.pick([c for *_, c in smallest(self.keyed(cands), max(self.top_k, count))], count)

    def keyed(self, cands: Sequence[Candidate]) -> list[tuple[Any, int, Candidate]]:
        """(sort key, position, candidate) of each: the ranking's order, the position breaking ties so that
        candidates themselves are never compared."""
        # keys built inline (no per-item key function or generator): this runs for every candidate per decision
        signed = self._signed
        if len(signed) == 1:
            name, sign = signed[0]
            return [(c.values[name] * sign, pos, c) for pos, c in enumerate(cands)]
        if len(signed) == 2:  # the default's (predicted TTFT, predicted TPOT)
            (first, first_sign), (second, second_sign) = signed
            return [
                ((c.values[first] * first_sign, c.values[second] * second_sign), pos, c) for pos, c in enumerate(cands)
            ]
        return [(tuple([c.values[n] * s for n, s in signed]), pos, c) for pos, c in enumerate(cands)]

    def pick(self, ranked: list[T], count: int) -> list[T]:
        """From the head of the ranking (best first, at least top_k long when there are that
        many): the random pick among the top K first, then the rest in order."""
        if self.top_k > 1:
            pick = self._rng.randrange(min(self.top_k, len(ranked)))
            ranked.insert(0, ranked.pop(pick))
        return ranked[:count]


# up to this many keys a full sort (in C) is cheaper than heapq.nsmallest's heap (in Python); a load index
# hands a selector a few candidates, a scan every instance
_SORT_UP_TO = 64


def smallest(keyed: list[T], k: int) -> list[T]:
    """The `k` least of `keyed`: heapq.nsmallest's answer (equal to sorted(keyed)[:k]), by a sort when short."""
    if len(keyed) <= _SORT_UP_TO:
        keyed.sort()
        return keyed[:k]
    return heapq.nsmallest(k, keyed)
