"""Lite-mode load metrics: the request and token counts of the local real-time state (LRS).

Full mode will derive num_requests from the CMS status plus the in-flight account; that is a
branch on `inst.status` here, not a new metric.
"""

from __future__ import annotations

from pilotfish.scheduler.policy.base import Metric
from pilotfish.scheduler.view.types import InstanceView, RequestInfo


class NumRequests(Metric):
    """Requests held on the instance: dispatched and not yet released."""

    name = "num_requests"
    lower_is_better = True
    lite = True

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return inst.lrs.num_requests


class NumTokens(Metric):
    """Tokens held on the instance: prompt tokens plus tokens generated so far, over held requests."""

    name = "num_tokens"
    lower_is_better = True
    lite = True

    def value(self, inst: InstanceView, req: RequestInfo) -> float:
        return inst.lrs.num_tokens
