"""A stand-in for the part of vLLM 0.32's scheduler that the llumlet's hooks use, for tests and
`bench llumlet-cachesim`, where vLLM itself is not installed or would take minutes to start.

`adapter_over_standin()` imports the vLLM adapter (adapters/vllm_v1.py) over stand-in modules
named as vLLM's; `StandinEngine` is a small continuous-batching scheduler (chunked prefill,
preemption, finishes) that calls the methods the hooks override in the order vLLM's engine core
does; `hooked(...)` puts it under the hooks, with a llumlet that stores into a shared-memory
hand-off the way it does for the export process. The real engine runs in
tests/integration/test_llumlet_vllm.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import random
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.export_supervisor import ProcessExporter
from pilotfish.vllm_plugin.core.handoff import HandoffReader, HandoffWriter, create_region
from pilotfish.vllm_plugin.core.llumlet import Llumlet

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


@contextlib.contextmanager
def adapter_over_standin() -> Iterator[Any]:
    """The vLLM adapter module (adapters/vllm_v1.py), imported over the stand-in modules, then
    forgotten again with them."""
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
class StandinRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    status: _Status = _Status.WAITING
    client_index: int = 0


class _Pool:
    """vLLM's block pool as the hooks read it: the free count is O(1), as vLLM's is (a queue's
    length), so bench llumlet-cachesim charges the hooks only for reading it. The engine counts
    it again (its side of the cost) wherever it moves tokens."""

    def __init__(self) -> None:
        self.num_gpu_blocks = 4096
        self.free = self.num_gpu_blocks - 1  # block 0 is vLLM's null block

    def get_num_free_blocks(self) -> int:
        return self.free


class StandinEngine(_Scheduler):
    """A small continuous-batching scheduler with chunked prefill, preemption and finishes,
    calling the methods the hooks override in vLLM's order. `preempt_p` and `skip_p`: the chance
    a step preempts its last running request, and that it leaves a running one out."""

    def __init__(
        self, rng: random.Random, max_seqs: int, budget: int, preempt_p: float = 0.03, skip_p: float = 0.02
    ) -> None:
        self.rng = rng
        self.max_seqs, self.budget = max_seqs, budget
        self.preempt_p, self.skip_p = preempt_p, skip_p
        self.requests: dict[str, StandinRequest] = {}
        self.waiting: list[StandinRequest] = []
        self.running: list[StandinRequest] = []
        self.kv_cache_manager = types.SimpleNamespace(block_pool=_Pool())
        self.cache_config = types.SimpleNamespace(block_size=BLOCK)
        self.max_model_len = 4096
        self.steps = 0
        self.used_at_step_end = 0

    # vLLM's side of each overridden method
    def add_request(self, request: StandinRequest) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        self._count_blocks()

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
                    self._count_blocks()
                    self._free_request(r)
        return {}

    def _free_request(self, request: StandinRequest, delay_free_blocks: bool = False) -> None:
        return None

    def _preempt_request(self, request: StandinRequest, timestamp: float) -> None:
        self.running.remove(request)
        request.status, request.num_computed_tokens = _Status.PREEMPTED, 0
        self.waiting.insert(0, request)
        self._count_blocks()

    def _count_blocks(self) -> None:
        pool = self.kv_cache_manager.block_pool
        pool.free = pool.num_gpu_blocks - 1 - sum(-(-r.num_computed_tokens // BLOCK) for r in self.requests.values())

    def has_requests(self) -> bool:
        return bool(self.requests)

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        return None

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[StandinRequest]:
        return []

    # the engine's loop
    def schedule(self) -> Any:
        if self.running and self.rng.random() < self.preempt_p:
            self._preempt_request(self.running[-1], 0.0)
        scheduled: dict[str, int] = {}
        budget = self.budget
        for r in self.running:
            todo = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens
            n = min(max(todo, 1), budget)
            if n <= 0 or self.rng.random() < self.skip_p:  # out of budget, or left out this step
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


def hooked(adapter: Any, rng: random.Random, max_seqs: int, budget: int, **options: float) -> tuple[Any, HandoffReader]:
    """A StandinEngine (`options`: its preempt_p, skip_p) under the llumlet's hooks, from `adapter`
    (adapter_over_standin's), its llumlet storing into a hand-off that the returned reader reads,
    as the export process would."""
    cls = type("Hooked", (adapter._LlumletHooks, StandinEngine), {})
    engine = cls.__new__(cls)
    StandinEngine.__init__(engine, rng, max_seqs, budget, **options)
    engine._init_hooks()
    engine._randomized_ids = False
    _, region = create_region()
    llumlet = Llumlet(
        LlumletConfig(cms_url="redis://unused"), "e0", cms_pb2.InstanceMetadata(block_size=BLOCK), own_process=True
    )
    exporter = llumlet.exporter
    assert isinstance(exporter, ProcessExporter)
    exporter.adopt(_Exporter(region))  # type: ignore[arg-type]  # a bare hand-off: no child process
    with llumlet.events() as s:
        s.kv_usage(0, engine._total_blocks, BLOCK)
    engine.llumlet = llumlet
    engine.migration = adapter.VllmMigrationAdapter(engine, None, False)
    return engine, HandoffReader(region, block_size=BLOCK)
