"""The scheduler's view of the cluster.

- `types`: `InstanceView` (what a policy reads), `RequestInfo`, the LRS and in-flight sums;
- `lrs`: lite mode's local real-time state (held requests, until Release);
- `cms_view`: full mode's view from the CMS records (metadata, status, monotonic update ids);
- `account`: the dispatch-time in-flight account and its reconciliation rule;
- `predictor` and `profile`: the online step-time fit, forward prediction, TTFT/TPOT tables;
- `prefix_index`: which instance holds which prefix blocks (cache-aware scheduling).
"""

from pilotfish.scheduler.view.lrs import LocalRealtimeState, RequestEntry
from pilotfish.scheduler.view.types import (
    Endpoint,
    EngineStatus,
    InferType,
    InflightLoad,
    InstanceView,
    LrsLoad,
    RequestInfo,
)

__all__ = [
    "Endpoint",
    "EngineStatus",
    "InferType",
    "InflightLoad",
    "InstanceView",
    "LocalRealtimeState",
    "LrsLoad",
    "RequestEntry",
    "RequestInfo",
]
