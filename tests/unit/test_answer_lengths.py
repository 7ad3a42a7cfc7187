"""How long an engine's answers run, in full mode: the llumlet counts the requests that leave with an answer
and its tokens, its status record carries the totals, and the scheduler counts their growth per instance as
lite mode counts its releases, so the default's stall charge (`predicted_stall`) works in both modes."""

from __future__ import annotations

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.types import RequestInfo
from pilotfish.vllm_plugin.core.state import LoadState

WALL = 1_700_000_000.0


def _core() -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(model=["m"], enable_full_mode_scheduling=True), wall_clock=lambda: WALL)
    for k, name in enumerate(("a", "b")):
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=name, host="h", http_port=1 + k, model="m"))
    return core


def _status(name: str, update_id: int, finished: int, tokens: int, **kw: object) -> cms_pb2.InstanceStatus:
    return cms_pb2.InstanceStatus(
        instance_id=name, update_id=update_id, timestamp_ms=int(WALL * 1000), schedulable=True,
        num_finished_total=finished, finished_output_tokens_total=tokens, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _answers(core: SchedulerCore, name: str) -> tuple[int, int]:
    lrs = core.instance(name).lrs
    return lrs.num_released, lrs.released_generated_tokens


def test_the_llumlet_counts_answers_and_not_requests_that_moved_away() -> None:
    state = LoadState("e")
    for rid, prompt in (("x", 100), ("y", 50), ("z", 10)):
        state.added(rid, prompt)
        state.scheduled(rid, prompt - 1)
    state.progressed("x", 107, 8)
    state.progressed("y", 53, 4)
    state.finished("x")
    state.finished("y")
    state.finished("z", answered=False)  # migrated: its answer goes on elsewhere
    state.finished("gone")  # unknown ids change nothing
    record = state.snapshot(update_id=1)
    assert (record.num_finished_total, record.finished_output_tokens_total) == (2, 12)
    # the engine's own count wins over the one held (vLLM frees a request before its last step is entered)
    state.added("w", 20)
    state.scheduled("w", 19)
    state.progressed("w", 22, 3)
    state.finished("w", num_output_tokens=4)
    assert state.snapshot(update_id=2).finished_output_tokens_total == 16


def test_status_totals_count_once_per_growth_and_afresh_after_a_restart() -> None:
    core = _core()
    assert core.apply_status(_status("a", 1, 3, 30))
    assert _answers(core, "a") == (3, 30)  # a first record's totals are all news
    assert core.apply_status(_status("a", 2, 5, 70))
    assert _answers(core, "a") == (5, 70)
    assert not core.apply_status(_status("a", 2, 9, 900))  # a duplicate counts nothing
    assert not core.apply_status(_status("a", 1, 9, 900))  # nor an older record
    assert core.apply_status(_status("a", 3, 5, 70))  # no growth, nothing counted
    assert _answers(core, "a") == (5, 70)
    # a restarted llumlet (a new epoch) counts from 0 again: its totals are new answers
    assert core.apply_status(_status("a", 1, 2, 8, epoch=int(WALL * 1000)))
    assert _answers(core, "a") == (7, 78)
    assert _answers(core, "b") == (0, 0)


def test_the_gateways_releases_do_not_count_in_full_mode() -> None:
    core = _core()
    for name in ("a", "b"):
        core.apply_status(_status(name, 1, 0, 0))
    decision = core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    assert core.report("r", 40)  # a full-mode gateway may report, but its count is not the answer's
    assert core.release("r")
    target = decision.target.instance_id
    assert _answers(core, target) == (0, 0)


def test_the_default_keeps_a_long_prompt_off_a_batch_of_short_answers() -> None:
    """Two engines decoding 8 requests each; `a` a little less loaded, but its answers run 5 tokens, `b`'s
    500: a 4,000-token prefill on `a` would stall each of its short answers past what they absorb."""
    core = _core()
    batch = {"num_running": 8, "num_running_decode": 8, "running_decode_seq_len_sum": 8 * 600}
    core.apply_status(_status("a", 1, 20, 100, **batch))
    core.apply_status(_status("b", 1, 20, 10_000, uncomputed_prefill_tokens=200, num_running_prefill=1,
                              num_running=9, num_running_decode=8, running_decode_seq_len_sum=8 * 600))  # fmt: skip
    long = core.schedule(RequestInfo("long", "m", prompt_tokens=4000))
    assert long.target.instance_id == "b"
    # a short prompt stalls nobody for long: it goes where its own first token comes first
    short = core.schedule(RequestInfo("short", "m", prompt_tokens=20))
    assert short.target.instance_id == "a"


def test_an_engine_with_no_answers_yet_goes_by_the_fleets() -> None:
    core = _core()
    core.apply_status(_status("a", 1, 0, 0))
    core.apply_status(_status("b", 1, 0, 0, num_running=1, num_running_decode=1))
    decision = core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    cold = core.instance(decision.target.instance_id)
    assert cold.lrs.fleet_output_level == -1  # no answer anywhere yet
    other = "b" if cold.instance_id == "a" else "a"
    core.apply_status(_status(other, 2, 4, 40))  # answers of 10 tokens there: the fleet's level is 8
    assert cold.lrs.fleet_output_level == 8 and cold.lrs.num_released == 0


def test_a_release_counts_the_answer_the_gateway_sized_at_the_end_in_lite_mode() -> None:
    """A lite gateway reading each stream to its first token reports 1 token, then tells the answer's
    length with the release: that length is the answer counted, never less than the last report."""
    core = SchedulerCore(SchedulerConfig(model=["m"], instances=["a=h:1"]))
    core.schedule(RequestInfo("r", "m", prompt_tokens=10))
    assert core.report("r", 1, True)
    assert core.release("r", answer_tokens=120)
    assert _answers(core, "a") == (1, 120)
    core.schedule(RequestInfo("s", "m", prompt_tokens=10))
    assert core.report("s", 50, True)
    assert core.release("s", answer_tokens=20)  # an estimate under what was counted counts nothing less
    assert _answers(core, "a") == (2, 170)
