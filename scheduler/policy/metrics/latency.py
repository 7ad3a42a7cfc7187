"""Predicted latencies (SLO policy), from the profiling tables (view/profile.py).

Both read the instance's load the way the load metrics do (status + in-flight, forward-
predicted when predictor-enhanced), and the request's own size, so they are per request.
"""

from __future__ import annotations

from pilotfish.scheduler.policy.base import Metric
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.metrics.load import AllDecodesTokensNum, AllPrefillsTokensNum, DecodeBatchSize
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class PredictedTtft(Metric):
    """TTFT in ms: the TTFT table at (prefill tokens ahead + this request's uncached tokens),
    plus the decode batch's share of every chunked-prefill step (TPOT table)."""

    name = "predicted_ttft"
    balance_band = (50.0, 1.1)
    indexable = False

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._prefills = AllPrefillsTokensNum(self.ctx)
        self._batch = DecodeBatchSize(self.ctx)
        self._decode_tokens = AllDecodesTokensNum(self.ctx)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        own = max(0, req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.instance_id, 0))
        return self.ctx.tables.ttft_ms(
            self._prefills.value(inst, req),
            own,
            self._batch.value(inst, req),
            self._decode_tokens.value(inst, req),
        )


class PredictedTpot(Metric):
    """TPOT in ms the request would see: the TPOT table at (decode batch + 1, mean sequence length
    with this request's prompt joining the batch)."""

    name = "predicted_tpot"
    balance_band = (2.0, 1.1)
    indexable = False

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._batch = DecodeBatchSize(self.ctx)
        self._decode_tokens = AllDecodesTokensNum(self.ctx)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        batch = self._batch.value(inst, req) + 1
        seq = self._decode_tokens.value(inst, req) + req.prompt_tokens
        return self.ctx.tables.tpot_ms(batch, seq / batch)
