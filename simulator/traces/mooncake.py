"""Mooncake trace JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

Each hash id stands for one 512-token block of prompt; equal ids at the start of two prompts
mean a shared prefix. The last block may be partial: `input_length` is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

from pilotfish.simulator.traces.model import Trace, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


def load_mooncake(path: str | Path, *, namespace: str = "mc", limit: int | None = None) -> Trace:
    """Requests in arrival order; segment keys are `<namespace>:<hash id>`."""
    out: Trace = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                row = json.loads(line)
                out.append(_request(row, len(out), namespace))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {exc}") from None
    out.sort(key=lambda r: r.arrival)
    return out


def _request(row: dict, index: int, namespace: str) -> TraceRequest:
    input_length = int(row["input_length"])
    hash_ids = [int(h) for h in row["hash_ids"]]
    block = MOONCAKE_BLOCK_TOKENS
    if not hash_ids or not (len(hash_ids) - 1) * block < input_length <= len(hash_ids) * block:
        raise ValueError(f"input_length {input_length} does not match {len(hash_ids)} blocks of {block}")
    last = input_length - (len(hash_ids) - 1) * block
    segments = tuple((f"{namespace}:{h}", block if i < len(hash_ids) - 1 else last) for i, h in enumerate(hash_ids))
    return TraceRequest(
        request_id=f"{namespace}-{index}",
        arrival=float(row["timestamp"]) / 1000.0,
        input_length=input_length,
        output_length=max(1, int(row["output_length"])),
        segments=segments,
    )
