"""pilotfish bench reschedule: end to end on a tiny synthetic trace, both scenarios, both arms."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pilotfish.bench import reschedule as bench


def _args(out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    bench.add_arguments(parser)
    return parser.parse_args(
        [
            "--out",
            str(out),
            "--trace",
            "synthetic:groups=3,prompts=8,system=512,question=64,output=64,rate=20",
            "--instances",
            "3",
            "--num-gpu-blocks",
            "600",
            "--max-model-len",
            "4096",
            "--load-threshold",
            "0.3",
            "--rescheduling-interval-ms",
            "100",
            "--duration",
            "0",
            "--failover-at",
            "0.2",
            "--no-progress",
        ]
    )


def test_both_scenarios_run_both_arms_and_report_integrity(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.run(_args(out)) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["benchmark"] == "reschedule"
    assert set(result["runs"]) == {"load_balance", "failover"}
    for arms in result["runs"].values():
        off, on = arms["off"], arms["on"]
        assert off["migrations"] == 0 and off["integrity"]["ok"] and on["integrity"]["ok"]
        assert off["finished"] == on["finished"] == result["requests"]
    failover = result["runs"]["failover"]["on"]
    assert failover["migrations"] > 0 and failover["failover"]["drain_seconds"] is not None
    assert failover["failover"]["dispatched_after_mark"] == 0
    report = (out / "report.md").read_text()
    assert "Rescheduling off vs on" in report and "token integrity" in report
