"""LRS: the requests this scheduler dispatched and has not seen released, and their load.

Every change is incremental: dispatch adds one request and its prompt tokens to the target's
`LrsLoad`, a report adds the generated-token delta, release or expiry subtracts exactly what
the entry added. So the per-instance counts are always the sum over held entries, never
negative, and zero once everything is released.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pilotfish.scheduler.view.types import InstanceView, LrsLoad

# answers a learned mean answer length weighs, per instance and fleet-wide: past it the counts are cut to
# half with their ratio kept, so an answer's weight halves with every half window of answers after it. A
# lifetime mean let one bad sample (a forged status: +1 answer of 2^62 tokens) set an engine's figure for
# good (audit F7); a window of a thousand answers is a lifetime for a benchmark cell (1024 requests) and
# follows a shift of a real engine's answers within a few thousand
ANSWER_WINDOW = 1024
FLEET_ANSWER_WINDOW = 4 * ANSWER_WINDOW


@dataclass(slots=True, eq=False)
class RequestEntry:
    request_id: str
    model: str
    instance_id: str
    load: LrsLoad  # the target's counters, shared with its InstanceView
    prompt_tokens: int
    last_touch: float
    generated_tokens: int = 0
    decoding: bool = False
    # what Schedule answered, returned again when the gateway retries the same request id
    decision: object = None
    dispatched_at: float = 0.0
    # the TTFT the profile predicted on its instance at dispatch, ms (lite mode; 0: none, or it moved since)
    predicted_ttft_ms: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class LocalRealtimeState:
    """Held requests by id, ordered by last activity so expiry pops from the front in O(1).

    An entry is touched by its dispatch, its reports and duplicate Schedules; one untouched for
    `staleness_seconds` is dropped with its load, so a lost Release can never leak load. Not
    thread-safe: one owner (the service's event loop, or the gateway's when colocated).
    """

    def __init__(
        self,
        staleness_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
        count_releases: bool = True,
        on_first_token: Callable[[RequestEntry, float], None] | None = None,
    ) -> None:
        """`count_releases` False (full mode): a release's generated tokens are not the answer's (the
        gateway did not count them), so answers are counted from the engines' records (`answered`).
        `on_first_token(entry, now)`: told each request whose prefill is reported done, once."""
        self.staleness_seconds = staleness_seconds
        self._clock = clock
        # told the instance id whenever its counts change, so load-ordered indexes re-key it
        self._on_change = on_change or (lambda instance_id: None)
        self._on_first_token = on_first_token
        self._entries: OrderedDict[str, RequestEntry] = OrderedDict()
        self.num_expired = 0  # monotonic; exported as pilotfish_scheduler_expired_total
        # the fleet's released requests and their generated tokens, and its mean at a power of two
        # (LrsLoad.fleet_output_level), given to the cold instances: dispatched to, nothing released there yet
        self._count_releases = count_releases
        self._released = 0
        self._released_tokens = 0
        self._fleet_level = -1
        self._cold: dict[str, LrsLoad] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[RequestEntry]:
        return iter(self._entries.values())

    def get(self, request_id: str) -> RequestEntry | None:
        return self._entries.get(request_id)

    def touch(self, entry: RequestEntry) -> None:
        entry.last_touch = self._clock()
        self._entries.move_to_end(entry.request_id)

    def dispatch(
        self, request_id: str, model: str, inst: InstanceView, prompt_tokens: int, decision: object = None
    ) -> RequestEntry:
        """Hold a new request on `inst` and raise its load at once (dispatch is a load change)."""
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} is already held")
        load = inst.lrs
        now = self._clock()
        entry = RequestEntry(
            request_id=request_id,
            model=model,
            instance_id=inst.instance_id,
            load=load,
            prompt_tokens=prompt_tokens,
            last_touch=now,
            decision=decision,
            dispatched_at=now,
        )
        self._entries[request_id] = entry
        if load.num_released == 0:
            self._cold[inst.instance_id] = load
            load.fleet_output_level = self._fleet_level
        load.num_requests += 1
        load.num_tokens += prompt_tokens
        load.prefill_tokens += prompt_tokens
        load.num_dispatched += 1
        self._on_change(entry.instance_id)
        return entry

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool = False) -> bool:
        """Apply a cumulative token count; False if the request is not held.

        Reports may repeat or arrive out of order, so a count lower than the one held is ignored
        (the entry still counts as alive).
        """
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        changed = False
        if generated_tokens > entry.generated_tokens:
            entry.load.num_tokens += generated_tokens - entry.generated_tokens
            entry.generated_tokens = generated_tokens
            changed = True
        # a generated token proves the prefill is done even if the flag was batched away
        if not entry.decoding and (prefill_done or entry.generated_tokens > 0):
            entry.decoding = True
            entry.load.num_decode_requests += 1
            entry.load.prefill_tokens -= entry.prompt_tokens
            changed = True
            if self._on_first_token is not None:
                self._on_first_token(entry, self._clock())
        if changed:
            self._on_change(entry.instance_id)
        self.touch(entry)
        return True

    def move(self, request_id: str, inst: InstanceView) -> bool:
        """The request is served on `inst` after all (a gateway retry elsewhere): its load moves
        there with it, counts unchanged. False if it is not held."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        if entry.instance_id == inst.instance_id:
            return True
        self._unload(entry)
        entry.instance_id, entry.load = inst.instance_id, inst.lrs
        entry.predicted_ttft_ms = 0.0  # predicted for the engine it left
        load = inst.lrs
        load.num_requests += 1
        load.num_tokens += entry.tokens
        if entry.decoding:
            load.num_decode_requests += 1
        else:
            load.prefill_tokens += entry.prompt_tokens
        self._on_change(inst.instance_id)
        self.touch(entry)
        return True

    def release(self, request_id: str, answer_tokens: int = 0) -> bool:
        """Drop the request and its load at once; False if it was not held (idempotent). `answer_tokens`: the
        answer's length where the gateway learned it only at the end (reports stopped at the first token)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        if self._count_releases:
            # counted before the unload, whose change notice re-keys the instance with them
            answered = entry.generated_tokens if entry.generated_tokens >= answer_tokens else answer_tokens
            self._count_answers(entry.load, entry.instance_id, 1, answered)
        self._unload(entry)
        return True

    def answered(self, inst: InstanceView, requests: int, tokens: int) -> None:
        """Full mode: `requests` left `inst`'s engine with `tokens` of output in all, as its status records
        count them (a full-mode gateway does not see response bodies): counted as releases are in lite mode."""
        if requests <= 0 or tokens < 0:
            return
        self._count_answers(inst.lrs, inst.instance_id, requests, tokens)
        self._on_change(inst.instance_id)

    def _count_answers(self, load: LrsLoad, instance_id: str, requests: int, tokens: int) -> None:
        """The instance's answers and the fleet's, whose mean at a power of two every cold instance is told when
        it moves (and its change noticed): a few times a run, not per answer."""
        released, released_tokens = load.num_released + requests, load.released_generated_tokens + tokens
        if released > ANSWER_WINDOW:
            released, released_tokens = _halved(released, released_tokens, ANSWER_WINDOW)
        load.num_released, load.released_generated_tokens = released, released_tokens
        self._cold.pop(instance_id, None)
        self._released += requests
        self._released_tokens += tokens
        if self._released > FLEET_ANSWER_WINDOW:
            self._released, self._released_tokens = _halved(self._released, self._released_tokens, FLEET_ANSWER_WINDOW)
        mean = self._released_tokens // self._released
        level = 1 << (mean.bit_length() - 1) if mean > 0 else 0
        if level == self._fleet_level:
            return
        self._fleet_level = level
        for cold_id, cold in self._cold.items():
            cold.fleet_output_level = level
            self._on_change(cold_id)

    def drop_instance(self, instance_id: str) -> int:
        """Forget every request held on an instance that left the cluster; returns how many."""
        self._cold.pop(instance_id, None)
        gone = [e for e in self._entries.values() if e.instance_id == instance_id]
        for entry in gone:
            del self._entries[entry.request_id]
            self._unload(entry)
        return len(gone)

    def expire(self) -> int:
        """Drop entries untouched for `staleness_seconds`; returns how many."""
        deadline = self._clock() - self.staleness_seconds
        dropped = 0
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.last_touch > deadline:
                break
            self._entries.popitem(last=False)
            self._unload(entry)
            dropped += 1
        self.num_expired += dropped
        return dropped

    def _unload(self, entry: RequestEntry) -> None:
        load = entry.load
        load.num_requests -= 1
        load.num_tokens -= entry.tokens
        if entry.decoding:
            load.num_decode_requests -= 1
        else:
            load.prefill_tokens -= entry.prompt_tokens
        self._on_change(entry.instance_id)


def _halved(count: int, tokens: int, window: int) -> tuple[int, int]:
    """`count` answers of `tokens` in all, past `window`, as half a window of answers at the same mean (rounded
    down): the older answers weigh less from here on, and one record's count, however large, weighs at most
    the window."""
    kept = window // 2
    return kept, tokens * kept // count
