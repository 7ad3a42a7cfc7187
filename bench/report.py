"""The two files every `pilotfish bench` command leaves in its `--out` folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out_dir: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """Write `out_dir/result.json` (figures by name, tagged with the benchmark's name) and `out_dir/report.md`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **result}
    # default=str: a Path or a datetime in a result must not cost the whole run at the last step
    (out_dir / "result.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
