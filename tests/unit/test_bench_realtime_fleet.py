"""bench realtime's fleet: every target's engines started with the same flags, slowed where asked."""

from __future__ import annotations

from pilotfish.bench.realtime import RealtimeBenchConfig, fleet_spec
from pilotfish.simulator.traces.model import TraceRequest


def test_step_scales_reach_every_engine_process_and_nothing_else_changes() -> None:
    trace = [TraceRequest(request_id="r0", arrival=0.0, input_length=100, output_length=10, segments=(("s", 100),))]
    alike = fleet_spec(RealtimeBenchConfig(engines=2), trace)
    slowed = fleet_spec(RealtimeBenchConfig(engines=2, step_scales=[1.0, 4.0]), trace)
    assert "--step-scales" not in alike.engine_args
    assert slowed.engine_args == (*alike.engine_args, "--step-scales", "1,4")
    assert slowed.engines == alike.engines == 2
