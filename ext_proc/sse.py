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
    _fed: int = field(default=0, repr=False)  # bytes fed

    def feed(self, chunk: bytes) -> None:
        self._fed += len(chunk)
        data = self._tail + chunk
        # events end with a blank line; tolerate \r\n framing
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *complete, self._tail = data.split(b"\n\n")
        for event in complete:
            self.count_event(event)

    @property
    def complete_bytes(self) -> int:
        """Bytes fed that end an event: all of them but an event split across chunks."""
        return self._fed - len(self._tail)

    def finish(self) -> None:
        """The body ended: an unterminated last event still counts."""
        if self._tail.strip():
            self.count_event(self._tail)
        self._tail = b""

    def count_event(self, event: bytes) -> bool:
        """Count one event; True when it is a usage-only event (no choices)."""
        usage_only = False
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            self.events += 1
            usage_only = self._payload(payload) or usage_only
        return usage_only

    def _payload(self, payload: bytes) -> bool:
        try:
            obj = _decoder.decode(payload)
        except msgspec.DecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.tokens = usage["completion_tokens"]
            self.exact = True
            return not obj.get("choices")
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
                return False
        return False


@dataclass(slots=True)
class UsageStripper:
    """Counts like TokenCounter and removes the usage-only event from the bytes passed on.

    Used when the gateway added `stream_options.include_usage` for exact counts and the client
    did not ask for it: the client must see the stream it asked for. Complete events pass at
    once; an event split across chunks is held until its end arrives.
    """

    counter: TokenCounter = field(default_factory=TokenCounter)
    _tail: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._tail = data
            return b""
        complete, self._tail = data[: cut + 2], data[cut + 2 :]
        return self._filter(complete)

    def finish(self) -> bytes:
        rest, self._tail = self._tail, b""
        return self._filter(rest) if rest.strip() else rest

    def _filter(self, data: bytes) -> bytes:
        kept = []
        for event in data.split(b"\n\n"):
            if not event.strip():
                continue
            if not self.counter.count_event(event.replace(b"\r\n", b"\n")):
                kept.append(event + b"\n\n")
        return b"".join(kept)
