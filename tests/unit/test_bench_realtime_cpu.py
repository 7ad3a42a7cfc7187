"""bench realtime's router-side CPU: per request, against each real router, and by component."""

from __future__ import annotations

from pilotfish.bench.realtime_report import aggregate, cpu_parts, cpu_ratios


def run(ms_per_request: float, parts: dict[str, float] | None = None) -> dict:
    return {"router_cpu_ms_per_request": ms_per_request, "router_cpu_ms_per_request_parts": parts or {}}


def test_each_pilotfish_target_is_set_against_each_real_router() -> None:
    runs = {
        "pilotfish-full": [run(10.0), run(12.0), run(11.0)],
        "vllm-router:round_robin": [run(5.0), run(5.5), run(4.0)],
        "direct-rr": [run(0.0)],
    }
    families = {"pilotfish-full": "pilotfish", "vllm-router:round_robin": "peer", "direct-rr": "baseline"}
    lines = cpu_ratios(aggregate(runs), families)
    assert lines == ["- `pilotfish-full` / `vllm-router:round_robin`: 2.2x (11 against 5 ms per request)"]


def test_components_are_medians_over_runs() -> None:
    lite = [
        run(3, {"envoy": 1.0, "ext_proc": 2.0}),
        run(5, {"envoy": 3.0, "ext_proc": 2.0}),
        run(4, {"envoy": 2.0, "ext_proc": 9.0}),
    ]
    runs = {"pilotfish-lite": lite, "vllm-router:round_robin": [run(1.0)]}
    assert cpu_parts(runs) == ["- `pilotfish-lite`: envoy 2, ext_proc 2 ms per request"]


def idle_run(ms_per_request: float, idle: float, idle_parts: dict[str, float] | None = None) -> dict:
    return run(ms_per_request) | {
        "router_idle_cpu_ms_per_request": idle,
        "router_net_cpu_ms_per_request": ms_per_request - idle,
        "router_idle_cpu_ms_per_request_parts": idle_parts or {},
    }


def test_the_net_ratio_takes_each_targets_idle_window_off() -> None:
    runs = {"pilotfish-full": [idle_run(12.0, 4.0)], "vllm-router:round_robin": [idle_run(6.0, 2.0)]}
    families = {"pilotfish-full": "pilotfish", "vllm-router:round_robin": "peer"}
    assert cpu_ratios(aggregate(runs), families) == [
        "- `pilotfish-full` / `vllm-router:round_robin`: 2.0x (12 against 6 ms per request); "
        "net of the idle window 2.0x (8 against 4)"
    ]


def test_components_show_their_idle_window_share() -> None:
    runs = {
        "pilotfish-full": [
            run(9, {"envoy": 5.0, "ext_proc": 4.0})
            | {"router_idle_cpu_ms_per_request_parts": {"envoy": 1.0, "ext_proc": 0.5}},
            run(9, {"envoy": 7.0, "ext_proc": 2.0})
            | {"router_idle_cpu_ms_per_request_parts": {"envoy": 3.0, "ext_proc": 0.5}},
        ]
    }
    assert cpu_parts(runs) == ["- `pilotfish-full`: envoy 6 (idle 2), ext_proc 3 (idle 0.5) ms per request"]


def test_idle_figures_use_the_replays_divisor() -> None:
    from pilotfish.bench.realtime import Replayed, _idle_figures

    replayed = Replayed(None, None, None, 0.0, 0.6, {"envoy": 0.6}, idle_cpu=0.12, idle_parts={"envoy": 0.12})  # type: ignore[arg-type]
    figures = _idle_figures(replayed, 60)
    assert figures["router_idle_cpu_ms_per_request"] == 2.0
    assert abs(figures["router_net_cpu_ms_per_request"] - 8.0) < 1e-9
    assert figures["router_idle_cpu_ms_per_request_parts"] == {"envoy": 2.0}
    assert _idle_figures(Replayed(None, None, None, 0.0, 0.6, {}), 60) == {}  # type: ignore[arg-type]
