"""The report of `pilotfish bench cluster`: per-policy metrics, the markdown tables, the conclusions
drawn from the numbers (never written by hand), and the PNG plots when matplotlib is there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pilotfish.bench.report import (
    NO_MATPLOTLIB,
    family_styles,
    plot_against_load,
    plot_latency_cdfs,
    pyplot,
    save_figure,
)
from pilotfish.simulator.cluster import ClusterResult


def policy_metrics(result: ClusterResult, requests: int, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """What the report shows for one run: latency percentiles, goodput at the SLO, cache hits, throughput."""
    s = result.summary()
    done = [r for r in result.records if r.finished is not None]
    good = sum(1 for r in done if r.ttft is not None and r.ttft <= slo_ttft
               and (r.tpot is None or r.tpot <= slo_tpot))
    # per second of arrivals: the same denominator for every policy at one load, so goodput ranks as
    # SLO attainment does (a policy that finishes late is not rewarded with a longer span)
    arrivals = [r.arrival for r in result.records]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else math.nan
    return {
        "requests": requests,
        "routed": len(result.records),
        "finished": len(done),
        "rejected": len(result.rejected),
        "ttft": s["ttft"], "tpot": s["tpot"], "e2e": s["e2e"], "queueing": s["queueing"],
        "goodput_rps": good / span if span and span > 0 else math.nan,
        "slo_attainment": good / requests if requests else math.nan,
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "output_tokens_per_s": s.get("output_tokens_per_s", math.nan),
        "requests_per_s": s.get("requests_per_s", math.nan),
        "preemptions": s["preemptions"],
        # from the records: every move counts on its request, and a request may move more than once
        "migrations": sum(r.migrations for r in result.records),
        "migrated_requests": sum(1 for r in result.records if r.migrations),
        "integrity_errors": len(result.integrity_errors),
        "engine_steps": result.steps,
        "virtual_seconds": result.virtual_seconds,
        "wall_seconds": result.wall_seconds,
    }


def latency_samples(result: ClusterResult) -> dict[str, list[float]]:
    done = [r for r in result.records if r.finished is not None]
    return {name: [v for r in done if (v := getattr(r, name)) is not None] for name in ("ttft", "tpot", "e2e")}


# ---- markdown ---------------------------------------------------------------------------------------------


def _ppp(d: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(f"{d[q] * scale:.{digits}f}" for q in ("p50", "p90", "p99"))


def table(runs: dict[str, dict[str, Any]], families: dict[str, str]) -> list[str]:
    lines = [
        "| policy | kind | TTFT p50 / p90 / p99 s | TPOT p50 / p90 / p99 ms | e2e p50 / p90 / p99 s | "
        "goodput req/s (SLO met) | cache hit | out tok/s | preempt | migr |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in runs.items():
        kind = families.get(name, "")
        lines.append(
            f"| {name} | {kind} | {_ppp(m['ttft'])} | {_ppp(m['tpot'], 1000, 1)} | {_ppp(m['e2e'])} | "
            f"{m['goodput_rps']:.2f} ({m['slo_attainment']:.0%}) | {m['prefix_cache_hit_rate']:.1%} | "
            f"{m['output_tokens_per_s']:.0f} | {m['preemptions']} | {m['migrations']} |")
    return lines


def _rank_key(m: dict[str, Any]) -> tuple[float, float]:
    # more requests within the SLO first, then the lower P99 TTFT
    return (-_num(m["slo_attainment"]), _num(m["ttft"]["p99"], math.inf))


def _num(x: float, nan_as: float = 0.0) -> float:
    return nan_as if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _pct(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{(a - b) / b:+.0%}"


def conclusions(load: float, runs: dict[str, dict[str, Any]], families: dict[str, str]) -> list[str]:
    """Sentences computed from the figures: who wins, where Pilotfish wins or loses, and the oracle's gap."""
    out: list[str] = []
    contenders = {n: m for n, m in runs.items() if families.get(n) != "oracle"}
    if not contenders:
        return out
    ours = {n: m for n, m in contenders.items() if families.get(n) == "pilotfish"}
    others = {n: m for n, m in contenders.items() if families.get(n) != "pilotfish"}
    best = min(contenders, key=lambda n: _rank_key(contenders[n]))
    out.append(f"- Load {load:g}: best by goodput (then P99 TTFT) is **{best}** "
               f"({contenders[best]['goodput_rps']:.2f} req/s, P99 TTFT {contenders[best]['ttft']['p99']:.2f} s).")
    if ours and others:
        mine = min(ours, key=lambda n: _rank_key(ours[n]))
        peer = min(others, key=lambda n: _rank_key(others[n]))
        m, p = ours[mine], others[peer]
        verdict = "wins" if _rank_key(m) < _rank_key(p) else ("ties" if _rank_key(m) == _rank_key(p) else "LOSES")
        out.append(
            f"- Load {load:g}: Pilotfish's best ({mine}) {verdict} against the best other policy ({peer}): "
            f"goodput {m['goodput_rps']:.2f} vs {p['goodput_rps']:.2f} req/s, "
            f"P99 TTFT {m['ttft']['p99']:.2f} vs {p['ttft']['p99']:.2f} s "
            f"({_pct(m['ttft']['p99'], p['ttft']['p99'])}), "
            f"P99 TPOT {m['tpot']['p99'] * 1000:.1f} vs {p['tpot']['p99'] * 1000:.1f} ms, "
            f"cache hit {m['prefix_cache_hit_rate']:.1%} vs {p['prefix_cache_hit_rate']:.1%}.")
        for metric, label in (("ttft", "P99 TTFT"), ("tpot", "P99 TPOT"), ("e2e", "P99 e2e")):
            def p99(n: str, metric: str = metric) -> float:
                return _num(contenders[n][metric]["p99"], math.inf)

            bp, bo = min(ours, key=p99), min(others, key=p99)
            word = "wins" if p99(bp) < p99(bo) else ("ties" if p99(bp) == p99(bo) else "LOSES")
            out.append(f"- Load {load:g}: Pilotfish {word} on {label}: its best, {bp}, {p99(bp):.3f} s; "
                       f"the best other, {bo}, {p99(bo):.3f} s ({_pct(p99(bp), p99(bo))}).")
    oracle = [n for n in runs if families.get(n) == "oracle"]
    for o in oracle:
        om = runs[o]
        beaters = [n for n, m in contenders.items() if _rank_key(m) < _rank_key(om)]
        if beaters:
            out.append(f"- Load {load:g}: the oracle (greedy, perfect knowledge) is beaten by {', '.join(beaters)}: "
                       "its one-request-at-a-time TTFT estimate is not a bound on these runs.")
        else:
            gap = {n: _pct(m["ttft"]["p99"], om["ttft"]["p99"]) for n, m in ours.items()}
            if gap:
                out.append(f"- Load {load:g}: oracle P99 TTFT {om['ttft']['p99']:.2f} s, goodput "
                           f"{om['goodput_rps']:.2f} req/s; Pilotfish's P99 TTFT against it: "
                           + ", ".join(f"{n} {g}" for n, g in gap.items()) + ".")
    same: list[str] = []
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if all(runs[a][k] == runs[b][k] for k in ("ttft", "tpot", "e2e", "prefix_cache_hit_rate")):
                same.append(f"{a} = {b}")
    if same:
        out.append(f"- Load {load:g}: identical figures (the same decisions): {'; '.join(same)}.")
    unserved = [n for n, m in runs.items() if m["finished"] != m["requests"] - m["rejected"]]
    if unserved:
        out.append(f"- Not every request finished under: {', '.join(unserved)}.")
    return out


def matrix(runs: dict[str, dict[str, Any]], toggled_from: dict[str, str | None]) -> list[str]:
    """One row per feature arm that ran with the policy it toggles: its figures, the change against
    that policy, and whether the feature helped (by SLO met, then P99 TTFT) or hurt."""
    rows = [(n, b) for n, b in toggled_from.items() if b is not None and n in runs and b in runs]
    if not rows:
        return []
    lines = ["| arm | against | goodput req/s (SLO met) | TTFT p50 / p99 s | TPOT p99 ms | e2e p99 s | cache hit | "
             "preempt | migr (requests) | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, base in rows:
        m, b = runs[name], runs[base]
        # the change in SLO met goes with the verdict, so a worse by a request or two reads as such
        points = (_num(m["slo_attainment"]) - _num(b["slo_attainment"])) * 100
        if all(m[k] == b[k] for k in ("ttft", "tpot", "e2e", "prefix_cache_hit_rate")):
            verdict = "no change (the same decisions)"
        elif _rank_key(m) < _rank_key(b):
            verdict = f"better ({points:+.1f} points SLO met)"
        elif _rank_key(m) == _rank_key(b):
            verdict = "ties"
        else:
            verdict = f"**WORSE** ({points:+.1f} points SLO met)"
        lines.append(
            f"| {name} | {base} | {m['goodput_rps']:.2f} ({m['slo_attainment']:.1%}; was {b['slo_attainment']:.1%}) | "
            f"{m['ttft']['p50']:.2f} / {m['ttft']['p99']:.2f} ({_pct(m['ttft']['p99'], b['ttft']['p99'])}) | "
            f"{m['tpot']['p99'] * 1000:.1f} ({_pct(m['tpot']['p99'], b['tpot']['p99'])}) | "
            f"{m['e2e']['p99']:.2f} ({_pct(m['e2e']['p99'], b['e2e']['p99'])}) | "
            f"{m['prefix_cache_hit_rate']:.1%} (was {b['prefix_cache_hit_rate']:.1%}) | "
            f"{m['preemptions']} (was {b['preemptions']}) | {m['migrations']} ({m.get('migrated_requests', 0)}) | "
            f"{verdict} |")
    return lines


def knee(loads: Sequence[float], sweep: dict[str, dict[str, dict[str, Any]]], slo_ttft: float,
         order: Sequence[str] = ()) -> list[str]:
    """Per policy: SLO attainment per load, the highest load that keeps it within 10 points of the
    lightest load's (the knee), and the highest load whose P99 TTFT meets the TTFT SLO. A policy run
    at one load only (a feature arm) is listed at that load. `order`: the policies' order (default: as run)."""
    lines = ["| policy | SLO met per load | knee: highest load within 10 points of the lightest | "
             "highest load with P99 TTFT <= SLO |", "|---|---|---|---|"]
    for name in _names(sweep, order):
        ran = [ld for ld in loads if name in sweep[str(ld)]]
        met = [_num(sweep[str(ld)][name]["slo_attainment"]) for ld in ran]
        # the knee is where it first falls off: loads after a drop do not count even if they recover
        knee_load = ran[0]
        for ld, m in zip(ran, met, strict=True):
            if m < met[0] - 0.10:
                break
            knee_load = ld
        knee_text = f"{knee_load:g}" if len(ran) > 1 else "n/a (one load)"
        within = [ld for ld in ran if _num(sweep[str(ld)][name]["ttft"]["p99"], math.inf) <= slo_ttft]
        per_load = ", ".join(f"{ld:g}: {m:.0%}" for ld, m in zip(ran, met, strict=True))
        p99_ok = f"{max(within):g}" if within else "none tried"
        lines.append(f"| {name} | {per_load} | {knee_text} | {p99_ok} |")
    return lines


def _names(sweep: dict[str, dict[str, dict[str, Any]]], order: Sequence[str] = ()) -> list[str]:
    """Every policy that ran at any load, in `order` first, then in the order they ran."""
    ran = dict.fromkeys(name for runs in sweep.values() for name in runs)
    return [n for n in order if n in ran] + [n for n in ran if n not in order]


# ---- plots ------------------------------------------------------------------------------------------------


def write_plots(out_dir: Path, load: float, samples: dict[str, dict[str, list[float]]],
                loads: Sequence[float], sweep: dict[str, dict[str, dict[str, Any]]],
                families: dict[str, str]) -> tuple[list[str], str | None]:
    """PNG files written (names), or the reason none were (matplotlib missing)."""
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    style = family_styles(plt, families)
    plot_latency_cdfs(plt, samples, style, f"Latency CDFs per policy, load {load:g}", out_dir / "latency_cdf.png")
    written = ["latency_cdf.png"]
    if len(loads) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        # a feature arm may run at one load only: each policy's points are the loads it ran at
        ran = {name: [ld for ld in loads if name in sweep[str(ld)]] for name in _names(sweep, list(families))}
        for ax, (key, label, log) in zip(axes, (("p99_ttft", "P99 TTFT (s)", True),
                                                 ("goodput_rps", "goodput (req/s within SLO)", False)), strict=True):
            points = {name: [(ld, _figure(sweep[str(ld)][name], key)) for ld in lds] for name, lds in ran.items()}
            plot_against_load(ax, points, style, label, log=log)
        axes[0].legend(fontsize=8)
        written.append(save_figure(plt, fig, out_dir / "p99_ttft_vs_load.png"))
    return written, None


def _figure(m: dict[str, Any], key: str) -> float:
    return m["ttft"]["p99"] if key == "p99_ttft" else m[key]
