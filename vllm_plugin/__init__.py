"""The llumlet: Pilotfish's vLLM plugin (entry point `vllm.general_plugins`).

`register()` runs in every process of every vLLM program in the environment and does nothing but
check the settings: the llumlet itself starts inside the engine-core process, from the scheduler
class selected with `--scheduler-cls pilotfish.vllm_plugin.LlumletScheduler`. A bad `PILOTFISH_*`
setting stops only a process whose command line selects that class (one line naming the
variable); any other vLLM process logs it once and runs on, and the scheduler class refuses the
setting again where it is built. With PILOTFISH_CMS_URL unset both are inert. Nothing here
imports vLLM until that class is asked for, so the package imports anywhere.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("pilotfish.llumlet")

_SCHEDULERS = ("LlumletScheduler", "LlumletSyncScheduler", "LlumletAsyncScheduler")
_SCHEDULER_FLAGS = ("--scheduler-cls", "--scheduler_cls")


def llumlet_selected(argv: Sequence[str] | None = None) -> bool:
    """True when the command line selects one of this package's scheduler classes
    (`--scheduler-cls pilotfish.vllm_plugin.X` or `--scheduler-cls=...`). vLLM's engine-core and
    worker processes carry the frontend's command line (fork, or spawn's copied sys.argv)."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in _SCHEDULER_FLAGS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.strip().startswith(__name__ + "."):
            return True
    return False


def register(argv: Sequence[str] | None = None) -> None:
    """vLLM's general-plugin hook. vLLM calls it, unguarded, in every process of every vLLM program
    in the environment, so a bad setting raises only where the llumlet is selected (fail fast, one
    line naming the variable); elsewhere it is logged and ignored."""
    from pilotfish.vllm_plugin.config import config_from_env

    try:
        config = config_from_env()
    except Exception as exc:  # a ConfigError naming the variable; anything else is ours to contain too
        if llumlet_selected(argv):
            raise
        log.warning(
            "pilotfish llumlet: ignoring bad settings in a vLLM process that does not use it "
            "(no --scheduler-cls %s.LlumletScheduler): %s",
            __name__,
            exc,
        )
        return
    if config.enabled:
        log.debug("pilotfish llumlet configured for cluster %s", config.cluster)


def __getattr__(name: str) -> Any:
    # `--scheduler-cls pilotfish.vllm_plugin.LlumletScheduler` resolves through here, lazily.
    if name in _SCHEDULERS:
        from pilotfish.vllm_plugin.adapters import vllm_v1

        return getattr(vllm_v1, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
