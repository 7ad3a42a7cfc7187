"""The instance status, kept from engine events: every figure the CMS status record carries.

Engine-agnostic: an adapter (vLLM scheduler subclass, simulator observer) translates its engine's
events into the calls below, by request id and token counts. Aggregates are kept incrementally
(each event removes a request's old contribution and adds its new one), so an event is O(1) and
a snapshot never walks the requests.

A request is, for load purposes:
  waiting          queued, not holding a seat in the batch (new, or preempted to recompute)
  running prefill  in the batch with prompt (or, after preemption, output) tokens still to compute
  running decode   in the batch with only the next token to compute: computed == tokens - 1
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from pilotfish.protos import cms_pb2

# The figures a status record carries as they are, named alike in LoadState and InstanceStatus
# (the export process gets them through shared memory in this order: core/handoff.py).
COUNTER_FIELDS = (
    "step_id",
    "schedulable",
    "num_waiting",
    "num_running",
    "num_loading",
    "num_running_prefill",
    "num_running_decode",
    "uncomputed_prefill_tokens",
    "running_decode_seq_len_sum",
    "used_kv_tokens",
    "total_kv_tokens",
    "unallocated_tokens",
    "last_step_duration_us",
    "last_step_prefill_tokens",
    "last_step_decode_batch",
    "last_step_seq_len_sum",
    "num_preempted_total",
    "num_migrating_out",
    "num_migrating_in",
    "num_finished_total",
    "finished_output_tokens_total",
)
counter_values = attrgetter(*COUNTER_FIELDS)  # a LoadState's, in that order, in one call


def status_record(
    instance_id: str,
    update_id: int,
    counters: dict[str, int],
    admitted_ids: list[str],
    timestamp_ms: int | None = None,
    admitted_total: int = 0,
) -> cms_pb2.InstanceStatus:
    """The CMS status record; `timestamp_ms` None is now (a virtual clock may well read 0)."""
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=time.time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms,
        num_waiting_prefill=counters["num_waiting"],
        admitted_request_ids=admitted_ids,
        admitted_total=admitted_total,
        **counters,
    )


MAX_DURATION_US = 2**32 - 1  # the record's field is 32 bits


@dataclass(slots=True)
class _Request:
    request_id: str
    num_prompt: int
    num_output: int = 0
    num_computed: int = 0
    num_cached: int = 0  # known prefix-cache hit (tokens), set when scheduled from waiting
    running: bool = False
    # LoadState.decode_steps when num_output and num_computed were last brought up to date: a
    # step of decoded_all() moves every request by one token without visiting it (_sync)
    decode_mark: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def decoding(self) -> bool:
        """The plain definition, which LoadState._apply writes out inline (tests hold them equal)."""
        return self.running and self.num_output > 0 and self.num_computed >= self.num_tokens - 1


class LoadState:
    """Mutated only by the engine's thread, under the Llumlet's lock; snapshot() by the exporter."""

    def __init__(
        self,
        instance_id: str,
        admitted_window_ms: int = 2000,
        max_admitted_ids: int = 1024,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """`clock_ns` stamps admissions and ages them out of the window: the engine's clock (a
        virtual-time cluster's, where the engines run faster or slower than the wall)."""
        self.instance_id = instance_id
        self.clock_ns = clock_ns
        self.admitted_window_ns = admitted_window_ms * 1_000_000
        self.max_admitted_ids = max_admitted_ids
        self.requests: dict[str, _Request] = {}
        self.prefilling: set[str] = set()  # the running requests in prefill (num_running_prefill of them)
        self.schedulable = True
        # aggregates, kept equal to what summing over self.requests would give
        self.num_waiting = 0
        self.num_running = 0
        self.num_running_prefill = 0
        self.num_running_decode = 0
        self.uncomputed_prefill_tokens = 0
        self.running_decode_seq_len_sum = 0
        self.unallocated_tokens = 0
        # engine-wide figures
        self.used_kv_tokens = 0
        self.total_kv_tokens = 0
        self.step_id = 0
        self.last_step_duration_us = 0
        self.last_step_prefill_tokens = 0
        self.last_step_decode_batch = 0
        self.last_step_seq_len_sum = 0
        self.num_preempted_total = 0
        self.num_loading = 0
        self.num_migrating_out = 0
        self.num_migrating_in = 0
        # requests that left with an answer, and its tokens: how long this engine's answers run
        self.num_finished_total = 0
        self.finished_output_tokens_total = 0
        self.admitted: deque[tuple[int, str]] = deque()  # (clock_ns, request id), oldest first
        self.admitted_total = 0  # ids ever appended to `admitted`
        self.decode_steps = 0  # steps applied by decoded_all()
        self.update_id = 0
        # set by every event that moved a figure; the Llumlet wakes its exporter only then
        self.changed = False

    # ---- contributions ----------------------------------------------------------------------

    def _apply(self, r: _Request, sign: int) -> None:
        # _Request.decoding written out; else its tokens not yet computed, past any cached prefix,
        # are prefill load. No min() or max(): engines call this a few times per event, on cold
        # caches inside vLLM (bench llumlet-cachesim)
        self.changed = True
        tokens = r.num_prompt + r.num_output
        computed = r.num_computed
        if r.running and r.num_output > 0 and computed >= tokens - 1:  # decoding
            self.num_running += sign
            self.num_running_decode += sign
            self.running_decode_seq_len_sum += sign * tokens
            return
        done = computed if computed > r.num_cached else r.num_cached
        uncomputed = tokens - done if tokens > done else 0
        self.uncomputed_prefill_tokens += sign * uncomputed
        if not r.running:
            self.num_waiting += sign
            self.unallocated_tokens += sign * uncomputed
            return
        self.num_running += sign
        self.num_running_prefill += sign
        if sign > 0:
            self.prefilling.add(r.request_id)
        else:
            self.prefilling.discard(r.request_id)

    # ---- events -----------------------------------------------------------------------------

    def added(
        self, request_id: str, num_prompt_tokens: int, num_output_tokens: int = 0, exported_id: str | None = None
    ) -> None:
        """A request joined the waiting queue (admitted by the engine).

        `exported_id` is the id readers know it by, where the engine renamed it on admission.
        """
        if request_id in self.requests:
            return
        r = _Request(request_id, num_prompt_tokens, num_output_tokens, decode_mark=self.decode_steps)
        self.requests[request_id] = r
        self._apply(r, +1)
        self.admitted.append((self.clock_ns(), exported_id or request_id))
        self.admitted_total += 1

    def scheduled(self, request_id: str, num_computed_tokens: int, num_cached_tokens: int = 0) -> None:
        """A waiting (or preempted) request entered the running batch; cached tokens came free."""
        r = self.requests.get(request_id)
        if r is None:
            return
        self._sync(r)
        self._apply(r, -1)
        r.running = True
        r.num_computed = num_computed_tokens
        r.num_cached = num_cached_tokens
        self._apply(r, +1)

    def cache_hit(self, request_id: str, num_tokens: int) -> None:
        """The prefix-cache lookup found `num_tokens` computed tokens: no prefill work for them."""
        r = self.requests.get(request_id)
        if r is None:
            return
        self._sync(r)
        self._apply(r, -1)
        r.num_cached = num_tokens
        self._apply(r, +1)

    def progressed(self, request_id: str, num_computed_tokens: int, num_output_tokens: int) -> None:
        """Tokens were computed (a prefill chunk) or sampled (a new output token)."""
        r = self.requests.get(request_id)
        if r is None:
            return
        if r.decode_mark != self.decode_steps:
            self._sync(r)
        # The hot path, once per decoding request per step: a decode stays a decode and only its
        # length moves. Inlined: the general path below costs ~4x as much.
        num_output = r.num_output
        if (
            r.running
            and num_output
            and num_output_tokens
            and r.num_computed >= r.num_prompt + num_output - 1
            and num_computed_tokens >= r.num_prompt + num_output_tokens - 1
        ):
            if num_output_tokens != num_output:
                self.running_decode_seq_len_sum += num_output_tokens - num_output
                self.changed = True
            r.num_computed = num_computed_tokens
            r.num_output = num_output_tokens
            return
        self._apply(r, -1)
        r.num_computed = num_computed_tokens
        r.num_output = num_output_tokens
        self._apply(r, +1)

    def decoded_all(self) -> None:
        """Every running decode sampled exactly one token (the adapter checked that); waiting
        requests and running prefills did not move by it (the adapter visits the prefills it
        scheduled next, with their own counts). O(running prefills): the decodes are brought up
        to date when an event next names one (_sync)."""
        self.decode_steps += 1
        self.running_decode_seq_len_sum += self.num_running_decode
        self.changed = True
        if self.prefilling:
            requests, mark = self.requests, self.decode_steps
            for request_id in self.prefilling:
                requests[request_id].decode_mark = mark  # sat this one out

    def decode_step(self, duration_us: int, used_kv_tokens: int) -> None:
        """A whole steady decode step: what decoded_all, step_finished and kv_usage would do, in
        one call and without setting `changed` (the caller stores the step: Llumlet.decode_step).

        The adapter checked what decoded_all needs, and that no request is in prefill. One call,
        not three: vLLM runs this once a step on caches its model just evicted, where each Python
        call costs microseconds (bench llumlet-cachesim). No call inside either: Python switches threads
        only at calls and loops, so a reader on another thread sees this step whole or not at all.
        """
        n = self.num_running_decode
        self.decode_steps += 1
        self.step_id += 1
        self.running_decode_seq_len_sum = seq_len_sum = self.running_decode_seq_len_sum + n
        self.used_kv_tokens = used_kv_tokens
        self.last_step_duration_us = duration_us
        self.last_step_prefill_tokens = 0
        self.last_step_decode_batch = n
        self.last_step_seq_len_sum = seq_len_sum - n

    def _sync(self, r: _Request) -> None:
        # Only decodes are ever moved by decoded_all (running prefills sit it out: it moves their
        # mark), and a request stops decoding only through an event, which syncs it first: so the
        # lag of a running request is its own. A waiting one sat those steps out.
        if not r.running:
            r.decode_mark = self.decode_steps
            return
        lag = self.decode_steps - r.decode_mark
        if lag:
            r.num_output += lag
            r.num_computed += lag
            r.decode_mark = self.decode_steps

    def preempted(self, request_id: str) -> None:
        """A running request lost its KV and went back to waiting, to recompute everything."""
        r = self.requests.get(request_id)
        if r is None:
            return
        self._sync(r)
        self._apply(r, -1)
        r.running = False
        r.num_computed = 0
        r.num_cached = 0
        self._apply(r, +1)
        self.num_preempted_total += 1

    def finished(self, request_id: str, answered: bool = True, num_output_tokens: int = -1) -> None:
        """A request left the engine (finished, stopped or aborted). `answered` False: it goes on
        elsewhere (migrated away), so its output so far is not an answer's length. `num_output_tokens`:
        the engine's own count, where it has one (vLLM frees a request before the step that sampled its
        last token is entered here, so the count held would be one short)."""
        r = self.requests.pop(request_id, None)
        if r is not None:
            self._sync(r)
            self._apply(r, -1)
            if answered:
                self.num_finished_total += 1
                self.finished_output_tokens_total += num_output_tokens if num_output_tokens >= 0 else r.num_output

    def migrating(self, out_delta: int = 0, in_delta: int = 0, loading_delta: int = 0) -> None:
        """Requests started or stopped moving: out (detached here, not yet accepted elsewhere), in
        (arriving, not yet admitted), loading (admitted, their KV still in transfer)."""
        self.num_migrating_out = max(0, self.num_migrating_out + out_delta)
        self.num_migrating_in = max(0, self.num_migrating_in + in_delta)
        self.num_loading = max(0, self.num_loading + loading_delta)
        self.changed = True

    def kv_usage(self, used_blocks: int, total_blocks: int, block_size: int) -> None:
        """Blocks allocated are carried, not a reason to write: they move with the events that
        move them (admission, tokens), each of which writes the figure with it; a decode step
        allocating a block would otherwise cost a write of its own, a step ahead of its token.
        Blocks freed are a reason: vLLM can free them with no event of ours (delay_free_blocks,
        once a KV transfer is done), and room freed is what a scheduler waits to see."""
        used = (used_blocks if used_blocks < total_blocks else total_blocks) * block_size
        if used < self.used_kv_tokens:
            self.changed = True
        self.used_kv_tokens = used
        self.total_kv_tokens = total_blocks * block_size

    def step_finished(self, duration_s: float, prefill_tokens: int, decode_batch: int, seq_len_sum: int) -> None:
        self.step_id += 1
        self.changed = True
        duration_us = int(duration_s * 1e6)
        self.last_step_duration_us = duration_us if duration_us < MAX_DURATION_US else MAX_DURATION_US
        self.last_step_prefill_tokens = prefill_tokens
        self.last_step_decode_batch = decode_batch
        self.last_step_seq_len_sum = seq_len_sum

    def set_schedulable(self, value: bool) -> None:
        if value != self.schedulable:
            self.schedulable = value
            self.changed = True

    # ---- export -----------------------------------------------------------------------------

    def next_update_id(self) -> int:
        # Microseconds of wall time as a floor: a restarted llumlet continues above its last
        # record instead of at 1, which a reader holding that record would drop as stale.
        floor = time.time_ns() // 1000
        self.update_id = update_id = self.update_id + 1 if self.update_id >= floor else floor  # no max(): hot
        return update_id

    def trim_admitted(self) -> None:
        """Drop admitted ids older than the window, and the oldest beyond the cap."""
        horizon = self.clock_ns() - self.admitted_window_ns
        admitted = self.admitted
        while admitted and admitted[0][0] < horizon:
            admitted.popleft()
        while len(admitted) > self.max_admitted_ids:
            admitted.popleft()

    def snapshot(self, update_id: int | None = None, timestamp_ms: int | None = None) -> cms_pb2.InstanceStatus:
        """The status record as of now; `update_id` None keeps the last one (for GetStatus),
        `timestamp_ms` None stamps it with the wall clock."""
        self.trim_admitted()
        # status_record's record, every counter named here rather than gathered into a dict and
        # spread: the virtual-time cluster takes one per engine step, and the dict cost as much
        # as the record (tests/unit/test_llumlet_core.py holds the two equal)
        return cms_pb2.InstanceStatus(
            instance_id=self.instance_id,
            update_id=self.update_id if update_id is None else update_id,
            timestamp_ms=time.time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms,
            num_waiting_prefill=self.num_waiting,
            admitted_request_ids=[rid for _, rid in self.admitted],
            admitted_total=self.admitted_total,
            step_id=self.step_id,
            schedulable=self.schedulable,
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_loading=self.num_loading,
            num_running_prefill=self.num_running_prefill,
            num_running_decode=self.num_running_decode,
            uncomputed_prefill_tokens=self.uncomputed_prefill_tokens,
            running_decode_seq_len_sum=self.running_decode_seq_len_sum,
            used_kv_tokens=self.used_kv_tokens,
            total_kv_tokens=self.total_kv_tokens,
            unallocated_tokens=self.unallocated_tokens,
            last_step_duration_us=self.last_step_duration_us,
            last_step_prefill_tokens=self.last_step_prefill_tokens,
            last_step_decode_batch=self.last_step_decode_batch,
            last_step_seq_len_sum=self.last_step_seq_len_sum,
            num_preempted_total=self.num_preempted_total,
            num_migrating_out=self.num_migrating_out,
            num_migrating_in=self.num_migrating_in,
            num_finished_total=self.num_finished_total,
            finished_output_tokens_total=self.finished_output_tokens_total,
        )
