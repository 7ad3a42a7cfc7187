"""The scheduler's KV event subscriber: vLLM's layouts decoded, engine blocks re-hashed into the gateway's
prefix hashes, hostile and malformed messages counted and dropped, sequence gaps and restarts."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.procs import free_port
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.kv_events import (
    MAX_BLOCKS_PER_EVENT,
    EngineBlocks,
    KvEventStats,
    KvEventSubscriber,
    MalformedBatch,
    decode_batch,
    valid_endpoint,
)
from pilotfish.scheduler.view.types import RequestInfo
from pilotfish.simulator.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ZmqKVEventPublisher, encode_batch

ENGINE_BLOCK = 16
TOKENS = list(range(1000, 1000 + 8 * ENGINE_BLOCK))  # eight engine blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=ENGINE_BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


class Sink:
    def __init__(self) -> None:
        self.held: set[int] = set()
        self.calls: list[tuple] = []

    def __call__(self, instance_id: str, stored: list[int], removed: list[int], cleared: bool) -> None:
        self.calls.append((instance_id, list(stored), list(removed), cleared))
        if cleared:
            self.held.clear()
        self.held -= set(removed)
        self.held |= set(stored)


def blocks(size: int = 64, **kw: object) -> tuple[EngineBlocks, Sink, KvEventStats]:
    sink, stats = Sink(), KvEventStats()
    return EngineBlocks("x", sink, stats, prefix_block_size=size, **kw), sink, stats  # type: ignore[arg-type]


# -- layouts --------------------------------------------------------------------------------------------


def test_simulator_layout_array_batch_of_map_events() -> None:
    payload = encode_batch(
        [stored([1, 2], None, TOKENS[:32]), BlockRemoved(block_hashes=[2], medium="GPU"), AllBlocksCleared()]
    )
    events = decode_batch(payload)
    assert [type(e).__name__ for e in events] == ["_Stored", "_Removed", "_Cleared"]
    assert events[0].block_hashes == [1, 2] and events[0].token_ids == TOKENS[:32]  # type: ignore[union-attr]


def test_vllm_map_layout_with_new_fields_and_bytes_hashes() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 1.5,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": TOKENS[:16],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full",
                },
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU", "group_idx": 0},
            ],
            "data_parallel_rank": 0,
        }
    )
    events = decode_batch(payload)
    assert events[0].block_hashes == [b"\x01" * 32]  # type: ignore[union-attr]
    assert type(events[1]).__name__ == "_Removed"


def test_older_vllm_array_layout() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [7], None, TOKENS[:16], 16, None, "GPU"],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    assert [type(e).__name__ for e in decode_batch(payload)] == ["_StoredArray", "_RemovedArray", "_ClearedArray"]


# -- re-hashing into the gateway's prefix hashes --------------------------------------------------------


@pytest.mark.parametrize("gateway_block", [8, 16, 32, 64, 48])
def test_stored_blocks_get_the_gateways_hashes_in_pieces(gateway_block: int) -> None:
    b, sink, _ = blocks(gateway_block)
    # the prompt's eight engine blocks arrive in three events, each continuing its parent
    b.apply(decode_batch(encode_batch([stored([11, 12, 13], None, TOKENS[:48])]))[0])
    b.apply(decode_batch(encode_batch([stored([14], 13, TOKENS[48:64])]))[0])
    b.apply(decode_batch(encode_batch([stored([15, 16, 17, 18], 14, TOKENS[64:])]))[0])
    assert sink.held == set(prefix_block_hashes(TOKENS, gateway_block))


def test_core_ranks_the_instance_that_reported_the_blocks() -> None:
    core = SchedulerCore(SchedulerConfig(enable_full_mode_scheduling=True, enable_cache_aware_scheduling=True))
    for name in ("a", "b"):
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=name, host="h", http_port=1, model="m"))
        core.apply_status(
            cms_pb2.InstanceStatus(
                instance_id=name, update_id=1, timestamp_ms=int(time.time() * 1000), schedulable=True
            )
        )
    engine = EngineBlocks("b", core.apply_kv_event, KvEventStats(), prefix_block_size=64)
    engine.on_message([b"", seq(0), encode_batch([stored(list(range(1, 9)), None, TOKENS)])])
    req = RequestInfo(
        "r",
        "m",
        prompt_tokens=len(TOKENS),
        prefix_block_hashes=tuple(prefix_block_hashes(TOKENS, 64)),
        prefix_block_size=64,
    )
    assert core.schedule(req).target.instance_id == "b"


def test_removed_and_cleared_take_the_hashes_away() -> None:
    b, sink, stats = blocks(16)
    b.on_message([b"", seq(0), encode_batch([stored([1, 2, 3], None, TOKENS[:48])])])
    full = prefix_block_hashes(TOKENS[:48], 16)
    b.on_message([b"", seq(1), encode_batch([BlockRemoved(block_hashes=[3, 99], medium="GPU")])])  # 99: unknown
    assert sink.held == set(full[:2])
    b.on_message([b"", seq(2), encode_batch([AllBlocksCleared()])])
    assert sink.held == set() and len(b) == 0
    assert stats.applied == {"stored": 1, "removed": 1, "cleared": 1}


def test_a_gateway_block_goes_when_the_engine_block_completing_it_goes() -> None:
    b, sink, _ = blocks(64)
    b.on_message([b"", seq(0), encode_batch([stored([1, 2, 3, 4, 5], None, TOKENS[:80])])])
    assert sink.held == set(prefix_block_hashes(TOKENS[:64], 64))
    b.on_message([b"", seq(1), encode_batch([BlockRemoved(block_hashes=[5], medium="GPU")])])
    assert len(sink.held) == 1  # block 5 only started the next gateway block
    b.on_message([b"", seq(2), encode_batch([BlockRemoved(block_hashes=[4], medium="GPU")])])
    assert sink.held == set()


def test_unchained_blocks_are_counted_not_guessed() -> None:
    b, sink, stats = blocks(16)
    b.on_message([b"", seq(0), encode_batch([stored([5, 6], 4, TOKENS[:32])])])  # parent 4 never seen
    assert sink.held == set() and stats.unchained_blocks == 2 and not stats.dropped


def test_engine_blocks_are_bounded() -> None:
    b, sink, _ = blocks(16, max_blocks=4)
    b.on_message([b"", seq(0), encode_batch([stored(list(range(1, 9)), None, TOKENS)])])
    assert len(b) == 4
    assert sink.held == set(prefix_block_hashes(TOKENS, 16)[4:])


def test_a_block_continued_is_kept_over_older_ones() -> None:
    """The bound forgets the least recently stored or continued block: a block another continues is used."""
    b, sink, _ = blocks(16, max_blocks=3)
    one, two, three = TOKENS[:16], TOKENS[16:32], TOKENS[32:48]
    b.on_message([b"", seq(0), encode_batch([stored([1], None, one), stored([2], None, two)])])
    b.on_message([b"", seq(1), encode_batch([stored([3], 1, three)])])  # continues block 1
    b.on_message([b"", seq(2), encode_batch([stored([4], None, TOKENS[48:64])])])
    assert set(b._blocks) == {1, 3, 4}  # block 2 went: the oldest not used since
    assert sink.held == {*prefix_block_hashes(one + three, 16), *prefix_block_hashes(TOKENS[48:64], 16)}
    b.on_message([b"", seq(3), encode_batch([stored([2], None, two)])])  # stored again: 1 is now the oldest
    assert set(b._blocks) == {2, 3, 4}


def test_engine_blocks_cost_the_collector_nothing() -> None:
    """What the translator keeps per block is ints and bytes in plain dicts, which the collector never tracks
    (an OrderedDict of tuples per engine made each full pass 512 ms at 256 engines of 30,000 blocks)."""
    import gc

    b, _, _ = blocks(16, max_blocks=100_000)
    tokens = list(range(3000, 3000 + 16 * 2000))
    b.on_message([b"", seq(0), encode_batch([stored(list(range(1, 2001)), None, tokens)])])
    gc.collect()
    assert len(b) == 2000
    assert not any(gc.is_tracked(d) for d in (b._blocks, b._number, b._by_number, b._refs))


# -- hostile and malformed messages ---------------------------------------------------------------------

HOSTILE = [
    ("frames", [b"", seq(0)]),
    ("frames", [b"", seq(0), b"", b""]),
    ("topic", [b"other", seq(0), encode_batch([])]),
    ("malformed", [b"", b"\x00\x01", encode_batch([])]),
    ("malformed", [b"", seq(0), b""]),
    ("malformed", [b"", seq(0), b"\xff\xfe garbage"]),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode("a string")]),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode({"ts": "x", "events": []})]),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])]),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode([1.0, [5]])]),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]])]),
    (
        "malformed",
        [b"", seq(0), msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]])],
    ),
    ("malformed", [b"", seq(0), msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-1.5]}]])]),
    (
        "malformed",
        [
            b"",
            seq(0),
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1] * (MAX_BLOCKS_PER_EVENT + 1)}]]),
        ],
    ),
    ("malformed", [b"", seq(0), encode_batch([stored([1, 2], None, TOKENS[:31])])]),  # token count mismatch
    ("malformed", [b"", seq(0), encode_batch([stored([1], None, [2**32] * 16)])]),  # token id too big
    (
        "malformed",
        [
            b"",
            seq(0),
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [1] * 10**5,
                            "block_size": 10**5,
                        }
                    ],
                ]
            ),
        ],
    ),
]


@pytest.mark.parametrize(("reason", "frames"), HOSTILE)
def test_hostile_messages_are_counted_and_dropped(reason: str, frames: list[bytes]) -> None:
    b, sink, stats = blocks(16)
    b.on_message(frames)
    assert stats.dropped == {reason: 1}
    assert sink.held == set()
    # and the next good message still applies
    b.on_message([b"", seq(1), encode_batch([stored([1], None, TOKENS[:16])])])
    assert sink.held == set(prefix_block_hashes(TOKENS[:16], 16))


def test_a_bad_token_id_short_of_a_gateway_block_is_malformed_too() -> None:
    """Tokens that no gateway block takes yet are kept for the next engine block, not hashed: a token id out of
    range among them is refused as one in a hashed block is."""
    b, sink, stats = blocks(64)
    b.on_message([b"", seq(0), encode_batch([stored([1], None, [2**32] * 16)])])
    b.on_message([b"", seq(1), encode_batch([stored([2], None, [-1] * 16)])])
    assert stats.dropped == {"malformed": 2} and len(b) == 0 and sink.held == set()


def test_decode_batch_raises_only_malformed() -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(b"\xc1")


def test_sequence_gaps_and_restarts() -> None:
    b, sink, stats = blocks(16)
    b.on_message([b"", seq(5), encode_batch([stored([1], None, TOKENS[:16])])])  # joined mid-stream: no gap
    b.on_message([b"", seq(6), encode_batch([])])
    b.on_message([b"", seq(10), encode_batch([])])
    assert (stats.gaps, stats.missed_batches) == (1, 3)
    assert sink.held
    b.on_message([b"", seq(0), encode_batch([])])  # the publisher started again: its engine's cache is new
    assert stats.restarts == 1 and sink.held == set()


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("tcp://*:5557", False),
        ("inproc://x", False),
        ("tcp://host", False),
        ("", False),
    ],
)
def test_endpoints(endpoint: str, ok: bool) -> None:
    assert valid_endpoint(endpoint) is ok


# -- the subscriber over real ZMQ sockets ----------------------------------------------------------------


async def test_subscriber_follows_instances_and_feeds_the_index() -> None:
    port = free_port()
    publisher = ZmqKVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", block_size=ENGINE_BLOCK)
    config = SchedulerConfig(
        enable_full_mode_scheduling=True, enable_cache_aware_scheduling=True, kv_events_prefix_block_size=16
    )
    core = SchedulerCore(config)
    meta = cms_pb2.InstanceMetadata(
        instance_id="e",
        host="h",
        http_port=1,
        model="m",
        update_id=1,
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_topic="kv",
    )
    core.apply_metadata(meta)
    core.apply_metadata(
        cms_pb2.InstanceMetadata(instance_id="bad", host="h", http_port=2, model="m", kv_events_endpoint="tcp://*:1")
    )
    subscriber = KvEventSubscriber(core, prefix_block_size=16, sync_seconds=0.05)
    subscriber.start()
    index = core.prefix_index
    assert index is not None
    try:
        deadline = time.monotonic() + 20
        while index.blocks_of("e") == 0:  # a slow joiner misses what was sent before it connected: resend
            assert time.monotonic() < deadline, "no KV event reached the index"
            publisher.publish([stored([1, 2], None, TOKENS[:32])])
            await asyncio.sleep(0.02)
        assert index.match(prefix_block_hashes(TOKENS[:32], 16)) == {"e": 2}
        assert len(subscriber) == 1 and subscriber.stats.dropped["bad_endpoint"] == 1
        core.cms.remove("e")  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while len(subscriber):
            assert time.monotonic() < deadline, "subscription outlived its instance"
            await asyncio.sleep(0.02)
    finally:
        await subscriber.close()
        publisher.close()
