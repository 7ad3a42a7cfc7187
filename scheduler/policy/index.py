"""LoadIndex: the candidates of one pipeline kept sorted by the selector's metrics, re-keyed on change.

A decision over n instances that scans them all costs O(n) Python work (about 0.7 µs per
instance per metric); at 4,096 instances that alone breaks a 1 ms budget. Most policies rank
by metrics that change only when something happens to an instance (a dispatch, a Report, a
status, an account confirmation), so the core tells the index which instances changed, the
index re-keys those (bisect remove + insort), and a decision walks the sorted list from the
best end, checking filters on the instances it visits, until it holds enough candidates.

The walk reproduces the scan exactly (same filters, passes, fallback, ties by instance id,
top-K pick); `indexable_pipeline` admits only pipelines where that holds, asking the stages
(base.py), never naming them:

- the selector has an `index_walk` (metric_based: RANKED) and ranks by indexable metrics;
- every global filter is `indexable` (failover: a blocker from the marked instances), and every
  single-instance filter that marks needsFailover is `health_indexed` and comes before the
  others, so "marked" is simply "fails a marking filter" and the index answers it from sets it
  maintains (`InstanceHealth`): instances without a status, unschedulable ones, and statuses
  sorted by timestamp (the stale prefix).

A ranking may put a cache metric first, which depends on the request; but only the few instances
holding the request's prefix differ from the rest: on the others the metric is its `miss_value`,
a base metric plus an offset of the request (kv_cache_hit_len: 0; cache_aware_all_prefills_tokens_num:
all_prefills_tokens_num plus the whole prompt). The index then keys by the base and the remaining
metrics, the instances with a hit are keyed explicitly, and the walk merges the two sorted streams.

A BANDED selector (cache_aware, selectors/cache_aware.py) ranks by load unless a prefix hit picks
among the instances within the load band: the index keys by its load metrics alone, finds the least
load from the first instance that passes, visits the instances with a hit explicitly, and merges
them with the walk's in-band instances without one (their miss value, whose base is the band's
metric).

Predictor-enhanced all_prefills_tokens_num moves with the clock, so no static order ranks it;
`PredictedLoadIndex` answers it exactly all the same. Between two changes of an instance its
predicted value P(now) = F + max(0, U - r * elapsed) (in-flight F, the status's uncomputed U,
prefill rate r) only falls, from F + U, to F, and while the status's tokens are not done it is
at least r * (T - now), T = status time + U / r being when they will be (the drain time).
A decision (1) walks the instances by F + U until enough pass the filters, which gives a
bound b on the value to beat; (2) walks the instances whose value does not move by value;
(3) visits those stamped in the future (skewed clocks, where the drain bound does not hold);
(4) walks whichever is shorter at bound b (a few bisects tell): the instances by F (stopping at
the first F that cannot rank), or those whose drain time could still give a value <= b (kept
sorted by T in buckets of rates within a factor of two, each walked up to now + b / its lowest
rate, and visiting only the instances whose own F + r * (T - now) is <= b: that check is a few
float ops on the bucket's entry, a visit costs several times more, and the bucket's lowest rate
alone lets in up to twice the values that can rank). Every instance that could rank among the
best is visited, and its value computed exactly as the scan computes it, from constants cached
when the instance changed (tests/unit/test_scheduler_index.py). An instance whose value has
stopped moving (its tokens done, or the staleness window over) is moved to the fixed ones at the
next decision, so the walks by F and by drain time hold only the instances still draining; one
re-keyed with the same inputs (a Release or a Report: the LRS, which this value does not read)
stays where it is.

A request-dependent metric with a floor (predicted TTFT, the default policy's first load metric) is
served by `BoundedLoadIndex`: its value is computed from a per-instance state kept here (re-made when the
instance changes) plus the request, and it is at least a request-free key of that state plus an offset of
the request. The walk visits the instances without a prefix hit by key until the floor passes the
`need`-th best value, the instances with a hit by their own floor while one can still matter, and runs the
selector's own `select` over the visited candidates (see the class).

Anything else (cache-aware with prediction, predictor-enhanced predicted latency, round-robin) scans.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, cast

# imported at module level, not in the functions that use them: a decision calls those many times, and
# an import statement costs a lookup each time (base.py imports this module only inside functions)
from pilotfish.scheduler.policy.base import (
    BandedSelector,
    Blocker,
    Candidate,
    Drain,
    IndexWalk,
    InstanceFilter,
    MissValue,
    RankedSelector,
)
from pilotfish.scheduler.view.types import InstanceView, RequestInfo

if TYPE_CHECKING:
    from pilotfish.scheduler.policy.base import GlobalFilter, Metric, Pipeline

_KEY_REQUEST = RequestInfo(request_id="", model="")


# sorts after every instance id: (value, _LAST) bounds all keys with that value
_LAST = "\U0010ffff"

Keyed = list[tuple[str, Callable[..., float], float]]


def _key_metrics(pipeline: Pipeline) -> tuple[Metric | None, Keyed] | None:
    """(cache head or None, what the index keys by as (name, value, sign)); None: not indexable."""
    selector = pipeline.selector
    metrics = list(selector.metrics)
    if selector.index_walk is IndexWalk.BANDED:
        # keyed by load alone; a cache value without a hit must follow the walk's order, so its base is
        # the band's metric (the walk's first key)
        head, load = metrics[0], metrics[1:]
        miss = head.miss_value()
        if miss is None or not all(m.indexable for m in load):
            return None
        if miss.base is not None and miss.base.name != load[0].name:
            return None
        return head, [(m.name, m.value, m.sign) for m in load]
    if selector.index_walk is not IndexWalk.RANKED:
        return None
    head = None
    miss: MissValue | None = None
    if metrics:
        miss = metrics[0].miss_value()
        if miss is not None:
            head = metrics.pop(0)
    if not all(m.indexable for m in metrics):
        return None
    keyed = [(m.name, m.value, m.sign) for m in metrics]
    if head is not None and miss is not None and miss.base is not None:
        if not miss.base.indexable:
            return None
        # the instances without a hit rank by their miss value, base plus the same offset: by base
        keyed.insert(0, ("", miss.base.value, head.sign))
    return head, keyed


def _predicted_metric(pipeline: Pipeline) -> Metric | None:
    """The RANKED selector's one metric when it is forward-predicted (it has `drain`); None otherwise."""
    metrics = pipeline.selector.metrics
    if pipeline.selector.index_walk is IndexWalk.RANKED and len(metrics) == 1 and metrics[0].forward_predicted:
        return metrics[0]
    return None


def indexable_pipeline(pipeline: Pipeline) -> bool:
    if pipeline.selector.index_walk is IndexWalk.NONE:
        return False
    if _key_metrics(pipeline) is None and _predicted_metric(pipeline) is None and _bounded_plan(pipeline) is None:
        return False
    if not all(g.indexable for g in pipeline.global_filters):
        return False
    seen_plain = False
    for flt in pipeline.instance_filters:
        if flt.marks_failover:
            if seen_plain or not flt.health_indexed:
                return False
        else:
            seen_plain = True
    return True


def _blockers(
    global_filters: Iterable[GlobalFilter], bad: AbstractSet[str], members: dict[str, InstanceView]
) -> list[Blocker]:
    """What the global filters of one pass block, given the members that fail a marking filter."""
    if not bad:
        return []  # nothing marked: an indexable global filter keeps every candidate
    marked = [members[i] for i in bad]
    return [g.blocker(marked, members.values()) for g in global_filters]


def _candidate(
    inst: InstanceView,
    values: dict[str, float],
    extra: list[Metric],
    filters: list[InstanceFilter],
    blockers: list[Blocker],
    req: RequestInfo,
) -> Candidate | None:
    """A member's Candidate, `values` completed with the pipeline's other metrics, when it passes the pass's
    single-instance filters and no blocker blocks it; None otherwise. Every walk of an index admits so."""
    for m in extra:
        values[m.name] = m.value(inst, req)
    cand = Candidate(inst, values)
    for flt in filters:
        if not flt.passes(cand, req):
            return None
    for blocker in blockers:
        if blocker.blocks(inst):
            return None
    return cand


class _Stages:
    """The filters of one pass (normal or fallback) of a pipeline: fixed once the pipeline is built, and a
    decision would otherwise sort them out again."""

    __slots__ = ("filters", "global_filters", "marking", "plain")

    def __init__(self, pipeline: Pipeline, fallback: bool) -> None:
        self.filters = [f for f in pipeline.instance_filters if not fallback or f.not_skip_when_fallback]
        self.marking = [f for f in self.filters if f.marks_failover]
        self.plain = [f for f in self.filters if not f.marks_failover]
        self.global_filters = [g for g in pipeline.global_filters if not fallback or g.not_skip_when_fallback]


class _KeyAdmit:
    """One pass of a walk over `LoadIndex._sorted`-shaped keys (signed values..., instance id): the key's
    Candidate, or None when the member fails the pass."""

    __slots__ = ("blockers", "extra", "filters", "members", "names", "req")

    def __init__(
        self, index: LoadIndex, pipeline: Pipeline, ranked: Sequence[Metric], fallback: bool, req: RequestInfo
    ) -> None:
        self.filters, self.blockers = index._pass(pipeline, fallback)
        # (name, sign, position in the key) of each ranked metric
        self.names = [(m.name, m.sign, i) for i, m in enumerate(ranked)]
        ranked_names = {m.name for m in ranked}
        self.extra = [m for m in pipeline.metrics if m.name not in ranked_names]
        self.members, self.req = index.members, req

    def __call__(self, key: tuple) -> Candidate | None:
        values = {name: key[i] * sign for name, sign, i in self.names}
        return _candidate(self.members[key[-1]], values, self.extra, self.filters, self.blockers, self.req)


def load_index(pipeline: Pipeline, instances: Iterable[InstanceView]) -> LoadIndex:
    """The index for an indexable pipeline: by value; by drain time for a forward-predicted metric; by a floor
    for a request-dependent one that has a floor."""
    if _key_metrics(pipeline) is not None:
        return LoadIndex(pipeline, instances)
    if _predicted_metric(pipeline) is not None:
        return PredictedLoadIndex(pipeline, instances)
    return BoundedLoadIndex(pipeline, instances)


class LoadIndex:
    def __init__(self, pipeline: Pipeline, instances: Iterable[InstanceView]) -> None:
        self.pipeline = pipeline
        self.members: dict[str, InstanceView] = {}
        self._no_status: set[str] = set()
        self._unschedulable: set[str] = set()
        self._ts: dict[str, int] = {}
        # the status each member's health sets were last brought up to date from: a re-key for a dispatch, a
        # Report or a Release finds the same one (a status is replaced when applied, never changed)
        self._health_from: dict[str, object] = {}
        self._by_ts: list[tuple[int, str]] = []
        # (instance filters, the marking ones, global filters) of each pass (normal, fallback) of
        # `pipeline`: fixed once it is built, and a decision would otherwise sort them out again
        self._passes: dict[bool, _Stages] = {}
        self._build(instances)

    def _build(self, instances: Iterable[InstanceView]) -> None:
        plan = _key_metrics(self.pipeline)
        assert plan is not None, "LoadIndex needs an indexable pipeline"
        self._head, self._metrics = plan
        # the head's value on the instances without a hit (a head always has one)
        self._miss = self._head.miss_value() if self._head is not None else None
        self._key: dict[str, tuple] = {}
        self._sorted: list[tuple] = []
        for inst in instances:
            self.members[inst.instance_id] = inst
            self._key[inst.instance_id] = key = self._make_key(inst, inst.instance_id)
            self._sorted.append(key)
            self._track_health(inst, inst.instance_id)
        self._sorted.sort()
        self._by_ts.sort()

    def __len__(self) -> int:
        return len(self.members)

    def _make_key(self, inst: InstanceView, instance_id: str) -> tuple:
        return (*(value(inst, _KEY_REQUEST) * sign for _, value, sign in self._metrics), instance_id)

    def rekey(self, inst: InstanceView) -> None:
        """`inst` changed (load or status): move it to its new place."""
        instance_id = inst.instance_id
        old = self._key.get(instance_id)
        if old is None or self.members.get(instance_id) is not inst:
            return
        key = self._make_key(inst, instance_id)
        if key != old:
            self._move(instance_id, old, key)
            self._key[instance_id] = key
        self._track_health(inst, instance_id)

    def _move(self, instance_id: str, old: tuple, key: tuple) -> None:
        """The member's key changed from `old` to `key`: its place in the sorted members (and whatever a
        subclass keeps in the same order)."""
        lst = self._sorted
        del lst[bisect.bisect_left(lst, old)]
        bisect.insort(lst, key)

    def _track_health(self, inst: InstanceView, instance_id: str) -> None:
        s = inst.status
        if self._health_from.get(instance_id, _UNSEEN) is s:
            return
        self._health_from[instance_id] = s
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

    # -- InstanceHealth: what the health_indexed filters answer from

    def without_status(self) -> AbstractSet[str]:
        return self._no_status

    def unschedulable(self) -> AbstractSet[str]:
        return self._unschedulable

    def stamped_before(self, cutoff_ms: float) -> AbstractSet[str]:
        end = bisect.bisect_left(self._by_ts, (cutoff_ms, ""))
        return {instance_id for _, instance_id in self._by_ts[:end]} if end else _NONE

    def _unhealthy(self, marking: list[InstanceFilter]) -> set[str]:
        bad: set[str] = set()
        for flt in marking:
            bad |= flt.blocked_in(self)  # sets: merged without hashing again
        return bad

    def _stages(self, pipeline: Pipeline, fallback: bool) -> _Stages:
        """The filters of one pass, sorted out once for the index's own pipeline."""
        stages = self._passes.get(fallback) if pipeline is self.pipeline else None
        if stages is None:
            stages = _Stages(pipeline, fallback)
            if pipeline is self.pipeline:
                self._passes[fallback] = stages
        return stages

    def _pass(self, pipeline: Pipeline, fallback: bool) -> tuple[list[InstanceFilter], list[Blocker]]:
        """The single-instance filters of this pass and the global filters' blockers."""
        stages = self._stages(pipeline, fallback)
        if not stages.global_filters or not stages.marking:
            return stages.filters, []
        return stages.filters, _blockers(stages.global_filters, self._unhealthy(stages.marking), self.members)

    def _health_pass(
        self, pipeline: Pipeline, fallback: bool
    ) -> tuple[list[InstanceFilter], AbstractSet[str], list[Blocker]]:
        """This pass as (the filters that do not mark, the members that fail one that does, the blockers): the
        marking filters answered from the health sets (`health_indexed`), without a call per member."""
        stages = self._stages(pipeline, fallback)
        if not stages.marking:
            return stages.plain, _NONE, []
        bad = self._unhealthy(stages.marking)
        blockers = _blockers(stages.global_filters, bad, self.members) if stages.global_filters else []
        return stages.plain, bad, blockers

    def _ranked(self, pipeline: Pipeline, req: RequestInfo) -> Iterator[tuple]:
        """Every member's full selector key (signed values..., instance id), best first."""
        head = self._head
        if head is None:
            return iter(self._sorted)
        members = self.members
        hits = {i: h for i, h in head.ctx.prefix_hits(req).items() if i in members}
        selector_metrics = pipeline.selector.metrics
        explicit = sorted((*(m.value(members[i], req) * m.sign for m in selector_metrics), i) for i in hits)
        miss = self._miss
        offset = miss.offset(req) * head.sign
        based = miss.base is not None

        def rest() -> Iterator[tuple]:
            # an instance without a hit: its miss value, keyed by the base (the first key) when there is one
            for key in self._sorted:
                if key[-1] in hits:
                    continue
                if based:
                    yield (key[0] + offset, *key[1:])
                else:
                    yield (offset, *key)

        return heapq.merge(explicit, rest())

    def run(self, pipeline: Pipeline, req: RequestInfo, count: int) -> list[InstanceView] | None:
        """The scan's answer by walking the index; None when nothing passes (the scan explains why)."""
        if pipeline.selector.index_walk is IndexWalk.BANDED:
            return self._run_banded(pipeline, cast(BandedSelector, pipeline.selector), req, count)
        selector = cast(RankedSelector, pipeline.selector)
        need = max(selector.top_k, count)
        for fallback in (False, True):
            admit = _KeyAdmit(self, pipeline, selector.metrics, fallback, req)
            picked: list[Candidate] = []
            for key in self._ranked(pipeline, req):
                cand = admit(key)
                if cand is None:
                    continue
                picked.append(cand)
                if len(picked) >= need:
                    break
            if picked:
                return [c.inst for c in selector.pick(picked, count)]
        return None

    def _run_banded(
        self, pipeline: Pipeline, selector: BandedSelector, req: RequestInfo, count: int
    ) -> list[InstanceView] | None:
        """The BANDED selector's `select` over the walk: load order, the band from its first passing
        instance, the instances with a hit visited explicitly."""
        cache, *load = selector.metrics
        need = max(selector.top_k, count)
        members = self.members
        hits = {i: h for i, h in cache.ctx.prefix_hits(req).items() if i in members}
        for fallback in (False, True):
            admit = _KeyAdmit(self, pipeline, load, fallback, req)
            walk = iter(self._sorted)
            passing: list[tuple[tuple, Candidate]] = []  # the candidates that pass, in load order, as walked

            def walked(j: int, walk: Iterator[tuple] = walk, passing: list = passing, admit: Callable = admit) -> bool:
                """Walk until `passing` holds j + 1 entries; False when the walk ends first."""
                while len(passing) <= j:
                    for key in walk:
                        cand = admit(key)
                        if cand is not None:
                            passing.append((key, cand))
                            break
                    else:
                        return False
                return True

            if not walked(0):
                continue
            if hits:
                ranked = self._affinity(selector, cache, hits, passing, walked, admit, req, need, count)
                if ranked is not None:
                    return ranked
            walked(need - 1)
            return [c.inst for c in selector.load_ranking.pick([c for _, c in passing[:need]], count)]
        return None

    def _affinity(
        self,
        selector: BandedSelector,
        cache: Metric,
        hits: dict[str, int],
        passing: list[tuple[tuple, Candidate]],
        walked: Callable[[int], bool],
        admit: Callable[[tuple], Candidate | None],
        req: RequestInfo,
        need: int,
        count: int,
    ) -> list[InstanceView] | None:
        """The in-band ranking when the hits tell in-band candidates apart; None when they do not."""
        limit = selector.band_limit(passing[0][0][0])
        banded = []
        for instance_id in hits:
            key = self._key[instance_id]
            if key[0] <= limit:
                cand = admit(key)
                if cand is not None:
                    banded.append((key, cand))
        if not banded:
            return None
        seen = {hits[key[-1]] for key, _ in banded}
        j = 0
        while walked(j) and passing[j][0][-1] in hits:
            j += 1
        if j < len(passing) and passing[j][0][0] <= limit:
            seen.add(0)  # an in-band candidate without a hit
        if len(seen) < 2:
            return None
        sign = cache.sign
        explicit = sorted(((c.values[cache.name] * sign, *key), c) for key, c in banded)
        miss = self._miss
        offset = miss.offset(req)
        based = miss.base is not None  # then the band's metric: the walk's first key, lower is better

        def without_hit() -> Iterator[tuple[tuple, Candidate]]:
            k = 0
            while walked(k):
                key, c = passing[k]
                if key[0] > limit:
                    return
                if key[-1] not in hits:
                    yield (((key[0] + offset if based else offset) * sign, *key), c)
                k += 1

        head = [c for _, c in itertools.islice(heapq.merge(explicit, without_hit(), key=lambda e: e[0]), need)]
        ranked = selector.load_ranking.pick(head, len(head))
        if len(ranked) < count:  # the fallbacks after them: the next by load alone
            taken = {c.inst.instance_id for c in ranked}
            k = 0
            while len(ranked) < count and walked(k):
                if passing[k][0][-1] not in taken:
                    ranked.append(passing[k][1])
                k += 1
        return [c.inst for c in ranked[:count]]


# the drain-time bound is bisected with this much slack, so rounding never leaves a contender out
_REL_SLACK = 1e-9
_ABS_SLACK = 1e-6
# draining instances are bucketed by rate, each bucket's rates within a factor of two (the float's
# exponent): a finer bucket visits fewer needless instances, but the walk checks every bucket at every
# decision, and a step of 1.1 (about 46 buckets) cost more than it saved at 256 and at 4,096 instances


def _rate_bucket(rate: float) -> int:
    """k such that 2 ** (k - 1) <= rate < 2 ** k."""
    return math.frexp(rate)[1]


# what an instance's value is made of between two of its changes: (value at the status's time, the
# status's uncomputed tokens U, tokens per second, status time in s); a fixed value is (value, 1, 0, inf)
Prediction = tuple[float, float, float, float]
# how it moves: Metric.drain's (value at the status's time, floor F, tokens per second, status time)
# no member fails a marking filter (a pass without one)
_NONE: frozenset[str] = frozenset()
# no status seen yet (None is one: an instance without a status)
_UNSEEN = object()


def _predicted(pred: Prediction, now: float, stale: float) -> float:
    """AllPrefillsTokensNum.value at `now`, with the same float operations: the elapsed time clamped to
    [0, stale] (PolicyContext.elapsed_since), times the rate (prefill_tokens_done), at most U.

    `_Best.consider` inlines it: keep the two the same."""
    upper, uncomputed, rate, start = pred
    elapsed = now - start
    if elapsed <= 0:
        return upper  # the scan's value less 0.0
    done = (elapsed if elapsed < stale else stale) * rate
    return upper - done if done < uncomputed else upper - uncomputed


class PredictedLoadIndex(LoadIndex):
    """The exact best-first answer for a forward-predicted metric (see the module's docstring).

    Each member is either fixed (its value does not move with the clock: kept in `_fixed` by
    value) or draining (kept by F + U, by F, and by drain time in its rate's bucket).
    Either way `_pred` holds what its value is computed from, so a visit costs a few float ops.
    """

    def _build(self, instances: Iterable[InstanceView]) -> None:
        metric = _predicted_metric(self.pipeline)
        assert metric is not None, "PredictedLoadIndex needs a forward-predicted selector metric"
        self._metric = metric
        self._entry: dict[str, tuple] = {}
        self._pred: dict[str, Prediction] = {}
        # what each member was placed from (`drain`, or the value when it does not move): a re-key that
        # finds the same leaves the member where it is (a Release or a Report changes the LRS, not this value)
        self._inputs: dict[str, Drain | float] = {}
        self._fixed: list[tuple[float, str]] = []
        self._upper: list[tuple[float, str]] = []
        self._floor: list[tuple[float, str]] = []
        # draining members whose status time may be after a decision's `now` (skewed clocks): id -> status
        # time. Every draining member stamped at or after `_clock - _ABS_SLACK` is in it; a decision drops
        # those it finds in the past, and a clock that steps back rebuilds it
        self._future: dict[str, float] = {}
        # rate bucket k (rates from 2 ** (k - 1)) -> [(drain time, instance id, rate, F)], sorted; the keys
        # sorted fastest first, and each bucket's 1 / lowest rate
        self._buckets: dict[int, list[tuple[float, str, float, float]]] = {}
        self._bucket_order: list[int] = []
        self._slowness: dict[int, float] = {}
        # when each draining member's value stops moving (its tokens done, or the staleness window over):
        # a heap of (time, id), stale pairs skipped by `_due_at`; then `_settle` makes it fixed
        self._due: list[tuple[float, str]] = []
        self._due_at: dict[str, float] = {}
        # members made fixed by the clock, not by a change: a clock that steps back makes them drain again
        self._settled: set[str] = set()
        self._clock = -math.inf
        # the filter lists of each pass (normal, fallback) of `pipeline`: fixed once the pipeline is built
        self._plans: dict[bool, _Plan] = {}
        for inst in instances:
            self.members[inst.instance_id] = inst
            self._place(inst, self._inputs_of(inst))
            self._track_health(inst, inst.instance_id)
        self._by_ts.sort()

    def _inputs_of(self, inst: InstanceView) -> Drain | float:
        """How the member's value moves (`drain`), or the value itself when it does not move."""
        drain = self._metric.drain(inst)
        return drain if drain is not None else self._metric.value(inst, _KEY_REQUEST)

    def _place(self, inst: InstanceView, inputs: Drain | float) -> None:
        instance_id = inst.instance_id
        self._inputs[instance_id] = inputs
        if not isinstance(inputs, tuple):
            self._fix(instance_id, inputs)
            return
        upper, floor, rate, start = inputs
        exponent = _rate_bucket(rate)
        drained_at = start + (upper - floor) / rate
        drain_key = (drained_at, instance_id, rate, floor)
        entry = (upper, floor, start, drain_key, exponent, instance_id)
        self._pred[instance_id] = (upper, upper - floor, rate, start)
        bisect.insort(self._upper, (upper, instance_id))
        bisect.insort(self._floor, (floor, instance_id))
        if start >= self._clock - _ABS_SLACK:
            self._future[instance_id] = start
        bucket = self._buckets.get(exponent)
        if bucket is None:
            bucket = self._buckets[exponent] = []
            bisect.insort(self._bucket_order, -exponent)
            self._slowness[exponent] = 2.0 ** (1 - exponent)
        bisect.insort(bucket, drain_key)
        due = min(drained_at, start + self._metric.ctx.instance_staleness_seconds)
        self._due_at[instance_id] = due
        heapq.heappush(self._due, (due, instance_id))
        self._entry[instance_id] = entry

    def _fix(self, instance_id: str, value: float) -> None:
        entry = (value, instance_id)
        bisect.insort(self._fixed, entry)
        self._pred[instance_id] = (value, 1.0, 0.0, math.inf)
        self._entry[instance_id] = entry

    def _settle(self, now: float, stale: float) -> None:
        """Make fixed the draining members whose value has stopped moving by `now`: the walks then rank
        them by value, and the walks by F and by drain time no longer visit them decision after decision."""
        if now < self._clock:
            for instance_id in self._settled:
                self._unplace(instance_id)
                inst = self.members[instance_id]
                self._place(inst, self._inputs_of(inst))
            self._settled.clear()
            cutoff = now - _ABS_SLACK
            self._future = {i: e[2] for i, e in self._entry.items() if len(e) > 2 and e[2] >= cutoff}
        self._clock = now
        due, due_at = self._due, self._due_at
        while due and due[0][0] <= now:
            when, instance_id = heapq.heappop(due)
            if due_at.get(instance_id) != when:
                continue  # re-placed since
            pred = self._pred[instance_id]
            _, uncomputed, rate, start = pred
            elapsed = now - start
            if elapsed < stale and elapsed * rate < uncomputed:
                # rounding: the drain time came out a hair early; look again a little later
                due_at[instance_id] = later = now + _ABS_SLACK
                heapq.heappush(due, (later, instance_id))
                continue
            # from now on the scan's value is the same (the elapsed time clamped, or all U done)
            value = _predicted(pred, now, stale)
            self._unplace(instance_id)
            self._fix(instance_id, value)
            self._settled.add(instance_id)

    def _unplace(self, instance_id: str) -> None:
        entry = self._entry.pop(instance_id)
        if len(entry) == 2:
            _remove(self._fixed, entry)
            return
        del self._due_at[instance_id]
        self._future.pop(instance_id, None)
        upper, floor, _, drain_key, exponent, _ = entry
        _remove(self._upper, (upper, instance_id))
        _remove(self._floor, (floor, instance_id))
        bucket = self._buckets[exponent]
        _remove(bucket, drain_key)
        if not bucket:
            del self._buckets[exponent], self._slowness[exponent]
            _remove(self._bucket_order, -exponent)

    def rekey(self, inst: InstanceView) -> None:
        instance_id = inst.instance_id
        if instance_id not in self._entry or self.members.get(instance_id) is not inst:
            return
        inputs = self._inputs_of(inst)
        # the same inputs give the same value at every time, drained or not: the member stays (a member
        # the clock settled stays fixed, at the value it would settle at again)
        if inputs != self._inputs[instance_id]:
            self._unplace(instance_id)
            self._settled.discard(instance_id)
            self._place(inst, inputs)
        self._track_health(inst, inst.instance_id)

    def run(self, pipeline: Pipeline, req: RequestInfo, count: int) -> list[InstanceView] | None:
        selector = cast(RankedSelector, pipeline.selector)  # a forward-predicted metric: RANKED only
        need = max(selector.top_k, count)
        metric = self._metric
        ctx = metric.ctx
        now = ctx.now or ctx.wall_clock()
        stale = ctx.instance_staleness_seconds
        self._settle(now, stale)
        for fallback in (False, True):
            plan = self._plan(pipeline, fallback)
            bad, blockers = self._health(plan)
            best = _Best(self.members, self._pred, now, stale, metric.name, plan, bad, blockers, req, need)
            self._walk(best, now)
            if best.keys:
                return [c.inst for c in selector.pick(best.candidates(), count)]
        return None

    def _plan(self, pipeline: Pipeline, fallback: bool) -> _Plan:
        """The filters of one pass, made once per pass for the index's own pipeline."""
        plan = self._plans.get(fallback) if pipeline is self.pipeline else None
        if plan is None:
            plan = _Plan(pipeline, self._metric.name, fallback)
            if pipeline is self.pipeline:
                self._plans[fallback] = plan
        return plan

    def _health(self, plan: _Plan) -> tuple[set[str] | frozenset[str], list[Blocker]]:
        """The members that fail a marking filter (offers skip them without a Candidate), and the global
        filters' blockers, as `_pass` makes them."""
        if not plan.marking:
            return _NONE, []
        bad = self._unhealthy(plan.marking)
        return bad, _blockers(plan.global_filters, bad, self.members)

    def _walk(self, best: _Best, now: float) -> None:
        keys, need = best.keys, best.need
        # (1) a bound: the least loaded at their last status, until enough pass
        for _, instance_id in self._upper:
            if len(keys) >= need:
                break
            best.consider(instance_id)
        # (2) the fixed ones, by their exact value, while they can still rank
        for key in self._fixed:
            if len(keys) >= need and key >= keys[-1]:
                break
            best.consider(key[1])
        # (3) every draining instance that could still rank; none is left when fewer than `need` passed
        if len(keys) >= need and len(best.seen) < len(self.members):
            self._contenders(best, now)

    def _contenders(self, best: _Best, now: float) -> None:
        """Visit every draining instance whose value could rank among `best` (full; it improves as we go).

        Either of two walks is enough alone: by drain time, and by F. The first is short when the
        best values are well above F (busy instances, drain times apart); the second when many are
        drained to F (it stops at the first F that cannot rank, and ties go by instance id). How far
        each would go at the bound we hold is a few bisects, so only the shorter one runs (taking
        turns, as before, visited up to twice the shorter, and every visit costs more than a bisect).
        """
        # a status stamped after `now` (a skewed clock) is predicted no progress: the bound fails there
        future = self._future
        if future:
            cutoff = now - _ABS_SLACK
            for instance_id, start in list(future.items()):
                if start >= cutoff:
                    best.consider(instance_id)
                else:
                    del future[instance_id]  # in the past for good (until the clock steps back)
        worst = best.keys[-1]
        by_floor = bisect.bisect_left(self._floor, worst)
        reach = worst[0] * (1.0 + _REL_SLACK) + _ABS_SLACK
        by_drain = 0
        for exponent, bucket in self._buckets.items():
            by_drain += bisect.bisect_right(bucket, (now + reach * self._slowness[exponent] + _ABS_SLACK, _LAST))
            if by_drain >= by_floor:
                self._by_floor(best)
                return
        self._by_drain(best, now)

    def _by_drain(self, best: _Best, now: float) -> None:
        buckets, slowness, keys = self._buckets, self._slowness, best.keys
        for negated in self._bucket_order:
            bucket, slow = buckets[-negated], slowness[-negated]
            # r * (T - now) <= value <= worst: drain times up to now + worst / (the bucket's lowest r);
            # the limit moves only when a visit improves the worst
            reach = keys[-1][0] * (1.0 + _REL_SLACK) + _ABS_SLACK
            limit = now + reach * slow + _ABS_SLACK
            for drained_at, instance_id, rate, floor in bucket:
                if drained_at > limit:
                    break
                # the same bound with the instance's own rate, and its F, without computing the value: most
                # of the bucket's rates are well above its lowest, and this skips the visit for them
                if floor + (drained_at - now - _ABS_SLACK) * rate > reach:
                    continue
                if best.consider(instance_id):
                    reach = keys[-1][0] * (1.0 + _REL_SLACK) + _ABS_SLACK
                    limit = now + reach * slow + _ABS_SLACK

    def _by_floor(self, best: _Best) -> None:
        # the value is never below F: stop at the first (F, id) that cannot rank
        keys = best.keys
        for key in self._floor:
            if key >= keys[-1]:
                return
            best.consider(key[1])


class _Plan:
    """What one pass of a pipeline runs besides the walk: made once, read by every decision."""

    __slots__ = ("check", "extra", "global_filters", "marking", "plain")

    def __init__(self, pipeline: Pipeline, name: str, fallback: bool) -> None:
        filters = [f for f in pipeline.instance_filters if not fallback or f.not_skip_when_fallback]
        # answered by the index's health sets
        self.marking: list[InstanceFilter] = [f for f in filters if f.marks_failover]
        # run on each candidate that could rank, with the metrics they read besides the ranked one
        self.plain: list[InstanceFilter] = [f for f in filters if not f.marks_failover]
        self.extra: list[Metric] = [m for m in pipeline.metrics if m.name != name]
        self.check = bool(self.plain or self.extra)
        self.global_filters = [g for g in pipeline.global_filters if not fallback or g.not_skip_when_fallback]


class _Best:
    """The best `need` candidates that pass one pass's filters, among the instances offered."""

    __slots__ = (
        "_bad",
        "_blockers",
        "_check",
        "_extra",
        "_filters",
        "_members",
        "_name",
        "_now",
        "_pred",
        "_req",
        "_stale",
        "cands",
        "keys",
        "need",
        "seen",
    )

    def __init__(
        self,
        members: dict[str, InstanceView],
        pred: dict[str, Prediction],
        now: float,
        stale: float,
        name: str,
        plan: _Plan,
        bad: set[str] | frozenset[str],
        blockers: list[Blocker],
        req: RequestInfo,
        need: int,
    ) -> None:
        self._members, self._pred, self._now, self._stale = members, pred, now, stale
        self._name, self._req, self.need = name, req, need
        # the marking filters are answered by `bad` (the index's health sets): only the others run
        self._filters, self._extra, self._check = plan.plain, plan.extra, plan.check
        self._bad, self._blockers = bad, blockers
        # (value, instance id) of the kept, best first: the scan's order (ties by id); their candidates.
        # The walks read `keys` directly: full is len(keys) >= need, and the worst kept is keys[-1]
        self.keys: list[tuple[float, str]] = []
        self.cands: list[Candidate | None] = []
        self.seen: set[str] = set()

    def candidates(self) -> list[Candidate]:
        members, name = self._members, self._name
        return [
            c if c is not None else Candidate(members[key[1]], {name: key[0]})
            for key, c in zip(self.keys, self.cands, strict=True)
        ]

    def consider(self, instance_id: str) -> bool:
        """Offer an instance once, whichever walks reach it; True when it is kept (the worst kept may improve).

        Kept if its (value, id) ranks and it passes; a Candidate is made only then."""
        seen = self.seen
        if instance_id in seen:
            return False
        seen.add(instance_id)
        # `_predicted`, inlined (the same float operations): this runs for every instance a walk reaches
        upper, uncomputed, rate, start = self._pred[instance_id]
        elapsed = self._now - start
        if elapsed <= 0:
            value = upper
        else:
            stale = self._stale
            done = (elapsed if elapsed < stale else stale) * rate
            value = upper - done if done < uncomputed else upper - uncomputed
        key = (value, instance_id)
        keys, need = self.keys, self.need
        if len(keys) >= need and key >= keys[-1]:
            return False  # cannot rank among the best, whatever the filters say
        if instance_id in self._bad:
            return False
        inst = self._members[instance_id]
        cand = None  # made at the end (`candidates`) when nothing here reads it: most offers are outranked later
        if self._check:
            req = self._req
            values = {self._name: key[0]}
            for m in self._extra:
                values[m.name] = m.value(inst, req)
            cand = Candidate(inst, values)
            for flt in self._filters:
                if not flt.passes(cand, req):
                    return False
        for blocker in self._blockers:
            if blocker.blocks(inst):
                return False
        at = bisect.bisect(keys, key)
        keys.insert(at, key)
        self.cands.insert(at, cand)
        if len(keys) > need:
            keys.pop()
            self.cands.pop()
        return True


def _remove(lst: list, item: tuple) -> None:
    del lst[bisect.bisect_left(lst, item)]


# a floor is compared with a value computed by other float operations: this much slack (relative, and
# absolute in the value's unit) keeps rounding from stopping a walk one instance early
_BOUND_REL_SLACK = 1e-9
_BOUND_ABS_SLACK = 1e-9
# step 2 walks the holders of a prefix lazily, in floor order, when at least 1/_LAZY_HOLDER_SHARE of the members
# hold it (else their floors are gathered and sorted)
_LAZY_HOLDER_SHARE = 4


def _bounded_plan(pipeline: Pipeline) -> tuple[Metric | None, list[Metric]] | None:
    """(cache head or None, the ranked metrics after it) when a BoundedLoadIndex serves the pipeline."""
    selector = pipeline.selector
    metrics = list(selector.metrics)
    head: Metric | None = None
    if selector.index_walk is IndexWalk.BANDED:
        head, metrics = metrics[0], metrics[1:]
    elif selector.index_walk is not IndexWalk.RANKED:
        return None
    elif metrics and metrics[0].cache_locality:
        head, metrics = metrics[0], metrics[1:]
    if head is not None:
        miss = head.miss_value()
        # the instances without a hit must all have the same head value: then they rank among themselves
        # by the metrics after it, and the walk's order (by the first one's floor) serves them
        if miss is None or miss.base is not None:
            return None
    if not metrics or not (metrics[0].has_floor and metrics[0].instance_state) or not metrics[0].lower_is_better:
        return None
    if not all(m.instance_state or m.indexable for m in metrics[1:]):
        return None
    return head, metrics


class BoundedLoadIndex(LoadIndex):
    """The exact answer for a ranking whose first metric depends on the request but has a floor (predicted TTFT).

    Such a metric's value is `evaluate(state, ...)` of a per-instance state kept here, made again when the
    instance changes, and it is at least lower_bound(state) + bound_offset(req, hit) (base.py). The members
    are kept sorted by (lower_bound, states, position). A decision

    1. walks the members without a prefix hit in that order, computing their values exactly (from the
       states: a few float operations, not the view's layers), until the floor of the next one passes the
       `need`-th best value among those that pass the filters: no member left can rank among the best
       `need` without a hit. Members with the same states as one outranked get the same values and come
       later in the stable order: the walk skips them all at once (idle instances in lite mode tie so);
    2. visits the members with a hit (few) by their own floor, while it is within what a hit can still
       matter at: for a banded selector the band limit of the least value or the `need`-th best value,
       whichever is higher; for a ranked one the `need`-th best (or every hit, with a cache head, which
       ranks the hits first);
    3. runs the selector's own `select` over the visited candidates in the scan's order.

    That gives the scan's answer: the least value, the in-band hits, whether an in-band candidate has no
    hit, the best `need` without a hit (the in-band ranking and the load ranking's head, fallbacks after
    them) are all among the visited, and what the selector draws at random it draws from the same list.
    """

    def _build(self, instances: Iterable[InstanceView]) -> None:
        plan = _bounded_plan(self.pipeline)
        assert plan is not None, "BoundedLoadIndex needs a ranking whose first metric has a floor"
        self._head, self._ranked = plan
        self._first = self._ranked[0]
        # what a visit computes, sorted out once: the ranked metrics' names, how each after the first gets
        # its value from its state (evaluate, or None: the state is the value), the filters' other metrics
        self._names = [m.name for m in self._ranked]
        self._state_of = [m.state if m.instance_state else _request_free(m) for m in self._ranked]
        self._rest = [m.evaluate if m.instance_state else None for m in self._ranked[1:]]
        ranked_names = {m.name for m in self.pipeline.selector.metrics}
        self._extra = [m for m in self.pipeline.metrics if m.name not in ranked_names]
        # id -> (floor, the ranked metrics' states, position, id): what `_sorted` holds, in the scan's order
        self._key: dict[str, tuple] = {}
        self._sorted: list[tuple] = []
        self._position: dict[str, int] = {}
        for inst in instances:
            self._position[inst.instance_id] = len(self._position)
            self.members[inst.instance_id] = inst
            self._key[inst.instance_id] = key = self._make_key(inst, inst.instance_id)
            self._sorted.append(key)
            self._track_health(inst, inst.instance_id)
        self._sorted.sort()
        # `_sorted`'s floors and ids, in its order: bisected, sliced and intersected in C
        self._floors = [entry[0] for entry in self._sorted]
        self._ids = [entry[3] for entry in self._sorted]
        # the members sorted again by the first metric's floor at each of its prompt levels (base.py,
        # `floor_levels`): a walk of the members without a hit uses the largest at or under the prompt
        self._levels = self._first.floor_levels
        # each member's entries per level, kept so a move finds its old ones without computing them again
        self._level_entries = {key[3]: self._level_keys(key) for key in self._sorted}
        per_member = list(self._level_entries.values())
        self._by_level = [sorted(keys[i] for keys in per_member) for i in range(len(self._levels))]
        self._by_ts.sort()

    def _level_keys(self, key: tuple) -> list[tuple]:
        """The member's entry at each prompt level, in `_levels`' order."""
        rest = key[1:]
        return [(floor, *rest) for floor in self._first.lower_bounds_at(key[1][0])]

    def _make_key(self, inst: InstanceView, instance_id: str) -> tuple:
        state_of = self._state_of
        if len(state_of) == 2:  # the default's (TTFT, TPOT), without a loop: the core re-keys on every change
            states: tuple = (state_of[0](inst), state_of[1](inst))
        else:
            states = tuple([state(inst) for state in state_of])
        return (self._first.lower_bound(states[0]), states, self._position[instance_id], instance_id)

    def _move(self, instance_id: str, old: tuple, key: tuple) -> None:
        """The member's new place, with its floor and id in `_floors`, `_ids` and its entries per prompt level."""
        entries, floors, ids = self._sorted, self._floors, self._ids
        at = bisect.bisect_left(entries, old)
        del entries[at], floors[at], ids[at]
        at = bisect.bisect_right(entries, key)
        entries.insert(at, key)
        floors.insert(at, key[0])
        ids.insert(at, instance_id)
        was_entries = self._level_entries[instance_id]  # `old`'s, as they were made
        new = self._level_entries[instance_id] = self._level_keys(key)
        for level_entries, was, now in zip(self._by_level, was_entries, new, strict=True):
            del level_entries[bisect.bisect_left(level_entries, was)]
            bisect.insort(level_entries, now)

    def run(self, pipeline: Pipeline, req: RequestInfo, count: int) -> list[InstanceView] | None:
        selector = pipeline.selector
        need = max(cast(RankedSelector, selector).top_k, count)
        first = self._first
        # every instance with a hit (some may not be members: the walk never meets those, step 2 skips them)
        hits = first.ctx.prefix_hits(req)
        offset = first.bound_offset(req, 0)
        # a member without a hit computes the whole prompt: the tightest floor is the largest level under it
        entries = self._sorted
        for level, by_level in zip(self._levels, self._by_level, strict=True):
            if level > req.prompt_tokens:
                break
            entries = by_level
        for fallback in (False, True):
            visit = _Visit(self, *self._health_pass(pipeline, fallback), req)
            best = self._walk_misses(visit, hits, need, offset, entries)
            if hits:
                self._visit_hits(visit, hits, need, best)
            cands = visit.cands
            if cands:
                cands.sort()  # by position (each member's own): the scan's order
                return [c.inst for c in selector.select([c for _, c in cands], req, count)]
        return None

    def _values(self, states: tuple, inst: InstanceView, req: RequestInfo, first: float) -> tuple:
        """The ranked metrics' values, the first one given: as the scan computes them."""
        rest = self._rest
        if len(rest) == 1:  # the default's two (TTFT, TPOT), without a loop
            evaluate = rest[0]
            return (first, states[1] if evaluate is None else evaluate(states[1], inst, req))
        later = [s if e is None else e(s, inst, req) for e, s in zip(rest, states[1:], strict=True)]
        return (first, *later)

    def _walk_misses(
        self, visit: _Visit, hits: dict[str, int], need: int, offset: float, entries: list[tuple]
    ) -> list[tuple]:
        """Step 1, over `entries` (the members sorted by a floor valid for this request without a hit); returns
        the best `need` passing members without a hit as (values, position)."""
        members, req = self.members, visit.req
        evaluate = self._first.evaluate
        admit = visit.admit
        # the second ranked metric's evaluate when there are exactly two with a state each (the default's TTFT
        # and TPOT): the values made here, without `_values`, for the members the walk evaluates
        second = self._rest[0] if len(self._rest) == 1 else None
        best: list[tuple] = []
        worst = math.inf  # the `need`-th best first value, once there are `need`
        limit = math.inf  # the same with slack, for the floors
        j, n = 0, len(entries)
        while j < n:
            floor, states, pos, instance_id = entries[j]
            if floor + offset > limit:
                break
            j += 1
            if instance_id in hits:
                continue
            inst = members[instance_id]
            first = evaluate(states[0], inst, req)
            if first <= worst:
                if second is not None:
                    values = (first, second(states[1], inst, req))
                else:
                    values = self._values(states, inst, req, first)
                if len(best) < need or (values, pos) < best[-1]:
                    if not admit(inst, instance_id, pos, values):
                        continue
                    bisect.insort(best, (values, pos))
                    if len(best) > need:
                        best.pop()
                    if len(best) >= need:
                        worst = best[-1][0][0]
                        limit = worst + abs(worst) * _BOUND_REL_SLACK + _BOUND_ABS_SLACK
                    continue
            # outranked by the `need` best: so are the members with the same states after it (same values,
            # later in the stable order), skipped at once
            j = max(j, bisect.bisect_left(entries, (floor, states, math.inf)))
        return best

    def _visit_hits(self, visit: _Visit, hits: dict[str, int], need: int, best: list[tuple]) -> None:
        """Step 2: the members with a hit, by their floor, while one can still matter."""
        first, key, members, req = self._first, self._key, self.members, visit.req
        selector = self.pipeline.selector
        banded = selector.index_walk is IndexWalk.BANDED
        band_limit = cast(BandedSelector, selector).band_limit if banded else None
        # a ranked selector with a cache head ranks every hit before every miss: all of them matter
        prune = banded or self._head is None
        # the first values of the passing candidates, the `need` least so far (the `need`-th best: the last)
        firsts = [values[0] for values, _ in best]
        least = firsts[0] if firsts else math.inf
        threshold = math.inf
        if prune and len(firsts) >= need:
            threshold = firsts[need - 1]
            if band_limit is not None:
                threshold = max(threshold, band_limit(least))
        # the threshold only falls as hits are visited: a floor above it now is above it for good
        cut = threshold + abs(threshold) * _BOUND_REL_SLACK + _BOUND_ABS_SLACK
        # per distinct hit, as the prefix index counts them (not a pass over the hits)
        offsets = {hit: first.bound_offset(req, hit) for hit in first.ctx.prefix_hit_lengths(req)}
        # a hit's own part is the prompt past it: its floor is the member's at the largest prompt level under
        # that (as the walk's for a whole prompt), where the metric charges what grows with the prompt (a
        # stall per decoding request) that much tighter; under the first level (a prompt all cached too: its own
        # part is one token), the member's key
        levels = self._levels
        at_level = {hit: bisect.bisect_right(levels, req.prompt_tokens - hit) - 1 for hit in offsets}
        # a hit is visited when key + offset(its hit) <= cut: only members keyed up to cut - the least offset
        # can be. A widespread prefix has many holders and a few of them in reach: then the members in key
        # order up to there are fewer to look at than the hits (a bisect tells how many)
        entries = self._sorted
        reach = len(entries)
        if cut < math.inf:
            reach = bisect.bisect_right(self._floors, cut - min(offsets.values()))
        floors: Iterable[tuple[float, str]]
        if len(hits) * _LAZY_HOLDER_SHARE >= len(entries):
            # a prefix most members hold (a shared system prompt): walked in each hit level's floor order, lazily,
            # since the visit below stops after a few; gathering every holder's floor first cost more than the
            # rest of the decision (full mode, 256 engines, 64 prefixes all held everywhere)
            floors = self._holders_by_floor(hits, offsets, at_level, cut)
        else:
            floors = self._gathered_floors(hits, offsets, at_level, cut, reach)
        evaluate, admit = first.evaluate, visit.admit
        # a banded selector's band, once no member left can be below the least value (the hits come by floor):
        # the in-band candidates' (signed cache value, load) and their hits
        head = self._head if band_limit is not None else None
        # the cache metric's sign (a property: read once, not per hit)
        head_sign = head.sign if head is not None else 1.0
        band: list[tuple[float, float]] | None = None
        told: set[int] = set()
        limit = math.inf
        for floor, instance_id in floors:
            if floor > cut:
                break
            inst = members[instance_id]
            if head is not None and floor - abs(floor) * _BOUND_REL_SLACK - _BOUND_ABS_SLACK >= least:
                if band is None:
                    assert band_limit is not None
                    limit = band_limit(least)
                    band, told = self._band(visit, hits, head, limit)
                # the hits tell the band apart already, and `need` in-band candidates outrank this one whatever
                # its load (its value is at least its floor): it cannot change the selector's answer
                if len(told) > 1 and len(band) >= need:
                    low = floor - abs(floor) * _BOUND_REL_SLACK - _BOUND_ABS_SLACK
                    if band[need - 1] < (head.value(inst, req) * head_sign, low):
                        continue
            _, states, pos, _ = key[instance_id]
            value = evaluate(states[0], inst, req)
            if value > threshold:
                continue  # past the band and the `need` best: it cannot matter
            if not admit(inst, instance_id, pos, self._values(states, inst, req, value)):
                continue
            bisect.insort(firsts, value)
            if value < least:
                least = value
                band = None  # (a floor a hair above its value) the band is made again from the new least
            elif band is not None and value <= limit:
                assert head is not None
                bisect.insort(band, (visit.cands[-1][1].values[head.name] * head_sign, value))
                told.add(hits.get(instance_id, 0))
            if prune and len(firsts) >= need:
                threshold = firsts[need - 1]
                if band_limit is not None:
                    threshold = max(threshold, band_limit(least))
                cut = threshold + abs(threshold) * _BOUND_REL_SLACK + _BOUND_ABS_SLACK

    def _gathered_floors(
        self, hits: dict[str, int], offsets: dict[int, float], at_level: dict[int, int], cut: float, reach: int
    ) -> list[tuple[float, str]]:
        """(floor, id) of each member with a hit whose floor is within the cut, sorted: a hit's floor is the
        member's entry at `at_level[hit]` (its key under the first level) plus the hit's offset."""
        key, level_entries = self._key, self._level_entries
        if reach < len(hits):
            # the members in reach that hold the prefix, found in C (a widespread prefix: half of them or more)
            near = hits.keys() & set(itertools.islice(self._ids, reach))
            held: Iterable[tuple[str, int]] = ((i, hits[i]) for i in near)
        else:
            held = ((i, hit) for i, hit in hits.items() if i in key)
        floors = [
            (floor, i)
            for i, hit in held
            if (floor := (key[i][0] if (li := at_level[hit]) < 0 else level_entries[i][li][0]) + offsets[hit]) <= cut
        ]
        floors.sort()
        return floors

    def _holders_by_floor(
        self, hits: dict[str, int], offsets: dict[int, float], at_level: dict[int, int], cut: float
    ) -> Iterator[tuple[float, str]]:
        """The same (floor, id) pairs as `_gathered_floors`, in the same order, made as they are taken: the
        members walked in each hit level's order (their keys under the first level), merged over the levels."""
        by_level: dict[int, dict[int, float]] = {}
        for hit, offset in offsets.items():
            by_level.setdefault(at_level[hit], {})[hit] = offset
        walks = [
            self._holders_at(self._sorted if li < 0 else self._by_level[li], hits, offsets_here, cut)
            for li, offsets_here in by_level.items()
        ]
        return walks[0] if len(walks) == 1 else heapq.merge(*walks)

    @staticmethod
    def _holders_at(
        entries: list[tuple], hits: dict[str, int], offsets: dict[int, float], cut: float
    ) -> Iterator[tuple[float, str]]:
        """The members holding one of these hits (length -> offset), by floor (entry + its hit's offset): walked in
        entry order, each held back until no member not yet walked can come before it."""
        get, least = hits.get, min(offsets.values())
        waiting: list[tuple[float, str]] = []
        for entry in entries:
            low = entry[0] + least  # no member from here on has a floor under this
            if low > cut:
                break
            while waiting and waiting[0][0] <= low:
                yield heapq.heappop(waiting)
            instance_id = entry[3]
            offset = offsets.get(get(instance_id, -1))
            if offset is not None and (floor := entry[0] + offset) <= cut:
                heapq.heappush(waiting, (floor, instance_id))
        while waiting:
            yield heapq.heappop(waiting)

    def _band(
        self, visit: _Visit, hits: dict[str, int], head: Metric, limit: float
    ) -> tuple[list[tuple[float, float]], set[int]]:
        """The in-band candidates visited so far (load <= limit): their (signed cache value, load), sorted as the
        banded selector ranks them, and their hits (0 for none), as it tells the band apart."""
        band, told = [], set()
        name, sign, load = head.name, head.sign, self._first.name
        for _, cand in visit.cands:
            value = cand.values[load]
            if value <= limit:
                band.append((cand.values[name] * sign, value))
                told.add(hits.get(cand.inst.endpoint.instance_id, 0))
        band.sort()
        return band, told


def _request_free(metric: Metric) -> Callable[[InstanceView], float]:
    """A ranked metric without a state: its value on a request-free request is what the index keeps."""

    def value(inst: InstanceView) -> float:
        return metric.value(inst, _KEY_REQUEST)

    return value


class _Visit:
    """One pass's visits of a BoundedLoadIndex: the pass's filters run on each member visited (the marking
    ones answered by the index's health sets), and the candidates that pass kept with their positions."""

    __slots__ = ("bad", "blockers", "cands", "checks", "extra", "filters", "head", "names", "req")

    def __init__(
        self,
        index: BoundedLoadIndex,
        filters: list[InstanceFilter],
        bad: AbstractSet[str],
        blockers: list[Blocker],
        req: RequestInfo,
    ) -> None:
        self.filters, self.bad, self.blockers, self.req = filters, bad, blockers, req
        self.head, self.names, self.extra = index._head, index._names, index._extra
        # whether `_candidate` has anything to do beyond making the Candidate
        self.checks = bool(self.extra or filters or blockers)
        self.cands: list[tuple[int, Candidate]] = []

    def admit(self, inst: InstanceView, instance_id: str, position: int, values: tuple) -> bool:
        """Keep the member when it passes, its Candidate holding every metric the pipeline names."""
        if instance_id in self.bad:
            return False
        req = self.req
        names = self.names
        if len(names) == 2:  # the default's (TTFT, TPOT): a literal, not a zip per candidate
            named = {names[0]: values[0], names[1]: values[1]}
        else:
            named = dict(zip(names, values, strict=True))
        head = self.head
        if head is not None:
            named[head.name] = head.value(inst, req)
        if self.checks:
            cand = _candidate(inst, named, self.extra, self.filters, self.blockers, req)
            if cand is None:
                return False
        else:  # no other metric, filter or blocker (the default policy's usual pass): nothing can fail it
            cand = Candidate(inst, named)
        self.cands.append((position, cand))
        return True
