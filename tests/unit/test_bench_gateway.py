"""pilotfish.bench.gateway: body modes parse and render, and the report's figures from raw samples."""

from __future__ import annotations

import argparse

import pytest
import yaml

from pilotfish.bench import gateway as bench
from pilotfish.config import ConfigError, struct_from_args

FD = "FULL_DUPLEX_STREAMED"


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("BUFFERED/STREAMED", bench.BodyMode("BUFFERED", "STREAMED")),
        ("STREAMED/STREAMED", bench.BodyMode("STREAMED", "STREAMED")),
        (f"{FD}/{FD}", bench.BodyMode(FD, FD)),
        ("BUFFERED/BUFFERED", bench.BodyMode("BUFFERED", "BUFFERED")),
        ("istio", bench.BodyMode(FD, FD, "istio")),
        ("ai-gateway", bench.BodyMode(FD, FD, "ai-gateway")),
        ("BUFFERED/FIRST/ungrouped", bench.BodyMode("BUFFERED", "FIRST", ungrouped=True)),
        ("BUFFERED/NONE/ungrouped@grpcio", bench.BodyMode("BUFFERED", "NONE", grpc_server="grpcio", ungrouped=True)),
    ],
)
def test_body_modes_parse(text: str, mode: bench.BodyMode) -> None:
    assert bench.parse_body_mode(text) == mode
    assert mode.label == text


@pytest.mark.parametrize(
    "text", ["BUFFERED", "BUFFERED/", "buffered/STREAMED", "NONE/STREAMED", "envoy-gateway", "BUFFERED/FIRST/grouped"]
)
def test_a_bad_body_mode_names_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--body-modes"):
        bench.parse_body_mode(text)


def test_flags_come_from_the_config_struct() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cfg = struct_from_args(bench.GatewayBenchConfig, parser.parse_args([]))
    assert cfg == bench.GatewayBenchConfig()
    assert [bench.parse_body_mode(t) for t in cfg.body_modes] == [
        bench.parse_body_mode(t) for t in bench.DEFAULT_BODY_MODES
    ]
    assert bench.parse_body_mode(cfg.body_modes[0]) == bench.DEFAULT_MODE
    cfg = struct_from_args(bench.GatewayBenchConfig, parser.parse_args(["--body-modes", "BUFFERED/BUFFERED,istio"]))
    assert cfg.body_modes == ["BUFFERED/BUFFERED", "istio"]


def test_the_default_mode_is_the_default_deployment_arm() -> None:
    assert bench.mode_arm(bench.DEFAULT_MODE) == bench.DEFAULT_ARM == bench._scale_arm(1)
    assert bench.mode_arm(bench.BodyMode("STREAMED", "STREAMED")) == "envoy+ext_proc, STREAMED/STREAMED"


def _ext_proc_filter(text: str) -> dict | None:
    config = yaml.safe_load(text)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    found = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return found[0]["typed_config"] if found else None


@pytest.mark.parametrize("text", bench.DEFAULT_BODY_MODES)
def test_each_mode_renders_its_body_modes(text: str) -> None:
    mode = bench.parse_body_mode(text)
    xp = _ext_proc_filter(bench._bootstrap(mode, 10000, [10001], 10002))
    assert xp is not None
    assert xp["processing_mode"]["request_body_mode"] == mode.request
    # OBSERVE: the routing filter reads no response body, an observing filter does; FIRST: streamed, read to the
    # first token, and released from Envoy's access log
    expected = {bench.OBSERVE: "NONE", bench.FIRST: "STREAMED"}.get(mode.response, mode.response)
    assert xp["processing_mode"]["response_body_mode"] == expected
    text_ = bench._bootstrap(mode, 10000, [10001], 10002)
    assert ("envoy.access_loggers.http_grpc" in text_) == (mode.response in (bench.FIRST, "NONE"))


def test_an_ungrouped_mode_asks_envoy_for_no_client_address() -> None:
    grouped = _ext_proc_filter(bench._bootstrap(bench.parse_body_mode("BUFFERED/FIRST"), 10000, [10001], 10002))
    ungrouped = _ext_proc_filter(
        bench._bootstrap(bench.parse_body_mode("BUFFERED/FIRST/ungrouped"), 10000, [10001], 10002))
    assert grouped is not None and grouped["request_attributes"] == ["source.address"]
    assert ungrouped is not None and ungrouped["request_attributes"] == []


def test_envoy_alone_has_no_ext_proc() -> None:
    assert _ext_proc_filter(bench._bootstrap(None, 10000, [], 10002)) is None


MODES = {m.label: m for m in map(bench.parse_body_mode, ["BUFFERED/STREAMED", f"{FD}/{FD}", "istio"])}


def _load(requests: int, envoy: float, ext_proc: float | None, scheduler: float | None, msgs: int = 0) -> dict:
    """One throughput round of 1 s; CPU figures in seconds for the whole round."""
    cpu = {"envoy": envoy, "ext_proc": ext_proc, "scheduler": scheduler}
    return {"requests": requests, "seconds": 1.0, "client_cpu": 0.5, "cpu": cpu, "messages_to": msgs * requests,
            "messages_from": msgs * requests}  # fmt: skip


def _streams(ttft_s: float, gap_s: float, envoy: float, ext_proc: float | None) -> dict:
    return {"streams": 4, "ttft": [ttft_s] * 4, "gaps": [gap_s] * 12, "cpu": {"envoy": envoy, "ext_proc": ext_proc,
            "scheduler": None}}  # fmt: skip


def _raw() -> dict:
    fd, istio = bench.mode_arm(MODES[f"{FD}/{FD}"]), bench.mode_arm(MODES["istio"])
    ms = 1e-3
    return {
        # two rounds each; Envoy alone 0.4 / 0.5 ms, the default +1.0 ms, full duplex +1.5 ms
        "latency": {
            "envoy": [[0.4 * ms] * 5, [0.5 * ms] * 5],
            bench.DEFAULT_ARM: [[1.4 * ms] * 5, [1.5 * ms] * 5],
            fd: [[1.9 * ms] * 5, [2.0 * ms] * 5],
            istio: [[1.8 * ms] * 5, [2.1 * ms] * 5],
        },
        # 1000 req/s; Envoy alone 0.1 s CPU, ext_proc 0.4 s, scheduler 0.05 s per round
        "load": {
            "envoy": [_load(1000, 0.1, None, None)] * 2,
            bench.DEFAULT_ARM: [_load(1000, 0.3, 0.4, 0.05, 3)] * 2,
            fd: [_load(1000, 0.35, 0.5, 0.05, 6), _load(500, 0.175, 0.25, 0.025, 6)],
            istio: [_load(1000, 0.35, 0.5, 0.05, 6)] * 2,
        },
        "load_ext_procs": {"envoy": 0, bench.DEFAULT_ARM: 1, fd: 1, istio: 1},
        "scale_out": [bench.DEFAULT_ARM],
        "down": {"BUFFERED/STREAMED": {"200": 5}, f"{FD}/{FD}": {"500": 5}, "istio": {"500": 5}},
        "streams": {
            "envoy": [_streams(10 * ms, 5 * ms, 0.004, None)] * 2,
            "BUFFERED/STREAMED": [_streams(11 * ms, 5.1 * ms, 0.008, 0.04)] * 2,
            f"{FD}/{FD}": [_streams(12 * ms, 5.2 * ms, 0.012, 0.06)] * 2,
            "istio": [_streams(12 * ms, 5.2 * ms, 0.012, 0.06)] * 2,
        },
        "phase_seconds": {"latency": 1.0},
    }


def test_a_mode_may_name_the_ext_procs_grpc_server() -> None:
    mode = bench.parse_body_mode("BUFFERED/NONE@grpcio")
    assert mode == bench.BodyMode("BUFFERED", "NONE", grpc_server="grpcio")
    assert mode.label == "BUFFERED/NONE@grpcio" and bench.mode_arm(mode) != bench.DEFAULT_ARM
    assert bench.parse_body_mode("istio@grpcio").gateway == "istio"
    with pytest.raises(ConfigError, match="gRPC server"):
        bench.parse_body_mode("BUFFERED/NONE@grpc")


def test_what_each_proxy_adds_over_a_direct_call_against_vllm_router() -> None:
    raw, ms = _raw(), 1e-3
    raw["latency"][bench.DIRECT_ARM] = [[0.3 * ms] * 5, [0.3 * ms] * 5]
    raw["latency"][bench.VLLM_ROUTER_ARM] = [[0.5 * ms] * 5, [0.5 * ms] * 5]
    result = bench.summarise(raw, {"rounds": 2, "concurrency": 16}, MODES)
    # the default arm's p50 is 1.45 ms: 1.15 over the direct call, against vllm-router's 0.2
    assert result["latency"][bench.DEFAULT_ARM]["over_direct_p50_ms"] == pytest.approx(1.15)
    assert result["over_direct_vs_vllm_router"][bench.DEFAULT_ARM] == pytest.approx(1.15 / 0.2)
    assert "Against what vllm-router adds over a direct call" in bench.render_markdown(result)


def test_summarise_reports_each_body_mode_against_envoy_alone() -> None:
    result = bench.summarise(_raw(), {"rounds": 2, "concurrency": 16}, MODES)
    assert list(result["body_modes"]) == list(MODES)

    default = result["body_modes"]["BUFFERED/STREAMED"]
    assert default["arm"] == bench.DEFAULT_ARM and default["envoy_config"] == "sidecar"
    assert default["added_p50_ms"] == pytest.approx(1.0)
    assert default["round_added_p50_ms"] == pytest.approx([1.0, 1.0])
    # per request: Envoy 300 µs (200 above Envoy alone), ext_proc 400, scheduler 50: the hop 650
    assert default["envoy_added_cpu_us_per_request"] == pytest.approx(200)
    assert default["ext_proc_cpu_us_per_request"] == pytest.approx(400)
    assert default["scheduler_cpu_us_per_request"] == pytest.approx(50)
    assert default["hop_cpu_us_per_request"] == pytest.approx(650)
    assert default["messages_to_ext_proc_per_request"] == pytest.approx(3)
    assert default["ext_proc_down"] == {"200": 5}
    assert default["stream"]["added_ttft_p50_ms"] == pytest.approx(1.0)
    assert default["stream"]["added_gap_mean_ms"] == pytest.approx(0.1)
    assert default["stream"]["ext_proc_cpu_us_per_stream"] == pytest.approx(10_000)  # 0.04 s over 4 streams
    assert default["stream"]["envoy_added_cpu_us_per_stream"] == pytest.approx(1000)

    fd = result["body_modes"][f"{FD}/{FD}"]
    assert fd["added_p50_ms"] == pytest.approx(1.5)
    assert fd["hop_cpu_us_per_request"] == pytest.approx(250 + 500 + 50)
    # rounds of different length weigh by their requests; the spread is per round
    assert fd["round_ext_proc_cpu_us_per_request"] == pytest.approx([500, 500])
    assert fd["stream"]["added_ttft_p50_ms"] == pytest.approx(2.0)
    assert result["body_modes"]["istio"]["envoy_config"] == "istio"
    assert result["throughput"]["envoy"]["envoy_added_cpu_us_per_request"] == pytest.approx(0)
    assert "hop_cpu_us_per_request" not in result["throughput"]["envoy"]


def test_markdown_has_one_row_per_body_mode() -> None:
    text = bench.render_markdown(bench.summarise(_raw(), {"rounds": 2, "concurrency": 16}, MODES))
    table = text[text.index("## Body modes") : text.index("## Latency")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[1] for row in rows] == ["BUFFERED / STREAMED", f"{FD} / {FD}", f"{FD} / {FD}"]
    assert "**+1.00** (+1.00..+1.00)" in rows[0] and "= **650**" in rows[0] and "5 x 200" in rows[0]
    assert rows[2].startswith("| istio |") and "5 x 500" in rows[2]
    assert "## Streaming" in text and "## Throughput" in text


def test_rounds_rotate_the_arm_order() -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    orders = [bench._rotated(names, k, 3) for k in range(3)]
    assert orders == [names, ["c", "d", "e", "f", "a", "b"], ["e", "f", "a", "b", "c", "d"]]
    assert [o[0] for o in (bench._rotated(names, k, 1) for k in range(2))] == ["a", "a"]
