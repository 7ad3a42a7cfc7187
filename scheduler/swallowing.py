"""Finds an engine whose server swallows its requests: it takes them and passes none on, while /health answers
and, in full mode, its llumlet reports an idle engine. Each request judged against its engine goes to
`EngineHealth.unadmitted` (health.py), which ejects after a few in a row.

- **Full mode** (`--engine-admission-seconds`): an in-flight account entry still unconfirmed after the period
  (`InflightAccount.overdue`) counts once a status of its engine came after it was sent (the llumlet
  reports, and did not list it) and the engine admitted no request at all since it was sent. One slow
  request (a prompt whose images the server still fetches) does not stop the others, nor does a server slow
  to pass on every request, which the ranking sees as load.
- **Lite mode** (`--engine-first-token-seconds`): a streamed request with no first token after the period
  counts once the gateway reported a first token of any engine since it was sent (so it reports them: a
  gateway that does not is never judged) and its engine has neither given a first token nor finished a
  request since. A busy engine does one or the other: its queue and prefills give first tokens, and when
  its KV is full its running answers finish to make room. Non-streamed answers come whole, at their end:
  not judged.

Schedule expires the core too, so `judge` looks at most once per JUDGE_EVERY_S: enough for rules of seconds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from pilotfish.scheduler.health import EngineHealth
from pilotfish.scheduler.view.account import AccountEntry, InflightAccount
from pilotfish.scheduler.view.lrs import RequestEntry

JUDGE_EVERY_S = 0.25


class SwallowingWatch:
    """One per core; `received_at` (full mode: when each instance's last status was applied, the core's clock)
    given means full mode, else lite with `first_token_due_s` (0: off)."""

    def __init__(
        self,
        health: EngineHealth,
        account: InflightAccount,
        held: Callable[[str], RequestEntry | None],
        drop: Callable[[list[str]], None],
        clock: Callable[[], float],
        received_at: dict[str, float] | None = None,
        first_token_due_s: float = 0.0,
    ) -> None:
        self._health, self._account, self._held, self._drop, self._clock = health, account, held, drop, clock
        self._received_at = received_at
        self.first_token_due_s = 0.0 if received_at is not None else first_token_due_s
        self._next_look = 0.0
        # full mode: overdue entries whose engine has sent no status since: judged when one comes
        self._unjudged: list[AccountEntry] = []
        # lite mode: when each engine last gave a first token or finished a request, and any engine last gave
        # a first token; streamed requests in dispatch order; and those due but waiting for a first token
        # anywhere, with the fleet's first token they were last looked at for
        self._progress_at: dict[str, float] = {}
        self._fleet_first_token_at = -math.inf
        self._streams: deque[RequestEntry] = deque()
        self._unanswered: list[RequestEntry] = []
        self._unanswered_seen_at = -math.inf

    @property
    def active(self) -> bool:
        return bool(self.first_token_due_s or (self._received_at is not None and self._account.overdue_seconds))

    # -- what the core tells it (lite mode) ----------------------------------------------------------------

    def sent(self, entry: RequestEntry, stream: bool) -> None:
        if self.first_token_due_s and stream:
            self._streams.append(entry)

    def first_token(self, instance_id: str, now: float) -> None:
        self._progress_at[instance_id] = self._fleet_first_token_at = now

    def finished(self, instance_id: str) -> None:
        if self.first_token_due_s:
            self._progress_at[instance_id] = self._clock()

    def forget(self, instance_id: str) -> None:
        self._progress_at.pop(instance_id, None)

    # -- the looks -----------------------------------------------------------------------------------------

    def judge(self) -> None:
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + JUDGE_EVERY_S
        if self._received_at is not None:
            self._judge_unadmitted(self._received_at)
        else:
            self._judge_unanswered(now)

    def _judge_unadmitted(self, received: dict[str, float]) -> None:
        account = self._account
        admitted, grace = account.admitted_at, account.grace
        waiting = self._unjudged
        waiting += account.overdue()
        if not waiting:
            return
        self._unjudged = []
        for entry in waiting:
            if not account.holds(entry):
                continue  # released or confirmed meanwhile
            instance_id = entry.inst.instance_id
            if received.get(instance_id, -math.inf) < entry.dispatched_at + grace:
                self._unjudged.append(entry)  # no status since it was sent: judged when one comes
            elif admitted.get(instance_id, -math.inf) <= entry.dispatched_at:
                self._drop(self._health.unadmitted(instance_id, entry.dispatched_at))

    def _judge_unanswered(self, now: float) -> None:
        cutoff = now - self.first_token_due_s
        due, streams, held = [], self._streams, self._held
        while streams and streams[0].dispatched_at <= cutoff:
            due.append(streams.popleft())
        if self._fleet_first_token_at > self._unanswered_seen_at:
            # those kept waiting for a first token anywhere: looked at again only once one came
            self._unanswered_seen_at = self._fleet_first_token_at
            due += self._unanswered
            self._unanswered = []
        for entry in due:
            if held(entry.request_id) is not entry or entry.decoding:
                continue  # released, or answering
            if self._fleet_first_token_at <= entry.dispatched_at:
                self._unanswered.append(entry)  # no first token anywhere since: judged when one comes
            elif self._progress_at.get(entry.instance_id, -math.inf) <= entry.dispatched_at:
                self._drop(self._health.unadmitted(entry.instance_id, entry.dispatched_at))
