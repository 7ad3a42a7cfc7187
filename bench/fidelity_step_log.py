"""bench fidelity's step log inside vLLM: what each engine step scheduled, and when it ran.

vLLM's scheduler under this subclass appends one line per step to the file named by
$PILOTFISH_BENCH_STEP_LOG (fidelity_steps.STEP_LOG_ENV): the step's start and end on the
system's monotonic clock (ns; the client and the simulator stamp the same clock), its prefill
tokens, decoding requests and context tokens (the step-time model's P, D and C, counted as the
simulator counts them), the requests added since the previous step, and whether requests were
left when it ended. The start is `schedule()`'s entry, the end `update_from_output()`'s exit,
so start to next start is one whole engine-core cycle. The lines are buffered and written every
64 steps and whenever the engine has no request left, so the benchmark reads a run's steps once
it has ended. Its cost (a few lookups per scheduled request, not timed) falls on the
calibration's steps as on the runs', so the profile fitted here includes it.
"""

from __future__ import annotations

import os
from time import monotonic_ns
from typing import Any, TextIO

from vllm.v1.core.sched.scheduler import Scheduler

from pilotfish.bench.fidelity_steps import STEP_LOG_ENV

_FLUSH_EVERY = 64  # steps


class StepLoggedScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(STEP_LOG_ENV)
        self._step_log: TextIO | None = open(path, "a") if path else None  # noqa: SIM115 (the engine's lifetime)
        self._step_lines: list[str] = []
        self._arrivals = 0
        self._step_open: tuple[int, int, int, int, int] | None = None

    def add_request(self, request: Any) -> None:
        self._arrivals += 1
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        start = monotonic_ns()
        output = super().schedule(*args, **kwargs)
        if not output.total_num_scheduled_tokens:
            return output
        prefill = decodes = context = 0
        requests = self.requests
        for rid, n in output.num_scheduled_tokens.items():
            request = requests[rid]
            # schedule() has advanced num_computed_tokens by n already (_update_after_schedule)
            after = request.num_computed_tokens
            if n == 1 and request.num_output_tokens > 0 and after == request.num_tokens:
                decodes += 1
            else:
                prefill += n
            context += after
        self._step_open = (start, prefill, decodes, context, self._arrivals)
        self._arrivals = 0
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        step, self._step_open = self._step_open, None
        if step is not None and self._step_log is not None:
            start, prefill, decodes, context, arrivals = step
            busy = 1 if self.requests else 0
            self._step_lines.append(f"{start} {monotonic_ns()} {prefill} {decodes} {context} {arrivals} {busy}\n")
            if len(self._step_lines) >= _FLUSH_EVERY or not busy:
                self._step_log.write("".join(self._step_lines))
                self._step_log.flush()
                self._step_lines.clear()
        return outputs
