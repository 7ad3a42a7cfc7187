"""`pilotfish rescheduler`: the standalone rescheduler; flags come from SchedulerConfig."""

from __future__ import annotations

import argparse
from typing import Any

from pilotfish.config import struct_from_args
from pilotfish.scheduler.cli import add_config_arguments
from pilotfish.scheduler.config import SchedulerConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rescheduler",
        help="the standalone rescheduler: migrates running requests between engines",
        description="Plan migrations from the CMS (Redis) every --rescheduling-interval-ms and ask the source "
        "llumlets to migrate. Always full mode with rescheduling on (--enable-full-mode-scheduling, "
        "--enable-rescheduling and --standalone-rescheduling-mode are implied); the scheduling flags are "
        "accepted so one YAML file serves both processes. Flags override the YAML file given by --config.",
    )
    add_config_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    config = struct_from_args(SchedulerConfig, args, args.config_path)
    from pilotfish.scheduler.rescheduler.service import run_forever

    return run_forever(config)
