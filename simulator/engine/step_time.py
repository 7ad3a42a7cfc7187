"""Step duration from what the step did, with coefficients from a named profile file.

t_ms = base_ms + prefill_ms_per_token * P + decode_ms_per_token * D + context_ms_per_token * C
where P is the prefill tokens computed, D the requests decoding and C the sum of the context
lengths attended. Linear terms only: a GPU step is bound by weight reads (base), prefill FLOPs
(P) and KV reads (C); `pilotfish sim calibrate` fits the same four numbers to a real engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from pilotfish.config import ConfigError, load_yaml_mapping, struct_from_mapping
from pilotfish.simulator.config import EngineConfig

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


class StepTimeProfile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    name: str
    base_ms: Annotated[float, Meta(ge=0)]
    prefill_ms_per_token: Annotated[float, Meta(ge=0)]
    decode_ms_per_token: Annotated[float, Meta(ge=0)]
    context_ms_per_token: Annotated[float, Meta(ge=0)] = 0.0
    # Serving overhead outside the steps (the API server's request path, the engine-core hop,
    # detokenizing): the engine sees a request this long after it arrives. `sim calibrate`
    # measures it as the first-token overhead. 0 for the GPU profiles, whose servers are fast.
    api_overhead_ms: Annotated[float, Meta(ge=0)] = 0.0
    # True where that serving work runs on the engine's own CPU (vLLM on CPU, API server and
    # engine on one core): then a request that reaches a busy engine also lengthens its next step
    # by `api_overhead_ms`, the CPU the frontend took from it. Measured (bench fidelity at 80
    # req/s): without it the simulated engine finished 256 requests in 6.2 s, vLLM in 7.5-8.1 s.
    shared_cpu: bool = False
    # The CPU each request's arrival takes from a busy engine where `shared_cpu`, if not
    # `api_overhead_ms`: on vLLM-CPU the frontend's work per arrival costs more on a busy core than
    # the first-token overhead an idle engine shows. `sim calibrate` fits it from a phase of arrivals
    # onto a decoding batch (calibrate/arrivals.py); None: `api_overhead_ms`, as profiles before it.
    busy_arrival_ms: Annotated[float, Meta(ge=0)] | None = None

    @property
    def busy_arrival_seconds(self) -> float:
        """What an arrival adds to a busy engine's next step: 0 unless the CPU is shared."""
        if not self.shared_cpu:
            return 0.0
        ms = self.api_overhead_ms if self.busy_arrival_ms is None else self.busy_arrival_ms
        return ms / 1000.0

    def step_seconds(self, prefill_tokens: int, decode_requests: int, context_tokens: int) -> float:
        ms = (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_token * decode_requests
            + self.context_ms_per_token * context_tokens
        )
        return ms / 1000.0


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> StepTimeProfile:
    """A profile by name (simulator/profiles/<name>.yaml) or by path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILES_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError(f"--profile {name_or_path!r}: no such profile (known: {', '.join(profile_names())})")
    try:
        return struct_from_mapping(StepTimeProfile, load_yaml_mapping(path))
    except ConfigError as exc:
        raise ConfigError(f"profile {path}: {exc}") from None


def profile_for(config: EngineConfig) -> StepTimeProfile:
    """The configured profile with the per-flag overrides applied."""
    profile = load_profile(config.profile)
    overrides = {
        "base_ms": config.step_ms,
        "prefill_ms_per_token": config.prefill_ms_per_token,
        "decode_ms_per_token": config.decode_ms_per_token,
    }
    profile = msgspec.structs.replace(profile, **{k: v for k, v in overrides.items() if v is not None})
    return scaled_profile(profile, config.step_scale)


def repeated_scales(pattern: list[float], engines: int) -> tuple[float, ...]:
    """A pattern of step scales repeated over `engines` engines, in engine order; () for no pattern."""
    return tuple(pattern[k % len(pattern)] for k in range(engines)) if pattern else ()


def scaled_profile(profile: StepTimeProfile, scale: float) -> StepTimeProfile:
    """`profile` with every step-time coefficient times `scale` (the serving overheads as they are)."""
    if scale == 1.0:
        return profile
    keys = ("base_ms", "prefill_ms_per_token", "decode_ms_per_token", "context_ms_per_token")
    return msgspec.structs.replace(profile, **{k: getattr(profile, k) * scale for k in keys})
