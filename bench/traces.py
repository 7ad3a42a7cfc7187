"""A benchmark's `--trace` spec to a trace: a shared trace file, a synthetic shared-prefix trace, or
a seeded workload family. Standard library only at module level (`pilotfish --help` imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pilotfish.simulator.traces import Trace

_SYNTHETIC_KEYS = {"groups": int, "prompts": int, "system": int, "question": int, "output": int, "rate": float,
                   "seed": int}  # fmt: skip
_SYNTHETIC_FIELDS = {"prompts": "prompts_per_group", "system": "system_prompt_length", "question": "question_length",
                     "output": "output_length"}  # fmt: skip


def load_trace(spec: str, trace_dir: str | None, seed: int) -> tuple[Trace, str]:
    """The trace named by `spec`, and a label for the report."""
    from pilotfish.simulator.traces import load_trace_file, resolve_trace

    if spec.startswith("family:"):  # a seeded workload family (simulator/traces/families.py)
        from pilotfish.simulator.traces.families import family_trace

        try:
            return family_trace(spec.partition(":")[2], seed), spec
        except ValueError as exc:
            raise SystemExit(f"--trace {spec}: {exc}") from None
    if spec == "synthetic" or spec.startswith("synthetic:"):
        return _synthetic(spec, seed), spec
    path = resolve_trace(spec, trace_dir)
    try:
        return load_trace_file(path), path.name
    except ValueError as exc:
        raise SystemExit(f"--trace {spec}: {exc}") from None


def _synthetic(spec: str, seed: int) -> Trace:
    from pilotfish.simulator.traces import SharedPrefixSpec, shared_prefix_trace

    values: dict[str, Any] = {"seed": seed}
    for item in filter(None, spec.partition(":")[2].split(",")):
        key, _, raw = item.partition("=")
        if key not in _SYNTHETIC_KEYS:
            raise SystemExit(f"--trace synthetic: unknown key {key!r} (known: {', '.join(_SYNTHETIC_KEYS)})")
        values[key] = _SYNTHETIC_KEYS[key](raw)
    return shared_prefix_trace(SharedPrefixSpec(**{_SYNTHETIC_FIELDS.get(k, k): v for k, v in values.items()}))


def compressed(base: Trace, load: float) -> Trace:
    """`base` at `load` times its arrival rate (time compression); load 1 is `base` itself."""
    from pilotfish.simulator.traces import compress

    return compress(base, load) if load != 1.0 else base


def arrival_span(trace: Trace) -> float:
    """Seconds from the first arrival to the last (0 for an empty trace)."""
    arrivals = [r.arrival for r in trace]
    return (max(arrivals) - min(arrivals)) if arrivals else 0.0
