"""`pilotfish ext-proc`: the Envoy external processor."""

from __future__ import annotations

import argparse

from pilotfish.config import add_struct_arguments, struct_from_args
from pilotfish.ext_proc.config import ExtProcConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ext-proc",
        help="the Envoy external processor: routes each request where the scheduler says",
        description="Envoy ext_proc gRPC server: parses OpenAI requests, asks the scheduler where each "
        "goes, counts streamed tokens, and falls back to round-robin when the scheduler is unavailable.",
    )
    parser.add_argument("--config", help="YAML file with any of the settings below")
    add_struct_arguments(parser, ExtProcConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pilotfish.ext_proc.server import serve
    from pilotfish.runtime import run_async

    config = struct_from_args(ExtProcConfig, args, args.config)
    run_async(serve(config))
    return 0
