"""`scripts/status_cost.py`, the command behind the README's running-scheduler figures, runs against a real
Redis and reports both re-key modes (its figures are benchmarks, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "status_cost.py"


def test_it_reports_statuses_and_schedules_in_both_modes(redis_binary: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--engines", "16", "--seconds", "1", "--reps", "1", "--decisions", "10",
         "--json", str(out)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert sorted(row["rekey"] for row in rows) == ["idle", "lazy"]
    for row in rows:
        assert row["engines"] == 16
        assert row["statuses_per_s"] > 0 and row["schedules"] >= 5
        assert 0 < row["schedule_cpu_p50_us"] <= row["schedule_cpu_p99_us"]
