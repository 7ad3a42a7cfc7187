"""Name -> class for every policy stage, and policies assembled from names.

Adding a metric, filter or selector is one class and one `register` line here; the name is
the registry key, and it is what the built-in policies and YAML-composed ones refer to.

Every policy is built the same way, from a spec (a mapping infer type -> pipeline spec):

    neutral:
      filters:
        - {name: schedulability}
        - {name: staleness}
        - {name: metric_based, metric: all_prefills_tokens_num, threshold: 8192}
        - {name: failover, domain: node}
      selector: {name: metric_based, metrics: [all_prefills_tokens_num], top_k: 2}

The built-in policies (`POLICIES`) turn the flags into such a spec; a YAML file adds named
specs under `policies`. So a YAML policy and the flag-built one it spells out are the same
object graph (`Policy.spec()` compares them).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import yaml

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.base import Filter, Metric, Pipeline, Policy, Selector
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.filters.failover import FailoverFilter, FailoverMigrationSrcFilter
from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
from pilotfish.scheduler.policy.filters.infer_type import InferTypeFilter
from pilotfish.scheduler.policy.filters.metric_based import MetricBasedFilter
from pilotfish.scheduler.policy.metrics.cache import CacheAwareAllPrefillsTokensNum, KvCacheHitLen
from pilotfish.scheduler.policy.metrics.counts import NumRequests, NumTokens
from pilotfish.scheduler.policy.metrics.latency import PredictedDelay, PredictedStall, PredictedTpot, PredictedTtft
from pilotfish.scheduler.policy.metrics.load import (
    AllDecodesTokensNum,
    AllPrefillsTokensNum,
    DecodeBatchSize,
    KvCacheUsageRatioProjected,
    NumWaitingRequests,
)
from pilotfish.scheduler.policy.selectors.cache_aware import CacheAwareSelector
from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector
from pilotfish.scheduler.policy.selectors.round_robin import RoundRobinSelector
from pilotfish.scheduler.view.types import InferType


class Named(Protocol):
    """What a registry holds: classes that carry their registry key."""

    name: ClassVar[str]


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        name = cls.name
        if name in self._classes:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Forget `name` (a test's own stage, registered for the test only)."""
        del self._classes[name]

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown {self.kind} {name!r} (known: {', '.join(self.names())})") from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def classes(self) -> list[type[T]]:
        """Every registered class, by name: what validation asks for the stages' declared attributes."""
        return [self._classes[name] for name in self.names()]


METRICS: Registry[Metric] = Registry("metric")
METRICS.register(NumRequests)
METRICS.register(NumTokens)
METRICS.register(KvCacheUsageRatioProjected)
METRICS.register(DecodeBatchSize)
METRICS.register(NumWaitingRequests)
METRICS.register(AllPrefillsTokensNum)
METRICS.register(AllDecodesTokensNum)
METRICS.register(KvCacheHitLen)
METRICS.register(CacheAwareAllPrefillsTokensNum)
METRICS.register(PredictedTtft)
METRICS.register(PredictedDelay)
METRICS.register(PredictedStall)
METRICS.register(PredictedTpot)

FILTERS: Registry[Filter] = Registry("filter")
FILTERS.register(MetricBasedFilter)
FILTERS.register(SchedulabilityFilter)
FILTERS.register(StalenessFilter)
FILTERS.register(InferTypeFilter)
FILTERS.register(FailoverFilter)
FILTERS.register(FailoverMigrationSrcFilter)

SELECTORS: Registry[Selector] = Registry("selector")
SELECTORS.register(MetricBasedSelector)
SELECTORS.register(RoundRobinSelector)
SELECTORS.register(CacheAwareSelector)

INFER_TYPES = {"neutral": InferType.NEUTRAL, "prefill": InferType.PREFILL, "decode": InferType.DECODE}


def lite_load_metrics() -> list[str]:
    """What lite load-balance may rank by (verifyDispatchLoadMetric in Llumnix): a load of the instance
    alone (indexable: not of the request, not of the clock) that lite mode computes, i.e. an LRS count."""
    return [cls.name for cls in METRICS.classes() if cls.lite and cls.indexable]


def cache_locality_metrics(*, lite: bool = False) -> list[str]:
    """What --cache-aware-metric may name (those lite mode computes, with `lite`)."""
    return [cls.name for cls in METRICS.classes() if cls.cache_locality and (cls.lite or not lite)]


def verify_dispatch_load_metric(config: SchedulerConfig) -> Metric:
    name = config.dispatch_load_metric
    allowed = lite_load_metrics()
    if not config.enable_full_mode_scheduling and name not in allowed:
        raise ConfigError(
            f"--dispatch-load-metric: {name!r} is not available in lite mode (choose {' or '.join(allowed)})"
        )
    return METRICS.get(name)()


# -- building stages from specs ---------------------------------------------------------------------


class _Builder:
    """Builds one policy: one metric object per name, shared by its stages."""

    def __init__(self, ctx: PolicyContext, rng: random.Random, where: str) -> None:
        self.ctx = ctx
        self.rng = rng
        self.where = where
        self._metrics: dict[str, Metric] = {}

    def metric(self, name: Any) -> Metric:
        if name not in self._metrics:
            cls = METRICS.get(name)
            self._metrics[name] = cls(self.ctx)
        return self._metrics[name]

    def _stage(self, registry: Registry[Any], spec: Any, what: str) -> Any:
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict) or "name" not in spec:
            raise ConfigError(f"{what}: each {registry.kind} is a mapping with a `name`, not {spec!r}")
        params = dict(spec)
        cls = registry.get(params.pop("name"))
        if "metric" in params:
            params["metric"] = self.metric(params["metric"])
        if "metrics" in params:
            if not isinstance(params["metrics"], list):
                raise ConfigError(f"{what}: `metrics` of {cls.name} must be a list of metric names")
            params["metrics"] = [self.metric(n) for n in params["metrics"]]
        accepted = inspect.signature(cls).parameters
        for extra, value in (("ctx", self.ctx), ("rng", self.rng)):
            if extra in accepted:
                params[extra] = value
        unknown = [k for k in params if k not in accepted]
        if unknown:
            raise ConfigError(f"{what}: {registry.kind} {cls.name!r} has no parameter {', '.join(unknown)}")
        try:
            return cls(**params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}: {registry.kind} {cls.name!r}: {exc}") from None

    def pipeline(self, spec: Any, what: str) -> Pipeline:
        if not isinstance(spec, dict) or "selector" not in spec:
            raise ConfigError(f"{what}: a pipeline is a mapping with `filters` (optional) and `selector`")
        unknown = set(spec) - {"filters", "selector"}
        if unknown:
            raise ConfigError(f"{what}: unknown key {', '.join(sorted(unknown))}")
        filters = [self._stage(FILTERS, f, f"{what}.filters") for f in spec.get("filters") or []]
        selector = self._stage(SELECTORS, spec["selector"], f"{what}.selector")
        return Pipeline(filters, selector)


def policy_from_spec(
    name: str,
    spec: Any,
    ctx: PolicyContext,
    rng: random.Random,
    *,
    full_mode: bool,
    where: str | None = None,
) -> Policy:
    """A policy from {infer type: pipeline spec}; lite mode admits lite metrics only."""
    where = where or f"policies.{name}"
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{where}: a policy maps infer types (neutral, prefill, decode) to pipelines")
    builder = _Builder(ctx, rng, where)
    pipelines: dict[InferType, Pipeline] = {}
    for key, pipeline_spec in spec.items():
        infer_type = INFER_TYPES.get(str(key))
        if infer_type is None:
            raise ConfigError(f"{where}: unknown infer type {key!r} (choose neutral, prefill, decode)")
        pipelines[infer_type] = pipeline = builder.pipeline(pipeline_spec, f"{where}.{key}")
        if not full_mode:
            for metric in pipeline.metrics:
                if not metric.lite:
                    raise ConfigError(
                        f"{where}.{key}: metric {metric.name!r} needs full mode (--enable-full-mode-scheduling)"
                    )
    return Policy(name, pipelines, ctx)


# -- the built-in policies, as specs ------------------------------------------------------------------

SpecBuilder = Callable[[SchedulerConfig], dict[str, Any]]


def _health(config: SchedulerConfig) -> list[dict[str, Any]]:
    return [
        {"name": "schedulability", "not_skip_when_fallback": True},
        {"name": "staleness", "staleness_seconds": config.instance_staleness_seconds, "not_skip_when_fallback": True},
    ]


def _failover(config: SchedulerConfig) -> dict[str, Any]:
    return {"name": "failover", "domain": config.failover_domain, "not_skip_when_fallback": True}


def _threshold(metric: str, threshold: float | None) -> list[dict[str, Any]]:
    if threshold is None:
        return []
    return [{"name": "metric_based", "metric": metric, "threshold": threshold, "not_skip_when_fallback": False}]


def _ranking(cache_first: list[str], metric: str, top_k: int) -> dict[str, Any]:
    """The selector: load alone, or (cache-aware) the cached prefix first within the load metric's
    balance band, so affinity never outweighs load (selectors/cache_aware.py)."""
    if cache_first:
        return {"name": "cache_aware", "metrics": [*cache_first, metric], "top_k": top_k}
    return {"name": "metric_based", "metrics": [metric], "top_k": top_k}


def load_balance_spec(config: SchedulerConfig) -> dict[str, Any]:
    """Lowest load wins. Full mode: health filters, threshold, failover, per infer type;
    lite mode: neutral only, a threshold, ranked by num_requests or num_tokens.

    Cache-aware: ranking by cache locality before load alone would lock in; here it ranks first only
    among the instances within the load metric's balance band of the least loaded one (the
    cache_aware selector), since a prefix everyone shares would otherwise send every request to
    the instance that cached it first."""
    cache_first = [config.cache_aware_metric] if config.enable_cache_aware_scheduling else []
    if cache_first and cache_first[0] not in cache_locality_metrics():
        raise ConfigError(
            f"--cache-aware-metric: {cache_first[0]!r} is not one of {', '.join(cache_locality_metrics())}"
        )
    top_k = config.dispatch_top_k
    if not config.enable_full_mode_scheduling:
        metric = verify_dispatch_load_metric(config).name
        if cache_first and cache_first[0] not in cache_locality_metrics(lite=True):
            raise ConfigError(
                f"--cache-aware-metric: lite mode can rank by {' or '.join(cache_locality_metrics(lite=True))} only"
            )
        return {
            "neutral": {
                "filters": _threshold(metric, config.dispatch_load_threshold),
                "selector": _ranking(cache_first, metric, top_k),
            }
        }
    spec: dict[str, Any] = {}
    for kind in ("neutral", "prefill", "decode"):
        metric = getattr(config, f"dispatch_{kind}_load_metric")
        METRICS.get(metric)
        threshold = getattr(config, f"dispatch_{kind}_load_threshold")
        # cache locality matters where the prompt is computed; a decode instance receives KV
        spec[kind] = {
            "filters": [*_health(config), *_threshold(metric, threshold), _failover(config)],
            "selector": _ranking(cache_first if kind != "decode" else [], metric, top_k),
        }
    return spec


def slo_spec(config: SchedulerConfig) -> dict[str, Any]:
    """Lowest predicted latency wins; instances predicted past SLO x threshold are blocked.

    Prefill ranks by predicted_ttft, decode by predicted_tpot; neutral instances do both
    stages, so both thresholds apply and TTFT ranks first, TPOT breaks ties.
    """
    if not config.enable_full_mode_scheduling:
        raise ConfigError("--scheduling-policy: slo needs full mode (--enable-full-mode-scheduling)")
    ttft_limit = config.ttft_slo * config.ttft_slo_dispatch_threshold if config.ttft_slo else None
    tpot_limit = config.tpot_slo * config.tpot_slo_dispatch_threshold if config.tpot_slo else None
    ttft = _threshold("predicted_ttft", ttft_limit)
    tpot = _threshold("predicted_tpot", tpot_limit)
    top_k = config.dispatch_top_k

    def stage(thresholds: list[dict[str, Any]], metrics: list[str]) -> dict[str, Any]:
        return {
            "filters": [*_health(config), *thresholds, _failover(config)],
            "selector": {"name": "metric_based", "metrics": metrics, "top_k": top_k},
        }

    return {
        "neutral": stage([*ttft, *tpot], ["predicted_ttft", "predicted_tpot"]),
        "prefill": stage(ttft, ["predicted_ttft"]),
        "decode": stage(tpot, ["predicted_tpot"]),
    }


# what the default policy ranks by, in both modes: the request's own predicted time to first token plus the
# stall its prefill puts on the decode batch it joins past what that batch's answers absorb
# (metrics/latency.py, predicted_stall, says why, and where each mode learns the answers' lengths), then the
# time per output token it would see
PREDICTED_LATENCY_METRICS = ["predicted_stall", "predicted_tpot"]


# The default's band in full mode: 50 ms over the least predicted value, not 10% of it. 10% of a long TTFT is
# a long time: with one 16k-token document every request shares, a cold engine's value is its prefill (1.9 s),
# so an engine computing the document stayed in band for 190 ms of further work, about 15 requests. They waited
# past the TTFT target behind it and then decoded together, past the TPOT target (16 engines: 0.76 of
# round-robin's goodput at half the knee, 0.998 with the 50 ms band alone). Full mode's values are the engine's
# own work; lite mode's count cached prompts as prefill ahead (metrics/latency.py), which the 10% allows for:
# there the same change cost 2% of goodput on the tenants family at the knee (bench/RESULTS.md, 2026-11-29).
FULL_MODE_BALANCE_REL = 1.0


def predicted_latency_spec(config: SchedulerConfig) -> dict[str, Any]:
    """The default: least predicted latency with cache affinity.

    Prefill (and neutral) instances rank by predicted TTFT (the prefill work ahead plus this
    prompt's uncached part, and the decode batch's share of each prefill step) plus the stall this
    prompt's prefill puts on the decode batch past what its answers absorb (`predicted_stall`: the
    answers' lengths from the gateway's reports in lite mode, from the engines' records in full mode),
    then predicted TPOT;
    the cached prefix picks among the instances whose value is within the band of the least (the
    cache_aware selector), so affinity never costs more than the band. Decode
    instances rank by predicted TPOT. The load comes from the mode's view (metrics/latency.py):
    the LRS in lite mode, CMS statuses + in-flight account + KV events in full mode.

    `--ttft-slo` / `--tpot-slo` add the `slo` policy's threshold filters (an optional refinement;
    the fallback pass ignores them)."""
    top_k = config.dispatch_top_k
    ranking = {"name": "cache_aware", "metrics": ["kv_cache_hit_len", *PREDICTED_LATENCY_METRICS], "top_k": top_k}
    if config.enable_full_mode_scheduling:
        ranking["balance_rel_threshold"] = FULL_MODE_BALANCE_REL
    ttft = _threshold("predicted_ttft", config.ttft_slo * config.ttft_slo_dispatch_threshold if config.ttft_slo
                      else None)
    tpot = _threshold("predicted_tpot", config.tpot_slo * config.tpot_slo_dispatch_threshold if config.tpot_slo
                      else None)
    if not config.enable_full_mode_scheduling:
        return {"neutral": {"filters": [*ttft, *tpot], "selector": ranking}}
    health, failover = _health(config), _failover(config)
    return {
        "neutral": {"filters": [*health, *ttft, *tpot, failover], "selector": ranking},
        "prefill": {"filters": [*health, *ttft, failover], "selector": ranking},
        "decode": {"filters": [*health, *tpot, failover],
                   "selector": {"name": "metric_based", "metrics": ["predicted_tpot"], "top_k": top_k}},
    }


def round_robin_spec(config: SchedulerConfig) -> dict[str, Any]:
    """Load-blind rotation (the benchmarks' baseline); full mode still skips unhealthy instances."""
    if not config.enable_full_mode_scheduling:
        return {"neutral": {"filters": [], "selector": {"name": "round_robin"}}}
    kinds = ("neutral", "prefill", "decode")
    return {k: {"filters": [*_health(config), _failover(config)], "selector": {"name": "round_robin"}} for k in kinds}


# the shipped default (SchedulerConfig.scheduling_policy) first, then the other named policies
DEFAULT_POLICY = "predicted-latency"
POLICIES: dict[str, SpecBuilder] = {
    DEFAULT_POLICY: predicted_latency_spec,
    "load-balance": load_balance_spec,
    "slo": slo_spec,
    "round-robin": round_robin_spec,
}


def custom_policies(config: SchedulerConfig) -> dict[str, Any]:
    """The YAML-composed policies (`policies:`), parsed from text when given as a flag."""
    raw = config.policies
    if isinstance(raw, str):
        try:
            raw = yaml.safe_load(raw) if raw.strip() else {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--policies: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("--policies: must map policy names to {infer type: pipeline}")
    clash = set(raw) & set(POLICIES)
    if clash:
        raise ConfigError(f"policies: {', '.join(sorted(clash))} is a built-in policy name; pick another")
    return raw


def policy_spec(config: SchedulerConfig) -> dict[str, Any]:
    """The policy spec of the configured policy (built-in from flags, or composed in YAML)."""
    custom = custom_policies(config)
    name = config.scheduling_policy
    if name in custom:
        return custom[name]
    builder = POLICIES.get(name)
    if builder is None:
        known = ", ".join([*POLICIES, *custom])
        raise ConfigError(f"--scheduling-policy: unknown policy {name!r} (known: {known})")
    return builder(config)


def build_policy(config: SchedulerConfig, rng: random.Random | None = None, ctx: PolicyContext | None = None) -> Policy:
    if config.enable_predictor_enhanced_scheduling and not config.enable_full_mode_scheduling:
        raise ConfigError("--enable-predictor-enhanced-scheduling: needs full mode (--enable-full-mode-scheduling)")
    ctx = ctx if ctx is not None else context_from_config(config)
    spec = policy_spec(config)
    where = (
        f"policies.{config.scheduling_policy}"
        if config.scheduling_policy in custom_policies(config)
        else (f"--scheduling-policy {config.scheduling_policy}")
    )
    return policy_from_spec(
        config.scheduling_policy,
        spec,
        ctx,
        rng or random.Random(),
        full_mode=config.enable_full_mode_scheduling,
        where=where,
    )


def context_from_config(config: SchedulerConfig, **overrides: Any) -> PolicyContext:
    from pilotfish.scheduler.view.profile import LatencyTables, profile_from_config

    values: dict[str, Any] = {
        "full_mode": config.enable_full_mode_scheduling,
        "tables": LatencyTables(profile_from_config(config.latency_profile or None)),
        "predictor_enhanced": config.enable_predictor_enhanced_scheduling,
        "instance_staleness_seconds": config.instance_staleness_seconds,
        "default_block_size": config.kv_events_prefix_block_size,
        "default_token_budget": config.default_max_num_batched_tokens,
    }
    values.update(overrides)
    return PolicyContext(**values)
