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
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.policy.context import PolicyContext, default_context
from pilotfish.scheduler.view.types import InferType, InstanceView, RequestInfo

if TYPE_CHECKING:
    from pilotfish.scheduler.policy.index import LoadIndex


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
    # (abs, rel): as the cache_aware selector's load metric, a value within
    # max(least + abs, least * rel) of the least loaded instance counts as balanced, so a prefix
    # hit may pick among such instances; (0, 1): only instances as loaded as the least
    balance_band: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        self.ctx = ctx if ctx is not None else default_context()

    @abc.abstractmethod
    def value(self, inst: InstanceView, req: RequestInfo) -> float: ...

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


class InstanceFilter(Filter):
    """Judges each candidate alone.

    `marks_failover`: a candidate it blocks is unhealthy, and the failover filter blocks its
    whole failure domain.
    """

    marks_failover: ClassVar[bool] = False

    @abc.abstractmethod
    def passes(self, cand: Candidate, req: RequestInfo) -> bool: ...


class GlobalFilter(Filter):
    """Judges the candidates together (failure domains); runs after every InstanceFilter.

    `cands` are the survivors so far; `marked` are the candidates single-instance filters of
    this pass blocked as unhealthy (needs_failover), which the survivors may share a domain with;
    `population` is every candidate of the decision (domains span filtered-out instances too).
    """

    @abc.abstractmethod
    def apply(
        self,
        cands: list[Candidate],
        req: RequestInfo,
        marked: Sequence[Candidate],
        population: Sequence[Candidate],
    ) -> list[Candidate]: ...


class Selector(abc.ABC):
    name: ClassVar[str]

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
