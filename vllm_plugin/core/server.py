"""The llumlet's gRPC server: Migrate, MigrateIn, Abort, GetStatus (protos/llumlet.proto).

Bound to loopback unless configured. Security (pilotfish/security.py, the PILOTFISH_TLS_*,
PILOTFISH_AUTH_TOKEN_FILE and PILOTFISH_INSECURE settings every component shares):
- beyond loopback with neither TLS nor a token the server refuses to start (ConfigError naming the
  settings), unless PILOTFISH_INSECURE is set;
- with TLS it serves the certificate files (re-read when they change); with a CA, callers must
  present a certificate it signed (mutual TLS), which authenticates them;
- with a token (PILOTFISH_AUTH_TOKEN_FILE, or the older PILOTFISH_LLUMLET_TOKEN), every call must carry
  metadata `authorization: Bearer <token>` or gets UNAUTHENTICATED;
- without a token, on loopback every call is open (only this machine can call);
- without a token or a client certificate, beyond loopback (PILOTFISH_INSECURE, or TLS without a CA),
  the calls that act on users' requests (Abort, Migrate, MigrateIn) are refused with
  PERMISSION_DENIED, and GetStatus is served without the request ids.
Each refusal is counted in `Llumlet.rpc_refused` (by method and reason) and logged (WARNING,
rate-limited per peer). A small thread pool: the rescheduler and
tools call it rarely, and it must never compete with the engine for cores. Each MigrateIn stream
holds a thread for as long as its request generates, so the pool has one per allowed incoming
migration (`max_migrations`) on top of the few the short calls share.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from pilotfish.cms.refusals import RefusalLog
from pilotfish.config import ConfigError
from pilotfish.grpc_malformed import MALFORMED as NOT_DECODED
from pilotfish.grpc_malformed import lenient
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.security import is_loopback
from pilotfish.vllm_plugin.config import LlumletConfig, env_name
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


# the calls that act on users' requests: never open beyond loopback without a token
CONTROL_METHODS = frozenset({"Abort", "Migrate", "MigrateIn"})
UNAUTHENTICATED = "unauthenticated"  # a token is configured; the call's is missing or wrong
NO_TOKEN_CONFIGURED = "no_token_beyond_loopback"
MALFORMED = "malformed"  # the request message is not a protobuf


def _env_names(message: str) -> str:
    return re.sub(r"--([a-z0-9-]+)", lambda m: env_name(m.group(1).replace("-", "_")), message)


class _Guard(grpc.ServerInterceptor):
    def __init__(self, token: str, loopback: bool, refused: Counter[tuple[str, str]]) -> None:
        """`loopback`: callers are trusted without a token (a loopback bind, or mutual TLS)."""
        self._expected = f"Bearer {token}".encode() if token else b""
        self._loopback = loopback
        self._refused = refused
        self._log = RefusalLog(log, what="refused llumlet call from peer")
        # method -> (the handler found, its copy that refuses a request message that is not a protobuf)
        self._lenient: dict[str, tuple[Any, Any]] = {}

    def _deny(self, method: str, code: grpc.StatusCode, reason: str, message: str) -> Any:
        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            self._refused[(method, reason)] += 1
            self._log.note(context.peer(), reason, f"{method}: {message}")
            context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(deny)

    def _admitted(self, method: str, handler: Any) -> Any:
        """`handler`, refusing a request message that does not decode: grpc's own decode would answer INTERNAL
        and log a traceback per call, inside the engine's process, for anyone who may call GetStatus."""
        kept = self._lenient.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        guarded = handler
        if handler is not None and not handler.request_streaming and handler.request_deserializer is not None:
            inner = handler.unary_stream or handler.unary_unary

            def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
                if request is NOT_DECODED:
                    self._refused[(method, MALFORMED)] += 1
                    self._log.note(context.peer(), MALFORMED, f"{method}: the request message is not a protobuf")
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request message is not a valid protobuf")
                return inner(request, context)

            make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else (
                grpc.unary_unary_rpc_method_handler)
            guarded = make(behaviour, request_deserializer=lenient(handler.request_deserializer),
                           response_serializer=handler.response_serializer)  # fmt: skip
        self._lenient[method] = (handler, guarded)
        return guarded

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        if self._expected:
            for key, value in details.invocation_metadata or ():
                if key == "authorization":
                    given = value.encode() if isinstance(value, str) else value
                    if hmac.compare_digest(given, self._expected):
                        return self._admitted(method, continuation(details))
            return self._deny(
                method, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED,
                "missing or wrong 'authorization: Bearer <token>'",
            )  # fmt: skip
        if self._loopback or method not in CONTROL_METHODS:
            return self._admitted(method, continuation(details))
        return self._deny(
            method, grpc.StatusCode.PERMISSION_DENIED, NO_TOKEN_CONFIGURED,
            f"{method} is refused: this llumlet listens beyond loopback without a token; set "
            "PILOTFISH_AUTH_TOKEN_FILE (or PILOTFISH_LLUMLET_TOKEN) here and the same token on every llumlet "
            "and the scheduler (--auth-token-file), or client certificates (PILOTFISH_TLS_CA_FILE)",
        )  # fmt: skip


class LlumletService(llumlet_pb2_grpc.LlumletServicer):
    def __init__(self, llumlet: Llumlet, redact_request_ids: bool = False) -> None:
        self.llumlet = llumlet
        # beyond loopback without a token: callers are unknown, so no request ids for them
        self.redact_request_ids = redact_request_ids

    def GetStatus(self, request: llumlet_pb2.GetStatusRequest, context: grpc.ServicerContext) -> cms_pb2.InstanceStatus:
        status = self.llumlet.status_now()
        if self.redact_request_ids and status.admitted_request_ids:
            del status.admitted_request_ids[:]
            self.llumlet.rpc_refused[("GetStatus", "request_ids_withheld")] += 1
        return status

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
    security = llumlet.security
    try:
        security.check_listener(config.llumlet_host, "--llumlet-host")
    except ConfigError as exc:  # inside vLLM the operator sets variables
        raise ConfigError(f"llumlet: {_env_names(str(exc))}") from None
    token, loopback = security.token.decode(), is_loopback(config.llumlet_host)
    trusted = loopback or security.mutual  # a client certificate authenticates the caller
    if not token and not trusted:
        log.warning(
            "llumlet gRPC on %s without a token or client certificates: Abort, Migrate and MigrateIn are "
            "refused and GetStatus carries no request ids until PILOTFISH_AUTH_TOKEN_FILE is set",
            config.llumlet_host,
        )
    interceptors = [_Guard(token, trusted, llumlet.rpc_refused)]
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=SHORT_CALL_WORKERS + config.max_migrations, thread_name_prefix="pilotfish-llumlet-grpc"
        ),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0)],
    )
    service = LlumletService(llumlet, redact_request_ids=not token and not trusted)
    llumlet_pb2_grpc.add_LlumletServicer_to_server(service, server)
    address = f"[{config.llumlet_host}]" if ":" in config.llumlet_host else config.llumlet_host
    try:
        port = security.add_port(server, f"{address}:{config.llumlet_port}")
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"llumlet: cannot bind gRPC to {config.llumlet_host}:{config.llumlet_port}")
    server.start()
    return server, port
