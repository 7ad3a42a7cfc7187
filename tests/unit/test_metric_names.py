"""Every metric family Pilotfish exposes follows Prometheus's naming conventions, and the Grafana
dashboard (deploy/grafana/pilotfish.json) names only series that are exposed.

Collected from live objects, not from a list: a full-mode scheduler core with every collector a
scheduler process registers (listener limits, KV events, the colocated rescheduler), the ext_proc's
registry, the llumlet's families on vLLM's /metrics (set from a snapshot) and the simulated
engine's /metrics (its `vllm:` families are vLLM's names, kept as vLLM spells them; the rest are ours).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.limits import ListenerStats
from pilotfish.scheduler.rescheduler.telemetry import ReschedulerTelemetry
from pilotfish.scheduler.telemetry import register_kv_events, register_listener_stats
from pilotfish.scheduler.view.kv_events import KvEventStats
from pilotfish.scheduler.view.types import RequestInfo

WALL = 1_700_000_000.0
# Prometheus's own target labels and the labels its histograms and summaries reserve
RESERVED_LABELS = {"instance", "job", "le", "quantile"}
# base units only: seconds not ms, bytes not KiB, ratios not percent
NON_BASE_UNITS = ("_ms", "_milliseconds", "_us", "_microseconds", "_ns", "_kb", "_mb", "_kib", "_mib", "_percent")
UNITS = ("seconds", "bytes", "tokens", "ratio")
# a label that names a metric means the family mixes several quantities (and their units)
MIXING_LABELS = {"metric", "name", "unit"}


def lint(family: Metric) -> list[str]:
    """What is wrong with one family, as prometheus_client collected it (counters without `_total`)."""
    name, kind = family.name, family.type
    problems = []
    if not name.startswith("pilotfish_"):
        problems.append("no pilotfish_ prefix")
    if kind != "counter" and name.endswith("_total"):
        problems.append(f"_total on a {kind}")
    if kind not in ("histogram", "summary", "gaugehistogram") and re.search(r"_(count|sum|bucket)$", name):
        problems.append("a histogram's sample suffix on a family that is not one")
    if kind == "counter" and re.search(r"_(count|sum|bucket)$", name):
        problems.append("counter named like a histogram sample")
    for suffix in NON_BASE_UNITS:
        if name.endswith(suffix) or f"{suffix}_" in name:
            problems.append(f"non-base unit {suffix}")
    for unit in UNITS:
        if re.search(rf"_{unit}_", name) and not name.endswith(f"_{unit}"):
            problems.append(f"unit {unit} not at the end")
    if kind == "histogram" and not re.search(r"_(seconds|bytes|tokens|requests)$", name):
        problems.append("histogram without a unit")
    for sample in family.samples:
        allowed = {"le"} if kind == "histogram" and sample.name.endswith("_bucket") else set()
        allowed |= {"quantile"} if kind == "summary" else set()
        for label in sample.labels:
            if label in RESERVED_LABELS - allowed or label.startswith("__"):
                problems.append(f"reserved label {label!r}")
            if label in MIXING_LABELS:
                problems.append(f"label {label!r} mixes quantities in one family")
        if kind == "counter" and not sample.name.endswith(("_total", "_created")):
            problems.append(f"counter sample {sample.name} without _total")
    return sorted(set(problems))


def families(registry: CollectorRegistry) -> list[Metric]:
    return list(registry.collect())


def scheduler_families() -> list[Metric]:
    config = SchedulerConfig(
        enable_full_mode_scheduling=True,
        enable_rescheduling=True,
        scheduling_policy="slo",
        ttft_slo=200,
        tpot_slo=40,
    )
    core = SchedulerCore(config, clock=lambda: 100.0, wall_clock=lambda: WALL)
    assert core.cms is not None
    for name in ("a", "b"):
        core.apply_metadata(
            cms_pb2.InstanceMetadata(instance_id=name, host="10.0.0.1", http_port=8000, model="m", infer_type=1)
        )
        core.apply_status(
            cms_pb2.InstanceStatus(instance_id=name, update_id=1, timestamp_ms=int(WALL * 1000), schedulable=True)
        )
    core.schedule(RequestInfo(request_id="r1", model="m", prompt_tokens=10))
    ReschedulerTelemetry(core.registry)
    listener = ListenerStats()
    listener.refused[("schedule", "rate_limited")] += 1
    listener.session_closed["idle_timeout"] += 1
    register_listener_stats(core.registry, listener)
    register_kv_events(core.registry, KvEventStats())
    got = families(core.registry)
    assert {f.name for f in got} >= {
        "pilotfish_scheduler_decision_seconds",
        "pilotfish_scheduler_dispatch",
        "pilotfish_scheduler_view_staleness_seconds",
        "pilotfish_scheduler_policy_predicted_ttft_seconds",
        "pilotfish_rescheduling_cycles",
        "pilotfish_scheduler_refused",
        "pilotfish_scheduler_kv_events_applied",
    }
    return got


def ext_proc_families() -> list[Metric]:
    metrics = ExtProcMetrics()
    metrics.routed.labels(route="scheduler").inc()
    metrics.schedule_seconds.observe(0.001)
    return families(metrics.registry)


def llumlet_families() -> list[Metric]:
    """The llumlet's families on vLLM's /metrics, set from a snapshot (and a read error from a missing one)."""
    import tempfile

    from pilotfish.vllm_plugin.config import LlumletConfig
    from pilotfish.vllm_plugin.core.metrics_snapshot import SnapshotWriter, snapshot_path
    from pilotfish.vllm_plugin.core.snapshot_metrics import SnapshotMetrics
    from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS

    with tempfile.TemporaryDirectory() as tmp:
        config = LlumletConfig(cms_url="redis://unused", metrics_dir=tmp)
        SnapshotWriter(config, "a", "process").write(dict.fromkeys(COUNTER_FIELDS, 1), 1, 1, [100.0])
        registry = CollectorRegistry()
        paths = {name: snapshot_path(config, name) for name in ("a", "b")}
        SnapshotMetrics("m", paths, 1.0, registry=registry, refresh_on_scrape=False).refresh()
    got = families(registry)
    assert {f.name for f in got} >= {
        "pilotfish_llumlet_requests",
        "pilotfish_llumlet_steps",
        "pilotfish_llumlet_snapshot_up",
        "pilotfish_llumlet_snapshot_read_errors",
    }
    return got


def simulator_families() -> list[Metric]:
    """The simulated engine's /metrics page, as Prometheus parses it: ours are every non-vllm: family."""
    from pilotfish.simulator.engine.base import EngineStats
    from pilotfish.simulator.server.metrics import render_metrics

    text = render_metrics(EngineStats(), "m")
    return [f for f in text_string_to_metric_families(text) if not f.name.startswith("vllm:")]


COMPONENTS = {
    "scheduler": scheduler_families,
    "ext_proc": ext_proc_families,
    "llumlet": llumlet_families,
    "simulator": simulator_families,
}


def _report(got: Iterable[Metric]) -> dict[str, list[str]]:
    return {f.name: p for f in got if (p := lint(f))}


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_every_family_follows_the_conventions(component: str) -> None:
    assert _report(COMPONENTS[component]()) == {}


@pytest.mark.parametrize(
    ("name", "kind", "labels", "problem"),
    [
        ("rescheduling_cycles_count", "counter", {}, "no pilotfish_ prefix"),
        ("pilotfish_x_count", "counter", {}, "a histogram's sample suffix on a family that is not one"),
        ("pilotfish_x_total", "gauge", {}, "_total on a gauge"),
        ("pilotfish_x", "gauge", {"instance": "a"}, "reserved label 'instance'"),
        ("pilotfish_x", "gauge", {"job": "a"}, "reserved label 'job'"),
        ("pilotfish_x", "gauge", {"metric": "ttft"}, "label 'metric' mixes quantities in one family"),
        ("pilotfish_x_ms", "gauge", {}, "non-base unit _ms"),
        ("pilotfish_x_seconds_max", "gauge", {}, "unit seconds not at the end"),
    ],
)
def test_the_lint_catches_each_known_offence(name: str, kind: str, labels: dict[str, str], problem: str) -> None:
    family = Metric(name, "h", kind)
    family.add_sample(name + ("_total" if kind == "counter" else ""), labels, 1.0)
    assert problem in lint(family)


# -- the Grafana dashboard ----------------------------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pilotfish.json"
# a PromQL identifier that names a series (functions and keywords are followed by "(" or are labels)
SERIES = re.compile(r"\b((?:pilotfish_|vllm:)[A-Za-z0-9_:]*)")


def exposed() -> set[str]:
    from pilotfish.simulator.engine.base import EngineStats
    from pilotfish.simulator.server.latency import LatencyHistograms
    from pilotfish.simulator.server.metrics import render_metrics

    load_balance = SchedulerCore(
        SchedulerConfig(
            enable_full_mode_scheduling=True,
            scheduling_policy="load-balance",
            dispatch_neutral_load_metric="kv_cache_usage_ratio_projected",
        )
    )
    load_balance.apply_metadata(
        cms_pb2.InstanceMetadata(instance_id="a", host="10.0.0.1", http_port=8000, model="m", infer_type=1)
    )
    ours = scheduler_families() + ext_proc_families() + llumlet_families() + families(load_balance.registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = {f.name + suffix for f in ours for suffix in suffixes.get(f.type, ("",))}
    text = render_metrics(EngineStats(), "m", latency=LatencyHistograms())
    names |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    names |= {f.name for f in text_string_to_metric_families(text)}
    return names


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_every_expression_names_an_exposed_series() -> None:
    known = exposed()
    exprs = expressions()
    assert len(exprs) >= 15
    missing = {name for expr in exprs for name in SERIES.findall(expr) if name not in known}
    assert missing == set()
    assert all(SERIES.search(expr) for expr in exprs), "an expression names no Pilotfish or vLLM series"


def test_the_dashboard_is_importable_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pilotfish" and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
