"""LoadIndex: the candidates of one pipeline kept sorted by the selector's metrics, re-keyed on change.

A decision over n instances that scans them all costs O(n) Python work (about 0.7 µs per
instance per metric); at 4,096 instances that alone breaks a 1 ms budget. Most policies rank
by metrics that change only when something happens to an instance (a dispatch, a Report, a
status, an account confirmation), so the core tells the index which instances changed, the
index re-keys those (bisect remove + insort), and a decision walks the sorted list from the
best end, checking filters on the instances it visits, until it holds enough candidates.

The walk reproduces the scan exactly (same filters, passes, fallback, ties by instance id,
top-K pick); `indexable_pipeline` admits only pipelines where that holds:

- the selector is metric_based and ranks by indexable metrics;
- global filters are failover filters only, and every single-instance filter that marks
  needsFailover (schedulability, staleness) comes before the others, so "marked" is simply
  "fails a marking filter" and the index can answer it from sets it maintains: instances
  without a status, unschedulable ones, and statuses sorted by timestamp (the stale prefix).

Cache-aware selectors rank by a cache metric first, which depends on the request; but only
the few instances holding the request's prefix differ from the rest. The index then keys by
the remaining metrics (for cache_aware_all_prefills_tokens_num: by all_prefills_tokens_num,
to which every instance without a hit adds the same prompt length), the instances with a hit
are keyed explicitly, and the walk merges the two sorted streams.

Predictor-enhanced all_prefills_tokens_num moves with the clock, so no static order ranks it;
`PredictedLoadIndex` answers it exactly all the same. Between two changes of an instance its
predicted value P(now) = F + max(0, U - r * elapsed) (in-flight F, the status's uncomputed U,
prefill rate r) only falls, from F + U, to F, and while the status's tokens are not done it is
at least r * (T - now), T = status time + U / r being when they will be (the drain time).
A decision (1) walks the instances by F + U until enough pass the filters, which gives a
bound b on the value to beat; (2) walks the instances whose value does not move by value;
(3) visits those stamped in the future (skewed clocks, where the drain bound does not hold);
(4) walks, taking turns until either ends, the instances by F (stopping at the first F that
cannot rank) and those whose drain time could still give a value <= b (kept sorted by T in
buckets of rates within a factor of 1.1, each walked up to now + b / its lowest rate). Every
instance that could rank among the best is visited, and its value computed exactly as the scan
computes it (tests/unit/test_scheduler_index.py).

Anything else (SLO, cache-aware with prediction, round-robin) scans.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from pilotfish.scheduler.view.types import InstanceView, RequestInfo

if TYPE_CHECKING:
    from pilotfish.scheduler.policy.base import Candidate, Filter, Metric, Pipeline
    from pilotfish.scheduler.policy.filters.failover import DomainBlocker

_KEY_REQUEST = RequestInfo(request_id="", model="")


HIT_LEN = "kv_cache_hit_len"
CACHE_AWARE = "cache_aware_all_prefills_tokens_num"
# sorts after every instance id: (value, _LAST) bounds all keys with that value
_LAST = "\U0010ffff"


def _key_metrics(pipeline: Pipeline) -> tuple[str | None, list[tuple[str, Callable[..., float], float]]] | None:
    """(cache head name or None, what the index keys by as (name, value, sign)); None: not indexable."""
    metrics = list(pipeline.selector.metrics)
    head = None
    if metrics and metrics[0].name in (HIT_LEN, CACHE_AWARE):
        head = metrics.pop(0)
    if not all(m.indexable for m in metrics):
        return None
    keyed = [(m.name, m.value, m.sign) for m in metrics]
    if head is not None and head.name == CACHE_AWARE:
        prefills = head._prefills  # type: ignore[attr-defined]
        if not prefills.indexable:
            return None
        keyed.insert(0, ("", prefills.value, 1.0))
    return (head.name if head is not None else None), keyed


def _predicted_metric(pipeline: Pipeline) -> Metric | None:
    """The selector's one metric when it is forward-predicted (it has `drain`); None otherwise."""
    metrics = pipeline.selector.metrics
    if len(metrics) == 1 and getattr(metrics[0], "forward_predicted", False):
        return metrics[0]
    return None


def indexable_pipeline(pipeline: Pipeline) -> bool:
    from pilotfish.scheduler.policy.filters.failover import FailoverFilter
    from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter, StalenessFilter
    from pilotfish.scheduler.policy.selectors.metric_based import MetricBasedSelector

    if not isinstance(pipeline.selector, MetricBasedSelector):
        return False
    if _key_metrics(pipeline) is None and _predicted_metric(pipeline) is None:
        return False
    if any(type(g) is not FailoverFilter for g in pipeline.global_filters):
        return False
    seen_plain = False
    for flt in pipeline.instance_filters:
        if flt.marks_failover:
            if seen_plain or type(flt) not in (SchedulabilityFilter, StalenessFilter):
                return False
        else:
            seen_plain = True
    return True


def load_index(pipeline: Pipeline, instances: Iterable[InstanceView]) -> LoadIndex:
    """The index for an indexable pipeline: by drain time for a forward-predicted metric, else by value."""
    if _key_metrics(pipeline) is None:
        return PredictedLoadIndex(pipeline, instances)
    return LoadIndex(pipeline, instances)


class LoadIndex:
    def __init__(self, pipeline: Pipeline, instances: Iterable[InstanceView]) -> None:
        self.pipeline = pipeline
        self.members: dict[str, InstanceView] = {}
        self._no_status: set[str] = set()
        self._unschedulable: set[str] = set()
        self._ts: dict[str, int] = {}
        self._by_ts: list[tuple[int, str]] = []
        self._build(instances)

    def _build(self, instances: Iterable[InstanceView]) -> None:
        plan = _key_metrics(self.pipeline)
        assert plan is not None, "LoadIndex needs an indexable pipeline"
        self._head, self._metrics = plan
        self._key: dict[str, tuple] = {}
        self._sorted: list[tuple] = []
        for inst in instances:
            self.members[inst.instance_id] = inst
            self._key[inst.instance_id] = key = self._make_key(inst)
            self._sorted.append(key)
            self._track_health(inst)
        self._sorted.sort()
        self._by_ts.sort()

    def __len__(self) -> int:
        return len(self.members)

    def _make_key(self, inst: InstanceView) -> tuple:
        return (*(value(inst, _KEY_REQUEST) * sign for _, value, sign in self._metrics), inst.instance_id)

    def rekey(self, inst: InstanceView) -> None:
        """`inst` changed (load or status): move it to its new place."""
        instance_id = inst.instance_id
        old = self._key.get(instance_id)
        if old is None or self.members.get(instance_id) is not inst:
            return
        key = self._make_key(inst)
        if key != old:
            lst = self._sorted
            del lst[bisect.bisect_left(lst, old)]
            bisect.insort(lst, key)
            self._key[instance_id] = key
        self._track_health(inst)

    def _track_health(self, inst: InstanceView) -> None:
        instance_id = inst.instance_id
        s = inst.status
        old_ts = self._ts.get(instance_id)
        new_ts = s.timestamp_ms if s is not None else None
        if old_ts != new_ts:
            if old_ts is not None:
                del self._by_ts[bisect.bisect_left(self._by_ts, (old_ts, instance_id))]
                del self._ts[instance_id]
            if new_ts is not None:
                bisect.insort(self._by_ts, (new_ts, instance_id))
                self._ts[instance_id] = new_ts
        if s is None:
            self._no_status.add(instance_id)
            self._unschedulable.discard(instance_id)
        else:
            self._no_status.discard(instance_id)
            if s.schedulable:
                self._unschedulable.discard(instance_id)
            else:
                self._unschedulable.add(instance_id)

    def _unhealthy(self, marking: list) -> set[str]:
        from pilotfish.scheduler.policy.filters.health import SchedulabilityFilter

        bad: set[str] = set()
        for flt in marking:
            bad |= self._no_status
            if isinstance(flt, SchedulabilityFilter):
                bad |= self._unschedulable
            else:
                end = bisect.bisect_left(self._by_ts, (flt.cutoff_ms(), ""))
                bad.update(instance_id for _, instance_id in self._by_ts[:end])
        return bad

    def _pass(self, pipeline: Pipeline, fallback: bool) -> tuple[list[Filter], list[DomainBlocker]]:
        """The single-instance filters of this pass and the failover filters' blockers."""
        from pilotfish.scheduler.policy.filters.failover import DomainBlocker

        members = self.members
        filters = [f for f in pipeline.instance_filters if not fallback or f.not_skip_when_fallback]
        blockers = []
        for gflt in pipeline.global_filters:
            if fallback and not gflt.not_skip_when_fallback:
                continue
            bad = self._unhealthy([f for f in filters if f.marks_failover])
            if bad:
                everyone = members.values() if gflt.domain == "node-unit" else ()  # type: ignore[attr-defined]
                blockers.append(DomainBlocker(gflt.domain, [members[i] for i in bad], everyone))  # type: ignore[attr-defined]
        return filters, blockers  # type: ignore[return-value]

    def _ranked(self, pipeline: Pipeline, req: RequestInfo) -> Iterator[tuple]:
        """Every member's full selector key (signed values..., instance id), best first."""
        head = self._head
        if head is None:
            return iter(self._sorted)
        members = self.members
        hits = {i: h for i, h in pipeline.metrics[0].ctx.prefix_hits(req).items() if i in members}
        selector_metrics = pipeline.selector.metrics
        explicit = sorted((*(m.value(members[i], req) * m.sign for m in selector_metrics), i) for i in hits)
        prompt = float(req.prompt_tokens)

        def rest() -> Iterator[tuple]:
            # an instance without a hit: kv_cache_hit_len 0, or its prefills plus the whole prompt
            for key in self._sorted:
                if key[-1] in hits:
                    continue
                if head == HIT_LEN:
                    yield (0.0, *key)
                else:
                    yield (key[0] + prompt, *key[1:])

        return heapq.merge(explicit, rest())

    def run(self, pipeline: Pipeline, req: RequestInfo, count: int) -> list[InstanceView] | None:
        """The scan's answer by walking the index; None when nothing passes (the scan explains why)."""
        from pilotfish.scheduler.policy.base import Candidate

        selector = pipeline.selector
        need = max(selector.top_k, count)  # type: ignore[attr-defined]
        names = [m.name for m in selector.metrics]
        signs = [m.sign for m in selector.metrics]
        extra = [m for m in pipeline.metrics if m.name not in names]
        members = self.members
        for fallback in (False, True):
            filters, blockers = self._pass(pipeline, fallback)
            picked: list[Candidate] = []
            for key in self._ranked(pipeline, req):
                inst = members[key[-1]]
                values = {name: key[i] * signs[i] for i, name in enumerate(names)}
                for m in extra:
                    values[m.name] = m.value(inst, req)
                cand = Candidate(inst, values)
                if not all(f.passes(cand, req) for f in filters):
                    continue
                if any(b.blocks(inst) for b in blockers):
                    continue
                picked.append(cand)
                if len(picked) >= need:
                    break
            if picked:
                return [c.inst for c in selector.pick(picked, count)]  # type: ignore[attr-defined]
        return None


# the drain-time bound is bisected with this much slack, so rounding never leaves a contender out
_REL_SLACK = 1e-9
_ABS_SLACK = 1e-6
# draining instances are bucketed by rate, each bucket's rates within this factor: a finer bucket
# visits fewer needless instances, at one bisect per bucket per decision
_RATE_STEP = 1.1
_LOG_RATE_STEP = math.log(_RATE_STEP)


def _rate_bucket(rate: float) -> int:
    """k such that _RATE_STEP ** k <= rate, the largest one but for rounding."""
    k = math.floor(math.log(rate) / _LOG_RATE_STEP)
    return k - 1 if _RATE_STEP**k > rate else k


class PredictedLoadIndex(LoadIndex):
    """The exact best-first answer for a forward-predicted metric (see the module's docstring).

    Each member is either fixed (its value does not move with the clock: kept in `_fixed` by
    value) or draining (kept by F + U, by F, by status time, and by drain time in its rate's bucket).
    """

    def _build(self, instances: Iterable[InstanceView]) -> None:
        metric = _predicted_metric(self.pipeline)
        assert metric is not None, "PredictedLoadIndex needs a forward-predicted selector metric"
        self._metric = metric
        self._entry: dict[str, tuple] = {}
        self._fixed: list[tuple[float, str]] = []
        self._upper: list[tuple[float, str]] = []
        self._floor: list[tuple[float, str]] = []
        self._starts: list[tuple[float, str]] = []
        # rate bucket k (rates from _RATE_STEP ** k) -> [(drain time, instance id)], sorted; the keys
        # sorted fastest first, and each bucket's 1 / lowest rate
        self._buckets: dict[int, list[tuple[float, str]]] = {}
        self._bucket_order: list[int] = []
        self._slowness: dict[int, float] = {}
        for inst in instances:
            self.members[inst.instance_id] = inst
            self._place(inst)
            self._track_health(inst)
        self._by_ts.sort()

    def _place(self, inst: InstanceView) -> None:
        instance_id = inst.instance_id
        drain = self._metric.drain(inst)  # type: ignore[attr-defined]
        if drain is None:
            entry: tuple = (self._metric.value(inst, _KEY_REQUEST), instance_id)
            bisect.insort(self._fixed, entry)
        else:
            upper, floor, rate, start = drain
            exponent = _rate_bucket(rate)
            entry = (upper, floor, start, start + (upper - floor) / rate, exponent, instance_id)
            bisect.insort(self._upper, (upper, instance_id))
            bisect.insort(self._floor, (floor, instance_id))
            bisect.insort(self._starts, (start, instance_id))
            bucket = self._buckets.get(exponent)
            if bucket is None:
                bucket = self._buckets[exponent] = []
                bisect.insort(self._bucket_order, -exponent)
                self._slowness[exponent] = 1.0 / _RATE_STEP**exponent
            bisect.insort(bucket, (entry[3], instance_id))
        self._entry[instance_id] = entry

    def _unplace(self, instance_id: str) -> None:
        entry = self._entry.pop(instance_id)
        if len(entry) == 2:
            _remove(self._fixed, entry)
            return
        upper, floor, start, drained_at, exponent, _ = entry
        _remove(self._upper, (upper, instance_id))
        _remove(self._floor, (floor, instance_id))
        _remove(self._starts, (start, instance_id))
        bucket = self._buckets[exponent]
        _remove(bucket, (drained_at, instance_id))
        if not bucket:
            del self._buckets[exponent], self._slowness[exponent]
            _remove(self._bucket_order, -exponent)

    def rekey(self, inst: InstanceView) -> None:
        instance_id = inst.instance_id
        if instance_id not in self._entry or self.members.get(instance_id) is not inst:
            return
        self._unplace(instance_id)
        self._place(inst)
        self._track_health(inst)

    def run(self, pipeline: Pipeline, req: RequestInfo, count: int) -> list[InstanceView] | None:
        selector = pipeline.selector
        need = max(selector.top_k, count)  # type: ignore[attr-defined]
        metric = self._metric
        extra = [m for m in pipeline.metrics if m.name != metric.name]
        now = metric.ctx.now or metric.ctx.wall_clock()
        for fallback in (False, True):
            filters, blockers = self._pass(pipeline, fallback)
            best = _Best(self.members, metric, extra, filters, blockers, req, need)
            # (1) a bound: the least loaded at their last status, until enough pass
            for _, instance_id in self._upper:
                if best.full:
                    break
                best.consider(instance_id)
            # (2) the fixed ones, by their exact value, while they can still rank
            for key in self._fixed:
                if best.full and key >= best.worst:
                    break
                best.consider(key[1])
            # (3) every draining instance that could still rank; none is left when fewer than `need` passed
            if best.full and len(best.seen) < len(self.members):
                self._contenders(best, now)
            if best.kept:
                return [c.inst for c in selector.pick(best.candidates(), count)]  # type: ignore[attr-defined]
        return None

    def _contenders(self, best: _Best, now: float) -> None:
        """Visit every draining instance whose value could rank among `best` (full; it improves as we go).

        Two walks, each enough alone, take turns until either ends: by drain time, and by F. The
        first is short when the best values are well above F (busy instances, drain times apart);
        the second when many are drained to F (it stops at the first F that cannot rank, and ties
        go by instance id). Taking turns costs at most twice the shorter; consider() skips repeats.
        """
        # a status stamped after `now` (a skewed clock) is predicted no progress: the bound fails there
        for _, instance_id in self._starts[bisect.bisect_left(self._starts, (now - _ABS_SLACK, "")) :]:
            best.consider(instance_id)
        walks = [self._by_floor(best)]
        if not self._floor or best.worst[0] > self._floor[0][0]:
            # else every contender is at the least F already, and the walk by F alone ranks them by id
            walks.append(self._by_drain(best, now))
        while True:
            for walk in walks:
                if next(walk, None) is None:
                    return

    def _by_drain(self, best: _Best, now: float) -> Iterator[bool]:
        buckets, slowness = self._buckets, self._slowness
        for negated in self._bucket_order:
            bucket, slow = buckets[-negated], slowness[-negated]
            for drained_at, instance_id in bucket:
                # r * (T - now) <= value <= worst: drain times up to now + worst / (the bucket's lowest r)
                if drained_at > now + (best.worst[0] * (1.0 + _REL_SLACK) + _ABS_SLACK) * slow + _ABS_SLACK:
                    break
                best.consider(instance_id)
                yield True

    def _by_floor(self, best: _Best) -> Iterator[bool]:
        # the value is never below F: stop at the first (F, id) that cannot rank
        for key in self._floor:
            if key >= best.worst:
                return
            best.consider(key[1])
            yield True


class _Best:
    """The best `need` candidates that pass one pass's filters, among the instances considered."""

    __slots__ = ("_blockers", "_extra", "_filters", "_members", "_metric", "_need", "_req", "kept", "seen")

    def __init__(
        self,
        members: dict[str, InstanceView],
        metric: Metric,
        extra: list[Metric],
        filters: list[Filter],
        blockers: list[DomainBlocker],
        req: RequestInfo,
        need: int,
    ) -> None:
        self._members, self._metric, self._extra = members, metric, extra
        self._filters, self._blockers, self._req, self._need = filters, blockers, req, need
        # ((value, instance id), candidate), best first: the scan's order (ties by instance id)
        self.kept: list[tuple[tuple[float, str], Candidate]] = []
        self.seen: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.kept) >= self._need

    @property
    def worst(self) -> tuple[float, str]:
        return self.kept[-1][0]

    def candidates(self) -> list[Candidate]:
        return [c for _, c in self.kept]

    def consider(self, instance_id: str) -> None:
        from pilotfish.scheduler.policy.base import Candidate

        if instance_id in self.seen:
            return
        self.seen.add(instance_id)
        inst, req, kept = self._members[instance_id], self._req, self.kept
        key = (self._metric.value(inst, req), instance_id)
        if len(kept) >= self._need and key >= kept[-1][0]:
            return  # cannot rank among the best, whatever the filters say
        values = {self._metric.name: key[0]}
        for m in self._extra:
            values[m.name] = m.value(inst, req)
        cand = Candidate(inst, values)
        if not all(f.passes(cand, req) for f in self._filters):  # type: ignore[attr-defined]
            return
        if any(b.blocks(inst) for b in self._blockers):
            return
        bisect.insort(kept, (key, cand), key=lambda item: item[0])
        if len(kept) > self._need:
            kept.pop()


def _remove(lst: list, item: tuple) -> None:
    del lst[bisect.bisect_left(lst, item)]
