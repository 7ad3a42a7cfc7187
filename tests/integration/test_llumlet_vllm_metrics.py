"""End to end on real vLLM on CPU: the llumlet's pilotfish_llumlet_* families on vLLM's own /metrics.

vLLM starts with the llumlet's scheduler class and its stat-logger plugin (the entry point of
this package, installed editable in .venv-vllm by scripts/install-vllm.sh); after a few requests
its /metrics shows the llumlet's figures for the engine's instance id, agreeing with what the
llumlet wrote to Redis. Skips without vLLM, except under CI=true, where it fails.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.cms.records import decode_metadata
from pilotfish.procs import Child
from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin import testing
from tests.integration.test_llumlet_vllm import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

CLUSTER = "metrics"
START_TIMEOUT = 600  # a loaded two-core machine: vLLM may take minutes to start
WAIT = 120
MAX_TOKENS = 16
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off"):
        pytest.fail(f"{reason} (CI is set: a missing dependency fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@dataclass
class Engine:
    child: Child
    port: int
    metrics_dir: Path
    instance_id: str
    meta: cms_pb2.InstanceMetadata

    def scrape(self) -> Samples:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def ours(self, samples: Samples, name: str, **labels: str) -> float | None:
        key = frozenset({"model_name": testing.MODEL_NAME, "engine": self.instance_id, **labels}.items())
        return samples.get((name, key))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    if testing.vllm_python() is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    try:
        service = services.start_redis(tmp_path_factory.mktemp("redis"))
    except services.MissingBinary as exc:
        _missing(str(exc))
    with service:
        model = testing.build_tiny_llama(tmp_path_factory.mktemp("model"))
        work = tmp_path_factory.mktemp("vllm")
        metrics_dir = work / "llumlet-metrics"
        env = {
            "PILOTFISH_CMS_URL": service.url,
            "PILOTFISH_CLUSTER": CLUSTER,
            "PILOTFISH_REFRESH_MS": "1000",
            "PILOTFISH_METRICS_DIR": str(metrics_dir),
            "PILOTFISH_METRICS_INTERVAL_MS": "200",
        }
        # --disable-log-stats (start_vllm's default): vLLM then calls no stat logger while idle,
        # so the figures after the requests come from the scrape's own refresh
        child, url = testing.start_vllm(model, work, llumlet_env=env, timeout=START_TIMEOUT)
        client = redis.Redis.from_url(service.url)
        try:
            meta_key = wait_for(lambda: client.keys(keys.meta_pattern(CLUSTER)), 60, "llumlet metadata")[0]
            instance_id = keys.instance_of(meta_key)
            meta = decode_metadata(client.get(meta_key), instance_id)
            yield Engine(child, int(url.rsplit(":", 1)[1]), metrics_dir, instance_id, meta)
        finally:
            child.stop(grace=20)
            client.close()


def complete(engine: Engine, request_id: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=WAIT)
    body = {"model": testing.MODEL_NAME, "prompt": "the quick brown fox " * 8, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": request_id})  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
    finally:
        conn.close()


def test_vllm_metrics_show_the_llumlets_figures_after_requests(engine: Engine) -> None:
    for i in range(3):
        complete(engine, f"metrics-{i}")

    capacity = engine.meta.num_gpu_blocks * engine.meta.block_size

    def settled() -> Samples | None:
        # the engine is idle again: its last snapshot shows every request gone and each one's steps
        got = engine.scrape()
        steps = engine.ours(got, "pilotfish_llumlet_steps_total") or 0
        running = sum(
            engine.ours(got, "pilotfish_llumlet_requests", state=s) or 0
            for s in ("waiting", "running_prefill", "running_decode")
        )
        up = engine.ours(got, "pilotfish_llumlet_snapshot_up")
        return got if up == 1 and steps >= MAX_TOKENS and running == 0 else None

    got = wait_for(settled, WAIT, "the llumlet's figures on vLLM's /metrics")
    value = lambda name, **labels: engine.ours(got, name, **labels)  # noqa: E731
    assert value("pilotfish_llumlet_kv_capacity_tokens") == capacity > 0
    assert value("pilotfish_llumlet_kv_used_tokens") is not None
    assert 0 <= value("pilotfish_llumlet_kv_used_tokens") <= capacity
    assert value("pilotfish_llumlet_exporter_info", exporter="process") == 1
    assert value("pilotfish_llumlet_cms_status_writes_total") >= 3  # at least a change per request
    assert value("pilotfish_llumlet_cms_write_failures_total") == 0
    assert value("pilotfish_llumlet_preemptions_total") == 0
    p50 = value("pilotfish_llumlet_export_staleness_seconds", percentile="50")
    p99 = value("pilotfish_llumlet_export_staleness_seconds", percentile="99")
    assert 0 < p50 <= p99 < 10
    assert 0 < value("pilotfish_llumlet_last_step_duration_seconds") < 60
    assert 0 <= value("pilotfish_llumlet_snapshot_age_seconds") < 5
    # vLLM's own families are still there beside ours, and nothing of ours carries `instance`
    assert any(name == "vllm:num_requests_running" for name, _ in got)
    assert not any(name.startswith("pilotfish_") and "instance" in dict(labels) for name, labels in got)
    assert [p.name for p in engine.metrics_dir.iterdir()] == [f"{engine.instance_id}.json"]


# vLLM imports in ~40 s here: every case runs in one process, its command line and settings set in turn
GATING = r"""
import json, os, sys
from types import SimpleNamespace
from pilotfish.vllm_plugin.adapters.vllm_metrics import LlumletStatLogger
from vllm.v1.metrics.loggers import StatLoggerBase, load_stat_logger_plugin_factories

assert issubclass(LlumletStatLogger, StatLoggerBase)
assert LlumletStatLogger in load_stat_logger_plugin_factories()  # through the installed entry point
results = []
for argv, env, dp_size in json.load(sys.stdin):
    sys.argv = ["vllm", *argv]
    saved = dict(os.environ)
    os.environ.update(env)
    config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=["m"], model="/models/m"),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size),
    )
    logger = LlumletStatLogger(config, list(range(dp_size)))
    logger.record(None, None)
    logger.log()
    metrics = logger.metrics
    results.append(None if metrics is None else sorted(str(e.path) for e in metrics.engines.values()))
    os.environ.clear()
    os.environ.update(saved)
print(json.dumps(results))
"""
SELECTED = ["--scheduler-cls", testing.SCHEDULER_CLS]
GATING_CASES = [
    (SELECTED, {}, 1, ["e.json"]),
    (SELECTED, {}, 2, ["e-dp0.json", "e-dp1.json"]),
    (["--port", "8001"], {}, 1, None),  # vLLM without the llumlet's scheduler class
    (SELECTED, {"PILOTFISH_VLLM_METRICS": "false"}, 1, None),
    (SELECTED, {"PILOTFISH_CMS_URL": ""}, 1, None),  # the llumlet off
    (SELECTED, {"PILOTFISH_TTL_MS": "bad"}, 1, None),  # the engine core refuses it, naming it
]


@pytest.fixture(scope="module")
def gating(tmp_path_factory) -> tuple[Path, list[list[str] | None]]:
    import subprocess

    python = testing.vllm_python()
    if python is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    directory = tmp_path_factory.mktemp("snapshots")
    settings = {"PILOTFISH_CMS_URL": "redis://unused", "PILOTFISH_INSTANCE_ID": "e",
                "PILOTFISH_METRICS_DIR": str(directory)}  # fmt: skip
    out = subprocess.run(
        [str(python), "-c", GATING],
        input=json.dumps([case[:3] for case in GATING_CASES]),
        env=testing.vllm_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return directory, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(GATING_CASES)))
def test_the_stat_logger_reads_only_where_the_llumlet_runs(gating, case: int) -> None:
    """vLLM's own plugin loader finds it; it is inert unless the llumlet runs with metrics on."""
    directory, results = gating
    expected = GATING_CASES[case][3]
    assert results[case] == (None if expected is None else [str(directory / name) for name in expected])
