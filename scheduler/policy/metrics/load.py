"""Full-mode load metrics from the CMS status plus the in-flight account (spec: Ial accurate metrics).

Prefill load is uncomputed prompt tokens (the engine reports them with cached prefixes and
computed chunks excluded; the account adds the uncached part of each in-flight prompt);
decode load is the decode batch and the sum of its sequence lengths. An instance without a
status yet counts as empty plus its in-flight load (schedulability blocks it anyway).
"""

from __future__ import annotations

from pilotfish.scheduler.policy.base import Drain, ExportedFamily, Metric
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.view.predictor import prefill_rate, prefill_tokens_done
from pilotfish.scheduler.view.types import EngineStatus, InstanceView, RequestInfo

EMPTY = EngineStatus()


class KvCacheUsageRatioProjected(Metric):
    """(used KV tokens + tokens still to allocate for waiting/running requests
    + tokens of in-flight decode requests) / total KV tokens."""

    name = "kv_cache_usage_ratio_projected"
    lrs_in_full_mode = False
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_kv_cache_usage_ratio", 1.0, "KV cache use, projected with in-flight requests (0..1)"
    )
    balance_band = (0.05, 1.1)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        s = inst.status or EMPTY
        projected = s.used_kv_tokens + s.unallocated_tokens + inst.inflight.decode_tokens
        if s.total_kv_tokens:
            return projected / s.total_kv_tokens
        return 1.0 if projected else 0.0  # capacity unknown: anything on it counts as full


class DecodeBatchSize(Metric):
    """Requests that will decode in the next steps: waiting (past prefill), loading, running and in-flight."""

    name = "decode_batch_size"
    lrs_in_full_mode = False
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_decode_batch_requests", 1.0, "Requests in the next decode step"
    )
    balance_band = (4.0, 1.2)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        s = inst.status or EMPTY
        return s.num_waiting_decode + s.num_loading + s.num_running_decode + inst.inflight.decode_requests


class NumWaitingRequests(Metric):
    """Queue pressure: waiting requests plus in-flight dispatches."""

    name = "num_waiting_requests"
    lrs_in_full_mode = False
    exported = ExportedFamily("pilotfish_scheduler_policy_waiting_requests", 1.0, "Requests waiting")
    balance_band = (2.0, 1.2)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        s = inst.status or EMPTY
        return s.num_waiting + inst.inflight.requests


class AllPrefillsTokensNum(Metric):
    """Prefill tokens to compute: uncomputed tokens of waiting and running prefills + in-flight prefill tokens,
    minus (predictor-enhanced) the tokens forward-predicted as computed since the status."""

    name = "all_prefills_tokens_num"
    lrs_in_full_mode = False
    exported = ExportedFamily("pilotfish_scheduler_policy_prefill_tokens", 1.0, "Prompt tokens left to prefill")
    # about one shared system prompt of prefill; no relative slack: a hit saves a fixed number of tokens
    balance_band = (512.0, 1.0)

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        # a prediction moves with the clock: a plain sorted index cannot keep it, the load index's
        # drain ordering can (it reads `drain` below)
        self.indexable = not self.ctx.predictor_enhanced
        self.forward_predicted = self.ctx.predictor_enhanced

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        s = inst.status
        if s is None:
            return inst.inflight.prefill_tokens
        tokens = s.uncomputed_prefill_tokens + inst.inflight.prefill_tokens
        if self.ctx.predictor_enhanced and s.uncomputed_prefill_tokens and inst.step_model is not None:
            tokens -= prefill_tokens_done(
                inst.step_model,
                s.uncomputed_prefill_tokens,
                s.num_running_decode,
                s.running_decode_seq_len_sum,
                inst.max_num_batched_tokens or self.ctx.default_token_budget,
                self.ctx.elapsed_since(s.timestamp_ms),
            )
        return tokens

    def drain(self, inst: InstanceView) -> Drain | None:
        """Predictor-enhanced: how `value` moves with the clock, as (value at the status's time, floor,
        tokens per second, status time in s): it falls from the first at that rate, never below the
        floor (the in-flight tokens). None when it does not move: then `value` is constant until the
        instance changes (no status, nothing to prefill, no step-time fit, or no prediction)."""
        s = inst.status
        if not self.ctx.predictor_enhanced or s is None or not s.uncomputed_prefill_tokens or inst.step_model is None:
            return None
        rate = prefill_rate(
            inst.step_model,
            s.uncomputed_prefill_tokens,
            s.num_running_decode,
            s.running_decode_seq_len_sum,
            inst.max_num_batched_tokens or self.ctx.default_token_budget,
        )
        floor = float(inst.inflight.prefill_tokens)
        return floor + s.uncomputed_prefill_tokens, floor, rate, s.timestamp_ms / 1000.0


class AllDecodesTokensNum(Metric):
    """Decode token load: sum of sequence lengths of the running decode batch + tokens of in-flight decode requests."""

    name = "all_decodes_tokens_num"
    lrs_in_full_mode = False
    exported = ExportedFamily("pilotfish_scheduler_policy_decode_tokens", 1.0, "Tokens of decoding sequences")
    balance_band = (4096.0, 1.2)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        s = inst.status or EMPTY
        return s.running_decode_seq_len_sum + inst.inflight.decode_tokens
