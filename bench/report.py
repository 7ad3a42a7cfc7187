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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
