"""A trace file to a trace, by its format: JSONL is Mooncake-style (simulator/traces/mooncake.py), and a
CSV is told by its header (Azure's `TIMESTAMP, ContextTokens, GeneratedTokens` or BurstGPT's
`Timestamp, Request tokens, Response tokens, ...`)."""

from __future__ import annotations

import csv
from pathlib import Path

from pilotfish.simulator.traces.azure import COLUMNS as AZURE_COLUMNS
from pilotfish.simulator.traces.azure import load_azure
from pilotfish.simulator.traces.burstgpt import COLUMNS as BURSTGPT_COLUMNS
from pilotfish.simulator.traces.burstgpt import load_burstgpt
from pilotfish.simulator.traces.model import Trace
from pilotfish.simulator.traces.mooncake import load_mooncake


def load_trace_file(path: str | Path, limit: int | None = None) -> Trace:
    """The requests of the trace at `path` (its first `limit` records when given); a ValueError naming the
    file when its format is none of these."""
    path = Path(path)
    if path.suffix.lower() != ".csv":
        return load_mooncake(path, limit=limit)
    with open(path, newline="", encoding="utf-8") as f:
        header = {name.strip() for name in next(csv.reader(f), [])}
    if header.issuperset(AZURE_COLUMNS):
        return load_azure(path, limit=limit)
    if header.issuperset(BURSTGPT_COLUMNS):
        return load_burstgpt(path, limit=limit)
    raise ValueError(f"{path}: a CSV trace needs the columns {', '.join(AZURE_COLUMNS)} (Azure) or "
                     f"{', '.join(BURSTGPT_COLUMNS)} (BurstGPT); its header has {', '.join(sorted(header)) or 'none'}")
