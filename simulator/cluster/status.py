"""An engine's state as the CMS `InstanceStatus` the llumlet writes, built from the engine model.

Full-mode scheduling reads these records; the virtual-time cluster builds one per engine after
every step (the llumlet writes on every load change) and hands it to the router late by the
observation delay. The fields follow cms.proto's comments.
"""

from __future__ import annotations

from dataclasses import dataclass

from pilotfish.protos.cms_pb2 import InstanceStatus
from pilotfish.simulator.engine.scheduler import V1Engine


@dataclass(slots=True)
class LastStep:
    duration: float = 0.0
    prefill_tokens: int = 0
    decode_batch: int = 0
    seq_len_sum: int = 0


def instance_status(
    core: V1Engine,
    instance_id: str,
    *,
    update_id: int,
    now: float,
    step_id: int = 0,
    last_step: LastStep | None = None,
    schedulable: bool = True,
    migrating_in: int = 0,
    migrating_out: int = 0,
) -> InstanceStatus:
    block_size = core.config.block_size
    waiting_prefill = uncomputed = unallocated = 0
    for r in core.waiting:
        if r.num_output_tokens == 0:
            waiting_prefill += 1
        # a waiting request recomputes from scratch (its cache hit is unknown until it is scheduled)
        uncomputed += r.num_prompt_tokens
        unallocated += r.num_prompt_tokens + r.max_tokens
    running_prefill = running_decode = decode_seq = 0
    for r in core.running:
        if r.num_computed_tokens < r.num_prompt_tokens:
            running_prefill += 1
            uncomputed += r.num_prompt_tokens - r.num_computed_tokens
        else:
            running_decode += 1
            decode_seq += r.num_tokens
        held = core.kv.num_blocks_held(r.request_id) * block_size
        unallocated += max(0, r.num_prompt_tokens + r.max_tokens - held)
    last = last_step or LastStep()
    return InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=int(now * 1000),
        step_id=step_id,
        schedulable=schedulable,
        num_waiting=len(core.waiting),
        num_running=len(core.running),
        num_migrating_in=migrating_in,
        num_migrating_out=migrating_out,
        num_waiting_prefill=waiting_prefill,
        num_running_prefill=running_prefill,
        num_running_decode=running_decode,
        uncomputed_prefill_tokens=uncomputed,
        running_decode_seq_len_sum=decode_seq,
        used_kv_tokens=core.kv.pool.num_used * block_size,
        total_kv_tokens=core.kv.pool.num_blocks * block_size,
        unallocated_tokens=unallocated,
        last_step_duration_us=min(int(last.duration * 1e6), 2**32 - 1),
        last_step_prefill_tokens=last.prefill_tokens,
        last_step_decode_batch=last.decode_batch,
        last_step_seq_len_sum=last.seq_len_sum,
        admitted_request_ids=[r.request_id for r in core.running] + [r.request_id for r in core.waiting],
        num_preempted_total=core.stats().num_preemptions_total,
    )
