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

Every predicted latency of an engine is its `speed_scale` times the profile's (view/speed.py): 1 exactly
unless the engine was found to run slower than the fleet. The scale is the last item of each state, and
multiplies the value and its floor alike; since it is at least 1 and the request's part of a floor
(`bound_offset`) is not negative where it is used, floor x scale + offset stays under the value.
"""

from __future__ import annotations

import bisect
import math

from pilotfish.scheduler.policy.base import ExportedFamily, Metric
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.metrics.load import AllDecodesTokensNum, AllPrefillsTokensNum, DecodeBatchSize
from pilotfish.scheduler.view.speed import MAX_SPEED_SCALE
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class _Load:
    """(prefill tokens ahead, decode batch, sum of the batch's sequence lengths) of an instance,
    from the mode's view."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.full = ctx.full_mode
        self._predicted = ctx.predictor_enhanced
        self._prefills = AllPrefillsTokensNum(ctx)
        self._batch = DecodeBatchSize(ctx)
        self._decode_tokens = AllDecodesTokensNum(ctx)

    def __call__(self, inst: InstanceView, req: RequestInfo) -> tuple[float, float, float]:
        if self.full:
            if self._predicted:
                return (
                    self._prefills.value(inst, req),
                    self._batch.value(inst, req),
                    self._decode_tokens.value(inst, req),
                )
            # the three metrics' formulas without a prediction, read in one go: a scan does this per instance
            # and a decision, an index per change (tests/unit/test_scheduler_predicted_index.py holds them equal)
            s, inflight = inst.status, inst.inflight
            if s is None:
                return inflight.prefill_tokens, inflight.decode_requests, inflight.decode_tokens
            return (
                s.uncomputed_prefill_tokens + inflight.prefill_tokens,
                s.num_waiting_decode + s.num_loading + s.num_running_decode + inflight.decode_requests,
                s.running_decode_seq_len_sum + inflight.decode_tokens,
            )
        lrs = inst.lrs
        return lrs.prefill_tokens, lrs.num_decode_requests, lrs.num_tokens - lrs.prefill_tokens


class PredictedTtft(Metric):
    """TTFT in ms: the TTFT table at (prefill tokens ahead + this request's uncached tokens),
    plus the decode batch's share of every chunked-prefill step (TPOT table).

    The instance's part, (tokens ahead, decode batch, the batch's share of a step), is its `state`; and
    since prefill time rises at least by the profile's least slope per token ahead (view/profile.py,
    `prefill_floor`), and the batch's share comes once per step (at least one, and at least one per
    step's worth of tokens ahead), the value is at least
    prefill_floor(own tokens) + slope * ahead + share * max(1, ceil(ahead / step tokens)): a load index
    walks the instances by the request-free part and stops where that floor passes what can rank.

    A request's own part is at least one token, however much of its prompt the instance holds: an engine
    computes at least the prompt's last token (vLLM caps a prefix hit below the prompt's length), in a step
    with its decode batch. Counted as none, an exact repeat saw the instance holding its prompt at 0 ms
    whatever that instance's batch, and a burst of repeats all went there, past its max_num_seqs, to wait
    seconds for a slot (64 engines, 8 prompts repeated: 335 of 1,024 requests on one engine)."""

    name = "predicted_ttft"
    lrs_in_full_mode = False
    # ms in the policy, seconds exported
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_predicted_ttft_seconds", 1e-3, "Predicted time to first token"
    )
    balance_band = (50.0, 1.1)
    indexable = False
    lite = True  # from the LRS in lite mode
    uses_prefix_cache = True  # the prompt's cached prefix is not prefilled again
    has_floor = True

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._load = _Load(self.ctx)
        # a forward-predicted prefill ahead moves with the clock: no state to keep between changes
        self.instance_state = not (self.ctx.full_mode and self.ctx.predictor_enhanced)

    def state(self, inst: InstanceView) -> tuple[float, float, float, float]:
        ahead, batch, seq_sum = self._load(inst, _NO_REQUEST)
        return ahead, batch, self.ctx.tables.decode_share_ms(batch, seq_sum), inst.speed_scale

    def evaluate(self, state: tuple[float, float, float, float], inst: InstanceView, req: RequestInfo) -> float:
        ahead, batch, share, scale = state
        # the endpoint's id, not the view's property: one call less for every candidate of every decision
        own = req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.endpoint.instance_id, 0)
        # max(1, own) without the call (a load index evaluates this for every member it visits)
        return self.ctx.tables.ttft_with_share(ahead + own if own > 1 else ahead + 1, batch, share) * scale

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return self.evaluate(self.state(inst), inst, req)

    def lower_bound(self, state: tuple[float, ...]) -> float:
        return self._ttft_floor(state[0], state[1], state[2]) * state[-1]

    def _ttft_floor(self, ahead: float, batch: float, share: float) -> float:
        """The floor at the profile's speed (the scale is the caller's to apply)."""
        if not ahead >= 0:  # (NaN too) the floor assumes a queue of zero or more tokens
            return -math.inf
        tables = self.ctx.tables
        if batch <= 0:
            return tables.prefill_slope * ahead
        # max(1, ceil(ahead / max(1.0, budget - batch))) without the calls to max: a load index computes this
        # at every change of an instance
        room = tables.token_budget - batch
        steps = math.ceil(ahead / (room if room > 1.0 else 1.0))
        return tables.prefill_slope * ahead + (steps if steps > 1 else 1) * share

    def bound_offset(self, req: RequestInfo, hit: int) -> float:
        own = req.prompt_tokens - hit
        if own < 1:  # at least one token (PredictedTtft)
            own = 1
        offset = self.ctx.tables.prefill_floor(own)
        # a floor below 0 (a profile table's line extended down to few tokens) is scaled down by the slowest
        # engine's scale at most: the bound holds for every scale up to MAX_SPEED_SCALE
        return offset if offset >= 0 else offset * MAX_SPEED_SCALE


class PredictedDelay(PredictedTtft):
    """Latency in ms this dispatch adds, summed over the requests it touches: the request's predicted TTFT
    (`predicted_ttft`) plus decode batch x the prefill time of its uncached tokens, since every
    chunked-prefill step of its prompt lengthens a step of each request decoding there by that step's
    prefill part.

    Why TTFT alone is not enough: the request's own TTFT does not see what its prefill costs the batch it
    joins. A long prompt sent to an instance whose queue is empty but whose batch
    decodes short outputs stalls every one of them for the whole prefill (a 7k-token prompt, ~0.8 s on the
    default profile, is 90 ms on each of a 10-token answer's nine tokens), where an instance a short
    prefill away, or with a smaller batch, would have cost a few ms of TTFT. On a code-completion trace
    (long prompts, ~10-token answers) nearly every SLO miss of a TTFT-first ranking was such a stall.

    Its floor is `predicted_ttft`'s plus batch x the least prefill time of one token: with own >= 1
    (`bound_offset` is -inf otherwise) the prefill curve rising by at least its least slope per token
    (`prefill_floor`) puts prefill_ms(own) at or above prefill_floor(1) when that slope is not negative.
    The batch's part belongs to the instance, so a load index keys it and passes over large batches
    without evaluating them; the prefill time multiplying it belongs to the request, so the index also keeps
    the members by the floor at a few prompt sizes (`floor_levels`, doubling) and walks a request by the
    largest at or under its prompt: its floor is then within about 2x of the stall, not the one-token
    prefill time's hundreds of times below it.

    Not the default (it is there to compose in YAML; lite mode's default is `predicted_stall`, below): every
    stalled request counts at its full stall, whatever its output length, so at high load it queues prompts
    behind long prefills on the few instances without a batch. On the system-prompt family (32-256-token
    answers, over which a stall spreads to little TPOT) that cost up to 17% of goodput at 1.2x the knee, and
    with every instance decoding a walk of 4096 members visits hundreds."""

    floor_levels = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

    name = "predicted_delay"
    # ms in the policy, seconds exported
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_predicted_delay_seconds",
        1e-3,
        "Predicted latency a dispatch adds: own time to first token plus the stall of the decode batch",
    )

    def evaluate(self, state: tuple[float, float, float, float], inst: InstanceView, req: RequestInfo) -> float:
        ahead, batch, share, scale = state
        own = req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.endpoint.instance_id, 0)
        if own < 1:  # at least one token (PredictedTtft)
            own = 1
        tables = self.ctx.tables
        ttft = tables.ttft_with_share(ahead + own, batch, share)
        return (ttft + batch * tables.prefill_ms(own) if batch > 0 else ttft) * scale

    def lower_bound(self, state: tuple[float, ...]) -> float:
        return self.lower_bound_at(state, 1)

    def lower_bound_at(self, state: tuple[float, ...], own_at_least: int) -> float:
        return self._floor_past(state, own_at_least, 0.0)

    def lower_bounds_at(self, state: tuple[float, ...]) -> list[float]:
        return self._floors_past(state, 0.0)

    def _floors_past(self, state: tuple[float, ...], absorbed: float, share: float = 0.0) -> list[float]:
        """`_floor_past` at every level, the TTFT floor and the levels' least prefill times computed once:
        the same floats as level by level (tests/unit/test_scheduler_predicted_index.py holds them equal)."""
        batch, scale = state[1], state[-1]
        floor = self._ttft_floor(state[0], batch, state[2])
        if not batch > 0:
            return [floor * scale] * len(self.floor_levels)
        leasts = self._level_leasts or self._make_level_leasts()
        return [(floor + batch * charged if (charged := _charged(least, absorbed, share)) > 0 else floor) * scale
                for least in leasts]

    # the least prefill time at each of `floor_levels` (the tables are the profile's, fixed): made at first use
    _level_leasts: list[float] | None = None

    def _make_level_leasts(self) -> list[float]:
        tables = self.ctx.tables
        self._level_leasts = [
            tables.prefill_floor(level) if tables.prefill_slope >= 0 else 0.0 for level in self.floor_levels
        ]
        return self._level_leasts

    def _floor_past(self, state: tuple[float, ...], own_at_least: int, absorbed: float, share: float = 0.0) -> float:
        """`predicted_ttft`'s floor plus batch x the least prefill time of `own_at_least` tokens or more past
        `absorbed` ms, and at least `share` of it (none absorbed here; `predicted_stall`'s instance state
        says how much, and its `least_stall_share` the share); times the engine's scale."""
        batch, scale = state[1], state[-1]
        floor = self._ttft_floor(state[0], batch, state[2])
        if not batch > 0:
            return floor * scale
        tables = self.ctx.tables
        # the least prefill time of an own prompt of `own_at_least` tokens or more (0 where the curve may fall)
        least = tables.prefill_floor(own_at_least) if tables.prefill_slope >= 0 else 0.0
        charged = _charged(least, absorbed, share)
        return (floor + batch * charged if charged > 0 else floor) * scale


def _charged(stall: float, absorbed: float, share: float) -> float:
    """What one decoding request is charged for a stall of `stall` ms: the part past `absorbed`, and at least
    `share` of it. Rising with the stall, so the least stall gives a floor."""
    over = stall - absorbed
    least = share * stall
    return over if over > least else least


class PredictedStall(PredictedDelay):
    """`predicted_delay` with the stall charged past what the batch absorbs: predicted TTFT plus decode
    batch x max(prefill time of the uncached tokens - absorbed, `least_stall_share` x that time), where
    absorbed is
    `absorbed_ms_per_token` x (1 + the mean output tokens of the requests released from this instance
    recently (a window of about a thousand answers): LrsLoad.released_generated_tokens / num_released; in lite
    mode as the gateway told them with the
    releases, in full mode as the engine's status records count its finished requests). An instance nothing was released
    from yet goes by the fleet's mean output instead (at a power of two, LrsLoad.fleet_output_level, which the
    LRS keeps and notifies), and only the least share is charged while nothing was released anywhere (no
    evidence the answers are short).

    Why: a prefill stalls every request decoding there once, and what that costs a request's TPOT is the
    stall spread over its output. A 7k-token prompt (~0.8 s on the default profile) puts ~90 ms on each of a
    10-token answer's tokens, past a 100 ms TPOT target, but ~6 ms on a 144-token one. `predicted_delay`
    charges the whole stall for every victim whatever its output, which on families with 32-256-token
    answers queues prompts behind prefills elsewhere for nothing (TTFT misses). Here a stall the victims'
    typical answer spreads below `absorbed_ms_per_token` per token costs only its least share, so the
    ranking is close to `predicted_ttft`'s wherever answers are long, and `predicted_delay`-like where they
    are short. The least share stays because stalls add up over a short answer, and TTFT alone leans to
    the larger batches (`least_stall_share`). The instance's own history stands for the victims' unknown
    remaining output. The fleet's level matters: with cold instances charged nothing they draw the long
    prompts the metric should keep off batches (Azure code trace, 64 engines, load 1: 71 req/s without it,
    79 with it).

    The absorbed part belongs to the instance (its `state`, re-made at every release there), so the floor is
    `predicted_delay`'s with batch x the same charge of prefill_floor(level), at the same prompt-size levels
    (the charge rises with the stall, so the least stall gives the least charge)."""

    name = "predicted_stall"
    # in full mode the answers per instance come from the engines' statuses (LrsLoad's counts, fed by CmsView),
    # whose own change re-keys the instance: nothing the gateway reports moves this metric there
    lrs_in_full_mode = False
    # ms in the policy, seconds exported
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_predicted_stall_seconds",
        1e-3,
        "Predicted latency a dispatch adds: own time to first token plus the decode batch's stall past what "
        "its answers absorb",
    )
    # per answer token, in both modes: each sees an answer's whole length (full mode: the engines' counts; lite:
    # the gateway's count or its estimate at the release). 25 charges too little: Azure code trace below
    # round-robin at 64 engines x 1 and 1.2 of the knee (full mode, seeds 2-5: 0.988, 0.981; lite, seeds 0-1:
    # 2 of 64 cells below round-robin and 11 below the best router-local peer, 0 and 10 at 15; lite took 25
    # while its gateway's counts trailed the answers). 10 charges too much: rag, 64 x 1.2,
    # 0.981 x round-robin in full mode (long prompts held back from batches whose 144-token answers absorb
    # them), and 8 costs lite 3% there. 15 is within 0.4% of round-robin or above it in every one of those
    # cells, and on two short-answer families no value was chosen on (bench/RESULTS.md, 2026-11-28)
    absorbed_ms_per_token = 15.0
    # the share of each stall charged however much the answers absorb. Answers absorb a stall's cost to their
    # TPOT one stall at a time, but a short answer meets several, and a least-TTFT ranking meets them most:
    # the engine whose prefill queue just emptied holds the batch it just prefilled. On system-prompt (16
    # engines, the knee: 32-256-token answers, each stall far below what they absorb) the chosen engine's
    # batch was 1.5% over the fleet's and the victims' stall 1.6% over round-robin's, and every TTFT-first
    # ranking lost ~1.5% to round-robin. A fifth (of the least prefill time at the prompt's level, which the
    # load index keys exactly), full mode, seeds 0-5: that cell 104.0 -> 105.3 req/s (round-robin 105.7),
    # Azure code 64 x 1.2 89.6 -> 90.4 (89.6); 0.3 cost 2% on bursty at 64 engines, and 0.5 of the exact
    # prefill time 6% on system-prompt at 1.2 x the knee (bench/RESULTS.md, 2026-11-28)
    least_stall_share = 0.2
    # the mean output assumed while nothing was released anywhere (the fleet's level, LrsLoad.fleet_output_level,
    # stands in for an instance's own history until then). inf: no stall charged; 0 (as 1-token answers)
    # loses 24% on system-prompt at 1.2x the knee, whose bench cells are decided before any release
    cold_output_tokens = math.inf

    def state(self, inst: InstanceView) -> tuple[float, float, float, float, float]:  # type: ignore[override]
        ahead, batch, seq_sum = self._load(inst, _NO_REQUEST)
        lrs = inst.lrs
        released = lrs.num_released
        per_token = self.absorbed_ms_per_token
        if released > 0:
            absorbed = per_token * (1.0 + lrs.released_generated_tokens / released)
        elif lrs.fleet_output_level >= 0:
            absorbed = per_token * (1.0 + lrs.fleet_output_level)
        else:
            absorbed = per_token * (1.0 + self.cold_output_tokens)
        return ahead, batch, self.ctx.tables.decode_share_ms(batch, seq_sum), absorbed, inst.speed_scale

    def evaluate(  # type: ignore[override]
        self, state: tuple[float, float, float, float, float], inst: InstanceView, req: RequestInfo
    ) -> float:
        ahead, batch, share, absorbed, scale = state
        own = req.prompt_tokens - self.ctx.prefix_hits(req).get(inst.endpoint.instance_id, 0)
        if own < 1:  # at least one token (PredictedTtft)
            own = 1
        tables = self.ctx.tables
        ttft = tables.ttft_with_share(ahead + own, batch, share)
        if batch > 0:
            over = tables.prefill_ms(own) - absorbed
            # the least share of the stall at the prompt level under `own` (`floor_levels`), not at `own`: a
            # load index keys the members by exactly that, so it passes over large batches at once
            least = self.least_stall_share * self._least_at(own)
            charged = over if over > least else least
            if charged > 0:
                return (ttft + batch * charged) * scale
        return ttft * scale

    def _least_at(self, own: int) -> float:
        """The least prefill time at the largest of `floor_levels` at or under `own` (of one token under the
        first): the floors' own figure, so a floor at a level is this metric's value wherever the least share
        is what it charges."""
        leasts = self._level_leasts or self._make_level_leasts()
        at = bisect.bisect_right(self.floor_levels, own) - 1
        if at >= 0:
            return leasts[at]
        tables = self.ctx.tables
        return tables.prefill_floor(1) if own >= 1 and tables.prefill_slope >= 0 else 0.0

    def lower_bound_at(self, state: tuple[float, ...], own_at_least: int) -> float:
        return self._floor_past(state, own_at_least, state[3], self.least_stall_share)

    def lower_bounds_at(self, state: tuple[float, ...]) -> list[float]:
        return self._floors_past(state, state[3], self.least_stall_share)


class PredictedTpot(Metric):
    """TPOT in ms the request would see: the TPOT table at (decode batch + 1, mean sequence length
    with this request's prompt joining the batch). Its `state` is (decode batch, sum of the batch's
    sequence lengths)."""

    name = "predicted_tpot"
    lrs_in_full_mode = False
    # ms in the policy, seconds exported
    exported = ExportedFamily(
        "pilotfish_scheduler_policy_predicted_tpot_seconds", 1e-3, "Predicted time per output token"
    )
    balance_band = (2.0, 1.1)
    indexable = False
    lite = True  # from the LRS in lite mode

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._load = _Load(self.ctx)
        self.instance_state = not (self.ctx.full_mode and self.ctx.predictor_enhanced)

    def state(self, inst: InstanceView) -> tuple[float, float, float]:
        _, batch, seq_sum = self._load(inst, _NO_REQUEST)
        return batch, seq_sum, inst.speed_scale

    def evaluate(self, state: tuple[float, float, float], inst: InstanceView, req: RequestInfo) -> float:
        batch, seq_sum, scale = state
        batch += 1
        return self.ctx.tables.tpot_ms(batch, (seq_sum + req.prompt_tokens) / batch) * scale

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return self.evaluate(self.state(inst), inst, req)


# the load metrics read no request (the view's load only): the state is made without one
_NO_REQUEST = RequestInfo(request_id="", model="")
