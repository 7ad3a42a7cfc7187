"""Server-sent events as they pass through the gateway: split across chunk boundaries, counted.

Envoy hands the response body over in arbitrary chunks; an event (`data: ...` lines ended by
a blank line) may straddle two of them, so the parser keeps the unfinished tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

_decoder = msgspec.json.Decoder()


@dataclass(slots=True)
class TokenCounter:
    """Generated tokens seen in a stream of OpenAI SSE events.

    Each event with generated text counts one token (vLLM streams one token per event unless
    told otherwise); a `usage` object, when the engine sends one, replaces the estimate with
    the engine's exact count.
    """

    tokens: int = 0
    exact: bool = False
    done: bool = False
    events: int = 0
    _tail: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        # events end with a blank line; tolerate \r\n framing
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *complete, self._tail = data.split(b"\n\n")
        for event in complete:
            self._event(event)

    def finish(self) -> None:
        """The body ended: an unterminated last event still counts."""
        if self._tail.strip():
            self._event(self._tail)
        self._tail = b""

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            self.events += 1
            self._payload(payload)

    def _payload(self, payload: bytes) -> None:
        try:
            obj = _decoder.decode(payload)
        except msgspec.DecodeError:
            return
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.tokens = usage["completion_tokens"]
            self.exact = True
            return
        if self.exact:
            return
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if delta is None:
                text = choice.get("text")
            else:
                text = delta.get("content") if isinstance(delta, dict) else None
            if text:
                self.tokens += 1
                return
