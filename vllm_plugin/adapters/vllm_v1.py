"""vLLM V1 adapter: scheduler subclasses whose hooks feed the llumlet (vLLM 0.32.x).

Select with `--scheduler-cls pilotfish.vllm_plugin.LlumletScheduler`. One name covers both
schedulers: at construction it becomes `LlumletAsyncScheduler` (over vLLM's AsyncScheduler)
when vLLM resolved async scheduling on, else `LlumletSyncScheduler` (over Scheduler). With no
CMS configured the subclass only calls its parent: vLLM behaves exactly as without it.

Hooks (all on the engine-core thread, the only thread that touches the scheduler):
  add_request              request added (admitted; its id goes into admitted_request_ids),
                           entered by the schedule hook that follows
  _update_after_schedule   requests entering the batch, tokens scheduled this step
  _preempt_request         preempted back to waiting
  update_from_output       tokens computed and sampled, the step's duration and shape, KV usage;
                           also where Abort calls from the gRPC thread are applied
  _free_request            finished, stopped or aborted (inside update_from_output: entered by
                           its block, which follows)
  shutdown                 keys removed from the CMS
Migration (adapters/vllm_migration.py) adds: has_requests (true while migration calls wait for
the engine thread; also its sign that a step's outputs are out), finish_requests (a frontend
abort of a request migrated away), and its calls run in update_from_output after the aborts.

The hooks run once or twice a step on vLLM's engine thread, after the model has evicted the
caches, where each Python call, lock and C routine touched costs microseconds (bench llumlet;
bench llumlet-cachesim counts the misses). So a step costs as little as its kind
allows: the steady decode step (every running request decoded one token, nothing else moved) is
O(1) and goes to the export process as a tick, without the lock (ProcessExporter.decode_step); a step
where requests are in prefill or finish moves the decodes in bulk and visits only the others;
anything else visits each request scheduled. Admissions and finishes inside a step are entered
by the block that follows at once, so a step takes the lock at most twice.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections import deque
from concurrent.futures import Future
from time import monotonic_ns, thread_time_ns
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.adapters import vllm_identity
from pilotfish.vllm_plugin.adapters.vllm_migration import VllmMigrationAdapter, find_engine_core
from pilotfish.vllm_plugin.config import config_from_env
from pilotfish.vllm_plugin.core.kv_endpoint import subscribable_endpoint
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from pilotfish.vllm_plugin.core.state import MAX_DURATION_US, LoadState

log = logging.getLogger("pilotfish.llumlet")

ABORT_TIMEOUT_S = 30.0  # a loaded engine may take seconds per step
# vLLM (>= 0.11) appends "-<8 random chars>" to every request id it admits; the frontend, the
# client and the gateway only know the id without it, so that is the id the llumlet exports.
_RANDOM_SUFFIX_LEN = 9
_RUNNING = RequestStatus.RUNNING


def external_id(request: Request, randomized: bool) -> str:
    rid = request.request_id
    if randomized and len(rid) > _RANDOM_SUFFIX_LEN and rid[-_RANDOM_SUFFIX_LEN] == "-":
        return rid[:-_RANDOM_SUFFIX_LEN]
    return rid


def _log_through_vllm() -> None:
    """Send the llumlet's log lines where vLLM sends its own, so operators see them in one place."""
    ours = logging.getLogger("pilotfish")
    if not ours.handlers:
        from pilotfish.logs import formatter, resolve_format

        try:
            json_lines = resolve_format(None) == "json"  # PILOTFISH_LOG_FORMAT=json (pilotfish/logs.py)
        except ValueError:
            json_lines = False
        if json_lines:
            handler = logging.StreamHandler()
            handler.setFormatter(formatter("json"))
            ours.addHandler(handler)
        for handler in [] if json_lines else logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class _LlumletHooks:
    """Mixed in before vLLM's scheduler class; `self` is that scheduler."""

    llumlet: Llumlet | None = None
    migration: VllmMigrationAdapter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._init_hooks()
        engine_core = find_engine_core()  # only reachable while vLLM constructs us
        _log_through_vllm()
        config = config_from_env()
        if not config.enabled:
            log.info("pilotfish llumlet: PILOTFISH_CMS_URL unset, scheduler runs unchanged")
            return
        sched: Any = self
        vc = sched.vllm_config
        pc = vc.parallel_config
        dp_rank = int(getattr(pc, "data_parallel_index", 0) or getattr(pc, "data_parallel_rank", 0) or 0)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        http_port = vllm_identity.http_port(config)
        host = config.advertise_host or vllm_identity.argv_value("--host") or "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        instance_id = vllm_identity.instance_id(config, dp_rank, dp_size)
        served = getattr(vc.model_config, "served_model_name", None)
        model = served[0] if isinstance(served, list | tuple) and served else served or vc.model_config.model
        meta = cms_pb2.InstanceMetadata(
            host=host,
            http_port=http_port,
            model=str(model),
            block_size=self._block_size,
            num_gpu_blocks=self._total_blocks,
            max_num_batched_tokens=int(sched.scheduler_config.max_num_batched_tokens),
            max_num_seqs=int(sched.scheduler_config.max_num_seqs),
            dp_rank=dp_rank,
            dp_size=dp_size,
            node_id=socket.gethostname(),
        )
        kv_events = getattr(vc, "kv_events_config", None)
        if kv_events is not None and kv_events.enable_kv_cache_events and kv_events.publisher == "zmq":
            from vllm.distributed.kv_events import ZmqEventPublisher

            endpoint = ZmqEventPublisher.offset_endpoint_port(kv_events.endpoint, dp_rank) or ""
            meta.kv_events_endpoint = subscribable_endpoint(endpoint, host)
            meta.kv_events_topic = kv_events.topic
            if not meta.kv_events_endpoint:
                log.warning(
                    "pilotfish llumlet: vLLM's KV events go to %s, which vLLM connects to; the scheduler "
                    "subscribes only to a publisher vLLM binds (tcp://*:PORT or ipc://PATH): not advertised",
                    endpoint,
                )
        self.migration = VllmMigrationAdapter(self, engine_core, self._randomized_ids)
        llumlet = Llumlet(
            config,
            instance_id,
            meta,
            abort_handler=self._abort_from_grpc,
            migration_adapter=self.migration,
            # vLLM's engine core owns its process: by default a child writes to the CMS
            # (export_process), else the hooks, which run once or twice a step around the model,
            # write once a step (engine_thread_writes)
            own_process=True,
            step_hooks=True,
            watch_parent=True,  # the API server is our parent: its death is ours
            # for the stat logger in vLLM's API server (adapters/vllm_metrics.py)
            metrics_snapshot=config.vllm_metrics,
        )
        llumlet.engine_cpu_start_ns = thread_time_ns()  # this is the engine-core thread
        with llumlet.events() as s:
            s.kv_usage(0, self._total_blocks, self._block_size)
        llumlet.start(serve_grpc=config.serve_grpc)
        self.llumlet = llumlet
        variant = "AsyncScheduler" if isinstance(self, AsyncScheduler) else "Scheduler"
        log.info("pilotfish llumlet %s: hooks over vLLM's %s", instance_id, variant)

    def _init_hooks(self) -> None:
        """What the hooks keep between calls, all but the llumlet (None: they only call vLLM's)."""
        sched: Any = self
        self.llumlet = None
        self.migration = None
        # The parent's methods the hooks call every step, bound once: a super() call costs a
        # lookup through the class hierarchy each time, on caches the model just evicted.
        parent: Any = super()
        self._parent_has_requests = parent.has_requests
        self._parent_update_after_schedule = parent._update_after_schedule
        self._parent_update_from_output = parent.update_from_output
        self._parent_add_request = parent.add_request
        self._aborts: queue.SimpleQueue[tuple[list[str], Future[list[str]]]] = queue.SimpleQueue()
        # (scheduler output, monotonic ns of its schedule), oldest first: vLLM updates from the
        # outputs in the order it scheduled them (two may be in flight, with async scheduling)
        self._scheduled_at: deque[tuple[Any, int]] = deque()
        self._randomized_ids = not os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")
        self._internal_ids: dict[str, str] = {}  # exported id -> vLLM's id, for Abort
        self._last_update_end = 0  # monotonic ns
        self._updating: Any = None  # the scheduler output in vLLM's update_from_output, whose end writes for its frees
        self._freed_ones = 0  # requests freed in it that it had scheduled for one token
        # the scheduler output in which a request counts as a decode that the step samples nothing
        # for (_update_after_schedule); until its update, updates visit every request
        self._unsampled: Any = None
        # admitted (request id, prompt tokens, output tokens, exported id) and freed (request id,)
        # since the last block on this thread, in order (_enter_pending)
        self._pending: list[tuple[Any, ...]] = []
        self._pool = sched.kv_cache_manager.block_pool
        self._block_size = int(sched.cache_config.block_size)
        self._total_blocks = max(int(self._pool.num_gpu_blocks) - 1, 1)  # block 0 is vLLM's null block

    # ---- requests in and out --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        llumlet = self.llumlet
        if llumlet is None:
            return self._parent_add_request(request)  # type: ignore[no-any-return]
        requests = self.requests  # type: ignore[attr-defined]
        is_new = request.request_id not in requests
        self._parent_add_request(request)
        if is_new and request.request_id in requests:
            cpu0 = thread_time_ns() if llumlet.profiling else 0
            exported = external_id(request, self._randomized_ids)
            self._internal_ids[exported] = request.request_id
            # vLLM schedules right after admitting (it has a request now): that hook enters it
            # and stores both, under one lock for every request admitted meanwhile
            self._pending.append((request.request_id, request.num_prompt_tokens, request.num_output_tokens, exported))
            if cpu0:
                llumlet.hook_cpu_ns += thread_time_ns() - cpu0
        return None

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        if self.migration is not None:
            self.migration.before_finish(request_ids)
        return super().finish_requests(request_ids, finished_status)  # type: ignore[misc]

    def has_requests(self) -> bool:
        # An idle engine core steps only while this is true: migration calls need a step.
        migration = self.migration
        if migration is None:
            return self._parent_has_requests()  # type: ignore[no-any-return]
        if migration.unflushed:
            migration.step_done()  # vLLM asks this after putting each step's outputs out
        return self._parent_has_requests() or migration.busy()  # type: ignore[no-any-return]

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)  # type: ignore[misc]
        llumlet = self.llumlet
        if llumlet is not None:
            cpu0 = thread_time_ns() if llumlet.profiling else 0
            self._internal_ids.pop(external_id(request, self._randomized_ids), None)
            updating = self._updating
            if updating is not None:
                # inside a step's output handling: our update_from_output block follows, and enters
                # and stores this with the step
                if updating.num_scheduled_tokens.get(request.request_id) == 1:
                    self._freed_ones += 1  # a decode that finished, or a prefill's last chunk that did
                self._pending.append((request.request_id, request.num_output_tokens))
            else:
                with llumlet.events() as s:
                    self._enter_pending(s)
                    s.finished(request.request_id, num_output_tokens=request.num_output_tokens)
                    s.kv_usage(
                        self._total_blocks - self._pool.get_num_free_blocks(), self._total_blocks, self._block_size
                    )
            if cpu0:
                llumlet.hook_cpu_ns += thread_time_ns() - cpu0
        return result

    def _preempt_request(self, request: Request, timestamp: float, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, timestamp, *args, **kwargs)  # type: ignore[misc]
        llumlet = self.llumlet
        if llumlet is not None:
            cpu0 = thread_time_ns() if llumlet.profiling else 0
            with llumlet.events() as s:
                self._enter_pending(s)
                s.preempted(request.request_id)
                s.kv_usage(self._total_blocks - self._pool.get_num_free_blocks(), self._total_blocks, self._block_size)
            if cpu0:
                llumlet.hook_cpu_ns += thread_time_ns() - cpu0

    # ---- one step -------------------------------------------------------------------------

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        self._parent_update_after_schedule(scheduler_output)
        llumlet = self.llumlet
        if llumlet is None:
            return
        cpu0 = thread_time_ns() if llumlet.profiling else 0
        self._scheduled_at.append((scheduler_output, monotonic_ns()))
        s = llumlet.state
        if (
            not self._pending
            and not s.num_running_prefill
            and not scheduler_output.scheduled_new_reqs
            and not scheduler_output.scheduled_cached_reqs.resumed_req_ids
        ):
            # Every running request decodes, none joined them (none new, none resumed from
            # preemption) and none was admitted: scheduling one moves no load (its token does,
            # in update_from_output), and the blocks it allocated ride with that hook's store.
            # Read without the lock: only this thread changes these counts.
            if cpu0:
                llumlet.hook_cpu_ns += thread_time_ns() - cpu0
            return
        requests = self.requests  # type: ignore[attr-defined]
        scheduled = scheduler_output.num_scheduled_tokens
        with llumlet.events() as s:
            self._enter_pending(s)
            # Scheduling a decode only advances num_computed past the sampled token; the load it
            # represents moves when the output arrives (update_from_output). So only requests in
            # prefill and those joining the batch (new, or resumed from preemption) are visited.
            moved = []
            for req_id in list(s.prefilling):  # a copy: it changes
                if req_id in scheduled:
                    request = requests[req_id]
                    s.progressed(req_id, request.num_computed_tokens, request.num_output_tokens)
                    moved.append(request)
            for new in scheduler_output.scheduled_new_reqs:
                request = requests[new.req_id]
                s.scheduled(new.req_id, request.num_computed_tokens)
                moved.append(request)
            for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                request = requests[req_id]
                s.scheduled(req_id, request.num_computed_tokens)
                moved.append(request)
            for request in moved:
                # A request recomputing after preemption whose chunk stops one token short of its
                # end counts as a decode already (the next step computes that token and samples),
                # but this step samples none for it: updates until this step's must visit every
                # request, not move the decodes by a token each (two steps may be in flight).
                if (
                    request.num_output_tokens
                    and request.num_computed_tokens == request.num_prompt_tokens + request.num_output_tokens - 1
                ):
                    self._unsampled = scheduler_output
            s.kv_usage(self._total_blocks - self._pool.get_num_free_blocks(), self._total_blocks, self._block_size)
        if cpu0:
            llumlet.hook_cpu_ns += thread_time_ns() - cpu0

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        self._updating = scheduler_output
        self._freed_ones = 0
        try:
            outputs = self._parent_update_from_output(scheduler_output, model_runner_output)
        finally:
            self._updating = None
        llumlet = self.llumlet
        if llumlet is None:
            return outputs
        cpu0 = thread_time_ns() if llumlet.profiling else 0
        now = start = monotonic_ns()
        scheduled_at = self._scheduled_at
        while scheduled_at:  # the first one, unless a schedule's update never came
            out, at = scheduled_at.popleft()
            if out is scheduler_output:
                start = at
                break
        # With async scheduling steps overlap: a step's time is from when it could start (its
        # schedule, or the previous step's end, whichever is later) to its outputs. (No min() or
        # max() here or below: their argument parsing costs more than the test.)
        if start < self._last_update_end:
            start = self._last_update_end
        self._last_update_end = now
        duration_ns = now - start
        s = llumlet.state
        n = len(scheduler_output.num_scheduled_tokens)
        if (
            n
            and not self._pending  # no request finished in it
            and self._unsampled is None  # see _update_after_schedule
            and scheduler_output.total_num_scheduled_tokens == n  # one token each
            and not s.num_running_prefill  # so every running request we track decodes...
            and n == s.num_running  # ...and, as many as were scheduled, are the ones scheduled
        ):
            # The steady decode step: each running request sampled one token. Those that finished
            # were freed above, so a finishing step goes the long way; none entered (it would be
            # running, in prefill, from the schedule hook), and waiting ones are not scheduled.
            # The same count of other requests cannot be scheduled in their place: every request
            # vLLM schedules passed add_request and the schedule hook. O(1) in the batch.
            # vLLM took its null block out of the free ones: used is within [0, total]
            used = self._total_blocks - self._pool.get_num_free_blocks()
            duration_us = duration_ns // 1000
            llumlet.decode_step(
                duration_us if duration_us < MAX_DURATION_US else MAX_DURATION_US, used, used * self._block_size, now
            )
        else:
            self._mixed_step(llumlet, scheduler_output, duration_ns)
        if not self._aborts.empty():  # once a step: an empty check costs least
            self._apply_aborts(outputs)
        if self.migration is not None:
            self.migration.apply(outputs)
        if cpu0:
            end = thread_time_ns()
            llumlet.hook_cpu_ns += end - cpu0
            llumlet.engine_cpu_ns = end
        return outputs

    def _mixed_step(self, llumlet: Llumlet, scheduler_output: Any, duration_ns: int) -> None:
        """update_from_output for any other step: the running decodes in bulk if each was scheduled
        for one token (LoadState.decoded_all), then a visit per scheduled request in prefill;
        otherwise a visit per scheduled request."""
        scheduled = scheduler_output.num_scheduled_tokens
        get = self.requests.get  # type: ignore[attr-defined]
        prefill_tokens = decodes = seq_len_sum = 0
        with llumlet.events() as s:
            self._enter_pending(s)  # the requests that finished in it
            # Requests scheduled for one token, less those in prefill and those that finished
            # above (freed): the running decodes, if each of them was scheduled (as in the steady
            # step, no other request can stand in for one). Loops, not comprehensions: in Python
            # 3.11 each of those is a function made and called.
            ones = list(scheduled.values()).count(1) - self._freed_ones
            visit: Any = []
            for req_id in s.prefilling:
                n = scheduled.get(req_id)
                if n is not None:
                    visit.append(req_id)
                    ones -= n == 1
            if ones == s.num_running_decode and self._unsampled is None:
                s.decoded_all()
                decodes = s.num_running_decode
                seq_len_sum = s.running_decode_seq_len_sum - decodes  # computed = tokens - 1
            else:
                visit = scheduled
            progressed = s.progressed
            for req_id in visit:
                request = get(req_id)
                if request is None:
                    continue
                n = scheduled[req_id]
                computed = request.num_computed_tokens
                output = request.num_output_tokens
                if output and n == 1:
                    decodes += 1
                    # the context it attended, as the bulk path counts it (under async
                    # scheduling num_computed already includes the next step's token)
                    seq_len_sum += request.num_prompt_tokens + output - 1
                else:
                    prefill_tokens += n
                    seq_len_sum += computed
                if request.status is _RUNNING:
                    progressed(req_id, computed, output)
            if self._unsampled is scheduler_output:
                self._unsampled = None
            if scheduler_output.total_num_scheduled_tokens:
                s.step_finished(duration_ns / 1e9, prefill_tokens, decodes, seq_len_sum)
            s.kv_usage(self._total_blocks - self._pool.get_num_free_blocks(), self._total_blocks, self._block_size)

    def _enter_pending(self, s: LoadState) -> None:
        """In a block on the engine thread: the requests admitted, or freed in update_from_output,
        since the last one; the hooks leave them to the block that follows at once, so a step
        takes the lock once or twice, not once more per request."""
        pending = self._pending
        if pending:
            for event in pending:
                if len(event) == 2:  # (id, output tokens): freed
                    s.finished(event[0], num_output_tokens=event[1])
                else:
                    s.added(*event)
            pending.clear()

    def resync(self) -> None:
        """Bring the llumlet's status to vLLM's requests as they are, in one block: for hooks that
        sat steps out (bench llumlet parks the llumlet for blocks of steps, `llumlet` None, to time
        steps with and without its hooks in one engine). O(requests); the hooks never call it."""
        llumlet = self.llumlet
        if llumlet is None:
            return
        requests = self.requests  # type: ignore[attr-defined]
        randomized = self._randomized_ids
        self._pending.clear()  # admissions or frees the parked steps never entered: read afresh below
        self._scheduled_at.clear()
        internal_ids = self._internal_ids = {}
        with llumlet.events() as s:
            for req_id in [req_id for req_id in s.requests if req_id not in requests]:
                s.finished(req_id)
            for req_id, request in requests.items():
                exported = external_id(request, randomized)
                internal_ids[exported] = req_id
                if req_id not in s.requests:
                    s.added(req_id, request.num_prompt_tokens, request.num_output_tokens, exported)
                running = request.status is _RUNNING
                if running != s.requests[req_id].running:
                    if running:
                        s.scheduled(req_id, request.num_computed_tokens)
                    else:
                        s.preempted(req_id)
                s.progressed(req_id, request.num_computed_tokens, request.num_output_tokens)
            s.kv_usage(self._total_blocks - self._pool.get_num_free_blocks(), self._total_blocks, self._block_size)

    def shutdown(self) -> None:
        if self.llumlet is not None:
            self.llumlet.stop(remove=True)
            self.llumlet = None
        super().shutdown()  # type: ignore[misc]

    # ---- Abort from the gRPC thread, applied on the engine thread -----------------------------

    def _abort_from_grpc(self, request_ids: list[str]) -> list[str]:
        done: Future[list[str]] = Future()
        self._aborts.put((request_ids, done))
        deadline = time.monotonic() + ABORT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return done.result(timeout=0.05)
            except TimeoutError:
                pass
            # An idle engine runs no steps, so nothing would drain the queue; it also holds no
            # request to abort. (A len() of vLLM's dict is safe from this thread under the GIL.)
            if not self.requests and done.cancel():  # type: ignore[attr-defined]
                return []
        if done.cancel():
            raise TimeoutError(f"engine took no step in {ABORT_TIMEOUT_S}s")
        return done.result()

    def _apply_aborts(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        aborts = self._aborts
        while not aborts.empty():  # once a step: an empty check is cheaper than get_nowait's exception
            ids, done = aborts.get()
            if not done.set_running_or_notify_cancel():  # the caller gave up waiting
                continue
            internal = [self._internal_ids.get(rid, rid) for rid in ids]
            aborted = self.finish_requests(internal, RequestStatus.FINISHED_ABORTED)  # type: ignore[attr-defined]
            away = self.migration.abort_away(ids, outputs) if self.migration is not None else []
            # The frontend did not ask for these aborts: tell it, or its streams never end.
            for request in aborted:
                eco = outputs.get(request.client_index)
                if eco is None:
                    eco = outputs[request.client_index] = EngineCoreOutputs()
                eco.outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT))
            done.set_result([external_id(r, self._randomized_ids) for r in aborted] + away)


class LlumletSyncScheduler(_LlumletHooks, Scheduler):
    pass


class LlumletAsyncScheduler(_LlumletHooks, AsyncScheduler):
    pass


class LlumletScheduler(LlumletSyncScheduler):
    """The `--scheduler-cls` name: becomes the sync or async variant to match vLLM's choice."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        use_async = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        target = _AsyncVariant if use_async else cls
        return object.__new__(target)


class _AsyncVariant(LlumletScheduler, AsyncScheduler):
    """LlumletScheduler over AsyncScheduler; a subclass of LlumletScheduler so Python runs __init__."""


if "resumed_req_ids" not in getattr(CachedRequestData, "__dataclass_fields__", {}):
    # the schedule hook's test for requests joining the batch reads it (vLLM 0.32)
    raise ImportError(
        "pilotfish llumlet: vLLM's CachedRequestData has no resumed_req_ids; this vLLM version is not supported"
    )
# AsyncScheduler must come before Scheduler in the async variant, or its overrides are lost.
if _AsyncVariant.__mro__.index(AsyncScheduler) > _AsyncVariant.__mro__.index(Scheduler):
    raise ImportError("pilotfish llumlet: unexpected vLLM scheduler hierarchy; this vLLM version is not supported")
