"""`pilotfish scheduler` flags and YAML: both land in SchedulerConfig, flags winning."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from pilotfish.config import ConfigError, flag_table, struct_from_args
from pilotfish.scheduler import cli
from pilotfish.scheduler.config import SchedulerConfig


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pilotfish")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["scheduler", *argv])


def config_of(argv: list[str]) -> SchedulerConfig:
    args = parse(argv)
    return struct_from_args(SchedulerConfig, args, args.config_path)


def test_defaults_come_from_the_struct() -> None:
    assert config_of([]) == SchedulerConfig()
    assert parse([]).run is cli.run


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--instances", "a:1,e1=b:2"], "instances", ["a:1", "e1=b:2"]),
        (["--model", "m1,m2"], "model", ["m1", "m2"]),
        (["--dispatch-load-metric", "num_tokens"], "dispatch_load_metric", "num_tokens"),
        (["--dispatch-top-k", "3"], "dispatch_top_k", 3),
        (["--dispatch-load-threshold", "12.5"], "dispatch_load_threshold", 12.5),
        (["--no-enable-full-mode-scheduling"], "enable_full_mode_scheduling", False),
        (["--request-local-account-staleness-seconds", "9"], "request_local_account_staleness_seconds", 9.0),
        (["--fallback-count", "0"], "fallback_count", 0),
        (["--metrics-port", "9100"], "metrics_port", 9100),
        (["--scheduling-policy", "slo"], "scheduling_policy", "slo"),
        (["--enable-full-mode-scheduling"], "enable_full_mode_scheduling", True),
        (
            ["--dispatch-prefill-load-metric", "num_waiting_requests"],
            "dispatch_prefill_load_metric",
            "num_waiting_requests",
        ),
        (["--dispatch-decode-load-threshold", "0.9"], "dispatch_decode_load_threshold", 0.9),
        (["--enable-cache-aware-scheduling"], "enable_cache_aware_scheduling", True),
        (["--enable-predictor-enhanced-scheduling"], "enable_predictor_enhanced_scheduling", True),
        (["--ttft-slo", "500"], "ttft_slo", 500.0),
        (["--tpot-slo", "50"], "tpot_slo", 50.0),
        (["--ttft-slo-dispatch-threshold", "0.8"], "ttft_slo_dispatch_threshold", 0.8),
        (["--instance-staleness-seconds", "3"], "instance_staleness_seconds", 3.0),
        (["--failover-domain", "node-unit"], "failover_domain", "node-unit"),
        (["--redis-url", "redis://h:1/0"], "redis_url", "redis://h:1/0"),
        (["--cms-cluster", "prod"], "cms_cluster", "prod"),
        (["--latency-profile", "p.yaml"], "latency_profile", "p.yaml"),
        (["--policies", "{x: {}}"], "policies", "{x: {}}"),
    ],
)
def test_flags(argv: list[str], field: str, value: object) -> None:
    assert getattr(config_of(argv), field) == value


def test_yaml_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("dispatch-load-metric: num_tokens\ndispatch_top_k: 4\ninstances: [a:1, b:2]\n")
    config = config_of(["--config", str(path), "--dispatch-top-k", "2"])
    assert (config.dispatch_load_metric, config.dispatch_top_k, config.instances) == ("num_tokens", 2, ["a:1", "b:2"])


def test_yaml_composes_a_policy_by_name(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("scheduling-policy: rr\npolicies:\n  rr:\n    neutral: {selector: {name: round_robin}}\n")
    config = config_of(["--config", str(path), "--instances", "a:1,b:2"])
    from pilotfish.scheduler.core import SchedulerCore
    from pilotfish.scheduler.view.types import RequestInfo

    core = SchedulerCore(config)
    assert core.policy.name == "rr"
    assert [core.schedule(RequestInfo(f"r{i}", "m")).target.instance_id for i in range(3)] == ["a:1", "b:2", "a:1"]


def test_full_mode_service_needs_redis() -> None:
    from pilotfish.scheduler.service import SchedulerServer

    with pytest.raises(ConfigError, match="--redis-url: full mode"):
        SchedulerServer(config_of(["--enable-full-mode-scheduling"]))


def test_yaml_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("dispatch_top_kk: 4\n")
    with pytest.raises(ConfigError, match="dispatch_top_kk"):
        config_of(["--config", str(path)])


def test_flag_table_lists_every_field() -> None:
    table = flag_table(SchedulerConfig)
    for field in msgspec.structs.fields(SchedulerConfig):
        assert f"`--{field.name.replace('_', '-')}`" in table
