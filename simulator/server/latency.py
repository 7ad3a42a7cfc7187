"""vLLM's latency histograms for /metrics: time to first token and inter-token latency.

Observed on the engine's own clock (the same `now` its steps carry): TTFT from the moment the
request was added, inter-token latency between consecutive tokens of a request. Buckets are
vLLM 0.32's (`vllm/v1/metrics/buckets.py`).
"""

from __future__ import annotations

import bisect

from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
# fmt: on


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class LatencyHistograms(EngineObserver):
    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self._added: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def request_added(self, request: SimRequest, now: float) -> None:
        self._added[request.request_id] = now

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        # once per token per engine: Histogram.observe inlined for the inter-token case
        rid = request.request_id
        last = self._last.get(rid)
        self._last[rid] = now
        if last is None:
            self.ttft.observe(now - self._added.get(rid, now))
            return
        itl, value = self.itl, now - last
        itl.counts[bisect.bisect_left(itl.bounds, value)] += 1
        itl.sum += value
        itl.count += 1

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        self._added.pop(request.request_id, None)
        self._last.pop(request.request_id, None)

    def detached(self, request: SimRequest, now: float) -> None:
        # migrated away: the destination times the rest; nothing may linger here
        self.finished(request, FinishReason.ABORT, now)
