"""Server-sent events as they pass through the gateway: split across chunk boundaries, counted.

Envoy hands the response body over in arbitrary chunks; an event (`data: ...` lines ended by
a blank line) may straddle two of them, so the parser keeps the unfinished tail, up to
`MAX_EVENT_BYTES`: an engine's events are a few hundred bytes (a few KB with logprobs), and an
upstream that sends megabytes with no blank line must not grow the ext_proc's memory, nor cost it
a copy of everything held at every chunk. An event past the bound is not parsed: it counts as one
event with a token when its end comes, and the stripper passes its bytes on as they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

_decoder = msgspec.json.Decoder()

MAX_EVENT_BYTES = 1 << 20


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
    oversized: int = 0  # events past MAX_EVENT_BYTES, counted unparsed
    _tail: bytes = field(default=b"", repr=False)
    _fed: int = field(default=0, repr=False)  # bytes fed
    _open: int = field(default=0, repr=False)  # bytes of an event past the bound, let go (0: none under way)

    def feed(self, chunk: bytes) -> None:
        self._fed += len(chunk)
        data = self._tail + chunk
        # events end with a blank line; tolerate \r\n framing
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *complete, tail = data.split(b"\n\n")
        if complete and self._open:
            self._open = 0
            self.count_oversized()
            complete = complete[1:]  # (the rest of that event)
        for event in complete:
            self.count_event(event)
        if len(tail) > MAX_EVENT_BYTES:
            # held no longer: its last byte stays, as it may begin the blank line that ends it
            self._open += len(tail) - 1
            tail = tail[-1:]
        self._tail = tail

    @property
    def complete_bytes(self) -> int:
        """Bytes fed that end an event: all of them but an event split across chunks."""
        return self._fed - len(self._tail) - self._open

    def count_oversized(self) -> None:
        """An event past MAX_EVENT_BYTES ended: one event, and a token unless the usage gave the count."""
        self.oversized += 1
        self.events += 1
        if not self.exact:
            self.tokens += 1

    def finish(self) -> None:
        """The body ended: an unterminated last event still counts."""
        if self._open:
            self._open = 0
            self.count_oversized()
        elif self._tail.strip():
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
    _open: bool = field(default=False, repr=False)  # an event past MAX_EVENT_BYTES under way: passed on as it comes

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk
        head = b""
        if self._open:
            end = data.find(b"\n\n")
            if end < 0:  # still under way: all but its last byte on (it may begin the blank line)
                self._tail = data[-1:]
                return data[:-1]
            self._open = False
            self.counter.count_oversized()
            head, data = data[: end + 2], data[end + 2 :]
        cut = data.rfind(b"\n\n")
        complete, tail = (data[: cut + 2], data[cut + 2 :]) if cut >= 0 else (b"", data)
        out = head + self._filter(complete)
        if len(tail) > MAX_EVENT_BYTES:
            self._open = True
            out += tail[:-1]
            tail = tail[-1:]
        self._tail = tail
        return out

    def finish(self) -> bytes:
        rest, self._tail = self._tail, b""
        if self._open:
            self._open = False
            self.counter.count_oversized()
            return rest
        return self._filter(rest) if rest.strip() else rest

    def _filter(self, data: bytes) -> bytes:
        kept = []
        for event in data.split(b"\n\n"):
            if not event.strip():
                continue
            if not self.counter.count_event(event.replace(b"\r\n", b"\n")):
                kept.append(event + b"\n\n")
        return b"".join(kept)
