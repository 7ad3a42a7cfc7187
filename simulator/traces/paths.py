"""Where the shared traces live: `../shared/traces` beside the repository, found from the working
directory or from this package (whichever is inside the checkout), or named by flag or
`PILOTFISH_TRACE_DIR`. Traces are read in place, never copied into the repository."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PILOTFISH_TRACE_DIR"


def _candidates() -> list[Path]:
    out: list[Path] = []
    if os.environ.get(ENV):
        out.append(Path(os.environ[ENV]))
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for ancestor in (start, *start.parents):
            out.append(ancestor / "shared" / "traces")
    return out


def default_trace_dir() -> Path | None:
    for candidate in _candidates():
        if candidate.is_dir():
            return candidate
    return None


def resolve_trace(name_or_path: str | Path, trace_dir: str | Path | None = None) -> Path:
    """A trace file: an existing path as given, else `name` in `trace_dir` or the default folder."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    folders = [Path(trace_dir)] if trace_dir else [c for c in _candidates() if c.is_dir()][:1]
    for folder in folders:
        if (folder / path).is_file():
            return folder / path
    where = ", ".join(str(f) for f in folders) or "no trace folder found (set --trace-dir or $" + ENV + ")"
    raise FileNotFoundError(f"trace {str(name_or_path)!r} not found (looked in {where})")
