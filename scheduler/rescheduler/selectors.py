"""Pair selectors: from candidate sources and destinations to (source, destination) pairs.

Llumnix's metricBalanceSelector and roundRobinSelector, over pairs rather than a ranking, so
they are apart from the scheduler's selectors (scheduler/policy/selectors).
"""

from __future__ import annotations

from collections.abc import Sequence

from pilotfish.scheduler.view.types import InstanceView

Loaded = tuple[InstanceView, float]


def metric_balance(
    sources: Sequence[Loaded], destinations: Sequence[Loaded], min_difference: float
) -> list[tuple[InstanceView, InstanceView]]:
    """Highest-load source with lowest-load destination, then the next of each, while the two differ by
    at least `min_difference`; ties go by instance id so a plan is reproducible."""
    by_load_desc = sorted(sources, key=lambda s: (-s[1], s[0].instance_id))
    by_load_asc = sorted(destinations, key=lambda d: (d[1], d[0].instance_id))
    pairs = []
    for (src, src_load), (dst, dst_load) in zip(by_load_desc, by_load_asc, strict=False):
        if src_load - dst_load < min_difference:
            break  # every later pair is closer still
        pairs.append((src, dst))
    return pairs


class RoundRobin:
    """Each source gets the next destination in turn; the turn carries over between cycles, so the
    requests of a failed instance spread over the healthy ones cycle after cycle."""

    def __init__(self) -> None:
        self._next = 0

    def assign(
        self, sources: Sequence[InstanceView], destinations: Sequence[InstanceView]
    ) -> list[tuple[InstanceView, InstanceView]]:
        if not destinations:
            return []
        pairs = []
        for src in sources:
            pairs.append((src, destinations[self._next % len(destinations)]))
            self._next = (self._next + 1) % len(destinations)
        return pairs
