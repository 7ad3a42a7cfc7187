"""The engine model: vLLM V1's scheduler over a paged KV cache, one step at a time.

Each step, under a token budget (`max_num_batched_tokens`):
  1. running requests first, in order: each gets the tokens it lacks (1 for a decode, a chunk of
     prompt for a prefill). When blocks run out the last running request is preempted (its
     blocks freed, to recompute later) until the current one fits, or it is itself preempted.
  2. then, if nothing was preempted, waiting requests in FCFS order while there are seats
     (`max_num_seqs`), budget and blocks; a prefix-cache hit skips its computed tokens.
A request whose computed tokens reach all its tokens samples one token at the end of the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pilotfish.config import ConfigError
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.base import EngineStats, StepPlan, StepResult, TokenOutput
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.kv_cache import KVCacheManager
from pilotfish.simulator.engine.request import FinishReason, RequestStatus, SimRequest
from pilotfish.simulator.engine.step_time import StepTimeProfile, profile_for
from pilotfish.simulator.tokens import GENERATED_TOKEN_IDS, NUM_GENERATED


class V1Engine:
    def __init__(
        self,
        config: EngineConfig,
        profile: StepTimeProfile | None = None,
        observers: Sequence[EngineObserver] = (),
    ) -> None:
        if config.num_gpu_blocks * config.block_size < config.max_model_len:
            # vLLM refuses to start in this case too: one long request could never be scheduled
            raise ConfigError(
                f"--num-gpu-blocks {config.num_gpu_blocks} x --block-size {config.block_size} holds fewer "
                f"tokens than --max-model-len {config.max_model_len}"
            )
        self.config = config
        self.profile = profile or profile_for(config)
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.observers: list[EngineObserver] = list(observers)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._cache_queries = 0
        self._cache_hits = 0
        self._finished: dict[str, int] = {}
        # serving work on the engine's CPU since the last step began (profile.shared_cpu)
        self._stolen_s = 0.0
        self._frontend_s = self.profile.busy_arrival_seconds

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def enable_kv_events(self) -> None:
        """Record block stored/removed events from now on; `take_kv_events` drains them."""
        if self.kv.pool.events is None:
            self.kv.pool.events = []

    def take_kv_events(self) -> list[tuple]:
        events = self.kv.pool.events
        if not events:
            return []
        self.kv.pool.events = []
        return events

    # ---- requests in and out --------------------------------------------------------------

    def add_request(self, request: SimRequest, now: float) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if not 0 < request.num_prompt_tokens < self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens does not fit max_model_len")
        if self._frontend_s and self.requests:  # busy: the frontend's work on this one took its CPU
            self._stolen_s += self._frontend_s
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        for o in self.observers:
            o.request_added(request, now)

    def abort_request(self, request_id: str, now: float) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT, now)
        return True

    def detach_request(self, request_id: str, now: float) -> SimRequest | None:
        """Take a waiting or running request out to continue on another engine (migration).

        Its blocks are freed (their hashed content stays in the prefix cache until evicted) and
        observers see `detached`, not `finished`: no finish is counted. `num_computed_tokens`
        keeps the KV it had, for a KV transfer to size itself by; None if it is not here.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free(request, now)
        # not RUNNING, so a step in flight that scheduled it produces nothing for it (as for an abort)
        request.status = RequestStatus.MIGRATED
        for o in self.observers:
            o.detached(request, now)
        return request

    def resume_request(self, request: SimRequest, now: float) -> None:
        """Add a request that already has output tokens: migrated in, or back after its migration
        failed. Like a preempted request it recomputes prompt + output (the prefix cache helps, as
        do `num_external_computed_tokens`) and samples its next token after them."""
        if request.length_limit_reached(self.config.max_model_len) is not None:
            # it would recompute and never sample: its client must be told it ended instead
            raise ValueError(f"request {request.request_id!r} has reached its length limit")
        request.num_computed_tokens = 0
        request.finish_reason = None
        self.add_request(request, now)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        plan = self.begin_step(now)
        outputs = self.end_step(plan)
        return StepResult(plan.duration, outputs, plan.num_prefill_tokens, plan.num_decode_requests)

    def begin_step(self, now: float) -> StepPlan:
        # The hot path of every simulation (one call per engine step): counters are read once into
        # locals, the step's totals are summed as requests are scheduled, and a running request
        # whose tokens fit the blocks it holds skips the allocator (see `_fits_held`).
        config = self.config
        budget = config.max_num_batched_tokens
        last = config.max_model_len - 1  # a request computes at most max_model_len - 1 tokens
        scheduled: list[tuple[SimRequest, int]] = []
        decode_flags: list[bool] = []
        prefill_tokens = decodes = context = 0
        preempted = False
        running = self.running
        kv = self.kv
        held_blocks = kv.req_blocks
        registered = kv.num_registered
        block_size = kv.block_size
        caching = kv.enable_prefix_caching

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            num_output = len(request.output_token_ids)
            num_tokens = request.num_prompt_tokens + num_output
            # min(tokens it lacks, budget, room to max_model_len), as integers
            num_new = num_tokens - computed
            if budget < num_new:
                num_new = budget
            if last - computed < num_new:
                num_new = last - computed
            if num_new <= 0:
                i += 1
                continue
            total = computed + num_new
            held = held_blocks.get(request.request_id)
            # what `kv.allocate` does when the tokens fit the blocks held and no block fills up to
            # be registered: nothing, returning no new blocks
            if held is None or total > len(held) * block_size or (
                caching and total // block_size > registered.get(request.request_id, 0)
            ):
                new_blocks = kv.allocate(request, num_new)
                while new_blocks is None:
                    victim = running.pop()  # the latest arrival loses its blocks first (FCFS)
                    self._preempt(victim, now)
                    preempted = True
                    if victim is request:
                        break
                    new_blocks = kv.allocate(request, num_new)
                if new_blocks is None:
                    break
                if new_blocks:
                    self._allocated(request, new_blocks, now)
            scheduled.append((request, num_new))
            # one new token right after a sampled one: a decode, not a (re)compute of known tokens
            if num_new == 1 and num_output > 0 and computed == num_tokens - 1:
                decode_flags.append(True)
                decodes += 1
            else:
                decode_flags.append(False)
                prefill_tokens += num_new
            context += total
            budget -= num_new
            i += 1

        # vLLM admits nothing in a step that had to preempt: memory is short
        waiting = self.waiting
        while not preempted and waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = waiting[0]
            cached = kv.computed_blocks(request)
            hit = len(cached) * block_size
            num_tokens = request.num_tokens
            # KV that arrived by transfer counts as computed, like a hit, but needs fresh blocks
            skip = max(hit, min(request.num_external_computed_tokens, num_tokens - 1))
            num_new = min(num_tokens - skip, budget)
            new_blocks = kv.allocate(request, skip - hit + num_new, cached)
            if new_blocks is None:
                break
            waiting.popleft()
            running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = skip
            request.num_external_computed_tokens = 0  # consumed: a later preemption recomputes
            if request.num_preemptions == 0:
                # vLLM counts prefix-cache queries and hits of new requests only; a preempted
                # request's return goes to separate (unexported) preempted_* counters
                request.num_cached_tokens = hit
                self._cache_queries += num_tokens
                self._cache_hits += hit
            for o in self.observers:
                o.request_scheduled(request, now)
                o.cache_hit(request, hit, now)
            self._allocated(request, new_blocks, now)
            scheduled.append((request, num_new))
            decode = _is_decode(request, num_new)
            decode_flags.append(decode)
            if decode:
                decodes += 1
            else:
                prefill_tokens += num_new
            context += skip + num_new
            budget -= num_new

        duration = self.profile.step_seconds(prefill_tokens, decodes, context) + self._stolen_s
        self._stolen_s = 0.0
        return StepPlan(now, duration, scheduled, prefill_tokens, decodes, decode_flags, context)

    def end_step(self, plan: StepPlan) -> list[TokenOutput]:
        end = plan.end
        outputs: list[TokenOutput] = []
        any_finished = False
        observers = self.observers
        max_model_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        length, stop = FinishReason.LENGTH, FinishReason.STOP
        # the two lists are built together in begin_step, so they have the same length
        for (request, num_new), decode in zip(plan.scheduled, plan.decode_flags):  # noqa: B905
            if request.status is not running:
                continue  # aborted while the step ran
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            if not decode:
                for o in observers:
                    o.prefill_chunk(request, num_new, end)
            output_ids = request.output_token_ids
            index = len(output_ids)
            num_prompt = request.num_prompt_tokens
            if computed < num_prompt + index:
                continue  # a prefill chunk that does not reach the end samples nothing
            if index == 0:
                self._prompt_tokens += num_prompt
            token_id = GENERATED_TOKEN_IDS[index % NUM_GENERATED]
            output_ids.append(token_id)
            self._generation_tokens += 1
            for o in observers:
                o.token_generated(request, token_id, end)
            # SimRequest.length_limit_reached, inlined: the request now has index + 1 outputs
            num_output = index + 1
            stop_after = request.stop_after
            if stop_after is not None and num_output >= stop_after:
                reason: FinishReason | None = stop
            elif num_output >= request.max_tokens or num_prompt + num_output >= max_model_len:
                reason = length
            else:
                reason = None
            outputs.append(TokenOutput(request.request_id, token_id, index, reason))
            if reason is not None:
                self._finish(request, reason, end)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        for o in observers:
            o.step_finished(
                plan.start, plan.duration, plan.num_prefill_tokens, plan.num_decode_requests, plan.num_context_tokens
            )
        return outputs

    # ---- helpers ------------------------------------------------------------------------------

    def _allocated(self, request: SimRequest, blocks: list, now: float) -> None:
        if blocks and self.observers:
            ids = [b.block_id for b in blocks]
            for o in self.observers:
                o.blocks_allocated(request, ids, now)

    def _preempt(self, request: SimRequest, now: float) -> None:
        self._free(request, now)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # recompute, as vLLM V1 does: no swapping
        request.num_preemptions += 1
        self._preemptions += 1
        self.waiting.appendleft(request)
        for o in self.observers:
            o.preempted(request, now)

    def _free(self, request: SimRequest, now: float) -> None:
        freed = self.kv.free(request)
        if freed:
            for o in self.observers:
                o.blocks_freed(request, freed, now)

    def _finish(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        self._free(request, now)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished[reason.value] = self._finished.get(reason.value, 0) + 1
        for o in self.observers:
            o.finished(request, reason, now)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_preemptions_total=self._preemptions,
            prefix_cache_queries_total=self._cache_queries,
            prefix_cache_hits_total=self._cache_hits,
            finished_total=dict(self._finished),
        )


def _is_decode(request: SimRequest, num_new: int) -> bool:
    """One new token right after a sampled one: a decode, not a (re)compute of known tokens."""
    return num_new == 1 and request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1
