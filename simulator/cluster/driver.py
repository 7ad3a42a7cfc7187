"""The discrete-event loop: arrivals, engine step ends and delayed observations on one clock.

Events are processed in time order. An engine step that ends at t is applied before an arrival
at t (its tokens exist at t), and engines woken by arrivals at the same instant share their
first step, as the real-time driver's loop does. The router hears engine events
`observation_delay` seconds after they happen; it always decides before the engine sees the
request, so an instant router (delay 0) is what an in-process gateway would be.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pilotfish.simulator.cluster.metrics import RequestRecord, summarize
from pilotfish.simulator.cluster.routers import Router, RouteRequest
from pilotfish.simulator.cluster.status import LastStep, instance_status
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.base import EngineStats
from pilotfish.simulator.engine.block_hash import block_hashes
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile
from pilotfish.simulator.traces.model import TraceRequest
from pilotfish.simulator.traces.prompts import prompt_token_ids
from pilotfish.simulator.virtual import TimedOutput, VirtualEngine

PromptBuilder = Callable[[TraceRequest], list[int]]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engines: int = 16
    engine: EngineConfig = field(default_factory=EngineConfig)
    profile: StepTimeProfile | None = None  # None: the engine config's profile
    observation_delay: float = 0.0  # seconds between an engine event and the router hearing of it
    report_every: int = 16  # token progress goes to the router at the first token, then every N
    engine_id_prefix: str = "sim"


@dataclass(slots=True)
class ClusterResult:
    records: list[RequestRecord]
    rejected: list[str]  # requests the engines would refuse (prompt too long), never routed
    engine_stats: list[EngineStats]
    virtual_seconds: float
    wall_seconds: float
    steps: int

    def summary(self) -> dict[str, Any]:
        out = summarize(self.records)
        out["rejected"] = len(self.rejected)
        out["virtual_seconds"] = self.virtual_seconds
        out["wall_seconds"] = self.wall_seconds
        out["steps"] = self.steps
        out["engine_preemptions"] = sum(s.num_preemptions_total for s in self.engine_stats)
        return out


class _Recorder(EngineObserver):
    """Scheduling-side facts of each request; token times come from the step outputs."""

    def __init__(self, records: dict[str, RequestRecord]) -> None:
        self.records = records

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        record = self.records[request.request_id]
        if record.scheduled is None:
            record.scheduled = now

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        if request.num_preemptions == 0:
            self.records[request.request_id].cached_tokens = num_tokens

    def preempted(self, request: SimRequest, now: float) -> None:
        self.records[request.request_id].preemptions += 1


class ClusterSim:
    def __init__(self, config: ClusterConfig, router: Router, *, prompt_builder: PromptBuilder = prompt_token_ids,
                 observers: Iterable[Callable[[int, V1Engine], None]] = ()) -> None:
        self.config = config
        self.router = router
        self.prompt_builder = prompt_builder
        self.engine_ids = [f"{config.engine_id_prefix}-{i}" for i in range(config.engines)]
        self.records: dict[str, RequestRecord] = {}
        self.cores = [V1Engine(config.engine, config.profile, [_Recorder(self.records)])
                      for _ in range(config.engines)]
        for attach in observers:  # e.g. a test's event recorder, per engine
            for i, core in enumerate(self.cores):
                attach(i, core)
        self.engines = [VirtualEngine(core) for core in self.cores]
        self.now = 0.0
        # (deliver at, sequence, callable): FIFO, since events happen in time order and the delay is fixed
        self._pending: deque[tuple[float, Callable[[], None]]] = deque()
        self._update_ids = [0] * config.engines
        self._steps = 0

    # ---- observations -------------------------------------------------------------------------

    def _observe(self, at: float, call: Callable[[], None]) -> None:
        if self.config.observation_delay <= 0:
            call()
        else:
            self._pending.append((at + self.config.observation_delay, call))

    def _deliver_until(self, t: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= t:
            pending.popleft()[1]()

    # ---- the run ------------------------------------------------------------------------------

    def run(self, trace: Iterable[TraceRequest]) -> ClusterResult:
        started = time.perf_counter()
        router = self.router
        router.bind(list(self.engine_ids))
        # the serving overhead delays every request equally: it is routed and reaches its engine
        # that much later, and its latencies still count from its arrival
        overhead = (self.cores[0].profile.api_overhead_ms / 1000.0) if self.cores else 0.0
        arrivals = sorted(trace, key=lambda r: r.arrival)
        limit = self.config.engine.max_model_len
        rejected: list[str] = []
        heap: list[tuple[float, int]] = []  # (step end, engine): stale entries are skipped
        woken: set[int] = set()  # engines given a request at the current instant, not yet stepped
        engines = self.engines
        i = 0
        n = len(arrivals)
        while True:
            next_arrival = arrivals[i].arrival + overhead if i < n else None
            if woken and (next_arrival is None or next_arrival > self.now):
                for k in woken:
                    end = engines[k].busy_until
                    if end is not None:
                        heapq.heappush(heap, (end, k))
                woken.clear()
            # stale entries: the engine's step changed since (step_end never starts a woken engine's
            # step early, which would keep a same-instant arrival out of it)
            while heap and engines[heap[0][1]].step_end != heap[0][0]:
                heapq.heappop(heap)
            if heap and (next_arrival is None or heap[0][0] <= next_arrival):
                end, k = heapq.heappop(heap)
                self._step(k, end)
                nxt = engines[k].busy_until
                if nxt is not None:
                    heapq.heappush(heap, (nxt, k))
                continue
            if next_arrival is None:
                break
            request = arrivals[i]
            i += 1
            self.now = request.arrival + overhead
            if request.input_length >= limit:
                rejected.append(request.request_id)
                continue
            k = self._dispatch(request)
            woken.add(k)
        self._deliver_until(float("inf"))
        return ClusterResult(
            records=list(self.records.values()),
            rejected=rejected,
            engine_stats=[c.stats() for c in self.cores],
            virtual_seconds=self.now,
            wall_seconds=time.perf_counter() - started,
            steps=self._steps,
        )

    def _dispatch(self, request: TraceRequest) -> int:
        now = self.now
        self._deliver_until(now)
        tokens = self.prompt_builder(request)
        block_size = self.config.engine.block_size
        # computed once: the router's prefix hashes are the engine's, which extends them lazily
        hashes = block_hashes(tokens, block_size)
        max_tokens = min(request.output_length, self.config.engine.max_model_len - len(tokens))
        k = self.router.route(RouteRequest(request.request_id, len(tokens), max_tokens, hashes, block_size), now)
        self.records[request.request_id] = RequestRecord(
            request.request_id, k, request.arrival, len(tokens), max_tokens)  # arrival: before the overhead
        sim_request = SimRequest(request.request_id, tokens, max_tokens, block_hashes=list(hashes))
        for out in self.engines[k].add_request(sim_request, now):
            self._output(k, out)
        return k

    def _step(self, k: int, end: float) -> None:
        engine = self.engines[k]
        plan = engine.current_plan
        self.now = end
        for out in engine.advance_to(end):
            self._output(k, out)
        self._steps += 1
        if self.router.wants_status and plan is not None:
            self._update_ids[k] += 1
            last = LastStep(plan.duration, plan.num_prefill_tokens, plan.num_decode_requests,
                            plan.num_context_tokens)
            status = instance_status(self.cores[k], self.engine_ids[k], update_id=self._update_ids[k], now=end,
                                     step_id=self._update_ids[k], last_step=last)
            router = self.router
            self._observe(end, lambda: router.on_status(k, status, end + self.config.observation_delay))

    def _output(self, k: int, timed: TimedOutput) -> None:
        out = timed.output
        record = self.records[out.request_id]
        t = timed.time
        router = self.router
        delay = self.config.observation_delay
        rid = out.request_id
        if out.token_id is not None:
            record.num_output_tokens += 1
            generated = record.num_output_tokens
            if generated == 1:
                record.first_token = t
            if (generated == 1 or generated % self.config.report_every == 0) and out.finish_reason is None:
                self._observe(t, lambda: router.on_progress(rid, k, generated, t + delay))
        if out.finish_reason is not None:
            record.finished = t
            record.finish_reason = out.finish_reason.value
            if out.finish_reason is not FinishReason.ABORT:
                self._observe(t, lambda: router.on_finish(rid, k, t + delay))
