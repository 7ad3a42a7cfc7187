"""Which engine a vLLM process serves, worked out alike by the engine core and the API server.

The llumlet (in the engine core) names its snapshot for vLLM's /metrics after its instance id, and
the stat logger (in the API server) must find it by the same name without talking to it: both
derive the id from the same settings, the same command line (multiprocessing hands the API
server's to the engine core) and the data-parallel rank.
"""

from __future__ import annotations

import socket
import sys

from pilotfish.vllm_plugin.config import LlumletConfig

DEFAULT_PORT = 8000  # vLLM's own default for --port


def argv_value(flag: str) -> str | None:
    """`--flag V` or `--flag=V` from the command line vLLM was started with (the API server's,
    which multiprocessing hands down to the engine-core process)."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def http_port(config: LlumletConfig) -> int:
    """The engine's OpenAI port: the setting, else vLLM's --port, else vLLM's default."""
    return config.http_port or int(argv_value("--port") or DEFAULT_PORT)


def instance_id(config: LlumletConfig, dp_rank: int, dp_size: int) -> str:
    """The engine's id in the CMS: the setting, else <hostname>-<http port>; -dp<rank> when vLLM
    runs data-parallel engines."""
    name = config.instance_id or f"{socket.gethostname()}-{http_port(config)}"
    return f"{name}-dp{dp_rank}" if dp_size > 1 else name
