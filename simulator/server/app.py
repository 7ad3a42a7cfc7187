"""One simulated engine's aiohttp application: routes, headers and the request lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.server.driver import EngineDriver
from pilotfish.simulator.server.latency import LatencyHistograms
from pilotfish.simulator.server.metrics import render_metrics
from pilotfish.simulator.server.protocol import (
    ApiError,
    ResponseShape,
    context_length_error,
    decode_body,
    models_response,
    parse_request,
    sse,
)
from pilotfish.simulator.server.sse_stream import SseSink, flush_headers, is_chunked
from pilotfish.simulator.tokens import Tokenizer, generated_word
from pilotfish.tracing import server_span

log = logging.getLogger(__name__)

ENGINE_HEADER = "x-pilotfish-engine"
REQUEST_ID_HEADER = "x-request-id"
# llm-d's prefill/decode convention: the gateway routes to the decode engine and names its prefill
# engine here; the decode side has that engine prefill (max_tokens 1), then decodes on the KV it got.
PREFILLER_HEADER = "x-prefiller-host-port"
PREFILLED_BY_HEADER = "x-pilotfish-prefilled-by"  # on the response: the prefill engine that served it
MAX_BODY_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFILLED_BY_KEY = web.RequestKey("prefilled_by", str)


def _json(body: Any, status: int = 200) -> web.Response:
    # compact, like vLLM's FastAPI responses, and faster than json.dumps
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class EngineApp:
    def __init__(
        self,
        engine_id: str,
        serve: ServeConfig,
        engine: EngineConfig,
        driver: EngineDriver,
        tokenizer: Tokenizer,
        prefill_peers: set[str] | None = None,
        fault: str = "",
    ) -> None:
        self.engine_id = engine_id
        self.fault = fault  # --answer-faults: how every completion fails fast ("": it does not)
        # the engines this one may ask to prefill for it ("host:port"): never an address a request names
        # beyond them, so the header cannot send the engine anywhere else
        self.prefill_peers = prefill_peers if prefill_peers is not None else set()
        self._client: Any = None  # aiohttp.ClientSession, opened on the first remote prefill
        self.serve = serve
        self.engine = engine
        self.driver = driver
        self.tokenizer = tokenizer
        # internal ids stay unique even when clients reuse an x-request-id
        self._seq = itertools.count()
        self.latency = LatencyHistograms()
        driver.core.add_observer(self.latency)

    def build(self) -> web.Application:
        # long-context prompts exceed aiohttp's 1 MiB default body limit; vLLM takes them
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(self._tag_response)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_cleanup.append(self._close_client)
        return app

    async def _close_client(self, app: web.Application) -> None:
        if self._client is not None:
            await self._client.close()

    async def _remote_prefill(self, http: web.Request, data: dict[str, Any], prefiller: str, prompt_len: int) -> None:
        """Have `prefiller` compute the prompt (one output token, as llm-d's sidecar asks), then wait
        out the KV transfer; the request then decodes here on the transferred KV."""
        import aiohttp

        if prefiller not in self.prefill_peers:
            raise ApiError(400, f"prefill engine {prefiller!r} is not a peer of this engine", "BadRequestError")
        if self._client is None:
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        body = {**data, "max_tokens": 1, "stream": False}
        body.pop("max_completion_tokens", None)
        body.pop("stream_options", None)
        # the same id, so the prefill engine's llumlet confirms the request the scheduler accounted there
        request_id = http.headers.get(REQUEST_ID_HEADER)
        headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
        try:
            async with self._client.post(f"http://{prefiller}{http.path}", json=body, headers=headers) as reply:
                await reply.read()
                status = reply.status
        except aiohttp.ClientError as exc:
            raise ApiError(502, f"prefill engine {prefiller} failed: {exc}", "BadGatewayError") from None
        if status != 200:
            raise ApiError(502, f"prefill engine {prefiller} answered {status}", "BadGatewayError")
        await asyncio.sleep(self.engine.kv_transfer_seconds(prompt_len))

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENGINE_HEADER] = self.engine_id
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id:
            response.headers[REQUEST_ID_HEADER] = request_id
        prefilled_by = request.get(PREFILLED_BY_KEY)
        if prefilled_by:
            response.headers[PREFILLED_BY_HEADER] = prefilled_by

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _json(exc.body(), status=exc.status)
        except web.HTTPException:
            raise
        except (RequestPayloadError, HttpProcessingError) as exc:  # a body it cannot read (not the gzip it declares)
            error = ApiError(400, f"unreadable request body: {exc}", "BadRequestError")
            return _json(error.body(), status=error.status)
        except Exception:
            log.exception("engine %s: unexpected error on %s", self.engine_id, request.path)
            error = ApiError(500, "internal error in the engine simulator", "InternalServerError")
            return _json(error.body(), status=500)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return _json(models_response(self.serve.model, self.engine.max_model_len))

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.driver.core.stats(), self.serve.model, self.engine, self.latency)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        with self._span(request):
            return await self._generate(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self._span(request):
            return await self._generate(request, chat=True)

    async def _fail_fast(self, http: web.Request) -> web.StreamResponse:
        """--answer-faults: a broken engine behind a live server, failing each completion at once while its
        /health answers (the black hole a gateway must not mistake for an idle, healthy engine), or taking it
        and never passing it on (a hung server loop in front of an idle engine)."""
        if self.fault == "hang":
            await asyncio.Event().wait()  # until the client goes (aiohttp cancels the handler then)
        if self.fault == "refuse":
            raise ApiError(429, "the engine is overloaded", "TooManyRequestsError")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        if self.fault == "cut":
            await response.write(b'data: {"choices": [{"index": 0, "text": " cut", "finish_reason": null}]}\n\n')
        await response.write_eof()
        return response

    def _span(self, request: web.Request) -> contextlib.AbstractContextManager[Any]:
        """The engine's span of a request, continuing the gateway's `traceparent` (pilotfish/tracing.py)."""
        h = request.headers
        attributes = {"pilotfish.engine": self.engine_id, "pilotfish.request_id": h.get(REQUEST_ID_HEADER, "")}
        traceparent, tracestate = h.get("traceparent", ""), h.get("tracestate", "")
        return server_span("pilotfish.simulator", "pilotfish.engine.generate", traceparent, tracestate, **attributes)

    async def _generate(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        data = decode_body(await http.read())
        if self.fault:
            return await self._fail_fast(http)
        parsed = parse_request(data, chat=chat, served_model=self.serve.model, tokenizer=self.tokenizer)
        prompt_len = len(parsed.prompt_token_ids)
        limit = self.engine.max_model_len
        stop_after: int | None = None
        if parsed.max_tokens is None:
            if prompt_len >= limit:
                raise context_length_error(limit, prompt_len, None)
            max_tokens = limit - prompt_len
            # a real model ends with EOS at some point; the simulated one after a fixed length
            stop_after = None if parsed.ignore_eos else self.serve.default_output_tokens
        else:
            max_tokens = parsed.max_tokens
            if prompt_len + max_tokens > limit:
                raise context_length_error(limit, prompt_len, max_tokens)

        prefiller = http.headers.get(PREFILLER_HEADER)
        if prefiller:
            await self._remote_prefill(http, data, prefiller, prompt_len)
            http[PREFILLED_BY_KEY] = prefiller
        base_id = http.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        internal_id = f"{base_id}#{next(self._seq)}"
        sim_request = SimRequest(internal_id, parsed.prompt_token_ids, max_tokens, stop_after, time.monotonic())
        if prefiller:  # the prompt's KV came from the prefill engine: like a prefix-cache hit
            sim_request.num_external_computed_tokens = prompt_len
        shape = ResponseShape(base_id, parsed.model, chat, prompt_len)
        finished = False
        response: web.StreamResponse | None = None
        try:
            if parsed.stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(http)
                if chat:  # vLLM opens a chat stream with the assistant role before any token
                    await response.write(sse(shape.chunk(None, None, role=True)))
                flush_headers(response)
                transport = http.transport
                if transport is None:
                    raise ConnectionResetError("client went away")
                sink = SseSink(
                    shape,
                    transport,
                    is_chunked(response),
                    include_usage=parsed.include_usage,
                    continuous_usage=parsed.continuous_usage_stats,
                )
                self.driver.submit(sim_request, sink.send)
                await sink.done
                finished = True
                await response.write_eof()
                return response

            queue = self.driver.submit(sim_request)
            words: list[str] = []
            while True:
                out = await queue.get()
                if out.error is not None:
                    finished = True
                    raise ApiError(500, out.error, "InternalServerError")
                if out.token_id is not None:
                    words.append(generated_word(out.index))
                if out.finish_reason is not None:
                    finished = True
                    body = shape.full("".join(words), out.finish_reason.value, len(words))
                    return _json(body)
        except ConnectionError:
            # the client went away mid-stream; the finally clause frees its slot
            return response if response is not None else web.Response(status=499)
        finally:
            if not finished:
                self.driver.abort(internal_id)
