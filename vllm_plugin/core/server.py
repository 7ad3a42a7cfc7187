"""The llumlet's gRPC server: Migrate, MigrateIn, Abort, GetStatus (protos/llumlet.proto).

Bound to loopback unless configured; with a token, every call must carry metadata
`authorization: Bearer <token>` or gets UNAUTHENTICATED. A small thread pool: the rescheduler and
tools call it rarely, and it must never compete with the engine for cores. Each MigrateIn stream
holds a thread for as long as its request generates, so the pool has one per allowed incoming
migration (`max_migrations`) on top of the few the short calls share.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.migration import MigrationError

if TYPE_CHECKING:
    from pilotfish.vllm_plugin.core.llumlet import Llumlet

log = logging.getLogger("pilotfish.llumlet")

MAX_ABORT_IDS = 4096
# threads for the short calls (GetStatus, Abort, Migrate waiting for acceptance), beside MigrateIn's
SHORT_CALL_WORKERS = 3
NO_MIGRATION = (
    "this engine adapter cannot migrate requests: the llumlet has no migration adapter, so the rescheduler "
    "cannot move requests from or to this engine"
)


class _TokenAuth(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>'")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(details)
        return self._deny


class LlumletService(llumlet_pb2_grpc.LlumletServicer):
    def __init__(self, llumlet: Llumlet) -> None:
        self.llumlet = llumlet

    def GetStatus(self, request: llumlet_pb2.GetStatusRequest, context: grpc.ServicerContext) -> cms_pb2.InstanceStatus:
        return self.llumlet.status_now()

    def Abort(self, request: llumlet_pb2.AbortRequest, context: grpc.ServicerContext) -> llumlet_pb2.AbortResponse:
        ids = list(request.request_ids)
        if len(ids) > MAX_ABORT_IDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(ids)} request ids (max {MAX_ABORT_IDS})")
        handler = self.llumlet.abort_handler
        if handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this engine adapter cannot abort requests")
        try:
            aborted = handler(ids)  # type: ignore[misc]
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not take the abort in time; retry")
        return llumlet_pb2.AbortResponse(aborted_request_ids=aborted)

    def Migrate(
        self, request: llumlet_pb2.MigrateRequest, context: grpc.ServicerContext
    ) -> llumlet_pb2.MigrateResponse:
        coordinator = self.llumlet.migration
        if coordinator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_MIGRATION)
        try:
            return coordinator.migrate(request)  # type: ignore[union-attr]
        except MigrationError as exc:
            context.abort(exc.code, exc.message)
        raise AssertionError("unreachable")  # context.abort raises

    def MigrateIn(
        self, request: llumlet_pb2.MigrateInRequest, context: grpc.ServicerContext
    ) -> Iterator[llumlet_pb2.MigrateInChunk]:
        coordinator = self.llumlet.migration
        if coordinator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_MIGRATION)
        return coordinator.migrate_in(request, context)  # type: ignore[union-attr]


def start_server(llumlet: Llumlet, config: LlumletConfig) -> tuple[grpc.Server, int]:
    """Serve on config.llumlet_host:llumlet_port (0: any free port); returns (server, port)."""
    interceptors = [_TokenAuth(config.llumlet_token)] if config.llumlet_token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=SHORT_CALL_WORKERS + config.max_migrations, thread_name_prefix="pilotfish-llumlet-grpc"
        ),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0)],
    )
    llumlet_pb2_grpc.add_LlumletServicer_to_server(LlumletService(llumlet), server)
    address = f"[{config.llumlet_host}]" if ":" in config.llumlet_host else config.llumlet_host
    port = server.add_insecure_port(f"{address}:{config.llumlet_port}")
    if port == 0:
        raise OSError(f"llumlet: cannot bind gRPC to {config.llumlet_host}:{config.llumlet_port}")
    server.start()
    return server, port
