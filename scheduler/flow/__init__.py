"""Flow control: hold Schedules while every eligible engine is saturated, by band and fairly.

saturation.py judges an engine from the scheduler's view; queue.py keeps the waiting requests
(strict bands, round robin between flows); controller.py admits, queues, drains, expires and
sheds, synchronously with an injected clock (the virtual-time bench runs it as is); gate.py
drives it on the service's or colocated gateway's event loop. README.md has the knobs.
"""

from pilotfish.scheduler.flow.bands import Band, band_of
from pilotfish.scheduler.flow.controller import FlowController, FlowSettings, Shed, Stopping
from pilotfish.scheduler.flow.gate import FlowGate
from pilotfish.scheduler.flow.queue import FlowQueue, Waiting
from pilotfish.scheduler.flow.saturation import Saturation

__all__ = [
    "Band",
    "FlowController",
    "FlowGate",
    "FlowQueue",
    "FlowSettings",
    "Saturation",
    "Shed",
    "Stopping",
    "Waiting",
    "band_of",
]
