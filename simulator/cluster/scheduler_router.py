"""The real `SchedulerCore`, in-process on the virtual-time cluster: one adapter for both modes.

    SchedulerRouter(SchedulerConfig(scheduling_policy="load-balance"))               # lite
    SchedulerRouter(SchedulerConfig(enable_full_mode_scheduling=True), engine=cfg)   # full
    sim = ClusterSim(config, router, observers=[router.observe_engine])

The mode is the config's. Both drive the core by Schedule, Report and Release exactly as ext_proc
does, on the cluster's virtual clock, and map its decision back to the engine index.

Lite mode registers the engines as static instances (`<engine id>=10.0.<i>:8000`-style addresses).
Full mode refuses static instances (its instances come from the CMS): each engine is registered
as its llumlet's metadata record does, from `engine`; every status the cluster hears is applied
(the llumlet's own record, simulator/cluster/status.py, with the cluster's observation delay and
its refreshes of idle engines); the engines' KV events (`kv_events`) are drained before each
decision and each rescheduling round (`refresh`), with no delay. Records carry virtual-time
stamps, so staleness is judged on the virtual clock too.

`inflight_account=False` is a bench-only ablation, not a scheduler flag: each dispatch's in-flight
account entry is released as soon as the core makes it, so the core ranks on engine statuses
alone (what full mode would be without the dispatch-time account). The LRS and the prefix index
still record the dispatch, as they do with the account on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from pilotfish.simulator.cluster.routers import Router, RouteRequest
from pilotfish.simulator.config import EngineConfig

if TYPE_CHECKING:
    from pilotfish.protos.cms_pb2 import InstanceStatus
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore
    from pilotfish.simulator.engine.scheduler import V1Engine


def engine_address(i: int) -> str:
    """Engine i's host: unique per engine, the same in both modes."""
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"


class SchedulerRouter(Router):
    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        engine: EngineConfig | None = None,
        model: str = "pilotfish-sim",
        kv_events: bool = True,
        node_ids: Sequence[str] = (),
        inflight_account: bool = True,
    ) -> None:
        """`engine`: what each engine's metadata states (full mode; default EngineConfig()).
        `node_ids`: engine i's node, its metadata's failure domain (full mode; empty: none)."""
        from pilotfish.scheduler.config import SchedulerConfig

        self.config = config or SchedulerConfig()
        self.full = self.config.enable_full_mode_scheduling
        self.wants_status = self.full
        self.engine = engine or EngineConfig()
        self.model = model
        self.kv_events = kv_events and self.full
        self.node_ids = list(node_ids)
        self.inflight_account = inflight_account
        self._now = 0.0
        self._core: SchedulerCore | None = None
        self._index: dict[str, int] = {}
        self._ids: list[str] = []
        self._engines: dict[int, V1Engine] = {}  # observed engines, whose KV events are drained

    @property
    def core(self) -> SchedulerCore:
        if self._core is None:
            raise RuntimeError("the router has no core before bind()")
        return self._core

    def observe_engine(self, index: int, core: V1Engine) -> None:
        """ClusterSim's `observers` hook: engine `index`'s KV events reach the prefix index (full mode)."""
        if self.kv_events:
            self._engines[index] = core
            core.enable_kv_events()

    def bind(self, engine_ids: list[str]) -> None:
        from pilotfish.scheduler.core import SchedulerCore

        self._index = {eid: i for i, eid in enumerate(engine_ids)}
        self._ids = list(engine_ids)
        if not self.full:
            instances = [f"{eid}={engine_address(i)}:8000" for i, eid in enumerate(engine_ids)]
            config = msgspec.structs.replace(self.config, instances=instances, model=[])
            self._core = SchedulerCore(config, clock=self._clock)
            return
        from pilotfish.protos.cms_pb2 import InstanceMetadata

        config = msgspec.structs.replace(self.config, instances=[], model=[])
        self._core = core = SchedulerCore(config, clock=self._clock, wall_clock=self._clock)
        e = self.engine
        for i, eid in enumerate(engine_ids):
            core.apply_metadata(InstanceMetadata(
                instance_id=eid, host=engine_address(i), http_port=8000, model=self.model,
                block_size=e.block_size, num_gpu_blocks=e.num_gpu_blocks,
                max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs, update_id=1,
                node_id=self.node_ids[i] if i < len(self.node_ids) else ""))  # fmt: skip

    def _clock(self) -> float:
        return self._now

    def refresh(self, now: float) -> None:
        """Bring the core's view to `now` as a decision would (KV events), for a rescheduler."""
        self._now = now
        if self.kv_events:
            self._drain_kv_events()

    def route(self, request: RouteRequest, now: float) -> int:
        from pilotfish.scheduler.view.types import RequestInfo

        self.refresh(now)
        core = self.core
        info = RequestInfo(
            request_id=request.request_id,
            model=self.model,
            prompt_tokens=request.prompt_tokens,
            prefix_block_hashes=tuple(request.block_hashes),
            prefix_block_size=request.block_size,
            max_tokens=request.max_tokens,
            stream=True,
        )
        decision = core.schedule(info)
        if not self.inflight_account:
            core.account.release(request.request_id)
        return self._index[decision.target.instance_id]

    def on_progress(self, request_id: str, engine: int, generated_tokens: int, now: float) -> None:
        self._now = now
        self.core.report(request_id, generated_tokens, True)

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        self._now = now
        self.core.release(request_id, answer_tokens=answer_tokens)

    def on_status(self, engine: int, status: InstanceStatus, now: float) -> None:
        self._now = now
        if self.full:
            self.core.apply_status(status)

    def _drain_kv_events(self) -> None:
        core = self.core
        for k, engine in self._engines.items():
            events = engine.take_kv_events()
            if not events:
                continue
            iid = self._ids[k]
            # runs of one kind, in order: a block evicted and stored again in one step ends up stored
            run_kind, run = events[0][0], []
            for event in [*events, ("end",)]:
                if event[0] != run_kind:
                    if run_kind == "stored":
                        core.apply_kv_event(iid, stored=run)
                    else:
                        core.apply_kv_event(iid, removed=run)
                    run_kind, run = event[0], []
                if event[0] == "stored":
                    run.extend(event[1])
                elif event[0] == "removed":
                    run.append(event[1])
