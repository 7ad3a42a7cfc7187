"""The scheduler's view of the cluster: instance views and the local real-time state (LRS).

Full mode will add the CMS reader, the in-flight account and forward prediction here; the
policy reads only `InstanceView`, so it does not change when they arrive.
"""

from pilotfish.scheduler.view.lrs import LocalRealtimeState, RequestEntry
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView, LrsLoad, RequestInfo

__all__ = [
    "Endpoint",
    "InferType",
    "InstanceView",
    "LocalRealtimeState",
    "LrsLoad",
    "RequestEntry",
    "RequestInfo",
]
