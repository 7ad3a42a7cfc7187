"""The oracle: least predicted TTFT from every engine's true state at the instant of the decision.

No gateway can know more than this router does: it reads each engine model directly (queues,
every request's computed tokens, the step in progress, the prefix cache's exact contents) with
zero delay. It is greedy, one request at a time, so it is a reference point rather than a proven
bound; the report says so if any policy beats it.
"""

from __future__ import annotations

import math
import random

from pilotfish.bench.peers import cached_prefix_blocks, pick_min
from pilotfish.simulator.cluster import Router, RouteRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.virtual import VirtualEngine


def predicted_ttft(core: V1Engine, engine: VirtualEngine, request: RouteRequest, now: float) -> float:
    """Seconds until `request`'s first token if it joined `core` now, from the step-time profile.

    Everything queued ahead is prefilled first (FCFS, chunked under the token budget), sharing
    each step with the decodes already running; the step in progress finishes first.
    """
    cfg = core.config
    profile = core.profile
    bs = cfg.block_size
    prefill_ahead = 0
    decodes = 0
    context = 0
    for r in core.running:
        left = r.num_tokens - r.num_computed_tokens
        if r.num_computed_tokens < r.num_prompt_tokens:
            prefill_ahead += left
        else:
            decodes += 1
        context += r.num_tokens
    for r in core.waiting:
        hit = cached_prefix_blocks(core, r.block_hashes, (r.num_tokens - 1) // bs) * bs
        prefill_ahead += r.num_tokens - hit
        context += r.num_tokens
    hit = cached_prefix_blocks(core, request.block_hashes, (request.prompt_tokens - 1) // bs) * bs
    prefill = prefill_ahead + request.prompt_tokens - hit
    budget = max(cfg.max_num_batched_tokens - decodes, 1)
    steps = max(math.ceil(prefill / budget), 1)
    per_step = (profile.base_ms + profile.decode_ms_per_token * decodes
                + profile.context_ms_per_token * context) / 1000.0
    ttft = steps * per_step + profile.prefill_ms_per_token * prefill / 1000.0
    # KV memory: what does not fit waits for running requests to free blocks (a coarse wait,
    # one average step per missing block's worth of the running set's decode)
    free = core.kv.pool.num_free
    needed = math.ceil((request.prompt_tokens - hit) / bs)
    if needed > free and core.running:
        ttft += (needed - free) / max(len(core.running), 1) * per_step
    busy = engine.step_end
    if busy is not None and busy > now:
        ttft += busy - now
    return ttft


class OracleRouter(Router):
    """Lowest predicted TTFT from the engines' true, zero-delay state; fewer decodes breaks ties."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"oracle:{seed}")
        self.cores: dict[int, V1Engine] = {}
        self.engines: dict[int, VirtualEngine] = {}

    def observe_engine(self, index: int, core: V1Engine) -> None:
        self.cores[index] = core

    def attach_engines(self, engines: list[VirtualEngine]) -> None:
        self.engines = dict(enumerate(engines))

    def route(self, request: RouteRequest, now: float) -> int:
        scores = []
        for k in range(len(self.cores)):
            core = self.cores[k]
            # the running set size as a sub-millisecond tie-break: equal TTFT, lighter decode batch
            scores.append(predicted_ttft(core, self.engines[k], request, now) + len(core.running) * 1e-6)
        return pick_min(scores, self.rng)
