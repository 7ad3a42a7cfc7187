"""The core re-keys an index for an LRS change (a Report, a Release once admitted) only where a metric reads
the LRS."""

from __future__ import annotations

import pytest

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.types import InferType, RequestInfo

INSTANCES = 32


def _core(**flags: object) -> SchedulerCore:
    if not flags.get("enable_full_mode_scheduling"):
        return SchedulerCore(SchedulerConfig(model=["m"], instances=[f"h:{1 + k}" for k in range(INSTANCES)]))
    core = SchedulerCore(SchedulerConfig(model=["m"], **flags))  # type: ignore[arg-type]
    for k in range(INSTANCES):
        instance_id = f"i{k:02d}"
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=instance_id, host="h", http_port=1 + k, model="m"))
        core.apply_status(
            cms_pb2.InstanceStatus(
                instance_id=instance_id, update_id=1, timestamp_ms=int(core.ctx.wall_clock() * 1000),
                schedulable=True, uncomputed_prefill_tokens=100 * k,
            )
        )  # fmt: skip
    return core


def _rekeys_for_a_report(core: SchedulerCore) -> int:
    """Index re-keys the next decision makes after one request's token Report, and nothing else (a Report
    changes the LRS alone; a Release may also retire an in-flight entry, which every mode reads)."""
    core.schedule(RequestInfo("a", "m", prompt_tokens=10))
    core.rekey_changed()  # the dispatch's own change
    index = core._by_model["m"].stages[InferType.NEUTRAL].index
    assert index is not None
    calls = 0
    rekey = index.rekey

    def counted(inst: object) -> None:
        nonlocal calls
        calls += 1
        rekey(inst)  # type: ignore[arg-type]

    index.rekey = counted  # type: ignore[method-assign]
    assert core.report("a", 5, prefill_done=True)
    core.rekey_changed()
    return calls


@pytest.mark.parametrize(
    "flags",
    [
        {"scheduling_policy": "predicted-latency"},  # predicted_stall: the answers come from the statuses
        {"scheduling_policy": "load-balance"},
        {"scheduling_policy": "load-balance", "dispatch_neutral_load_metric": "predicted_stall"},
    ],
)
def test_a_full_mode_policy_rekeys_nothing_for_a_report(flags: dict[str, object]) -> None:
    assert _rekeys_for_a_report(_core(enable_full_mode_scheduling=True, **flags)) == 0


def test_lite_mode_rekeys_for_a_report() -> None:  # every lite metric reads the LRS
    assert _rekeys_for_a_report(_core()) == 1
