"""The vLLM adapter's hooks on a stand-in for vLLM's scheduler: every kind of step they take apart
(the steady decode step as a tick, the mixed step in bulk, a visit per request, admissions and
finishes left to the block that follows) keeps the status the requests themselves make, and the
export process reads that same status back. vLLM itself runs in tests/integration/test_llumlet_vllm.py;
this file drives far more step shapes than a real engine shows in a test's time.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import random
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.handoff import HandoffReader, HandoffWriter, create_region
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.state import COUNTER_FIELDS, counter_values

BLOCK = 16
ADAPTER = "pilotfish.vllm_plugin.adapters.vllm_v1"


class _Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_ABORTED = 4


class _Scheduler:
    """The part of vLLM 0.32's Scheduler the hooks call or read."""


@dataclasses.dataclass
class _CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]


def _stand_in_vllm() -> dict[str, types.ModuleType]:
    """Modules named as vLLM's, holding what the adapter imports from them."""
    names = {
        "vllm": {},
        "vllm.v1": {},
        "vllm.v1.core": {},
        "vllm.v1.core.sched": {},
        "vllm.v1.core.sched.scheduler": {"Scheduler": _Scheduler},
        "vllm.v1.core.sched.async_scheduler": {"AsyncScheduler": type("AsyncScheduler", (_Scheduler,), {})},
        "vllm.v1.core.sched.output": {"CachedRequestData": _CachedRequestData},
        "vllm.v1.engine": {
            "EngineCoreOutput": object,
            "EngineCoreOutputs": object,
            "FinishReason": enum.Enum("FinishReason", "ABORT"),
        },
        "vllm.v1.request": {"Request": object, "RequestStatus": _Status},
        "vllm.sampling_params": {"SamplingParams": object},
    }
    modules = {}
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        modules[name] = module
    return modules


@pytest.fixture(scope="module")
def adapter() -> Iterator[Any]:
    """The adapter module, imported over the stand-in modules, then forgotten again."""
    ours = [ADAPTER, "pilotfish.vllm_plugin.adapters.vllm_migration"]
    saved = {name: sys.modules.get(name) for name in [*_stand_in_vllm(), *ours]}
    try:
        sys.modules.update(_stand_in_vllm())
        for name in ours:
            sys.modules.pop(name, None)
        yield importlib.import_module(ADAPTER)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@dataclasses.dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    status: _Status = _Status.WAITING
    client_index: int = 0


class _Pool:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.num_gpu_blocks = 4096

    def get_num_free_blocks(self) -> int:
        used = sum(-(-r.num_computed_tokens // BLOCK) for r in self.engine.requests.values())
        return self.num_gpu_blocks - 1 - used


class FakeEngine(_Scheduler):
    """A small continuous-batching scheduler with chunked prefill, preemption and finishes,
    calling the methods the hooks override in vLLM's order."""

    def __init__(self, rng: random.Random, max_seqs: int, budget: int) -> None:
        self.rng = rng
        self.max_seqs, self.budget = max_seqs, budget
        self.requests: dict[str, _Request] = {}
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.kv_cache_manager = types.SimpleNamespace(block_pool=_Pool(self))
        self.cache_config = types.SimpleNamespace(block_size=BLOCK)
        self.max_model_len = 4096
        self.steps = 0
        self.used_at_step_end = 0

    # vLLM's side of each overridden method
    def add_request(self, request: _Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        for rid in scheduler_output.num_scheduled_tokens:
            r = self.requests.get(rid)
            if r is None:
                continue
            if r.num_computed_tokens >= r.num_prompt_tokens + r.num_output_tokens:
                r.num_output_tokens += 1  # all its tokens computed: it samples one
                if r.num_output_tokens >= r.max_tokens:
                    self.running.remove(r)
                    del self.requests[rid]
                    self._free_request(r)
        return {}

    def _free_request(self, request: _Request, delay_free_blocks: bool = False) -> None:
        return None

    def _preempt_request(self, request: _Request, timestamp: float) -> None:
        self.running.remove(request)
        request.status, request.num_computed_tokens = _Status.PREEMPTED, 0
        self.waiting.insert(0, request)

    def has_requests(self) -> bool:
        return bool(self.requests)

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        return None

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[_Request]:
        return []

    # the engine's loop
    def schedule(self) -> Any:
        if self.running and self.rng.random() < 0.03:
            self._preempt_request(self.running[-1], 0.0)
        scheduled: dict[str, int] = {}
        budget = self.budget
        for r in self.running:
            todo = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens
            n = min(max(todo, 1), budget)
            if n <= 0 or self.rng.random() < 0.02:  # out of budget, or left out this step
                continue
            scheduled[r.request_id] = n
            budget -= n
        new, resumed = [], set()
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            r = self.waiting.pop(0)
            n = min(r.num_prompt_tokens + r.num_output_tokens, budget)
            (resumed.add(r.request_id) if r.status is _Status.PREEMPTED else new.append(r.request_id))
            r.status = _Status.RUNNING
            self.running.append(r)
            scheduled[r.request_id] = n
            budget -= n
        output = types.SimpleNamespace(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=[types.SimpleNamespace(req_id=rid) for rid in new],
            scheduled_cached_reqs=_CachedRequestData(list(scheduled), resumed),
        )
        self._update_after_schedule(output)
        return output

    def step(self, dispatched: Callable[[], None] = lambda: None) -> None:
        """One engine step as vLLM's EngineCore.step takes it; `dispatched` runs where vLLM waits
        for the model (after get_grammar_bitmask)."""
        if self.has_requests():
            output = self.schedule()
            self.get_grammar_bitmask(output)
            dispatched()
            self.update_from_output(output, None)
            self.steps += output.total_num_scheduled_tokens > 0  # what the llumlet counts as a step
            self.used_at_step_end = self.used_kv_tokens()

    def truth(self) -> dict[str, int]:
        """The figures the requests make: what the llumlet's status must say."""
        figures = dict.fromkeys(
            ("num_waiting", "num_running", "num_running_prefill", "num_running_decode", "running_decode_seq_len_sum"),
            0,
        )
        uncomputed = 0
        for r in self.requests.values():
            tokens = r.num_prompt_tokens + r.num_output_tokens
            if r.status is not _Status.RUNNING:
                figures["num_waiting"] += 1
                uncomputed += tokens - r.num_computed_tokens
                continue
            figures["num_running"] += 1
            if r.num_output_tokens and r.num_computed_tokens >= tokens - 1:
                figures["num_running_decode"] += 1
                figures["running_decode_seq_len_sum"] += tokens
            else:
                figures["num_running_prefill"] += 1
                uncomputed += tokens - r.num_computed_tokens
        figures["uncomputed_prefill_tokens"] = uncomputed
        return figures

    def used_kv_tokens(self) -> int:
        pool = self.kv_cache_manager.block_pool
        return (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * BLOCK


class _Exporter:
    def __init__(self, region: Any) -> None:
        self.handoff = HandoffWriter(region)

    def wake(self) -> None:
        pass


def hooked(adapter: Any, rng: random.Random, max_seqs: int, budget: int) -> tuple[Any, HandoffReader]:
    """A FakeEngine under the llumlet's hooks, its llumlet storing into a hand-off a reader reads."""
    cls = type("Hooked", (adapter._LlumletHooks, FakeEngine), {})
    engine = cls.__new__(cls)
    FakeEngine.__init__(engine, rng, max_seqs, budget)
    engine._init_hooks()
    engine._randomized_ids = False
    _, region = create_region()
    llumlet = Llumlet(LlumletConfig(cms_url="redis://unused"), "e0", cms_pb2.InstanceMetadata(block_size=BLOCK))
    llumlet._exporter = _Exporter(region)  # type: ignore[assignment]
    with llumlet.events() as s:
        s.kv_usage(0, engine._total_blocks, BLOCK)
    engine.llumlet = llumlet
    engine.migration = adapter.VllmMigrationAdapter(engine, None, False)
    return engine, HandoffReader(region, block_size=BLOCK)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), max_seqs=st.integers(1, 12), budget=st.sampled_from([8, 64, 512]))
def test_the_hooks_keep_the_status_the_requests_make(adapter, seed, max_seqs, budget):
    rng = random.Random(seed)
    engine, reader = hooked(adapter, rng, max_seqs, budget)
    exported: dict[str, int] = {}

    def check() -> None:
        """While the model computes a step: the last one ended and this one scheduled, in the
        state and in what the export process reads."""
        nonlocal exported
        state = engine.llumlet.state
        truth = engine.truth()
        assert {name: getattr(state, name) for name in truth} == truth, f"step {engine.steps}"
        if (record := reader.poll()) is not None:
            exported = record.counters
        # KV blocks allocated ride with the next change (LoadState.kv_usage), so may lag here
        now = dict(zip(COUNTER_FIELDS, (int(v) for v in counter_values(state)), strict=True))
        assert {**exported, "used_kv_tokens": 0} == {**now, "used_kv_tokens": 0}
        assert exported["step_id"] == engine.steps

    for i in range(150):
        for _ in range(rng.choice((0, 0, 0, 1, 3))):
            engine.add_request(_Request(f"q{i}-{rng.random()}", rng.randint(1, 60), rng.randint(1, 40)))
        engine.step(check)
    while engine.has_requests():
        engine.step(check)
    # idle: the last step is stored too
    assert engine.llumlet.state.step_id == engine.steps and engine.llumlet.state.num_running == 0


def test_steady_decode_steps_go_as_ticks_and_finishes_as_full_records(adapter):
    engine, reader = hooked(adapter, random.Random(1), max_seqs=4, budget=512)
    for i in range(4):
        engine.add_request(_Request(f"r{i}", 20, 10 + i))
    handoff = engine.llumlet._exporter.handoff
    full: list[bool] = []
    def dispatched() -> None:
        record = reader.poll()
        assert record is not None and record.counters["step_id"] == engine.steps
        if full and not full[-1]:  # after a steady step: its tick carried the blocks in use at its end
            assert record.counters["used_kv_tokens"] == engine.used_at_step_end

    while engine.has_requests():
        seq = handoff._seq
        engine.step(dispatched)
        full.append(handoff._seq != seq)
    # admission and prefill (the schedule hook's record and the step's), then ticks, and a full
    # record for each step where a request finished (the stand-in leaves some out at random)
    assert full[0] and not all(full[1:9]) and sum(full) >= 1 + 4


def test_a_request_admitted_to_a_full_batch_is_stored_when_vllm_schedules(adapter):
    """It joins no batch, but its schedule hook enters it and stores it, a step before the step ends."""
    engine, reader = hooked(adapter, random.Random(3), max_seqs=1, budget=512)
    engine.add_request(_Request("busy", 20, 30))
    for _ in range(3):
        engine.step()
    first = reader.poll()
    assert first is not None and reader.ids_until(first.ring_end) == ["busy"]
    engine.add_request(_Request("queued", 20, 5))
    engine.schedule()  # the batch is full: it waits
    record = reader.poll()
    assert record is not None and (record.counters["num_waiting"], record.counters["num_running"]) == (1, 1)
    assert reader.ids_until(record.ring_end) == ["queued"]
