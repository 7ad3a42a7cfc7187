"""KV events in vLLM's wire format: what the engine records, the msgpack encoding, and the ZMQ
multipart message (topic, 8-byte big-endian sequence, payload) a subscriber receives."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from pilotfish.procs import free_port_block
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.engine.block_hash import block_hashes
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.fleet import serve_engines
from pilotfish.simulator.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    engine_endpoint,
    to_events,
)

U64 = (1 << 64) - 1
PROFILE = StepTimeProfile(name="t", base_ms=1.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0)


def run(core: V1Engine) -> None:
    now = 0.0
    while core.has_unfinished_requests():
        now += core.step(now).duration


def test_the_engine_records_stored_and_evicted_blocks_like_vllm() -> None:
    core = V1Engine(EngineConfig(block_size=4, num_gpu_blocks=8, max_model_len=32, max_num_batched_tokens=64),
                    PROFILE)
    core.enable_kv_events()
    prompt_a = list(range(10, 22))  # three full blocks
    core.add_request(SimRequest("a", prompt_a, 1), 0.0)
    run(core)
    events = to_events(core.take_kv_events(), 4)
    hashes_a = block_hashes(prompt_a, 4)
    assert events == [BlockStored(block_hashes=[h & U64 for h in hashes_a], parent_block_hash=None,
                                  token_ids=prompt_a, block_size=4, lora_id=None, medium="GPU", lora_name=None,
                                  group_idx=0)]
    assert core.take_kv_events() == []  # drained
    # b needs 7 blocks: the 4 never used, then a's freed ones, tail first (a's 4th block held no hash)
    core.add_request(SimRequest("b", list(range(100, 128)), 1), 0.0)
    run(core)
    events = to_events(core.take_kv_events(), 4)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [hashes_a[2] & U64, hashes_a[1] & U64]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].token_ids[:4] == [100, 101, 102, 103]


def test_a_batch_round_trips_and_matches_vllm_layout() -> None:
    events = [BlockStored(block_hashes=[1, U64], parent_block_hash=7, token_ids=[5, 6], block_size=16, lora_id=None,
                          medium="GPU", lora_name=None, group_idx=0),
              BlockRemoved(block_hashes=[U64], medium="GPU", group_idx=0), AllBlocksCleared()]
    payload = encode_batch(events, ts=1.5)
    assert decode_batch(payload).events == events
    raw = msgspec.msgpack.decode(payload)
    # EventBatch is an array [ts, events, data_parallel_rank]; events are maps tagged by "type"
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == [1, U64]
    assert raw[1][0]["lora_id"] is None and "extra_keys" not in raw[1][0]  # defaults omitted, required kept
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [U64], "medium": "GPU", "group_idx": 0}
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_endpoints_offset_by_engine_index() -> None:
    assert engine_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert engine_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    with pytest.raises(ValueError):
        engine_endpoint("tcp://nowhere", 1)


async def test_a_subscriber_receives_vllm_multipart_messages() -> None:
    import aiohttp

    port = free_port_block(2)  # engine i publishes on port + i
    serve = ServeConfig(engines=2, base_port=0, kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                        kv_events_topic="kv", kv_events_engines=[1])
    engine = EngineConfig(step_ms=0.5, prefill_ms_per_token=0, decode_ms_per_token=0)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        async with serve_engines(serve, engine) as fleet, aiohttp.ClientSession() as http:
            sub.connect(f"tcp://127.0.0.1:{port + 1}")  # engine 1 only: kv_events_engines=[1]
            assert fleet.engines[0].driver.kv_events is None
            frames = None
            async with asyncio.timeout(10):
                n = 0
                while frames is None:  # a PUB drops what it sends before the subscription lands
                    prompt = [1000 + 40 * n + i for i in range(40)]  # fresh: two new full blocks of 16
                    body = {"prompt": prompt, "max_tokens": 1}
                    n += 1
                    async with http.post(f"{fleet.urls[1]}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                    if await sub.poll(50):
                        frames = await sub.recv_multipart()
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8
        batch = decode_batch(payload)
        (stored,) = batch.events
        assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
        assert len(stored.token_ids) == 32 and stored.block_size == 16 and stored.medium == "GPU"
        assert stored.block_hashes == [h & U64 for h in block_hashes(stored.token_ids, 16)]
    finally:
        sub.close(linger=0)
        ctx.term()
