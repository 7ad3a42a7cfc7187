"""bench fidelity's steps: where vLLM's time went in a run, beside where the simulator's went.

A latency ratio says the simulator is off, not where. Both engines log every step (vLLM through
`fidelity_step_log.StepLoggedScheduler`, the simulator through `SimStepRecorder`) with what it
scheduled (the step-time model's P, D and C) and when it ran, on one monotonic clock. Over a
run's window this sums: how many steps, how full they were, how long they took, and how that
compares with what the profile predicts for the same steps. Real steps longer than predicted
say the step-time model is off (and for which kind of step); as many steps in less time say it
is not the steps but the schedule (more, emptier steps: requests reached the engine later).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotfish.simulator.engine.events import EngineObserver

STEP_LOG_ENV = "PILOTFISH_BENCH_STEP_LOG"
STEP_LOG_SCHEDULER = "pilotfish.bench.fidelity_step_log.StepLoggedScheduler"
PER_SECOND_MIN_CYCLES = 20  # a second with fewer busy cycles says little about the speed


@dataclass(frozen=True, slots=True)
class Step:
    start_s: float
    end_s: float
    prefill_tokens: int
    decodes: int
    context_tokens: int
    arrivals: int  # requests added since the previous step
    busy_after: bool  # requests were left when it ended: the next step follows at once


def parse_steps(text: str) -> list[Step]:
    """The step log's lines; a torn last line (the engine still writing) is skipped."""
    steps = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 7:
            continue
        start, end, prefill, decodes, context, arrivals, busy = map(int, fields)
        steps.append(Step(start / 1e9, end / 1e9, prefill, decodes, context, arrivals, busy == 1))
    return steps


def read_steps(path: Path) -> list[Step]:
    return parse_steps(path.read_text()) if path.is_file() else []


class SimStepRecorder(EngineObserver):
    """The simulator's steps, as vLLM's scheduler logs them."""

    def __init__(self, has_requests: Callable[[], bool]) -> None:
        self.steps: list[Step] = []
        self._has_requests = has_requests
        self._arrived: list[float] = []  # not yet counted to a step

    def request_added(self, request: Any, now: float) -> None:
        self._arrived.append(now)

    def step_finished(
        self, now: float, duration: float, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int
    ) -> None:
        # vLLM adds requests between steps: each counts to the first step that starts after it
        # (the one whose time a shared CPU's frontend takes), not to the one it arrived during
        before = sum(1 for t in self._arrived if t <= now)
        self._arrived = [t for t in self._arrived if t > now]
        self.steps.append(Step(now, now + duration, num_prefill_tokens, num_decodes, num_context_tokens,
                               before, self._has_requests()))  # fmt: skip


def _inside(steps: Iterable[Step], window: tuple[float, float]) -> list[Step]:
    t0, t1 = window
    return [s for s in steps if t0 <= s.start_s <= t1]


def _cycles(inside: list[Step], profile: Any) -> Iterator[tuple[Step, float, float]]:
    """(step, cycle, predicted) for each step with requests left after it: its start to the next
    step's, and what the profile predicts for what it computed."""
    for step, after in itertools.pairwise(inside):
        if step.busy_after:
            predicted = profile.step_seconds(step.prefill_tokens, step.decodes, step.context_tokens)
            yield step, after.start_s - step.start_s, predicted


def _by_second(inside: list[Step], profile: Any, origin: float) -> dict[int, list[float]]:
    """Whole seconds since `origin` -> [busy, predicted, cycles] of the cycles that started in it."""
    seconds: dict[int, list[float]] = {}
    for step, cycle, predicted in _cycles(inside, profile):
        second = seconds.setdefault(int(step.start_s - origin), [0.0, 0.0, 0])
        second[0] += cycle
        second[1] += predicted
        second[2] += 1
    return seconds


def summarize_steps(steps: Iterable[Step], window: tuple[float, float], profile: Any) -> dict[str, Any]:
    """The steps that started in `window`: counts, fill, and busy time against the profile's
    prediction, overall and by kind. A cycle is one step's start to the next's, where the engine
    had requests left (so the next step followed at once): the time the engine spent on it,
    including its work between steps (inputs, outputs) and CPU the frontend took from it."""
    inside = _inside(steps, window)
    kinds: dict[str, list[float]] = {"decode_only": [0.0, 0.0, 0], "with_prefill": [0.0, 0.0, 0],
                                     "with_arrivals": [0.0, 0.0, 0], "no_arrivals": [0.0, 0.0, 0]}  # fmt: skip
    cycle_s = predicted_s = in_step_s = 0.0
    cycles = 0
    for step, cycle, predicted in _cycles(inside, profile):
        cycles += 1
        cycle_s += cycle
        predicted_s += predicted
        in_step_s += step.end_s - step.start_s
        for kind in ("with_prefill" if step.prefill_tokens else "decode_only",
                     "with_arrivals" if step.arrivals else "no_arrivals"):  # fmt: skip
            kinds[kind][0] += cycle
            kinds[kind][1] += predicted
            kinds[kind][2] += 1
    n = len(inside) or 1
    # how the machine's speed moved inside the run: busy over predicted, second by second
    seconds = _by_second(inside, profile, inside[0].start_s) if inside else {}
    per_second = [b / p for b, p, c in seconds.values() if c >= PER_SECOND_MIN_CYCLES and p]
    return {
        "steps": len(inside),
        "busy_cycles": cycles,
        "mean_decodes": sum(s.decodes for s in inside) / n,
        "mean_prefill_tokens": sum(s.prefill_tokens for s in inside) / n,
        "steps_with_prefill": sum(1 for s in inside if s.prefill_tokens),
        "arrivals": sum(s.arrivals for s in inside),
        "busy_s": cycle_s,
        "predicted_s": predicted_s,
        "busy_over_predicted": cycle_s / predicted_s if predicted_s else None,
        "in_step_fraction": in_step_s / cycle_s if cycle_s else None,
        "per_second_over_predicted": [min(per_second), max(per_second)] if per_second else None,
        "by_kind": {k: {"cycles": c, "busy_s": b, "over_predicted": b / p if p else None}
                    for k, (b, p, c) in kinds.items()},
    }


def steps_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown rows comparing step summaries (one per engine and run)."""

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    out = ["| run | steps | decodes / step | prefill tokens / step | steps with prefill | busy s | "
           "busy / profile | decode-only / profile | with prefill / profile | with arrivals / profile | "
           "in step | per second |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, s in rows:
        k = s["by_kind"]
        per_second = s.get("per_second_over_predicted")
        spread = f"{per_second[0]:.2f}-{per_second[1]:.2f}" if per_second else "-"
        out.append(
            f"| {label} | {s['steps']} | {s['mean_decodes']:.2f} | {s['mean_prefill_tokens']:.1f} | "
            f"{s['steps_with_prefill']} | {s['busy_s']:.3f} | {ratio(s['busy_over_predicted'])} | "
            f"{ratio(k['decode_only']['over_predicted'])} | {ratio(k['with_prefill']['over_predicted'])} | "
            f"{ratio(k['with_arrivals']['over_predicted'])} | {ratio(s['in_step_fraction'])} | {spread} |"
        )
    return out


def speed_timeline(steps: Iterable[Step], window: tuple[float, float], profile: Any, baseline: float) -> list[float]:
    """vLLM's speed in each whole second of a run's window: its busy time over what the profile
    predicts for those steps, over `baseline` (the simulated engine's own ratio for the workload,
    above 1 by its busy-arrival cost). A second with too few busy cycles (an idle engine) takes the
    run's mean."""
    t0, t1 = window
    seconds = _by_second(_inside(steps, window), profile, t0)
    busy, predicted = sum(s[0] for s in seconds.values()), sum(s[1] for s in seconds.values())
    mean = busy / predicted if predicted else baseline
    timeline = [seconds.get(k, [0.0, 0.0, 0]) for k in range(int(t1 - t0) + 1)]
    return [(b / p if c >= PER_SECOND_MIN_CYCLES and p else mean) / baseline for b, p, c in timeline]


class TimedProfile:
    """A profile whose step times follow a timeline of speeds, one factor per whole second since
    `start()` was called (the replay's start, on the monotonic clock the timeline was read on).
    The busy-arrival cost a simulated engine reads once at its start stays unscaled."""

    def __init__(self, profile: Any, speeds: list[float]) -> None:
        self._profile = profile
        self._speeds = speeds or [1.0]
        self._start: float | None = None

    def start(self, at: float) -> None:
        self._start = at

    def speed(self, now: float) -> float:
        if self._start is None:
            return self._speeds[0]
        return self._speeds[min(max(0, int(now - self._start)), len(self._speeds) - 1)]

    def step_seconds(self, prefill_tokens: int, decode_requests: int, context_tokens: int) -> float:
        speed = self.speed(time.monotonic())
        return self._profile.step_seconds(prefill_tokens, decode_requests, context_tokens) * speed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)
