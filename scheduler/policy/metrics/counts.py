"""Request and token counts: the load metrics of lite mode, and num_requests in full mode too."""

from __future__ import annotations

from pilotfish.scheduler.policy.base import ExportedFamily, Metric
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class NumRequests(Metric):
    """Active and queued requests.

    Full mode: waiting + loading + running (CMS status) + in-flight (dispatched, not yet
    admitted). Lite mode: requests held in the LRS (dispatched and not yet released).
    """

    name = "num_requests"
    exported = ExportedFamily("pilotfish_scheduler_policy_requests", 1.0, "Requests held (LRS num_requests)")
    lower_is_better = True
    lite = True
    balance_band = (4.0, 1.2)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        if self.ctx.full_mode:
            s = inst.status
            queued = s.num_waiting + s.num_loading + s.num_running if s is not None else 0
            return queued + inst.inflight.requests
        return inst.lrs.num_requests


class NumTokens(Metric):
    """Tokens held on the instance: prompt tokens plus tokens generated so far, over LRS requests.

    A simplified lite-mode indicator; it reads the LRS in full mode too (the
    scheduler keeps it there for Release), where the engine-side metrics are the better choice.
    """

    name = "num_tokens"
    exported = ExportedFamily("pilotfish_scheduler_policy_tokens", 1.0, "Tokens of held requests (LRS num_tokens)")
    lower_is_better = True
    lite = True
    balance_band = (2048.0, 1.2)

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return inst.lrs.num_tokens
