"""The soak of `pilotfish bench faults`: what it samples besides RSS, and the rule that calls its
memory flat.

Sampled every `rss_interval_seconds`: each process's VmRSS, RssAnon (its heap and stacks), RssFile
(file pages such as its code, touched for the first time or read back in) and AnonHugePages;
Envoy's own allocator figures from its admin endpoint (/memory: `allocated`, the bytes live in
tcmalloc; `heap_size`, what tcmalloc holds from the OS; `pageheap_free`, free pages it keeps
mapped, so resident but not live; the thread caches) and its `downstream_rq_active`; and the load
generator's requests outstanding. The Python processes' /metrics serve their own registries
without the process/gc collectors, so nothing cheap tells their live memory from what pymalloc
retains: RssAnon is what is shown for them.

The rule (`memory_verdict`). RSS is a high-water mark: an allocator keeps what a burst of
concurrent streams made it take (tcmalloc's page heap, pymalloc's arenas), so a one-time step is
what a burst leaves, not a leak. A leak keeps growing at a steady load. So:

- leak: the least-squares slope of RSS over the second half of the soak after the warm-up,
  extrapolated to an hour, is above `soak_leak_pct_per_hour` percent of the process's level plus
  `soak_leak_mib_per_hour` MiB;
- and Envoy's live bytes (not its RSS) must come back: their median over the last
  `soak_live_window_seconds` within `soak_live_return_pct` percent plus 1 MiB of their median over
  the first window after the warm-up (a step in RSS with live bytes back is memory tcmalloc holds
  free; live bytes that stay up are memory Envoy still uses).

The old rule (whole-run growth at most `memory_flat_pct` percent plus 1 MiB) is reported beside
it; it does not decide. Each process's largest rise within `soak_step_window_seconds` is set
against the client's in-flight peak around it, so the report says with numbers whether a step
coincides with a burst.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

ENVOY = "envoy"
MIB = 1024 * 1024
# the admin's /stats filter is a regular expression: Envoy's allocator figures, every HTTP
# connection manager's active requests and connections (the admin's own dropped when read) and
# every cluster's open connections: an idle connection a burst opened holds live bytes until the
# pool's idle timeout
ENVOY_STATS_FILTER = r"^server\.memory_|^http\..*\.downstream_(rq|cx)_active$|^cluster\..*\.upstream_cx_active$"
ENVOY_ACTIVE_SUFFIXES = {
    ".downstream_rq_active": "rq_active",
    ".downstream_cx_active": "downstream_cx",
    ".upstream_cx_active": "upstream_cx",
}
ENVOY_MEMORY_KEYS = {
    "server.memory_allocated": "allocated",
    "server.memory_heap_size": "heap_size",
    "server.memory_physical_size": "physical_size",
}

Series = Sequence[tuple[float, float]]


# ---------------------------------------------------------------------------------------------- sample


def envoy_memory(admin_port: int) -> dict[str, float]:
    """Envoy's allocator figures (bytes) and its downstream requests in flight (`rq_active`, the
    admin listener's own left out); {} when the admin does not answer. The server.memory_* gauges
    change only at a stats flush (every 5 s), so /memory, read now, overrides them."""
    from urllib.parse import quote

    from pilotfish.services import http_call

    out: dict[str, float] = {}
    try:
        status, body = http_call(f"http://127.0.0.1:{admin_port}/stats?filter={quote(ENVOY_STATS_FILTER)}")
        if status == 200:
            out |= parse_envoy_stats(body.decode())
        status, body = http_call(f"http://127.0.0.1:{admin_port}/memory")
        if status == 200:
            out |= parse_envoy_memory(body.decode())
    except OSError:
        pass
    return out


# /memory's fields (admin.v3.Memory: uint64 as JSON strings), by the names the samples use
ENVOY_MEMORY_JSON = {
    "allocated": "allocated",
    "heap_size": "heap_size",
    "total_physical_bytes": "physical_size",
    "pageheap_free": "pageheap_free",  # free pages tcmalloc keeps mapped: resident, not live
    "pageheap_unmapped": "pageheap_unmapped",
    "total_thread_cache": "thread_cache",
}


def parse_envoy_memory(text: str) -> dict[str, float]:
    import json

    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    out: dict[str, float] = {}
    for key, name in ENVOY_MEMORY_JSON.items():
        with contextlib.suppress(KeyError, TypeError, ValueError):
            out[name] = float(doc[key])
    return out


def parse_envoy_stats(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if not sep or not re.fullmatch(r"-?\d+(\.\d+)?", value.strip()):
            continue
        if key in ENVOY_MEMORY_KEYS:
            out[ENVOY_MEMORY_KEYS[key]] = float(value)
        elif not key.startswith("http.admin."):
            for suffix, name in ENVOY_ACTIVE_SUFFIXES.items():
                if key.endswith(suffix):
                    out[name] = out.get(name, 0.0) + float(value)
    return out


MEMORY_FIELDS = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssFile": "file_kib", "AnonHugePages": "thp_kib"}


def process_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile (/proc/PID/status) and AnonHugePages (smaps_rollup: anonymous
    memory in transparent huge pages, which khugepaged can fill out to 2 MiB at a time) in KiB;
    {} for a process that is gone."""
    out: dict[str, int] = {}
    try:
        for name in ("status", "smaps_rollup"):
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in MEMORY_FIELDS:
                        out[MEMORY_FIELDS[key]] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return out if "rss_kib" in out else {}
    return out


# ---------------------------------------------------------------------------------------------- in flight


def inflight_peaks(spans: Iterable[tuple[float, float]], times: Sequence[float]) -> list[int]:
    """For each sample time, the most requests in flight at once since the previous sample (the
    first: since the start). `spans` are (sent, ended) in seconds; ended < 0: never ended."""
    events: list[tuple[float, int]] = []
    for start, end in spans:
        events.append((start, 1))
        if end >= 0:
            events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peaks: list[int] = []
    level = 0
    i = 0
    for t in times:
        peak = level
        while i < len(events) and events[i][0] <= t:
            level += events[i][1]
            peak = max(peak, level)
            i += 1
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------------------------------------- the rule


def ls_slope(points: Series) -> float:
    """Least-squares slope (units per second); 0 with fewer than two distinct times."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def after_warmup(points: Series, warmup: float) -> list[tuple[float, float]]:
    return [(t, v) for t, v in points if t >= warmup] or list(points)


def second_half(points: Series, warmup: float) -> list[tuple[float, float]]:
    span = after_warmup(points, warmup)
    middle = span[0][0] + (span[-1][0] - span[0][0]) / 2
    return [(t, v) for t, v in span if t >= middle]


def rss_growth(points: list[tuple[float, int]], warmup: float, flat_pct: float) -> dict[str, Any]:
    """The old rule's figures: RSS (MiB) from the first sample after `warmup` to the last, the
    least-squares slope over that span, the growth over its second half, and whether it grew at
    most `flat_pct` percent plus 1 MiB (first to last)."""
    span = after_warmup([(t, kib / 1024) for t, kib in points], warmup)
    first, last = span[0][1], span[-1][1]
    at_middle = second_half(span, warmup)[0][1]
    return {
        "first_mib": round(first, 1),
        "last_mib": round(last, 1),
        "max_mib": round(max(m for _, m in span), 1),
        "growth_mib": round(last - first, 1),
        "growth_pct": round((last - first) / first * 100, 1) if first else 0.0,
        "slope_mib_per_min": round(ls_slope(span) * 60, 2),
        # a step early on (buffers sized to a burst) levels off; a leak keeps growing here too
        "second_half_growth_mib": round(last - at_middle, 1),
        "flat": last - first <= first * flat_pct / 100 + 1.0,
    }


def leak_check(
    points: Series, warmup: float, pct_per_hour: float, mib_per_hour: float, min_seconds: float
) -> dict[str, Any]:
    """`points` in (seconds, MiB). The slope over the second half after `warmup`, extrapolated to
    an hour, against `pct_per_hour` percent of the level there plus `mib_per_hour`; `decides` only
    when that half spans at least `min_seconds` (over less, one allocator step of a fraction of a
    MiB extrapolates to tens of MiB an hour)."""
    half = second_half(points, warmup)
    slope = ls_slope(half) * 3600
    level = sum(v for _, v in half) / len(half)
    bound = level * pct_per_hour / 100 + mib_per_hour
    return {
        "second_half_from_s": round(half[0][0], 1),
        "slope_mib_per_hour": round(slope, 2),
        "bound_mib_per_hour": round(bound, 2),
        "leak": slope > bound,
        "decides": half[-1][0] - half[0][0] >= min_seconds,
        # shown, not deciding: growth that slows quarter by quarter is levelling off, a leak does not
        "quarter_slopes_mib_per_hour": [round(ls_slope(q) * 3600, 1) for q in quarters(points, warmup)],
    }


def quarters(points: Series, warmup: float) -> list[list[tuple[float, float]]]:
    """The span after `warmup` cut into four equal stretches of time."""
    span = after_warmup(points, warmup)
    start, length = span[0][0], (span[-1][0] - span[0][0]) / 4
    if length <= 0:
        return [span]
    return [[(t, v) for t, v in span if min(3, int((t - start) / length)) == k] for k in range(4)]


def live_return(points: Series, warmup: float, window: float, pct: float) -> dict[str, Any]:
    """`points` in (seconds, MiB) of live bytes. The median over the last `window` seconds against
    the median over the first `window` after `warmup` (each window at most a quarter of the span,
    so a short soak still compares its start with its end)."""
    span = after_warmup(points, warmup)
    window = min(window, (span[-1][0] - span[0][0]) / 4)
    start = [v for t, v in span if t <= span[0][0] + window]
    end = [v for t, v in span if t >= span[-1][0] - window]
    baseline, last = statistics.median(start), statistics.median(end)
    return {
        "baseline_mib": round(baseline, 2),
        "end_mib": round(last, 2),
        "max_mib": round(max(v for _, v in span), 2),
        "returned": last <= baseline * (1 + pct / 100) + 1.0,
    }


def largest_step(points: Series, warmup: float, window: float) -> dict[str, Any]:
    """The largest rise from one sample to a later one at most `window` seconds on, after `warmup`
    (of equal rises, the one over the least time)."""
    span = after_warmup(points, warmup)
    best = (0.0, span[0][0], span[0][0])
    for i, (t0, v0) in enumerate(span):
        for t1, v1 in span[i + 1 :]:
            if t1 - t0 > window:
                break
            # of equal rises the shortest: the samples either side of the step, not a plateau before it
            if v1 - v0 > best[0] or (v1 - v0 == best[0] > 0 and t1 - t0 < best[2] - best[1]):
                best = (v1 - v0, t0, t1)
    return {"rise_mib": round(best[0], 2), "from_s": best[1], "to_s": best[2]}


def step_vs_burst(
    step: dict[str, Any], times: Sequence[float], peaks: Sequence[int], window: float, factor: float
) -> dict[str, Any]:
    """The client's in-flight peak from `window` seconds before a step to its end, against the
    median of the per-sample peaks over the soak: a burst when at least `factor` times it."""
    near = [p for t, p in zip(times, peaks, strict=True) if step["from_s"] - window <= t <= step["to_s"]]
    typical = statistics.median(peaks) if peaks else 0
    at_step = max(near, default=0)
    return {
        "inflight_peak_at_step": at_step,
        "inflight_peak_typical": typical,
        "coincides_with_burst": bool(peaks) and at_step >= factor * max(typical, 1),
    }


def memory_verdict(processes: dict[str, dict[str, Any]], envoy_live: dict[str, Any] | None) -> dict[str, Any]:
    """Flat by the slope rule: no process leaks and Envoy's live bytes came back (not checked, so
    not flat, when they were never sampled). A soak too short for the slope rule falls back on the
    whole-run growth, and says so."""
    if not all(p["leak"]["decides"] for p in processes.values()):
        grew = [f"{name}: RSS grew {p['growth_pct']:g}%" for name, p in processes.items() if not p["whole_run_flat"]]
        return {
            "flat": not grew,
            "decided_by": "whole-run growth (the soak is too short for the slope)",
            "why_not": grew,
        }
    reasons = [f"{name}: RSS still growing in the second half" for name, p in processes.items() if p["leak"]["leak"]]
    if envoy_live is None:
        reasons.append("Envoy's live bytes were not sampled")
    elif not envoy_live["returned"]:
        held = ", ".join(
            f"{envoy_live[f'{key}_first']} → {envoy_live[f'{key}_last']} {key.replace('_cx', '')} connections"
            for key in ("upstream_cx", "downstream_cx")
            if f"{key}_first" in envoy_live
        )
        reasons.append(
            f"Envoy's live bytes did not come back to their level after the warm-up ({envoy_live['baseline_mib']} → "
            f"{envoy_live['end_mib']} MiB" + (f"; {held} open" if held else "") + ")"
        )
    return {"flat": not reasons, "decided_by": "second-half slope and Envoy's live bytes", "why_not": reasons}


# ---------------------------------------------------------------------------------------------- summary


def memory_series(samples: Sequence[dict[str, Any]], key: str, name: str) -> list[tuple[float, float]]:
    """(t, MiB) of one process's `key` (a MEMORY_FIELDS value) over the samples that have it."""
    return [(s["t"], s[key][name] / 1024) for s in samples if name in s.get(key, {})]


def envoy_series(samples: Sequence[dict[str, Any]], key: str, scale: float = MIB) -> list[tuple[float, float]]:
    return [(s["t"], s["envoy"][key] / scale) for s in samples if key in s.get("envoy", {})]


PARTS = ("anon_kib", "file_kib", "thp_kib")


def memory_parts(samples: Sequence[dict[str, Any]], name: str, warmup: float) -> dict[str, list[float]]:
    """RssAnon, RssFile and AnonHugePages (MiB) of one process: [after the warm-up, at the end]."""
    out: dict[str, list[float]] = {}
    for key in PARTS:
        series = memory_series(samples, key, name)
        if series:
            out[key.removesuffix("_kib")] = [round(after_warmup(series, warmup)[0][1], 1), round(series[-1][1], 1)]
    return out


def step_parts(samples: Sequence[dict[str, Any]], name: str, step: dict[str, Any]) -> dict[str, float]:
    """How RssAnon, RssFile and AnonHugePages (MiB) of one process changed across its step."""
    out: dict[str, float] = {}
    for key in PARTS:
        at = dict(memory_series(samples, key, name))
        if step["from_s"] in at and step["to_s"] in at:
            out[key.removesuffix("_kib")] = round(at[step["to_s"]] - at[step["from_s"]], 2)
    return out


def summarise_memory(
    samples: Sequence[dict[str, Any]], spans: Iterable[tuple[float, float]], cfg: Any
) -> dict[str, Any]:
    """Per process: the old whole-run growth, the slope rule, the largest step and the in-flight
    peak around it; Envoy's live bytes; the verdict and the rule that gave it."""
    times = [s["t"] for s in samples]
    peaks = inflight_peaks(spans, times)
    names = sorted({name for s in samples for name in s["rss_kib"]})
    processes: dict[str, dict[str, Any]] = {}
    for name in names:
        kib = [(s["t"], s["rss_kib"][name]) for s in samples if name in s["rss_kib"]]
        rss = [(t, v / 1024) for t, v in kib]
        old = rss_growth(kib, cfg.soak_warmup_seconds, cfg.memory_flat_pct)
        step = largest_step(rss, cfg.soak_warmup_seconds, cfg.soak_step_window_seconds)
        leak = leak_check(rss, cfg.soak_warmup_seconds, cfg.soak_leak_pct_per_hour, cfg.soak_leak_mib_per_hour,
                          cfg.soak_leak_min_seconds)  # fmt: skip
        processes[name] = old | {
            "whole_run_flat": old.pop("flat"),
            "leak": leak,
            "parts": memory_parts(samples, name, cfg.soak_warmup_seconds),
            "step": step
            | step_vs_burst(step, times, peaks, cfg.soak_step_window_seconds, cfg.soak_burst_factor)
            | {"made_of": step_parts(samples, name, step)},
        }
    live = envoy_series(samples, "allocated")
    envoy_live = None
    if len(live) >= 2:
        envoy_live = live_return(live, cfg.soak_warmup_seconds, cfg.soak_live_window_seconds, cfg.soak_live_return_pct)
        envoy_live["slope_mib_per_hour"] = round(ls_slope(second_half(live, cfg.soak_warmup_seconds)) * 3600, 2)
        for key in ("heap_size", "physical_size", "pageheap_free", "thread_cache"):
            series = envoy_series(samples, key)
            if series:
                envoy_live[f"{key}_first_mib"] = round(after_warmup(series, cfg.soak_warmup_seconds)[0][1], 1)
                envoy_live[f"{key}_last_mib"] = round(series[-1][1], 1)
        for key in ("upstream_cx", "downstream_cx"):  # counts: what holds live bytes after a burst
            series = envoy_series(samples, key, scale=1)
            if series:
                envoy_live[f"{key}_first"] = int(after_warmup(series, cfg.soak_warmup_seconds)[0][1])
                envoy_live[f"{key}_last"] = int(series[-1][1])
    active = [s["envoy"]["rq_active"] for s in samples if "rq_active" in s.get("envoy", {})]
    peak_at = max(range(len(peaks)), key=peaks.__getitem__) if peaks else None
    return {
        "rule": (
            f"flat = no process's RSS slope over the second half after the warm-up (at least "
            f"{cfg.soak_leak_min_seconds:g} s of it), extrapolated to an hour, "
            f"above {cfg.soak_leak_pct_per_hour:g}% of its level + {cfg.soak_leak_mib_per_hour:g} MiB, and "
            "Envoy's live bytes (tcmalloc's allocated bytes, admin /memory) at the end within "
            f"{cfg.soak_live_return_pct:g}% + 1 MiB "
            f"of their level after the warm-up; the whole-run growth (at most {cfg.memory_flat_pct:g}% + 1 MiB) "
            "decides only a soak too short for the slope"
        ),
        **memory_verdict(processes, envoy_live),
        "whole_run_flat": all(p["whole_run_flat"] for p in processes.values()),
        "processes": processes,
        "envoy_live": envoy_live,
        "inflight": {
            "client_peak": max(peaks, default=0),
            "client_peak_at_s": times[peak_at] if peak_at is not None else None,
            "client_peak_typical": statistics.median(peaks) if peaks else 0,
            "envoy_rq_active_max": max(active, default=None),
        },
        "inflight_peaks": peaks,
    }


def render_memory(soak: dict[str, Any]) -> list[str]:
    """The soak's memory section of report.md."""
    why = f" ({'; '.join(soak['why_not'])})" if soak.get("why_not") else ""
    lines = [
        f"Memory flat: **{'yes' if soak['memory_flat'] else 'NO'}**{why}, decided by {soak['decided_by']}. "
        f"Rule: {soak['rule']}. By the whole-run rule alone: {'flat' if soak['whole_run_flat'] else 'not flat'}.",
        "",
        "| process | RSS first MiB | last MiB | max MiB | whole-run growth % | 2nd-half slope MiB/h (bound) | leak "
        "| slope by quarter MiB/h | anon / file / THP MiB, first → last | largest step MiB: anon / file / THP "
        "| in flight at step / typical |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for name, p in soak["processes"].items():
        s, leak = p["step"], p["leak"]
        parts = " / ".join(f"{a} → {b}" for a, b in p["parts"].values()) or "-"
        made = " / ".join(f"{v:+g}" for v in s["made_of"].values())
        cells = [name, p["first_mib"], p["last_mib"], p["max_mib"],
                 f"{p['growth_pct']:g}" + ("" if p["whole_run_flat"] else " (over)"),
                 f"{leak['slope_mib_per_hour']:g} ({leak['bound_mib_per_hour']:g})",
                 ("YES" if leak["leak"] else "no") + ("" if leak["decides"] else " (too short)"),
                 ", ".join(f"{v:g}" for v in leak["quarter_slopes_mib_per_hour"]), parts,
                 f"+{s['rise_mib']:g} at {s['from_s']:.0f}-{s['to_s']:.0f} s" + (f": {made}" if made else ""),
                 f"{s['inflight_peak_at_step']} / {s['inflight_peak_typical']:g}"
                 + (" (burst)" if s["coincides_with_burst"] else "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    live = soak.get("envoy_live")
    if live:
        lines.append(
            f"Envoy's live bytes (tcmalloc's allocated bytes): {live['baseline_mib']} MiB after the warm-up, "
            f"{live['end_mib']} MiB at the end (max {live['max_mib']}; second-half slope "
            f"{live['slope_mib_per_hour']} MiB/h): {'back' if live['returned'] else 'NOT back'}. "
            f"tcmalloc heap {live.get('heap_size_first_mib', '-')} → {live.get('heap_size_last_mib', '-')} MiB, "
            f"resident {live.get('physical_size_first_mib', '-')} → {live.get('physical_size_last_mib', '-')} MiB, "
            f"free but mapped {live.get('pageheap_free_first_mib', '-')} → {live.get('pageheap_free_last_mib', '-')} "
            f"MiB, thread caches {live.get('thread_cache_first_mib', '-')} → {live.get('thread_cache_last_mib', '-')} "
            "MiB."
            + (
                f" Open connections: upstream {live['upstream_cx_first']} → {live['upstream_cx_last']}, downstream "
                f"{live.get('downstream_cx_first', '-')} → {live.get('downstream_cx_last', '-')}."
                if "upstream_cx_first" in live
                else ""
            )
        )
    else:
        lines.append("Envoy's live bytes: not sampled (its admin endpoint did not answer).")
    f = soak["inflight"]
    lines += [
        "",
        f"Requests in flight (the client's peak per sample interval): typical {f['client_peak_typical']:g}, "
        f"most {f['client_peak']} at {f['client_peak_at_s']} s; Envoy's downstream_rq_active at most "
        f"{f['envoy_rq_active_max'] if f['envoy_rq_active_max'] is not None else '-'} at a sample.",
        "",
    ]
    return lines


# ---------------------------------------------------------------------------------------------- plot


def plot_memory(samples: Sequence[dict[str, Any]], peaks: Sequence[int], path: Any, plt: Any) -> str:
    """Three panels on one time axis: RSS of every process; Envoy's RSS, tcmalloc heap, resident
    and live bytes; requests in flight (client peak per interval, Envoy's rq_active)."""
    if plt is None or not samples:
        return ""
    fig, (ax_rss, ax_env, ax_inf) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    names = sorted({name for s in samples for name in s["rss_kib"]})
    for name in names:
        series = memory_series(samples, "rss_kib", name)
        ax_rss.plot([t for t, _ in series], [v for _, v in series], label=name)
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_title("soak: RSS of every process, Envoy's allocator, requests in flight")
    ax_rss.legend(fontsize=7, ncol=3)
    if ENVOY in names:
        series = memory_series(samples, "rss_kib", ENVOY)
        ax_env.plot([t for t, _ in series], [v for _, v in series], label="Envoy RSS", color="black")
        anon = memory_series(samples, "anon_kib", ENVOY)  # RSS less the binary's pages: tcmalloc's part
        ax_env.plot([t for t, _ in anon], [v for _, v in anon], label="Envoy RssAnon", color="grey")
    for key, label in (("heap_size", "tcmalloc heap"), ("physical_size", "tcmalloc resident"),
                       ("allocated", "live (allocated)"), ("pageheap_free", "tcmalloc free, mapped")):  # fmt: skip
        series = envoy_series(samples, key)
        if series:
            ax_env.plot([t for t, _ in series], [v for _, v in series], label=label)
    ax_env.set_ylabel("Envoy (MiB)")
    ax_env.set_title("Envoy: RSS, RssAnon and tcmalloc's own figures (admin /memory)", fontsize=8)
    ax_env.legend(fontsize=7, ncol=2)
    times = [s["t"] for s in samples]
    # a peak belongs to the interval that ends at its sample
    ax_inf.plot(times, peaks, drawstyle="steps-pre", label="client: peak in flight per interval")
    active = [(s["t"], s["envoy"]["rq_active"]) for s in samples if "rq_active" in s.get("envoy", {})]
    if active:
        ax_inf.plot([t for t, _ in active], [v for _, v in active], ".", ms=3, label="Envoy downstream_rq_active")
    ax_inf.set_ylabel("in flight")
    ax_inf.set_xlabel("seconds")
    ax_inf.legend(fontsize=7)
    for ax in (ax_rss, ax_env, ax_inf):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path.name)
