"""Run the ext_proc gRPC server (its own loop's, or grpc.aio's) on uvloop until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pilotfish.config import ConfigError
from pilotfish.discovery.follow import discovery_configured, follow
from pilotfish.discovery.static import parse_instances
from pilotfish.ext_proc.access_log import AccessLogReleaser
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.ext_proc.flow import FlowHeaders
from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import CircuitBreaker, Router, SchedulerBackend
from pilotfish.ext_proc.scheduler_client import GrpcScheduler
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.ext_proc.tokens import tokenizer
from pilotfish.grpc_loop import HealthService, Kind, LoopGrpcServer
from pilotfish.grpc_malformed import MalformedRequests
from pilotfish.metrics_http import register_counts, serve_metrics
from pilotfish.procs import StartError
from pilotfish.security import Security, register_auth_stats

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Health names the Gateway API Inference Extension's endpoint pickers answer to: liveness as soon as
# the server runs; readiness (and the overall and ext_proc names) once the engines are known.
LIVE_SERVICES = ("liveness",)
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
HEALTH_SERVICES = LIVE_SERVICES + READY_SERVICES
LISTENER = "ext_proc_grpc"  # its refusals' label in pilotfish_auth_refused_total


class ExtProcServer:
    """The servicer, its router and the gRPC server, started and stopped together."""

    def __init__(self, config: ExtProcConfig) -> None:
        self.config = config
        # TLS and the token on its own listener (Envoy's link) and to the scheduler (pilotfish/security.py)
        self.security = security = Security.from_config(config)
        security.check_listener(config.host, "--host")
        if config.response_bodies == "first-token" and config.grpc_server == "grpcio":
            # each such stream ends with Envoy's reset after the ext_proc's OK, and grpc.aio never frees
            # the native op array a reset cuts (~120-150 bytes a request)
            raise ConfigError("--response-bodies first-token needs --grpc-server loop: grpc.aio's server leaks "
                              "native memory on every stream Envoy resets; use --response-bodies count with grpcio")
        try:
            instances = parse_instances(config.instances)
        except ValueError as exc:
            raise StartError(f"--instances: {exc}") from None
        self.metrics = ExtProcMetrics()
        register_auth_stats(self.metrics.registry, security.stats)
        self.router = Router(
            _scheduler_backend(config, self.metrics, security),
            instances,
            breaker=CircuitBreaker(config.breaker_failures, config.breaker_open_seconds),
        )
        self.servicer = ExtProcServicer(
            self.router,
            tokenizer(config.tokenizer_path, config.tokenizer_name),
            frozenset(config.model),
            config.max_body_bytes,
            self.metrics,
            exact_usage=config.exact_usage,
            prefix_block_size=config.prefix_block_size,
            destination_fallbacks=config.destination_fallbacks,
            response_bodies=config.response_bodies,
            flow_headers=FlowHeaders(
                config.priority_header.lower(),
                config.flow_header.lower(),
                config.schedule_queue_timeout_ms,
                config.client_priority_max,
                config.flow_groups,
            ),
            unscheduled_paths=config.unscheduled_paths,
        )
        self.router.on_breaker_change = lambda is_open: self.metrics.breaker_open.set(1 if is_open else 0)
        # Envoy's access log: the end of each request as Envoy saw it (access_log.py)
        self.access_log = AccessLogReleaser(self.servicer.release_from_access_log)
        self.grpc_refusals: collections.Counter[str] = collections.Counter()  # grpc.aio's server: by reason
        self.server: grpc.aio.Server | LoopGrpcServer
        self.health: health.aio.HealthServicer | HealthService
        if config.grpc_server == "loop":
            self.server = self._loop_server()
        else:
            self.server = self._grpcio_server()
        self.port = 0
        self.ready = False  # readiness: the first discovery sync is done (at once without discovery)
        self._ready_task: asyncio.Task[None] | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._discovery_task: asyncio.Task[None] | None = None

    @property
    def _max_message_bytes(self) -> int:
        # a request body arrives whole in one message (buffered body modes), with room for its headers
        return max(4 << 20, self.config.max_body_bytes + (64 << 10))

    def _grpcio_server(self) -> grpc.aio.Server:
        # last, the guard that answers a request message that does not decode (pilotfish/grpc_malformed.py)
        malformed = MalformedRequests(self._refuse_malformed, "ext_proc")
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self._max_message_bytes)],
            interceptors=[self.security.aio_interceptor(LISTENER), malformed],
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        register_counts(
            self.metrics.registry,
            "pilotfish_ext_proc_grpc_refused",
            "Calls the ext_proc's gRPC server refused, by reason: malformed (a request message that is not a "
            "protobuf); grpc core's own refusals are not counted.",
            ["reason"],
            lambda: {(reason,): n for reason, n in self.grpc_refusals.items()},
        )
        return server

    def _refuse_malformed(self, method: str) -> None:
        self.grpc_refusals["malformed"] += 1

    def _loop_server(self) -> LoopGrpcServer:
        security = self.security
        server = LoopGrpcServer(
            max_message_bytes=self._max_message_bytes,
            authorize=security.call_authorized,
            on_unauthenticated=lambda peer, method: security.refused_call(LISTENER, peer, method),
        )
        server.add_method(f"/{EXT_PROC_SERVICE}/Process", ep.ProcessingRequest, Kind.BIDI, self.servicer.Process)
        server.add_method(
            "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
            als_pb2.StreamAccessLogsMessage,
            Kind.CLIENT_STREAM,
            self.access_log.StreamAccessLogs,
        )
        self.health = HealthService()
        self.health.add_to(server)
        register_counts(
            self.metrics.registry,
            "pilotfish_ext_proc_grpc_refused",
            "Connections, streams and calls the ext_proc's gRPC server refused, by reason (an HTTP/2 error "
            "code's name, or message_too_large, compressed_message, malformed, unknown_method, not_grpc, "
            "unauthenticated).",
            ["reason"],
            lambda: {(reason,): n for reason, n in server.refusals.items()},
        )
        return server

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if isinstance(self.server, LoopGrpcServer):
            try:
                ssl_context = self.security.server_ssl_context(alpn=("h2",))
                self.port = await self.server.start(self.config.host, self.config.port, ssl_context)
            except OSError:
                self.port = 0
        else:
            try:
                self.port = self.security.add_port(self.server, address)
            except RuntimeError:
                self.port = 0
        if not self.port:
            raise StartError(f"cannot listen on {address}: port in use or address unavailable")
        if self.config.metrics_port:
            registry, host = self.metrics.registry, self.config.host
            self._metrics_runner = await serve_metrics(registry, host, self.config.metrics_port, security=self.security)
        if not isinstance(self.server, LoopGrpcServer):
            await self.server.start()
        for name in HEALTH_SERVICES:
            serving = name in LIVE_SERVICES
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING if serving else NOT_SERVING)
        if discovery_configured(self.config):
            # ready only once discovery has been read: before, every request would get a 503
            self._discovery_task = asyncio.get_running_loop().create_task(
                follow(self.config, self.router.instance_added, self.router.instance_removed, self._mark_ready)
            )
        else:
            self._mark_ready()
        return self.port

    def _mark_ready(self) -> None:
        self.ready = True
        self._ready_task = asyncio.get_running_loop().create_task(self._serve_ready())

    async def _serve_ready(self) -> None:
        for name in READY_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 2.0) -> None:
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery_task
        await self.router.close()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()


def _scheduler_backend(
    config: ExtProcConfig, metrics: ExtProcMetrics, security: Security | None = None
) -> SchedulerBackend | None:
    if config.colocated_scheduling:
        from pilotfish.config import load_yaml_mapping, struct_from_mapping
        from pilotfish.ext_proc.colocated import LocalScheduler
        from pilotfish.scheduler.config import SchedulerConfig
        from pilotfish.scheduler.core import SchedulerCore

        values = load_yaml_mapping(config.scheduler_config) if config.scheduler_config else {}
        values.setdefault("instances", config.instances)
        values.setdefault("model", config.model)
        # the core's pilotfish_scheduler_* series join the gateway's own on its /metrics
        core = SchedulerCore(struct_from_mapping(SchedulerConfig, values), registry=metrics.registry)
        return LocalScheduler(core, frozenset(config.model))
    if config.scheduler_address:
        session_address = config.scheduler_session_address
        host, colon, port = session_address.rpartition(":")
        if session_address and not (colon and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--scheduler-session-address: {session_address!r} is not host:port")
        return GrpcScheduler(
            config.scheduler_address,
            config.schedule_timeout_ms / 1000,
            config.report_interval_ms / 1000,
            session=config.scheduler_session,
            session_address=session_address,
            security=security,
        )
    return None


async def serve(config: ExtProcConfig) -> None:
    server = ExtProcServer(config)
    port = await server.start()
    print(f"ext_proc listening on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
