"""`pilotfish sidecar`: flags come from SidecarConfig; heavy imports wait for `run`."""

from __future__ import annotations

import argparse
from typing import Any

from pilotfish.config import add_struct_arguments, struct_from_args
from pilotfish.discovery.config import SidecarConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sidecar",
        help="the discovery sidecar: health-checks local engines and registers the healthy ones",
        description="Health-check local engine endpoints every cycle; register the healthy ones to Redis, etcd "
        "or Kubernetes and remove the unhealthy. Flags override the YAML file given by --config.",
    )
    parser.add_argument(
        "--config", dest="config_path", metavar="sidecar.yaml", help="YAML file of settings (keys as flag names)"
    )
    add_struct_arguments(parser, SidecarConfig)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    config = struct_from_args(SidecarConfig, args, args.config_path)
    import uvloop

    from pilotfish.discovery.sidecar import run_sidecar

    return uvloop.run(run_sidecar(config))
