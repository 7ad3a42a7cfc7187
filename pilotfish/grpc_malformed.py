"""Request messages that are not protobufs, on a grpc.aio server: INVALID_ARGUMENT, counted, logged rarely.

grpc.aio decodes each request message with the stubs' `FromString` before the servicer runs; a
DecodeError there is answered UNKNOWN and logged as an ERROR traceback, once per call, ahead of
every per-peer limit, so any peer could flood the log. `MalformedRequests` is a server interceptor
that wraps each method's handler, once per method: its deserializer is a try around `FromString`
(nothing copied), and its behaviour answers INVALID_ARGUMENT, reports the refusal to
`refused(method)` (the server's metrics) and logs a WARNING at most once a minute, DEBUG otherwise.

A unary request that fails to decode arrives as `MALFORMED` and is refused before the servicer
runs. A streamed one raises `MalformedMessage` from the servicer's read; it leaves the servicer
(whose `finally` runs) and is refused around it.

Put it last among a server's interceptors: one before it (the token check, pilotfish/security.py)
then turns away its calls first, whatever they carry, on a copy of the guarded handler. Only async
behaviours are guarded (every servicer here is one); a sync one is served as grpc serves it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

NOTE_INTERVAL_S = 60.0  # a refusal's WARNING at most this often; the rest at DEBUG

Refuse = Callable[[grpc.aio.ServicerContext], Awaitable[NoReturn]]


class _Malformed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED: Any = _Malformed()  # what a unary request message that is not a protobuf decodes to


class MalformedMessage(Exception):
    """Raised from a stream's read: the request message is not a protobuf."""


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Refuses request messages that do not decode; `listener` names the server in the log line."""

    def __init__(
        self, refused: Callable[[str], None], listener: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._refused = refused
        self._listener = listener
        self._clock = clock
        self._last_note = -math.inf
        # method -> (the handler found, its guarded copy); only methods that have a handler
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method  # type: ignore[attr-defined]
        kept = self._guarded.get(method)
        if kept is None or kept[0] is not handler:
            kept = self._guarded[method] = (handler, self._guard(method, handler))
        return kept[1]

    def _guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        decode = handler.request_deserializer
        if decode is None:  # raw bytes: nothing to decode
            return handler
        owner = getattr(decode, "__self__", None)  # the message class of a stub's `FromString`
        what = owner.DESCRIPTOR.full_name if hasattr(owner, "DESCRIPTOR") else "request message"

        async def refuse(context: grpc.aio.ServicerContext) -> NoReturn:
            self._refused(method)
            self._note(method, what, context.peer())
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message is not a valid {what}")
            raise AssertionError("abort returned")  # pragma: no cover - abort always raises

        streaming = handler.request_streaming
        kind, make = _KINDS[streaming, handler.response_streaming]
        behaviour = _guarded(getattr(handler, kind), refuse)
        if behaviour is None:
            return handler
        decoded = _raising(decode) if streaming else lenient(decode)
        return make(behaviour, request_deserializer=decoded, response_serializer=handler.response_serializer)

    def _note(self, method: str, what: str, peer: str) -> None:
        """A refusal's log line: a flood of bad messages must not flood the log."""
        now = self._clock()
        line = "%s: a request to %s from %s is not a valid %s; answered INVALID_ARGUMENT"
        if now - self._last_note >= NOTE_INTERVAL_S:
            self._last_note = now
            log.warning(line + " (further such this minute at DEBUG; counted in the metrics)",
                        self._listener, method, peer, what)  # fmt: skip
        else:
            log.debug(line, self._listener, method, peer, what)


# (request streaming, response streaming) -> the handler's behaviour attribute, and what builds such a handler
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def lenient(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`decode`, giving MALFORMED for bytes that are not its message (a unary request: sync servers use it too)."""

    def decoded_or_malformed(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError:
            return MALFORMED

    return decoded_or_malformed


def _raising(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decoded(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError:
            raise MalformedMessage from None

    return decoded


def _guarded(behaviour: Callable[..., Any] | None, refuse: Refuse) -> Callable[..., Any] | None:
    """`behaviour` refusing a MALFORMED request, or a MalformedMessage read from its stream; None for
    a sync one. Of the same kind (async generator or coroutine): grpc serves each its own way."""
    if inspect.isasyncgenfunction(behaviour):

        async def replies(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if request is MALFORMED:
                await refuse(context)
            try:
                # closed with this one: a cancelled call's servicer runs its `finally` at once
                async with contextlib.aclosing(behaviour(request, context)) as inner:  # type: ignore[misc]
                    async for reply in inner:
                        yield reply
            except MalformedMessage:
                await refuse(context)

        return replies
    if inspect.iscoroutinefunction(behaviour):

        async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is MALFORMED:
                await refuse(context)
            try:
                return await behaviour(request, context)  # type: ignore[misc]
            except MalformedMessage:
                await refuse(context)

        return answer
    return None
