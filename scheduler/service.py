"""The scheduler's gRPC service: translates protos, calls the core, maps errors to status codes.

`SchedulerServer` owns the grpc.aio server (Scheduler + standard health service), the
Prometheus endpoint, the periodic expiry of the local account, the engines' health probes
(--health-probes, scheduler/health.py) and, in full mode, the CMS reader that feeds the core's
view from Redis, all on one event loop.
`run_forever` is what `pilotfish scheduler` runs: uvloop, signals, one line when listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pilotfish.discovery.follow import discovery_configured, follow
from pilotfish.discovery.static import Instance
from pilotfish.grpc_malformed import MalformedRequests
from pilotfish.metrics_http import serve_metrics
from pilotfish.procs import StartError
from pilotfish.protos import scheduler_pb2, scheduler_pb2_grpc
from pilotfish.protos.session_frames import ANSWERED_KEY
from pilotfish.scheduler.config import SchedulerConfig, probes_enabled, validate_service
from pilotfish.scheduler.core import Decision, SchedulerCore
from pilotfish.scheduler.errors import SchedulerError
from pilotfish.scheduler.flow import FlowGate
from pilotfish.scheduler.flow import wire as flow_wire
from pilotfish.scheduler.health import HealthProber
from pilotfish.scheduler.idle_rekey import rekey_when_idle
from pilotfish.scheduler.limits import (
    ListenerStats,
    OutOfBounds,
    PeerBuckets,
    PeerRates,
    RateLimited,
    ReportGuard,
    RequestBounds,
    grpc_server_options,
    peer_host,
)
from pilotfish.scheduler.rescheduler.service import colocated_loop
from pilotfish.scheduler.session_server import Answer, SessionSocketServer, SocketLimits
from pilotfish.scheduler.telemetry import register_listener_stats
from pilotfish.scheduler.tracing import schedule_traced
from pilotfish.scheduler.ui import serve_ui
from pilotfish.scheduler.view.kv_events import KvEventSubscriber
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView, RequestInfo
from pilotfish.security import Security, register_auth_stats

if TYPE_CHECKING:
    from aiohttp import web

    from pilotfish.cms.reader import CmsReader

log = logging.getLogger(__name__)

SERVICE_NAME = "pilotfish.v1.Scheduler"
ANSWERED_TRAILER = ((ANSWERED_KEY, "1"),)


def _endpoint(ep: Endpoint) -> scheduler_pb2.Endpoint:
    return scheduler_pb2.Endpoint(instance_id=ep.instance_id, address=ep.address, infer_type=int(ep.infer_type))


def decision_to_proto(decision: Decision) -> scheduler_pb2.ScheduleResponse:
    response = scheduler_pb2.ScheduleResponse(
        target=_endpoint(decision.target), fallbacks=[_endpoint(e) for e in decision.fallbacks]
    )
    if decision.decode_target is not None:
        response.decode_target.CopyFrom(_endpoint(decision.decode_target))
    return response


_BOUNDS = RequestBounds()


def request_from_proto(request: scheduler_pb2.ScheduleRequest, bounds: RequestBounds = _BOUNDS) -> RequestInfo:
    """Raises OutOfBounds (INVALID_ARGUMENT) for a request outside `bounds` (scheduler/limits.py)."""
    bounds.check(request)
    try:
        hint = InferType(request.infer_type_hint)
    except ValueError:  # a newer gateway's enum value: treat as no hint
        hint = InferType.UNSPECIFIED
    return RequestInfo(
        request_id=request.request_id,
        model=request.model,
        prompt_tokens=request.prompt_tokens,
        prefix_block_hashes=tuple(request.prefix_block_hashes),
        prefix_block_size=request.prefix_block_size,
        infer_type_hint=hint,
        max_tokens=request.max_tokens,
        stream=request.stream,
        candidate_addresses=_subset(request.candidate_addresses),
    )


MAX_SUBSET = 4096  # a subset hint names at most this many engines


def _subset(addresses: Sequence[str]) -> frozenset[str]:
    if len(addresses) > MAX_SUBSET:
        raise OutOfBounds(
            f"candidate_addresses names {len(addresses)} engines; at most {MAX_SUBSET}", "candidate_addresses"
        )
    return frozenset(addresses)


def _probe_port(host: str, port: int, flag: str) -> None:
    """Fail with one line if `port` is taken; grpc would log its own multi-line error first."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                # other failures (an address family the host lacks) are grpc's to judge
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise _bind_error(host, port, flag, exc) from None


def _bind_error(host: str, port: int, flag: str, exc: OSError) -> StartError:
    reason = "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return StartError(f"cannot listen on {host}:{port} ({flag}): {reason}")


def malformed_call(method: str) -> str:
    """The `call` label of a malformed request to `method`: a Scheduler method's name (schedule, report,
    release, session), else its service's (health)."""
    service, _, name = method.rpartition("/")
    return name.lower() if service == f"/{SERVICE_NAME}" else service.rpartition(".")[2].lower()


def _peer_of(context: grpc.aio.ServicerContext) -> str:
    peer = getattr(context, "peer", None)
    return peer_host(peer()) if peer is not None else ""


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore, config: SchedulerConfig | None = None) -> None:
        self.core = core
        self._sessions: set[grpc.aio.ServicerContext] = set()  # open Session streams
        config = config if config is not None else SchedulerConfig()
        # input bounds, the report guard and per-peer rates (scheduler/limits.py); refusals counted here
        self._bounds = RequestBounds.from_config(config)
        self._guard = ReportGuard(config.max_model_len, config.request_local_account_staleness_seconds)
        self._rates = PeerRates.from_config(config)
        self.stats = ListenerStats()
        # flow control (scheduler/flow): None when off; releases, reports and statuses drain its queue
        self.flow = FlowGate.from_config(core, config)
        if self.flow is not None:
            core.on_view_change = self.flow.poke

    def _buckets(self, context: grpc.aio.ServicerContext) -> PeerBuckets | None:
        peer = _peer_of(context)
        return self._rates.peer(peer) if peer else None

    def _schedule(
        self, request: scheduler_pb2.ScheduleRequest, buckets: PeerBuckets | None, reply: flow_wire.Reply | None = None
    ) -> Decision | None:
        """Rate, bounds, then the core; raises SchedulerError (RateLimited, OutOfBounds, the core's).
        With flow control, a request its gateway can hold (queue_timeout_ms) and a `reply` may wait:
        None, and `reply` gets the Decision or the SchedulerError later."""
        if buckets is not None and buckets.schedule is not None and not buckets.schedule.take(1, self._rates.clock()):
            self.stats.refuse("schedule", "rate_limited")
            raise RateLimited("over this gateway's Schedule rate (--peer-schedule-rate); retry")
        try:
            req = request_from_proto(request, self._bounds)
        except OutOfBounds as exc:
            self.stats.refuse("schedule", exc.reason)
            raise
        if self.flow is not None and reply is not None and request.queue_timeout_ms:
            return self._submit(request, req, reply)
        decision = schedule_traced(self.core.schedule, req, request.traceparent)  # a span when tracing
        self._guard.scheduled(req.request_id, req.prompt_tokens, req.max_tokens)
        return decision

    def _submit(
        self, request: scheduler_pb2.ScheduleRequest, req: RequestInfo, reply: flow_wire.Reply
    ) -> Decision | None:
        """Through flow control's queue (scheduler/flow); the guard learns of a dispatch when it happens."""
        assert self.flow is not None
        if len(request.flow) > flow_wire.MAX_FLOW_LENGTH:
            self.stats.refuse("schedule", "flow")
            raise OutOfBounds(f"flow is longer than {flow_wire.MAX_FLOW_LENGTH} characters", "flow")
        guard = self._guard

        def answered(outcome: object) -> None:
            if isinstance(outcome, Decision):
                guard.scheduled(req.request_id, req.prompt_tokens, req.max_tokens)
            reply(outcome)

        hold_s = min(request.queue_timeout_ms, flow_wire.MAX_HOLD_MS) / 1000
        decision = self.flow.submit(req, request.priority, request.flow, hold_s, answered)
        if decision is not None:
            guard.scheduled(req.request_id, req.prompt_tokens, req.max_tokens)
        return decision  # type: ignore[return-value]

    def _release(self, request_id: str, reason: int, answer_tokens: int = 0) -> bool:
        """A waiting request leaves the queue (never dispatched); a held one is released."""
        flow = self.flow
        if flow is not None and flow.cancel(request_id):
            return True
        found = self.core.release(request_id, reason, answer_tokens)
        if flow is not None:
            flow.poke()
        return found

    def _admit(self, call: str, n: int, buckets: PeerBuckets | None) -> bool:
        """Whether `n` reports, or a release, fit the peer's rate; counted when not."""
        if buckets is None:
            return True
        bucket = buckets.report if call == "report" else buckets.release
        if bucket is None or bucket.take(n, self._rates.clock()):
            return True
        self.stats.refuse(call, "rate_limited", n)
        return False

    def _release_ok(self, release: scheduler_pb2.ReleaseRequest) -> int | None:
        """A release the guard may forget: the answer tokens it may count (clamped as a report's); None
        for an id no Schedule could have held."""
        if self._bounds.check_id(release.request_id):
            self.stats.refuse("release", "request_id_length")
            return None
        return self._guard.released(release.request_id, release.generated_tokens)

    async def end_sessions(self) -> None:
        """End every open Session with UNAVAILABLE; its gateway falls back, or opens a new one. A
        Session has no end of its own, so a graceful stop would otherwise wait out its whole grace."""
        for context in list(self._sessions):
            with contextlib.suppress(Exception):  # abort raises in its caller, here, once it has sent
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        waiter: asyncio.Future[object] | None = None
        if self.flow is not None and request.queue_timeout_ms:
            waiter = asyncio.get_running_loop().create_future()
        try:
            decision = self._schedule(request, self._buckets(context), flow_wire.resolve(waiter))
            if decision is None:  # waits in flow control's queue: say how long, then answer
                decision = await self._queued(request.request_id, waiter, context)  # type: ignore[arg-type]
        except SchedulerError as exc:
            # the trailer tells the gateway this is the scheduler's answer, not a transport failure
            trailer = () if isinstance(exc, flow_wire.Stopping) else ANSWERED_TRAILER  # stopping: fall back
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc), trailer)
        return decision_to_proto(decision)

    async def _queued(
        self, request_id: str, waiter: asyncio.Future[object], context: grpc.aio.ServicerContext
    ) -> Decision:
        assert self.flow is not None
        await context.send_initial_metadata(((flow_wire.QUEUED_KEY, str(int(self.flow.wait_s(request_id) * 1000))),))
        try:
            outcome = await waiter
        except asyncio.CancelledError:  # the gateway gave up or went away: never dispatched
            self.flow.cancel(request_id)
            raise
        if isinstance(outcome, SchedulerError):
            raise outcome
        return outcome  # type: ignore[return-value]

    async def Report(
        self, request: scheduler_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportResponse:
        if not self._admit("report", len(request.reports), self._buckets(context)):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over this gateway's report rate; retry")
        return scheduler_pb2.ReportResponse(unknown_requests=self._report(request.reports))

    def _report(self, reports: Sequence[scheduler_pb2.TokenReport]) -> int:
        """Apply a batch of reports (a served_address moves the request first); returns how many
        named a request the scheduler does not hold. A count beyond what the request's stream can
        generate is clamped, and one that brings no progress is dropped: it must not renew the
        held request (ReportGuard)."""
        core, guard, stats = self.core, self._guard, self.stats
        max_id = self._bounds.max_request_id_length
        applied: list[tuple[str, int, bool]] = []
        for r in reports:
            if len(r.request_id) > max_id:
                stats.refuse("report", "request_id_length")
                continue
            generated, why = guard.admit(r)
            if why:
                stats.refuse("report", why)
                if why == "no_progress":
                    continue
            if r.served_address:
                core.reroute(r.request_id, r.served_address)
            applied.append((r.request_id, generated, r.prefill_done))
        unknown = core.report_many(applied)
        if self.flow is not None:
            self.flow.poke()  # a request served elsewhere may leave its engine room
        return unknown

    async def Release(
        self, request: scheduler_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReleaseResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if not self._admit("release", 1, self._buckets(context)):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over this gateway's release rate; retry")
        answer_tokens = self._release_ok(request)
        if answer_tokens is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is longer than any held")
        found = self._release(request.request_id, request.reason, answer_tokens or 0)
        return scheduler_pb2.ReleaseResponse(found=found)

    async def Session(
        self, request_iterator: AsyncIterator[scheduler_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SessionResponse]:
        """Schedule, Report and Release as messages; a schedule's error is a reply, not the stream's end."""
        await context.send_initial_metadata(())  # the gateway writes nothing before this: the stream is up
        self._sessions.add(context)
        outbox: asyncio.Queue[object] = asyncio.Queue()  # flow control's late answers
        answer = self.answerer(_peer_of(context), outbox.put_nowait)
        try:
            if isinstance(answer.answer, flow_wire.SessionAnswer):
                async for response in flow_wire.merged(request_iterator, answer, outbox):
                    yield response
            else:
                async for response in self._session(request_iterator, answer):
                    yield response
        finally:
            self._sessions.discard(context)
            answer.close()  # waiting requests leave the queue; held ones become orphans

    async def _session(
        self, request_iterator: AsyncIterator[scheduler_pb2.SessionRequest], answer: Answer
    ) -> AsyncIterator[scheduler_pb2.SessionResponse]:
        async for message in request_iterator:
            reply = answer(message)
            if reply is not None:
                yield reply

    def answerer(
        self, peer: str, deliver: Callable[[scheduler_pb2.SessionResponse], None] | None = None
    ) -> SessionRequests:
        """`answer` for the messages of one peer's Session (its IP): they count against its rates.
        With flow control and `deliver`, a schedule may wait: `deliver` then gets its late answer.
        `close()` when the Session ends."""
        buckets = self._rates.peer(peer) if peer else None
        answer: Answer
        if self.flow is not None and deliver is not None:
            answer = flow_wire.SessionAnswer(
                lambda message, reply: self._answer(message, buckets, reply), self.flow, deliver, decision_to_proto
            )
        else:

            def answer(message: scheduler_pb2.SessionRequest) -> scheduler_pb2.SessionResponse | None:
                return self._answer(message, buckets)

        return SessionRequests(answer, self.core)

    def answer(self, message: scheduler_pb2.SessionRequest) -> scheduler_pb2.SessionResponse | None:
        """One Session message, no peer's rate applied: a schedule's reply, or None for the rest."""
        return self._answer(message, None)

    def _answer(
        self, message: scheduler_pb2.SessionRequest, buckets: PeerBuckets | None, reply: flow_wire.Reply | None = None
    ) -> scheduler_pb2.SessionResponse | None:
        """One Session message (gRPC stream or framed socket): a schedule's reply, or None for the
        rest; a report or release over the peer's rate is dropped and counted."""
        kind = message.WhichOneof("kind")
        if kind == "schedule":
            try:
                decision = self._schedule(message.schedule, buckets, reply)
                if decision is None:  # waits in flow control's queue: its answer comes later
                    assert self.flow is not None
                    return flow_wire.notice(message.seq, self.flow.wait_s(message.schedule.request_id))
            except SchedulerError as exc:
                return _session_error(message.seq, getattr(grpc.StatusCode, exc.code), str(exc))
            except Exception:  # a bug answers this request, as a unary call would; the stream goes on
                log.exception("Schedule %s failed", message.schedule.request_id)
                return _session_error(message.seq, grpc.StatusCode.INTERNAL, "internal scheduler error")
            return scheduler_pb2.SessionResponse(seq=message.seq, schedule=decision_to_proto(decision))
        if kind in ("report", "release"):
            release = message.release
            answer_tokens: int | None = 0
            if kind == "report":
                if not self._admit("report", len(message.report.reports), buckets):
                    return None
            elif not release.request_id or not self._admit("release", 1, buckets):
                return None  # an empty id is dropped
            elif (answer_tokens := self._release_ok(release)) is None:
                return None
            try:
                if kind == "report":
                    self._report(message.report.reports)
                else:
                    self._release(release.request_id, release.reason, answer_tokens or 0)
            except Exception:  # a bug loses this message only; the gateway's schedules go on
                log.exception("Session: a %s failed", kind)
        else:  # a newer gateway's message kind: skipped, the stream goes on
            log.debug("Session: skipped a message of unknown kind")
        return None


class SessionRequests:
    """One gateway Session's answer, and the requests it placed and has not released. When the
    Session ends with some still held, its gateway is gone (nobody will release them): the core
    drops each after --orphan-grace-seconds unless a report or a release reaches it first."""

    MAX_TRACKED = 65536  # a Session holds at most this many ids; the oldest are forgotten first

    __slots__ = ("_core", "answer", "held")

    def __init__(self, answer: Answer, core: SchedulerCore) -> None:
        self.answer = answer
        self._core = core
        self.held: dict[str, None] = {}  # insertion-ordered set

    def __call__(self, message: scheduler_pb2.SessionRequest) -> scheduler_pb2.SessionResponse | None:
        reply = self.answer(message)
        kind = message.WhichOneof("kind")
        if kind == "schedule":
            held = self.held
            held[message.schedule.request_id] = None
            if len(held) > self.MAX_TRACKED:
                del held[next(iter(held))]
        elif kind == "release":
            self.held.pop(message.release.request_id, None)
        return reply

    def close(self) -> None:
        close = getattr(self.answer, "close", None)
        if close is not None:
            close()
        held, self.held = self.held, {}
        if held:
            self._core.orphan(held)


def _session_error(seq: int, code: grpc.StatusCode, message: str) -> scheduler_pb2.SessionResponse:
    error = scheduler_pb2.SessionError(code=code.value[0], message=message)
    return scheduler_pb2.SessionResponse(seq=seq, error=error)


class SchedulerServer:
    """One core behind gRPC (and /metrics when configured); start() binds, stop() drains."""

    def __init__(self, config: SchedulerConfig, core: SchedulerCore | None = None) -> None:
        validate_service(config)
        self.config = config
        # TLS, the token and the refusal beyond loopback without either (pilotfish/security.py)
        self.security = security = Security.from_config(config)
        security.check_listener(config.host, "--host")
        self.core = core if core is not None else SchedulerCore(config)
        self.port = 0
        self.metrics_port = 0
        self.session_port = 0
        self._session_socket: SessionSocketServer | None = None
        self._server: grpc.aio.Server | None = None
        self._servicer = SchedulerServicer(self.core, config)
        register_listener_stats(self.core.registry, self._servicer.stats)
        register_auth_stats(self.core.registry, security.stats)
        self._health = health_aio.HealthServicer()
        self._metrics_runner: web.AppRunner | None = None
        self._ui_runner: web.AppRunner | None = None  # the live page (scheduler/ui), --ui-port
        self._expiry: asyncio.Task[None] | None = None
        self.reader: CmsReader | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self.prober: HealthProber | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.kv_events: KvEventSubscriber | None = None
        # colocated rescheduling: None unless enabled (bad rescheduling flags fail here, before binding)
        self._rescheduler = colocated_loop(config, self.core, security)

    async def start(self) -> None:
        """Bind and serve; raises StartError naming the address when a port cannot be bound."""
        host, port, metrics_port = self.config.host, self.config.port, self.config.metrics_port
        _probe_port(host, port, "--port")
        if metrics_port:
            _probe_port(host, metrics_port, "--metrics-port")
        if self.config.session_port:
            _probe_port(host, self.config.session_port, "--session-port")
        rekey_when_idle(self.core, asyncio.get_running_loop())
        # grpc's default SO_REUSEPORT would let a second scheduler silently share a busy port
        # and the listener limits: message size, streams, connections, idle, keepalive (scheduler/limits.py).
        # Last, the guard that answers a request message that does not decode (pilotfish/grpc_malformed.py)
        malformed = MalformedRequests(self._refuse_malformed, "scheduler")
        server = self._server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *grpc_server_options(self.config)],
            interceptors=[self.security.aio_interceptor("scheduler_grpc"), malformed],
        )
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            self.port = self.security.add_port(server, f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if not self.port:  # lost a race with another process after the probe
            raise StartError(f"cannot listen on {host}:{port} (--port): address in use")
        await server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if metrics_port:
            try:
                await self._start_metrics()
            except StartError:
                await self.stop(0)
                raise
        if self.config.ui_port:
            try:
                self._ui_runner = await serve_ui(self.core, self.config.ui_host, self.config.ui_port, self.security)
            except Exception:  # a busy port, or beyond loopback without TLS or a token
                await self.stop(0)
                raise
        if self.config.session_port:
            self._session_socket = SessionSocketServer(
                self._servicer.answerer, SocketLimits.from_config(self.config), self._servicer.stats, self.security
            )
            try:
                self.session_port = await self._session_socket.start(host, self.config.session_port)
            except OSError as exc:
                await self.stop(0)
                raise _bind_error(host, self.config.session_port, "--session-port", exc) from None
        self._expiry = asyncio.create_task(self._expire_periodically(), name="scheduler-expiry")
        if probes_enabled(self.config):
            self.prober = HealthProber(self.core, self.config)
            self._probe_task = asyncio.create_task(self.prober.run(), name="scheduler-health-probes")
        if self.core.cms is not None:
            from pilotfish.cms.reader import CmsReader

            self.reader = CmsReader(
                self.config.redis_url,
                self.config.cms_cluster,
                self.core.cms,
                self.config.cms_poll_interval_seconds,
                redis_options=self.security.redis_options(self.config.redis_url),
                notice_records=self.config.cms_notice_records,
            )
            self._reader_task = asyncio.create_task(self.reader.run(), name="scheduler-cms-reader")
            if self.core.cms.follows_discovery:  # CMS metadata admits only engines discovery lists
                self._discovery_task = asyncio.create_task(
                    self.core.cms.follow_discovery(self.config), name="scheduler-discovery"
                )
            self.kv_events = KvEventSubscriber.start_for(self.core, self.config)
            if self._rescheduler is not None:
                self._rescheduler.start(self.reader.wait_first_poll)
        elif discovery_configured(self.config):
            self._discovery_task = asyncio.create_task(
                follow(self.config, self._instance_added, self.core.remove_instance), name="scheduler-discovery"
            )

    def _refuse_malformed(self, method: str) -> None:
        self._servicer.stats.refuse(malformed_call(method), "malformed")

    def _instance_added(self, instance: Instance) -> None:
        """Lite mode: a discovered engine serves the configured models (any, when none is given)."""
        endpoint = Endpoint(instance.instance_id, instance.address)
        self.core.add_instance(InstanceView(endpoint, models=frozenset(self.config.model)))

    async def _start_metrics(self) -> None:
        # served on the loop that owns the core, so a scrape sees consistent counts
        self._metrics_runner = await serve_metrics(
            self.core.registry, self.config.host, self.config.metrics_port, security=self.security
        )
        self.metrics_port = self.config.metrics_port

    async def _expire_periodically(self) -> None:
        # Schedule expires lazily too; this keeps the account honest when no requests arrive, and
        # lets back engines whose ejection ran out (so /metrics says so within a second)
        period = min(self.config.request_local_account_staleness_seconds / 2, 1.0)
        while True:
            await asyncio.sleep(period)
            self.core.expire()

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for up to `grace` seconds, then close."""
        await self._health.enter_graceful_shutdown()
        expiry, server, runner = self._expiry, self._server, self._metrics_runner
        reader, self._reader_task = self._reader_task, None
        discovery, self._discovery_task = self._discovery_task, None
        probes, self._probe_task = self._probe_task, None
        self._expiry = self._server = self._metrics_runner = None  # a second stop() is a no-op
        self.core.on_rekey_due = None  # the loop may close after this: later changes wait for a Schedule
        if self._rescheduler is not None:
            await self._rescheduler.stop()  # before the reader: no cycle plans over a view being torn down
        for task in (expiry, reader, discovery, probes):
            if task is not None:
                task.cancel()
                # bounded: the CMS reader may be mid-reconnect to a Redis that is gone
                await asyncio.wait([task], timeout=5.0)
        kv_events, self.kv_events = self.kv_events, None
        if kv_events is not None:
            await kv_events.close()
        session_socket, self._session_socket = self._session_socket, None
        if session_socket is not None:
            await session_socket.close()  # its gateways fall back at once, as on the gRPC Session
        if self._servicer.flow is not None:
            self._servicer.flow.close()  # what waits is answered "stopping": its gateway falls back
        if server is not None:
            await self._servicer.end_sessions()
            await server.stop(grace)
        if runner is not None:
            await runner.cleanup()
        ui, self._ui_runner = self._ui_runner, None
        if ui is not None:
            await ui.cleanup()


async def serve(config: SchedulerConfig, core: SchedulerCore | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # handlers first: a supervisor may send SIGTERM the moment the port answers
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = SchedulerServer(config, core)
    try:
        await server.start()
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
        session = f", Session socket on :{server.session_port}" if server.session_port else ""
        print(f"scheduler listening on {config.host}:{server.port}{metrics}{session}", flush=True)
        if config.ui_port:
            print(f"scheduler live page on http://{config.ui_host}:{config.ui_port}/", flush=True)
        await stop.wait()
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_forever(config: SchedulerConfig) -> int:
    """Build the core (config errors surface here), then serve on uvloop; 0 after a clean stop."""
    validate_service(config)
    core = SchedulerCore(config)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config, core))
    sys.stdout.flush()
    return 0
