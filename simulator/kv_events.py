"""KV-cache events over ZMQ in vLLM's wire format, so routers that consume them can watch the simulator.

Checked against vLLM 0.32.0 (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`): each batch
is one multipart message `(topic, seq, payload)`, `seq` an 8-byte big-endian counter from 0 and
`payload` msgspec-msgpack of `KVEventBatch`: an array `[ts, events]` (array_like, the data-parallel
rank omitted when unset) whose events are maps tagged `type` = `BlockStored`, `BlockRemoved` or
`AllBlocksCleared`. Block hashes are unsigned 64-bit ints, as vLLM sends them with its default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`. One batch per engine step that changed the cache.
Not implemented: vLLM's replay socket (ROUTER) for missed batches.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; the tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_events(raw: list[tuple], block_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The engine's raw event tuples (`V1Engine.take_kv_events`) as vLLM's event structs."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in raw:
        kind = event[0]
        if kind == "stored":
            _, hashes, parent, tokens = event
            out.append(BlockStored(
                block_hashes=[h & _U64 for h in hashes],
                parent_block_hash=None if parent is None else parent & _U64,
                token_ids=list(tokens), block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
                lora_name=None, group_idx=0,
            ))
        elif kind == "removed":
            out.append(BlockRemoved(block_hashes=[event[1] & _U64], medium=MEDIUM_GPU, group_idx=0))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
    return out


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: list[BlockStored | BlockRemoved | AllBlocksCleared], ts: float | None = None) -> bytes:
    # vLLM's publisher stamps its data-parallel rank (0 for one engine) on every batch
    return _ENCODER.encode(KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=0))


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)


def engine_endpoint(endpoint: str, index: int) -> str:
    """Engine `index`'s endpoint: the port plus the index, as vLLM offsets data-parallel ranks."""
    base, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT")
    return f"{base}:{int(port) + index}"


class ZmqKVEventPublisher:
    """A PUB socket bound at `endpoint` (`tcp://*:5557` or `tcp://127.0.0.1:5557`).

    Sends without blocking from the engine's loop: ZMQ queues up to the high-water mark and then
    drops, which is what vLLM's PUB socket does too when a subscriber falls behind.
    """

    def __init__(self, endpoint: str, topic: str = "", block_size: int = 16, hwm: int = 100_000) -> None:
        import zmq

        self.endpoint = endpoint
        self.block_size = block_size
        self._topic = topic.encode()
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.bind(endpoint)
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again

    def publish_raw(self, raw: list[tuple]) -> None:
        if raw:
            self.publish(to_events(raw, self.block_size))

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        seq = self._seq
        self._seq += 1
        # at the high-water mark a batch is dropped, and the sequence gap tells subscribers so
        with contextlib.suppress(self._again):
            self._sock.send_multipart((self._topic, seq.to_bytes(8, "big"), encode_batch(events)),
                                      flags=self._noblock)

    def close(self) -> None:
        self._sock.close(linger=0)
