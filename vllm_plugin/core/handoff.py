"""Shared memory between the engine's process and the llumlet's export process.

The engine thread stores the latest status in one fixed record and appends each admitted request
id to a ring; the export process (core/export_process.py) polls the record and writes it to the CMS.
A store costs the engine thread a few microseconds and no system call: no socket write, no
thread woken, no GIL handed to a thread of ours (bench llumlet measured 78 µs a step for the
write from the engine thread, inside vLLM on CPU).

A steady decode step (LoadState.decode_step: every running request decoded one token, nothing
else moved) changes the figures in a way the last full record already fixes, but for the step's
duration and the KV blocks in use. So the engine stores only those, with the step's time, in two
64-bit words (the tick), and the reader derives the rest from the record (`steady_figures`).
Inside vLLM, where the hooks run once a step on caches the model just evicted, the full store
(struct) cost about twice as much (bench llumlet-cachesim counts such costs).

Layout (one memfd, both processes map it):
  [0, 64)        control: magic, layout version, `napping` (set by the exporter while it sleeps
                 on its pipe instead of polling; the engine then wakes it with one byte)
  [64, ...)      the status record: seq, the figures, seq again, Adler-32
  [TICK_AT, +16) the tick, two words, each led by the same 16-bit tag: the engine's count of
                 decode steps (LoadState.decode_steps) at the step. Word 0: the step's duration
                 (µs, 24 bits) and the KV blocks in use (24 bits); word 1: the step's end
                 (monotonic µs, 48 bits). The record carries the count as of its own figures, so
                 the tick names how many steady steps past the record it is (mod 2**16).
  [RING_AT, +n)  admitted ids, each: u16 length, u32 Adler-32 (of the bytes, seeded with the entry's
                 position, so an old entry left at that place does not pass), the id's UTF-8
                 bytes; a ring whose end (bytes ever written) the record carries

Checksums are Adler-32, not CRC32: the engine thread computes one per record, on cold caches, and
CRC32's tables cost it ~100 cache misses each time (Adler-32 has none); either catches a copy
that mixes two records, which is all they are for.

Reads are lock-free: the writer rewrites the record whole (one memcpy); a reader that copied it
mid-write sees the two seqs or the checksum disagree and reads again. The checksum also covers what the
processor may show out of order on weakly ordered CPUs, so the layout needs no fences. A tick's
word is stored in one aligned 8-byte write, which no CPU shows half done; a reader that sees the
two words' tags differ reads again.

Writers: full records under the llumlet's lock, from any thread; ticks from the engine thread
alone, without it (ProcessExporter.decode_step says why that is safe).
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
import zlib
from typing import NamedTuple

from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, LoadState

MAGIC = 0x50464C48  # "PFLH"
VERSION = 2
_CONTROL = struct.Struct("<IIQ")  # magic, version, napping
RECORD_AT = 64
# seq first, then what the exporter needs beside the counters, then the counters
_HEAD_FIELDS = ("seq", "update_id", "dirty_since_ns", "ring_end", "hook_cpu_ns", "engine_cpu_ns", "decode_steps")
_BODY = struct.Struct("<" + "q" * (len(_HEAD_FIELDS) + len(COUNTER_FIELDS)))
_TAIL = struct.Struct("<qI")  # seq again, Adler-32 of the body
_SEQ = struct.Struct("<q")
RECORD_SIZE = _BODY.size + _TAIL.size
_TAIL_AT = RECORD_AT + _BODY.size
_NAPPING = struct.Struct("<Q")
_NAPPING_AT = _CONTROL.size - _NAPPING.size
TICK_AT = 512
_TICK = struct.Struct("<QQ")
_TAG_SHIFT = 48
_TAG_MASK = 0xFFFF
_MASK24 = (1 << 24) - 1
_MASK48 = (1 << 48) - 1
TICK_MAX_US = _MASK24  # a longer step, or more blocks than TICK_MAX_BLOCKS, goes as a full record
TICK_MAX_BLOCKS = _MASK24
# Steady steps a tick may lie past its record: half the tag's range, so an old tick is never
# read as a new one. The engine stores a full record at the latest this many steps after the last.
TICK_SPAN = 1 << 14
RING_AT = 1024
RING_SIZE = 1 << 20  # ~20,000 ids of 50 bytes: the exporter drains it every poll
_ENTRY = struct.Struct("<HI")
MAX_ID_BYTES = 1024  # longer ids are not handed over (a CMS reader refuses them anyway)
assert RECORD_AT + RECORD_SIZE <= TICK_AT and TICK_AT + _TICK.size <= RING_AT and TICK_AT % 8 == 0


class Record(NamedTuple):
    update_id: int
    dirty_since_ns: int  # monotonic ns of the oldest change this record carries; 0: none
    ring_end: int
    hook_cpu_ns: int  # the engine thread's accounting (profiling on), for the exporter's stats
    engine_cpu_ns: int
    decode_steps: int  # LoadState.decode_steps as of the counters
    counters: dict[str, int]


def create_region() -> tuple[int, mmap.mmap]:
    """A fresh shared region: (its fd, to hand to the exporter; the engine's mapping)."""
    size = RING_AT + RING_SIZE
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pilotfish-llumlet")  # close-on-exec: pass_fds hands it to the exporter
    else:  # not Linux: an unlinked file in RAM where there is one
        with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, size)
    region = mmap.mmap(fd, size)
    _CONTROL.pack_into(region, 0, MAGIC, VERSION, 0)
    return fd, region


def map_region(fd: int) -> mmap.mmap:
    """The exporter's mapping of the region behind `fd`; ValueError if it is not one."""
    region = mmap.mmap(fd, RING_AT + RING_SIZE)
    magic, version, _ = _CONTROL.unpack_from(region, 0)
    if (magic, version) != (MAGIC, VERSION):
        raise ValueError(f"not a llumlet hand-off region (magic {magic:#x}, version {version})")
    return region


class HandoffWriter:
    """The engine's side: `publish` the state after a change. Engine thread only, under the llumlet's lock."""

    def __init__(self, region: mmap.mmap) -> None:
        self._region = region
        self._view = memoryview(region)
        self._body = self._view[RECORD_AT : RECORD_AT + _BODY.size]
        self._tick = self._view[TICK_AT : TICK_AT + _TICK.size].cast("Q")
        self._napping = self._view[_NAPPING_AT : _NAPPING_AT + _NAPPING.size].cast("Q")
        self._seq = 0
        # LoadState.decode_steps as of the last full record: a tick goes only within TICK_SPAN of it
        self.record_decode_steps = 0
        self._ring_end = 0
        self._pushed = 0  # admitted ids handed over so far (LoadState.admitted_total)
        self._woken = 0  # the nap the engine last woke the exporter from
        self.dropped_ids = 0  # ids too long to hand over

    def publish(self, state: LoadState, dirty_since_ns: int, hook_cpu_ns: int = 0, engine_cpu_ns: int = 0) -> int:
        """Store the state's figures and its new admitted ids; returns the exporter's nap id if it is
        napping and not yet woken for it (the caller writes a byte to its pipe), else 0."""
        new = state.admitted_total - self._pushed
        if new:
            self._push_ids(state, new)
            state.trim_admitted()  # GetStatus's window (the exporter keeps its own): grows only here
        self._seq = seq = self._seq + 1
        self.record_decode_steps = state.decode_steps
        # stored in place, no bytes object between: this runs on the engine's thread
        region = self._region
        # COUNTER_FIELDS named one by one: attrgetter and a star call cost more here (a cache
        # simulation of the hooks), and test_handoff's round trip holds the order to the tuple
        _BODY.pack_into(
            region, RECORD_AT, seq, state.next_update_id(), dirty_since_ns, self._ring_end, hook_cpu_ns,
            engine_cpu_ns, state.decode_steps,
            state.step_id, state.schedulable, state.num_waiting, state.num_running, state.num_loading,
            state.num_running_prefill, state.num_running_decode, state.uncomputed_prefill_tokens,
            state.running_decode_seq_len_sum, state.used_kv_tokens, state.total_kv_tokens, state.unallocated_tokens,
            state.last_step_duration_us, state.last_step_prefill_tokens, state.last_step_decode_batch,
            state.last_step_seq_len_sum, state.num_preempted_total, state.num_migrating_out, state.num_migrating_in,
            state.num_finished_total, state.finished_output_tokens_total,
        )  # fmt: skip
        _TAIL.pack_into(region, _TAIL_AT, seq, zlib.adler32(self._body))
        return self._wake_id()

    def tick(self, decode_steps: int, duration_us: int, used_blocks: int, now_ns: int) -> int:
        """Store a steady decode step (engine thread only): LoadState.decode_steps after it, its
        duration (< TICK_MAX_US), the KV blocks in use (< TICK_MAX_BLOCKS) and its end (monotonic).
        Only for a state that a full record, within TICK_SPAN steps, and steady steps since make.
        Returns as `publish` does. Two stores and no call on the way (`_wake_id` written out): it
        runs every step."""
        tag = (decode_steps & _TAG_MASK) << _TAG_SHIFT
        tick = self._tick
        tick[0] = tag | duration_us << 24 | used_blocks
        tick[1] = tag | (now_ns // 1000) & _MASK48
        napping = self._napping[0]
        if napping and napping != self._woken:
            self._woken = napping
            return napping
        return 0

    def _wake_id(self) -> int:
        napping = self._napping[0]
        if napping and napping != self._woken:
            self._woken = napping
            return napping
        return 0

    def close(self) -> None:
        self._body.release()
        self._tick.release()
        self._napping.release()
        self._view.release()
        self._region.close()

    def _push_ids(self, state: LoadState, new: int) -> None:
        admitted = state.admitted
        view = self._view
        for i in range(max(0, len(admitted) - new), len(admitted)):
            raw = admitted[i][1].encode()
            if not raw or len(raw) > MAX_ID_BYTES:
                self.dropped_ids += 1
                continue
            entry = _ENTRY.pack(len(raw), zlib.adler32(raw, self._ring_end & 0xFFFFFFFF)) + raw
            at = self._ring_end % RING_SIZE
            first = min(len(entry), RING_SIZE - at)
            view[RING_AT + at : RING_AT + at + first] = entry[:first]
            if first < len(entry):
                view[RING_AT : RING_AT + len(entry) - first] = entry[first:]
            self._ring_end += len(entry)
        self._pushed = state.admitted_total


class Tick(NamedTuple):
    tag: int  # LoadState.decode_steps after the step, mod 2**16
    duration_us: int
    used_blocks: int
    end_ns: int  # monotonic


def steady_figures(record: Record, tick: Tick, block_size: int) -> dict[str, int] | None:
    """The counters `tick` makes of `record` (LoadState.decode_step, done `k` times since the
    record: each decode then added one token to its request); None if the tick is not past it."""
    k = (tick.tag - record.decode_steps) & _TAG_MASK
    if not 0 < k < TICK_SPAN:
        return None  # the record is as new (it carries the step already) or newer
    c = record.counters
    batch = c["num_running_decode"]
    seq_len_sum = c["running_decode_seq_len_sum"] + k * batch
    return {
        **c,
        "step_id": c["step_id"] + k,
        "running_decode_seq_len_sum": seq_len_sum,
        "used_kv_tokens": tick.used_blocks * block_size,
        "last_step_duration_us": tick.duration_us,
        "last_step_prefill_tokens": 0,
        "last_step_decode_batch": batch,
        "last_step_seq_len_sum": seq_len_sum - batch,
    }


class HandoffReader:
    """The exporter's side: the latest status when it changed, and the ids admitted since.
    `block_size`: the engine's, for the KV blocks a tick counts."""

    def __init__(self, region: mmap.mmap, block_size: int = 1) -> None:
        self._region = region
        self._block_size = block_size
        self._seq = 0  # of the full record held
        self._record: Record | None = None
        self._tick_words = (0, 0)  # the tick's, as last read
        self._tick: Tick | None = None
        self._ring_at = 0  # the ring position read up to
        self._bad_reads = 0
        self.lost_ids = 0  # overruns or unreadable stretches (not ids): the scheduler's account times those out

    def changed(self) -> bool:
        """Whether a record or a tick other than the last ones polled is there."""
        region = self._region
        return _SEQ.unpack_from(region, RECORD_AT)[0] != self._seq or _TICK.unpack_from(region, TICK_AT) != (
            self._tick_words
        )

    def poll(self) -> Record | None:
        """The status if it changed since the last poll (a torn copy is read again), else None: the
        full record, with the figures of the steady steps that its tick says followed it."""
        fresh_record = self._read_record()
        fresh_tick = self._read_tick()
        held = self._record
        if held is None or (fresh_record is None and fresh_tick is None):
            return None
        dirty = min(
            (t for t in (fresh_record and held.dirty_since_ns, fresh_tick and fresh_tick.end_ns) if t), default=0
        )
        tick = self._tick
        counters = steady_figures(held, tick, self._block_size) if tick is not None else None
        if counters is None:
            return held._replace(dirty_since_ns=dirty)
        return held._replace(dirty_since_ns=dirty, counters=counters)

    def _read_record(self) -> Record | None:
        """The full record if its seq moved and a copy reads whole (else None: read at the next poll)."""
        region = self._region
        for _ in range(100):
            if _SEQ.unpack_from(region, RECORD_AT)[0] == self._seq:
                return None
            raw = region[RECORD_AT : RECORD_AT + RECORD_SIZE]
            values = _BODY.unpack_from(raw)
            seq, crc = _TAIL.unpack_from(raw, _BODY.size)
            if seq == values[0] and crc == zlib.adler32(raw[: _BODY.size]):
                self._seq = seq
                head = len(_HEAD_FIELDS)
                self._record = Record(*values[1:head], dict(zip(COUNTER_FIELDS, values[head:], strict=True)))
                return self._record
        return None

    def _read_tick(self) -> Tick | None:
        """The tick if its words changed and carry one tag (else None)."""
        for _ in range(100):
            words = _TICK.unpack_from(self._region, TICK_AT)
            if words == self._tick_words:
                return None
            first, second = words
            if first >> _TAG_SHIFT == second >> _TAG_SHIFT:
                self._tick_words = words
                now_us = time.monotonic_ns() // 1000
                end_us = now_us - ((now_us - second) & _MASK48)  # the full time from its low 48 bits
                self._tick = Tick(first >> _TAG_SHIFT, (first >> 24) & _MASK24, first & _MASK24, end_us * 1000)
                return self._tick
        return None

    def ids_until(self, ring_end: int) -> list[str]:
        """The ids admitted between the last call and `ring_end` (a record's)."""
        start = self._ring_at
        if ring_end - start > RING_SIZE or ring_end < start:
            self.lost_ids += 1  # overrun (the exporter slept through a flood): skip to the end
            self._ring_at = ring_end
            return []
        ids: list[str] = []
        at = start
        while at < ring_end:
            head = self._read_ring(at, _ENTRY.size)
            length, crc = _ENTRY.unpack(head)
            raw = self._read_ring(at + _ENTRY.size, length)
            if (
                not 0 < length <= MAX_ID_BYTES
                or at + _ENTRY.size + length > ring_end
                or zlib.adler32(raw, at & 0xFFFFFFFF) != crc
            ):
                # not (yet) visible whole to this CPU: read again next poll; a lasting mismatch is
                # damage, skipped
                self._bad_reads += 1
                if self._bad_reads < 3:
                    break
                self.lost_ids += 1
                at = ring_end
                break
            self._bad_reads = 0
            ids.append(raw.decode(errors="replace"))
            at += _ENTRY.size + length
        self._ring_at = at
        return ids

    def _read_ring(self, at: int, n: int) -> bytes:
        pos = at % RING_SIZE
        first = min(n, RING_SIZE - pos)
        raw = self._region[RING_AT + pos : RING_AT + pos + first]
        if first < n:
            raw += self._region[RING_AT : RING_AT + n - first]
        return raw

    def set_napping(self, nap_id: int) -> None:
        _NAPPING.pack_into(self._region, _NAPPING_AT, nap_id)
