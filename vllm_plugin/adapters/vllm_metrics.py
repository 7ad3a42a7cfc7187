"""vLLM's stat-logger plugin: the llumlet's figures on vLLM's own /metrics.

Registered as the `vllm.stat_logger_plugins` entry point `pilotfish_llumlet_metrics`. vLLM (0.32) loads
that group in its API-server process only, and instantiates an `AggregateStatLoggerBase` subclass
once with `(vllm_config, engine_indexes)`; it calls `record()` for every batch of engine outputs
and `log()` every VLLM_LOG_STATS_INTERVAL (10 s). The llumlet runs in the engine-core process, so
the figures come through its snapshot file (core/metrics_snapshot.py), read here by
core/snapshot_metrics.py.

Inert (no family registered, nothing read) unless this command line selects the llumlet's
scheduler class and the settings enable it with `PILOTFISH_VLLM_METRICS` on. Never raises into
vLLM: the first unexpected error is logged and the logger goes quiet.

Side effect of the entry point, whatever the settings: vLLM keeps its engine statistics (and its
own Prometheus families) even under --disable-log-stats when any stat-logger plugin is installed;
only its periodic log line stays off. VLLM_PLUGINS=pilotfish_llumlet (the general plugin, without
this one) leaves vLLM's statistics as they were.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from pilotfish.vllm_plugin import llumlet_selected
from pilotfish.vllm_plugin.adapters import vllm_identity
from pilotfish.vllm_plugin.config import config_from_env
from pilotfish.vllm_plugin.core.metrics_snapshot import snapshot_path
from pilotfish.vllm_plugin.core.snapshot_metrics import SnapshotMetrics

log = logging.getLogger("pilotfish.llumlet")


def _model_name(vllm_config: VllmConfig) -> str:
    """vLLM's `model_name` label: the first served name, else the model (as vLLM's own families)."""
    model_config: Any = vllm_config.model_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    return str(served or getattr(model_config, "model", ""))


class LlumletStatLogger(AggregateStatLoggerBase):
    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        self.metrics: SnapshotMetrics | None = None
        if not llumlet_selected():
            return
        try:
            config = config_from_env()
        except Exception as exc:  # the engine core refuses the same settings, naming the variable
            log.warning("pilotfish llumlet: no pilotfish_llumlet_* metrics: %s", exc)
            return
        if not (config.enabled and config.vllm_metrics):
            return
        dp_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        snapshots = {}
        for index in engine_indexes or [0]:
            engine = vllm_identity.instance_id(config, index, dp_size)
            snapshots[engine] = snapshot_path(config, engine)
        self.metrics = SnapshotMetrics(_model_name(vllm_config), snapshots, config.metrics_interval_ms / 1000)
        log.info(
            "pilotfish llumlet: pilotfish_llumlet_* on vLLM's /metrics from %s",
            ", ".join(str(p) for p in snapshots.values()),
        )

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if self.metrics is not None:
            self._guarded(self.metrics.maybe_refresh)

    def log(self) -> None:
        if self.metrics is not None:
            self._guarded(self.metrics.refresh)

    def log_engine_initialized(self) -> None:
        self.log()

    def _guarded(self, refresh: Any) -> None:
        try:
            refresh()
        except Exception:  # ours to contain: vLLM calls this from its output loop
            log.exception("pilotfish llumlet: pilotfish_llumlet_* metrics stopped after an error")
            self.metrics = None
