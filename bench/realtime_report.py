"""Figures, tables, verdicts and plots of `pilotfish bench realtime`, all computed from result.json's runs.

A target's figure is the median over its repetitions, with the spread (min-max) beside it; the
verdicts compare medians and say whether the ranges overlap, so a difference inside the noise of
a shared machine is called that.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pilotfish.bench.report import (
    NO_MATPLOTLIB,
    family_styles,
    plot_against_load,
    plot_latency_cdfs,
    plots_section,
    pyplot,
    save_figure,
)

# figure -> (path in a run summary, scale, label, lower is better)
FIGURES: dict[str, tuple[tuple[str, ...], float, str, bool]] = {
    "ttft_p50": (("ttft", "p50"), 1.0, "P50 TTFT s", True),
    "ttft_p99": (("ttft", "p99"), 1.0, "P99 TTFT s", True),
    "tpot_p50": (("tpot", "p50"), 1000.0, "P50 TPOT ms", True),
    "tpot_p99": (("tpot", "p99"), 1000.0, "P99 TPOT ms", True),
    "e2e_p99": (("e2e", "p99"), 1.0, "P99 E2E s", True),
    "requests_per_s": (("requests_per_s",), 1.0, "req/s", False),
    "output_tokens_per_s": (("output_tokens_per_s",), 1.0, "out tok/s", False),
    "failures": (("failures",), 1.0, "failed", True),
    "client_cpu_share": (("client_cpu_share",), 1.0, "client CPU", True),
    "router_cpu_seconds": (("router_cpu_seconds",), 1.0, "router CPU s", True),
    "router_cpu_ms_per_request": (("router_cpu_ms_per_request",), 1.0, "router CPU ms/req", True),
    # --idle-window: the same per-request divisor over an idle window as long as the replay, and the difference
    "router_idle_cpu_ms_per_request": (("router_idle_cpu_ms_per_request",), 1.0, "idle CPU ms/req", True),
    "router_net_cpu_ms_per_request": (("router_net_cpu_ms_per_request",), 1.0, "net CPU ms/req", True),
}
TABLE = (
    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p99", "requests_per_s", "failures",
    "router_cpu_ms_per_request", "router_idle_cpu_ms_per_request", "router_net_cpu_ms_per_request",
)  # fmt: skip
VERDICT = ("ttft_p50", "ttft_p99", "tpot_p99", "e2e_p99", "failures", "router_cpu_seconds")


def run_summary(records: Sequence[Any], engines: int) -> dict[str, Any]:
    """One run's latency distributions (seconds), throughput, failures and the requests each engine served."""
    from pilotfish.simulator.cluster.metrics import summarize

    s = summarize(records)
    reasons = Counter(r.finish_reason for r in records if r.finished is None)
    served = Counter(r.engine for r in records)
    return {
        "finished": s["finished"],
        "failures": len(records) - s["finished"],
        "failure_reasons": dict(reasons.most_common(3)),
        "ttft": s["ttft"],
        "tpot": s["tpot"],
        "e2e": s["e2e"],
        "requests_per_s": s.get("requests_per_s", math.nan),
        "output_tokens_per_s": s.get("output_tokens_per_s", math.nan),
        "engine_requests": [served.get(i, 0) for i in range(engines)] + ([served[-1]] if served.get(-1) else []),
    }


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = run
    for key in path:
        value = value.get(key, math.nan) if isinstance(value, dict) else math.nan
    return float(value) if value is not None else math.nan


def aggregate(per_target: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per target: each figure's median, min, max and per-repetition values, over the runs that ran."""
    out: dict[str, dict[str, Any]] = {}
    for name, runs in per_target.items():
        ok = [r for r in runs if "error" not in r]
        entry: dict[str, Any] = {"runs": len(ok), "run_errors": [r["error"] for r in runs if "error" in r]}
        for figure, (path, scale, _, _) in FIGURES.items():
            values = [v * scale for r in ok if not math.isnan(v := _get(r, path))]
            entry[figure] = (
                {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}
                if values
                else None
            )
        out[name] = entry
    return out


def _fmt(value: float, figure: str) -> str:
    if figure == "failures":
        return f"{value:g}"
    if figure == "client_cpu_share":
        return f"{value:.0%}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _cell(entry: dict[str, Any] | None, figure: str) -> str:
    if not entry:
        return "-"
    med, lo, hi = entry["median"], entry["min"], entry["max"]
    if lo == hi:
        return _fmt(med, figure)
    return f"{_fmt(med, figure)} ({_fmt(lo, figure)}-{_fmt(hi, figure)})"


def table(summary: dict[str, dict[str, Any]], families: dict[str, str]) -> list[str]:
    head = "| target | " + " | ".join(FIGURES[f][2] for f in TABLE) + " | runs |"
    lines = [head, "|---|" + "---:|" * (len(TABLE) + 1)]
    for name, entry in summary.items():
        label = f"**{name}**" if families.get(name) == "pilotfish" else name
        lines.append(f"| {label} | " + " | ".join(_cell(entry[f], f) for f in TABLE) + f" | {entry['runs']} |")
    return lines


def losses(summary: dict[str, dict[str, Any]], families: dict[str, str]) -> list[str]:
    """Every figure where a non-Pilotfish target has a better median than a Pilotfish target, said plainly."""
    lines: list[str] = []
    others = [n for n in summary if families.get(n) != "pilotfish"]
    for name in (n for n in summary if families.get(n) == "pilotfish"):
        mine = summary[name]
        if not mine["runs"]:
            lines.append(f"- `{name}` did not run: {'; '.join(mine['run_errors'])[:300]}")
            continue
        found = []
        for figure in VERDICT:
            label, lower = FIGURES[figure][2], FIGURES[figure][3]
            m = mine[figure]
            if m is None:
                continue
            beaten = []
            for other in others:
                if figure == "router_cpu_seconds" and families.get(other) != "peer":
                    continue  # no router uses no CPU: only a peer router is a fair comparison
                o = summary[other][figure]
                if o is None or not (o["median"] < m["median"] if lower else o["median"] > m["median"]):
                    continue
                if min(len(o["values"]), len(m["values"])) < 2:
                    spread = " (one run: no spread to judge it by)"
                elif o["max"] < m["min"] if lower else o["min"] > m["max"]:
                    spread = " (ranges apart)"
                else:
                    spread = " (ranges overlap: within run-to-run spread)"
                delta = f", {o['median'] / m['median'] - 1:+.0%}" if m["median"] else ""
                beaten.append(f"`{other}` {_fmt(o['median'], figure)} vs {_fmt(m['median'], figure)}{delta}{spread}")
            if beaten:
                found.append(f"  - {label}: " + "; ".join(beaten))
        if found:
            lines.append(f"- `{name}` loses on:")
            lines += found
        else:
            lines.append(
                f"- `{name}`: no other target has a better median on " + ", ".join(FIGURES[f][2] for f in VERDICT) + "."
            )
    return lines


def cpu_ratios(summary: dict[str, dict[str, Any]], families: dict[str, str]) -> list[str]:
    """Each Pilotfish target's router-side CPU per request against each real router's (medians): over
    the replay, and net of the idle window where both have one."""
    lines: list[str] = []
    peers = [n for n in summary if families.get(n) == "peer" and summary[n].get("router_cpu_ms_per_request")]
    for name in (n for n in summary if families.get(n) == "pilotfish"):
        mine = summary[name].get("router_cpu_ms_per_request")
        if not mine:
            continue
        for peer in peers:
            theirs = summary[peer]["router_cpu_ms_per_request"]["median"]
            if not theirs:
                continue
            ratio = mine["median"] / theirs
            line = f"- `{name}` / `{peer}`: {ratio:.1f}x ({mine['median']:.3g} against {theirs:.3g} ms per request)"
            mine_net, theirs_net = (
                summary[name].get("router_net_cpu_ms_per_request"),
                summary[peer].get("router_net_cpu_ms_per_request"),
            )
            if mine_net and theirs_net and theirs_net["median"] > 0:
                line += (
                    f"; net of the idle window {mine_net['median'] / theirs_net['median']:.1f}x "
                    f"({mine_net['median']:.3g} against {theirs_net['median']:.3g})"
                )
            lines.append(line)
    return lines


def cpu_parts(per_target: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Median router-side CPU per request of each component, for the targets that report them; with
    --idle-window, each component's idle-window share beside it."""
    lines: list[str] = []
    for name, runs in per_target.items():
        parts = [r["router_cpu_ms_per_request_parts"] for r in runs if r.get("router_cpu_ms_per_request_parts")]
        if not parts:
            continue
        idle = [
            r["router_idle_cpu_ms_per_request_parts"] for r in runs if r.get("router_idle_cpu_ms_per_request_parts")
        ]
        cells = []
        for part in parts[0]:
            cell = f"{part} {statistics.median(p[part] for p in parts):.3g}"
            if idle:
                cell += f" (idle {statistics.median(p[part] for p in idle):.3g})"
            cells.append(cell)
        lines.append(f"- `{name}`: {', '.join(cells)} ms per request")
    return lines


def best(summary: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for figure in VERDICT[:-2]:
        ranked = sorted((e[figure]["median"], n) for n, e in summary.items() if e[figure] is not None)
        if ranked:
            value, name = ranked[0]
            lines.append(f"- best {FIGURES[figure][2]}: `{name}` ({_fmt(value, figure)})")
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone."""
    families = {n: t["family"] for n, t in result["targets"].items()}
    loads = result["loads"]
    runs = result["runs"]
    all_runs = [r for ld in loads for target_runs in runs[str(ld)].values() for r in target_runs if "error" not in r]
    cpu = [r["client_cpu_share"] for r in all_runs]
    load_avg = [r["load_avg_1m"] for ld in loads for rs in runs[str(ld)].values() for r in rs]
    machine = result["machine"]
    md = [
        "# Real time, against peer routers",
        "",
        f"Trace `{result['trace']}`, requests {result['skip']}..{result['skip'] + result['requests'] - 1} "
        f"({result['requests']} requests over {result['span_seconds_at_load_1']:.0f} s at load 1), prompts scaled by "
        f"{result['token_scale']:g} (mean {result['mean_prompt_tokens']:.0f} prompt and "
        f"{result['mean_output_tokens']:.0f} output tokens); {result['engines']} simulated engines "
        f"(`pilotfish sim serve {' '.join(result['engine_args'])}`) started fresh for every run; loads "
        f"{', '.join(f'{x:g}' for x in loads)} (time compression); {result['reps']} repetitions, the target order "
        f"rotated each time. Every target got the same requests at the same times from one client. "
        f"Figures are medians over the repetitions, (min-max) beside them. Wall time "
        f"{result['wall_seconds'] / 60:.1f} min on {machine['cpus']} CPUs ({machine['host']}, Python "
        f"{machine['python']}).",
        "",
        f"Command: `{result['command']}`" if result.get("command") else "",
        "",
        "`router CPU s`: CPU seconds the router side used over one replay (Pilotfish: Envoy + ext_proc + "
        "scheduler; a peer: its router process; direct-rr: nothing; every thread's run time in ns from "
        "/proc/<pid>/task/*/schedstat), on the same cores as the engines and client. "
        "`idle CPU ms/req` (with --idle-window): the same processes over an idle window as long as the replay, "
        "right after it, divided by the same request count; `net CPU ms/req`: the replay's less that, the cost "
        "of the requests themselves.",
        "",
        "Targets (nothing tuned per target; every router on its own defaults):",
        "",
        *[f"- `{n}` ({t['family']}): {t['description']}" for n, t in result["targets"].items()],
        *[f"- skipped: {line}" for line in result["skipped"]],
        "",
    ]
    for load in loads:
        summary = result["summary"][str(load)]
        md += [f"## Load {load:g}", "", *table(summary, families), ""]
        errors = [
            f"- `{n}`: {len(e['run_errors'])} run(s) did not run: {e['run_errors'][0][:300]}"
            for n, e in summary.items()
            if e["run_errors"]
        ]
        md += [*errors, *([""] if errors else [])]
        md += [
            "Best medians:",
            "",
            *best(summary),
            "",
            "Where Pilotfish loses (medians; a Pilotfish target against every other target):",
            "",
            *losses(summary, families),
            "",
        ]
        ratios = cpu_ratios(summary, families)
        if ratios:
            md += ["Router-side CPU per request against each real router (medians):", "", *ratios, ""]
        parts = cpu_parts(result.get("runs", {}).get(str(load), {}))
        if parts:
            md += ["Router-side CPU per request by component (medians):", "", *parts, ""]
    md += _agreement_section(result)
    md += [
        "## The client and the machine",
        "",
        (
            f"Client CPU (its process time over the replay's wall time): at most {max(cpu):.0%} of one core, "
            f"median {statistics.median(cpu):.0%}: the client was not the bottleneck."
            if cpu and max(cpu) < 0.7
            else f"Client CPU at most {max(cpu):.0%} of one core: the client may have limited some runs."
            if cpu
            else "No run finished."
        ),
        f"1-minute load average at the start of the runs: {min(load_avg):.1f}-{max(load_avg):.1f} on "
        f"{machine['cpus']} CPUs: the engines, routers and client share the machine (with whatever else ran on it), "
        "so a router's own CPU cost shows in everyone's latency; differences inside the (min-max) spread are noise."
        if load_avg
        else "",
        "",
        "## Plots",
        "",
    ]
    md += plots_section(result["plots"], result.get("no_plots"))
    md += ["", "Per-request records (every repetition and target): `records.jsonl`."]
    return "\n".join(md)


def write_plots(
    out_dir: Path,
    load: float,
    samples: dict[str, dict[str, list[float]]],
    loads: Sequence[float],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    families: dict[str, str],
) -> tuple[list[str], str | None]:
    """latency_cdf.png (pooled over repetitions at `load`) and, with several loads, p99_ttft_vs_load.png."""
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    # a strong colour each (tab10 covers every target) and a dash per family, so lines tell apart in print
    style = family_styles(plt, families, cmap="tab10")
    title = f"Latency CDFs per target, load {load:g}, all repetitions pooled"
    plot_latency_cdfs(plt, samples, style, title, out_dir / "latency_cdf.png")
    written = ["latency_cdf.png"]
    if len(loads) > 1:
        fig, ax = plt.subplots(figsize=(8, 4.8))
        plot_against_load(
            ax, _p99_ttft_points(families, loads, runs), style, "P99 TTFT (s), median and min-max over repetitions",
            log=True,
        )  # fmt: skip
        ax.legend(fontsize=8)
        written.append(save_figure(plt, fig, out_dir / "p99_ttft_vs_load.png"))
    return written, None


def _p99_ttft_points(
    families: dict[str, str], loads: Sequence[float], runs: dict[str, dict[str, list[dict[str, Any]]]]
) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per target: (load, median, min, max) of P99 TTFT over its repetitions, at each load it ran."""
    points: dict[str, list[tuple[float, float, float, float]]] = {}
    for name in families:
        points[name] = []
        for ld in loads:
            entry = aggregate({name: runs[str(ld)][name]})[name]["ttft_p99"]
            if entry:
                points[name].append((ld, entry["median"], entry["min"], entry["max"]))
    return points


def _agreement_section(result: dict[str, Any]) -> list[str]:
    """`--agreement`: the reproductions' choices against the real routers', per load and repetition."""
    from pilotfish.bench.realtime_agreement import markdown

    rows: dict[str, dict[str, Any]] = {}
    for load in result["loads"]:
        for name, runs in result["runs"][str(load)].items():
            for run in runs:
                if "agreement" in run:
                    label = (
                        name
                        if len(result["loads"]) == 1 and result["reps"] == 1
                        else f"{name} (load {load:g}, rep {run['rep'] + 1})"
                    )
                    rows[label] = run["agreement"]
    return markdown(rows)
