"""Load transforms: compress time to sweep load, loop a trace to cover a longer run, cut a window."""

from __future__ import annotations

import dataclasses

from pilotfish.simulator.traces.model import Trace


def compress(trace: Trace, factor: float) -> Trace:
    """Arrivals `factor` times closer together: `factor` 2 doubles the request rate."""
    if factor <= 0:
        raise ValueError("compression factor must be > 0")
    return [dataclasses.replace(r, arrival=r.arrival / factor) for r in trace]


def take_duration(trace: Trace, seconds: float) -> Trace:
    """The requests arriving in the first `seconds`."""
    return [r for r in trace if r.arrival < seconds]


def loop_to(trace: Trace, seconds: float, *, period: float | None = None) -> Trace:
    """Repeat the trace back to back until `seconds` of arrivals.

    Each lap renames its segment keys (and request ids), so a lap shares prefixes within itself
    as the original does but never with earlier laps: the rate and the sharing statistics of the
    original hold over the whole run. `period` defaults to the last arrival (rounded up to 1 s).
    """
    if not trace:
        return []
    period = period or float(int(max(r.arrival for r in trace)) + 1)
    out: Trace = []
    lap = 0
    while lap * period < seconds:
        offset = lap * period
        for r in trace:
            at = r.arrival + offset
            if at >= seconds:
                break
            if lap == 0:
                out.append(r)
                continue
            segments = tuple((f"{key}@{lap}", n) for key, n in r.segments)
            out.append(dataclasses.replace(r, request_id=f"{r.request_id}@{lap}", arrival=at, segments=segments))
        lap += 1
    return out
