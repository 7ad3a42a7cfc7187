"""When an engine is saturated, judged from the scheduler's own view (no engine is asked).

Lite mode (LRS): the prompt and generated tokens of the requests the scheduler holds on the
engine reach --flow-lite-max-tokens, or their count --flow-lite-max-requests.

Full mode (CMS status plus the in-flight account), any of:
  queued prefill   uncomputed prefill tokens + in-flight prompt tokens >= --flow-max-queued-prefill-tokens
  KV usage         (used + to allocate + in-flight decode tokens) / total >= --flow-max-kv-usage
  batch            running + loading + waiting + in-flight requests >= --flow-max-batch-requests
                   (0: the engine's max_num_seqs, when its metadata gives one)
  step             the engine's next step, predicted by its step-time fit from its queued prefill (at
                   most its token budget), decode batch and context, would take --flow-max-step-ms
The step bound is in the TPOT SLO's unit: a step that carries a prefill is a slow token for every
answer in its batch, which a token bound set for TTFT lets through where answers are long. It bounds
the next step, not the mean a TPOT is, so it also holds back prefill the engines could take where
answers are short: off by default (scheduler/flow/README.md has the trade in figures).
A bound of 0 is not judged. An engine with no status yet, or an unschedulable one, offers no room.

`scale` (below 1) tightens the bounds: a flow over its fair share of the work in flight is judged
against the scaled bounds (controller.py), so engines keep headroom for the others. In full mode the
batch bound is not scaled: engines below the knee run batches past half their max_num_seqs, and a
scaled one held the flow back where nothing was saturated. `over_share` adds one more bound for that
flow (full mode, --flow-over-share-max-step-ms, 150 ms): the next step's, as above. Another flow's
first token waits about two steps (the one in progress and its own prefill's), so this bounds what the
flood adds to it, in the unit the TPOT SLO is in, whatever the family's prompt and answer lengths,
and it is what a big batch costs the others that it judges, not the batch's size.
`reserve_tokens` (full mode, --flow-critical-headroom-ms) judges a standard or sheddable request while
critical ones arrive: the engine is saturated for it while its queued prefill and that many tokens more
(a critical prompt's) are predicted to take the headroom or longer, so the engines keep room to start
a critical request soon (an engine with no prefill queued always has room; the bound is not scaled).
The token bounds leave a queue of the same length on every family, which on long prompts (RAG) is,
with the critical request's own prefill, its whole TTFT SLO; the time bound reads the engine's speed
and what critical prompts leave to compute instead. Critical requests are judged without it.
`prefill_scale` multiplies the queued-prefill bound on top: above 1 for a flow within its share
while another is over it, which may queue prefill beyond the plain bound but never passes the
KV or batch bounds (those protect the engine, not the queue's order).
"""

from __future__ import annotations

from dataclasses import dataclass

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.view.types import InstanceView

# reasons, as the metric's label
TOKENS, REQUESTS, PREFILL, KV, BATCH, NO_STATUS = "tokens", "requests", "prefill", "kv", "batch", "no_status"
STEP = "step"  # a flow over its share: the engine's predicted next step
HEADROOM = "headroom"  # a standard or sheddable request: room kept to start a critical one


# the shipped values: the defaults live in SchedulerConfig, and a judge made without one (a test's) uses them
_SHIPPED = SchedulerConfig()


@dataclass(frozen=True, slots=True)
class Saturation:
    full_mode: bool = _SHIPPED.enable_full_mode_scheduling
    lite_max_tokens: int = _SHIPPED.flow_lite_max_tokens
    lite_max_requests: int = _SHIPPED.flow_lite_max_requests
    max_queued_prefill_tokens: int = _SHIPPED.flow_max_queued_prefill_tokens
    max_kv_usage: float = _SHIPPED.flow_max_kv_usage
    max_batch_requests: int = _SHIPPED.flow_max_batch_requests
    max_step_ms: float = _SHIPPED.flow_max_step_ms
    over_share_max_step_ms: float = _SHIPPED.flow_over_share_max_step_ms
    critical_headroom_ms: float = _SHIPPED.flow_critical_headroom_ms

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Saturation:
        sat = cls(
            full_mode=config.enable_full_mode_scheduling,
            lite_max_tokens=config.flow_lite_max_tokens,
            lite_max_requests=config.flow_lite_max_requests,
            max_queued_prefill_tokens=config.flow_max_queued_prefill_tokens,
            max_kv_usage=config.flow_max_kv_usage,
            max_batch_requests=config.flow_max_batch_requests,
            max_step_ms=config.flow_max_step_ms,
            over_share_max_step_ms=config.flow_over_share_max_step_ms,
            critical_headroom_ms=config.flow_critical_headroom_ms,
        )
        if config.enable_flow_control and not sat.full_mode and not (sat.lite_max_tokens or sat.lite_max_requests):
            raise ConfigError(
                "--enable-flow-control: lite mode judges saturation by --flow-lite-max-tokens or "
                "--flow-lite-max-requests; set one"
            )
        return sat

    @property
    def keeps_critical_headroom(self) -> bool:
        """The critical headroom is judged (full mode, a headroom set): only then is a reserve worth learning."""
        return self.full_mode and self.critical_headroom_ms > 0

    def reason(
        self,
        inst: InstanceView,
        scale: float = 1.0,
        prefill_scale: float = 1.0,
        over_share: bool = False,
        reserve_tokens: float = 0.0,
    ) -> str:
        """Why `inst` is saturated ("" when it has room), every bound times `scale`, the queued-prefill
        bound times `prefill_scale` too; for a flow `over_share`, its next step's bound as well; with
        `reserve_tokens`, the critical headroom."""
        if not self.full_mode:
            lrs = inst.lrs
            if self.lite_max_tokens and lrs.num_tokens >= self.lite_max_tokens * scale:
                return TOKENS
            if self.lite_max_requests and lrs.num_requests >= self.lite_max_requests * scale:
                return REQUESTS
            return ""
        s, inflight = inst.status, inst.inflight
        if s is None or not s.schedulable:
            return NO_STATUS
        queued_bound = self.max_queued_prefill_tokens * scale * prefill_scale
        if queued_bound and s.uncomputed_prefill_tokens + inflight.prefill_tokens >= queued_bound:
            return PREFILL
        if self.max_kv_usage:
            projected = s.used_kv_tokens + s.unallocated_tokens + inflight.decode_tokens
            if s.total_kv_tokens and projected >= self.max_kv_usage * scale * s.total_kv_tokens:
                return KV
        batch = self.max_batch_requests or inst.max_num_seqs
        # not scaled: below the knee the engines' batches run past half their max_num_seqs, so a scaled batch
        # bound held the tenant asking more back though nothing was saturated (multi-turn: 18% of goodput).
        # What a big batch does to another flow's first token, long steps, the over-share step bound judges
        if batch and s.num_running + s.num_loading + s.num_waiting + inflight.requests >= batch:
            return BATCH
        queued = s.uncomputed_prefill_tokens + inflight.prefill_tokens
        # the bound for every flow holds back prefill only: an engine with none queued is never held by it,
        # so a bound under the engine's decode step leaves one prefill at a time, not a fleet that takes none
        step_bound = self.max_step_ms * scale if queued else 0.0
        over_bound = self.over_share_max_step_ms if over_share else 0.0
        if over_bound and (not step_bound or over_bound < step_bound):  # the tighter of the two that are set
            step_bound = over_bound
        model = inst.step_model
        if reserve_tokens and queued and self.critical_headroom_ms and model is not None:
            # the queue and the critical prompt computed together: one step's base cost and decode batch, a
            # little under the steps they take. Like the step bound it holds back only behind queued prefill:
            # a critical prompt longer than the headroom alone must not stop the other bands everywhere
            ahead = model.step_ms(queued + reserve_tokens, s.num_running_decode + inflight.requests,
                                  s.running_decode_seq_len_sum)  # fmt: skip
            if ahead >= self.critical_headroom_ms:
                return HEADROOM
        if step_bound and model is not None:
            budget = inst.max_num_batched_tokens
            if budget and queued > budget:  # one step computes at most its token budget
                queued = budget
            # what is dispatched now joins the decode batch after its prefill: count it there already
            step = model.step_ms(queued, s.num_running_decode + inflight.requests, s.running_decode_seq_len_sum)
            if step >= step_bound:
                return STEP
        return ""
