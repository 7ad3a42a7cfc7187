"""pilotfish bench cluster: end to end on a tiny synthetic trace; every policy serves every request."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from pilotfish.bench import cluster as bench
from pilotfish.bench.cluster_policies import (
    DEFAULT_POLICIES,
    FEATURE_ARMS,
    FULL_DEFAULT,
    PolicyUnavailable,
    policy_spec,
    resolve_policies,
)


def _args(out: Path, **overrides: object) -> argparse.Namespace:
    """The command line a user would type: the small defaults here, then `overrides` as flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    bench.add_arguments(parser)
    argv = ["--out", str(out), "--trace", "synthetic:groups=3,prompts=6,system=256,question=32,output=16,rate=30",
            "--instances", "3", "--sweep", "0.5,2", "--no-progress"]
    for key, value in overrides.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return parser.parse_args(argv)


def test_every_policy_serves_every_request_and_the_report_has_its_shape(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.run(_args(out)) == 0

    result = json.loads((out / "result.json").read_text())
    assert result["benchmark"] == "cluster"
    assert result["loads"] == [0.5, 2.0]  # the sweep, with --load (2) in it
    ran = set(result["policies"])
    # the default set runs whole, except a pilotfish policy the scheduler lacks, which is listed with its reason
    for name in DEFAULT_POLICIES:
        assert name in ran or any(line.startswith(f"{name}: ") for line in result["skipped"]), name
    assert {"round-robin", "least-requests", "power-of-two", "llm-d", "dynamo", "sglang", "oracle"} <= ran
    assert set(FEATURE_ARMS) <= ran and result["matrix_at"] == "load"
    for load in ("0.5", "2.0"):
        runs = result["runs"][load]
        # the feature arms run at --load only (--matrix-at load, the default)
        assert set(runs) == (ran if load == "2.0" else ran - set(FEATURE_ARMS))
        for name, m in runs.items():
            assert m["requests"] == 18, name
            assert m["finished"] == m["requests"] - m["rejected"] == 18, name
            for metric in ("ttft", "tpot", "e2e"):
                assert 0 < m[metric]["p50"] <= m[metric]["p90"] <= m[metric]["p99"], (name, metric)
            assert 0 <= m["slo_attainment"] <= 1 and m["goodput_rps"] >= 0
            assert 0 <= m["prefix_cache_hit_rate"] <= 1
            assert m["output_tokens_per_s"] > 0 and m["integrity_errors"] == 0
            assert m["migrations"] == 0 or name.endswith("+rescheduling"), name
    report = (out / "report.md").read_text()
    assert "| policy |" in report and "## Conclusions" in report and "## Knee" in report
    assert "## One feature at a time (load 2)" in report
    assert "oracle" in report
    assert bench.render_markdown(result) + "\n" == report  # the report can be redrawn from result.json alone
    # PNGs when matplotlib imports, else the report says why there are none
    assert all((out / png).stat().st_size > 0 for png in result["plots"])
    assert result["plots"] == ["latency_cdf.png", "p99_ttft_vs_load.png"] or "matplotlib is not installed" in report


def test_feature_arms_and_rescheduling_on_a_tiny_trace(tmp_path: Path) -> None:
    # KV small enough, and a low threshold, that the rescheduler has something to move
    resched = "+rescheduling_neutral_load_threshold=0.3+rescheduling_interval_ms=100"
    base = f"{FULL_DEFAULT}{resched}"
    policies = [base, f"{base}-account", f"{base}+cache-aware", f"{base}+rescheduling"]
    args = _args(tmp_path / "out", policies=",".join(policies), sweep="0.5", load=1.0, matrix_at="sweep",
                 duration=0.0,
                 trace="synthetic:groups=3,prompts=8,system=512,question=64,output=64,rate=20", num_gpu_blocks=600,
                 max_model_len=4096)
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["policies"][f"{base}+rescheduling"]["toggles"] == {"rescheduling": True}
    assert result["policies"][f"{base}-account"]["toggled_from"] == base
    for load in ("0.5", "1.0"):  # --matrix-at sweep: the arms at every load
        runs = result["runs"][load]
        assert set(runs) == set(policies)
        for name, m in runs.items():
            assert m["finished"] == m["requests"] and m["integrity_errors"] == 0, name
            assert m["migrations"] == 0 or name.endswith("+rescheduling"), (load, name)
            assert m["migrated_requests"] <= m["migrations"]
    at_one = result["runs"]["1.0"]
    assert at_one[f"{base}+rescheduling"]["migrations"] > 0  # at load 1 the threshold is crossed
    assert at_one[f"{base}+cache-aware"]["prefix_cache_hit_rate"] > at_one[base]["prefix_cache_hit_rate"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## One feature at a time (load 1)" in report
    moved = at_one[f"{base}+rescheduling"]
    assert f"| {moved['migrations']} ({moved['migrated_requests']}) |" in report


@pytest.mark.parametrize(("name", "toggles", "against"), [
    ("pilotfish-full:load-balance-account", {"account": False}, "pilotfish-full:load-balance"),
    ("pilotfish-full:load-balance+predictor", {"predictor": True}, "pilotfish-full:load-balance"),
    ("pilotfish-full:cache-aware-cache-aware", {"cache-aware": False}, "pilotfish-full:cache-aware"),
    ("pilotfish-full:slo+dispatch_top_k=2-account+rescheduling", {"account": False, "rescheduling": True},
     "pilotfish-full:slo+dispatch_top_k=2"),
    ("pilotfish-full:cache-aware", {}, None),  # the alias is a policy, not a toggle
])
def test_feature_toggles_are_read_off_the_end_of_the_name(name: str, toggles: dict[str, bool],
                                                           against: str | None) -> None:
    spec = policy_spec(name)
    assert spec.toggles == toggles and spec.toggled_from == against
    assert (spec.rescheduler is not None) == toggles.get("rescheduling", False)


def test_full_mode_only_toggles_are_refused_in_lite_mode() -> None:
    for name in ("pilotfish:load-balance-account", "pilotfish:load-balance+rescheduling"):
        with pytest.raises(ValueError, match="full mode"):
            policy_spec(name)


def test_same_arrivals_give_the_same_decisions_for_a_seeded_policy(tmp_path: Path) -> None:
    args = _args(tmp_path / "a", policies="power-of-two,round-robin", sweep="")
    assert bench.run(args) == 0
    first = json.loads((tmp_path / "a" / "result.json").read_text())["runs"]
    args = _args(tmp_path / "b", policies="power-of-two,round-robin", sweep="")
    assert bench.run(args) == 0
    second = json.loads((tmp_path / "b" / "result.json").read_text())["runs"]
    for name in ("power-of-two", "round-robin"):
        assert first["2.0"][name]["ttft"] == second["2.0"][name]["ttft"]


def test_a_pilotfish_policy_the_registry_lacks_is_skipped_with_the_reason() -> None:
    with pytest.raises(PolicyUnavailable, match="no policy 'no-such-policy'"):
        policy_spec("pilotfish:no-such-policy")
    specs, skipped = resolve_policies(["round-robin", "pilotfish:no-such-policy"])
    assert [s.name for s in specs] == ["round-robin"] and len(skipped) == 1
    with pytest.raises(ValueError, match="unknown policy"):
        policy_spec("nonsense")


def test_without_matplotlib_no_png_is_written_and_the_reason_is_given(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pilotfish.bench.cluster_report import write_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    plots, reason = write_plots(tmp_path, 1.0, {}, [1.0], {}, {})
    assert plots == [] and reason is not None and "matplotlib is not installed" in reason
    assert list(tmp_path.iterdir()) == []
