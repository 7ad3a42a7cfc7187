"""`pilotfish sim ...`: simulated vLLM engines.

`sim serve` starts a fleet over HTTP and runs until SIGTERM or SIGINT. Imports stay light:
aiohttp and the engine model load inside `run`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    from pilotfish.simulator.config import add_arguments

    sim = subparsers.add_parser("sim", help="simulated vLLM engines (OpenAI API, /metrics)",
                                description="Simulated vLLM engines.")
    commands = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve simulated engines over HTTP, one port each",
        description="Serve N simulated vLLM engines in one process, one port each, until SIGTERM/SIGINT.",
    )
    add_arguments(serve)
    serve.set_defaults(run=run_serve)
    calibrate = commands.add_parser(
        "calibrate",
        help="fit a step-time profile from a running vLLM",
        description="Time requests against a running vLLM (or simulator) and fit the step-time profile.",
    )
    calibrate.set_defaults(run=run_calibrate)
    from pilotfish.simulator.calibrate.command import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from pilotfish.simulator.calibrate.command import run

    return run(args)


def run_serve(args: argparse.Namespace) -> int:
    import uvloop

    from pilotfish.simulator.config import configs_from_args
    from pilotfish.simulator.serve import serve_forever

    serve, engine = configs_from_args(args)
    return uvloop.run(serve_forever(serve, engine))
