"""pilotfish.bench.ext_proc_protos: the xds-protos half measures; a missing envoy-data-plane is reported."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pilotfish.bench import cli as bench_cli
from pilotfish.bench import ext_proc_protos as bench
from pilotfish.bench.report import write_report


def _check_xds(result: dict) -> None:
    xds = result["libraries"][bench.XDS]
    assert xds["available"] is True
    assert xds["runtime"].startswith("protobuf ")
    for phase in bench.PHASES:
        stats = xds["us_per_request"][phase]
        assert stats["median"] > 0 and stats["min"] > 0
    # the whole request cannot cost less than its decodes alone
    assert xds["us_per_request"]["total"]["median"] > xds["us_per_request"]["decode"]["median"] * 0.5


def test_xds_half_runs_and_a_missing_edp_is_unavailable(tmp_path: Path) -> None:
    result = bench.run_bench(iterations=3, repeats=1, edp_python=str(tmp_path / "no-python"), min_phase_s=0.0)

    _check_xds(result)
    edp = result["libraries"][bench.EDP]
    assert edp["available"] is False and edp["reason"]
    assert "ratio_edp_over_xds" not in result

    out = tmp_path / "out"
    write_report(out, bench.NAME, result, bench.render_markdown(result, "pilotfish bench protos --out out"))
    written = json.loads((out / "result.json").read_text())
    assert written["benchmark"] == bench.NAME
    assert written["libraries"][bench.XDS]["us_per_request"]["total"]["median"] > 0
    report = (out / "report.md").read_text()
    assert "xds-protos" in report and "unavailable" in report


def test_edp_not_installed_and_not_named_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bench.EDP_PYTHON_ENV, raising=False)
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    python, reason = bench._interpreter(bench.EDP, None)
    assert python is None and "envoy-data-plane" in reason


def test_one_request_is_the_same_wire_bytes_every_time() -> None:
    codec = bench.XdsCodec()
    traffic = bench.Traffic(codec)
    kind, headers = codec.decode(traffic.request_headers)
    assert kind == "request_headers" and headers[":path"] == "/v1/completions" and len(headers) == 12
    assert 1400 <= len(codec.decode(traffic.request_body)[1][0]) <= 1600
    assert all(150 <= len(codec.decode(c)[1][0]) <= 250 for c in traffic.response_body)
    assert bench.encode_all(codec) == bench.encode_all(codec)


def test_bench_protos_subcommand_writes_the_report(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="pilotfish")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "report"
    args = parser.parse_args(
        ["bench", "protos", "--out", str(out), "--iterations", "3", "--repeats", "1", "--edp-python", "/nonexistent"]
    )
    assert args.run(args) == 0
    _check_xds(json.loads((out / "result.json").read_text()))
    assert (out / "report.md").is_file()
