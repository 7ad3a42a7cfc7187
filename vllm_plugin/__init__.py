"""The llumlet: Pilotfish's vLLM plugin (entry point `vllm.general_plugins`).

`register()` runs in every process vLLM starts and does nothing but check the settings: the
llumlet itself starts inside the engine-core process, from the scheduler class selected with
`--scheduler-cls pilotfish.vllm_plugin.LlumletScheduler`. With PILOTFISH_CMS_URL unset both are
inert. Nothing here imports vLLM until that class is asked for, so the package imports anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pilotfish.llumlet")

_SCHEDULERS = ("LlumletScheduler", "LlumletSyncScheduler", "LlumletAsyncScheduler")


def register() -> None:
    """vLLM's general-plugin hook: fail fast on bad settings, in the process that parses flags."""
    from pilotfish.vllm_plugin.config import config_from_env

    config = config_from_env()  # raises ConfigError naming the variable
    if config.enabled:
        log.debug("pilotfish llumlet configured for cluster %s", config.cluster)


def __getattr__(name: str) -> Any:
    # `--scheduler-cls pilotfish.vllm_plugin.LlumletScheduler` resolves through here, lazily.
    if name in _SCHEDULERS:
        from pilotfish.vllm_plugin.adapters import vllm_v1

        return getattr(vllm_v1, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
