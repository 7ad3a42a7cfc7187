"""Checks of the rescheduling flags that msgspec cannot express; each error is one line naming the flag.

The flags themselves live in SchedulerConfig (scheduler/config.py), grouped under "rescheduling".
"""

from __future__ import annotations

from pilotfish.config import ConfigError
from pilotfish.protos.migration_selection import check_method, check_order, check_rule
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.filters.failover import check_domain

SCOPES = ("cluster", "unit")


def check_config(config: SchedulerConfig) -> None:
    """Everything the planner and the dispatcher rely on; raises ConfigError."""
    from pilotfish.scheduler.rescheduler.registry import RESCHEDULING_POLICIES

    names = config.rescheduling_policies
    if not names:
        raise ConfigError("--rescheduling-policies: name at least one policy")
    known = RESCHEDULING_POLICIES.names()
    for name in names:
        if name not in known:
            raise ConfigError(f"--rescheduling-policies: unknown policy {name!r} (known: {', '.join(known)})")
    if len(set(names)) < len(names):
        raise ConfigError("--rescheduling-policies: a policy is named twice")
    for kind in ("decode", "neutral"):
        _check_load_metric(getattr(config, f"rescheduling_{kind}_load_metric"), kind)
    if config.rescheduling_load_balance_scope not in SCOPES:
        raise ConfigError(
            f"--rescheduling-load-balance-scope: {config.rescheduling_load_balance_scope!r} is not cluster or unit"
        )
    for flag, check, value in (
        ("--rescheduling-req-select-rule", check_rule, config.rescheduling_req_select_rule),
        ("--rescheduling-req-select-order", check_order, config.rescheduling_req_select_order),
        ("--rescheduling-migration-method", check_method, config.rescheduling_migration_method),
    ):
        try:
            check(value)
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    if config.rescheduling_req_select_rule == "RATIO" and config.rescheduling_req_select_value > 1:
        raise ConfigError(
            f"--rescheduling-req-select-value: {config.rescheduling_req_select_value:g} is a KV-cache fraction "
            "with rule RATIO and must be at most 1"
        )
    check_domain(config.failover_domain)
    for name in names:  # what each policy needs of the flags, it checks itself
        RESCHEDULING_POLICIES.get(name).check_config(config)
    if config.enable_adaptive_pd:
        if config.scheduling_policy != "slo":
            raise ConfigError("--enable-adaptive-pd: needs --scheduling-policy slo")
        if not config.tpot_slo:
            raise ConfigError("--enable-adaptive-pd: needs --tpot-slo (ms)")


def _check_load_metric(name: str, kind: str) -> None:
    from pilotfish.scheduler.policy.registry import METRICS

    flag = f"--rescheduling-{kind}-load-metric"
    try:
        metric = METRICS.get(name)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    # a cache-locality metric ranks where a prompt is cached: a request-free probe has no prompt
    if not metric.lower_is_better or metric.cache_locality:
        raise ConfigError(f"{flag}: {name!r} is not a load of the instance alone (lower = less loaded)")


def colocated(config: SchedulerConfig) -> bool:
    """Does `pilotfish scheduler` run the loop itself? Raises ConfigError when it should but cannot."""
    if not config.enable_rescheduling:
        return False
    if config.standalone_rescheduling_mode:
        return False  # `pilotfish rescheduler` runs it
    if not config.colocated_rescheduling_mode:
        raise ConfigError(
            "--enable-rescheduling: neither --colocated-rescheduling-mode nor --standalone-rescheduling-mode is on"
        )
    if not config.enable_full_mode_scheduling:
        raise ConfigError(
            "--enable-rescheduling: the rescheduler plans from the CMS view; add --enable-full-mode-scheduling"
        )
    return True
