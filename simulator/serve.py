"""`sim serve` as a process: start the fleet, announce each engine, stop cleanly on a signal."""

from __future__ import annotations

import asyncio
import signal
import sys

from pilotfish.config import ConfigError
from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import serve_engines, settle_for_load


async def serve_forever(serve: ServeConfig, engine: EngineConfig) -> int:
    from pilotfish.simulator.engine.step_time import profile_for

    profile_for(engine)  # a bad profile fails here, before any port is bound
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serve_engines(serve, engine) as fleet:
            settle_for_load(fleet)
            for address in fleet.addresses:
                print(f"engine {address.engine_id} ready on {address.endpoint}", flush=True)
            await stop.wait()
    except OSError as exc:
        raise ConfigError(f"cannot listen: {exc.strerror or exc}") from None
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print("engines stopped", file=sys.stderr, flush=True)
    return 0
