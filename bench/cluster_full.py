"""Pilotfish full mode on the virtual-time cluster: the real core fed as the CMS would feed it.

The committed `SchedulerRouter` registers engines as static `--instances`, which full mode
refuses (its instances come from the CMS). This router registers each engine the way a
llumlet's metadata record does, hands the core every engine status the cluster builds after
each step (`apply_status`), and the engines' KV events (`apply_kv_event`), drained before each
decision. The status delay is the cluster's `observation_delay`; KV events arrive with zero delay.
An engine with no step to report still writes its (idle) status at start and then every
`heartbeat` seconds, as the llumlet refreshes its record, so the core never sees it stale.

`inflight_account=False` is a bench-only ablation, not a scheduler flag: each dispatch's
in-flight account entry is released as soon as the core makes it, so the core ranks on engine
statuses alone (what full mode would be without the dispatch-time account). The LRS and the
prefix index still record the dispatch, as they do with the account on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pilotfish.simulator.cluster import RouteRequest, SchedulerRouter
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.scheduler import V1Engine


class FullModeRouter(SchedulerRouter):
    def __init__(self, config: Any, engine: EngineConfig, *, kv_events: bool = True, heartbeat: float = 1.0,
                 node_ids: Sequence[str] = (), inflight_account: bool = True) -> None:
        super().__init__(config, apply_status=self._apply)
        self.engine = engine
        self.inflight_account = inflight_account
        self.node_ids = list(node_ids)  # engine i's node (its metadata's failure domain); empty: none
        self.kv_events = kv_events
        self.heartbeat = heartbeat
        self.cores: dict[int, V1Engine] = {}
        self.engines: dict[int, Any] = {}
        # the router numbers every status it applies, step reports and heartbeats alike, so the
        # core's "newer update_id wins" holds across both sources
        self._update_ids: list[int] = []
        self._stamped: list[float] = []
        self.unschedulable: set[int] = set()  # engines whose heartbeats say schedulable = false

    def attach_engines(self, engines: list[Any]) -> None:
        self.engines = dict(enumerate(engines))

    def _apply(self, core: Any, instance_id: str, status: Any) -> None:
        k = self._index[instance_id]
        self._update_ids[k] += 1
        status.update_id = self._update_ids[k]
        self._stamped[k] = status.timestamp_ms / 1000.0
        core.apply_status(status)

    def _heartbeats(self, now: float) -> None:
        from pilotfish.simulator.cluster import instance_status

        for k, core in self.cores.items():
            engine = self.engines.get(k)
            idle = engine is None or engine.step_end is None
            if idle and now - self._stamped[k] >= self.heartbeat:
                status = instance_status(core, self._ids[k], update_id=0, now=now,
                                         schedulable=k not in self.unschedulable)
                self._apply(self.core, self._ids[k], status)

    def set_schedulable(self, engine: int, schedulable: bool) -> None:
        if schedulable:
            self.unschedulable.discard(engine)
        else:
            self.unschedulable.add(engine)

    def refresh(self, now: float) -> None:
        """Bring the core's view to `now` as a decision would (heartbeats, KV events), for a rescheduler."""
        self._now = now
        self._heartbeats(now)
        if self.kv_events:
            self._drain_kv_events()

    def observe_engine(self, index: int, core: V1Engine) -> None:
        self.cores[index] = core
        if self.kv_events:
            core.enable_kv_events()

    def bind(self, engine_ids: list[str]) -> None:
        from pilotfish.protos.cms_pb2 import InstanceMetadata
        from pilotfish.scheduler.core import SchedulerCore

        config = msgspec.structs.replace(self.config, instances=[], model=[])
        # the CMS records carry virtual-time stamps, so staleness is judged on the virtual clock too
        self.core = SchedulerCore(config, clock=lambda: self._now, wall_clock=lambda: self._now)
        e = self.engine
        for i, eid in enumerate(engine_ids):
            self.core.apply_metadata(InstanceMetadata(
                instance_id=eid, host=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", http_port=8000, model=self.model,
                block_size=e.block_size, num_gpu_blocks=e.num_gpu_blocks,
                max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs, update_id=1,
                node_id=self.node_ids[i] if i < len(self.node_ids) else ""))
        self._index = {eid: i for i, eid in enumerate(engine_ids)}
        self._ids = list(engine_ids)
        self._update_ids = [0] * len(engine_ids)
        self._stamped = [-self.heartbeat] * len(engine_ids)
        if self.cores:
            self._heartbeats(0.0)

    def route(self, request: RouteRequest, now: float) -> int:
        self._now = now
        self._heartbeats(now)
        if self.kv_events:
            self._drain_kv_events()
        engine = super().route(request, now)
        if not self.inflight_account:
            self.core.account.release(request.request_id)  # type: ignore[attr-defined]
        return engine

    def _drain_kv_events(self) -> None:
        core = self.core
        for k, engine in self.cores.items():
            events = engine.take_kv_events()
            if not events:
                continue
            iid = self._ids[k]
            # runs of one kind, in order: a block evicted and stored again in one step ends up stored
            run_kind, run = events[0][0], []
            for event in [*events, ("end",)]:
                if event[0] != run_kind:
                    if run_kind == "stored":
                        core.apply_kv_event(iid, stored=run)  # type: ignore[attr-defined]
                    else:
                        core.apply_kv_event(iid, removed=run)  # type: ignore[attr-defined]
                    run_kind, run = event[0], []
                if event[0] == "stored":
                    run.extend(event[1])
                elif event[0] == "removed":
                    run.append(event[1])
