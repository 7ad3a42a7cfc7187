"""Mooncake-style trace JSONL: `timestamp`, `input_length`, `output_length`, `hash_ids`.

Each hash id stands for one block of prompt; equal ids at the start of two prompts mean a shared
prefix. The last block may be partial: `input_length` is exact. Mooncake's own traces use blocks of
512 tokens and timestamps in ms; other releases in the same shape differ in both (Alibaba's Qwen
traces: blocks of 16 tokens, timestamps in seconds), so both are read off the file:

- the block size is the largest of 512, 256, ..., 16 tokens that every record's length fits
  (k hash ids hold more than k - 1 blocks and at most k); a record no size fits is refused with its line;
- timestamps are ms when every one is a whole number, seconds when any has a fraction; arrivals count
  from the first request's.

A record without hash ids (or with an empty list) shares nothing: its prompt is one segment of its own.
Fields beyond these (a conversation id, a turn, a type) are ignored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pilotfish.simulator.traces.model import Trace, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512
# the block sizes tried, largest first: Mooncake's first, then the smaller ones engines use
BLOCK_SIZES = (512, 256, 128, 64, 32, 16)


def load_mooncake(
    path: str | Path, *, namespace: str = "mc", limit: int | None = None, block_tokens: int | None = None
) -> Trace:
    """Requests in arrival order; segment keys are `<namespace>:<hash id>`. `block_tokens` None: read off
    the file (above)."""
    rows: list[tuple[int, float, int, int, list[int]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            try:
                row = json.loads(line)
                hash_ids = [int(h) for h in row.get("hash_ids") or ()]
                rows.append((lineno, float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                             hash_ids))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {exc}") from None
    block = block_tokens or _block_tokens(rows, path)
    seconds = any(not ts.is_integer() for _, ts, _, _, _ in rows)
    out: Trace = []
    for lineno, ts, input_length, output_length, hash_ids in rows:
        try:
            out.append(_request(len(out), ts if seconds else ts / 1000.0, input_length, output_length, hash_ids,
                                block, namespace))
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {exc}") from None
    out.sort(key=lambda r: r.arrival)
    # arrivals from the first request's (a trace of absolute times would start with a long idle)
    start = out[0].arrival if out else 0.0
    if start:
        out = [dataclasses.replace(r, arrival=r.arrival - start) for r in out]
    return out


def _fits(input_length: int, hash_ids: list[int], block: int) -> bool:
    return not hash_ids or (len(hash_ids) - 1) * block < input_length <= len(hash_ids) * block


def _block_tokens(rows: list[tuple[int, float, int, int, list[int]]], path: str | Path) -> int:
    """The largest of `BLOCK_SIZES` every record fits; a ValueError naming the first record 512 does not fit
    when none does."""
    for block in BLOCK_SIZES:
        if all(_fits(length, ids, block) for _, _, length, _, ids in rows):
            return block
    lineno, _, length, _, ids = next(r for r in rows if not _fits(r[2], r[4], BLOCK_SIZES[0]))
    raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: input_length {length} does not match "
                     f"{len(ids)} blocks of {BLOCK_SIZES[0]} (and no block size of {BLOCK_SIZES[-1]}-"
                     f"{BLOCK_SIZES[0]} tokens fits every record)")


def _request(
    index: int, arrival: float, input_length: int, output_length: int, hash_ids: list[int], block: int,
    namespace: str,
) -> TraceRequest:
    if input_length < 1:
        raise ValueError(f"input_length {input_length} is not positive")
    if not hash_ids:
        segments: tuple[tuple[str, int], ...] = ((f"{namespace}:own:{index}", input_length),)
    else:
        if not _fits(input_length, hash_ids, block):
            raise ValueError(f"input_length {input_length} does not match {len(hash_ids)} blocks of {block}")
        last = input_length - (len(hash_ids) - 1) * block
        segments = tuple((f"{namespace}:{h}", block if i < len(hash_ids) - 1 else last)
                         for i, h in enumerate(hash_ids))
    return TraceRequest(
        request_id=f"{namespace}-{index}",
        arrival=arrival,
        input_length=input_length,
        output_length=max(1, output_length),
        segments=segments,
    )
