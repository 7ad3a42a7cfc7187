"""The llumlet's hooks under a cache simulation: instructions and cache misses a step, by kind of step.

Inside vLLM the hooks run once or twice a step on caches the model has just evicted, so what a
step costs them is mostly misses: code and data fetched from memory, not instructions. Timing
that on a shared VM moves by more than the effect (bench llumlet); counting it does not.
callgrind (valgrind) simulates the caches and counts, the same for the same code on any machine.

For each kind of step (`steady`: every running request decodes one token; `arrival`: a request
admitted and prefilled beside 15 decoding; `finish`: one of 16 finishes) a child runs the hooks
over vLLM's stand-in scheduler (vllm_plugin/standin.py) in a cycle of those three steps, evicts
the caches before the measured one by reading a buffer four times the simulated last-level
cache, and calls it through `operator.call`, the one C function callgrind collects inside. The
same child with the llumlet off (its hooks only call vLLM's) gives what the stand-in costs; the
report is the difference. The simulated caches are small (32 KiB L1, 1 MiB last level, as a
core's L2), so "LL misses" reads as what the hooks fetch from beyond a core's own caches.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

NAME = "llumlet_cachesim"
KINDS = ("steady", "arrival", "finish")
LL_BYTES = 1 << 20
_EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


class LlumletCachesimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    steps: Annotated[int, Meta(ge=1, description="measured steps of each kind")] = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, LlumletCachesimConfig)


def child(kind: str, llumlet_on: bool, steps: int) -> None:
    """In the child, under callgrind: `steps` cycles, the `kind` step of each measured."""
    import operator
    import random

    from pilotfish.vllm_plugin.standin import StandinRequest, adapter_over_standin, hooked

    evict = bytearray(4 * LL_BYTES)
    with adapter_over_standin() as adapter:
        engine, _ = hooked(adapter, random.Random(0), max_seqs=16, budget=512, preempt_p=0.0, skip_p=0.0)
        for i in range(15):
            engine.add_request(StandinRequest(f"cmpl-long-{i}-0-abcdef12", 80, 1_000_000))
        while engine.waiting or any(not r.num_output_tokens for r in engine.running):
            engine.step()  # admitted and prefilled, a few a step
        if not llumlet_on:
            engine.llumlet = engine.migration = None  # the hooks only call vLLM's

        def cycle(measured: str | None) -> None:
            # arrival (prefill, a first token), steady (17 decode), finish (its third token)
            engine.add_request(StandinRequest(f"cmpl-short-{engine.steps}-0-abcdef12", 80, 3))
            for step in ("arrival", "steady", "finish"):
                if step == measured:
                    sum(evict[::64])  # every line of a buffer four times the last-level cache
                    operator.call(engine.step)
                else:
                    engine.step()

        for _ in range(10):
            cycle(None)  # warm: Python's specialisation, first touches
        for _ in range(steps):
            cycle(kind)
    if llumlet_on:
        assert engine.llumlet.state.num_running == 15, "the cycle did not come back to its start"


def _collect(kind: str, llumlet_on: bool, steps: int, work: Path, valgrind: str) -> dict[str, float]:
    """One child under callgrind: its collected events a measured step."""
    out = work / f"callgrind.{kind}.{int(llumlet_on)}"
    argv = [
        valgrind, "--tool=callgrind", "--cache-sim=yes", f"--LL={LL_BYTES},16,64", "--D1=32768,8,64",
        "--I1=32768,8,64", "--toggle-collect=_operator_call*", f"--callgrind-out-file={out}",
        sys.executable, "-m", __name__, kind, "on" if llumlet_on else "off", str(steps),
    ]  # fmt: skip
    # the same hash seed in every child: a dict's layout, and so its misses, depend on it
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run(argv, check=True, capture_output=True, timeout=1800, env=env)
    totals = read_totals(out.read_text())
    return {name: totals.get(name, 0) / steps for name in _EVENTS}


def read_totals(text: str) -> dict[str, int]:
    """The collected events of a callgrind output file, by name."""
    found = re.search(r"^(?:summary|totals):\s+([\d ]+)$", text, re.M)
    events = re.search(r"^events:\s+(.+)$", text, re.M)
    if found is None or events is None:
        raise RuntimeError("not a callgrind output file (no events or totals line)")
    return dict(zip(events.group(1).split(), (int(v) for v in found.group(1).split()), strict=False))


def run(args: argparse.Namespace) -> int:
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(LlumletCachesimConfig, args)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("llumlet-cachesim: valgrind is not installed (Debian: apt-get install valgrind)")
        return 2
    _report(cfg, _measure(cfg, valgrind), Path(args.out))
    return 0


def _measure(cfg: LlumletCachesimConfig, valgrind: str) -> dict[str, Any]:
    """Per kind of step: the events a step with the llumlet, with its hooks only, and the difference."""
    kinds: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pf-cachesim-") as tmp:
        for kind in KINDS:
            on, off = (_collect(kind, flag, cfg.steps, Path(tmp), valgrind) for flag in (True, False))
            added = {name: on[name] - off[name] for name in _EVENTS}
            added["LL_misses"] = added["ILmr"] + added["DLmr"] + added["DLmw"]
            kinds[kind] = {"llumlet": on, "hooks_only": off, "added": added}
            print(
                f"  {kind:8s} +{added['Ir']:,.0f} instructions, +{added['LL_misses']:,.0f} last-level misses a step",
                flush=True,
            )
    return kinds


def _report(cfg: LlumletCachesimConfig, kinds: dict[str, Any], out: Path) -> None:
    from pilotfish.bench.report import write_report

    result = {"steps_each": cfg.steps, "ll_bytes": LL_BYTES, "kinds": kinds}
    rows = [
        f"| {kind} | {a['Ir']:,.0f} | {a['ILmr']:,.0f} | {a['DLmr'] + a['DLmw']:,.0f} | {a['LL_misses']:,.0f} |"
        for kind, a in ((kind, k["added"]) for kind, k in kinds.items())
    ]
    plots = _plot(out, kinds)
    markdown = "\n".join([
        "# The llumlet's hooks under a cache simulation", "",
        f"callgrind, caches cold before each measured step (32 KiB L1, {LL_BYTES >> 20} MiB last level), "
        f"{cfg.steps} steps of each kind, vLLM's stand-in scheduler with 16 requests; the llumlet's hooks less "
        "the same hooks with the llumlet off (they only call vLLM's).", "",
        "| step | instructions added | last-level misses, code | last-level misses, data | last-level misses |",
        "|---|---|---|---|---|",
        *rows, "",
        *(f"![{p}]({p})" for p in plots),
    ])  # fmt: skip
    write_report(out, NAME, result, markdown)
    print(markdown)


def _plot(out: Path, kinds: dict[str, Any]) -> list[str]:
    """misses.png: last-level misses a step the llumlet adds, by kind of step; [] without matplotlib."""
    from pilotfish.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(kinds)
    code = [kinds[k]["added"]["ILmr"] for k in names]
    data = [kinds[k]["added"]["DLmr"] + kinds[k]["added"]["DLmw"] for k in names]
    ax.bar(names, code, label="code")
    ax.bar(names, data, bottom=code, label="data")
    ax.set_ylabel("last-level misses added a step")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return [save_figure(plt, fig, out / "misses.png")]


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in KINDS or sys.argv[2] not in ("on", "off"):
        raise SystemExit(f"usage: python -m {__name__} {{{','.join(KINDS)}}} on|off STEPS")
    child(sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]))
