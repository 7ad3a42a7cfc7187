"""Forged metadata must not pin an instance's address past the forger (docs/cms-trust.md).

Metadata gets the bounds statuses get: a timestamp or an update_id the scheduler's clock cannot have is
refused, counted by the status reasons, and changes nothing. What a plausible forgery can still claim
does not outlast the forger: a held update_id past the clock binds nobody, and a record newer by more than
the staleness window wins whatever its update_id.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pilotfish.cms.records import Bounds
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.cms_view import metadata_implausible
from tests.unit.test_cms_validation import NOW_MS, U64_MAX
from tests.unit.test_cms_validation import Clocks as WallClocks

SKEW_MS = 5_000  # the default --cms-max-clock-skew-seconds
JUMP = 1_000_000  # the default --cms-max-update-id-jump
CEILING = (NOW_MS + SKEW_MS) * 1000  # the highest update_id a clock-counting writer may claim now


class Clocks(WallClocks):
    """The scheduler's clocks, moved by hand, and the wall clock in microseconds (what a llumlet counts from)."""

    @property
    def us(self) -> int:
        return int(self.wall * 1_000_000)


def core(clocks: Clocks, **kw: Any) -> SchedulerCore:
    config = SchedulerConfig(enable_full_mode_scheduling=True, instance_staleness_seconds=10, **kw)
    return SchedulerCore(config, clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall)


def meta(update_id: int, port: int = 8000, name: str = "a", **kw: Any) -> cms_pb2.InstanceMetadata:
    fields: dict[str, Any] = {"instance_id": name, "host": "10.0.0.1", "http_port": port, "model": "m"}
    fields.update(update_id=update_id, infer_type=1, **kw)
    return cms_pb2.InstanceMetadata(**fields)


class Llumlet:
    """Numbers metadata as the llumlet's export thread does (`write_metadata`): update_id the wall clock in
    microseconds or one past the last, whichever is higher; timestamp_ms the wall clock; the writer's clock
    `ahead_ms` ahead of the scheduler's."""

    def __init__(self, clocks: Clocks, ahead_ms: int = 0, port: int = 8000) -> None:
        self.clocks, self.ahead_ms, self.port = clocks, ahead_ms, port
        self.update_id = 0

    def next(self) -> cms_pb2.InstanceMetadata:
        now_us = self.clocks.us + self.ahead_ms * 1000
        self.update_id = max(self.update_id + 1, now_us)
        return meta(self.update_id, self.port, timestamp_ms=now_us // 1000)


def address(c: SchedulerCore, name: str = "a") -> str:
    return c.instance(name).endpoint.address


def refused(c: SchedulerCore) -> dict[str, int]:
    assert c.cms is not None
    return c.cms.refused_by_reason()


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        ({"update_id": U64_MAX}, "update_id_jump"),  # the audit's pin (F2)
        ({"update_id": CEILING + JUMP + 1}, "update_id_jump"),  # past the clock and the jump from the held one
        ({"timestamp_ms": NOW_MS + SKEW_MS + 1}, "future_timestamp"),
        ({"update_id": U64_MAX, "timestamp_ms": U64_MAX}, "future_timestamp"),
    ],
)
def test_implausible_metadata_is_refused_counted_and_changes_nothing(
    forged: dict[str, int], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    clocks = Clocks()
    c = core(clocks)
    llumlet = Llumlet(clocks)
    assert c.apply_metadata(llumlet.next())
    assert c.apply_status(cms_pb2.InstanceStatus(instance_id="a", update_id=1, timestamp_ms=NOW_MS, num_waiting=3))
    caplog.set_level(logging.WARNING)
    fields = {"update_id": llumlet.update_id + 1, "timestamp_ms": NOW_MS, **forged}
    assert not c.apply_metadata(meta(port=18099, **fields))
    assert refused(c) == {reason: 1}
    assert address(c) == "10.0.0.1:8000"
    status = c.instance("a").status
    assert status is not None and status.num_waiting == 3  # the instance keeps its load
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "instance a" in lines[0] and reason in lines[0]
    # the llumlet's next record, a second later, is taken as usual
    clocks.advance(1)
    llumlet.port = 8001
    assert c.apply_metadata(llumlet.next())
    assert address(c) == "10.0.0.1:8001"


def test_implausible_metadata_of_an_unknown_instance_introduces_nothing() -> None:
    c = core(Clocks())
    assert not c.apply_metadata(meta(U64_MAX, name="ghost"))
    assert c.instances() == []
    assert c.cms is not None and c.cms.known() == set()


def test_the_audits_pin_does_not_outlast_the_forger() -> None:
    """Audit F2: one record with update_id 2^64-1 for a real engine, then the engine's own records every 2 s."""
    clocks = Clocks()
    c = core(clocks)
    llumlet = Llumlet(clocks)
    c.apply_metadata(llumlet.next())
    assert not c.apply_metadata(meta(U64_MAX, port=18099, timestamp_ms=NOW_MS))
    for _ in range(3):
        clocks.advance(2)
        assert c.apply_metadata(llumlet.next())
        assert address(c) == "10.0.0.1:8000"


def test_a_forger_cannot_climb_a_jump_at_a_time_and_its_last_step_binds_nobody() -> None:
    """The held update_id plus the jump is a base only while the held one is within the clock's ceiling:
    a forger writing record after record gets one jump past the clock at most, and the engine's next record
    replaces that one at once."""
    clocks = Clocks()
    c = core(clocks)
    llumlet = Llumlet(clocks)
    c.apply_metadata(llumlet.next())
    assert c.apply_metadata(meta(CEILING, port=18099, timestamp_ms=NOW_MS))  # plausible: the clock plus the skew
    assert c.apply_metadata(meta(CEILING + JUMP, port=18099, timestamp_ms=NOW_MS))  # a jump past the held one
    assert not c.apply_metadata(meta(CEILING + 2 * JUMP, port=18099, timestamp_ms=NOW_MS))
    assert refused(c) == {"update_id_jump": 1}
    assert address(c) == "10.0.0.1:18099"  # a plausible forgery is control while it lasts
    assert c.apply_metadata(llumlet.next())  # lower, but the held one is past anything the clock allows
    assert address(c) == "10.0.0.1:8000"


def test_a_forged_update_id_within_the_bounds_pins_at_most_the_staleness_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A writer counting from 1 (no clock in its ids): a forged update_id far above its count but within
    the bounds holds only until the engine's records are newer by more than the staleness window (10 s)."""
    clocks = Clocks()
    c = core(clocks)
    assert c.apply_metadata(meta(5, timestamp_ms=NOW_MS))
    assert c.apply_metadata(meta(900_000, port=18099, timestamp_ms=NOW_MS))
    clocks.advance(2)
    assert not c.apply_metadata(meta(6, timestamp_ms=NOW_MS + 2_000))  # within the window: stale
    assert address(c) == "10.0.0.1:18099"
    clocks.advance(10)
    caplog.set_level(logging.WARNING)
    assert c.apply_metadata(meta(7, timestamp_ms=NOW_MS + 12_000))
    assert address(c) == "10.0.0.1:8000"
    assert any("update_id fell from 900000 to 7" in r.getMessage() for r in caplog.records)
    assert refused(c) == {}  # taken, not refused
    assert c.apply_metadata(meta(8, timestamp_ms=NOW_MS + 14_000))  # and its sequence goes on from there


@pytest.mark.parametrize("ahead_ms", [0, 4_900, -60_000])
def test_the_llumlets_own_numbering_is_never_refused(ahead_ms: int) -> None:
    """Its clock within the skew of the scheduler's, or behind it: every record is taken, also after an
    idle hour (a jump of 3.6e9 in update_id) and after a restart (its count starts again from the clock)."""
    clocks = Clocks()
    c = core(clocks)
    llumlet = Llumlet(clocks, ahead_ms)
    for gap in (0, 2, 2, 3600, 2):
        clocks.advance(gap)
        assert c.apply_metadata(llumlet.next())
    llumlet = Llumlet(clocks, ahead_ms, port=8001)  # restarted
    clocks.advance(1)
    assert c.apply_metadata(llumlet.next())
    assert address(c) == "10.0.0.1:8001" and refused(c) == {}


def test_simple_writers_without_clocks_are_taken() -> None:
    """update_id counted from 1 (or 0) and no timestamp, as the simulator's router and benchmarks write."""
    c = core(Clocks())
    assert c.apply_metadata(meta(1))
    assert c.apply_metadata(meta(1))  # the same record again (admission re-applies it)
    assert c.apply_metadata(meta(2, port=8001))
    assert c.apply_metadata(meta(0, port=8002))
    assert address(c) == "10.0.0.1:8002" and refused(c) == {}


BOUNDS = Bounds(max_clock_skew_ms=1000, max_update_id_jump=10)
TOP = (NOW_MS + 1000) * 1000


@pytest.mark.parametrize(
    ("update_id", "timestamp_ms", "held", "reason"),
    [
        (TOP, NOW_MS + 1000, None, ""),
        (TOP + 1, 0, None, "update_id_jump"),
        (5, NOW_MS + 1001, None, "future_timestamp"),
        (TOP + 10, 0, TOP, ""),  # one jump past a held id within the ceiling
        (TOP + 11, 0, TOP, "update_id_jump"),
        (TOP + 11, 0, TOP + 1, "update_id_jump"),  # a held id past the ceiling is no base
    ],
)
def test_metadata_bounds(update_id: int, timestamp_ms: int, held: int | None, reason: str) -> None:
    record = meta(update_id, timestamp_ms=timestamp_ms)
    assert metadata_implausible(record, NOW_MS, BOUNDS, held) == reason


def test_a_virtual_clock_reading_zero_still_takes_counts_from_one() -> None:
    assert metadata_implausible(meta(1_000_000), 0, BOUNDS) == ""  # the clock plus the skew, in microseconds
    assert metadata_implausible(meta(1_000_001), 0, BOUNDS) == "update_id_jump"
