"""The engine side of `pilotfish bench sim-capacity`: a simulated fleet that records, per request,
the engine's own arrival and first-token times (its TTFT) and when the first token's bytes were
handed to the socket, and writes them out on SIGTERM with the loop's lag, GC pauses and CPU.

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
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.bench.options import Profile
from pilotfish.simulator.engine.base import TokenOutput
from pilotfish.simulator.engine.events import EngineObserver
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.server.driver import EngineDriver, TokenSink


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The server's flags (bench sim-capacity passes --engines, --profile and --timings)."""

    engines: Annotated[int, Meta(ge=1, description="simulated engines, one port each")] = 16
    profile: Profile = "llama3-8b-a100"
    max_num_seqs: Annotated[int, Meta(ge=1, description="each engine's max_num_seqs")] = 256
    timings: Annotated[str, Meta(description="write the timings here (JSON) on SIGTERM")]
    cprofile: Annotated[str | None, Meta(description="write a cProfile of the server here (diagnosis)")] = None


class FirstTokenClock(EngineObserver):
    """x-request-id -> [engine arrival, first token, first token written], on the engine's own clock;
    and the tokens generated, in `tokens[0]`."""

    def __init__(self, out: dict[str, list[float]], tokens: list[int]) -> None:
        self.out = out
        self.tokens = tokens

    def request_added(self, request: SimRequest, now: float) -> None:
        self.out[request.request_id.split("#", 1)[0]] = [now, -1.0, -1.0]

    def token_generated(self, request: SimRequest, token_id: int, now: float) -> None:
        self.tokens[0] += 1
        if request.num_output_tokens == 1:
            self.out[request.request_id.split("#", 1)[0]][1] = now


def time_first_writes(driver: EngineDriver, out: dict[str, list[float]]) -> None:
    """Wrap each stream's sink to stamp when its first token went to the socket.

    The stamp is taken after the sink returns, so the server-side gap includes the write itself.
    """
    submit = driver.submit

    def timed_submit(request: SimRequest, sink: TokenSink | None = None) -> Any:
        if sink is None:
            return submit(request)
        rid = request.request_id.split("#", 1)[0]

        def timed(token: TokenOutput) -> None:
            sink(token)
            if token.index == 0 and rid in out:
                out[rid][2] = time.monotonic()

        return submit(request, timed)

    driver.submit = timed_submit  # type: ignore[method-assign]


_schedstat: list[int] = []  # this process's open /proc/self/schedstat, kept: a probe reads it 400 times a second


def run_delay() -> float:
    """Seconds this process has waited on a run queue, runnable but without a CPU (Linux schedstat)."""
    try:
        if not _schedstat or _schedstat[0] != os.getpid():  # opened anew in a forked child
            _schedstat[:] = [os.getpid(), os.open("/proc/self/schedstat", os.O_RDONLY)]
        return int(os.pread(_schedstat[1], 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _gc_timer(pauses: list[tuple[int, float, float, int, float]]) -> Callable[[str, dict], None]:
    """(generation, wall seconds, CPU seconds, objects collected, when) per collection: a wall pause
    far above its CPU is the process losing the CPU mid-collection, not the collection's own work."""
    started = [0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0], started[1] = time.perf_counter(), time.thread_time()
        else:
            pauses.append(
                (
                    info["generation"],
                    time.perf_counter() - started[0],
                    time.thread_time() - started[1],
                    info["collected"],
                    time.monotonic(),
                )
            )

    return on_gc


async def lag_probe(samples: list[tuple[float, float]], period: float = 0.005) -> None:
    """How late the loop wakes a sleeper (the delay every stream's next token also sees), with how
    much of that time the process spent waiting for a CPU the machine's other work held."""
    while True:
        start, waited = time.monotonic(), run_delay()
        await asyncio.sleep(period)
        samples.append((time.monotonic() - start - period, run_delay() - waited))


async def serve(cfg: ServerConfig) -> None:
    from pilotfish.simulator.config import EngineConfig, ServeConfig
    from pilotfish.simulator.fleet import serve_engines, settle_for_load

    timings: dict[str, list[float]] = {}
    tokens = [0]
    lag: list[tuple[float, float]] = []
    engine = EngineConfig(profile=cfg.profile, max_num_seqs=cfg.max_num_seqs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with serve_engines(ServeConfig(engines=cfg.engines, base_port=0), engine) as fleet:
        for e in fleet.engines:
            e.core.add_observer(FirstTokenClock(timings, tokens))
            time_first_writes(e.driver, timings)
        settle_for_load(fleet)
        probe = loop.create_task(lag_probe(lag))
        gc_pauses: list[tuple[int, float, float, int, float]] = []
        gc.callbacks.append(_gc_timer(gc_pauses))
        cpu0, waited0 = os.times(), run_delay()
        print(json.dumps({"urls": fleet.urls}), flush=True)
        await stop.wait()
        cpu1, waited1 = os.times(), run_delay()
        probe.cancel()
    with open(cfg.timings, "w") as f:
        json.dump(
            {
                "requests": timings,
                "loop_lag": lag,
                "gc_pauses": gc_pauses,
                "tokens": tokens[0],
                "run_queue_wait_seconds": waited1 - waited0,
                "cpu_seconds": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            },
            f,
        )


def main() -> int:
    import uvloop

    from pilotfish.config import ConfigError, add_struct_arguments, struct_from_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_struct_arguments(parser, ServerConfig)
    try:
        cfg = struct_from_args(ServerConfig, parser.parse_args())
    except ConfigError as exc:
        parser.error(str(exc))  # exits 2, naming the flag (--timings is required)
    if cfg.cprofile:
        import cProfile

        with cProfile.Profile() as prof:
            uvloop.run(serve(cfg))
        prof.dump_stats(cfg.cprofile)
        return 0
    uvloop.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
