"""`pilotfish`: one command, a subcommand per long-running piece.

Each subcommand lives beside its component as `<component>/cli.py` and exposes
`add_parser(subparsers)`, which registers its flags (derived from the component's config
struct) and sets `run(args) -> int`. Those modules import only what parsing needs, so
`pilotfish --help` stays fast; the heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    _add_observability_flags(parser, None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that component has no CLI yet
                continue
            raise
        module.add_parser(subparsers)
    _add_to_subcommands(subparsers)
    return parser


def _add_to_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Every subcommand, nested ones too (`sim serve`), takes the flags after its name."""
    for sub in subparsers.choices.values():
        _add_observability_flags(sub, argparse.SUPPRESS)
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_to_subcommands(action)


def _add_observability_flags(parser: argparse.ArgumentParser, default: object) -> None:
    """--log-format and --otlp-endpoint, before or after the subcommand (pilotfish/logs.py, pilotfish/tracing.py)."""
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=default,
        help="log lines as text or one JSON object each (default: $PILOTFISH_LOG_FORMAT, else text)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=default,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/gRPC to URL, e.g. http://collector:4317 (default: "
        "$PILOTFISH_OTLP_ENDPOINT; none: no tracing; needs pip install pilotfish[tracing])",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse would blame the top-level command; name the subcommand the flag was given to.
        print(f"pilotfish {args.command}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    from pilotfish.logs import ENV as LOG_FORMAT_ENV
    from pilotfish.logs import configure_logging, resolve_format
    from pilotfish.tracing import ENV as OTLP_ENV
    from pilotfish.tracing import configure_tracing, shutdown_tracing

    try:
        log_format = resolve_format(args.log_format)
    except ValueError as exc:
        print(f"pilotfish {args.command}: error: ${LOG_FORMAT_ENV}: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, log_format)
    endpoint = args.otlp_endpoint if args.otlp_endpoint is not None else os.environ.get(OTLP_ENV, "")
    # the children `pilotfish up` starts log and trace the same way
    os.environ[LOG_FORMAT_ENV] = log_format
    if endpoint:
        os.environ[OTLP_ENV] = endpoint
    configure_tracing(endpoint, service=f"pilotfish-{args.command}")
    try:
        return int(args.run(args) or 0)
    except (ConfigError, StartError, FileNotFoundError) as exc:
        print(f"pilotfish {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown_tracing()  # flush what is batched


if __name__ == "__main__":
    sys.exit(main())
