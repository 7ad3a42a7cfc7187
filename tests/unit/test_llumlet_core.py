"""The llumlet core: every engine event moves the exported status as specified, on synthetic
events and on the simulator's engine; the export thread coalesces but never loses the latest."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.cms.records import decode_status
from pilotfish.config import ConfigError
from pilotfish.protos import cms_pb2
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.request import RequestStatus, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.llumlet_adapter import attach_llumlet
from pilotfish.vllm_plugin.config import LlumletConfig, config_from_env
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, LoadState, counter_values, status_record

# fields that identify a record rather than describe load
_VOLATILE = ("update_id", "timestamp_ms")


class FakeWriter:
    """Stands in for CmsWriter: keeps what was written; optionally slow, to force coalescing."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.statuses: list[cms_pb2.InstanceStatus] = []
        self.metadata: list[cms_pb2.InstanceMetadata] = []
        self.removed = False

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        if self.delay:
            time.sleep(self.delay)
        # what a reader gets: through the wire format and the strict decoder
        self.statuses.append(decode_status(status.SerializeToString(), status.instance_id))

    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None:
        self.metadata.append(cms_pb2.InstanceMetadata.FromString(meta.SerializeToString()))

    def remove(self) -> None:
        self.removed = True

    def close(self) -> None:
        pass


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def load_fields(status: cms_pb2.InstanceStatus) -> cms_pb2.InstanceStatus:
    copy = cms_pb2.InstanceStatus()
    copy.CopyFrom(status)
    for name in _VOLATILE:
        copy.ClearField(name)
    return copy


def config(**kw: object) -> LlumletConfig:
    return LlumletConfig(cms_url="redis://127.0.0.1:1/0", **kw)  # type: ignore[arg-type]


# ---- one table row per event class: (events applied to a state holding r0 waiting, 100-token
# prompt, on 10 x 16-token blocks) -> the figures that must change


def _base() -> LoadState:
    s = LoadState("e0")
    s.kv_usage(0, 10, 16)
    s.added("r0", 100)
    return s


EVENT_TABLE = [
    ("added", lambda s: None,
     dict(num_waiting=1, num_waiting_prefill=1, uncomputed_prefill_tokens=100, unallocated_tokens=100)),
    ("added twice is one request", lambda s: s.added("r0", 100), dict(num_waiting=1, uncomputed_prefill_tokens=100)),
    ("scheduled with a prefix hit", lambda s: s.scheduled("r0", 32),
     dict(num_waiting=0, num_running=1, num_running_prefill=1, uncomputed_prefill_tokens=68, unallocated_tokens=0)),
    ("cache hit reported apart", lambda s: (s.scheduled("r0", 0), s.cache_hit("r0", 48)),
     dict(num_running_prefill=1, uncomputed_prefill_tokens=52)),
    ("prefill chunk", lambda s: (s.scheduled("r0", 0), s.progressed("r0", 64, 0)),
     dict(num_running_prefill=1, uncomputed_prefill_tokens=36)),
    ("first token: now decoding", lambda s: (s.scheduled("r0", 0), s.progressed("r0", 100, 1)),
     dict(num_running=1, num_running_prefill=0, num_running_decode=1, uncomputed_prefill_tokens=0,
          running_decode_seq_len_sum=101)),
    ("token generated", lambda s: (s.scheduled("r0", 0), s.progressed("r0", 100, 1), s.progressed("r0", 101, 2)),
     dict(num_running_decode=1, running_decode_seq_len_sum=102)),
    ("preempted: recompute all", lambda s: (s.scheduled("r0", 0), s.progressed("r0", 100, 1), s.preempted("r0")),
     dict(num_waiting=1, num_running=0, num_running_decode=0, uncomputed_prefill_tokens=101,
          running_decode_seq_len_sum=0, num_preempted_total=1)),
    ("finished", lambda s: (s.scheduled("r0", 0), s.finished("r0")),
     dict(num_waiting=0, num_running=0, num_running_prefill=0, uncomputed_prefill_tokens=0)),
    ("finished while waiting (abort)", lambda s: s.finished("r0"), dict(num_waiting=0, uncomputed_prefill_tokens=0)),
    ("unknown ids are ignored", lambda s: (s.progressed("x", 1, 1), s.preempted("x"), s.finished("x")),
     dict(num_waiting=1, num_preempted_total=0)),
    ("blocks allocated", lambda s: s.kv_usage(7, 10, 16), dict(used_kv_tokens=112, total_kv_tokens=160)),
    ("blocks freed", lambda s: (s.kv_usage(7, 10, 16), s.kv_usage(2, 10, 16)), dict(used_kv_tokens=32)),
    ("step finished", lambda s: s.step_finished(0.0125, 300, 7, 4000),
     dict(step_id=1, last_step_duration_us=12500, last_step_prefill_tokens=300, last_step_decode_batch=7,
          last_step_seq_len_sum=4000)),
    ("not schedulable", lambda s: s.set_schedulable(False), dict(schedulable=False)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "apply", "expected"), EVENT_TABLE, ids=[row[0] for row in EVENT_TABLE])
def test_each_event_moves_the_status(name, apply, expected):
    s = _base()
    apply(s)
    status = s.snapshot(s.next_update_id())
    for field, value in expected.items():
        assert getattr(status, field) == value, field
    assert list(status.admitted_request_ids) == ["r0"]


def test_kv_usage_rides_with_the_next_change():
    s = _base()
    s.changed = False
    s.kv_usage(3, 10, 16)
    assert not s.changed  # a block allocated is no write of its own
    s.step_finished(0.01, 0, 1, 100)
    assert s.changed and s.snapshot().used_kv_tokens == 48


def test_kv_blocks_freed_without_an_event_are_a_change():
    s = _base()
    s.kv_usage(3, 10, 16)
    s.changed = False
    s.kv_usage(3, 10, 16)
    assert not s.changed  # the same figure again
    s.kv_usage(1, 10, 16)  # vLLM's delayed free after a KV transfer: no request event comes with it
    assert s.changed and s.snapshot().used_kv_tokens == 16


def test_admitted_ids_use_the_exported_name_and_age_out():
    s = LoadState("e0", admitted_window_ms=50, max_admitted_ids=2)
    s.added("cmpl-1-0-abcdef12", 5, exported_id="cmpl-1-0")
    s.added("b", 5)
    s.added("c", 5)
    assert list(s.snapshot().admitted_request_ids) == ["b", "c"]  # newest kept under the cap
    time.sleep(0.08)
    assert list(s.snapshot().admitted_request_ids) == []


def test_update_ids_increase_across_restarts():
    first = LoadState("e0")
    ids = [first.next_update_id() for _ in range(1000)]
    assert ids == sorted(set(ids))
    assert LoadState("e0").next_update_id() > ids[0]  # a restarted llumlet starts above the old one


# ---- the simulator's engine: after every step the exported status equals what the engine holds


PROFILE = StepTimeProfile(name="t", base_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.1,
                          context_ms_per_token=0.001)  # fmt: skip


def expected_from_engine(engine: V1Engine) -> dict[str, int]:
    """The status figures recomputed from the engine's own queues (the specification)."""
    running = [r for r in engine.running if r.status is RequestStatus.RUNNING]
    decode = [r for r in running if r.num_output_tokens > 0 and r.num_computed_tokens >= r.num_tokens - 1]
    prefill = [r for r in running if r not in decode]
    return {
        "num_waiting": len(engine.waiting),
        "num_running": len(running),
        "num_running_decode": len(decode),
        "num_running_prefill": len(prefill),
        "running_decode_seq_len_sum": sum(r.num_tokens for r in decode),
        "uncomputed_prefill_tokens": sum(r.num_tokens - r.num_computed_tokens for r in prefill)
        + sum(r.num_tokens for r in engine.waiting),
        "used_kv_tokens": engine.kv.pool.num_used * engine.config.block_size,
        "num_preempted_total": engine.stats().num_preemptions_total,
    }


def run_simulation(seed: int, num_requests: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                       num_gpu_blocks=num_blocks, enable_prefix_caching=True)  # fmt: skip
    engine = V1Engine(cfg, PROFILE)
    writer = FakeWriter()
    llumlet = attach_llumlet(engine, cfg, config(), "sim-0", "127.0.0.1", 8000, start=False, writer=writer)  # type: ignore[arg-type]
    shared = [rng.randrange(50) for _ in range(24)]  # a common prefix, so cache hits happen
    now = 0.0
    pending = [
        SimRequest(f"r{i}", shared[: rng.randrange(0, 24)] + [rng.randrange(50) for _ in range(rng.randrange(1, 60))],
                   max_tokens=rng.randrange(1, 30))
        for i in range(num_requests)
    ]  # fmt: skip
    steps = 0
    while (pending or engine.has_unfinished_requests()) and steps < 5000:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.add_request(pending.pop(), now)
        if engine.running and rng.random() < 0.03:
            engine.abort_request(rng.choice(engine.running).request_id, now)
        result = engine.step(now)
        now += max(result.duration, 0.001)
        steps += 1
        status = llumlet.export_once()
        got = {field: getattr(status, field) for field in expected_from_engine(engine)}
        assert got == expected_from_engine(engine), f"step {steps}"
        assert status.step_id == steps
        # the snapshot names every counter itself: the same record status_record makes of them
        state = llumlet.state
        counters = dict(zip(COUNTER_FIELDS, counter_values(state), strict=True))
        ids = [rid for _, rid in state.admitted]
        assert state.snapshot(7, 1234) == status_record("sim-0", 7, counters, ids, 1234, state.admitted_total)
    assert llumlet.state.requests == {}
    final = llumlet.export_once()
    assert (final.num_waiting, final.num_running, final.uncomputed_prefill_tokens, final.used_kv_tokens) == (0, 0, 0, 0)
    assert writer.statuses[-1].update_id == final.update_id


def test_snapshot_carries_every_counter_as_status_record_does():
    s = LoadState("sim-0", clock_ns=lambda: 0)
    s.added("r1", 10)
    for i, name in enumerate(COUNTER_FIELDS):  # a distinct value each, so a field left out shows
        setattr(s, name, (i + 1) if name != "schedulable" else False)
    counters = dict(zip(COUNTER_FIELDS, counter_values(s), strict=True))
    assert s.snapshot(3, 99) == status_record("sim-0", 3, counters, ["r1"], 99, admitted_total=1)
    assert s.snapshot(3, 99).HasField("admitted_total")  # a counting writer says so, even at 0
    assert s.snapshot(3, 99).num_waiting_prefill == s.num_waiting


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), num_requests=st.integers(1, 30), num_blocks=st.integers(64, 200))
def test_status_follows_the_simulated_engine(seed, num_requests, num_blocks):
    # small caches preempt, a shared prefix hits the cache, random aborts free mid-flight
    run_simulation(seed, num_requests, num_blocks)


def test_simulation_exercises_preemption_and_cache_hits():
    # the property test above is only as good as the paths it walks: make sure they happen
    rng_seed = 7
    cfg_blocks = 64
    engine_stats = []
    original = V1Engine.stats

    def spy(self):
        s = original(self)
        engine_stats.append(s)
        return s

    V1Engine.stats = spy  # type: ignore[method-assign]
    try:
        run_simulation(rng_seed, 30, cfg_blocks)
    finally:
        V1Engine.stats = original  # type: ignore[method-assign]
    assert engine_stats[-1].num_preemptions_total > 0
    assert engine_stats[-1].prefix_cache_hits_total > 0


# ---- the export thread: latest wins, and the latest is always written


@settings(max_examples=30, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(["add", "sched", "tok", "pre", "fin", "kv"]), st.integers(0, 7)),
                    min_size=1, max_size=300),
    delay=st.sampled_from([0.0, 0.0005, 0.003]),
)  # fmt: skip
def test_coalescing_never_loses_the_latest_state(events, delay):
    writer = FakeWriter(delay)
    llumlet = Llumlet(config(refresh_ms=100, ttl_ms=1000), "e0", cms_pb2.InstanceMetadata(), writer)  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        for kind, i in events:
            rid = f"r{i}"
            with llumlet.events() as s:
                if kind == "add":
                    s.added(rid, 10 + i)
                elif kind == "sched":
                    s.scheduled(rid, i)
                elif kind == "tok":
                    r = s.requests.get(rid)
                    if r is not None:
                        s.progressed(rid, r.num_tokens, r.num_output + 1)
                elif kind == "pre":
                    s.preempted(rid)
                elif kind == "fin":
                    s.finished(rid)
                else:
                    s.kv_usage(i, 8, 16)
        final = load_fields(llumlet.status_now())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            written = list(writer.statuses)
            if written and load_fields(written[-1]) == final:
                break
            time.sleep(0.001)
        assert written and load_fields(written[-1]) == final
        ids = [s.update_id for s in written]
        assert ids == sorted(set(ids)), "update_id must increase with every write"
        if delay:
            assert len(written) <= len(events) + 1  # coalesced, not one write per event and more
    finally:
        llumlet.stop()
    assert writer.removed
    assert writer.metadata and writer.metadata[0].instance_id == "e0"


def test_export_wakes_on_event_not_on_refresh():
    writer = FakeWriter()
    # no refresh for ten minutes: a write within the wait below can only be the event's
    llumlet = Llumlet(config(refresh_ms=600_000, ttl_ms=1_200_000), "e0", cms_pb2.InstanceMetadata(), writer)  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        wait_until(lambda: llumlet.exports >= 1, "the first write")
        with llumlet.events() as s:
            s.added("a", 3)
        wait_until(lambda: writer.statuses[-1].num_waiting == 1, "the event's write", timeout=60)
        assert len(writer.metadata) == 1  # no refresh came meanwhile
    finally:
        llumlet.stop()


class InlineWriter(FakeWriter):
    """Takes writes from the engine's thread too, or refuses them (a full socket, Redis away)."""

    def __init__(self) -> None:
        super().__init__()
        self.accept = True
        self.inline: list[cms_pb2.InstanceStatus] = []

    def try_write_status(self, status: cms_pb2.InstanceStatus) -> bool:
        if self.accept:
            self.inline.append(status)
        return self.accept


def test_deferred_events_ride_with_the_next_write():
    writer = InlineWriter()
    llumlet = Llumlet(config(refresh_ms=5000, ttl_ms=20000), "e0", cms_pb2.InstanceMetadata(), writer, step_hooks=True)  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        wait_until(lambda: llumlet.exports >= 1, "the first write")  # done, export lock released
        with llumlet.events(write=False) as s:
            s.added("a", 3)
        with llumlet.events(write=False) as s:
            s.added("b", 4)
        assert writer.inline == []
        with llumlet.events() as s:
            s.scheduled("a", 0)
        assert len(writer.inline) == 1  # one write for three events, made by the hook itself
        assert (writer.inline[0].num_waiting, writer.inline[0].num_running) == (1, 1)
        assert list(writer.inline[0].admitted_request_ids) == ["a", "b"]
        writer.accept = False  # refused: the export thread writes it instead
        with llumlet.events() as s:
            s.finished("a")
        wait_until(lambda: writer.statuses[-1].num_running == 0, "the export thread's write")
        assert llumlet.inline_exports == 1
    finally:
        llumlet.stop()


class StuckWriter(FakeWriter):
    """A write that does not return until the test lets it (Redis hanging)."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.release = threading.Event()

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        self.writing.set()
        self.release.wait(60)
        super().write_status(status)


def test_engine_thread_never_waits_for_a_slow_writer():
    writer = StuckWriter()
    llumlet = Llumlet(config(), "e0", cms_pb2.InstanceMetadata(), writer)  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        assert writer.writing.wait(30), "the export thread never wrote"
        for i in range(1000):
            with llumlet.events() as s:
                s.added(f"r{i}", 5)
        # all 1000 applied while the first write still hangs: the engine thread never waited on it
        assert not writer.release.is_set() and writer.statuses == []
        assert llumlet.status_now().num_waiting == 1000
        writer.release.set()
        wait_until(lambda: writer.statuses and writer.statuses[-1].num_waiting == 1000, "the latest state written")
    finally:
        writer.release.set()
        llumlet.stop()


def test_export_survives_writer_failures():
    class Flaky(FakeWriter):
        fail = 3

        def write_status(self, status):
            if self.fail:
                self.fail -= 1
                raise ConnectionError("redis down")
            super().write_status(status)

    writer = Flaky()
    llumlet = Llumlet(config(), "e0", cms_pb2.InstanceMetadata(), writer)  # type: ignore[arg-type]
    llumlet.start(serve_grpc=False)
    try:
        with llumlet.events() as s:
            s.added("a", 3)
        deadline = time.monotonic() + 5
        while not writer.statuses and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.statuses and writer.statuses[-1].num_waiting == 1
        assert llumlet.write_failures == 3
        assert len(writer.metadata) >= 2  # metadata re-sent after the outage
    finally:
        llumlet.stop()


# ---- settings


def test_config_from_environment():
    cfg = config_from_env({"PILOTFISH_CMS_URL": "redis://h:1/0", "PILOTFISH_TTL_MS": "4000",
                           "PILOTFISH_REFRESH_MS": "1000", "PILOTFISH_INFER_TYPE": "decode",
                           "PILOTFISH_ENGINE_THREAD_WRITES": "false"})  # fmt: skip
    assert cfg.enabled and cfg.ttl_ms == 4000 and cfg.infer_type == "decode"
    assert not cfg.engine_thread_writes
    assert not config_from_env({}).enabled and config_from_env({}).engine_thread_writes


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PILOTFISH_TTL_MS": "abc"}, "at `PILOTFISH_TTL_MS`"),  # the variable, not a flag
        ({"PILOTFISH_ENGINE_THREAD_WRITES": "sometimes"}, "bool.*PILOTFISH_ENGINE_THREAD_WRITES"),
        ({"PILOTFISH_INFER_TYPE": "both"}, "infer_type"),
        ({"PILOTFISH_TTL_MS": "1000", "PILOTFISH_REFRESH_MS": "900"}, "half"),
        ({"PILOTFISH_INSTANCE_ID": "a:b"}, "instance_id"),
    ],
)
def test_bad_settings_fail_with_the_reason(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        config_from_env(env)


def test_plugin_entry_point_is_inert_without_cms(monkeypatch):
    from pilotfish import vllm_plugin

    monkeypatch.delenv("PILOTFISH_CMS_URL", raising=False)
    before = {t.name for t in threading.enumerate()}
    assert vllm_plugin.register() is None
    # nothing started: it only checks settings (a thread another test left, such as grpc.aio's poller,
    # may end meanwhile, so only new threads count)
    assert {t.name for t in threading.enumerate()} - before == set()
    with pytest.raises(AttributeError):
        vllm_plugin.NoSuchThing  # noqa: B018


def test_readme_table_is_generated_from_the_config():
    from pathlib import Path

    from pilotfish.vllm_plugin.config import env_table

    readme = (Path(__file__).resolve().parents[2] / "vllm_plugin" / "README.md").read_text()
    assert env_table() in readme, "regenerate the table in vllm_plugin/README.md from config.env_table()"


async def test_simulator_abort_runs_on_the_engine_loop():
    import asyncio

    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_gpu_blocks=64)
    engine = V1Engine(cfg, PROFILE)
    loop = asyncio.get_running_loop()
    llumlet = attach_llumlet(engine, cfg, config(), "sim-0", "127.0.0.1", 8000, loop=loop, start=False)
    engine.add_request(SimRequest("r1", list(range(10)), max_tokens=5), loop.time())
    assert llumlet.status_now().num_waiting == 1
    aborted = await asyncio.to_thread(llumlet.abort_handler, ["r1", "nope"])  # as the gRPC thread would
    assert aborted == ["r1"]
    status = llumlet.status_now()
    assert (status.num_waiting, status.num_running) == (0, 0)


def test_a_request_waiting_through_bulk_decode_steps_does_not_decode():
    """decoded_all moves the running decodes; a request that waited through those steps, once
    scheduled and prefilled, counts its own tokens only."""
    s = LoadState("e")
    for rid in ("a", "b"):
        s.added(rid, 10)
        s.scheduled(rid, 0)
        s.progressed(rid, 10, 1)  # prefilled, one token sampled: decoding
    s.added("w", 20)
    for _ in range(5):
        s.decoded_all()
    assert (s.num_waiting, s.num_running_decode, s.running_decode_seq_len_sum) == (1, 2, 2 * (10 + 6))
    s.scheduled("w", 0)
    s.progressed("w", 20, 1)
    assert s.requests["w"].num_output == 1 and s.requests["w"].num_tokens == 21
    assert (s.num_waiting, s.num_running_decode, s.running_decode_seq_len_sum) == (0, 3, 2 * 16 + 21)
    s.finished("a")
    assert s.running_decode_seq_len_sum == 16 + 21


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), num_requests=st.integers(1, 12))
def test_decoded_all_keeps_the_same_status_as_visiting_every_request(seed, num_requests):
    """The adapter's O(1) decode step against the per-request path, over admissions, prefills,
    decode steps where some requests sit out, requests left waiting (they sit the bulk steps out),
    preemptions and finishes."""
    rng = random.Random(seed)
    bulk, visit = LoadState("e"), LoadState("e")  # bulk: decoded_all whenever it applies
    truth: dict[str, list[int]] = {}  # id -> [prompt, output, max output, running]
    for step in range(200):
        if len(truth) < num_requests and rng.random() < 0.3:
            rid = f"r{step}"
            truth[rid] = [rng.randint(1, 50), 0, rng.randint(1, 30), 0]
            for s in (bulk, visit):
                s.added(rid, truth[rid][0])
        for rid, t in truth.items():
            if not t[3] and rng.random() < 0.5:  # scheduled: its prompt (or recompute) in one chunk
                t[3] = 1
                for s in (bulk, visit):
                    s.scheduled(rid, 0)
                    s.progressed(rid, t[0] + t[1], t[1])
                t[1] += 1  # the prefill's step samples a token
                for s in (bulk, visit):
                    s.progressed(rid, t[0] + t[1] - 1, t[1])
        running = [rid for rid, t in truth.items() if t[3]]
        decoding = [rid for rid in running if truth[rid][1] > 0]
        sits_out = {rid for rid in decoding if rng.random() < 0.1}
        everyone = len(decoding) == len(running) and not sits_out  # waiting ones may remain
        for rid in decoding:
            if rid not in sits_out:
                truth[rid][1] += 1
        if everyone and decoding:
            bulk.decoded_all()
        for rid in decoding:
            if rid in sits_out:
                continue
            t = truth[rid]
            if not everyone:
                bulk.progressed(rid, t[0] + t[1] - 1, t[1])
            visit.progressed(rid, t[0] + t[1] - 1, t[1])
        for rid in list(truth):
            t = truth[rid]
            if t[3] and (t[1] >= t[2] or rng.random() < 0.02):
                del truth[rid]
                for s in (bulk, visit):
                    s.finished(rid)
            elif t[3] and rng.random() < 0.02:
                t[3] = 0
                for s in (bulk, visit):
                    s.preempted(rid)
        assert counter_values(bulk) == counter_values(visit), f"step {step}"
        assert bulk.running_decode_seq_len_sum == sum(t[0] + t[1] for t in truth.values() if t[3] and t[1])
    for rid in list(truth):
        for s in (bulk, visit):
            s.finished(rid)
    assert bulk.running_decode_seq_len_sum == bulk.uncomputed_prefill_tokens == bulk.num_running == 0


def test_decode_step_is_decoded_all_step_finished_and_kv_usage_in_one():
    one, three = LoadState("e"), LoadState("e")
    for s in (one, three):
        for rid in ("a", "b", "c"):
            s.added(rid, 10)
            s.scheduled(rid, 0)
            s.progressed(rid, 10, 1)
        s.kv_usage(5, 100, 16)
        s.changed = False
    one.decode_step(6_500, 7 * 16)
    three.decoded_all()
    three.step_finished(0.0065, 0, 3, three.running_decode_seq_len_sum - 3)
    three.kv_usage(7, 100, 16)
    assert counter_values(one) == counter_values(three)
    assert one.decode_steps == three.decode_steps == 1
    assert not one.changed  # the caller stores the step (Llumlet.decode_step)
    assert (one.last_step_decode_batch, one.last_step_seq_len_sum, one.used_kv_tokens) == (3, 3 * 11, 112)


def test_running_prefills_sit_a_bulk_decode_step_out():
    """decoded_all with a request in prefill: the decodes move by one token, the prefill does not,
    and its own visit afterwards (its chunk done, its first token sampled) counts it exactly once."""
    s = LoadState("e")
    s.added("d", 10)
    s.scheduled("d", 0)
    s.progressed("d", 10, 1)
    s.added("p", 30)
    s.scheduled("p", 16)  # the first chunk of its prompt
    assert s.prefilling == {"p"} and s.num_running_prefill == 1
    for _ in range(3):
        s.decoded_all()
    assert s.running_decode_seq_len_sum == 10 + 1 + 3 and s.requests["p"].num_output == 0
    s.progressed("p", 30, 1)  # the last chunk: prefilled, one token sampled
    assert s.prefilling == set() and (s.num_running_decode, s.running_decode_seq_len_sum) == (2, 14 + 31)
    s.decoded_all()
    s.finished("d")
    s.finished("p")
    assert (s.running_decode_seq_len_sum, s.num_running, s.uncomputed_prefill_tokens) == (0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), num_requests=st.integers(1, 12))
def test_bulk_steps_with_prefills_keep_the_same_status_as_visiting_every_request(seed, num_requests):
    """The vLLM adapter's mixed step (decoded_all, then a visit per request in prefill) against
    the per-request path, over chunked prefills, decode steps where some requests sit out
    (visited then), requests left waiting, preemptions and finishes."""
    rng = random.Random(seed)
    bulk, visit = LoadState("e"), LoadState("e")
    truth: dict[str, list[int]] = {}  # id -> [prompt, output, max output, running, computed]
    for step in range(200):
        if len(truth) < num_requests and rng.random() < 0.3:
            rid = f"r{step}"
            truth[rid] = [rng.randint(1, 50), 0, rng.randint(1, 30), 0, 0]
            for s in (bulk, visit):
                s.added(rid, truth[rid][0])
        for rid, t in truth.items():
            if not t[3] and rng.random() < 0.5:  # scheduled from waiting: a first chunk
                t[3], t[4] = 1, min(t[0] + t[1], rng.randint(1, 40))
                for s in (bulk, visit):
                    s.scheduled(rid, t[4])
        # this step: every request in prefill takes a chunk (sampling once its prompt is done)
        # unless it sits out; every decode samples one token unless it sits out
        moved: dict[str, tuple[int, int]] = {}  # id -> (computed, output) after the step
        sits_out = set()
        for rid, t in truth.items():
            if not t[3] or rng.random() < 0.1:
                sits_out.add(rid)
                continue
            if t[4] < t[0] + t[1]:  # in prefill: a chunk (it ran at schedule, as vLLM counts)
                if t[4] + 1 >= t[0] + t[1] or rng.random() < 0.5:
                    t[4] = t[0] + t[1]
                    t[1] += 1  # prefilled: a token sampled
                else:
                    t[4] = min(t[0] + t[1], t[4] + rng.randint(1, 20))
            else:
                t[1] += 1
                t[4] += 1
            moved[rid] = (t[4] if t[4] < t[0] + t[1] else t[0] + t[1] - 1, t[1])
        in_prefill = set(bulk.prefilling)
        decodes_moved = all(rid in moved for rid in visit.requests if visit.requests[rid].decoding)
        if decodes_moved:
            bulk.decoded_all()
        for rid, (computed, output) in moved.items():
            if not decodes_moved or rid in in_prefill:
                bulk.progressed(rid, computed, output)
            visit.progressed(rid, computed, output)
        for rid in list(truth):
            t = truth[rid]
            if t[3] and t[4] >= t[0] + t[1] - 1 and (t[1] >= t[2] or rng.random() < 0.02):
                del truth[rid]
                for s in (bulk, visit):
                    s.finished(rid)
            elif t[3] and rng.random() < 0.02:
                t[3], t[4] = 0, 0
                for s in (bulk, visit):
                    s.preempted(rid)
        assert counter_values(bulk) == counter_values(visit), f"step {step}"
        assert bulk.prefilling == {rid for rid, r in bulk.requests.items() if r.running and not r.decoding}
    for rid in list(truth):
        for s in (bulk, visit):
            s.finished(rid)
    assert bulk.running_decode_seq_len_sum == bulk.uncomputed_prefill_tokens == bulk.num_running == 0
    assert bulk.prefilling == set()
