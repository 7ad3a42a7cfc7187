"""The waiting requests of one model: strict priority between bands, round robin between flows.

Each band keeps a FIFO per flow and a turn list of the flows that have requests waiting; `pop`
takes the head of the next flow in turn from the highest band that holds any, so within a band
every flow with requests waiting gets one dispatch per round, however many it queued (a flood
waits behind its own requests, not in front of others'). A cancelled request is marked and
skipped when it reaches a head or tail; counts are kept exact at once, so memory is bounded by
what waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pilotfish.scheduler.flow.bands import BANDS, Band
from pilotfish.scheduler.view.types import RequestInfo


@dataclass(slots=True, eq=False)
class Waiting:
    """One queued request and whom to tell its outcome."""

    req: RequestInfo
    band: Band
    flow: str
    enqueued: float
    deadline: float
    # told the outcome once: a Decision, or the SchedulerError it was refused with
    reply: Callable[[object], None] | None = None
    done: bool = False
    outcome: object = None

    @property
    def tokens(self) -> int:
        """Its work: prompt + max tokens (what fair shares are counted in)."""
        return self.req.prompt_tokens + max(self.req.max_tokens, 0)


@dataclass(slots=True, eq=False)
class _Band:
    flows: dict[str, deque[Waiting]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # live requests per flow
    turn: deque[str] = field(default_factory=deque)  # flows with requests waiting, in round-robin order
    in_turn: set[str] = field(default_factory=set)
    live: int = 0


class FlowQueue:
    def __init__(self) -> None:
        self._bands = {band: _Band() for band in BANDS}
        self.live = 0
        self.flow_tokens: dict[str, int] = {}  # prompt + max tokens waiting per flow, all bands

    def __len__(self) -> int:
        return self.live

    def count(self, band: Band) -> int:
        return self._bands[band].live

    def flow_counts(self, band: Band) -> dict[str, int]:
        return dict(self._bands[band].counts)

    def push(self, w: Waiting) -> None:
        b = self._bands[w.band]
        q = b.flows.get(w.flow)
        if q is None:
            q = b.flows[w.flow] = deque()
            if w.flow not in b.in_turn:  # a flow emptied by cancels may still hold its turn
                b.in_turn.add(w.flow)
                b.turn.append(w.flow)
        q.append(w)
        if w.tokens:
            self.flow_tokens[w.flow] = self.flow_tokens.get(w.flow, 0) + w.tokens
        b.counts[w.flow] = b.counts.get(w.flow, 0) + 1
        b.live += 1
        self.live += 1

    def pop(self, eligible: Callable[[str, Band], bool] | None = None) -> Waiting | None:
        """The next request to dispatch: highest band first, flows of a band in turn. With
        `eligible(flow, band)`, a flow it refuses keeps its place in the turn and the next one is tried;
        bands stay strict (nothing of a lower band passes a band with requests waiting)."""
        for band in BANDS:
            b = self._bands[band]
            if not b.live:
                continue
            for flow in list(b.turn):
                if flow not in b.flows:
                    continue  # emptied by cancels: its stale turn is dropped below
                if eligible is not None and not eligible(flow, band):
                    continue
                b.turn.remove(flow)
                b.in_turn.discard(flow)
                q = b.flows[flow]
                while q and q[0].done:
                    q.popleft()
                w = q.popleft()
                self._took(b, w)
                if flow in b.flows:
                    b.in_turn.add(flow)
                    b.turn.append(flow)  # still has requests: its next turn is after the others'
                return w
            return None
        return None

    def evict_for(self, band: Band) -> Waiting | None:
        """Make room for a request of `band`: the newest request of the largest flow of the lowest
        band below it that holds any; None when only `band` or higher wait."""
        for lower in reversed(BANDS):
            if lower <= band:
                return None
            b = self._bands[lower]
            if not b.live:
                continue
            flow = max(b.counts, key=lambda f: b.counts[f])
            q = b.flows[flow]
            while q[-1].done:
                q.pop()
            w = q.pop()
            self._took(b, w)
            return w
        return None

    def cancel(self, w: Waiting) -> None:
        """`w` leaves the queue (it must be in it and not done); marked, dropped lazily."""
        self._took(self._bands[w.band], w)

    def _took(self, b: _Band, w: Waiting) -> None:
        """`w` leaves: taken off its flow's deque (head or tail), or cancelled in place. A flow with
        nothing live left is dropped (a turn it still holds is skipped)."""
        w.done = True
        b.live -= 1
        self.live -= 1
        left = self.flow_tokens.get(w.flow, 0) - w.tokens
        if left > 0:
            self.flow_tokens[w.flow] = left
        else:
            self.flow_tokens.pop(w.flow, None)
        n = b.counts[w.flow] - 1
        if n:
            b.counts[w.flow] = n
        else:
            del b.counts[w.flow]
            del b.flows[w.flow]
            if len(b.turn) > 2 * len(b.flows) + 16:  # stale turns of dropped flows: bound them
                b.turn = deque(f for f in b.turn if f in b.flows)
                b.in_turn = set(b.turn)

    def __iter__(self) -> Iterator[Waiting]:
        for b in self._bands.values():
            for q in b.flows.values():
                yield from (w for w in q if not w.done)
