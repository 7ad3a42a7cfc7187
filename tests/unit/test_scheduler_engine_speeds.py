"""Slow engines found and scaled (view/speed.py): from their steps in full mode, their first tokens in lite
mode; alike engines keep a scale of exactly 1."""

from __future__ import annotations

import pytest

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.view.profile import LatencyProfile
from pilotfish.scheduler.view.speed import MIN_EVIDENCE, EngineSpeeds
from pilotfish.scheduler.view.types import Endpoint, InstanceView, RequestInfo

PROFILE = LatencyProfile()


def fleet(n: int) -> list[InstanceView]:
    return [InstanceView(Endpoint(f"i{k}", f"h{k}:1")) for k in range(n)]


def steps(speeds: EngineSpeeds, inst: InstanceView, slowness: float, count: int = MIN_EVIDENCE) -> None:
    for k in range(count):
        prefill, batch, seq = 512 * (k % 3), 1 + k % 7, 1000 * (1 + k % 5)
        speeds.observe_step(inst, slowness * PROFILE.step_ms(prefill, batch, seq), prefill, batch, seq)


def test_an_engine_slower_than_the_fleet_is_scaled_by_how_much_and_told() -> None:
    told: list[str] = []
    speeds = EngineSpeeds(1.5, lambda inst: told.append(inst.instance_id), PROFILE)
    engines = fleet(8)
    for inst in engines[:7]:
        steps(speeds, inst, 1.0)
    steps(speeds, engines[7], 4.0)
    assert [inst.speed_scale for inst in engines[:7]] == [1.0] * 7  # exactly 1: ranked as without scales
    assert engines[7].speed_scale == pytest.approx(4.0)
    assert told == ["i7"]
    # it recovers: newer steps at the profile's speed outweigh the old ones, and the scale goes back to 1
    steps(speeds, engines[7], 1.0, 200)
    assert engines[7].speed_scale == 1.0 and set(told) == {"i7"}  # told at each move on the way down


def test_the_reference_is_the_fleets_fast_engines_whatever_the_profile_says() -> None:
    speeds = EngineSpeeds(1.5, lambda inst: None, PROFILE)
    engines = fleet(8)
    # every engine 3x slower than the profile, half of them 2x slower again: only those are scaled, by 2
    for k, inst in enumerate(engines):
        steps(speeds, inst, 3.0 if k % 2 == 0 else 6.0)
    for inst in engines:  # a second round, after the reference was taken over all of them
        steps(speeds, inst, 3.0 if inst.instance_id[1:] in "0246" else 6.0)
    assert [inst.speed_scale for inst in engines[0::2]] == [1.0] * 4
    assert [inst.speed_scale for inst in engines[1::2]] == pytest.approx([2.0] * 4)


def test_below_the_threshold_or_turned_off_nothing_is_scaled() -> None:
    for threshold, slowness in ((1.5, 1.4), (0.0, 10.0)):
        speeds = EngineSpeeds(threshold, lambda inst: None, PROFILE)
        engines = fleet(4)
        for inst in engines[:3]:
            steps(speeds, inst, 1.0)
        steps(speeds, engines[3], slowness)
        assert [inst.speed_scale for inst in engines] == [1.0] * 4


def test_too_little_evidence_scales_nothing_and_a_forgotten_engine_is_out_of_the_reference() -> None:
    speeds = EngineSpeeds(1.5, lambda inst: None, PROFILE)
    engines = fleet(3)
    steps(speeds, engines[0], 1.0)
    steps(speeds, engines[1], 5.0, MIN_EVIDENCE - 1)
    assert engines[1].speed_scale == 1.0
    steps(speeds, engines[1], 5.0, 1)
    assert engines[1].speed_scale == pytest.approx(5.0)
    speeds.forget("i0")
    steps(speeds, engines[2], 5.0)  # the reference is now taken among slow engines alone
    assert engines[2].speed_scale == 1.0


def test_lite_first_tokens_later_than_predicted_mark_the_engine_slow() -> None:
    speeds = EngineSpeeds(1.5, lambda inst: None, PROFILE, allowance_ms=100.0)
    engines = fleet(4)
    for _ in range(MIN_EVIDENCE):
        for inst in engines[:3]:
            speeds.observe_ttft(inst, 220.0, 200.0)  # a little late, as reports are
        speeds.observe_ttft(engines[3], 2000.0, 200.0)
    assert [inst.speed_scale for inst in engines[:3]] == [1.0] * 3
    # (2000 + 100) / (200 + 100) over (220 + 100) / (200 + 100)
    assert engines[3].speed_scale == pytest.approx(2100 / 320)


def full_core() -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(enable_full_mode_scheduling=True, model=["m"]), wall_clock=lambda: 0.0)
    for k in range(4):
        core.apply_metadata(cms_pb2.InstanceMetadata(instance_id=f"i{k}", host="h", http_port=1 + k, model="m",
                                                     update_id=1))
    return core


def test_full_mode_learns_a_slow_engine_from_its_statuses_and_sends_it_less() -> None:
    core = full_core()
    update = [1] * 4
    for step in range(1, 3 * MIN_EVIDENCE):
        for k in range(4):
            update[k] += 1
            slow = 10.0 if k == 3 else 1.0
            core.apply_status(cms_pb2.InstanceStatus(
                instance_id=f"i{k}", update_id=update[k], step_id=step, timestamp_ms=0, schedulable=True,
                last_step_duration_us=int(slow * PROFILE.step_ms(256, 4, 4000) * 1000), last_step_prefill_tokens=256,
                last_step_decode_batch=4, last_step_seq_len_sum=4000))
    assert [core.instance(f"i{k}").speed_scale for k in range(3)] == [1.0] * 3
    assert core.instance("i3").speed_scale == pytest.approx(10.0, rel=1e-3)
    # idle engines all: the slow one is the last choice, and it gets a request only when the others hold
    # ten times its work
    picks = [core.schedule(RequestInfo(f"r{n}", "m", prompt_tokens=2000)).target.instance_id for n in range(12)]
    assert "i3" not in picks
    scales = {s.labels["engine"]: s.value for s in core.registry.collect() for s in s.samples
              if s.name == "pilotfish_scheduler_engine_speed_scale"}
    assert scales["i0"] == 1.0 and scales["i3"] == pytest.approx(10.0, rel=1e-3)


def test_a_replaced_instance_keeps_its_scale() -> None:
    core = SchedulerCore(SchedulerConfig(instances=["a=h:1", "b=h:2"], model=["m"]))
    core.instance("a").speed_scale = 3.0
    core.add_instance(InstanceView(Endpoint("a", "h:9"), models=frozenset({"m"})))
    assert core.instance("a").speed_scale == 3.0


def test_lite_mode_judges_first_tokens_against_the_ttft_predicted_at_dispatch() -> None:
    now = [0.0]
    core = SchedulerCore(SchedulerConfig(instances=[f"i{k}=h:{k + 1}" for k in range(4)], model=["m"],
                                         slow_engine_ratio_lite=1.5), clock=lambda: now[0])
    for rnd in range(3 * MIN_EVIDENCE):
        # four at once, so each engine gets one; i3's first token comes ten times later than predicted
        started = now[0]
        firsts = []
        for k in range(4):
            req = RequestInfo(f"r{rnd}.{k}", "m", prompt_tokens=2000)
            target = core.schedule(req).target.instance_id
            entry = core._lrs.get(req.request_id)
            assert entry is not None and entry.predicted_ttft_ms > 0
            late = 10.0 if target == "i3" else 1.0
            firsts.append((started + entry.predicted_ttft_ms / 1000.0 * late, req.request_id))
        for at, request_id in sorted(firsts):
            now[0] = at
            core.report(request_id, 1, prefill_done=True)
        for _, request_id in firsts:
            core.release(request_id)
    assert [core.instance(f"i{k}").speed_scale for k in range(3)] == [1.0] * 3
    assert core.instance("i3").speed_scale >= 3.0
    # off (the default), the same first tokens change nothing
    plain = SchedulerCore(SchedulerConfig(instances=["a=h:1"], model=["m"]))
    plain.schedule(RequestInfo("r", "m", prompt_tokens=10))
    assert plain._lrs.get("r").predicted_ttft_ms == 0.0  # type: ignore[union-attr]
