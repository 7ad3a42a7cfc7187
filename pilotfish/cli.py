"""`pilotfish`: one command, a subcommand per long-running piece.

Each subcommand lives beside its component as `<component>/cli.py` and exposes
`add_parser(subparsers)`, which registers its flags (derived from the component's config
struct) and sets `run(args) -> int`. Those modules import only what parsing needs, so
`pilotfish --help` stays fast; the heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pilotfish import __version__
from pilotfish.config import ConfigError
from pilotfish.procs import StartError

# subcommand modules, in the order `--help` lists them
SUBCOMMAND_MODULES = [
    "pilotfish.up",
    "pilotfish.scheduler.cli",
    "pilotfish.scheduler.rescheduler.cli",
    "pilotfish.ext_proc.cli",
    "pilotfish.discovery.cli",
    "pilotfish.vllm_plugin.cli",
    "pilotfish.simulator.cli",
    "pilotfish.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pilotfish",
        description="Request scheduling for fleets of vLLM engines (Envoy ext_proc + scheduler + llumlet).",
    )
    parser.add_argument("--version", action="version", version=f"pilotfish {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that component has no CLI yet
                continue
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse would blame the top-level command; name the subcommand the flag was given to.
        print(f"pilotfish {args.command}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args) or 0)
    except (ConfigError, StartError, FileNotFoundError) as exc:
        print(f"pilotfish {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
