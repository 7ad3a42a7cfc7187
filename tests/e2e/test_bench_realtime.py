"""pilotfish bench realtime: end to end on a tiny trace, through real Envoy and (where installed) vllm-router."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pilotfish.bench import realtime as bench
from pilotfish.bench.realtime_targets import find_executable

pytestmark = pytest.mark.integration

TINY_TRACE = "synthetic:groups=2,prompts=3,system=128,question=16,output=8,rate=20"


def _args(out: Path, targets: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    bench.add_arguments(parser)
    return parser.parse_args(
        [
            "--out",
            str(out),
            "--trace",
            TINY_TRACE,
            "--requests",
            "6",
            "--reps",
            "1",
            "--engines",
            "2",
            "--token-scale",
            "1",
            "--targets",
            ",".join(targets),
            "--request-timeout",
            "30",
            "--no-progress",
        ]
    )


def test_the_harness_runs_end_to_end_and_every_request_completes(tmp_path: Path, envoy_binary: Path) -> None:
    targets = ["direct-rr", "envoy-rr", "pilotfish-lite"]
    if find_executable("", "vllm-router")[0]:  # a peer arm only where the router is installed
        targets.append("vllm-router:round_robin")
    out = tmp_path / "out"
    assert bench.run(_args(out, targets)) == 0

    result = json.loads((out / "result.json").read_text())
    assert result["benchmark"] == "realtime"
    assert result["loads"] == [2.0] and result["reps"] == 1 and result["requests"] == 6
    assert list(result["targets"]) == targets
    runs = result["runs"]["2.0"]
    for name in targets:
        (run,) = runs[name]
        assert "error" not in run, run.get("error")
        assert run["finished"] == 6 and run["failures"] == 0, run["failure_reasons"]
        assert sum(run["engine_requests"]) == 6  # every response named the engine that served it
        assert 0 <= run["client_cpu_share"] < 1
        summary = result["summary"]["2.0"][name]
        assert summary["runs"] == 1
        for figure in ("ttft_p50", "ttft_p99", "tpot_p99", "e2e_p99", "requests_per_s"):
            assert summary[figure]["median"] > 0, (name, figure)
    assert runs["direct-rr"][0]["engine_requests"] == [3, 3]  # the client's own round-robin
    # Envoy's default pool: each worker thread keeps its own round-robin position (one worker per core), so
    # the split depends on which worker took each connection; only the pool's size is fixed
    assert len(runs["envoy-rr"][0]["engine_requests"]) == 2
    assert set(runs["envoy-rr"][0]["router_idle_cpu_ms_per_request_parts"]) == {"envoy"}
    # the idle window (on by default): as long as the replay, the same divisor, so the figures subtract
    lite = runs["pilotfish-lite"][0]
    assert set(lite["router_idle_cpu_ms_per_request_parts"]) == {"envoy", "ext_proc", "scheduler"}
    assert lite["router_net_cpu_ms_per_request"] == pytest.approx(
        lite["router_cpu_ms_per_request"] - lite["router_idle_cpu_ms_per_request"]
    )

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 6 * len(targets)
    assert all(r["error"] is None and r["ttft"] > 0 for r in records)
    report = (out / "report.md").read_text()
    assert "Where Pilotfish loses" in report and "| **pilotfish-lite** |" in report
