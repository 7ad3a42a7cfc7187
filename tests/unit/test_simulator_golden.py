"""The engine model's full output for a fixed short run, pinned by a digest.

Speed work on the engine (scheduler.py, kv_cache.py, request.py, virtual.py) must leave every
result exactly as it was: the same steps, token times (floats compared by repr, so bit for bit),
preemptions, prefix-cache hits, KV events and observer calls in the same order. The run below
covers chunked prefill, prefix hits, preemption under a small cache, a stop and a length finish,
an abort in the middle of a step, a detach and resume, and a shared-CPU profile's stolen time.

The pinned digests were computed by the engine before its hot paths were rewritten for speed. If
the model changes on purpose (a new scheduling rule, another step-time formula), regenerate them
with `python -m pytest tests/unit/test_simulator_golden.py` after setting PILOTFISH_PRINT_GOLDEN=1,
which prints the new values, and say in the commit why the results changed. Block hashes are
Python's tuple hashes, stable for one CPython version on 64-bit platforms.
"""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.virtual import VirtualEngine

GOLDEN = {
    "llama3-8b-a100": "b1d51aa502441cc41e46e296e8c5bccb8c60b6ed54d59860abf9bb807c97af16",
    "cpu-tiny": "459757940712c484dc109d47a5f956cfe03ce1f5723200351468f5f028068b5b",
}


class _Log(EngineObserver):
    """Every observer call, with its arguments, in order."""

    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def request_added(self, request: SimRequest, now: float) -> None:
        self.log.append(("added", request.request_id, now))

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        self.log.append(("scheduled", request.request_id, now, request.num_computed_tokens))

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.log.append(("hit", request.request_id, num_tokens, now))

    def blocks_allocated(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        self.log.append(("allocated", request.request_id, list(block_ids), now))

    def blocks_freed(self, request: SimRequest, block_ids: list[int], now: float) -> None:
        self.log.append(("freed", request.request_id, list(block_ids), now))

    def prefill_chunk(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.log.append(("chunk", request.request_id, num_tokens, now))

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        self.log.append(("token", request.request_id, token_id, now))

    def preempted(self, request: SimRequest, now: float) -> None:
        self.log.append(("preempted", request.request_id, now))

    def finished(self, request: SimRequest, reason: FinishReason, now: float) -> None:
        self.log.append(("finished", request.request_id, str(reason), now))

    def detached(self, request: SimRequest, now: float) -> None:
        self.log.append(("detached", request.request_id, now))

    def step_finished(
        self, now: float, duration: float, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int
    ) -> None:
        self.log.append(("step", now, duration, num_prefill_tokens, num_decodes, num_context_tokens))


def _run(profile: str) -> list[tuple]:
    """A fixed mixed workload on one small engine in virtual time; everything it produced."""
    config = EngineConfig(
        profile=profile, block_size=4, num_gpu_blocks=160, max_model_len=300, max_num_batched_tokens=96,
        max_num_seqs=12,
    )
    log: list[tuple] = []
    core = V1Engine(config, observers=[_Log(log)])
    core.enable_kv_events()
    engine = VirtualEngine(core)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 60))] for _ in range(4)]
    t = 0.0
    for i in range(90):
        t += rng.expovariate(40.0)
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 80))]
        stop = rng.choice([None, None, rng.randrange(1, 30)])
        # some run into max_model_len, the rest into max_tokens or their stop
        max_tokens = rng.choice([rng.randrange(1, 60), 400])
        for timed in engine.add_request(SimRequest(f"r{i}", prompt, max_tokens, stop_after=stop), t):
            log.append(("out", timed.time, timed.output))
        log.append(("kv", core.take_kv_events()))
        if i % 17 == 5 and core.running:
            # abort one that is in the step under way: it must produce nothing at the step's end
            victim = core.running[-1].request_id
            for timed in engine.abort_request(victim, t):
                log.append(("out", timed.time, timed.output))
        if i % 23 == 11 and core.running:
            moving = core.detach_request(core.running[0].request_id, t)
            assert moving is not None
            if moving.length_limit_reached(config.max_model_len) is None:
                core.resume_request(moving, t)
        log.append(("stats", core.stats()))
    for timed in engine.run_until_idle():
        log.append(("out", timed.time, timed.output))
    log.append(("kv", core.take_kv_events()))
    log.append(("stats", core.stats(), engine.now, core.kv.pool.num_evictions))
    return log


def _digest(log: list[tuple]) -> str:
    return hashlib.sha256(repr(log).encode()).hexdigest()


@pytest.mark.parametrize("profile", sorted(GOLDEN))
def test_engine_output_is_what_it_was(profile: str) -> None:
    log = _run(profile)
    if os.environ.get("PILOTFISH_PRINT_GOLDEN"):
        print(f'\n    "{profile}": "{_digest(log)}",')
    # the run exercises what it claims to, so the digest pins something
    kinds = {entry[0] for entry in log}
    assert {"preempted", "hit", "chunk", "detached", "freed"} <= kinds
    reasons = {entry[2] for entry in log if entry[0] == "finished"}
    assert {"stop", "length", "abort"} <= reasons
    assert any(entry[1] for entry in log if entry[0] == "kv")
    assert _digest(log) == GOLDEN[profile]
