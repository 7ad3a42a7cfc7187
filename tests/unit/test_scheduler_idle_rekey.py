"""A server re-keys its load index when its loop is free (scheduler/idle_rekey.py): changes schedule one
re-key callback, the index is current after it, and the decisions are the ones the lazy re-key gives."""

from __future__ import annotations

import asyncio
import random

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.idle_rekey import rekey_when_idle
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.scheduler.view.types import InferType, RequestInfo

INSTANCES = 32  # over INDEX_MIN_INSTANCES: the core keeps a load index


def lite_core() -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(model=["m"], instances=[f"h:{1 + k}" for k in range(INSTANCES)]))


def full_core() -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(model=["m"], enable_full_mode_scheduling=True))
    for k in range(INSTANCES):
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=f"i{k:02d}", host="h", http_port=1 + k, model="m"))
        status(core, k, 1, random.Random(k))
    return core


def status(core: SchedulerCore, k: int, update_id: int, rng: random.Random) -> None:
    core.apply_status(
        cms_pb2.InstanceStatus(
            instance_id=f"i{k:02d}", update_id=update_id, timestamp_ms=int(core.ctx.wall_clock() * 1000),
            schedulable=True, uncomputed_prefill_tokens=rng.randrange(0, 5000),
            num_running_decode=rng.randrange(0, 16), running_decode_seq_len_sum=rng.randrange(0, 20_000),
        )
    )  # fmt: skip


class Loop:
    """A loop stand-in that keeps what call_soon is given."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def call_soon(self, callback) -> None:  # type: ignore[no-untyped-def]
        self.callbacks.append(callback)

    def run(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


def counted_rekeys(core: SchedulerCore) -> list[str]:
    index = core._by_model["m"].stages[InferType.NEUTRAL].index
    assert index is not None
    rekeyed: list[str] = []
    rekey = index.rekey

    def counted(inst) -> None:  # type: ignore[no-untyped-def]
        rekeyed.append(inst.instance_id)
        rekey(inst)

    index.rekey = counted  # type: ignore[method-assign]
    return rekeyed


def test_changes_schedule_one_rekey_and_the_next_decision_has_none_left() -> None:
    core, loop = full_core(), Loop()
    core.schedule(RequestInfo("warm", "m", prompt_tokens=10))  # builds the index
    rekey_when_idle(core, loop)  # type: ignore[arg-type]
    rekeyed = counted_rekeys(core)
    # the change from before the hook (the warm-up's dispatch) is re-keyed at the loop's next turn too
    assert len(loop.callbacks) == 1
    loop.run()
    assert len(rekeyed) == 1 and not core._dirty
    rekeyed.clear()
    rng = random.Random(1)
    for update, k in enumerate((3, 5, 3, 9), start=2):
        status(core, k, update, rng)
    assert len(loop.callbacks) == 1  # one callback for the four changes
    loop.run()
    assert sorted(rekeyed) == ["i03", "i05", "i09"]  # each changed instance once
    rekeyed.clear()
    core.schedule(RequestInfo("next", "m", prompt_tokens=10))
    assert rekeyed == []  # the decision found the index current
    # its own dispatch is a change: the next callback re-keys the engine it chose
    assert len(loop.callbacks) == 1
    loop.run()
    assert len(rekeyed) == 1


def test_the_decisions_are_the_ones_the_lazy_rekey_gives() -> None:
    for make in (lite_core, full_core):
        lazy, idle, loop = make(), make(), Loop()
        rekey_when_idle(idle, loop)  # type: ignore[arg-type]
        rng_lazy, rng_idle, prompts = random.Random(2), random.Random(2), random.Random(3)
        updates = [1] * INSTANCES
        for i in range(300):
            req = RequestInfo(f"r{i}", "m", prompt_tokens=prompts.randrange(16, 4096))
            picked = [core.schedule(req).target.instance_id for core in (lazy, idle)]
            assert picked[0] == picked[1], i
            if i >= 40:
                for core in (lazy, idle):
                    core.release(f"r{i - 40}")
            if make is full_core:
                k = prompts.randrange(INSTANCES)
                updates[k] += 1
                status(lazy, k, updates[k], rng_lazy)
                status(idle, k, updates[k], rng_idle)
            if i % 3:  # the loop is free after two decisions in three: the third finds changes pending
                loop.run()


async def test_a_server_rekeys_on_its_loop_and_stops_doing_so_when_stopped() -> None:
    server = SchedulerServer(
        SchedulerConfig(model=["m"], instances=[f"10.0.0.{k}:8000" for k in range(INSTANCES)], port=0)
    )
    core = server.core
    await server.start()
    try:
        assert core.on_rekey_due is not None
        core.schedule(RequestInfo("a", "m", prompt_tokens=10))
        assert core._dirty  # the dispatch changed the engine it chose
        await asyncio.sleep(0)  # the loop's next turn
        assert not core._dirty
    finally:
        await server.stop(grace=0)
    assert core.on_rekey_due is None


def test_a_fleet_without_an_index_schedules_no_rekey() -> None:
    # under INDEX_MIN_INSTANCES the policy scans: a callback per engine status would be a loop turn for nothing
    core = SchedulerCore(SchedulerConfig(model=["m"], instances=["h:1", "h:2"]))
    loop = Loop()
    rekey_when_idle(core, loop)  # type: ignore[arg-type]
    loop.run()  # the one it schedules as it starts
    for i in range(5):
        core.schedule(RequestInfo(f"r{i}", "m", prompt_tokens=10))
        core.release(f"r{i}")
    assert loop.callbacks == []
