"""Engine KV events -> the prefix index (full mode): a ZMQ SUB per engine that advertises a publisher.

A llumlet puts its engine's KV-event publisher in the CMS metadata (`kv_events_endpoint`,
`kv_events_topic`); `KvEventSubscriber` keeps one SUB socket per instance that has one, opened
and closed as instances come and go in the view (checked every `SYNC_SECONDS`), and feeds
what it receives to `SchedulerCore.apply_kv_event`.

Wire format (vLLM's `ZmqEventPublisher`): multipart `[topic, seq, payload]`, `seq` an 8-byte
big-endian counter, `payload` msgpack of `KVEventBatch` with `BlockStored` (block hashes, parent
hash, token ids, block size), `BlockRemoved` (block hashes) and `AllBlocksCleared`. Both layouts
in use are read: maps (vLLM today: a map batch whose events are maps tagged `type`; the
simulator: an array batch of such maps) and arrays (older vLLM: array batch, events
`[tag, fields...]`). Unknown fields are ignored, so newer fields do not break it.

Hashes: the prefix index keys are the gateway's chained hashes (`cms.prefix_hash`, blocks of
the gateway's `--prefix-block-size`), never the engine's own (vLLM's are process-local and
version-dependent). So each stored block's token ids are re-hashed here, continuing the chain
of its parent block: `EngineBlocks` maps every engine block hash to the chain state at its end
(the last gateway hash and the tokens since it), so a gateway block of several engine blocks
(or several of one) is stored once its last token is. A removed engine block removes the
gateway hashes it completed (engines evict a freed request's blocks tail first, so that is the
one that goes first). This holds only when the gateway tokenizes as the engine does: with the
simulator it does (both use the same tokenizer); with real vLLM see the README.

Defensive: a message over `MAX_MESSAGE_BYTES` is refused by ZMQ itself (it drops the peer,
which reconnects); one that does not decode, exceeds a bound, or has the wrong shape is counted
and dropped with a rate-limited warning; nothing here raises into the loop. A sequence gap is
counted (vLLM's replay socket is not used: it is not advertised in the metadata and the
simulator has none; the dispatch feed and LRU bounds keep the index usable meanwhile, and the
blocks stored during a gap stay unknown until stored again). A sequence that goes back is a
restarted publisher: its engine's cache starts empty, so the instance's blocks are cleared.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta, Raw

from pilotfish.cms.prefix_hash import prefix_block_hashes

if TYPE_CHECKING:
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)

# bounds on what one message may carry: a step stores at most its token budget (tens of
# thousands of tokens); anything past these is hostile or broken
MAX_MESSAGE_BYTES = 16 << 20
MAX_EVENTS = 65536
MAX_BLOCKS_PER_EVENT = 65536
MAX_BLOCK_SIZE = 4096
MAX_TOKENS_PER_EVENT = 1 << 20
# how often the subscriptions follow the view's instances, and the warnings' rate limit
SYNC_SECONDS = 1.0
WARN_EVERY_SECONDS = 10.0

# vLLM's ExternalBlockHash: an unsigned 64-bit int, or bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
EngineHash = int | Annotated[bytes, Meta(max_length=64)]
_Hashes = Annotated[list[EngineHash], Meta(max_length=MAX_BLOCKS_PER_EVENT)]
_Tokens = Annotated[list[int], Meta(max_length=MAX_TOKENS_PER_EVENT)]
_Events = Annotated[list[Raw], Meta(max_length=MAX_EVENTS)]


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: EngineHash | None
    token_ids: _Tokens
    block_size: int


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: _Hashes


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: EngineHash | None
    token_ids: _Tokens
    block_size: int


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: _Hashes


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct):
    ts: float
    events: _Events


class _BatchArray(msgspec.Struct, array_like=True):
    ts: float
    events: _Events


Event = _Stored | _Removed | _Cleared | _StoredArray | _RemovedArray | _ClearedArray

_BATCH = {"map": msgspec.msgpack.Decoder(_Batch), "array": msgspec.msgpack.Decoder(_BatchArray)}
_EVENT = {
    "map": msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared),
    "array": msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray),
}


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch this decoder accepts."""


def _layout(raw: bytes | Raw) -> str:
    """msgpack's first byte says map or array; anything else is no batch or event."""
    first = memoryview(raw)[:1].tobytes()
    if not first:
        raise MalformedBatch("empty")
    b = first[0]
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    raise MalformedBatch(f"not a map or an array (first byte 0x{b:02x})")


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch payload, in order; raises MalformedBatch."""
    try:
        batch = _BATCH[_layout(payload)].decode(payload)
        events = []
        for raw in batch.events:
            events.append(_EVENT[_layout(raw)].decode(raw))
    except msgspec.DecodeError as exc:  # ValidationError included: a bound or a type
        raise MalformedBatch(str(exc)) from None
    return events


@dataclass(slots=True)
class KvEventStats:
    """Counts for /metrics (scheduler/telemetry.py reads them at scrape time)."""

    # events applied, by kind: stored, removed, cleared
    applied: Counter[str] = field(default_factory=Counter)
    # messages or events dropped, by reason
    dropped: Counter[str] = field(default_factory=Counter)
    # sequence gaps, and the batches they skipped
    gaps: int = 0
    missed_batches: int = 0
    # stored blocks whose parent was never seen (stored before we subscribed, or during a gap)
    unchained_blocks: int = 0
    # publishers that started their sequence again
    restarts: int = 0
    subscriptions: int = 0


Sink = Callable[[str, Sequence[int], Sequence[int], bool], None]


# what is kept of an engine block, packed into bytes (`_pack`): the gateway hash of the last complete gateway
# block, then how many token ids follow it; then those token ids, then the gateway hashes the block completed
_BLOCK_HEAD = struct.Struct("<QH")


def _pack(chain: int, pending: Sequence[int], completed: Sequence[int]) -> bytes:
    return _BLOCK_HEAD.pack(chain, len(pending)) + struct.pack(f"<{len(pending)}I{len(completed)}Q", *pending,
                                                               *completed)


def _unpack(raw: bytes) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    chain, n = _BLOCK_HEAD.unpack_from(raw)
    at = _BLOCK_HEAD.size + 4 * n
    return (chain, struct.unpack_from(f"<{n}I", raw, _BLOCK_HEAD.size),
            struct.unpack_from(f"<{(len(raw) - at) // 8}Q", raw, at))


class EngineBlocks:
    """One engine's blocks: engine hash -> the gateway chain at its end; decodes and applies its messages.

    No I/O: `on_message` takes the frames one SUB socket received. Bounded by `max_blocks`
    engine blocks (the least recently stored or continued forgotten first, as if evicted).

    Kept in plain dicts of ints and bytes, which Python's collector never tracks: an OrderedDict of tuples
    per engine, 256 engines of 30,000 blocks, made each full pass of the collector 512 ms, the scheduler's
    loop stopped meanwhile. The order is a sequence number per block and the blocks by their numbers.
    """

    def __init__(
        self,
        instance_id: str,
        sink: Sink,
        stats: KvEventStats,
        *,
        prefix_block_size: int,
        topic: str = "",
        max_blocks: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self._sink = sink
        self._stats = stats
        self._size = prefix_block_size
        self._topic = topic.encode()
        self._max_blocks = max_blocks
        self._clock = clock
        # engine hash -> (gateway hash of the last complete gateway block, token ids since it, gateway hashes this
        # engine block completed), packed (`_pack`)
        self._blocks: dict[int | bytes, bytes] = {}
        # engine hash -> its number in the order (the least recently stored or continued first), and back
        self._number: dict[int | bytes, int] = {}
        self._by_number: dict[int, int | bytes] = {}
        self._next = 0  # the next block's number
        self._oldest = 0  # no block has a lower number
        # gateway hash -> engine blocks that completed it (several when engines hash more than tokens)
        self._refs: dict[int, int] = {}
        self.last_seq: int | None = None
        self._warned_at = -WARN_EVERY_SECONDS

    def __len__(self) -> int:
        return len(self._blocks)

    # -- one message ---------------------------------------------------------------------------------

    def on_message(self, frames: Sequence[bytes]) -> None:
        """One multipart message `[topic, seq, payload]`; never raises."""
        try:
            self._on_message(frames)
        except Exception as exc:  # a bug or a case not thought of must not end the subscription
            self._drop("error", f"{type(exc).__name__}: {exc}")

    def _on_message(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            return self._drop("frames", f"{len(frames)} frames, not [topic, seq, payload]")
        topic, seq_bytes, payload = frames
        if bytes(topic) != self._topic:
            return self._drop("topic", f"topic {bytes(topic)[:64]!r}")
        if len(seq_bytes) != 8:
            return self._drop("malformed", f"sequence of {len(seq_bytes)} bytes, not 8")
        self._sequence(int.from_bytes(seq_bytes, "big"))
        try:
            events = decode_batch(bytes(payload))
        except MalformedBatch as exc:
            return self._drop("malformed", str(exc))
        for event in events:
            self.apply(event)
        return None

    def _sequence(self, seq: int) -> None:
        last = self.last_seq
        self.last_seq = seq
        if last is None or seq == last + 1:
            return
        if seq > last + 1:
            self._stats.gaps += 1
            self._stats.missed_batches += seq - last - 1
            self._warn(f"sequence gap: {seq - last - 1} batches missed (after {last})")
            return
        # the publisher started again (its engine restarted): what it cached before is gone
        self._stats.restarts += 1
        self._warn(f"sequence went back from {last} to {seq}: publisher restarted, clearing its blocks")
        self.clear()

    # -- events ----------------------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        if isinstance(event, _Stored | _StoredArray):
            self._stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
        elif isinstance(event, _Removed | _RemovedArray):
            self._removed(event.block_hashes)
        else:
            self.clear()
            self._stats.applied["cleared"] += 1

    def clear(self) -> None:
        self._blocks.clear()
        self._number.clear()
        self._by_number.clear()
        self._oldest = self._next
        self._refs.clear()
        self._sink(self.instance_id, (), (), True)

    def _stored(
        self, hashes: Sequence[int | bytes], parent: int | bytes | None, tokens: Sequence[int], block_size: int
    ) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE or len(tokens) != len(hashes) * block_size:
            return self._drop(
                "malformed", f"BlockStored: {len(hashes)} blocks of {block_size} tokens with {len(tokens)} token ids"
            )
        if parent is None:
            chain, pending = 0, ()
        else:
            at = self._blocks.get(parent)
            if at is None:
                # its prefix is unknown here: the gateway hash of these blocks cannot be computed
                self._stats.unchained_blocks += len(hashes)
                return None
            chain, pending, _ = _unpack(at)
            del self._by_number[self._number[parent]]
            self._numbered(parent)  # continued: the most recently used
        size = self._size
        stored: list[int] = []
        gone: list[int] = []
        for i, engine_hash in enumerate(hashes):
            run = (*pending, *tokens[i * block_size : (i + 1) * block_size])
            full = len(run) - len(run) % size
            completed: tuple[int, ...] = ()
            if full:
                try:
                    completed = tuple(prefix_block_hashes(run[:full], size, chain))
                except ValueError as exc:  # a token id outside [0, 2^32)
                    return self._drop("malformed", f"BlockStored: {exc}")
                chain = completed[-1]
            pending = run[full:]
            try:
                packed = _pack(chain, pending, completed)
            except struct.error:  # a token id outside [0, 2^32) among those no gateway block took yet
                return self._drop("malformed", "BlockStored: token ids must be integers in [0, 2^32)")
            replaced = self._forget(engine_hash)  # stored again (its removal was missed)
            self._blocks[engine_hash] = packed
            self._numbered(engine_hash)
            for h in completed:
                self._refs[h] = self._refs.get(h, 0) + 1
            stored.extend(completed)
            gone.extend(h for h in replaced if h not in self._refs)
        self._stats.applied["stored"] += 1
        evicted = gone + self._trim()
        if evicted:  # the bound pushed out blocks of this very event: the index applies removals first
            stored = [h for h in stored if h in self._refs]
        if stored or evicted:
            self._sink(self.instance_id, stored, evicted, False)
        return None

    def _removed(self, hashes: Sequence[int | bytes]) -> None:
        removed: list[int] = []
        for engine_hash in hashes:
            removed.extend(self._forget(engine_hash))
        self._stats.applied["removed"] += 1
        if removed:
            self._sink(self.instance_id, (), removed, False)

    def _numbered(self, engine_hash: int | bytes) -> None:
        """Give the block the next number: it is the most recently used."""
        self._number[engine_hash] = self._next
        self._by_number[self._next] = engine_hash
        self._next += 1

    def _forget(self, engine_hash: int | bytes) -> list[int]:
        """Drop one engine block; the gateway hashes no engine block completes any more."""
        at = self._blocks.pop(engine_hash, None)
        if at is None:
            return []
        del self._by_number[self._number.pop(engine_hash)]
        gone = []
        for h in _unpack(at)[2]:
            left = self._refs.get(h, 0) - 1
            if left > 0:
                self._refs[h] = left
            else:
                self._refs.pop(h, None)
                gone.append(h)
        return gone

    def _trim(self) -> list[int]:
        gone: list[int] = []
        by_number = self._by_number
        while len(self._blocks) > self._max_blocks:
            while self._oldest not in by_number:  # numbers of blocks forgotten or used again since
                self._oldest += 1
            gone.extend(self._forget(by_number[self._oldest]))
        return gone

    # -- bookkeeping -------------------------------------------------------------------------------------

    def _drop(self, reason: str, detail: str) -> None:
        self._stats.dropped[reason] += 1
        self._warn(f"dropped a KV event message ({reason}): {detail[:200]}")

    def _warn(self, text: str) -> None:
        now = self._clock()
        if now - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = now
            log.warning("instance %s: %s (further warnings muted for %gs)", self.instance_id, text, WARN_EVERY_SECONDS)
        else:
            log.debug("instance %s: %s", self.instance_id, text)


def valid_endpoint(endpoint: str) -> bool:
    """tcp://HOST:PORT or ipc://PATH: what a publisher can be reached at from another process."""
    if endpoint.startswith("ipc://"):
        return len(endpoint) > 6
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    return endpoint.startswith("tcp://") and bool(sep and host and "*" not in host and port.isdigit())


@dataclass(slots=True, eq=False)
class _Subscription:
    endpoint: str
    topic: str
    blocks: EngineBlocks
    task: asyncio.Task[None]


class KvEventSubscriber:
    """The live subscriptions of one scheduler core (full mode, with a prefix index)."""

    def __init__(self, core: SchedulerCore, *, prefix_block_size: int, sync_seconds: float = SYNC_SECONDS) -> None:
        import zmq.asyncio

        self.core = core
        self.prefix_block_size = prefix_block_size
        self.sync_seconds = sync_seconds
        self.stats = KvEventStats()
        self._ctx = zmq.asyncio.Context()
        self._subs: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self._bad_endpoints: set[tuple[str, str]] = set()
        self._collector: Any = None

    @classmethod
    def start_for(cls, core: SchedulerCore, config: SchedulerConfig) -> KvEventSubscriber | None:
        """Started (on the running loop) when full mode has a prefix index and --enable-kv-events; else None."""
        if not (config.enable_kv_events and core.full_mode and core.prefix_index is not None):
            return None
        from pilotfish.scheduler.telemetry import register_kv_events

        subscriber = cls(core, prefix_block_size=config.kv_events_prefix_block_size)
        subscriber._collector = register_kv_events(core.registry, subscriber.stats)
        subscriber.start()
        return subscriber

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="scheduler-kv-events")

    def __len__(self) -> int:
        return len(self._subs)

    def blocks(self, instance_id: str) -> EngineBlocks | None:
        sub = self._subs.get(instance_id)
        return sub.blocks if sub is not None else None

    async def _follow(self) -> None:
        while True:
            try:
                self.sync()
            except Exception:  # never let a surprise end the feed; the next round tries again
                log.exception("KV event subscriptions: sync failed")
            await asyncio.sleep(self.sync_seconds)

    def sync(self) -> None:
        """Open a subscription for each instance that advertises a publisher, close the others."""
        wanted = {
            inst.instance_id: (inst.kv_events_endpoint, inst.kv_events_topic)
            for inst in self.core.instances()
            if inst.kv_events_endpoint
        }
        for instance_id, sub in list(self._subs.items()):
            if wanted.get(instance_id) != (sub.endpoint, sub.topic):
                self._close(instance_id, moved=instance_id in wanted)
        for instance_id, (endpoint, topic) in wanted.items():
            if instance_id not in self._subs:
                self._open(instance_id, endpoint, topic)
        self.stats.subscriptions = len(self._subs)

    def _open(self, instance_id: str, endpoint: str, topic: str) -> None:
        import zmq

        if not valid_endpoint(endpoint):
            if (instance_id, endpoint) not in self._bad_endpoints:
                self._bad_endpoints.add((instance_id, endpoint))
                self.stats.dropped["bad_endpoint"] += 1
                log.warning(
                    "instance %s: KV events endpoint %r is not tcp://HOST:PORT; not subscribing",
                    instance_id,
                    endpoint[:200],
                )
            return
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # ZMQ refuses (and disconnects) a peer that sends a bigger message: it is never read
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self.stats.dropped["bad_endpoint"] += 1
            log.warning("instance %s: cannot subscribe to KV events at %r: %s", instance_id, endpoint[:200], exc)
            return
        index = self.core.prefix_index
        capacity = index.capacity_of(instance_id) if index is not None else 65536
        blocks = EngineBlocks(
            instance_id,
            self._apply,
            self.stats,
            prefix_block_size=self.prefix_block_size,
            topic=topic,
            max_blocks=capacity,
        )
        task = asyncio.create_task(self._receive(sock, blocks), name=f"kv-events-{instance_id}")
        self._subs[instance_id] = _Subscription(endpoint, topic, blocks, task)
        log.info("instance %s: subscribed to KV events at %s", instance_id, endpoint)

    def _apply(self, instance_id: str, stored: Sequence[int], removed: Sequence[int], cleared: bool) -> None:
        self.core.apply_kv_event(instance_id, stored, removed, cleared)

    def _close(self, instance_id: str, *, moved: bool) -> None:
        sub = self._subs.pop(instance_id)
        sub.task.cancel()
        if moved:
            # a new publisher address is a new engine process: what the old one cached is gone
            self.core.apply_kv_event(instance_id, cleared=True)

    async def _receive(self, sock: Any, blocks: EngineBlocks) -> None:
        import zmq

        try:
            while True:
                try:
                    frames = await sock.recv_multipart()
                except zmq.ZMQError as exc:
                    blocks._warn(f"receive failed: {exc}")
                    await asyncio.sleep(1.0)
                    continue
                blocks.on_message(frames)
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        tasks = [s.task for s in self._subs.values()]
        if self._task is not None:
            tasks.append(self._task)
        self._subs.clear()
        self._task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self._ctx.destroy(linger=0)
        if self._collector is not None:
            self.core.registry.unregister(self._collector)
            self._collector = None
