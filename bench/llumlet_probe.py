"""bench llumlet's probe inside vLLM: the engine thread's CPU spent scheduling, per step.

Throughput on a shared two-core machine moves between rounds by ten times the 1% goal. What
the llumlet adds to a step is CPU on vLLM's engine-core thread, inside the scheduler methods
its hooks run in: `add_request`, `schedule` (which calls `_update_after_schedule`) and
`update_from_output` (which calls `_free_request`). The probe times those with the thread's CPU
clock, which leaves out the wait for the model (the worker runs in another process) and time
the thread spent preempted by other processes. Both arms of the benchmark run under the same
probe (`ProbedScheduler`: vLLM's own scheduler; `ProbedLlumletScheduler`: the llumlet's), so the
difference per step is the llumlet's cost on the step's critical path, the probe's own two clock
reads a call falling on both.

$PILOTFISH_BENCH_BURN_US (bench llumlet's control arm, `--variant burn:...`) makes every step
spend that much more of the engine thread's CPU, in `update_from_output`, doing nothing: what
any added CPU of that size costs vLLM's step on this machine, beside what the llumlet costs.
With $PILOTFISH_BENCH_BURN_AT=dispatch it burns in `get_grammar_bitmask` instead, which vLLM
calls once it has handed the step to the model and before it waits for the result: what the
same CPU costs while the model runs. With $PILOTFISH_BENCH_BURN_BLOCK=k it burns in blocks of k
steps, k on and k off, and the probe times each step's cycle (one step's end to the next's, wall
clock) in both: steps milliseconds apart see the same machine, so the difference is what that CPU
costs a step here, free of the drift between rounds (seconds apart) that swamps a throughput
comparison. Only decode steps count (one token each, as many as the step before: a step with a
prefill is milliseconds longer, and would land in either set by chance), and not the first of a
block (a burn's cost may spill into the step after it).

$PILOTFISH_BENCH_LLUMLET_BLOCK=k does the same with the llumlet itself, in the llumlet's scheduler:
its hooks work for k steps and sit k out (the llumlet parked: `llumlet` None, so they only call
vLLM's methods, as with no CMS), and the probe times both. At the first step of each block on,
before vLLM schedules it, the llumlet is brought to vLLM's requests (`resync`, O(requests)); that
step is the first of its block, so its cycle is not counted. The difference is everything the hooks
cost a decode step on the critical path, whatever it is spent on (CPU, caches, allocation, the
export process's wake on the other CPU), measured, not priced.

The running totals go to the file named by $PILOTFISH_BENCH_PROBE_FILE (the steps, then the CPU
ns in each method of llumlet_overhead.PROBED, then the cycles timed in blocks on and their ns,
and in blocks off and theirs), replaced every 32 steps and whenever the engine
has no request left, so the benchmark reads them between rounds. Only the synchronous scheduler
is probed: vLLM on CPU runs no other.
"""

from __future__ import annotations

import os
from pathlib import Path
from time import perf_counter_ns, thread_time_ns
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from pilotfish.bench.llumlet_overhead import (
    BURN_AT_ENV,
    BURN_BLOCK_ENV,
    BURN_US_ENV,
    LLUMLET_BLOCK_ENV,
    PROBE_FILE_ENV,
    PROBED,
)
from pilotfish.vllm_plugin.adapters.vllm_v1 import LlumletSyncScheduler

_FLUSH_EVERY = 32  # steps
_CYCLE_GAP_NS = 1_000_000_000  # a longer cycle spans an idle engine: not a step's


class _Probe:
    """Mixed in before the scheduler class it times; `self` is that scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        path = os.environ.get(PROBE_FILE_ENV)
        self._probe_file = Path(path) if path else None
        self._probe_steps = 0
        self._probe_ns = dict.fromkeys(PROBED, 0)  # CPU in each probed method
        self._burn_ns = int(float(os.environ.get(BURN_US_ENV) or 0) * 1000)
        self._burn_at_dispatch = os.environ.get(BURN_AT_ENV, "update") == "dispatch"
        self._hooks_block = max(int(os.environ.get(LLUMLET_BLOCK_ENV) or 0), 0)
        # steps are timed in blocks k on, k off: of the burn, else of the llumlet's hooks
        self._block = max(int(os.environ.get(BURN_BLOCK_ENV) or 0), 0) or self._hooks_block
        self._on = False  # this step is in a block on (burns; its hooks work)
        self._on_last = False  # the step before was
        self._burn_now = False  # this step burns
        self._cycle_end = 0  # perf_counter_ns at the end of the last step
        self._last_batch = 0  # requests the step before scheduled
        self._cycles = [0, 0, 0, 0]  # steps in blocks on, their cycles' ns; steps in blocks off, theirs
        self._probe_flush()

    def add_request(self, request: Any) -> None:
        t0 = thread_time_ns()
        super().add_request(request)  # type: ignore[misc]
        self._probe_ns["add_request"] += thread_time_ns() - t0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        block = self._block
        self._on = on = not block or self._probe_steps // block % 2 == 1
        self._burn_now = bool(self._burn_ns) and on
        if self._hooks_block:
            self._switch_hooks(on)
        t0 = thread_time_ns()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._probe_ns["schedule"] += thread_time_ns() - t0
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t0 = thread_time_ns()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._burn_now and not self._burn_at_dispatch and scheduler_output.total_num_scheduled_tokens:
            self._burn()
        self._probe_ns["update_from_output"] += thread_time_ns() - t0
        if scheduler_output.total_num_scheduled_tokens:
            end = perf_counter_ns()
            batch = len(scheduler_output.num_scheduled_tokens)
            if (
                self._block
                and self._cycle_end
                and end - self._cycle_end < _CYCLE_GAP_NS
                and scheduler_output.total_num_scheduled_tokens == batch == self._last_batch  # decodes alike
                and self._on == self._on_last  # not the first of a block
            ):
                at = 0 if self._on else 2
                self._cycles[at] += 1
                self._cycles[at + 1] += end - self._cycle_end
            self._cycle_end, self._last_batch, self._on_last = end, batch, self._on
            self._probe_steps += 1
            if self._probe_steps % _FLUSH_EVERY == 0 or not self.requests:  # type: ignore[attr-defined]
                self._probe_flush()
        return outputs

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        grammar = super().get_grammar_bitmask(scheduler_output)  # type: ignore[misc]
        if self._burn_now and self._burn_at_dispatch and scheduler_output.total_num_scheduled_tokens:
            self._burn()
        return grammar

    def _switch_hooks(self, on: bool) -> None:
        """The llumlet's scheduler only (LLUMLET_BLOCK_ENV): park the llumlet, or bring it back."""

    def _burn(self) -> None:
        until = thread_time_ns() + self._burn_ns
        while thread_time_ns() < until:
            pass

    def _probe_flush(self) -> None:
        if self._probe_file is None:
            return
        staged = self._probe_file.with_suffix(".tmp")
        staged.write_text(" ".join(map(str, (self._probe_steps, *self._probe_ns.values(), *self._cycles))) + "\n")
        os.replace(staged, self._probe_file)  # whole, for a reader in another process


class ProbedScheduler(_Probe, Scheduler):
    """vLLM's scheduler, probed: the benchmark's baseline."""


class ProbedLlumletScheduler(_Probe, LlumletSyncScheduler):
    """The llumlet's scheduler, probed."""

    _parked: Any = None  # the llumlet, while its hooks sit a block out

    def _switch_hooks(self, on: bool) -> None:
        if on and self._parked is not None:
            self.llumlet, self._parked = self._parked, None
            self.resync()
        elif not on and self.llumlet is not None:
            self._parked, self.llumlet = self.llumlet, None

    def shutdown(self) -> None:
        if self._parked is not None:  # its keys are removed and its report logged as ever
            self._switch_hooks(True)
        super().shutdown()
