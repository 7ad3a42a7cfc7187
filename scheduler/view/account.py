"""Full mode's dispatch-time account: load sent to an instance that its engine has not reported yet.

Dispatch is the first moment the scheduler knows an instance's load will change, so each
dispatch adds an entry (its load increment) to the target's `InflightLoad` at once; the
engine's status later covers the request, and the entry must then go, or the request would
count twice. The reconciliation rule, applied for every status of an instance:

1. **Named**: a status lists the ids the engine admitted recently (the llumlet keeps each id
   in its statuses for --admitted-window-ms, so one lost status loses nothing); each
   listed id removes that request's entry on this instance. If the request has no entry
   here but has one on another instance of the same infer type, that one goes (the gateway
   retried on a fallback). Applied for every status that decodes, *including ones older than
   the status held* (a reordered status still proves admission; only its load is ignored).
2. **Gap**: the ids of an admission can be lost only if no status listing them was read:
   statuses were skipped across at least the writer's admitted-id window
   (--account-admitted-window-ms): its admitted_total grew by more than the new status lists, or,
   for a writer that does not count, update_id jumped (cms_view.py decides). Then
   entries on this instance dispatched
   at least `admission_grace_seconds` before it arrived are taken as admitted (an engine admits
   a request within milliseconds of receiving it); younger ones are marked and go once they
   reach that age (at the next status or expiry sweep), unless named first.
3. **Staleness**: an entry unconfirmed for `staleness_seconds` expires (the request never
   reached the engine and no Release came).
4. **Release** removes a request's entries at once.
5. **Overdue** (`overdue`): an entry on a neutral or prefill instance still unconfirmed after
   `overdue_seconds` is handed to the core once, which judges its engine (health.py, unadmitted).

Redis keeps only the newest status and the reader polls it, so a lost status is always
followed by one that is read: rule 2 bounds double counting after a loss to the grace
period, rule 1 makes duplicates and reordering harmless (removal is idempotent), and
rules 3-4 guarantee nothing leaks. The costs are asymmetric on purpose: confirming a request
the engine has not admitted yet under-counts it for one status interval, keeping an admitted
one double-counts it until expiry.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pilotfish.scheduler.view.types import InferType, InstanceView


@dataclass(slots=True, eq=False)
class AccountEntry:
    request_id: str
    inst: InstanceView
    dispatched_at: float
    requests: int = 1
    prefill_tokens: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    # a status gap was seen while this entry was younger than the grace period
    suspect: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.request_id, self.inst.instance_id)


def increment_for(inst: InstanceView, prompt_tokens: int, cached_tokens: int = 0) -> tuple[int, int, int, int]:
    """(requests, prefill tokens, decode requests, decode tokens) a request adds on `inst`, by infer type.

    Prefill work is the uncached part of the prompt; a request decodes on neutral and decode
    instances, where its whole prompt will sit in the KV cache.
    """
    uncached = max(0, prompt_tokens - cached_tokens)
    kind = inst.infer_type
    if kind == InferType.PREFILL:
        return (1, uncached, 0, 0)
    if kind == InferType.DECODE:
        return (1, 0, 1, prompt_tokens)
    return (1, uncached, 1, prompt_tokens)


class InflightAccount:
    """Entries by (request id, instance), kept in dispatch order so expiry pops from the front.

    Not thread-safe: one owner (the scheduling core's event loop). `on_change(inst)` is called
    after every change of an instance's sums, so load-ordered indexes can re-key it.
    """

    def __init__(
        self,
        staleness_seconds: float,
        admission_grace_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[InstanceView], None] | None = None,
        overdue_seconds: float = 0.0,
        on_admitted: Callable[[str], None] | None = None,
    ) -> None:
        self.staleness_seconds = staleness_seconds
        self.grace = admission_grace_seconds
        # entries on neutral and prefill instances in dispatch order, judged once when `overdue_seconds`
        # old (0: not kept); a decode engine may get its request only after a prefill elsewhere
        self.overdue_seconds = overdue_seconds
        self._watch: deque[AccountEntry] = deque()
        # instance id -> when a status last named an entry of it (the engine admits what it is sent)
        self.admitted_at: dict[str, float] = {}
        self._on_admitted = on_admitted or (lambda instance_id: None)  # told the instance id of each
        self._clock = clock
        self._on_change = on_change or (lambda inst: None)
        self._entries: OrderedDict[tuple[str, str], AccountEntry] = OrderedDict()
        self._by_request: dict[str, list[AccountEntry]] = {}
        # (dispatched_at, seq, entry): a heap, since gaps on different instances mark out of order
        self._suspects: list[tuple[float, int, AccountEntry]] = []
        self._seq = itertools.count()
        self.num_expired = 0
        self.num_confirmed = 0
        self.num_gap_confirmed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterable[AccountEntry]:
        return iter(self._entries.values())

    def entries_of(self, request_id: str) -> list[AccountEntry]:
        return list(self._by_request.get(request_id, ()))

    def dispatch(self, request_id: str, inst: InstanceView, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """Record the load `request_id` adds on `inst` (once per pair: a retry is not new load)."""
        key = (request_id, inst.instance_id)
        if key in self._entries:
            return
        requests, prefill, dec_req, dec_tok = increment_for(inst, prompt_tokens, cached_tokens)
        entry = AccountEntry(request_id, inst, self._clock(), requests, prefill, dec_req, dec_tok)
        self._entries[key] = entry
        self._by_request.setdefault(request_id, []).append(entry)
        if self.overdue_seconds and inst.infer_type != InferType.DECODE:
            self._watch.append(entry)
        load = inst.inflight
        load.requests += requests
        load.prefill_tokens += prefill
        load.decode_requests += dec_req
        load.decode_tokens += dec_tok
        self._on_change(inst)

    def apply_status(self, inst: InstanceView, admitted: Iterable[str], gap: bool) -> int:
        """Reconcile with one status of `inst` (rules 1 and 2); returns how many entries went."""
        removed = 0
        instance_id = inst.instance_id
        for request_id in admitted:
            entries = self._by_request.get(request_id)
            if not entries:
                continue
            here = [e for e in entries if e.inst.instance_id == instance_id]
            if not here:  # rerouted: admitted here, dispatched to a peer of the same kind
                here = [e for e in entries if e.inst.infer_type == inst.infer_type]
            for entry in here:
                self._remove(entry)
                removed += 1
        if removed:
            self.admitted_at[instance_id] = self._clock()
            self._on_admitted(instance_id)
        self.num_confirmed += removed
        if gap:
            removed += self._gap(inst)
        return removed

    def _gap(self, inst: InstanceView) -> int:
        cutoff = self._clock() - self.grace
        removed = 0
        for entry in [e for e in self._entries.values() if e.inst is inst]:
            if entry.dispatched_at <= cutoff:
                self._remove(entry)
                removed += 1
            elif not entry.suspect:
                entry.suspect = True
                heapq.heappush(self._suspects, (entry.dispatched_at, next(self._seq), entry))
        self.num_gap_confirmed += removed
        return removed

    def move(self, request_id: str, from_instance_id: str, inst: InstanceView, prompt_tokens: int) -> None:
        """The gateway served the request on `inst`, not `from_instance_id`: its in-flight load moves."""
        old = self._entries.get((request_id, from_instance_id))
        if old is not None:
            self._remove(old)
        self.dispatch(request_id, inst, prompt_tokens)

    def release(self, request_id: str) -> bool:
        """Drop every entry of the request at once; False if it had none (idempotent)."""
        entries = self._by_request.get(request_id)
        if not entries:
            return False
        for entry in list(entries):
            self._remove(entry)
        return True

    def drop_instance(self, instance_id: str) -> int:
        gone = [e for e in self._entries.values() if e.inst.instance_id == instance_id]
        for entry in gone:
            self._remove(entry)
        self.admitted_at.pop(instance_id, None)
        return len(gone)

    def holds(self, entry: AccountEntry) -> bool:
        """Whether the entry is still unconfirmed and unreleased."""
        return self._entries.get(entry.key) is entry

    def overdue(self) -> list[AccountEntry]:
        """The entries that reached `overdue_seconds` since the last call and are still unconfirmed and
        unreleased: requests their engine has not admitted in that time (each is returned once)."""
        cutoff = self._clock() - self.overdue_seconds
        found: list[AccountEntry] = []
        watch = self._watch
        while watch and watch[0].dispatched_at <= cutoff:
            entry = watch.popleft()
            if self._entries.get(entry.key) is entry:
                found.append(entry)
        return found

    def expire(self) -> int:
        """Rule 3, and the suspects of rule 2 that reached the grace age; returns how many went."""
        now = self._clock()
        dropped = 0
        cutoff = now - self.grace
        while self._suspects and self._suspects[0][0] <= cutoff:
            entry = heapq.heappop(self._suspects)[2]
            if self._entries.get(entry.key) is entry:
                self._remove(entry)
                self.num_gap_confirmed += 1
        deadline = now - self.staleness_seconds
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.dispatched_at > deadline:
                break
            self._remove(entry)
            dropped += 1
        self.num_expired += dropped
        return dropped

    def _remove(self, entry: AccountEntry) -> None:
        del self._entries[entry.key]
        siblings = self._by_request[entry.request_id]
        siblings.remove(entry)
        if not siblings:
            del self._by_request[entry.request_id]
        load = entry.inst.inflight
        load.requests -= entry.requests
        load.prefill_tokens -= entry.prefill_tokens
        load.decode_requests -= entry.decode_requests
        load.decode_tokens -= entry.decode_tokens
        self._on_change(entry.inst)
