"""An answer's length from its size, for `--response-bodies first-token`.

That mode reads a stream only up to its first token and leaves the rest to Envoy, whose access log
gives the whole body's size once the request is over. vLLM streams one SSE event per token, and
every event of a stream carries the same envelope (id, created, model, choice index), so the bytes
per event read up to the first token divide the rest of the body into events. The estimate is off
by the variation in token text (a few bytes against an envelope of well over a hundred) and by the
events that carry no token (the finish and usage events): a few percent, where the scheduler uses
the answers' lengths as a mean over many of them.
"""

from __future__ import annotations

from collections import OrderedDict

# the stream's last event, which the first chunks cannot have shown
_DONE_BYTES = len(b"data: [DONE]\n\n")


class AnswerSizes:
    """What was read of each stream up to its first token, by request id, until its release.

    Bounded: the oldest is forgotten past `capacity` (a request whose access-log entry never came;
    its release then counts no answer length, as a lost Release would).
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._read: OrderedDict[str, tuple[int, int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._read)

    def read(self, request_id: str, complete_bytes: int, events: int, tokens: int) -> None:
        """The stream's first `complete_bytes` held `events` data events and `tokens` generated tokens."""
        self._read[request_id] = (complete_bytes, events, tokens)
        if len(self._read) > self.capacity:
            self._read.popitem(last=False)

    def estimate(self, request_id: str, body_bytes: int) -> int:
        """The answer's tokens, given the whole body's size (forgets the request); 0 if nothing was read."""
        read = self._read.pop(request_id, None)
        if read is None:
            return 0
        complete_bytes, events, tokens = read
        rest = body_bytes - complete_bytes - _DONE_BYTES
        if events <= 0 or complete_bytes <= 0 or rest <= 0:
            return tokens
        return tokens + round(rest * events / complete_bytes)
