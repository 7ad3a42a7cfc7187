"""Many simulated engines in one asyncio loop, one port each: the in-process API.

async with serve_engines(ServeConfig(engines=2, base_port=0)) as fleet:
    fleet.urls  # ["http://127.0.0.1:41234", ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pilotfish.config import ConfigError
from pilotfish.simulator.config import ANSWER_FAULTS, EngineConfig, ServeConfig
from pilotfish.simulator.engine.base import EngineCore
from pilotfish.simulator.engine.step_time import repeated_scales
from pilotfish.simulator.server.app import EngineApp
from pilotfish.simulator.server.driver import EngineDriver
from pilotfish.simulator.tokens import Tokenizer, load_tokenizer

CoreFactory = Callable[[EngineConfig], EngineCore]

YOUNG_GC_PERIOD_S = 0.01  # a loaded fleet's young collection then walks ~1k objects: well under 1 ms
MIDDLE_GC_EVERY = 10  # young collections per middle-generation one, CPython's own ratio
FULL_GC_PERIOD_S = 60.0  # the only long pause (tens of ms at 16 x 32 streams), once a minute


def default_core(config: EngineConfig) -> EngineCore:
    from pilotfish.simulator.engine.scheduler import V1Engine

    return V1Engine(config)


@dataclass(frozen=True, slots=True)
class EngineAddress:
    engine_id: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """host:port, as the gateway's destination header names it."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class SimEngine:
    address: EngineAddress
    config: EngineConfig
    driver: EngineDriver
    llumlet: Any = None  # the engine's Llumlet, in full mode (--cms-url)

    @property
    def core(self) -> EngineCore:
        return self.driver.core


@dataclass(frozen=True, slots=True)
class Fleet:
    engines: list[SimEngine]
    # run when the fleet stops (settle_for_load's collector pacing)
    on_close: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    @property
    def addresses(self) -> list[EngineAddress]:
        return [e.address for e in self.engines]

    @property
    def urls(self) -> list[str]:
        return [e.address.url for e in self.engines]

    def by_id(self, engine_id: str) -> SimEngine:
        for engine in self.engines:
            if engine.address.engine_id == engine_id:
                return engine
        raise KeyError(engine_id)


@contextlib.asynccontextmanager
async def serve_engines(
    serve: ServeConfig | None = None,
    engine: EngineConfig | Sequence[EngineConfig] | None = None,
    *,
    core_factory: CoreFactory = default_core,
    tokenizer: Tokenizer | None = None,
) -> AsyncIterator[Fleet]:
    """Start every engine (listening when this yields) and stop them all on exit.

    `engine` is one config for all engines or one per engine (heterogeneous fleets).
    """
    serve = serve or ServeConfig()
    ports = serve.resolved_ports()
    engine = engine or EngineConfig()
    configs = [engine] * len(ports) if isinstance(engine, EngineConfig) else list(engine)
    if len(configs) != len(ports):
        raise ValueError(f"{len(configs)} engine configs for {len(ports)} engines")
    if serve.step_scales:
        scales = repeated_scales(serve.step_scales, len(configs))
        configs = [msgspec.structs.replace(c, step_scale=scale) for c, scale in zip(configs, scales, strict=True)]
    tokenizer = tokenizer or load_tokenizer(serve.tokenizer_path)
    runners: list[web.AppRunner] = []
    drivers: list[EngineDriver] = []
    engines: list[SimEngine] = []
    publishers: list[Any] = []
    llumlets: list[Any] = []
    fleet: Fleet | None = None
    roles = list(serve.infer_types) or ["neutral"] * len(ports)
    if len(roles) != len(ports):
        raise ConfigError(f"--infer-types: {len(roles)} roles for {len(ports)} engines")
    if bad := [r for r in roles if r not in ("neutral", "prefill", "decode")]:
        raise ConfigError(f"--infer-types: {bad[0]!r} is not neutral, prefill or decode")
    if bad := [f for f in serve.answer_faults if f not in ANSWER_FAULTS]:
        raise ConfigError(f"--answer-faults: {bad[0]!r} is not one of {', '.join(ANSWER_FAULTS)}")
    faults = serve.answer_faults or ["ok"]
    peers: set[str] = set()  # every engine of this fleet, filled as they bind: who may prefill for whom
    try:
        for i, (port, config) in enumerate(zip(ports, configs, strict=True)):
            engine_id = f"{serve.engine_id_prefix}-{i}"
            core = core_factory(config)
            publisher = None
            kv_endpoint = ""  # advertised in the llumlet's metadata, so full-mode schedulers subscribe
            if serve.kv_events_endpoint and (not serve.kv_events_engines or i in serve.kv_events_engines):
                from pilotfish.simulator.kv_events import ZmqKVEventPublisher, engine_endpoint

                try:
                    publisher = ZmqKVEventPublisher(
                        engine_endpoint(serve.kv_events_endpoint, i), serve.kv_events_topic, config.block_size
                    )
                except Exception as exc:  # a bad endpoint or a taken port: say which flag, at start-up
                    raise ConfigError(f"--kv-events-endpoint: engine {i}: {exc}") from None
                publishers.append(publisher)
                kv_endpoint = engine_endpoint(serve.kv_events_endpoint, i).replace("*", serve.host)
                core.enable_kv_events()  # type: ignore[attr-defined]
            driver = EngineDriver(core, publisher)
            driver.start()
            drivers.append(driver)
            fault = faults[i % len(faults)]
            app = EngineApp(engine_id, serve, config, driver, tokenizer, peers, "" if fault == "ok" else fault).build()
            # handler_cancellation: a client that hangs up cancels its handler, which aborts the request
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, serve.host, port, reuse_address=True)
            await site.start()
            bound = _bound_port(runner, port)
            peers.add(f"{serve.host}:{bound}")
            llumlet = None
            if serve.cms_url:
                llumlet = _attach_llumlet(serve, config, driver, engine_id, bound, kv_endpoint, roles[i])
                llumlets.append(llumlet)
            engines.append(SimEngine(EngineAddress(engine_id, serve.host, bound), config, driver, llumlet))
        fleet = Fleet(engines)
        yield fleet
    finally:
        if fleet is not None:
            for close in fleet.on_close:
                close()
        for llumlet in llumlets:
            llumlet.stop()
        for runner in runners:
            await runner.cleanup()
        for driver in drivers:
            await driver.stop()
        for publisher in publishers:
            publisher.close()


def _attach_llumlet(
    serve: ServeConfig,
    config: EngineConfig,
    driver: EngineDriver,
    engine_id: str,
    port: int,
    kv_events_endpoint: str,
    infer_type: str = "neutral",
) -> Any:
    """Full mode on a simulated engine: the same llumlet core the vLLM plugin runs, migration included."""
    from pilotfish.simulator.llumlet_adapter import attach_llumlet
    from pilotfish.vllm_plugin.config import LlumletConfig

    llumlet_config = LlumletConfig(
        cms_url=serve.cms_url, cluster=serve.cms_cluster, instance_id=engine_id, infer_type=infer_type
    )
    return attach_llumlet(
        driver.core,
        config,
        llumlet_config,
        engine_id,
        serve.host,
        port,
        model=serve.model,
        kv_events_endpoint=kv_events_endpoint,
        loop=asyncio.get_running_loop(),
        driver=driver,
    )


def settle_for_load(fleet: Fleet, max_blocks: int = 4_000_000) -> None:
    """Make a long-running fleet's garbage-collector pauses short; call once after start, in the loop.

    A full collection walks every tracked object, and each KV block is one: at 16 engines of
    8192 blocks a pause reached 70 ms, straight into the TTFT of every stream. So the block
    pools are made whole now (they otherwise grow lazily as the cache fills) and everything
    alive is frozen out of the collector's reach (skipped above `max_blocks` blocks in all).
    Then collections are paced by the clock (`GcPacer`) until the fleet stops.
    """
    pools = [getattr(getattr(e.core, "kv", None), "pool", None) for e in fleet.engines]
    if all(p is not None for p in pools) and sum(p.num_blocks for p in pools) <= max_blocks:  # type: ignore[union-attr]
        for pool in pools:
            pool.materialize()  # type: ignore[union-attr]
        gc.collect()
        gc.freeze()
    pacer = GcPacer(asyncio.get_running_loop())
    pacer.start()
    fleet.on_close.append(pacer.stop)


class GcPacer:
    """Young collections every `YOUNG_GC_PERIOD_S` instead of CPython's allocation count.

    CPython collects the young generation when allocations minus deallocations pass 700, and a
    deallocation of *any* object counts, old ones included. In a loaded fleet every finishing
    request frees old objects, so the count hovers near zero while the young generation fills
    with the live objects of new requests: at 16 x 32 streams a young collection walked 24,000
    objects and paused the loop 15-20 ms, growing with uptime. Collecting on a clock bounds the
    young generation to what a few milliseconds allocate.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ticks = 0
        self._next_full = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        gc.disable()
        self._next_full = time.monotonic() + FULL_GC_PERIOD_S
        self._handle = self._loop.call_later(YOUNG_GC_PERIOD_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            if self._was_enabled:
                gc.enable()

    def _tick(self) -> None:
        self._ticks += 1
        now = time.monotonic()
        if now >= self._next_full:
            gc.collect(2)
            self._next_full = now + FULL_GC_PERIOD_S
        else:
            gc.collect(1 if self._ticks % MIDDLE_GC_EVERY == 0 else 0)
        self._handle = self._loop.call_later(YOUNG_GC_PERIOD_S, self._tick)


def _bound_port(runner: web.AppRunner, asked: int) -> int:
    if asked:
        return asked
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("engine site has no TCP address")
