"""The virtual-time cluster: a smoke run per router, the observation delay, the status record,
and the same per-request schedule as the HTTP driver for the same trace and decisions."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from pilotfish.simulator.cluster import (
    ClusterConfig,
    ClusterSim,
    EngineStatus,
    RoundRobinRouter,
    Router,
    RouteRequest,
    router_by_name,
)
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.fleet import serve_engines
from pilotfish.simulator.replay import ReplayConfig, replay
from pilotfish.simulator.traces import SharedPrefixSpec, shared_prefix_trace

PROFILE = StepTimeProfile(name="t", base_ms=2.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.05,
                          context_ms_per_token=0.0005)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=256, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=512)


def trace(n_groups: int = 3, per_group: int = 4, rate: float = 40.0, seed: int = 1) -> list[Any]:
    return shared_prefix_trace(SharedPrefixSpec(groups=n_groups, prompts_per_group=per_group,
                                                system_prompt_length=(24, 60), question_length=(4, 20),
                                                output_length=(2, 6), rate=rate, seed=seed))


@pytest.mark.parametrize("router", ["round-robin", "least-requests", "scheduler", "scheduler:round-robin"])
def test_every_request_finishes_with_consistent_times(router: str) -> None:
    requests = trace()
    result = ClusterSim(ClusterConfig(engines=3, engine=ENGINE, profile=PROFILE), router_by_name(router)).run(requests)
    assert len(result.records) == len(requests) and not result.rejected
    by_id = {r.request_id: r for r in requests}
    for rec in result.records:
        assert rec.finished is not None and rec.first_token is not None and rec.scheduled is not None
        assert rec.arrival <= rec.scheduled <= rec.first_token <= rec.finished
        assert rec.num_output_tokens == by_id[rec.request_id].output_length
        assert rec.finish_reason == "length"
    summary = result.summary()
    assert summary["finished"] == len(requests) and summary["ttft"]["p50"] > 0
    assert summary["prefix_cache_hit_rate"] > 0  # groups share system prompts
    # the same run twice gives the same schedule
    again = ClusterSim(ClusterConfig(engines=3, engine=ENGINE, profile=PROFILE), router_by_name(router)).run(requests)
    assert [(r.engine, r.first_token, r.finished) for r in again.records] == \
        [(r.engine, r.first_token, r.finished) for r in result.records]


class Spy(Router):
    wants_status = True

    def __init__(self) -> None:
        self.heard: list[tuple[str, str, float, float]] = []  # (what, id, event time, heard at)
        self.statuses: list[tuple[int, Any, float]] = []
        self.now = 0.0

    def route(self, request: RouteRequest, now: float) -> int:
        self.now = now
        return 0

    def on_finish(self, request_id: str, engine: int, now: float, answer_tokens: int = 0) -> None:
        self.heard.append(("finish", request_id, now, self.now))

    def on_status(self, engine: int, status: Any, now: float) -> None:
        self.statuses.append((engine, status, now))


def test_the_router_hears_engine_events_late_by_the_delay() -> None:
    requests = trace(2, 3, rate=5.0)
    spy = Spy()
    result = ClusterSim(ClusterConfig(engines=1, engine=ENGINE, profile=PROFILE, observation_delay=0.25), spy).run(
        requests)
    finished = {r.request_id: r.finished for r in result.records}
    assert len(spy.heard) == len(requests)
    for _, rid, heard_time, _ in spy.heard:
        assert heard_time == pytest.approx(finished[rid] + 0.25)
    assert spy.statuses and all(s.instance_id == "sim-0" for _, s, _ in spy.statuses)
    update_ids = [s.update_id for _, s, _ in spy.statuses]
    assert update_ids == sorted(update_ids) and len(set(update_ids)) == len(update_ids)


def test_engine_status_is_the_llumlets_record_on_the_virtual_clock() -> None:
    core = V1Engine(ENGINE, PROFILE)
    clock = [0.0]
    status = EngineStatus(core, "e0", lambda: clock[0])
    core.add_request(SimRequest("a", list(range(40)), 3), 0.0)
    core.add_request(SimRequest("b", list(range(100, 110)), 3), 0.0)
    core.step(0.0)  # 32-token budget: a gets 32 of its 40 prompt tokens, b waits
    clock[0] = 1.5
    record = status.snapshot(1.5, update_id=7)
    assert (record.instance_id, record.update_id, record.timestamp_ms) == ("e0", 7, 1500)
    assert (record.num_running, record.num_waiting) == (1, 1)
    assert (record.num_running_prefill, record.num_running_decode, record.num_waiting_prefill) == (1, 0, 1)
    assert record.uncomputed_prefill_tokens == 8 + 10
    assert record.used_kv_tokens == 32 and record.total_kv_tokens == 256 * 4
    assert record.step_id == 1 and record.last_step_prefill_tokens == 32
    assert list(record.admitted_request_ids) == ["a", "b"]  # admitted 1.5 s ago: inside the 2 s window
    clock[0] = 2.5
    assert list(status.snapshot(2.5).admitted_request_ids) == []  # aged out of the window, as the llumlet's


class ScheduleLog(EngineObserver):
    """Per request, what the engine did to it, in step order: no times, only the schedule."""

    def __init__(self, log: dict[str, list[Any]]) -> None:
        self.log = log

    @staticmethod
    def key(request: SimRequest) -> str:
        return request.request_id.split("#", 1)[0]  # the HTTP driver appends "#<seq>"

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.log[self.key(request)].append(("hit", num_tokens))

    def prefill_chunk(self, request: SimRequest, num_tokens: int, now: float) -> None:
        self.log[self.key(request)].append(("prefill", num_tokens))

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        self.log[self.key(request)].append(("token", token_id))

    def preempted(self, request: SimRequest, now: float) -> None:
        self.log[self.key(request)].append(("preempted",))


async def test_http_and_virtual_drivers_schedule_each_request_the_same() -> None:
    """Same trace, same decisions: each request gets the same cache hit, prefill chunks and tokens.

    Arrivals are spaced wider than a request's life, so the real-time driver's wake-up jitter
    cannot change which step a request joins; prefixes are shared across requests and prompts
    are longer than the 32-token budget, so hits and chunking are both exercised.
    """
    requests = trace(2, 4, rate=1.0, seed=3)
    requests = [r.__class__(r.request_id, 0.12 * i, r.input_length, r.output_length, r.segments)
                for i, r in enumerate(requests)]
    virtual_log: dict[str, list[Any]] = defaultdict(list)
    sim = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), RoundRobinRouter(),
                     observers=[lambda i, core: core.add_observer(ScheduleLog(virtual_log))])
    result = sim.run(requests)
    decisions = {r.request_id: r.engine for r in result.records}
    assert set(decisions.values()) == {0, 1}

    http_log: dict[str, list[Any]] = defaultdict(list)
    fast = EngineConfig(**{**{f: getattr(ENGINE, f) for f in ENGINE.__struct_fields__},
                           "step_ms": PROFILE.base_ms, "prefill_ms_per_token": PROFILE.prefill_ms_per_token,
                           "decode_ms_per_token": PROFILE.decode_ms_per_token})
    async with serve_engines(ServeConfig(engines=2, base_port=0), fast) as fleet:
        for e in fleet.engines:
            e.core.add_observer(ScheduleLog(http_log))
        records = await replay(requests, fleet.urls, lambda r: decisions[r.request_id],
                               ReplayConfig(text_prompts=True))
    assert all(r.finished is not None and r.num_output_tokens == r.output_length for r in records)
    assert dict(http_log) == dict(virtual_log)
    hits = [entry[1] for log in virtual_log.values() for entry in log if entry[0] == "hit"]
    assert len(hits) == len(requests) and any(h > 0 for h in hits)
    assert any(entry == ("prefill", 32) for log in virtual_log.values() for entry in log)  # chunked


def test_a_slow_engine_takes_its_scale_times_as_long_for_each_request() -> None:
    # requests far apart, so none waits for another: every step of a request on the slow engine is 3x
    requests = trace(2, 3, rate=0.01)
    fast = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), router_by_name("round-robin"))
    mixed = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE, step_scales=(1.0, 3.0)),
                       router_by_name("round-robin"))
    before, after = fast.run(requests).records, mixed.run(requests).records
    assert [r.engine for r in before] == [r.engine for r in after]
    for was, now in zip(before, after, strict=True):
        scale = 3.0 if now.engine == 1 else 1.0
        assert now.first_token - now.arrival == pytest.approx(scale * (was.first_token - was.arrival))
        assert now.finished - now.arrival == pytest.approx(scale * (was.finished - was.arrival))
    assert {r.engine for r in after} == {0, 1}


@pytest.mark.parametrize("scales", [(1.0,), (1.0, 0.0), (1.0, 2.0, 3.0)])
def test_step_scales_need_one_positive_scale_per_engine(scales: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="step_scales"):
        ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE, step_scales=scales),
                   router_by_name("round-robin"))


def test_prompt_hashes_kept_per_process_give_the_same_run() -> None:
    from pilotfish.simulator.cluster import driver
    from pilotfish.simulator.engine.block_hash import block_hashes
    from pilotfish.simulator.traces.prompts import prompt_token_ids

    kept = driver._prompt_block_hashes
    requests = trace(3, 4)

    def run() -> list[tuple[int, float, float]]:
        result = ClusterSim(ClusterConfig(engines=3, engine=ENGINE, profile=PROFILE),
                            router_by_name("scheduler")).run(requests)
        return [(r.engine, r.first_token, r.finished) for r in result.records]

    kept.cache_clear()
    cold = run()
    assert kept.cache_info().currsize == len({r.segments for r in requests})  # one entry per distinct prompt
    entry = kept(requests[0].segments, ENGINE.block_size)
    assert entry.tolist() == block_hashes(prompt_token_ids(requests[0]), ENGINE.block_size)
    hits = kept.cache_info().hits
    assert run() == cold  # every prompt's hashes from the kept entries now
    assert kept.cache_info().hits - hits == len(requests)
    kept.cache_clear()


def test_a_prompt_builder_of_its_own_is_hashed_each_time() -> None:
    from pilotfish.simulator.cluster import driver
    from pilotfish.simulator.traces.prompts import prompt_token_ids

    driver._prompt_block_hashes.cache_clear()
    requests = trace(2, 3)
    result = ClusterSim(ClusterConfig(engines=2, engine=ENGINE, profile=PROFILE), RoundRobinRouter(),
                        prompt_builder=lambda r: list(prompt_token_ids(r))).run(requests)
    assert len(result.records) == len(requests)
    assert driver._prompt_block_hashes.cache_info().currsize == 0  # its tokens need not follow from the segments
