"""The flow controller: synchronous, no I/O, an injected clock; the service (gate.py) or a
virtual-time benchmark drives it.

`submit` answers at once (a Decision, or raises) or queues the request and returns None; a
queued request is told its outcome exactly once through its `reply`: the Decision the ordinary
policy makes when an engine has room (`drain`), or a SchedulerError when it is shed or its
scheduling fails. `expire` applies the deadlines: critical requests are then dispatched whatever
the saturation, the others shed. `cancel` takes a request out (its client went away) and tells
nobody. The core is called only for dispatch (`SchedulerCore.schedule`), so a dispatch from the
queue is exactly a Schedule that arrives at that moment.

Admission, in order:
1. a request its gateway cannot hold (hold 0), or one for a model with no eligible engine, goes
   straight to the core (which answers or refuses it as it always has);
2. with nothing of its model waiting and an eligible engine with room, it is dispatched now;
3. otherwise it waits, behind its band and its flow's turn. A full queue makes room by shedding
   the newest request of the largest flow of the lowest band below the arrival's; with no lower
   band to shed, the arrival is shed. A sheddable request is shed at once when the queue's recent
   drain rate says it would wait past its deadline.

Fair share of what is dispatched (--flow-fair-share): round robin orders the queue, but a flood
already on the engines (queued prefill, big decode batches) delays everyone else's first token
however the queue is ordered. So the controller keeps an account of the tokens (prompt + max
tokens) each flow has in flight, and while more than one flow is active (in flight or waiting),
a flow holding more than 1/active of them, and asking for more than 1/active of the tokens
arriving lately (a rate decayed over --flow-fair-share-window-ms), is judged against the
saturation bounds times --flow-over-share-bound (the batch bound aside in full mode) and against
each engine's predicted next step (--flow-over-share-max-step-ms): it waits while an engine is past
that, and the headroom above it is left to the flows within their share. The arrival test keeps the flag on the
flood: held back and shed, a flood's work in flight can fall below a lighter flow's, but what it
asks for does not, and a flow over its share stays so while its requests wait and it still asks for
more than 1/active. While a flow is over its share, the flows within theirs are judged against the
queued-prefill bound times --flow-under-share-bound (above 1; the KV and batch bounds stay): the
flood keeps every engine near its own bound, so at the plain bound a light tenant's request would
wait in the queue for the flood's prefill to drain, though it is the next to leave whatever the
order. One flow alone is never judged either way, so a single tenant pays nothing. A flow id counts
apart only once established (--flow-established-after-ms, newcomers.py): ids not yet established share one
flow, so a client sending a new id with every request gets one turn and one share, not one per id.
Shares and turns are split between a flow key's groups first, then between a group's flows (groups.py:
the gateway groups by the client's address), so a client that keeps many ids alive gets one group's.

Critical headroom (--flow-critical-headroom-ms, full mode): while critical requests for a model arrive,
its standard and sheddable requests are also judged against each engine's predicted time to compute its
queued prefill and one critical prompt (the recent mean of their prefill), so a critical request finds
an engine that starts it soon (saturation.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.errors import DuplicateRequestError, SchedulerError
from pilotfish.scheduler.flow.bands import Band, band_of, parse_model_priorities
from pilotfish.scheduler.flow.groups import by_group, group_of
from pilotfish.scheduler.flow.newcomers import Newcomers
from pilotfish.scheduler.flow.queue import FlowQueue, Waiting
from pilotfish.scheduler.flow.saturation import Saturation
from pilotfish.scheduler.view.types import InstanceView, RequestInfo

log = logging.getLogger(__name__)

MAX_FLOW_LENGTH = 64
# the fair-share account is checked against the core at most this often (seconds): a walk of every
# request in flight per Schedule would cost more than the few milliseconds a finished one is counted
PRUNE_EVERY_S = 0.01

# shed reasons (the metric's label)
QUEUE_FULL = "queue_full"  # the arrival: no lower band to shed
EVICTED = "evicted"  # shed to make room for a higher band
DEADLINE = "deadline"  # waited its longest
WOULD_MISS = "would_miss_deadline"  # sheddable: the drain rate says it would wait past its deadline

# the drain rate a sheddable request's expected wait is judged by: queued requests' departures over this
# many seconds (at least 8 of them). Bursts come and go within seconds: over 10 s the rate still held the
# slow seconds between them, called a burst's wait too long and shed at once sheddable requests the
# engines would have served within the SLO (bursty below the knee: 2% of goodput)
DRAIN_RATE_WINDOW_S = 3.0

# how dispatched (the metric's label)
AT_ONCE, FROM_QUEUE, AT_DEADLINE = "at_once", "queued", "deadline"


class Shed(SchedulerError):
    """The request is shed by flow control: the gateway answers 429 with Retry-After."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Stopping(SchedulerError):
    """The scheduler is stopping: the request's gateway should fall back, as for any request in flight."""

    code = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class FlowSettings:
    max_wait_s: dict[Band, float]
    queue_max: int = 4096
    by_model: dict[str, Band] | None = None
    recheck_s: float = 0.05
    fair_share: bool = True
    over_share_bound: float = 0.5
    under_share_bound: float = 4.0
    share_window_s: float = 5.0
    established_after_s: float = 1.0

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> FlowSettings:
        return cls(
            max_wait_s={
                Band.CRITICAL: config.flow_critical_max_wait_ms / 1000,
                Band.STANDARD: config.flow_standard_max_wait_ms / 1000,
                Band.SHEDDABLE: config.flow_sheddable_max_wait_ms / 1000,
            },
            queue_max=config.flow_queue_max_requests,
            by_model=parse_model_priorities(config.flow_model_priorities),
            recheck_s=config.flow_recheck_ms / 1000,
            fair_share=config.flow_fair_share,
            over_share_bound=config.flow_over_share_bound,
            under_share_bound=config.flow_under_share_bound,
            share_window_s=config.flow_fair_share_window_ms / 1000,
            established_after_s=config.flow_established_after_ms / 1000,
        )


WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FlowStats:
    """Counters the metrics read (flow/metrics.py): plain ints, bumped as things happen."""

    def __init__(self) -> None:
        self.dispatched: Counter[tuple[str, str]] = Counter()  # (band, how)
        self.shed: Counter[tuple[str, str]] = Counter()  # (band, reason)
        self.cancelled: Counter[str] = Counter()  # band
        # the wait histogram per band: cumulative counts per WAIT_BUCKETS bound (+Inf last), and the sum
        self.wait_buckets: dict[str, list[int]] = {}
        self.wait_sum: Counter[str] = Counter()
        self.flow_wait: Counter[tuple[str, str]] = Counter()  # (band, flow): seconds waited, at most 4096 keys

    def waited(self, w: Waiting, now: float) -> None:
        seconds = max(0.0, now - w.enqueued)
        band = w.band.label
        buckets = self.wait_buckets.get(band)
        if buckets is None:
            buckets = self.wait_buckets[band] = [0] * (len(WAIT_BUCKETS) + 1)
        for i, bound in enumerate(WAIT_BUCKETS):
            if seconds <= bound:
                buckets[i] += 1
        buckets[-1] += 1
        self.wait_sum[band] += seconds
        key = (band, w.flow)
        if key in self.flow_wait or len(self.flow_wait) < 4096:
            self.flow_wait[key] += seconds


class ArrivalRates:
    """Tokens arriving per flow, each an exponentially decayed sum (time constant `window_s`), so a
    flow's share of what is asked lately is its value over the total. A flow whose value decays
    below one token is forgotten, which bounds the memory by the flows active lately."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._values: dict[str, tuple[float, float]] = {}  # flow -> (decayed tokens, as of when)

    def add(self, flow: str, tokens: int, now: float) -> None:
        value, at = self._values.get(flow, (0.0, now))
        self._values[flow] = (value * math.exp(-(now - at) / self.window_s) + tokens, now)

    def rates(self, now: float) -> dict[str, float]:
        out = {}
        for flow, (value, at) in list(self._values.items()):
            v = value * math.exp(-(now - at) / self.window_s)
            if v < 1.0:
                del self._values[flow]
            else:
                out[flow] = v
        return out


class FlowController:
    def __init__(
        self,
        core: object,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.settings = FlowSettings.from_config(config)
        self.saturation = Saturation.from_config(config)
        self._staleness = config.instance_staleness_seconds
        self._clock = clock
        self._wall_clock = wall_clock
        self._queues: dict[str, FlowQueue] = {}
        self._waiting: dict[str, Waiting] = {}  # request id -> its queue entry
        self._deadlines: list[tuple[float, int, Waiting]] = []
        self._seq = itertools.count()
        self._departures: deque[float] = deque(maxlen=64)  # when queued requests left for an engine
        self.stats = FlowStats()
        # the fair-share account: request id -> (flow, tokens) of what this controller dispatched
        # and the core still holds; pruned against the core (it also drops requests by itself:
        # orphans, staleness), so it never outlives a release
        self._inflight: dict[str, tuple[str, int]] = {}
        self._flow_tokens: Counter[str] = Counter()
        self._pruned_at = -math.inf
        self.arrivals = ArrivalRates(self.settings.share_window_s)
        self._over: set[str] = set()  # the flows over their share when last judged
        self._over_groups: set[str] = set()  # the groups over theirs (groups.py)
        self._over_within: set[str] = set()  # the flows over theirs within their group
        self._loosens = False  # whether the flows within their share get --flow-under-share-bound
        # flow ids not yet established share one flow (newcomers.py): rotating ids buys no shares
        self.newcomers = Newcomers(self.settings.established_after_s)
        # --flow-critical-headroom-ms, per model: the recent mean of critical prefills (tokens) and when one
        # last arrived (as many entries as models served)
        self._critical: dict[str, tuple[float, float]] = {}

    # -- what waits ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._waiting)

    def queued(self, request_id: str) -> bool:
        return request_id in self._waiting

    def queues(self) -> dict[str, FlowQueue]:
        return self._queues

    def next_deadline(self) -> float | None:
        d = self._deadlines
        while d and d[0][2].done:
            heapq.heappop(d)
        return d[0][0] if d else None

    # -- engines --------------------------------------------------------------------------------------

    def _eligible(self, model: str) -> list[InstanceView]:
        """The engines the policy may pick for `model`: serving it, not ejected (unless all are),
        with a fresh status in full mode."""
        core = self.core
        serving = [i for i in core.instances() if i.serves(model)]  # type: ignore[attr-defined]
        ejected = core.health.ejected  # type: ignore[attr-defined]
        if ejected:
            serving = [i for i in serving if i.instance_id not in ejected] or serving
        cms = core.cms  # type: ignore[attr-defined]
        if cms is not None and serving:
            now = self._wall_clock()
            fresh = []
            for i in serving:
                age = cms.status_age(i.instance_id, now)
                if age is not None and age <= self._staleness:
                    fresh.append(i)
            serving = fresh
        return serving

    def has_room(self, model: str, flow: str | None = None, band: Band = Band.CRITICAL) -> bool:
        """An eligible engine has room for `model`, judged for `flow` (tighter bounds while it is
        over its fair share, more queued prefill while another flow is) and `band` (below critical, the
        critical headroom too); without a flow, for a critical flow within its share (the loosest bounds
        in use)."""
        scale, prefill_scale = self.scales(flow)
        over = flow is not None and self._judged_over(flow)  # as scales just judged it
        reserve = self.critical_reserve(model) if band != Band.CRITICAL else 0.0
        why = self.saturation.reason  # "" when the engine has room
        return any(not why(i, scale, prefill_scale, over, reserve) for i in self._eligible(model))

    def critical_reserve(self, model: str) -> float:
        """The tokens a standard or sheddable request for `model` must leave room for on an engine
        (--flow-critical-headroom-ms): the recent mean critical prefill while critical requests for it
        arrive (one within --flow-fair-share-window-ms), else 0 (not judged)."""
        mean, at = self._critical.get(model, (0.0, -math.inf))
        return mean if self._clock() - at <= self.settings.share_window_s else 0.0

    def critical_reserve_on(self, inst: InstanceView) -> float:
        """The largest critical reserve of the models `inst` serves (the saturation metric's)."""
        return max((self.critical_reserve(m) for m in self._critical if inst.serves(m)), default=0.0)

    def _critical_arrived(self, req: RequestInfo) -> None:
        was = self._critical.get(req.model)
        self._critical[req.model] = (req.prompt_tokens if was is None else was[0], self._clock())

    def _critical_dispatched(self, req: RequestInfo) -> None:
        """Learn what a critical prompt leaves to compute: its prefill on the engine it went to (the
        account's, past the cached prefix; the whole prompt without one). A mean over about the last
        ten, so one odd prompt moves it little and a new mix is learned soon."""
        entries = self.core.account.entries_of(req.request_id)  # type: ignore[attr-defined]
        tokens = entries[0].prefill_tokens if entries else req.prompt_tokens
        mean, at = self._critical.get(req.model, (tokens, self._clock()))
        self._critical[req.model] = (0.9 * mean + 0.1 * tokens, at)

    def scales(self, flow: str | None) -> tuple[float, float]:
        """What `flow`'s saturation bounds are multiplied by: every bound, and the queued-prefill bound
        on top. --flow-over-share-bound (every bound) while it is over its fair share;
        --flow-under-share-bound (queued prefill) while another flow is over its share and it is
        not; else 1. `None`: a flow within its share (one is, whenever another is over)."""
        over = self.over_share_flows()
        if not over:
            return 1.0, 1.0
        if flow is not None and self._judged_over(flow):
            return self.settings.over_share_bound, 1.0
        return (1.0, self.settings.under_share_bound) if self._loosens else (1.0, 1.0)

    def _judged_over(self, flow: str) -> bool:
        """`flow` was over its share when last judged: itself, or its group (groups.py) for a flow with
        nothing in flight or waiting yet, so a client's idle id is not a way round its address's share."""
        return flow in self._over or (bool(self._over_groups) and group_of(flow) in self._over_groups)

    # -- the fair-share account ---------------------------------------------------------------------

    def flow_tokens(self) -> dict[str, int]:
        """Tokens in flight per flow (prompt + max tokens of what is dispatched and held)."""
        self._prune()
        return {f: n for f, n in self._flow_tokens.items() if n}

    def _active(self) -> Counter[str]:
        """Tokens in flight and waiting per flow with any."""
        self._prune()
        demand = Counter({f: n for f, n in self._flow_tokens.items() if n})
        for queue in self._queues.values():
            demand.update(queue.flow_tokens)
        return demand

    def over_share_flows(self) -> set[str]:
        """The flows over their fair share: more than one flow is active and each of these holds more
        than 1/active of the work in flight and waiting (tokens) and asks for more than 1/active of
        the tokens arriving lately. Waiting requests count: a flow held back keeps its demand, so the
        flood stays the one over its share instead of the lighter flow in turn. A flow already over
        its share stays so while it has requests waiting and still asks for more than 1/active,
        though it holds less: held at the tighter bounds, a flood's work in flight falls below a
        steady light flow's (whose requests decode for as long as ever), and without this it took
        the engines back at the plain bounds at once, flipping in and out of its share.

        With groups (groups.py), the groups are judged so against each other first, every flow of a
        group over its share making its flows over theirs, and then the flows of each group of several
        against each other; one group, or a group per flow, judges as flows alone."""
        if not self.settings.fair_share:
            return set()
        demand = self._active()
        if len(demand) < 2:
            return set()
        waiting: set[str] = set()
        for queue in self._queues.values():
            waiting.update(queue.flow_tokens)
        members = by_group(demand)
        held = {g: sum(demand[f] for f in flows) for g, flows in members.items()}
        rates: dict[str, float] | None = None
        asked: dict[str, float] = {}  # tokens arriving lately per group

        def arrival_rates() -> dict[str, float]:
            nonlocal rates
            if rates is None:
                rates = self.arrivals.rates(self._clock())
                # each group's by sum() over its rates in order, as the total was taken before groups (a
                # loop of += rounds otherwise from Python 3.12, whose sum() of floats is compensated)
                for g, flows in by_group(rates).items():
                    asked[g] = sum(rates[f] for f in flows)
            return rates

        over: set[str] = set()
        # between groups (groups.py; a flow alone in its group is judged here, as flows were before groups)
        n, total = len(members), sum(held.values())
        heavy = [g for g, mine in held.items()
                 if mine * n > total or (g in self._over_groups and any(f in waiting for f in members[g]))]
        over_groups: set[str] = set()
        if heavy and n > 1:
            arrival_rates()
            arriving = sum(asked.values())
            over_groups = {g for g in heavy if asked.get(g, 0.0) * n > arriving}
            for g in over_groups:
                over.update(members[g])
        self._over_groups = over_groups
        # within each group of several flows (one group: every flow, as without groups)
        over_within: set[str] = set()
        for g, flows in members.items():
            if len(flows) < 2:
                continue
            n, total = len(flows), held[g]
            heavy_flows = [f for f in flows if demand[f] * n > total or (f in self._over_within and f in waiting)]
            if heavy_flows:
                flow_rates = arrival_rates()
                over_within.update(f for f in heavy_flows if flow_rates.get(f, 0.0) * n > asked.get(g, 0.0))
        self._over_within = over_within
        self._over = over | over_within
        # the flows within their share get room beside a flood: beside a group over its share where there
        # are several groups (a flow over its share within its group only holds that flow back: the other
        # flows of its group are not a flood's neighbours), beside any flow over its share in one group
        self._loosens = bool(over_groups) if len(members) > 1 else bool(over_within)
        return self._over

    @property
    def over_share_groups(self) -> frozenset[str]:
        """The groups (groups.py) over their share when last judged."""
        return frozenset(self._over_groups)

    def over_share(self, flow: str) -> bool:
        """`flow` is over its fair share (over_share_flows), or in a group that is."""
        return bool(self.over_share_flows()) and self._judged_over(flow)

    def _account(self, req: RequestInfo, flow: str, band: Band) -> None:
        """`req` was dispatched: its flow's work in flight; a critical one's prefill for the headroom."""
        if band == Band.CRITICAL and self.saturation.keeps_critical_headroom:
            self._critical_dispatched(req)
        if not self.settings.fair_share:
            return
        n = req.prompt_tokens + max(req.max_tokens, 0)
        old = self._inflight.get(req.request_id)
        if old is not None:  # the same id again (a retry): count it once
            self._flow_tokens[old[0]] -= old[1]
        self._inflight[req.request_id] = (flow, n)
        self._flow_tokens[flow] += n

    def _prune(self) -> None:
        """Forget what the core no longer holds, at most every PRUNE_EVERY_S."""
        now = self._clock()
        if now - self._pruned_at < PRUNE_EVERY_S or not self._inflight:
            return
        self._pruned_at = now
        holds = self.core.holds  # type: ignore[attr-defined]
        gone = [rid for rid in self._inflight if not holds(rid)]
        for rid in gone:
            flow, n = self._inflight.pop(rid)
            left = self._flow_tokens[flow] - n
            if left > 0:
                self._flow_tokens[flow] = left
            else:
                del self._flow_tokens[flow]

    # -- the request path -----------------------------------------------------------------------------

    def submit(
        self, req: RequestInfo, priority: int, flow: str, hold_s: float, reply: Callable[[object], None]
    ) -> object | None:
        """A Decision now, or None: queued, and `reply` gets the outcome later (never from inside
        this call). Raises SchedulerError for a refusal now (Shed, or the core's own)."""
        core = self.core
        if req.request_id in self._waiting:
            raise DuplicateRequestError(f"request {req.request_id!r} is already waiting in the queue")
        band = band_of(priority, req.model, self.settings.by_model or {})
        queue = self._queues.get(req.model)
        arrived = self._clock()
        flow = self.newcomers.flow(flow[:MAX_FLOW_LENGTH], arrived)
        if self.settings.fair_share:
            self.arrivals.add(flow, req.prompt_tokens + max(req.max_tokens, 0), arrived)
        if hold_s <= 0 or not self._eligible(req.model):
            decision = core.schedule(req)  # type: ignore[attr-defined]
            self._account(req, flow, band)
            return decision
        # after the check above, so only a model some engine serves gets an entry, whatever names clients send
        if band == Band.CRITICAL and self.saturation.keeps_critical_headroom:
            self._critical_arrived(req)
        if not queue and self.has_room(req.model, flow, band):
            decision = core.schedule(req)  # type: ignore[attr-defined]
            self._account(req, flow, band)
            self.stats.dispatched[(band.label, AT_ONCE)] += 1
            return decision
        now = self._clock()
        deadline = now + min(self.settings.max_wait_s[band], hold_s)
        w = Waiting(req, band, flow, now, deadline)
        if queue is None:
            queue = self._queues[req.model] = FlowQueue()
        if band == Band.SHEDDABLE:
            wait = self._expected_wait(len(queue), now)
            if wait is not None and now + wait > deadline:
                self.stats.shed[(band.label, WOULD_MISS)] += 1
                raise Shed(
                    f"flow control: the queue would hold this request ~{wait:.1f} s, past its deadline", WOULD_MISS
                )
        if len(self._waiting) >= self.settings.queue_max:
            victim = queue.evict_for(band) or self._evict_elsewhere(band)
            if victim is None:
                self.stats.shed[(band.label, QUEUE_FULL)] += 1
                raise Shed(f"flow control: the queue is full ({self.settings.queue_max} requests)", QUEUE_FULL)
            self._shed(victim, EVICTED, f"flow control: shed to make room for a {band.label} request")
        queue.push(w)
        self._waiting[req.request_id] = w
        heapq.heappush(self._deadlines, (deadline, next(self._seq), w))
        self.drain()  # something may have room after all (a change not yet drained)
        if w.outcome is not None:  # dispatched or refused by that drain: answered here, not by reply
            outcome = w.outcome
            if isinstance(outcome, SchedulerError):
                raise outcome
            return outcome
        w.reply = reply
        return None

    def _evict_elsewhere(self, band: Band) -> Waiting | None:
        for queue in self._queues.values():
            victim = queue.evict_for(band)
            if victim is not None:
                return victim
        return None

    def cancel(self, request_id: str) -> bool:
        """The request's client went away: out of the queue, nobody told. False if it is not waiting."""
        w = self._waiting.pop(request_id, None)
        if w is None:
            return False
        self._queues[w.req.model].cancel(w)
        self.stats.cancelled[w.band.label] += 1
        self._forget(w)
        return True

    def drain(self) -> int:
        """Dispatch waiting requests, best band and flow in turn first, while their model has an
        engine with room; returns how many left the queue."""
        n = 0
        for model, queue in list(self._queues.items()):
            while queue and self.has_room(model):
                # the next flow in turn that has room: one over its share may not (tighter bounds), nor
                # one below critical while critical requests arrive (the headroom)
                w = queue.pop(lambda flow, band, model=model: self.has_room(model, flow, band))
                if w is None:
                    break
                self._dispatch(w, FROM_QUEUE)
                n += 1
            if not queue:
                del self._queues[model]
        return n

    def expire(self) -> int:
        """Apply the deadlines passed by now: critical dispatched, the rest shed; returns how many."""
        now = self._clock()
        d = self._deadlines
        n = 0
        while d and d[0][0] <= now:
            _, _, w = heapq.heappop(d)
            if w.done:
                continue
            queue = self._queues[w.req.model]
            queue.cancel(w)  # out of the queue (marked), then answered
            w.done = False
            if w.band == Band.CRITICAL:
                self._dispatch(w, AT_DEADLINE)
            else:
                self._shed(w, DEADLINE, f"flow control: no engine had room within {w.deadline - w.enqueued:.2f} s")
            if not queue:
                del self._queues[w.req.model]
            n += 1
        return n

    def shed_all(self, why: str) -> None:
        """Answer everything waiting with Stopping: its gateway falls back."""
        for w in list(self._waiting.values()):
            self._queues[w.req.model].cancel(w)
            self._answer(w, Stopping(why))
        self._queues.clear()

    # -- outcomes ---------------------------------------------------------------------------------

    def _dispatch(self, w: Waiting, how: str) -> None:
        now = self._clock()
        self.stats.waited(w, now)
        self._departures.append(now)
        try:
            outcome: object = self.core.schedule(w.req)  # type: ignore[attr-defined]
        except SchedulerError as exc:
            outcome = exc
        else:
            self._account(w.req, w.flow, w.band)
            self.stats.dispatched[(w.band.label, how)] += 1
        self._answer(w, outcome)

    def _shed(self, w: Waiting, reason: str, message: str) -> None:
        """`w` is shed; it is off its queue already (popped, evicted or cancelled in place)."""
        self.stats.shed[(w.band.label, reason)] += 1
        self.stats.waited(w, self._clock())
        self._answer(w, Shed(message, reason))

    def _answer(self, w: Waiting, outcome: object) -> None:
        w.done = True
        w.outcome = outcome
        self._forget(w)
        reply = w.reply
        if reply is not None:
            try:
                reply(outcome)
            except Exception:  # one gateway's broken reply path must not stop the others' dispatch
                log.exception("flow control: answering request %s failed", w.req.request_id)

    def _forget(self, w: Waiting) -> None:
        if self._waiting.get(w.req.request_id) is w:
            del self._waiting[w.req.request_id]

    def _expected_wait(self, ahead: int, now: float) -> float | None:
        """Seconds `ahead` queued requests take to leave at the recent drain rate; None when the
        queue has not drained enough lately to say."""
        dep = self._departures
        while dep and now - dep[0] > DRAIN_RATE_WINDOW_S:
            dep.popleft()
        if len(dep) < 8:
            return None
        span = now - dep[0]
        if span <= 0:
            return 0.0
        return ahead * span / len(dep)
