"""Simulator adapter: the llumlet core on a simulated engine, through its EngineObserver hooks.

    llumlet = attach_llumlet(engine_core, engine_config, llumlet_config, instance_id, host, port, loop=loop)
    ...
    llumlet.stop()

With the HTTP driver as well (`driver=`), the llumlet can migrate requests in and out
(simulator/llumlet_migration.py).

Observer hooks run inside the simulator's step (on its asyncio loop, or in virtual time); each
updates the LoadState under the llumlet's lock and wakes the export thread (the llumlet's
"thread" exporter, vllm_plugin/core/exporter.py), as the vLLM adapter's hooks do when they
write from vLLM's process. The hooks' translation is load_observer.py's, which the virtual-time
cluster's statuses use too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING, Any

from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2
from pilotfish.simulator.llumlet_migration import SimMigrationAdapter
from pilotfish.simulator.load_observer import LoadObserver, used_blocks_reader
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.llumlet import Llumlet

if TYPE_CHECKING:
    from pilotfish.simulator.server.driver import EngineDriver

ABORT_TIMEOUT_S = 5.0


def attach_llumlet(
    core: Any,
    engine_config: Any,
    config: LlumletConfig,
    instance_id: str,
    host: str,
    http_port: int,
    *,
    model: str = "",
    kv_events_endpoint: str = "",
    loop: asyncio.AbstractEventLoop | None = None,
    driver: EngineDriver | None = None,
    serve_grpc: bool = True,
    start: bool = True,
    writer: CmsWriter | None = None,
) -> Llumlet:
    """Attach a started llumlet to a simulator engine core (`V1Engine` or any EngineCore).

    `loop` is the asyncio loop that owns the core: Abort calls from the gRPC thread run there.
    Without it Abort answers UNIMPLEMENTED (a virtual-time core has no thread to hand them to).
    `driver` (the HTTP driver running `core` on `loop`) enables Migrate and MigrateIn; without
    it they answer UNIMPLEMENTED. `writer`: the CMS writer (default: one for `config.cms_url`).

    Every write goes from the export thread: the observer's hooks fire per token, where the
    thread coalesces, and the simulated engines share one process (no export process each).
    """
    meta = cms_pb2.InstanceMetadata(
        host=host,
        http_port=http_port,
        model=model,
        block_size=engine_config.block_size,
        num_gpu_blocks=engine_config.num_gpu_blocks,
        max_num_batched_tokens=engine_config.max_num_batched_tokens,
        max_num_seqs=engine_config.max_num_seqs,
        dp_size=1,
        kv_events_endpoint=kv_events_endpoint,
    )
    abort = None
    if loop is not None:

        def abort(request_ids: list[str]) -> list[str]:
            def run() -> list[str]:
                if driver is not None:  # through the driver, so each client's stream ends too
                    return [rid for rid in request_ids if driver.abort_from_engine(rid)]
                now = loop.time()
                return [rid for rid in request_ids if core.abort_request(rid, now)]

            done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
            loop.call_soon_threadsafe(lambda: done.set_result(run()))
            return done.result(timeout=ABORT_TIMEOUT_S)

    migration = None
    if loop is not None and driver is not None:
        migration = SimMigrationAdapter(driver, engine_config, loop)
    llumlet = Llumlet(
        config,
        instance_id,
        meta,
        writer=writer,
        abort_handler=abort,
        migration_adapter=migration,
        own_process=False,
        step_hooks=False,
    )
    num_blocks = engine_config.num_gpu_blocks
    used_blocks = used_blocks_reader(core, num_blocks)
    core.add_observer(LoadObserver(llumlet.events, used_blocks, engine_config.block_size, num_blocks))
    if migration is not None:
        migration.llumlet = llumlet
        core.add_observer(migration)
    if start:
        llumlet.start(serve_grpc=serve_grpc and config.serve_grpc)
    return llumlet
