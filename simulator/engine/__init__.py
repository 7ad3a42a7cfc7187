"""The engine model: requests in, one step at a time, tokens and a step duration out.

Free of asyncio and wall-clock time: a driver passes `now` and sleeps (or advances virtual
time) by the duration each step returns.
"""

from pilotfish.simulator.engine.base import EngineCore, EngineStats, StepPlan, StepResult, TokenOutput
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import FinishReason, RequestStatus, SimRequest

__all__ = [
    "EngineCore",
    "EngineObserver",
    "EngineStats",
    "FinishReason",
    "RequestStatus",
    "SimRequest",
    "StepPlan",
    "StepResult",
    "TokenOutput",
]
