"""`pilotfish sim calibrate --engine-url URL`: time requests against a running engine, fit the
step-time profile, write it as a profile YAML (with how and where it was measured)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pilotfish.simulator.calibrate.fit import Fit
    from pilotfish.simulator.calibrate.measure import CalibrationPlan
    from pilotfish.simulator.calibrate.probes import HttpProber


# first-token overhead `sim calibrate` measures against the simulator itself over HTTP (loopback)
SIM_HTTP_OVERHEAD_MS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True, help="base URL of a running vLLM (or simulator)")
    parser.add_argument("--model", default=None, help="model name (default: the first in /v1/models)")
    parser.add_argument("--name", default="calibrated", help="profile name written into the file")
    parser.add_argument("--out", type=Path, default=None, help="profile YAML to write (default: stdout)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="longest prompt timed; keep it within the engine's --max-num-batched-tokens")
    parser.add_argument("--max-batch", type=int, default=16, help="largest decode batch; within --max-num-seqs")
    parser.add_argument("--repeats", type=int, default=5, help="times each prefill length is timed (median kept)")
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn below this")
    parser.add_argument("--note", default="", help="where it was measured (machine, engine flags), for the comment")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's --max-num-seqs; with --max-num-batched-tokens, calibration ends with a "
                        "saturated phase that sets the level of the decode terms (calibrate/saturation.py)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's --max-num-batched-tokens (see --max-num-seqs)")
    parser.add_argument("--shared-cpu", action="store_true",
                        help="the engine's API server runs on the engine's own CPU (vLLM on CPU pinned to one "
                        "core): the profile then charges each request's serving overhead to the engine's steps")


def plan_for(args: argparse.Namespace) -> CalibrationPlan:
    from pilotfish.simulator.calibrate.measure import CalibrationPlan

    top = args.max_prompt_tokens
    lengths = tuple(sorted({max(8, round(top * f)) for f in (1 / 32, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)}))
    batches = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.max_batch)
    return CalibrationPlan(
        prefill_lengths=lengths, cached_prefix=top // 2,
        cached_suffixes=tuple(sorted({max(8, top // 32), max(8, top // 8), max(8, top // 4)})),
        batch_sizes=batches, decode_prompt_lengths=(max(8, top // 16), top // 2), repeats=args.repeats,
        vocab=(16, args.vocab_size),
    )


async def calibrate(args: argparse.Namespace) -> Fit:
    import aiohttp

    from pilotfish.simulator.calibrate.fit import fit_profile
    from pilotfish.simulator.calibrate.measure import measure
    from pilotfish.simulator.calibrate.probes import HttpProber

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = args.model
        if model is None:
            async with session.get(f"{args.engine_url.rstrip('/')}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        prober = HttpProber(args.engine_url, model, session)
        plan = plan_for(args)
        fit = with_serving(fit_profile(await measure(prober, plan), args.name), getattr(args, "shared_cpu", False))
        if getattr(args, "max_num_seqs", None) and getattr(args, "max_num_batched_tokens", None):
            fit = await _at_saturation(fit, prober, plan, args)
    return fit


def with_serving(fit: Fit, shared_cpu: bool) -> Fit:
    """The profile with its serving overhead: the first-token overhead less what the simulator's
    own HTTP path already costs (about 1 ms), so a simulated first token takes what vLLM's did."""
    import dataclasses

    import msgspec

    overhead = round(max(0.0, fit.overhead_ms - SIM_HTTP_OVERHEAD_MS), 3)
    profile = msgspec.structs.replace(fit.profile, api_overhead_ms=overhead, shared_cpu=shared_cpu)
    return dataclasses.replace(fit, profile=profile)


async def _at_saturation(fit: Fit, prober: HttpProber, plan: CalibrationPlan, args: argparse.Namespace) -> Fit:
    import dataclasses

    from pilotfish.simulator.calibrate.arrivals import (
        ArrivalPlan,
        fit_busy_arrival,
        measure_arrivals,
        with_busy_arrival,
    )
    from pilotfish.simulator.calibrate.probes import metric_labels
    from pilotfish.simulator.calibrate.saturation import (
        SaturationPlan,
        measure_saturation,
        saturation_factor,
        scaled,
    )
    from pilotfish.simulator.config import EngineConfig

    info = metric_labels(await prober.metrics_text(), "vllm:cache_config_info")
    async with prober.session.get(f"{prober.url}/v1/models") as resp:
        max_model_len = int((await resp.json())["data"][0].get("max_model_len") or 2048)
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, block_size=int(info.get("block_size", 16)),
        # vLLM V1 keeps one block aside as its null block: it reports N and uses N - 1
        num_gpu_blocks=max(1, int(float(info.get("num_gpu_blocks", 0))) - 1),
    )  # fmt: skip
    phase_plan = SaturationPlan.for_engine(args.max_prompt_tokens, args.max_num_seqs)
    phase = await measure_saturation(prober, phase_plan, plan.vocab, plan.seed + 1)
    factor = await saturation_factor(fit.profile, phase, engine)
    if not fit.profile.shared_cpu:
        return dataclasses.replace(fit, profile=scaled(fit.profile, factor), saturation_factor=factor,
                                   saturation_makespan_s=phase.makespan_s)  # fmt: skip
    arrival_plan = ArrivalPlan.for_engine(args.max_prompt_tokens, args.max_num_seqs, scaled(fit.profile, factor))
    arrivals = await measure_arrivals(prober, arrival_plan, plan.vocab, plan.seed + 2)
    busy, factor = await fit_busy_arrival(fit.profile, factor, phase, arrivals, engine)
    return dataclasses.replace(fit, profile=with_busy_arrival(scaled(fit.profile, factor), busy),
                               saturation_factor=factor, saturation_makespan_s=phase.makespan_s,
                               arrivals_slowdown=arrivals.slowdown)  # fmt: skip


def profile_yaml(fit: Fit, url: str, note: str) -> str:
    import yaml

    p = fit.profile
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"# Fitted by `pilotfish sim calibrate --engine-url {url}` on {when}",
        f"# ({platform.node()}, {platform.machine()}, Python {platform.python_version()}). {note}".rstrip(),
        "# Least squares over timed requests: single-request TTFTs (prefill, with and without a cached",
        "# prefix) and inter-token gaps of decode batches; see simulator/calibrate/measure.py. With the",
        "# engine's batch limits given, the decode terms are then scaled to match a saturated phase",
        "# (simulator/calibrate/saturation.py); with a shared CPU, a phase of arrivals onto a decoding",
        "# batch sets what each takes from a busy engine (busy_arrival_ms, simulator/calibrate/arrivals.py).",
        f"# Fit: {fit.describe()}.",
        "# t_ms = base_ms + prefill_ms_per_token * P + decode_ms_per_token * D + context_ms_per_token * C",
    ]
    body = {"name": p.name, "base_ms": round(p.base_ms, 6), "prefill_ms_per_token": round(p.prefill_ms_per_token, 8),
            "decode_ms_per_token": round(p.decode_ms_per_token, 8),
            "context_ms_per_token": round(p.context_ms_per_token, 10),
            "api_overhead_ms": p.api_overhead_ms, "shared_cpu": p.shared_cpu}
    if p.busy_arrival_ms is not None:
        body["busy_arrival_ms"] = round(p.busy_arrival_ms, 3)
    return "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    fit = asyncio.run(calibrate(args))
    text = profile_yaml(fit, args.engine_url, args.note)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}: {fit.describe()}", file=sys.stderr)
    return 0
