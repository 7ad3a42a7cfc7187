"""Cache-locality metrics (cache-aware scheduling): how much of the prompt is already cached where.

Hit lengths come from the prefix index (view/prefix_index.py) through the policy context,
matched once per decision. They depend on the request, so they are computed per decision.
"""

from __future__ import annotations

from pilotfish.scheduler.policy.base import ExportedFamily, Metric, MissValue
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.metrics.load import AllPrefillsTokensNum
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class KvCacheHitLen(Metric):
    """Prompt tokens of this request whose KV the instance already holds (longest cached prefix)."""

    name = "kv_cache_hit_len"
    lrs_in_full_mode = False
    exported = ExportedFamily("pilotfish_scheduler_policy_kv_cache_hit_tokens", 1.0, "Prefix-cache hit of the request")
    lower_is_better = False
    indexable = False
    cache_locality = True
    uses_prefix_cache = True
    # the prefix index is fed by dispatch decisions too, so lite mode has it
    lite = True

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        # the endpoint's id, not the view's property: one call less for every candidate of every decision
        hit = self.ctx.prefix_hits(req).get(inst.endpoint.instance_id, 0)
        return min(hit, req.prompt_tokens) if req.prompt_tokens else hit

    def miss_value(self) -> MissValue:
        """0 on every instance without a hit."""
        return MissValue(None, _nothing)


class CacheAwareAllPrefillsTokensNum(Metric):
    """all_prefills_tokens_num + this request's cache-miss tokens (prompt - kv_cache_hit_len):
    the prefill work the instance would have, this request included."""

    name = "cache_aware_all_prefills_tokens_num"
    lrs_in_full_mode = False
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_cache_aware_prefill_tokens", 1.0, "Prompt tokens left to prefill, less prefix hits"
    )
    indexable = False
    cache_locality = True
    uses_prefix_cache = True

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._prefills = AllPrefillsTokensNum(self.ctx)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        hit = self.ctx.prefix_hits(req).get(inst.endpoint.instance_id, 0)
        return self._prefills.value(inst, req) + max(0, req.prompt_tokens - hit)

    def miss_value(self) -> MissValue:
        """all_prefills_tokens_num plus the whole prompt on every instance without a hit."""
        return MissValue(self._prefills, _whole_prompt)


def _nothing(req: RequestInfo) -> float:
    return 0.0


def _whole_prompt(req: RequestInfo) -> float:
    return float(req.prompt_tokens)
