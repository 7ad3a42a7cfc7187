"""GcPacer: a loaded fleet collects on a clock, not on CPython's allocation count, and gives the
collector back when it stops."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from pilotfish.simulator.fleet import MIDDLE_GC_EVERY, GcPacer


async def test_pacer_collects_on_a_clock_and_restores_automatic_collection() -> None:
    assert gc.isenabled()
    generations: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(seen)
    pacer = GcPacer(asyncio.get_running_loop())
    try:
        pacer.start()
        assert not gc.isenabled()  # no allocation-count collections while the fleet runs
        async with asyncio.timeout(60):
            while generations.count(1) < 1 or generations.count(0) < MIDDLE_GC_EVERY - 1:
                await asyncio.sleep(0.005)
    finally:
        pacer.stop()
        gc.callbacks.remove(seen)
    assert gc.isenabled()
    assert 0 in generations and 1 in generations  # young collections, and the middle one in turn


async def test_stopping_a_pacer_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        pacer = GcPacer(asyncio.get_running_loop())
        pacer.start()
        pacer.stop()
        assert not gc.isenabled()  # it was off before the pacer: the pacer must not turn it on
    finally:
        gc.enable()
