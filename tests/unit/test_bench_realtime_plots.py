"""bench realtime's plots: through bench/report.py's pieces, one PNG per figure, or the reason for none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pilotfish.bench import report
from pilotfish.bench.realtime_report import write_plots

FAMILIES = {"pilotfish-lite": "pilotfish", "direct-rr": "baseline"}


def _run(ttft_p99: float) -> dict:
    return {"ttft": {"p50": ttft_p99 / 2, "p99": ttft_p99}}


def _inputs() -> tuple[dict, dict]:
    samples = {name: {"ttft": [0.1, 0.2], "tpot": [0.01, 0.02], "e2e": [1.0, 2.0]} for name in FAMILIES}
    runs = {str(ld): {name: [_run(ld), _run(ld * 2)] for name in FAMILIES} for ld in (1.0, 2.0)}
    return samples, runs


def test_several_loads_give_the_cdfs_and_p99_ttft_against_load(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    samples, runs = _inputs()
    plots, reason = write_plots(tmp_path, 2.0, samples, [1.0, 2.0], runs, FAMILIES)
    assert reason is None and plots == ["latency_cdf.png", "p99_ttft_vs_load.png"]
    assert all((tmp_path / p).stat().st_size > 0 for p in plots)


def test_one_load_draws_no_figure_against_load(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    samples, runs = _inputs()
    assert write_plots(tmp_path, 2.0, samples, [2.0], runs, FAMILIES) == (["latency_cdf.png"], None)


def test_without_matplotlib_no_png_and_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    samples, runs = _inputs()
    assert write_plots(tmp_path, 2.0, samples, [1.0, 2.0], runs, FAMILIES) == ([], report.NO_MATPLOTLIB)
    assert list(tmp_path.iterdir()) == []
