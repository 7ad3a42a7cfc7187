"""Round-robin: each decision starts one further along the candidates; a load-blind baseline."""

from __future__ import annotations

from collections.abc import Sequence

from pilotfish.scheduler.policy.base import Candidate, Selector
from pilotfish.scheduler.view.types import RequestInfo


class RoundRobinSelector(Selector):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, cands: Sequence[Candidate], req: RequestInfo, count: int) -> list[Candidate]:
        start = self._next % len(cands)
        self._next = start + 1
        rotated = [*cands[start:], *cands[:start]]
        return rotated[:count]
