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
