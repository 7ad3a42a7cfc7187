"""The plot pieces the benchmarks share (bench/report.py): one style per family, figures against
load, the plots section, and no PNG (with the reason) where matplotlib is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pilotfish.bench import report


def test_each_family_has_its_dash_the_oracle_is_black_and_every_arm_its_own_colour() -> None:
    plt = report.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    families = {"ours": "pilotfish", "theirs": "peer", "rr": "baseline", "best": "oracle", "odd": "other"}
    style = report.family_styles(plt, families)
    assert [style[n]["linestyle"] for n in families] == ["-", "--", ":", "-.", "-"]
    assert style["best"]["color"] == "black"
    colours = [style[n]["color"] for n in families if n != "best"]
    assert len(set(colours)) == len(colours)
    assert style["ours"]["linewidth"] > style["theirs"]["linewidth"]


def test_against_load_a_range_draws_error_bars_and_a_point_a_plain_line(tmp_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    fig, ax = plt.subplots()
    style = {"a": {}, "b": {}, "none": {}}
    points = {"a": [(1.0, 2.0, 1.5, 3.0), (2.0, 4.0, 3.0, 5.0)], "b": [(1.0, 1.0), (2.0, 3.0)], "none": []}
    report.plot_against_load(ax, points, style, "P99 TTFT (s)", log=True)
    assert len(ax.containers) == 1  # a's error bars; b is a plain line; an arm with no points is left out
    assert sorted(line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")) == ["b"]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "P99 TTFT (s)"
    assert report.save_figure(plt, fig, tmp_path / "x.png") == "x.png" and (tmp_path / "x.png").stat().st_size > 0


def test_the_plots_section_shows_each_png_or_says_why_there_is_none() -> None:
    assert report.plots_section(["a.png", "b.png"], None) == ["![a.png](a.png)", "![b.png](b.png)"]
    assert report.plots_section([], report.NO_MATPLOTLIB) == [f"None: {report.NO_MATPLOTLIB}."]


def test_without_matplotlib_reschedule_writes_no_png_and_gives_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pilotfish.bench.reschedule import write_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert report.pyplot() is None
    assert write_plots(tmp_path, {}, {}) == ([], report.NO_MATPLOTLIB)
    assert list(tmp_path.iterdir()) == []
