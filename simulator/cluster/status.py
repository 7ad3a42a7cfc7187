"""An engine's CMS `InstanceStatus` in the virtual-time cluster: the llumlet's own record.

Each engine gets the llumlet's `LoadState`, fed by the engine's event hooks through the
translation the real-time llumlet adapter uses (simulator/load_observer.py) and stamped with the
cluster's virtual clock; no exporter, thread or Redis. The driver snapshots it after every step
(the llumlet writes on every load change) and when an idle engine's record is due a refresh, and
hands it to the router late by the observation delay. A snapshot costs the counters and the ids
admitted within the window, never a walk over the engine's requests.
"""

from __future__ import annotations

from collections.abc import Callable

from pilotfish.protos.cms_pb2 import InstanceStatus
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.load_observer import DirectBlock, LoadObserver, used_blocks_reader
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.state import LoadState


class EngineStatus:
    """The LoadState of one simulated engine, on the cluster's clock (seconds)."""

    def __init__(
        self, core: V1Engine, instance_id: str, clock: Callable[[], float], config: LlumletConfig | None = None
    ) -> None:
        config = config or LlumletConfig()
        self.state = LoadState(
            instance_id, config.admitted_window_ms, config.max_admitted_ids, clock_ns=lambda: int(clock() * 1e9)
        )
        num_blocks = core.kv.pool.num_blocks
        used_blocks = used_blocks_reader(core, num_blocks)
        core.add_observer(LoadObserver(DirectBlock(self.state), used_blocks, core.config.block_size, num_blocks))

    def snapshot(self, now: float, update_id: int = 0) -> InstanceStatus:
        """The record as the llumlet would write it at `now` (virtual seconds)."""
        return self.state.snapshot(update_id, int(now * 1000))
