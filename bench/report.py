"""What every `pilotfish bench` command leaves in its `--out` folder: result.json, report.md, and the
plot pieces the benchmarks share (matplotlib on a file-only backend, one line style per policy
family, latency CDFs, a figure against load, the report's plots section)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NO_MATPLOTLIB = "matplotlib is not installed (`pip install 'pilotfish[bench]'`): no PNG plots"


def write_report(out_dir: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """Write `out_dir/result.json` (figures by name, tagged with the benchmark's name) and `out_dir/report.md`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **result}
    # default=str: a Path or a datetime in a result must not cost the whole run at the last step
    (out_dir / "result.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")


LATENCY_METRICS = (("ttft", "TTFT (s)", 1.0), ("tpot", "TPOT (ms)", 1000.0), ("e2e", "end-to-end (s)", 1.0))


def plot_latency_cdfs(
    plt: Any, samples: dict[str, dict[str, list[float]]], style: dict[str, dict[str, Any]], title: str, path: Path
) -> None:
    """One PNG, three panels (TTFT, TPOT, end to end): each arm's latency CDF on a log axis.

    `samples[arm][metric]` are seconds; `style[arm]` the matplotlib line style of each arm.
    """
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (metric, label, scale) in zip(axes, LATENCY_METRICS, strict=True):
        for name, s in samples.items():
            values = sorted(v * scale for v in s[metric])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name, **style[name])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    save_figure(plt, fig, path)


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend (files only: a benchmark has no display), or None where
    matplotlib is not installed; the caller then reports NO_MATPLOTLIB instead of plots."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, dpi: int = 110) -> str:
    """Lay out, write and close `fig` (an open figure holds its memory until closed); the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path).name


FAMILY_DASHES = {"pilotfish": "-", "peer": "--", "baseline": ":", "oracle": "-."}


def family_styles(plt: Any, families: dict[str, str], cmap: str = "tab20") -> dict[str, dict[str, Any]]:
    """A matplotlib line style per arm: a colour each (the oracle black), a dash per family so lines
    tell apart in print, Pilotfish and the oracle drawn wider. `families[arm]` names its family."""
    colours = plt.get_cmap(cmap)
    return {
        name: {
            "color": "black" if family == "oracle" else colours(i % colours.N),
            "linestyle": FAMILY_DASHES.get(family, "-"),
            "linewidth": 2.2 if family in ("pilotfish", "oracle") else 1.4,
        }
        for i, (name, family) in enumerate(families.items())
    }


def plot_against_load(
    ax: Any,
    points: dict[str, Sequence[tuple[float, float] | tuple[float, float, float, float]]],
    style: dict[str, dict[str, Any]],
    ylabel: str,
    log: bool = False,
) -> None:
    """One line per arm of a figure against load on `ax`: `points[arm]` are (load, value) or (load,
    value, low, high), the latter drawn with its range as error bars (repetitions)."""
    for name, pts in points.items():
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if all(len(p) == 4 for p in pts):
            below = [p[1] - p[2] for p in pts]  # type: ignore[misc]
            above = [p[3] - p[1] for p in pts]  # type: ignore[misc]
            ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=name, **style[name])
        else:
            ax.plot(xs, ys, marker="o", label=name, **style[name])
    ax.set_xlabel("load (time compression)")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def plots_section(plots: Sequence[str], no_plots: str | None) -> list[str]:
    """report.md's plots: each PNG inline, or the reason there are none."""
    return [f"![{p}]({p})" for p in plots] if plots else [f"None: {no_plots}."]
