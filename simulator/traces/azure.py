"""Azure LLM inference trace CSV: `TIMESTAMP, ContextTokens, GeneratedTokens`; no prefix data,
so every prompt is its own segment and nothing is shared."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from pilotfish.simulator.traces.model import Trace, unshared_trace

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch (naive, as written); the trace has 7 fractional digits, more than
    `datetime` parses, so the fraction is read apart."""
    text = text.strip()
    whole, _, fraction = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{fraction}") if fraction else 0.0)


def load_azure(path: str | Path, *, namespace: str = "az", limit: int | None = None) -> Trace:
    """Requests in arrival order, arrivals in seconds from the first request."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        for lineno, row in enumerate(reader, 2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                rows.append((parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not an Azure trace row: {exc}") from None
    return unshared_trace(rows, namespace)
