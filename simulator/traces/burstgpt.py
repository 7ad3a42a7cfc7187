"""BurstGPT trace CSV: `Timestamp` (seconds), `Model`, `Request tokens`, `Response tokens`, `Total tokens`,
`Log Type`; no prefix data, so every prompt is its own segment and nothing is shared.

The release's files with failures keep them as rows of 0 response tokens: those requests never ran, so
they are left out (the `without_fails` files have none). Every model's rows are kept, as one fleet serves
them here.
"""

from __future__ import annotations

import csv
from pathlib import Path

from pilotfish.simulator.traces.model import Trace, unshared_trace

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def load_burstgpt(path: str | Path, *, namespace: str = "bg", limit: int | None = None) -> Trace:
    """Requests in arrival order, arrivals in seconds from the first request; failed rows left out."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.DictReader(f, skipinitialspace=True), 2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                at, prompt, answer = float(row["Timestamp"]), int(row["Request tokens"]), int(row["Response tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a BurstGPT trace row: {exc}") from None
            if answer > 0:
                rows.append((at, prompt, answer))
    return unshared_trace(rows, namespace)
