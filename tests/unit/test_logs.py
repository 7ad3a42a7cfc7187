"""--log-format json: one place configures logging (pilotfish/logs.py), every subcommand takes the flag."""

from __future__ import annotations

import argparse
import io
import json
import logging
import subprocess
import sys

import pytest

from pilotfish import cli, logs


@pytest.fixture(autouse=True)
def _restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_lines_carry_level_logger_message_extras_and_exceptions() -> None:
    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out)
    log = logging.getLogger("pilotfish.test")
    log.info("routed %s", "r1", extra={"engine": "sim-0"})
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["level"] == "INFO" and lines[0]["logger"] == "pilotfish.test"
    assert lines[0]["msg"] == "routed r1" and lines[0]["engine"] == "sim-0"
    assert lines[0]["ts"].endswith("Z") and isinstance(lines[0]["pid"], int)
    assert lines[1]["level"] == "ERROR" and "ValueError: boom" in lines[1]["exc"]


def test_a_record_inside_a_span_names_its_trace() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pilotfish import tracing

    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out)
    assert tracing.configure_tracing(exporter=InMemorySpanExporter())
    try:
        with tracing.server_span("t", "s") as span:
            logging.getLogger("pilotfish.test").info("inside")
            trace_id = f"{span.get_span_context().trace_id:032x}"
    finally:
        tracing.shutdown_tracing()
    line = json.loads(out.getvalue())
    assert line["trace_id"] == trace_id and len(line["span_id"]) == 16


def test_text_stays_the_default_and_the_environment_picks_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(logs.ENV, raising=False)
    assert logs.resolve_format(None) == "text"
    monkeypatch.setenv(logs.ENV, "JSON")
    assert logs.resolve_format(None) == "json"
    assert logs.resolve_format("text") == "text"  # the flag wins
    monkeypatch.setenv(logs.ENV, "xml")
    with pytest.raises(ValueError, match="xml"):
        logs.resolve_format(None)


def test_every_subcommand_takes_log_format_and_otlp_endpoint() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(subparsers.choices) >= 7
    def check(subparsers: argparse._SubParsersAction, path: str) -> None:
        for name, sub in subparsers.choices.items():
            flags = {s for action in sub._actions for s in action.option_strings}
            assert {"--log-format", "--otlp-endpoint"} <= flags, f"{path} {name}"
            for action in sub._actions:
                if isinstance(action, argparse._SubParsersAction):
                    check(action, f"{path} {name}")

    check(subparsers, "pilotfish")
    args, _ = parser.parse_known_args(["sim", "serve", "--log-format", "json"])
    assert args.log_format == "json"
    args, _ = parser.parse_known_args(["--log-format", "json", "scheduler"])
    assert args.log_format == "json"  # before the subcommand too, not reset by its default


def test_a_component_logs_json_from_its_command_line() -> None:
    """A real rescheduler with Redis unreachable: its retry WARNINGs arrive as JSON lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pilotfish", "rescheduler", "--log-format", "json", "--redis-url", "redis://127.0.0.1:1/0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # blocks until the first record: a condition, not a sleep
        record = json.loads(line)
        assert record["level"] == "WARNING" and record["logger"].startswith("pilotfish.")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
