"""`pilotfish scheduler`: flags come from SchedulerConfig; heavy imports wait for `run`."""

from __future__ import annotations

import argparse
from typing import Any

from pilotfish.config import add_struct_arguments, struct_from_args
from pilotfish.scheduler.config import SchedulerConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "scheduler",
        help="the scheduler service (gRPC): picks the engine for each request",
        description="Serve Schedule/Report/Release over gRPC. Flags override the YAML file given by --config.",
    )
    add_config_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and every SchedulerConfig flag: the scheduler and the rescheduler read one YAML file."""
    parser.add_argument(
        "--config", dest="config_path", metavar="policy.yaml", help="YAML file of settings (keys as flag names)"
    )
    add_struct_arguments(parser, SchedulerConfig)


def run(args: argparse.Namespace) -> int:
    config = struct_from_args(SchedulerConfig, args, args.config_path)
    from pilotfish.scheduler.service import run_forever

    return run_forever(config)
