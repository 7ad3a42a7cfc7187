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
        # keys built inline (no per-item key function): this runs for every candidate per decision
        if len(self._signed) == 1:
            name, sign = self._signed[0]
            keyed = [(c.values[name] * sign, pos, c) for pos, c in enumerate(cands)]
        else:
            signed = self._signed
            keyed = [(tuple(c.values[n] * s for n, s in signed), pos, c) for pos, c in enumerate(cands)]
        # only the head of the ranking is needed: O(n log k), not a full sort; the position
        # breaks ties, so candidates themselves are never compared
        return self.pick([c for *_, c in heapq.nsmallest(max(self.top_k, count), keyed)], count)

    def pick(self, ranked: list[T], count: int) -> list[T]:
        """From the head of the ranking (best first, at least top_k long when there are that
        many): the random pick among the top K first, then the rest in order."""
        if self.top_k > 1:
            pick = self._rng.randrange(min(self.top_k, len(ranked)))
            ranked.insert(0, ranked.pop(pick))
        return ranked[:count]
