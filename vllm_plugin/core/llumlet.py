"""The llumlet: load state fed by an engine adapter, exported to the CMS, with a gRPC API.

This object wires the parts; each job lives in its own module:
  core/state.py              LoadState: the status kept from events, incrementally
  core/exporter.py           the Exporter contract, chosen once at construction (`export_kind`)
  core/export_supervisor.py  process: an export process fed through shared memory, supervised
  core/export_thread.py      thread and inline: the export thread, the hooks' own writes
  core/server.py             the gRPC server (Migrate, MigrateIn, Abort, GetStatus) and its guard
  core/migration.py          MigrationCoordinator: Migrate and MigrateIn over a MigrationAdapter

Threads:
  engine thread   the adapter's hooks run here, inside the engine's step loop. They mutate the
                  LoadState under one lock (`with llumlet.events() as s: s.added(...)`); the
                  exporter then stores or writes the change (core/exporter.py says how, by kind).
  export thread   (in-process exporters) or export process and its watcher thread: see their modules.
  gRPC threads    Migrate, MigrateIn, Abort, GetStatus (core/server.py); Abort is handed to the
                  engine thread through `abort_handler`, migrations through `migration_adapter`
                  (core/migration.py), never applied from here.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from pilotfish.cms.writer import CmsWriter
from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig, llumlet_security
from pilotfish.vllm_plugin.core.export_supervisor import ProcessExporter
from pilotfish.vllm_plugin.core.export_thread import InlineExporter, ThreadExporter
from pilotfish.vllm_plugin.core.exporter import EventBlock, Exporter, ExportKind, export_kind, in_process_kind
from pilotfish.vllm_plugin.core.migration_api import MigrationAdapter
from pilotfish.vllm_plugin.core.state import LoadState

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.destinations import DestinationCheck
    from pilotfish.vllm_plugin.core.export_process import ExportProcess
    from pilotfish.vllm_plugin.core.migration import MigrationCoordinator

_INFER_TYPES = {
    "neutral": cms_pb2.INFER_TYPE_NEUTRAL,
    "prefill": cms_pb2.INFER_TYPE_PREFILL,
    "decode": cms_pb2.INFER_TYPE_DECODE,
}

AbortHandler = Callable[[list[str]], list[str]]


class Llumlet:
    def __init__(
        self,
        config: LlumletConfig,
        instance_id: str,
        metadata: cms_pb2.InstanceMetadata,
        writer: CmsWriter | None = None,
        abort_handler: AbortHandler | None = None,
        migration_adapter: MigrationAdapter | None = None,
        destination_check: DestinationCheck | None = None,
        *,
        own_process: bool = False,
        step_hooks: bool = False,
        watch_parent: bool = False,
        metrics_snapshot: bool = False,
    ) -> None:
        """What the engine adapter states about its engine picks the exporter, with the settings
        (core/exporter.py):

        own_process   the engine owns its process (vLLM's engine core): a child process may write
                      for it (`export_process`). Not for engines sharing a process (the
                      simulator's fleet): one child each would poll side by side.
        step_hooks    the hooks run in bursts around a long step (vLLM's): a change may be written
                      from the hook itself (`engine_thread_writes`). Not for hooks that fire per
                      token (the simulator's): they would write per token, where the export
                      thread coalesces.
        watch_parent  the engine runs in a child of its frontend (vLLM's engine core): if that
                      parent dies and this process lingers, stop exporting so the keys expire.
        metrics_snapshot  the exporter also writes the figures vLLM's /metrics shows
                      (core/metrics_snapshot.py): for an engine whose frontend runs the stat logger.
        """
        self.config = config
        self.instance_id = instance_id
        self.state = LoadState(instance_id, config.admitted_window_ms, config.max_admitted_ids)
        self.metadata = metadata
        self.metadata.instance_id = instance_id
        self.metadata.infer_type = _INFER_TYPES[config.infer_type]
        if config.node_id:
            self.metadata.node_id = config.node_id
        if config.unit_id:
            self.metadata.unit_id = config.unit_id
        # TLS files, the token and the Redis password (pilotfish/security.py), read once
        self.security = llumlet_security(config)
        self.writer = writer or CmsWriter(
            config.cms_url,
            config.cluster,
            instance_id,
            config.ttl_ms,
            redis_options=self.security.redis_options(config.cms_url),
        )
        self.abort_handler = abort_handler
        # who may receive a migrating request; None: the CMS decides (core/destinations.py)
        self.destination_check = destination_check
        # gRPC calls refused for want of credentials, by (method, reason) (core/server.py)
        self.rpc_refused: Counter[tuple[str, str]] = Counter()
        self._server: object | None = None
        # Migrate and MigrateIn answer UNIMPLEMENTED without an adapter
        self.migration: MigrationCoordinator | None = None
        self._migration_adapter: MigrationAdapter | None = None
        self.migration_adapter = migration_adapter
        self._watch_parent = watch_parent
        self.metrics_snapshot = metrics_snapshot
        self.lock = threading.Lock()
        # With stats_log_s, adapters account the engine-thread CPU their hooks cost (thread_time:
        # CPU, not wall, so a loaded machine does not inflate it) against the thread's total.
        self.profiling = config.stats_log_s > 0
        self.hook_cpu_ns = 0
        self.engine_cpu_start_ns = 0
        self.engine_cpu_ns = 0
        kind = export_kind(config, own_process=own_process, step_hooks=step_hooks)
        self.exporter: Exporter = _exporter(kind, self, fallback=in_process_kind(config, step_hooks=step_hooks))
        # the hot paths, bound once: the hooks call these on the llumlet, with no lookup beyond
        self.decode_step: Callable[[int, int, int, int], None] = self.exporter.decode_step
        self._write_block = self.exporter.write_block
        self._hold_block = self.exporter.hold_block

    @property
    def watch_parent(self) -> bool:
        """Read by the exporter at construction: set it there, not afterwards."""
        return self._watch_parent

    @property
    def migration_adapter(self) -> MigrationAdapter | None:
        return self._migration_adapter

    @migration_adapter.setter
    def migration_adapter(self, adapter: MigrationAdapter | None) -> None:
        """The engine's side of migration; assignable after construction (an adapter that needs the
        llumlet first), before or after start: each Migrate and MigrateIn reads the current one."""
        self._migration_adapter = adapter
        if adapter is None:
            self.migration = None
            return
        from pilotfish.vllm_plugin.core.migration import MigrationCoordinator

        self.migration = MigrationCoordinator(self, adapter)

    # ---- engine side --------------------------------------------------------------------------

    def events(self, write: bool = True) -> EventBlock:
        """Apply one or more engine events atomically; if they changed load, the exporter stores
        or writes it now, or wakes its thread.

        `write=False` leaves the change for the next block to write with its own: for a hook that
        another hook follows at once (vLLM frees requests inside the step's output handling), so a
        step costs one write, not one per event. Nothing else writes it: the caller answers for
        that next block.

        (`decode_step`, the steady decode step, is the exporter's, bound at construction.)
        """
        return self._write_block if write else self._hold_block

    def status_now(self) -> cms_pb2.InstanceStatus:
        """The current status, without a new update_id (GetStatus)."""
        with self.lock:
            return self.state.snapshot()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, serve_grpc: bool = True) -> None:
        if serve_grpc:
            from pilotfish.vllm_plugin.core.server import start_server

            self._server, port = start_server(self, self.config)
            self.metadata.llumlet_port = port
        exporter = self.exporter.start()
        if exporter is not self.exporter:  # a process exporter whose process could not start
            self.exporter = exporter
            self.decode_step = exporter.decode_step
            self._write_block, self._hold_block = exporter.write_block, exporter.hold_block

    def stop(self, remove: bool = True) -> None:
        """Stop exporting; `remove` deletes the keys so readers drop us now, not after the TTL."""
        self.exporter.stop(remove, self._stop_services)

    def _stop_services(self) -> None:
        if self.migration is not None:
            self.migration.shutdown()  # before the server stops, so sources hear why
        if self._server is not None:
            self._server.stop(grace=0.5)  # type: ignore[attr-defined]
            self._server = None

    # ---- the exporter's account ---------------------------------------------------------------

    @property
    def export_process(self) -> ExportProcess | None:
        """The export process changes go to (a process exporter's, while it runs), else None."""
        return getattr(self.exporter, "process", None)

    @property
    def exports(self) -> int:
        return self.exporter.exports

    @property
    def inline_exports(self) -> int:
        """Of the exports, those written from the engine's thread."""
        return self.exporter.inline_exports

    @property
    def staleness_us(self) -> deque[float]:
        return self.exporter.staleness_us

    @property
    def write_failures(self) -> int:
        return self.exporter.write_failures

    def export_once(self) -> cms_pb2.InstanceStatus:
        """Snapshot with a new update_id and write it; raises on a Redis error."""
        return self.exporter.export_once()

    def staleness_summary(self) -> str:
        return self.exporter.summary()


def _exporter(kind: ExportKind, llumlet: Llumlet, fallback: ExportKind) -> Exporter:
    if kind == "process":
        return ProcessExporter(llumlet, fallback)
    if kind == "inline":
        return InlineExporter(llumlet)
    return ThreadExporter(llumlet)
