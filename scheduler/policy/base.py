"""The policy contracts: Metric, Filter, Selector, and the Pipeline and Policy that run them.

A decision runs metrics -> filters -> selector over the candidate instances of one infer type:
every metric a stage names is computed once per candidate, single-instance filters run, then
global filters; if nothing passes, a fallback pass runs again with only the filters marked
`not_skip_when_fallback`. The selector ranks what is left: the chosen instance first, then
the next-best ones (the gateway's fallbacks).

Two ways to run a pipeline, with the same result (tests/unit/test_scheduler_index.py):

- **scan**: compute every metric for every candidate, filter, rank. Works for any stage.
- **indexed**: when the selector ranks by metrics that depend only on instance state (not on
  the request or the clock), a `LoadIndex` keeps the candidates sorted by those metrics,
  re-keyed only when an instance changes; a decision walks it from the best end and stops
  once enough candidates pass the filters. A decision then costs O(visited), not O(n).

A stage carries what the rest of the scheduler needs to know about it, as class attributes and
small methods, so neither the index nor the core nor the registry names a stage: a metric says
whether it works in lite mode, reads the prefix cache, can be indexed (and, a cache metric, what it
is on an instance without a hit); a filter whether it marks failover and how an index answers it;
a selector which walk of the index serves it (`IndexWalk`, with the `RankedSelector` or
`BandedSelector` contract). README.md beside this module lists them.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar

from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.context import PolicyContext, default_context
from pilotfish.scheduler.view.types import InferType, InstanceView, RequestInfo

if TYPE_CHECKING:
    from pilotfish.scheduler.policy.index import LoadIndex

T = TypeVar("T")
# how a forward-predicted metric moves with the clock: (value at the status's time, floor it never
# falls below, units per second, status time in s)
Drain = tuple[float, float, float, float]


@dataclass(frozen=True, slots=True)
class MissValue:
    """A cache-locality metric on an instance that holds none of the request's prefix: `base`'s value
    (0 when None) plus `offset(req)`. The same for every such instance but through `base`, so a load
    index keys them by `base` and visits only the instances with a hit apart."""

    base: Metric | None
    offset: Callable[[RequestInfo], float]


class ExportedFamily(NamedTuple):
    """How the scheduler exports a metric's per-engine value: its own Prometheus family (so no family
    mixes units), the scale from the metric's unit to the family's, and the family's help."""

    family: str
    scale: float
    help: str


class Metric(abc.ABC):
    """One number per (instance, request); the registry key is `name`.

    One comparison interface for every metric: `get_value` (GetValue), `value_less` (ValueLess:
    is a strictly better than b) and `less` (Less: is instance a strictly better than b).
    """

    name: ClassVar[str]
    lower_is_better: ClassVar[bool] = True
    # computable from LRS alone; full-mode metrics (CMS status, prediction) set this False
    lite: ClassVar[bool] = False
    # the value depends only on instance state whose changes are notified (LRS, status,
    # in-flight account) — not on the request or the clock — so a LoadIndex may order by it
    indexable: bool = True
    # ranks by where the request's prefix is cached (the prefix index), so a cache_aware selector
    # may put it first; the core keeps a prefix index for a policy that reads one
    cache_locality: ClassVar[bool] = False
    # reads the prefix index (ctx.prefix_hits): the core keeps one for a policy with such a metric;
    # every cache_locality metric does
    uses_prefix_cache: ClassVar[bool] = False
    # reads the LRS (the request counts the scheduler keeps itself) in full mode too. False: in full
    # mode the value reads only the CMS status, the in-flight account and the prefix index, so the
    # core re-keys no index when only the LRS changed (a Release, a Report) and no metric reads it
    lrs_in_full_mode: ClassVar[bool] = True
    # the value moves with the clock between two changes of an instance, as `drain` says: a
    # PredictedLoadIndex orders it by drain time
    forward_predicted: bool = False
    # (abs, rel): as the cache_aware selector's load metric, a value within
    # max(least + abs, least * rel) of the least loaded instance counts as balanced, so a prefix
    # hit may pick among such instances; (0, 1): only instances as loaded as the least
    balance_band: ClassVar[tuple[float, float]] = (0.0, 1.0)
    # the value is `evaluate(state(inst), inst, req)`, `state` depending only on notified instance state
    # (as `indexable` asks of the whole value): a load index keeps it per member, re-made when the member
    # changes, and a decision adds the request's part (BoundedLoadIndex)
    instance_state: bool = False
    # instance_state, and `lower_bound` + `bound_offset` put a floor under the value: a load index walks
    # the members by the floor when the metric ranks first
    has_floor: ClassVar[bool] = False
    # its Prometheus family on the scheduler's /metrics; None: pilotfish_scheduler_policy_<name>, unscaled
    exported: ClassVar[ExportedFamily | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.cache_locality and not cls.uses_prefix_cache:
            raise TypeError(f"{cls.__name__}: a cache_locality metric reads the prefix index (uses_prefix_cache)")

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        self.ctx = ctx if ctx is not None else default_context()

    @abc.abstractmethod
    def value(self, inst: InstanceView, req: RequestInfo) -> float: ...

    def miss_value(self) -> MissValue | None:
        """A cache-locality metric a load index can serve: its value on an instance without a hit.
        None (the default): an index does not rank by it (the pipeline scans)."""
        return None

    def state(self, inst: InstanceView) -> Any:
        """instance_state: what the value reads of the instance, request aside."""
        raise NotImplementedError(f"metric {self.name!r} has no instance state")

    def evaluate(self, state: Any, inst: InstanceView, req: RequestInfo) -> float:
        """instance_state: `value(inst, req)` from `state(inst)`, with the same float operations."""
        raise NotImplementedError(f"metric {self.name!r} has no instance state")

    def lower_bound(self, state: Any) -> float:
        """instance_state: with `bound_offset`, a floor under the value: for every request, value >=
        lower_bound(state) + bound_offset(req, hit) on an instance whose cached prefix for it is `hit`.
        -inf (the default): no floor, a load index visits every member."""
        return -math.inf

    def bound_offset(self, req: RequestInfo, hit: int) -> float:
        """The request's part of `lower_bound`'s floor; -inf where no floor holds."""
        return -math.inf

    # has_floor: prompt sizes at which `lower_bound_at` gives a tighter floor than `lower_bound`, ascending;
    # a load index keeps its members sorted by each, and walks a request without a hit by the largest at or
    # under its prompt (for a floor with a request-by-instance product, as predicted_delay's)
    floor_levels: ClassVar[tuple[int, ...]] = ()

    def lower_bound_at(self, state: Any, own_at_least: int) -> float:
        """has_floor: `lower_bound` for a request whose uncached prompt is at least `own_at_least` tokens:
        value >= lower_bound_at(state, n) + bound_offset(req, hit) wherever that prompt is n tokens or more."""
        return self.lower_bound(state)

    def lower_bounds_at(self, state: Any) -> list[float]:
        """`lower_bound_at` at every one of `floor_levels`, in their order (a load index re-keys a member at
        all of them on every change, so a metric may share the work between levels)."""
        return [self.lower_bound_at(state, level) for level in self.floor_levels]

    def drain(self, inst: InstanceView) -> Drain | None:
        """forward_predicted: how `value` moves with the clock until `inst` changes; None while it does not move."""
        return None

    def get_value(self, inst: InstanceView, req: RequestInfo) -> float:
        return self.value(inst, req)

    @property
    def sign(self) -> float:
        """Multiplier that makes the better value the smaller one, whatever the direction."""
        return 1.0 if self.lower_is_better else -1.0

    def sort_key(self, value: float) -> float:
        """Ascending key: the better value sorts first."""
        return value * self.sign

    def better(self, a: float, b: float) -> bool:
        """ValueLess: is `a` strictly better than `b`."""
        return self.sort_key(a) < self.sort_key(b)

    def value_less(self, a: float, b: float) -> bool:
        return self.better(a, b)

    def less(self, a: InstanceView, b: InstanceView, req: RequestInfo) -> bool:
        return self.better(self.value(a, req), self.value(b, req))


@dataclass(slots=True, eq=False)
class Candidate:
    """An instance during one decision, with the metric values computed for it."""

    inst: InstanceView
    values: dict[str, float] = field(default_factory=dict)
    # set by single-instance filters for the failure-domain (global) filters to read
    needs_failover: bool = False


class Filter(abc.ABC):
    """Removes unsuitable candidates; subclass InstanceFilter or GlobalFilter."""

    name: ClassVar[str]

    def __init__(self, *, not_skip_when_fallback: bool = False) -> None:
        # a filter that guards correctness (schedulability) keeps running in the fallback pass;
        # one that only shapes load (a threshold) is skipped there
        self.not_skip_when_fallback = not_skip_when_fallback

    @property
    def metrics(self) -> Sequence[Metric]:
        """Metrics this filter reads from Candidate.values."""
        return ()

    def describe(self) -> str:
        """Short text for the reason in an UNAVAILABLE answer."""
        return self.name

    def spec(self) -> dict[str, Any]:
        """The stage as a YAML policy would write it (equal specs mean equal stages)."""
        return {"name": self.name, "not_skip_when_fallback": self.not_skip_when_fallback, **self.params()}

    def params(self) -> dict[str, Any]:
        return {}


class InstanceHealth(Protocol):
    """What a load index keeps of its members' statuses, kept current as they change."""

    def without_status(self) -> AbstractSet[str]:
        """Ids of the members with no status yet."""
        ...

    def unschedulable(self) -> AbstractSet[str]:
        """Ids of the members whose status says not schedulable."""
        ...

    def stamped_before(self, cutoff_ms: float) -> AbstractSet[str]:
        """Ids of the members whose status is stamped before `cutoff_ms`."""
        ...


class Blocker(Protocol):
    def blocks(self, inst: InstanceView) -> bool: ...


class InstanceFilter(Filter):
    """Judges each candidate alone.

    `marks_failover`: a candidate it blocks is unhealthy, and the failover filter blocks its
    whole failure domain.

    `health_indexed`: a load index answers it for all its members at once with `blocked_in`, from
    the health it keeps (a marks_failover filter must, for an indexed pipeline: the failover
    filters need every marked instance, not only those a walk visits). Other filters run
    `passes` on the instances the walk visits.
    """

    marks_failover: ClassVar[bool] = False
    health_indexed: ClassVar[bool] = False

    @abc.abstractmethod
    def passes(self, cand: Candidate, req: RequestInfo) -> bool: ...

    def blocked_in(self, health: InstanceHealth) -> AbstractSet[str]:
        """health_indexed: the ids of the members `passes` would block, at this decision."""
        raise NotImplementedError(f"filter {self.name!r} is not answered from an index's health")


class GlobalFilter(Filter):
    """Judges the candidates together (failure domains); runs after every InstanceFilter.

    `cands` are the survivors so far; `marked` are the candidates single-instance filters of
    this pass blocked as unhealthy (needs_failover), which the survivors may share a domain with;
    `population` is every candidate of the decision (domains span filtered-out instances too).

    `indexable`: the filter keeps every candidate when nothing is marked, and otherwise exactly the
    candidates `blocker(marked, population)` does not block, so a load index applies it to the
    instances it visits.
    """

    indexable: ClassVar[bool] = False

    def blocker(self, marked: Iterable[InstanceView], population: Iterable[InstanceView]) -> Blocker:
        """indexable: what the filter blocks, given the marked instances and every candidate."""
        raise NotImplementedError(f"filter {self.name!r} is not answered by a blocker")

    @abc.abstractmethod
    def apply(
        self,
        cands: list[Candidate],
        req: RequestInfo,
        marked: Sequence[Candidate],
        population: Sequence[Candidate],
    ) -> list[Candidate]: ...


class IndexWalk(enum.Enum):
    """How a load index serves a selector (`Selector.index_walk`)."""

    NONE = "none"  # it does not: the pipeline scans every candidate
    RANKED = "ranked"  # the RankedSelector contract
    BANDED = "banded"  # the BandedSelector contract


class RankedSelector(Protocol):
    """Answers `pick` over the best max(top_k, count) candidates ranked by `metrics` in order (ties by
    the stable order): a load index walks its members by those metrics and picks the same way. The
    first metric may be a cache-locality one with a `miss_value`."""

    top_k: int

    @property
    def metrics(self) -> Sequence[Metric]: ...

    def pick(self, ranked: list[T], count: int) -> list[T]: ...


class BandedSelector(Protocol):
    """`metrics` = [cache metric, load metrics...]: when the prefix index tells the candidates whose
    first load metric is within `band_limit(least)` apart, those rank by all the metrics and `load_ranking`
    picks among them; otherwise `load_ranking`'s answer over the load metrics. The cache metric has a
    `miss_value` whose base, if any, is the first load metric."""

    top_k: int
    load_ranking: RankedSelector

    @property
    def metrics(self) -> Sequence[Metric]: ...

    def band_limit(self, least: float) -> float: ...


class Selector(abc.ABC):
    name: ClassVar[str]
    index_walk: ClassVar[IndexWalk] = IndexWalk.NONE

    @property
    def metrics(self) -> Sequence[Metric]:
        return ()

    @abc.abstractmethod
    def select(self, cands: Sequence[Candidate], req: RequestInfo, count: int) -> list[Candidate]:
        """Up to `count` candidates: the chosen one first, then the next-best in order.

        `cands` is non-empty and in a stable order (by instance id), which breaks ties.
        """

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, **self.params()}

    def params(self) -> dict[str, Any]:
        return {}


class Pipeline:
    """Metrics, filters and selector for one infer type."""

    def __init__(self, filters: Sequence[Filter], selector: Selector) -> None:
        self.filters = list(filters)
        self.instance_filters = [f for f in filters if isinstance(f, InstanceFilter)]
        self.global_filters = [f for f in filters if isinstance(f, GlobalFilter)]
        self.selector = selector
        named: dict[str, Metric] = {}
        for stage in (*filters, selector):
            for metric in stage.metrics:
                named.setdefault(metric.name, metric)
        self.metrics = list(named.values())
        from pilotfish.scheduler.policy.index import indexable_pipeline

        self.indexable = indexable_pipeline(self)

    def spec(self) -> dict[str, Any]:
        return {"filters": [f.spec() for f in self.filters], "selector": self.selector.spec()}

    def run(
        self,
        instances: Sequence[InstanceView],
        req: RequestInfo,
        count: int,
        index: LoadIndex | None = None,
    ) -> list[InstanceView]:
        if not instances:
            raise NoSchedulableInstanceError(f"no instance serves model {req.model!r}")
        if index is not None:
            ranked = index.run(self, req, count)
            if ranked is not None:
                return ranked
        if len(self.metrics) == 1:  # the common case, without a dict comprehension per instance
            name, value = self.metrics[0].name, self.metrics[0].value
            cands = [Candidate(inst, {name: value(inst, req)}) for inst in instances]
        else:
            cands = [Candidate(inst, {m.name: m.value(inst, req) for m in self.metrics}) for inst in instances]
        passed, blocked = self._filter(cands, req, fallback=False)
        if not passed:
            passed, blocked = self._filter(cands, req, fallback=True)
        if not passed:
            raise self.nothing_passed(len(cands), req, blocked)
        return [c.inst for c in self.selector.select(passed, req, count)]

    @staticmethod
    def nothing_passed(n: int, req: RequestInfo, blocked: Mapping[str, int]) -> NoSchedulableInstanceError:
        why = ", ".join(f"{name}: {k}" for name, k in blocked.items())
        return NoSchedulableInstanceError(f"all {n} instances serving {req.model!r} are filtered out ({why})")

    def _filter(
        self, cands: list[Candidate], req: RequestInfo, *, fallback: bool
    ) -> tuple[list[Candidate], dict[str, int]]:
        blocked: dict[str, int] = {}
        marked: list[Candidate] = []
        population = cands
        for c in cands:
            c.needs_failover = False
        for flt in self.instance_filters:
            if fallback and not flt.not_skip_when_fallback:
                continue
            if flt.marks_failover:
                kept = []
                for c in cands:
                    if flt.passes(c, req):
                        kept.append(c)
                    else:
                        c.needs_failover = True
                        marked.append(c)
            else:
                kept = [c for c in cands if flt.passes(c, req)]
            if len(kept) < len(cands):
                blocked[flt.describe()] = len(cands) - len(kept)
            cands = kept
        for gflt in self.global_filters:
            if fallback and not gflt.not_skip_when_fallback:
                continue
            kept = gflt.apply(cands, req, marked, population)
            if len(kept) < len(cands):
                blocked[gflt.describe()] = len(cands) - len(kept)
            cands = kept
        return cands, blocked


@dataclass(frozen=True, slots=True)
class Selection:
    target: InstanceView
    fallbacks: tuple[InstanceView, ...] = ()
    # prefill/decode disaggregation: where decode continues
    decode_target: InstanceView | None = None


class Policy:
    """A named set of pipelines, one per infer type."""

    def __init__(self, name: str, pipelines: Mapping[InferType, Pipeline], ctx: PolicyContext | None = None) -> None:
        self.name = name
        self.pipelines = dict(pipelines)
        self.ctx = ctx if ctx is not None else default_context()

    def spec(self) -> dict[str, Any]:
        return {t.name.lower(): p.spec() for t, p in sorted(self.pipelines.items())}

    def schedule(self, instances: Sequence[InstanceView], req: RequestInfo, fallback_count: int) -> Selection:
        """Neutral pipeline over `instances` (the lite path and the tests' entry point)."""
        self.ctx.begin(req)
        pipeline = self.pipelines[InferType.NEUTRAL]
        ranked = pipeline.run(instances, req, 1 + fallback_count)
        return Selection(ranked[0], tuple(ranked[1:]))
