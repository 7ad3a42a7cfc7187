"""The discrete-event loop: arrivals, engine step ends, timers and delayed observations on one clock.

Events are processed in time order. An engine step that ends at t is applied before a timer at
t, and a timer before an arrival at t (its tokens exist at t), and engines woken at the same
instant share their first step, as the real-time driver's loop does. The router hears engine
events `observation_delay` seconds after they happen; it always decides before the engine sees
the request, so an instant router (delay 0) is what an in-process gateway would be.

A router that `wants_status` (full mode) gets each engine's CMS status as the llumlet writes it
(status.py: the llumlet's own LoadState, fed by the engine's hooks): after every step, late by
the observation delay, and, for an engine idle for `heartbeat` seconds since the last status the
router heard, a refresh at once, before the next decision or rescheduling round, as the llumlet
re-writes its record. The cluster numbers the statuses in the order the router hears them, so its
core's "newer update_id wins" holds across both.

Timers (`at`) carry what is not an arrival or a step: the rescheduling tick (every
`rescheduling_interval` while requests are in flight, when a `rescheduler` is given), the end
of a KV transfer, and whatever a benchmark schedules (an engine marked unschedulable). Moving
requests between engines is `migrate`; the engine-side mechanics are in migration.py.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pilotfish.protos.cms_pb2 import InstanceStatus
from pilotfish.simulator.cluster.metrics import RequestRecord, summarize
from pilotfish.simulator.cluster.migration import (
    KV_TRANSFER,
    RECOMPUTE,
    MigrationEvent,
    Rescheduler,
    admit_running,
    check_method,
    detach,
    release_blocks,
    reserve_blocks,
    successor,
)
from pilotfish.simulator.cluster.routers import Router, RouteRequest
from pilotfish.simulator.cluster.status import EngineStatus
from pilotfish.simulator.config import EngineConfig
from pilotfish.simulator.engine.base import EngineStats
from pilotfish.simulator.engine.block_hash import block_hashes
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.engine.step_time import StepTimeProfile, profile_for, scaled_profile
from pilotfish.simulator.traces.model import Segment, TraceRequest
from pilotfish.simulator.traces.prompts import prompt_token_ids, segments_token_ids
from pilotfish.simulator.virtual import TimedOutput, VirtualEngine
from pilotfish.vllm_plugin.config import LlumletConfig

PromptBuilder = Callable[[TraceRequest], list[int]]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engines: int = 16
    engine: EngineConfig = field(default_factory=EngineConfig)
    profile: StepTimeProfile | None = None  # None: the engine config's profile
    observation_delay: float = 0.0  # seconds between an engine event and the router hearing of it
    # token progress goes to the router at the first token, then every N; 0: at the first token only, and the
    # answer's length just before its release, as a lite gateway reading each stream to its first token learns it
    # (ext_proc --response-bodies first-token, its sidecar default)
    report_every: int = 0
    engine_id_prefix: str = "sim"
    rescheduling_interval: float = 0.5  # seconds between rescheduler calls, when the sim has one
    heartbeat: float = 1.0  # seconds an idle engine goes without a status before it writes one (full mode)
    # each engine's step time as a multiple of the profile's, in engine order (a fleet of mixed GPUs, or an
    # engine gone slow); empty: every engine at the profile's speed
    step_scales: tuple[float, ...] = ()


@dataclass(slots=True)
class ClusterResult:
    records: list[RequestRecord]
    rejected: list[str]  # requests the engines would refuse (prompt too long), never routed
    engine_stats: list[EngineStats]
    virtual_seconds: float
    wall_seconds: float
    steps: int
    migrations: list[MigrationEvent] = field(default_factory=list)
    # token outputs out of order, duplicated or missing (should be empty): "request: what"
    integrity_errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = summarize(self.records)
        out["rejected"] = len(self.rejected)
        out["virtual_seconds"] = self.virtual_seconds
        out["wall_seconds"] = self.wall_seconds
        out["steps"] = self.steps
        out["engine_preemptions"] = sum(s.num_preemptions_total for s in self.engine_stats)
        out["migrations"] = len(self.migrations)
        out["integrity_errors"] = len(self.integrity_errors)
        return out


@dataclass(slots=True)
class _Transfer:
    """A KV transfer under way: the source still holds `left`'s blocks, the destination `arriving`'s."""

    event: MigrationEvent
    left: SimRequest  # the source's dead copy
    arriving: SimRequest  # what joins the destination's running batch


class _Recorder(EngineObserver):
    """Scheduling-side facts of each request; token times come from the step outputs."""

    def __init__(self, records: dict[str, RequestRecord]) -> None:
        self.records = records

    def request_scheduled(self, request: SimRequest, now: float) -> None:
        record = self.records[request.request_id]
        if record.scheduled is None:
            record.scheduled = now

    def cache_hit(self, request: SimRequest, num_tokens: int, now: float) -> None:
        record = self.records[request.request_id]
        if request.num_preemptions == 0 and record.migrations == 0:  # the hit of the first schedule only
            record.cached_tokens = num_tokens

    def preempted(self, request: SimRequest, now: float) -> None:
        self.records[request.request_id].preemptions += 1


def _engine_profiles(config: ClusterConfig, profile: StepTimeProfile) -> list[StepTimeProfile]:
    """Each engine's profile: the fleet's, with its step-time coefficients times the engine's scale."""
    scales = config.step_scales or (1.0,) * config.engines
    if len(scales) != config.engines or min(scales) <= 0:
        raise ValueError(f"step_scales: {len(scales)} positive scales for {config.engines} engines")
    scaled = {scale: scaled_profile(profile, scale) for scale in set(scales)}  # one per scale, not per engine
    return [scaled[scale] for scale in scales]


# A bench runs one trace under many policies and loads in one worker process, and the driver hashed every
# prompt's blocks again each run: 10% of a Mooncake cell's run on 64 engines (prompts of 12,000 tokens on
# average). A prompt's tokens are a function of its segments, and its hashes of its tokens, so a kept entry is
# what hashing gives. Kept as 8-byte integers (a hash is a C long), not Python ints: a Mooncake trace's take
# 6 MB. 8,192: eight traces of a matrix cell's 1,024 requests (a worker interleaves the cells queued at once).
@functools.lru_cache(maxsize=8192)
def _prompt_block_hashes(segments: tuple[Segment, ...], block_size: int) -> array:
    return array("q", block_hashes(segments_token_ids(segments), block_size))


class ClusterSim:
    def __init__(self, config: ClusterConfig, router: Router, *, prompt_builder: PromptBuilder = prompt_token_ids,
                 observers: Iterable[Callable[[int, V1Engine], None]] = (),
                 rescheduler: Rescheduler | None = None) -> None:
        self.config = config
        self.router = router
        self.rescheduler = rescheduler
        self.prompt_builder = prompt_builder
        self.engine_ids = [f"{config.engine_id_prefix}-{i}" for i in range(config.engines)]
        self.records: dict[str, RequestRecord] = {}
        # the profile read once for the fleet, not once per engine (a YAML file: 64 engines' reads
        # cost a bench matrix cell more than its router)
        profile = config.profile or profile_for(config.engine)
        self.cores = [V1Engine(config.engine, p, [_Recorder(self.records)]) for p in _engine_profiles(config, profile)]
        for attach in observers:  # e.g. a test's event recorder, per engine
            for i, core in enumerate(self.cores):
                attach(i, core)
        self.engines = [VirtualEngine(core) for core in self.cores]
        self.now = 0.0
        # the llumlet's status of each engine, kept only for a router that reads statuses: the
        # hooks then cost a LoadState update per event
        llumlet = LlumletConfig()
        self.statuses = [EngineStatus(core, eid, self._clock, llumlet)
                         for core, eid in zip(self.cores, self.engine_ids, strict=True)] if router.wants_status else []
        self._heard = [-config.heartbeat] * config.engines  # timestamp of the last status the router heard
        # (deliver at, sequence, callable): FIFO, since events happen in time order and the delay is fixed
        self._pending: deque[tuple[float, Callable[[], None]]] = deque()
        self._update_ids = [0] * config.engines
        self._steps = 0
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  # (time, sequence, action)
        self._timer_seq = 0
        self._woken: set[int] = set()  # engines given work at the current instant, not yet stepped
        self._next_arrival: float | None = None  # the run's next arrival (after the serving overhead)
        self.schedulable = [True] * config.engines
        self.migrations: list[MigrationEvent] = []
        self._transfers: dict[str, _Transfer] = {}
        self.integrity_errors: list[str] = []

    def _clock(self) -> float:
        return self.now

    # ---- observations -------------------------------------------------------------------------

    def _observe(self, at: float, call: Callable[[], None]) -> None:
        if self.config.observation_delay <= 0:
            call()
        else:
            self._pending.append((at + self.config.observation_delay, call))

    def _deliver_until(self, t: float) -> None:
        """What the router has heard by `t`: the observations due, then the statuses idle engines
        write at `t` (called before each decision and each rescheduling round)."""
        pending = self._pending
        while pending and pending[0][0] <= t:
            pending.popleft()[1]()
        if self.statuses and t != math.inf:
            self._heartbeats(t)

    # ---- the run ------------------------------------------------------------------------------

    def run(self, trace: Iterable[TraceRequest]) -> ClusterResult:
        started = time.perf_counter()
        router = self.router
        router.bind(list(self.engine_ids))
        self._deliver_until(self.now)  # idle engines' first statuses
        # the serving overhead delays every request equally: it is routed and reaches its engine
        # that much later, and its latencies still count from its arrival
        overhead = (self.cores[0].profile.api_overhead_ms / 1000.0) if self.cores else 0.0
        arrivals = sorted(trace, key=lambda r: r.arrival)
        limit = self.config.engine.max_model_len
        rejected: list[str] = []
        heap: list[tuple[float, int]] = []  # (step end, engine): stale entries are skipped
        woken = self._woken
        timers = self._timers
        engines = self.engines
        i = 0
        n = len(arrivals)
        if self.rescheduler is not None and arrivals:
            self.at(arrivals[0].arrival + overhead + self.config.rescheduling_interval, self._reschedule)
        while True:
            next_arrival = arrivals[i].arrival + overhead if i < n else None
            self._next_arrival = next_arrival
            # woken engines start once nothing else happens at this instant that could join their step
            instant = (next_arrival is not None and next_arrival <= self.now) or (timers and timers[0][0] <= self.now)
            if woken and not instant:
                for k in woken:
                    end = engines[k].busy_until
                    if end is not None:
                        heapq.heappush(heap, (end, k))
                woken.clear()
            # stale entries: the engine's step changed since (step_end never starts a woken engine's
            # step early, which would keep a same-instant arrival out of it)
            while heap and engines[heap[0][1]].step_end != heap[0][0]:
                heapq.heappop(heap)
            next_timer = timers[0][0] if timers else None
            if heap and (next_arrival is None or heap[0][0] <= next_arrival) and \
                    (next_timer is None or heap[0][0] <= next_timer):
                end, k = heapq.heappop(heap)
                self._step(k, end)
                nxt = engines[k].busy_until
                if nxt is not None:
                    heapq.heappush(heap, (nxt, k))
                continue
            if next_timer is not None and (next_arrival is None or next_timer <= next_arrival):
                at, _, action = heapq.heappop(timers)
                self.now = max(self.now, at)
                action()
                continue
            if next_arrival is None:
                if woken:
                    continue  # a timer woke an engine as the last thing: its step is still to run
                break
            request = arrivals[i]
            i += 1
            self.now = request.arrival + overhead
            if request.input_length >= limit:
                rejected.append(request.request_id)
                continue
            k = self._dispatch(request)
            woken.add(k)
        self._deliver_until(math.inf)
        self._check_outputs()
        return ClusterResult(
            records=list(self.records.values()),
            rejected=rejected,
            engine_stats=[c.stats() for c in self.cores],
            virtual_seconds=self.now,
            wall_seconds=time.perf_counter() - started,
            steps=self._steps,
            migrations=list(self.migrations),
            integrity_errors=list(self.integrity_errors),
        )

    # ---- timers, rescheduling and migration ---------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` at virtual time `t` (after the steps that end at t, before arrivals at t)."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (max(t, self.now), self._timer_seq, action))

    def transfers(self) -> list[MigrationEvent]:
        """The KV transfers under way (their requests are on neither engine's queues yet)."""
        return [t.event for t in self._transfers.values()]

    def in_flight(self) -> bool:
        """Some request is on an engine or between two."""
        return bool(self._transfers) or any(c.has_unfinished_requests() for c in self.cores)

    def _reschedule(self) -> None:
        now = self.now
        if self.in_flight():
            self._deliver_until(now)  # the rescheduler sees what the router has heard by now
            assert self.rescheduler is not None
            for order in self.rescheduler(self, now):
                self.migrate(order.source, order.destination, order.request_ids, order.method, now,
                             reason=order.reason)
        interval = self.config.rescheduling_interval
        if self.in_flight():
            self.at(now + interval, self._reschedule)
        elif self._next_arrival is not None:
            # idle until the next arrival: the first tick on the interval's grid after it
            nxt = self._next_arrival
            self.at(now + interval * max(1, math.ceil((nxt - now) / interval)), self._reschedule)

    def set_schedulable(self, k: int, schedulable: bool) -> None:
        """Mark engine `k` (un)schedulable, as its llumlet would (draining it, or a failing health check).

        Its next status says so; one is written now too, as the llumlet writes on every change.
        """
        self.schedulable[k] = schedulable
        self.router.set_schedulable(k, schedulable)
        if self.statuses:
            self.statuses[k].state.set_schedulable(schedulable)
            self._write_status(k, self.now)

    def migrate(self, source: int, destination: int, request_ids: Iterable[str], method: str = RECOMPUTE,
                now: float | None = None, *, reason: str = "") -> list[MigrationEvent]:
        """Move the listed requests that are still on `source` to `destination`; one event per request moved.

        Recompute: each joins the destination's waiting queue now. KV transfer: each joins its
        running batch after the transfer time (or by recompute now, when it does not fit).
        """
        check_method(method)
        now = self.now if now is None else now
        if source == destination:
            return []
        src, dst = self.engines[source], self.engines[destination]
        for out in src.advance_to(now):
            self._output(source, out)
        for out in dst.advance_to(now):
            self._output(destination, out)
        done: list[MigrationEvent] = []
        for rid in request_ids:
            request = self.cores[source].requests.get(rid)
            if request is None:
                continue  # finished (or moved) since it was selected
            computed = request.num_computed_tokens if method == KV_TRANSFER else 0
            left = detach(self.cores[source], rid, now, keep_blocks=computed > 0)
            assert left is not None
            arriving = successor(left)
            record = self.records[rid]
            record.migrations += 1
            if computed and reserve_blocks(self.cores[destination], arriving, computed,
                                           self._arriving_count(destination), now):
                arrives = now + self.config.engine.kv_transfer_seconds(computed)
                event = MigrationEvent(now, rid, source, destination, KV_TRANSFER, method, computed, arrives, reason)
                self._transfers[rid] = _Transfer(event, left, arriving)
                self._migrating(source, destination, +1)
                self.at(arrives, lambda rid=rid: self._transfer_done(rid))
            else:
                if computed:  # no room for its KV on the destination: move it by recompute
                    release_blocks(self.cores[source], left, now)
                event = MigrationEvent(now, rid, source, destination, RECOMPUTE, method, 0, now, reason)
                for out in dst.add_request(arriving, now):
                    self._output(destination, out)
                self._woken.add(destination)
            record.engine = destination
            self.migrations.append(event)
            done.append(event)
        return done

    def _transfer_done(self, request_id: str) -> None:
        transfer = self._transfers.pop(request_id)
        event = transfer.event
        now = self.now
        self._migrating(event.source, event.destination, -1)
        release_blocks(self.cores[event.source], transfer.left, now)
        for out in admit_running(self.engines[event.destination], transfer.arriving, event.tokens, now):
            self._output(event.destination, out)
        self._woken.add(event.destination)

    def _migrating(self, source: int, destination: int, delta: int) -> None:
        """A KV transfer started (+1) or ended (-1): the source's llumlet counts it out, the destination's in."""
        if self.statuses:
            self.statuses[source].state.migrating(out_delta=delta)
            self.statuses[destination].state.migrating(in_delta=delta)

    def _arriving_count(self, k: int) -> int:
        return sum(1 for t in self._transfers.values() if t.event.destination == k)

    def _dispatch(self, request: TraceRequest) -> int:
        now = self.now
        self._deliver_until(now)
        tokens = self.prompt_builder(request)
        block_size = self.config.engine.block_size
        # computed once: the router's prefix hashes are the engine's, which extends them lazily
        if self.prompt_builder is prompt_token_ids:  # a builder of its own need not follow the segments
            hashes = _prompt_block_hashes(request.segments, block_size).tolist()
        else:
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
        if self.statuses and plan is not None:
            self._write_status(k, end)

    # ---- statuses (full mode) -----------------------------------------------------------------

    def _write_status(self, k: int, now: float) -> None:
        status = self.statuses[k].snapshot(now)
        heard_at = now + self.config.observation_delay
        self._observe(now, lambda: self._hear_status(k, status, heard_at))

    def _hear_status(self, k: int, status: InstanceStatus, now: float) -> None:
        self._update_ids[k] += 1
        status.update_id = self._update_ids[k]
        self._heard[k] = status.timestamp_ms / 1000.0
        self.router.on_status(k, status, now)

    def _heartbeats(self, now: float) -> None:
        """Idle engines whose last status the router heard `heartbeat` seconds ago write one now."""
        heartbeat, heard, engines = self.config.heartbeat, self._heard, self.engines
        for k, status in enumerate(self.statuses):
            if now - heard[k] >= heartbeat and engines[k].step_end is None:
                self._hear_status(k, status.snapshot(now), now)

    def _output(self, k: int, timed: TimedOutput) -> None:
        out = timed.output
        record = self.records[out.request_id]
        t = timed.time
        router = self.router
        delay = self.config.observation_delay
        rid = out.request_id
        if out.token_id is not None:
            if out.index != record.num_output_tokens:
                self.integrity_errors.append(
                    f"{out.request_id}: token index {out.index} on engine {k} after {record.num_output_tokens} tokens")
            record.num_output_tokens += 1
            generated = record.num_output_tokens
            if generated == 1:
                record.first_token = t
            every = self.config.report_every
            if (generated == 1 or (every and generated % every == 0)) and out.finish_reason is None:
                self._observe(t, lambda: router.on_progress(rid, k, generated, t + delay))
        if out.finish_reason is not None:
            record.finished = t
            record.finish_reason = out.finish_reason.value
            if out.finish_reason is not FinishReason.ABORT:
                # the answer's length, told with its release where the reports stopped at the first token
                total = 0 if self.config.report_every else record.num_output_tokens
                self._observe(t, lambda: router.on_finish(rid, k, t + delay, total))

    def _check_outputs(self) -> None:
        """Every finished request has exactly the tokens it asked for (indices were checked as they came)."""
        for record in self.records.values():
            # max_tokens was clipped to max_model_len at dispatch, so "length" means all of them
            if record.finish_reason == "length" and record.num_output_tokens != record.output_length:
                self.integrity_errors.append(
                    f"{record.request_id}: finished with {record.num_output_tokens} of {record.output_length} tokens")
            if record.finished is None:
                self.integrity_errors.append(f"{record.request_id}: never finished")
