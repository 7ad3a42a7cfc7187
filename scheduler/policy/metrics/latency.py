"""Predicted latencies (the default `predicted-latency` policy and `slo`), from the profiling
tables (view/profile.py).

Both read the instance's load from whatever view the mode has, and the request's own size, so
they are per request:

- full mode: the load metrics' view (CMS status + in-flight account, forward-predicted when
  predictor-enhanced);
- lite mode: the scheduler's own LRS: prompt tokens of held requests not yet past their prefill
  are the prefill ahead, held requests past it are the decode batch, and their prompt and
  generated tokens its sequence lengths.

The cached prefix (prefix index) comes off the request's own prompt in both modes.
"""

from __future__ import annotations

from pilotfish.scheduler.policy.base import Metric
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.metrics.load import AllDecodesTokensNum, AllPrefillsTokensNum, DecodeBatchSize
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class _Load:
    """(prefill tokens ahead, decode batch, sum of the batch's sequence lengths) of an instance,
    from the mode's view."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.full = ctx.full_mode
        self._prefills = AllPrefillsTokensNum(ctx)
        self._batch = DecodeBatchSize(ctx)
        self._decode_tokens = AllDecodesTokensNum(ctx)

    def __call__(self, inst: InstanceView, req: RequestInfo) -> tuple[float, float, float]:
        if self.full:
            return (self._prefills.value(inst, req), self._batch.value(inst, req), self._decode_tokens.value(inst, req))
        lrs = inst.lrs
        return lrs.prefill_tokens, lrs.num_decode_requests, lrs.num_tokens - lrs.prefill_tokens


class PredictedTtft(Metric):
    """TTFT in ms: the TTFT table at (prefill tokens ahead + this request's uncached tokens),
    plus the decode batch's share of every chunked-prefill step (TPOT table)."""

    name = "predicted_ttft"
    balance_band = (50.0, 1.1)
    indexable = False
    lite = True  # from the LRS in lite mode
    uses_prefix_cache = True  # the prompt's cached prefix is not prefilled again

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._load = _Load(self.ctx)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        own = max(0, req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.instance_id, 0))
        ahead, batch, seq_sum = self._load(inst, req)
        return self.ctx.tables.ttft_ms(ahead, own, batch, seq_sum)


class PredictedTpot(Metric):
    """TPOT in ms the request would see: the TPOT table at (decode batch + 1, mean sequence length
    with this request's prompt joining the batch)."""

    name = "predicted_tpot"
    balance_band = (2.0, 1.1)
    indexable = False
    lite = True  # from the LRS in lite mode

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._load = _Load(self.ctx)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        _, batch, seq_sum = self._load(inst, req)
        batch += 1
        return self.ctx.tables.tpot_ms(batch, (seq_sum + req.prompt_tokens) / batch)
