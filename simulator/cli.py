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


def run_serve(args: argparse.Namespace) -> int:
    import uvloop

    from pilotfish.simulator.config import configs_from_args
    from pilotfish.simulator.serve import serve_forever

    serve, engine = configs_from_args(args)
    return uvloop.run(serve_forever(serve, engine))
