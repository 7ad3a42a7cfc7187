"""One status must not set an engine's learned answer length for good (audit F7, docs/cms-trust.md).

The default policy's stall charge (`predicted_stall`) reads how long an engine's answers run from the
finished totals of its status records. What one record may add is bounded (output tokens per finished
request), a record past the bound is refused and counted, and the learned mean weighs a window of recent
answers, so a bad sample within the bound fades as real answers come in.
"""

from __future__ import annotations

from typing import Any

import pytest

from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.cms_view import MAX_ANSWER_TOKENS
from pilotfish.scheduler.view.lrs import ANSWER_WINDOW, FLEET_ANSWER_WINDOW, LocalRealtimeState
from pilotfish.scheduler.view.types import Endpoint, InstanceView, RequestInfo
from tests.unit.test_answer_lengths import WALL, _core, _status

NOW_MS = int(WALL * 1000)
# both engines decode 8 requests; `b` also has a short prefill queued, so `a` is a little less loaded
BATCH = {"num_running": 8, "num_running_decode": 8, "running_decode_seq_len_sum": 8 * 600}
B_LOAD = {**BATCH, "uncomputed_prefill_tokens": 200, "num_running_prefill": 1, "num_running": 9}


def _mean(core: SchedulerCore, name: str) -> float:
    lrs = core.instance(name).lrs
    return lrs.released_generated_tokens / lrs.num_released


def _refused(core: SchedulerCore) -> dict[str, int]:
    assert core.cms is not None
    return core.cms.refused_by_reason()


class Engine:
    """An engine's honest statuses: its finished totals grow by `per_status` answers of `length` tokens."""

    def __init__(self, core: SchedulerCore, name: str, length: int, **load: Any) -> None:
        self.core, self.name, self.length, self.load = core, name, length, load
        self.update_id = self.finished = self.tokens = 0

    def report(self, answers: int = 0, length: int | None = None) -> bool:
        self.update_id += 1
        self.finished += answers
        self.tokens += answers * (self.length if length is None else length)
        return self.core.apply_status(_status(self.name, self.update_id, self.finished, self.tokens, **self.load))


def test_the_audits_poisoned_status_is_refused_and_changes_nothing() -> None:
    """Audit F7: a status with +1 finished request and +2^62 output tokens, otherwise plausible."""
    core = _core()
    a = Engine(core, "a", 5, num_waiting=1)
    for _ in range(4):
        assert a.report(5)
    fields = {"num_waiting": 99, "admitted_request_ids": ["forged"]}
    assert not core.apply_status(_status("a", a.update_id + 1, a.finished + 1, a.tokens + 2**62, **fields))
    assert _refused(core) == {"invalid_field": 1}
    status = core.instance("a").status
    assert status is not None and status.num_waiting == 1 and status.update_id == a.update_id  # nothing changed
    assert (core.instance("a").lrs.num_released, _mean(core, "a")) == (20, 5.0)
    # the engine's next statuses are taken and counted from the one held
    assert a.report(4)
    assert (core.instance("a").lrs.num_released, _mean(core, "a")) == (24, 5.0)


@pytest.mark.parametrize(
    ("answers", "tokens", "taken"),
    [
        (1, MAX_ANSWER_TOKENS, True),
        (1, MAX_ANSWER_TOKENS + 1, False),
        (3, 3 * MAX_ANSWER_TOKENS, True),
        (3, 3 * MAX_ANSWER_TOKENS + 1, False),
        (0, MAX_ANSWER_TOKENS, True),  # tokens without a finished request: counted nowhere, but bounded too
        (0, MAX_ANSWER_TOKENS + 1, False),
    ],
)
def test_one_status_adds_at_most_the_bound_per_finished_request(answers: int, tokens: int, taken: bool) -> None:
    core = _core()
    assert core.apply_status(_status("a", 1, 10, 50))
    assert core.apply_status(_status("a", 2, 10 + answers, 50 + tokens)) is taken
    assert _refused(core) == ({} if taken else {"invalid_field": 1})


@pytest.mark.parametrize("epoch", [0, NOW_MS])
def test_a_first_record_and_a_restart_are_bounded_on_their_whole_totals(epoch: int) -> None:
    """A record with nothing held, or from a restarted llumlet (new epoch), counts its totals from 0."""
    core = _core()
    if epoch:
        assert core.apply_status(_status("a", 9, 1000, 1000))
    assert not core.apply_status(_status("a", 1, 2, 2 * MAX_ANSWER_TOKENS + 1, epoch=epoch))
    assert core.apply_status(_status("a", 1, 2, 2 * MAX_ANSWER_TOKENS, epoch=epoch))
    assert _refused(core) == {"invalid_field": 1}


def test_a_bad_sample_within_the_bound_fades_as_real_answers_come_in() -> None:
    """Answers of 5 tokens, then one record of a single answer as long as the bound allows, then real answers
    again: a lifetime mean would still read ~800 tokens after 20,000 of them."""
    core = _core()
    a = Engine(core, "a", 5)
    for _ in range(50):
        a.report(16)
    assert a.report(1, MAX_ANSWER_TOKENS)
    assert _mean(core, "a") > 10_000
    for _ in range(20_000 // 16):
        a.report(16)
    assert _mean(core, "a") < 5.5


def _poisoned_then(answers_after: int) -> str:
    """Where a long prompt goes: `a` serves 5-token answers, `b` 500-token ones (the default keeps a long
    prefill off `a`'s short answers); `a`'s figure poisoned by one bad sample, then `answers_after` real ones."""
    core = _core()
    a, b = Engine(core, "a", 5, **BATCH), Engine(core, "b", 500, **B_LOAD)
    for _ in range(50):
        a.report(16)
    b.report(20)
    a.report(1, MAX_ANSWER_TOKENS)
    for _ in range(answers_after // 16):
        a.report(16)
    b.report(0)
    return core.schedule(RequestInfo("long", "m", prompt_tokens=4000)).target.instance_id


def test_the_default_routes_as_before_once_the_bad_sample_has_faded() -> None:
    assert _poisoned_then(0) == "a"  # while it lasts: a plausible forgery is control of the figures
    assert _poisoned_then(20_000) == "b"


# -- the window itself, on the LRS ----------------------------------------------------------------------


def _lrs() -> tuple[LocalRealtimeState, InstanceView, InstanceView]:
    lrs = LocalRealtimeState(60.0, count_releases=False)
    return lrs, InstanceView(Endpoint("a", "h:1")), InstanceView(Endpoint("c", "h:2"))


def test_honest_answers_keep_their_mean_through_the_window() -> None:
    lrs, inst, _ = _lrs()
    for k in range(10 * ANSWER_WINDOW):
        lrs.answered(inst, 1, 100 + (k % 2) * 50)  # alternating 100 and 150
        assert inst.lrs.num_released <= ANSWER_WINDOW
    assert abs(inst.lrs.released_generated_tokens / inst.lrs.num_released - 125) < 0.5


def test_within_the_window_the_counts_are_the_totals() -> None:
    lrs, inst, _ = _lrs()
    lrs.answered(inst, ANSWER_WINDOW - 1, 7 * (ANSWER_WINDOW - 1))
    lrs.answered(inst, 1, 7)
    assert (inst.lrs.num_released, inst.lrs.released_generated_tokens) == (ANSWER_WINDOW, 7 * ANSWER_WINDOW)


def test_one_record_claiming_a_huge_count_weighs_at_most_the_window() -> None:
    """2^40 finished requests of 0 tokens (within the per-request bound): the mean reads 0, and comes back
    within a few windows of real answers; the fleet's level, which cold instances go by, too."""
    lrs, inst, cold = _lrs()
    lrs.dispatch("r", "m", cold, 10)  # `cold` has no answers: it goes by the fleet's level
    for _ in range(ANSWER_WINDOW):
        lrs.answered(inst, 1, 64)
    assert cold.lrs.fleet_output_level == 64
    lrs.answered(inst, 2**40, 0)
    assert inst.lrs.released_generated_tokens == 0 and cold.lrs.fleet_output_level == 0
    for _ in range(4 * FLEET_ANSWER_WINDOW):
        lrs.answered(inst, 1, 64)
    assert inst.lrs.released_generated_tokens / inst.lrs.num_released > 63
    assert cold.lrs.fleet_output_level == 32  # the power of two at or under the fleet's mean (~64, from below)
