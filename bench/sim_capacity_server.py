"""The engine side of `pilotfish bench sim-capacity`: a simulated fleet that records, per request,
the engine's own arrival and first-token times (its TTFT), and writes them out on SIGTERM.

    python -m pilotfish.bench.sim_capacity_server --engines 16 --timings FILE [engine flags]

Prints one JSON line `{"urls": [...]}` once every engine listens. Runs on uvloop, as `sim serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable

from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import SimRequest


class FirstTokenClock(EngineObserver):
    """x-request-id -> [engine arrival, first token], on the engine's own clock."""

    def __init__(self, out: dict[str, list[float]]) -> None:
        self.out = out

    def request_added(self, request: SimRequest, now: float) -> None:
        self.out[request.request_id.split("#", 1)[0]] = [now, -1.0]

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        if request.num_output_tokens == 1:
            self.out[request.request_id.split("#", 1)[0]][1] = now


def _gc_timer(pauses: list[float]) -> Callable[[str, dict], None]:
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    return on_gc


async def _lag_probe(samples: list[float], period: float = 0.005) -> None:
    """How late the loop wakes a sleeper: the delay every stream's next token also sees."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(period)
        samples.append(time.monotonic() - start - period)


async def serve(args: argparse.Namespace) -> None:
    from pilotfish.simulator.config import EngineConfig, ServeConfig
    from pilotfish.simulator.fleet import serve_engines, settle_for_load

    timings: dict[str, list[float]] = {}
    lag: list[float] = []
    engine = EngineConfig(profile=args.profile, max_num_seqs=args.max_num_seqs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with serve_engines(ServeConfig(engines=args.engines, base_port=0), engine) as fleet:
        for e in fleet.engines:
            e.core.add_observer(FirstTokenClock(timings))
        settle_for_load(fleet)
        probe = loop.create_task(_lag_probe(lag))
        gc_pauses: list[float] = []
        gc.callbacks.append(_gc_timer(gc_pauses))
        cpu0 = os.times()
        print(json.dumps({"urls": fleet.urls}), flush=True)
        await stop.wait()
        cpu1 = os.times()
        probe.cancel()
    with open(args.timings, "w") as f:
        json.dump({"requests": timings, "loop_lag": lag, "gc_pauses": gc_pauses,
                   "cpu_seconds": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)}, f)


def main() -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--profile", default="llama3-8b-a100")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--timings", required=True)
    parser.add_argument("--cprofile", default=None, help="write a cProfile of the server here (diagnosis)")
    args = parser.parse_args()
    if args.cprofile:
        import cProfile

        with cProfile.Profile() as prof:
            uvloop.run(serve(args))
        prof.dump_stats(args.cprofile)
        return 0
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
