"""The one place Pilotfish's processes configure logging: text lines, or one JSON object a line.

`pilotfish <command> --log-format json` (every subcommand takes it, as does `pilotfish` itself) or
`PILOTFISH_LOG_FORMAT=json` (inside vLLM, where the llumlet has no command line) gives records a
log shipper parses without a pattern:

    {"ts": "2026-11-27T10:53:44.284Z", "level": "INFO", "logger": "pilotfish.scheduler", "msg": "...",
     "pid": 4242, "trace_id": "4bf92f...", "span_id": "00f067...", "exc": "Traceback ..."}

`trace_id`/`span_id` appear when a record is logged inside an OpenTelemetry span (pilotfish/tracing.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV = "PILOTFISH_LOG_FORMAT"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; extra fields given with `extra={...}` are kept."""

    _STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        out.update(_trace_fields())
        for key, value in record.__dict__.items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


def _trace_fields() -> dict[str, str]:
    from pilotfish.tracing import current_ids

    ids = current_ids()
    return {"trace_id": ids[0], "span_id": ids[1]} if ids else {}


def resolve_format(fmt: str | None) -> str:
    """The flag's value, else PILOTFISH_LOG_FORMAT, else text; ValueError on anything else."""
    value = (fmt or os.environ.get(ENV) or "text").strip().lower()
    if value not in FORMATS:
        raise ValueError(f"log format {value!r}: use one of {', '.join(FORMATS)}")
    return value


def formatter(fmt: str | None = None) -> logging.Formatter:
    return JsonFormatter() if resolve_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(level: str | int = "INFO", fmt: str | None = None, stream: Any = None) -> None:
    """Root logger: one stream handler (stderr) in the chosen format, replacing any handler set before."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else getattr(logging, level))
