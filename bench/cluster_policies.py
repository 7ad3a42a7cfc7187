"""Policy names for `pilotfish bench cluster`: name -> a fresh router, and which family it belongs to.

- baselines: `round-robin`, `least-requests` (the real scheduler core, lite mode, fewest
  requests), `power-of-two`;
- Pilotfish: `pilotfish` and `pilotfish-full`, bare, are what ships (the scheduler's default
  policy with no flags, lite and full mode); `pilotfish:<policy>` for any policy the scheduler's
  registry offers (lite mode, the real core on the virtual clock), plus `pilotfish:cache-aware`
  (lite load-balance with the cache-aware metric first); `pilotfish-full:<policy>` the same in
  full mode (simulator/cluster/scheduler_router.py);
  `+field=value` after the policy sets any SchedulerConfig field
  (`pilotfish-full:load-balance+dispatch_top_k=2`); a name the registry lacks, or a
  configuration the core refuses, is skipped with the reason;
- feature toggles, last in the name: `+feature` turns one on, `-feature` off, against what the
  policy ships with (`pilotfish-full:load-balance-account`, `pilotfish-full:load-balance+predictor`);
  the features are FEATURES below, and the default set toggles each once against full mode's
  shipped default (FEATURE_ARMS);
- peers: `llm-d`, `dynamo`, `sglang` (see bench/peers.py for the sources);
- `oracle`: least predicted TTFT from the engines' true state (bench/cluster_oracle.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `pilotfish --help` imports this module: nothing heavy at module level
    from pilotfish.simulator.cluster import Rescheduler, Router
    from pilotfish.simulator.config import EngineConfig

# what a bare `pilotfish:NAME` means when NAME is not itself a registry policy
_PILOTFISH_ALIASES: dict[str, dict[str, Any]] = {
    "cache-aware": {"scheduling_policy": "load-balance", "enable_cache_aware_scheduling": True,
                    "cache_aware_metric": "kv_cache_hit_len"},
}

# bare names: whatever ships (SchedulerConfig's default policy and flags), lite and full mode
SHIPPED = ("pilotfish", "pilotfish-full")

# Full mode's features, each toggled by name: the SchedulerConfig field that switches it. The
# dispatch-time (in-flight) account has no field, since full mode is not correct without it; the
# bench turns it off inside the router (simulator/cluster/scheduler_router.py), hence None.
FEATURES: dict[str, str | None] = {
    "account": None,
    "predictor": "enable_predictor_enhanced_scheduling",
    "cache-aware": "enable_cache_aware_scheduling",
    "rescheduling": "enable_rescheduling",
}
_TOGGLE = re.compile(r"([+-])(" + "|".join(re.escape(f) for f in FEATURES) + r")$")

# the matrix: each feature flipped once against full mode as shipped (account on, the others off)
FULL_DEFAULT = "pilotfish-full:load-balance"
FEATURE_ARMS = (f"{FULL_DEFAULT}-account", f"{FULL_DEFAULT}+predictor", f"{FULL_DEFAULT}+cache-aware",
                f"{FULL_DEFAULT}+rescheduling")

DEFAULT_POLICIES = ("round-robin", "least-requests", "power-of-two", "pilotfish:load-balance",
                    "pilotfish:cache-aware", FULL_DEFAULT, *FEATURE_ARMS, "pilotfish-full:slo", "llm-d", "dynamo",
                    "sglang", "oracle")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    family: str  # baseline | pilotfish | peer | oracle
    make: Callable[[int], Router]  # seed -> a fresh router
    description: str
    # router -> the sim's rescheduler, and its period in seconds (None: no rescheduling)
    rescheduler: Callable[[Router], Rescheduler] | None = None
    rescheduling_interval: float = 0.0
    # feature toggles in the name, and the name without them (what the toggles are measured against)
    toggles: dict[str, bool] = field(default_factory=dict)
    toggled_from: str | None = None


class PolicyUnavailable(Exception):
    """The name is well formed but cannot run now (e.g. the scheduler has no such policy yet)."""


def _scheduler_router(fields: dict[str, Any]) -> Callable[[int], Router]:
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.simulator.cluster import SchedulerRouter

    def make(seed: int) -> Router:
        return SchedulerRouter(SchedulerConfig(**fields))

    return make


def _registry_policies() -> list[str]:
    from pilotfish.scheduler.policy.registry import POLICIES

    return list(POLICIES)


def _toggles(variant: str) -> tuple[str, dict[str, bool]]:
    """Peel `+feature` / `-feature` off the end: `load-balance-account+predictor` -> load-balance, both."""
    toggles: dict[str, bool] = {}
    while (m := _TOGGLE.search(variant)) and m.start() > 0:
        toggles.setdefault(m.group(2), m.group(1) == "+")  # peeled from the end: the last written wins
        variant = variant[:m.start()]
    return variant, dict(reversed(toggles.items()))


def _overrides(name: str, variant: str) -> tuple[str, dict[str, Any]]:
    """`policy+field=value+...`: SchedulerConfig fields set on top of the policy (feature on/off by name)."""
    import yaml

    base, *pairs = variant.split("+")
    fields: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"{name}: {pair!r} is not field=value")
        fields[key] = yaml.safe_load(raw)
    return base, fields


def _pilotfish(name: str, variant: str, full: bool, engine: EngineConfig | None) -> PolicySpec:
    import msgspec

    from pilotfish.scheduler.config import SchedulerConfig

    untoggled, toggles = _toggles(variant)
    base = name[:len(name) - len(variant)] + untoggled if toggles else None  # what the toggles are measured against
    variant, extra = _overrides(name, untoggled)
    known = _registry_policies()
    mode = "full mode (CMS statuses after every step, KV events)" if full else \
        "lite mode (Schedule/Report/Release as ext_proc drives it)"
    if variant in known:
        fields: dict[str, Any] = {"scheduling_policy": variant}
        what = f"the scheduler's `{variant}` policy, {mode}"
    elif variant in _PILOTFISH_ALIASES:
        fields = dict(_PILOTFISH_ALIASES[variant])
        what = "load-balance with " + ", ".join(f"{k}={v}" for k, v in fields.items() if k != "scheduling_policy") \
            + f", {mode}"
    else:
        raise PolicyUnavailable(
            f"{name}: the scheduler registry has no policy {variant!r} yet "
            f"(it has: {', '.join(known)}; aliases: {', '.join(_PILOTFISH_ALIASES)})")
    if extra:
        fields.update(extra)
        what += "; set: " + ", ".join(f"{k}={v}" for k, v in extra.items())
    for feature, on in toggles.items():
        key = FEATURES[feature]
        if key is not None:
            fields[key] = on
    account = toggles.get("account", True)
    if not full and ("account" in toggles or fields.get("enable_rescheduling")):
        raise ValueError(f"{name}: the in-flight account and rescheduling are full mode's (pilotfish-full:...)")
    if not account:
        what += "; in-flight account off (bench-only: each entry dropped as the core makes it)"
    try:
        config = msgspec.convert(fields, SchedulerConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if config.scheduling_policy == "load-balance":
        # the metric it ranks by is a default of the scheduler's, so the report names it
        metric = config.dispatch_neutral_load_metric if full else config.dispatch_load_metric
        if config.enable_cache_aware_scheduling:
            metric = f"{config.cache_aware_metric}, then {metric}"
        what += f"; ranks by {metric}"
    if config.enable_predictor_enhanced_scheduling:
        what += "; forward prediction on"
    make = _full_router(fields, engine, account) if full else _scheduler_router(fields)
    _probe(name, make)
    rescheduler, interval = None, 0.0
    if config.enable_rescheduling:
        config = msgspec.structs.replace(config, enable_full_mode_scheduling=True)
        rescheduler, interval = _rescheduler(name, config), config.rescheduling_interval_ms / 1000.0
        what += (f"; rescheduling every {config.rescheduling_interval_ms} ms: "
                 f"{', '.join(config.rescheduling_policies)}, {config.rescheduling_neutral_load_metric} >= "
                 f"{config.rescheduling_neutral_load_threshold:g}, method {config.rescheduling_migration_method}")
    return PolicySpec(name, "pilotfish", make, what, rescheduler, interval, toggles, base)


def _full_router(fields: dict[str, Any], engine: EngineConfig | None, account: bool) -> Callable[[int], Router]:
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.simulator.cluster import SchedulerRouter

    def make(seed: int) -> Router:
        return SchedulerRouter(SchedulerConfig(enable_full_mode_scheduling=True, **fields), engine=engine,
                               inflight_account=account)

    return make


def _rescheduler(name: str, config: Any) -> Callable[[Router], Rescheduler]:
    """The scheduler's own ReschedulingPlanner over the full-mode router's core (simulator/cluster/rescheduling.py)."""
    from pilotfish.scheduler.rescheduler import ReschedulingPlanner
    from pilotfish.simulator.cluster import PlannerRescheduler

    try:
        ReschedulingPlanner(config)  # bad rescheduling flags: skipped with the reason, not crashed on
    except Exception as exc:
        raise PolicyUnavailable(f"{name}: the rescheduler refused it: {exc}") from None

    def make(router: Router) -> Rescheduler:
        return PlannerRescheduler(ReschedulingPlanner(config), router)  # type: ignore[arg-type]

    return make


def _probe(name: str, make: Callable[[int], Router]) -> None:
    """Build the router once against two engines so a config the core refuses is skipped, not crashed on."""
    try:
        make(0).bind(["probe-0", "probe-1"])
    except Exception as exc:
        raise PolicyUnavailable(f"{name}: the scheduler refused it: {exc}") from None


def policy_spec(name: str, engine: EngineConfig | None = None) -> PolicySpec:
    """The PolicySpec for one name; raises PolicyUnavailable (skip it) or ValueError (a typo)."""
    from pilotfish.bench.cluster_oracle import OracleRouter
    from pilotfish.bench.peers import DynamoKvRouter, LlmdDefaultRouter, PowerOfTwoRouter, SglangCacheAwareRouter
    from pilotfish.simulator.cluster import RoundRobinRouter

    fixed: dict[str, PolicySpec] = {
        "round-robin": PolicySpec("round-robin", "baseline", lambda seed: RoundRobinRouter(),
                                  "rotation, blind to load"),
        "least-requests": PolicySpec(
            "least-requests", "baseline",
            _scheduler_router({"scheduling_policy": "load-balance", "dispatch_load_metric": "num_requests"}),
            "fewest outstanding requests: the real scheduler core, lite mode"),
        "power-of-two": PolicySpec("power-of-two", "baseline", lambda seed: PowerOfTwoRouter(seed),
                                   "two random engines, fewer outstanding requests wins (sglang router)"),
        "llm-d": PolicySpec("llm-d", "peer", lambda seed: LlmdDefaultRouter(seed),
                            "GIE/llm-d default profile: 2 queue + 2 KV util + 3 prefix, max score, 50 ms scrape"),
        "dynamo": PolicySpec("dynamo", "peer", lambda seed: DynamoKvRouter(seed),
                             "Dynamo KV router: min 1.0 x prefill blocks + decode blocks, exact KV events"),
        "sglang": PolicySpec("sglang", "peer", lambda seed: SglangCacheAwareRouter(seed),
                             "SGLang router cache_aware: balance 64 / 1.5, then prefix match > 0.3"),
        "oracle": PolicySpec("oracle", "oracle", lambda seed: OracleRouter(seed),
                             "least predicted TTFT from every engine's true state, zero delay"),
    }
    if name in fixed:
        return fixed[name]
    if name in SHIPPED:  # whatever ships: the scheduler's default policy, no flags
        from pilotfish.scheduler.config import SchedulerConfig

        spec = _pilotfish(name, SchedulerConfig().scheduling_policy, name == "pilotfish-full", engine)
        return dataclasses.replace(spec, description="the shipped default, no flags: " + spec.description)
    family, sep, variant = name.partition(":")
    if sep and family in ("pilotfish", "pilotfish-full") and variant:
        return _pilotfish(name, variant, family == "pilotfish-full", engine)
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(fixed)}, pilotfish[-full][:<policy>])")


def resolve_policies(names: list[str], engine: EngineConfig | None = None) -> tuple[list[PolicySpec], list[str]]:
    """Specs for the names that can run, and one line per name skipped and why."""
    specs: list[PolicySpec] = []
    skipped: list[str] = []
    for name in names:
        try:
            specs.append(policy_spec(name, engine))
        except PolicyUnavailable as exc:
            skipped.append(str(exc))
    return specs, skipped
