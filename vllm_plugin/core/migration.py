"""Live request migration, engine-agnostic: the llumlet's side of Migrate and MigrateIn.

    coordinator = MigrationCoordinator(llumlet, adapter)   # Llumlet(..., migration_adapter=adapter) does this
    coordinator.migrate(MigrateRequest)        # source, from a gRPC thread: answers once all are accepted or failed
    coordinator.migrate_in(MigrateInRequest, context)  # destination: the MigrateIn stream

Source, per chosen request: `adapter.detach` (the engine stops computing it; the client's stream
stays open here), then one pump thread opens MigrateIn on the destination's llumlet and waits
up to `migration_accept_timeout_ms` for `accepted`. After that it relays every chunk into the
client's stream (`adapter.relay`) until a finish reason. If the destination refuses, times out,
reports an error or its stream breaks before the finish, the request is `reattach`ed here with
every token the client has seen, and continues here; if even that fails, `adapter.fail` ends
the client's stream with an error. A request is never dropped without one of these.

Destination: MigrateIn admits the request through `adapter.admit` with a relay that feeds a
thread-safe queue; the handler streams from that queue. If the source goes away (the RPC ends
before the finish), `adapter.drop` frees what the request holds here.

Destinations (core/destinations.py): before anything is detached or sent, the destination must be
a registered, live llumlet of the same model in the CMS, at the address the Migrate names; the
registered address is the one dialled, so the request's tokens and the cluster's token never go to
an address the CMS does not vouch for. Refusals are counted in `refused` (by reason) and logged.

Bounds: at most `max_migrations` requests migrate out at once (each holds a pump thread until
it finishes, since its tokens pass through here), and at most as many migrate in (each holds a
gRPC server thread; the server's pool is sized from the same setting). LoadState counts
`num_migrating_out` from detach until the destination accepts (or the move fails), and
`num_migrating_in` from the MigrateIn call until the engine admitted the request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from pilotfish.cms.refusals import RefusalLog
from pilotfish.protos import llumlet_pb2, llumlet_pb2_grpc
from pilotfish.protos.migration_selection import order_name, rule_name
from pilotfish.vllm_plugin.core.destinations import CmsDestinations, DestinationCheck, DestinationRefused
from pilotfish.vllm_plugin.core.migration_api import MigratingRequest, MigrationAdapter
from pilotfish.vllm_plugin.core.selection import select_requests

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pilotfish.vllm_plugin.core.llumlet import Llumlet

log = logging.getLogger("pilotfish.llumlet.migration")

MAX_MIGRATE_IDS = 4096
MAX_ERROR_CHARS = 1000
METHODS = {
    llumlet_pb2.MIGRATION_METHOD_UNSPECIFIED: "recompute",
    llumlet_pb2.MIGRATION_METHOD_RECOMPUTE: "recompute",
    llumlet_pb2.MIGRATION_METHOD_KV_TRANSFER: "kv_transfer",
}
# the deprecated `num_requests` predates orders: shortest running first, as Llumnix defaulted
LEGACY_ORDER = "SR"
# how often a MigrateIn handler with no tokens to send checks that its caller is still there
_IDLE_CHECK_S = 1.0
# past the acceptance timeout, how long Migrate waits for a pump that has not reported
_ANSWER_GRACE_S = 5.0


class MigrationError(Exception):
    """A Migrate or MigrateIn call refused as a whole; the server answers with `code`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _RelayFailed(Exception):
    """The client's stream here could not take the tokens (the client left, or the engine is stuck)."""


@dataclass(eq=False)
class _Outgoing:
    request: MigratingRequest
    destination: str
    # None once the destination accepted; else why the move failed
    answer: concurrent.futures.Future[str | None] = field(default_factory=concurrent.futures.Future)
    call: Any = None  # the MigrateIn call, for cancellation at shutdown


_CLOSED = object()  # the MigrateIn RPC ended (its caller cancelled, or the server stopped it)
_STOPPING = object()  # this llumlet is stopping: tell the source, which continues the request


class MigrationCoordinator:
    def __init__(self, llumlet: Llumlet, adapter: MigrationAdapter) -> None:
        config = llumlet.config
        self.llumlet = llumlet
        self.adapter = adapter
        self.max_migrations = config.max_migrations
        self.accept_timeout_s = config.migration_accept_timeout_ms / 1000
        # every llumlet of a cluster shares the token, so the destination checks ours; the channel
        # dials TLS with this llumlet's certificate when it has one (pilotfish/security.py)
        self._security = llumlet.security
        self._call_metadata: tuple[tuple[str, str], ...] = llumlet.security.metadata or ()
        self._lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing | None] = {}  # None: slot reserved, detach under way
        self._incoming: dict[str, queue.SimpleQueue[Any]] = {}
        self._closed = False
        # counters, for tests and logs
        self.num_migrated_out = 0  # finished on a destination
        self.num_reattached = 0
        self.num_failed = 0
        self.num_migrated_in = 0  # admitted here
        # Migrates refused because of their destination, by reason (core/destinations.py)
        self.refused: Counter[str] = Counter()
        self._refusals = RefusalLog(log, what="refused Migrate to destination")
        self._cms_destinations: DestinationCheck | None = None

    def _destination(self, request: llumlet_pb2.MigrateRequest) -> str:
        """The address to dial, once the CMS vouches for the destination; raises MigrationError."""
        check = self.llumlet.destination_check
        if check is None:
            if self._cms_destinations is None:
                config = self.llumlet.config
                self._cms_destinations = CmsDestinations(
                    config.cms_url,
                    config.cluster,
                    lambda: self.llumlet.metadata.model,
                    config.ttl_ms,
                    redis_options=self._security.redis_options(config.cms_url),
                )
            check = self._cms_destinations
        try:
            return check(request.destination_instance_id, request.destination_llumlet_address.strip())
        except DestinationRefused as exc:
            self.refused[exc.reason] += 1
            self._refusals.note(request.destination_instance_id or "?", exc.reason, exc.message)
            raise MigrationError(exc.code, exc.message) from None

    # ---- source: Migrate ------------------------------------------------------------------------

    def migrate(self, request: llumlet_pb2.MigrateRequest) -> llumlet_pb2.MigrateResponse:
        """Move the chosen requests; returns once each is accepted by the destination or failed."""
        self._check(request)
        method = METHODS.get(request.method)
        if method is None:
            raise MigrationError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown migration method {request.method}")
        destination = self._destination(request)  # before anything is detached or sent
        chosen = self._choose(request)
        if not chosen:
            return llumlet_pb2.MigrateResponse(error="no request on this instance matches the selection")
        failed: dict[str, str] = {}
        moving: list[_Outgoing] = []
        for rid in chosen:
            why = self._reserve(rid)
            if why is None:
                out = self._start(rid, destination, method)
                if isinstance(out, str):
                    why = out
                else:
                    moving.append(out)
            if why is not None:
                failed[rid] = why
        if not moving and failed and all(w.startswith("busy") for w in failed.values()):
            raise MigrationError(grpc.StatusCode.RESOURCE_EXHAUSTED, next(iter(failed.values())))
        migrated: list[str] = []
        for out in moving:
            rid = out.request.request_id
            try:
                why = out.answer.result(timeout=self.accept_timeout_s + _ANSWER_GRACE_S)
            except concurrent.futures.TimeoutError:
                # the pump still owns the request and settles it (reattach) when its call ends
                why = "no answer from the destination in time"
            if why is None:
                migrated.append(rid)
            else:
                failed[rid] = why
        error = "; ".join(f"{rid}: {why}" for rid, why in failed.items())
        if len(error) > MAX_ERROR_CHARS:
            error = error[: MAX_ERROR_CHARS - 3] + "..."
        return llumlet_pb2.MigrateResponse(migrated_request_ids=migrated, failed_request_ids=list(failed), error=error)

    def _check(self, request: llumlet_pb2.MigrateRequest) -> None:
        def bad(message: str) -> MigrationError:
            return MigrationError(grpc.StatusCode.INVALID_ARGUMENT, message)

        if self._closed:
            raise MigrationError(grpc.StatusCode.UNAVAILABLE, "this llumlet is stopping")
        own = self.llumlet.instance_id
        if request.source_instance_id and request.source_instance_id != own:
            raise bad(f"source_instance_id {request.source_instance_id!r} is not this instance ({own!r})")
        address = request.destination_llumlet_address.strip()
        if not address:
            raise bad("destination_llumlet_address is required (ip:port of the destination's llumlet)")
        if request.destination_instance_id == own or address in self._own_addresses():
            raise bad("the destination is this instance")
        if len(request.request_ids) > MAX_MIGRATE_IDS:
            raise bad(f"{len(request.request_ids)} request ids (max {MAX_MIGRATE_IDS})")
        if request.request_ids:
            return  # explicit ids: the selection fields are ignored
        if request.select_rule == llumlet_pb2.SELECT_RULE_UNSPECIFIED:
            if request.num_requests == 0:
                raise bad("name request_ids, or a select_rule, select_order and select_value")
            return
        if rule_name(request.select_rule) is None:
            raise bad(f"unknown select_rule {request.select_rule}")
        if order_name(request.select_order) is None:
            raise bad(f"select_order is required with select_rule (got {request.select_order})")
        value = request.select_value
        if not math.isfinite(value) or value <= 0:
            raise bad(f"select_value must be a positive number, not {value}")
        if request.select_rule == llumlet_pb2.SELECT_RULE_RATIO and value > 1:
            raise bad(f"select_value is a fraction of the KV cache with RATIO: 0 < value <= 1, not {value}")

    def _own_addresses(self) -> set[str]:
        port = self.llumlet.metadata.llumlet_port
        if not port:
            return set()
        hosts = {self.llumlet.config.llumlet_host, self.llumlet.metadata.host}
        if self.llumlet.config.llumlet_host in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::"):
            hosts |= {"127.0.0.1", "localhost", "[::1]"}
        return {f"{h}:{port}" for h in hosts if h}

    def _choose(self, request: llumlet_pb2.MigrateRequest) -> list[str]:
        if request.request_ids:
            return list(dict.fromkeys(request.request_ids))  # each once, in the order given
        if request.select_rule == llumlet_pb2.SELECT_RULE_UNSPECIFIED:
            rule, order, value = "NUM_REQ", LEGACY_ORDER, float(request.num_requests)
        else:
            # both known: _check ran first
            rule, order = rule_name(request.select_rule) or "", order_name(request.select_order) or ""
            value = request.select_value
        with self.llumlet.lock:
            total_kv_tokens = self.llumlet.state.total_kv_tokens
        candidates = self._adapter_call("candidates", self.adapter.candidates)
        return select_requests(candidates, rule, order, value, total_kv_tokens)

    def _reserve(self, rid: str) -> str | None:
        with self._lock:
            if self._closed:
                return "this llumlet is stopping"
            if rid in self._outgoing:
                return "already migrating"
            if len(self._outgoing) >= self.max_migrations:
                return f"busy: {len(self._outgoing)} requests migrating out already (max_migrations)"
            self._outgoing[rid] = None
            return None

    def _start(self, rid: str, destination: str, method: str) -> _Outgoing | str:
        """Detach the request and start its pump; a string says why it did not move."""
        try:
            moving = self.adapter.detach(rid)
        except Exception as exc:
            log.warning("migration of %s: detach failed: %s", rid, exc)
            moving = None
        if moving is None:
            with self._lock:
                self._outgoing.pop(rid, None)
            return "not migratable here (unknown, finished or already moving)"
        moving.method = method
        out = _Outgoing(moving, destination)
        with self._lock:
            self._outgoing[rid] = out
        with self.llumlet.events() as s:
            s.migrating(out_delta=+1)
        threading.Thread(target=self._pump, args=(out,), name=f"pilotfish-migrate-{rid}", daemon=True).start()
        return out

    # ---- source: the pump ------------------------------------------------------------------------

    def _pump(self, out: _Outgoing) -> None:
        rid = out.request.request_id
        why: str | None
        try:
            why = self._stream(out)
        except _RelayFailed as exc:
            self._fail(rid, f"migration ended: the request's stream here failed: {exc}")
            why = ""
        except Exception as exc:  # a bug here must not lose the request: continue it here
            log.exception("migration of %s: unexpected error", rid)
            why = f"internal error: {exc}"
        try:
            if why:
                self._settle(out, why)
                self._reattach(out.request, why)
            elif why is None:
                self.num_migrated_out += 1
        finally:
            self._settle(out, why or "ended")
            with self._lock:
                self._outgoing.pop(rid, None)

    def _stream(self, out: _Outgoing) -> str | None:
        """Run the MigrateIn call to its end: None when the destination finished the request,
        else why it did not. Raises _RelayFailed when the client's stream here broke."""
        moving = out.request
        with self._security.channel(out.destination) as channel:
            call = llumlet_pb2_grpc.LlumletStub(channel).MigrateIn(
                _migrate_in_request(moving, self.llumlet.instance_id), metadata=self._call_metadata
            )
            with self._lock:
                out.call = call
                closed = self._closed
            if closed:
                call.cancel()
            timer = threading.Timer(self.accept_timeout_s, call.cancel)
            timer.daemon = True
            timer.start()
            accepted = False
            try:
                for chunk in call:
                    if not accepted:
                        timer.cancel()
                        if not chunk.accepted:
                            return f"refused by the destination: {chunk.error or 'no reason given'}"
                        accepted = True
                        self._settle(out, None)
                    if chunk.error:
                        return f"the destination could not continue: {chunk.error}"
                    if chunk.token_ids or chunk.finish_reason:
                        tokens = list(chunk.token_ids)
                        try:
                            self.adapter.relay(moving.request_id, tokens, chunk.finish_reason or None)
                        except Exception as exc:
                            call.cancel()  # the destination drops the request
                            raise _RelayFailed(str(exc) or type(exc).__name__) from exc
                        moving.output_token_ids.extend(tokens)
                        if chunk.finish_reason:
                            return None
            except grpc.RpcError as exc:
                if not accepted and exc.code() is grpc.StatusCode.CANCELLED and not self._closed:
                    return f"not accepted within {self.accept_timeout_s:g} s"
                return f"{'stream broke' if accepted else 'refused'}: {exc.code().name}: {exc.details()}"
            finally:
                timer.cancel()
            return "the destination's stream ended before the request finished"

    def _settle(self, out: _Outgoing, why: str | None) -> None:
        """The destination's answer is known (once): Migrate may reply, the request is no longer in transit."""
        with self._lock:
            if out.answer.done():
                return
            out.answer.set_result(why)
        with self.llumlet.events() as s:
            s.migrating(out_delta=-1)

    def _reattach(self, moving: MigratingRequest, why: str) -> None:
        rid = moving.request_id
        if len(moving.output_token_ids) >= moving.max_tokens:
            # every token arrived, only the finish was lost: end the stream here
            try:
                self.adapter.relay(rid, [], "length")
            except Exception as exc:
                self._fail(rid, f"migration failed ({why}); ending the request failed too: {exc}")
            return
        try:
            self.adapter.reattach(moving)
        except Exception as exc:
            self._fail(rid, f"migration failed ({why}) and the request cannot continue here: {exc}")
            return
        self.num_reattached += 1
        log.warning(
            "migration of %s failed (%s); it continues here after %d output tokens",
            rid,
            why,
            len(moving.output_token_ids),
        )

    def _fail(self, rid: str, error: str) -> None:
        self.num_failed += 1
        try:
            self.adapter.fail(rid, error)
        except Exception as exc:
            log.error("request %s lost: %s; ending its stream failed too: %s", rid, error, exc)
            return
        log.warning("request %s ended with an error: %s", rid, error)

    def _adapter_call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except TimeoutError:
            raise MigrationError(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer {what} in time") from None

    # ---- destination: MigrateIn ------------------------------------------------------------------

    def migrate_in(
        self, request: llumlet_pb2.MigrateInRequest, context: grpc.ServicerContext
    ) -> Iterator[llumlet_pb2.MigrateInChunk]:
        """Admit the request and stream its tokens back; drop it if the source goes away."""
        rid = request.request_id
        if not rid or not request.prompt_token_ids or request.max_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id, prompt_token_ids and max_tokens are required")
        method = METHODS.get(request.method)
        if method is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown migration method {request.method}")
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._lock:
            refusal = self._refusal(rid)
            if refusal is None:
                self._incoming[rid] = inbox
        if refusal is not None:
            context.abort(*refusal)
        admitted = finished = False
        refused = ""
        try:
            context.add_callback(lambda: inbox.put(_CLOSED))

            def relay(token_ids: list[int], finish_reason: str | None) -> None:
                inbox.put((list(token_ids), finish_reason))

            moving = MigratingRequest(
                request_id=rid,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                max_tokens=request.max_tokens,
                sampling_params_json=request.sampling_params_json or b"{}",
                arrival_time_ms=request.arrival_time_ms,
                method=method,  # type: ignore[arg-type]
            )
            with self.llumlet.events() as s:
                s.migrating(in_delta=+1)
            try:
                self.adapter.admit(moving, relay)
                admitted = True
            except Exception as exc:
                refused = str(exc) or type(exc).__name__
            finally:
                with self.llumlet.events() as s:
                    s.migrating(in_delta=-1)
            if not admitted:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot admit {rid}: {refused}")
            self.num_migrated_in += 1
            log.info(
                "migrated-in request %s admitted from %s with %d of %d tokens generated",
                rid, request.source_instance_id or "?", len(moving.output_token_ids), moving.max_tokens,
            )  # fmt: skip
            yield llumlet_pb2.MigrateInChunk(accepted=True)
            while True:
                try:
                    item = inbox.get(timeout=_IDLE_CHECK_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if item is _CLOSED:
                    return
                if item is _STOPPING:
                    yield llumlet_pb2.MigrateInChunk(error="the destination's llumlet is stopping")
                    return
                tokens, reason = item
                reason = _more_tokens(inbox, tokens, reason)
                # before the yield: the source may close the call as soon as it has the finish,
                # and grpc then closes this generator at the yield
                finished = bool(reason)
                yield llumlet_pb2.MigrateInChunk(token_ids=tokens, finish_reason=reason or "")
                if finished:
                    return
        finally:
            with self._lock:
                self._incoming.pop(rid, None)
            if admitted and not finished:
                try:
                    self.adapter.drop(rid)
                except Exception as exc:
                    log.warning("migrated-in request %s: drop after the source left failed: %s", rid, exc)

    def _refusal(self, rid: str) -> tuple[grpc.StatusCode, str] | None:
        if self._closed:
            return grpc.StatusCode.UNAVAILABLE, "this llumlet is stopping"
        if rid in self._incoming:
            return grpc.StatusCode.ALREADY_EXISTS, f"{rid} is already migrating in"
        if len(self._incoming) >= self.max_migrations:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(self._incoming)} requests migrating in (max_migrations)"
        return None

    # ---- lifecycle --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Refuse new migrations; requests relayed through here continue here, those relayed
        from here are handed back to their sources. Does not wait."""
        with self._lock:
            self._closed = True
            calls = [o.call for o in self._outgoing.values() if o is not None and o.call is not None]
            inboxes = list(self._incoming.values())
        for inbox in inboxes:
            inbox.put(_STOPPING)
        for call in calls:
            call.cancel()  # each pump reattaches its request

    def in_flight(self) -> tuple[int, int]:
        """(requests migrating out, requests migrating in), relaying included."""
        with self._lock:
            return len(self._outgoing), len(self._incoming)


def _migrate_in_request(moving: MigratingRequest, source_id: str) -> llumlet_pb2.MigrateInRequest:
    return llumlet_pb2.MigrateInRequest(
        request_id=moving.request_id,
        source_instance_id=source_id,
        prompt_token_ids=moving.prompt_token_ids,
        output_token_ids=moving.output_token_ids,
        max_tokens=moving.max_tokens,
        sampling_params_json=moving.sampling_params_json,
        method=(
            llumlet_pb2.MIGRATION_METHOD_KV_TRANSFER
            if moving.method == "kv_transfer"
            else llumlet_pb2.MIGRATION_METHOD_RECOMPUTE
        ),
        arrival_time_ms=moving.arrival_time_ms,
    )


def _more_tokens(inbox: queue.SimpleQueue[Any], tokens: list[int], reason: str | None) -> str | None:
    """Append the tokens already queued behind the first (one chunk, not one per token)."""
    while reason is None:
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            break
        if not isinstance(item, tuple):
            inbox.put(item)  # a sentinel: it ends the stream after this chunk
            break
        tokens.extend(item[0])
        reason = item[1]
    return reason
