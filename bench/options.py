"""The options several virtual-time benchmarks share, declared once: engines, SLO, trace slice, load.

Each option is an annotated type here (its description and bounds) and a field of one of the
base structs below; a benchmark's config struct subclasses the base that fits and adds its own
fields, or overrides a default by declaring the field again with the same type:

    class RescheduleBenchConfig(ClusterRunOptions, frozen=True):
        instances: Instances = 8
        scenarios: ... = ...

The structs are not kw_only: msgspec then keeps the base's fields first, in order, and an
overridden field in its place, so `--help` and the tables read engine, SLO, trace, then the
benchmark's own. The chain is linear because msgspec structs take fields from one base only:
`EngineOptions` (the simulated engine) <- `SloOptions` (+ goodput SLO) <- `ClusterRunOptions`
(+ trace slice, load, fleet, seed: one run of the virtual-time cluster). A benchmark whose names
differ (`--traces-dir`, `--seeds`) takes the annotated types alone. Flags come from the structs
through `pilotfish.config.add_struct_arguments`, so `--help` and the README's tables follow them.

Only the standard library and msgspec at module level: `pilotfish --help` imports every benchmark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.traces import Trace

DEFAULT_TRACE = "mooncake_synthetic.jsonl"

# ---- one annotated type per shared option ------------------------------------------------------------

Profile = Annotated[str, Meta(description="engine step-time profile (a name in simulator/profiles or a YAML path)")]
NumGpuBlocks = Annotated[int, Meta(ge=1, description="KV blocks per engine (30000: Llama-3-8B on an 80 GB A100)")]
MaxModelLen = Annotated[int, Meta(ge=1, description="engine max model length (196608 fits the Mooncake trace)")]
SloTtft = Annotated[float, Meta(gt=0, description="goodput SLO: TTFT at most this many seconds")]
SloTpot = Annotated[float, Meta(gt=0, description="goodput SLO: TPOT at most this many seconds")]
TraceSpec = Annotated[
    str,
    Meta(
        description="Mooncake-style .jsonl, Azure or BurstGPT .csv (a name in ../shared/traces or a path), "
        "synthetic[:groups=8,prompts=32,system=1024,question=128,output=128,rate=10,seed=0], or "
        "family:<name>[:knob=value,...] (simulator/traces/families.py; ranges as low-high)"
    ),
]
TraceDir = Annotated[str | None, Meta(description="folder of the shared traces (unset: ../shared/traces)")]
Duration = Annotated[
    float, Meta(ge=0, description="seconds of the trace's own timeline to replay, taken before compression (0: all)")
]
Load = Annotated[float, Meta(gt=0, description="time compression: 2 = twice the trace's arrival rate")]
Instances = Annotated[int, Meta(ge=1, description="simulated engines")]
ObservationDelay = Annotated[
    float,
    Meta(
        ge=0,
        description="seconds the router hears engine events late (token reports, finishes, full-mode statuses)",
    ),
]
StepScales = Annotated[
    list[Annotated[float, Meta(gt=0)]],
    Meta(
        description="each engine's step time as a multiple of the profile's, a pattern repeated over the fleet "
        "(1,2: every other engine half as fast, as a fleet of two GPU kinds; 1,1,1,4: every fourth engine gone "
        "slow); empty: every engine alike"
    ),
]
Seed = Annotated[int, Meta(description="seed of the routers' random draws and of synthetic traces")]
Progress = Annotated[bool, Meta(description="a progress line on stderr (--no-progress: none)")]


# ---- the base structs ----------------------------------------------------------------------------------


class EngineOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The simulated engine every engine of a fleet runs."""

    profile: Profile = "llama3-8b-a100"
    num_gpu_blocks: NumGpuBlocks = 30000
    max_model_len: MaxModelLen = 196608

    def engine_config(self, **extra: Any) -> EngineConfig:
        """The simulator's EngineConfig for these options; `extra` sets its other fields."""
        from pilotfish.simulator.config import EngineConfig

        return EngineConfig(
            profile=self.profile, num_gpu_blocks=self.num_gpu_blocks, max_model_len=self.max_model_len, **extra
        )


class SloOptions(EngineOptions, frozen=True):
    """The engine, and the SLO a request must meet to count towards goodput."""

    slo_ttft: SloTtft = 2.0
    slo_tpot: SloTpot = 0.1

    def slo(self) -> dict[str, float]:
        """The SLO as result.json records it."""
        return {"ttft_s": self.slo_ttft, "tpot_s": self.slo_tpot}


class ClusterRunOptions(SloOptions, frozen=True):
    """One run of the virtual-time cluster: engine and SLO, a trace slice at a load, a fleet, a seed."""

    trace: TraceSpec = DEFAULT_TRACE
    trace_dir: TraceDir = None
    duration: Duration = 600.0
    load: Load = 2.0
    instances: Instances = 16
    observation_delay: ObservationDelay = 0.0
    seed: Seed = 0
    progress: Progress = True

    def base_trace(self) -> tuple[Trace, str]:
        """The trace's slice (`duration` seconds of its own timeline), uncompressed, and its label."""
        from pilotfish.bench.traces import load_trace
        from pilotfish.simulator.traces import take_duration

        trace, label = load_trace(self.trace, self.trace_dir, self.seed)
        return (take_duration(trace, self.duration) if self.duration > 0 else trace), label


def step_scales_note(pattern: list[float] | None) -> str:
    """How the fleet's engines differ in speed, for a report's first line ("" when all are alike)."""
    if not pattern:
        return ""
    return f"; engine step times {', '.join(f'{x:g}' for x in pattern)} x the profile's, repeated over the fleet"
