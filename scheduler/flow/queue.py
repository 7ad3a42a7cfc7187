"""The waiting requests of one model: strict priority between bands, round robin between flows.

Each band keeps a FIFO per flow and turn lists: of the groups that have requests waiting, and per
group of its flows that do (groups.py: a flow key's group, by default the client's address). `pop`
takes the head of the next flow in turn of the next group in turn from the highest band that holds
any, so within a band every group with requests waiting gets one dispatch per round, and within a
group every flow, however many it queued (a flood waits behind its own requests, not in front of
others'; a client's many ids wait behind each other). With one group, or a group per flow, that is
round robin between flows. A cancelled request is marked and skipped when it reaches a head or
tail; counts are kept exact at once, so memory is bounded by what waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pilotfish.scheduler.flow.bands import BANDS, Band
from pilotfish.scheduler.flow.groups import group_of
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
    turn: deque[str] = field(default_factory=deque)  # groups with requests waiting, in round-robin order
    in_turn: set[str] = field(default_factory=set)  # the groups in `turn`
    # per group, its flows with requests waiting in round-robin order; and the flows in those lists
    flow_turns: dict[str, deque[str]] = field(default_factory=dict)
    flows_in_turn: set[str] = field(default_factory=set)
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
            if w.flow not in b.flows_in_turn:  # a flow emptied by cancels may still hold its turn
                group = group_of(w.flow)
                turns = b.flow_turns.get(group)
                if turns is None:
                    turns = b.flow_turns[group] = deque()
                turns.append(w.flow)
                b.flows_in_turn.add(w.flow)
                if group not in b.in_turn:  # so may a group
                    b.in_turn.add(group)
                    b.turn.append(group)
        q.append(w)
        if w.tokens:
            self.flow_tokens[w.flow] = self.flow_tokens.get(w.flow, 0) + w.tokens
        b.counts[w.flow] = b.counts.get(w.flow, 0) + 1
        b.live += 1
        self.live += 1

    def pop(self, eligible: Callable[[str, Band], bool] | None = None) -> Waiting | None:
        """The next request to dispatch: highest band first, the groups of a band in turn and the flows
        of a group in turn. With `eligible(flow, band)`, a flow it refuses keeps its place in the turn
        and the next one is tried; bands stay strict (nothing of a lower band passes a band with
        requests waiting)."""
        for band in BANDS:
            b = self._bands[band]
            if not b.live:
                continue
            for group in list(b.turn):
                turns = b.flow_turns[group]  # a group in turn has a turn list (emptied ones leave both)
                for flow in list(turns):
                    if flow not in b.flows:
                        continue  # emptied by cancels: its stale turn is dropped below
                    if eligible is not None and not eligible(flow, band):
                        continue
                    turns.remove(flow)
                    q = b.flows[flow]
                    while q and q[0].done:
                        q.popleft()
                    w = q.popleft()
                    # the turns first: taking the last request of a flow may rebuild them
                    if b.counts[flow] > 1:
                        turns.append(flow)  # still has requests: its next turn is after its group's others'
                    else:
                        b.flows_in_turn.discard(flow)
                    b.turn.remove(group)
                    if turns:
                        b.turn.append(group)  # the group's next turn is after the other groups'
                    else:  # as a flow's: it comes back at the end when it has requests again
                        b.in_turn.discard(group)
                        del b.flow_turns[group]
                    self._took(b, w)
                    return w
            return None
        return None

    def evict_for(self, band: Band) -> Waiting | None:
        """Make room for a request of `band`: the newest request of the largest flow of the largest
        group of the lowest band below it that holds any (a client's many small flows are one large
        group); None when only `band` or higher wait."""
        for lower in reversed(BANDS):
            if lower <= band:
                return None
            b = self._bands[lower]
            if not b.live:
                continue
            sizes: dict[str, int] = {}
            for f, n in b.counts.items():
                g = group_of(f)
                sizes[g] = sizes.get(g, 0) + n
            largest = max(sizes, key=lambda g: sizes[g])
            flow = max((f for f in b.counts if group_of(f) == largest), key=lambda f: b.counts[f])
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
            if len(b.flows_in_turn) > 2 * len(b.flows) + 16:  # stale turns of dropped flows: bound them
                for group, turns in list(b.flow_turns.items()):
                    kept = deque(f for f in turns if f in b.flows)
                    if kept:
                        b.flow_turns[group] = kept
                    else:
                        del b.flow_turns[group]
                b.flows_in_turn = {f for turns in b.flow_turns.values() for f in turns}
                b.turn = deque(g for g in b.turn if g in b.flow_turns)
                b.in_turn = set(b.turn)

    def __iter__(self) -> Iterator[Waiting]:
        for b in self._bands.values():
            for q in b.flows.values():
                yield from (w for w in q if not w.done)
