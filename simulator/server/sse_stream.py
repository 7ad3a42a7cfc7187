"""A streaming response's token sink: writes each SSE event to the socket from the step loop.

aiohttp's `StreamResponse.write` is a coroutine; awaiting it per token per stream would cost a
queue hop and a task switch each, which at 16 engines x 32 streams is most of a core. After
the handler has sent the headers, this sink frames events itself (HTTP/1.1 chunked when the
response is chunked) and hands them to the transport synchronously. The handler only awaits
`done` and then finishes the response through aiohttp as usual (`write_eof`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pilotfish.simulator.engine.base import TokenOutput
from pilotfish.simulator.server.protocol import SSE_DONE, ApiError, ResponseShape, sse
from pilotfish.simulator.tokens import WORDS, generated_word

_MARK = "@@pilotfish-text@@"  # JSON-encodes as itself
_WORD_BYTES = tuple(w.encode() for w in WORDS)  # generated_word(i) is WORDS[i % len(WORDS)]


class SseSink:
    def __init__(
        self,
        shape: ResponseShape,
        transport: asyncio.Transport,
        chunked: bool,
        *,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.shape = shape
        self.transport = transport
        self.chunked = chunked
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.completion_tokens = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # the bytes around the text of a mid-stream event, so a token is a format, not a JSON encode
        head, found, tail = sse(shape.chunk(_MARK, None)).partition(_MARK.encode())
        # a mid-stream token is then one %-format and one write: its frame is head + word + tail,
        # where a model name that escapes oddly, or continuous usage, makes every event encoded whole
        self._template = bool(found) and not continuous_usage
        self._head, self._tail = head, (tail + b"\r\n" if chunked else tail)
        self._frame = b"%x\r\n%b%b%b" if chunked else b"%b%b%b"
        self._frame_len = len(head) + len(tail)

    def send(self, out: TokenOutput) -> None:
        """The token sink (pass the bound method: CPython calls it faster than an instance's __call__)."""
        if self.done.done():
            return
        if self.transport.is_closing():
            self.done.set_exception(ConnectionResetError("client went away"))
            return
        if self._template and out.finish_reason is None and out.token_id is not None:
            self.completion_tokens += 1
            word = _WORD_BYTES[out.index % len(_WORD_BYTES)]
            if self.chunked:
                self.transport.write(self._frame % (self._frame_len + len(word), self._head, word, self._tail))
            else:
                self.transport.write(self._frame % (self._head, word, self._tail))
            return
        if out.error is not None:
            # as vLLM ends a stream that fails mid-way: an error event, then [DONE]
            self._write(sse(ApiError(500, out.error, "InternalServerError").body()) + SSE_DONE)
            self.done.set_result(None)
            return
        text = ""
        if out.token_id is not None:
            text = generated_word(out.index)
            self.completion_tokens += 1
        usage = self.shape.usage(self.completion_tokens) if self.include_usage and self.continuous_usage else None
        reason = out.finish_reason.value if out.finish_reason else None
        payload = sse(self.shape.chunk(text, reason, usage=usage))
        if out.finish_reason is not None:
            if self.include_usage:
                payload += sse(self.shape.usage_chunk(self.completion_tokens))
            payload += SSE_DONE
        self._write(payload)
        if out.finish_reason is not None:
            self.done.set_result(None)

    def _write(self, data: bytes) -> None:
        if self.chunked:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self.transport.write(data)


def flush_headers(response: Any) -> None:
    """Send the headers aiohttp holds back to coalesce with the first body write (aiohttp >= 3.11)."""
    writer = getattr(response, "_payload_writer", None)
    send = getattr(writer, "send_headers", None)
    if send is not None:
        send()


def is_chunked(response: Any) -> bool:
    writer = getattr(response, "_payload_writer", None)
    return bool(getattr(writer, "chunked", False))
