"""The policy contracts: Metric, Filter, Selector, and the Policy that runs them.

A decision runs metrics -> filters -> selector over the candidate instances of one infer type:
every metric a stage names is computed once per candidate, single-instance filters run, then
global filters; if nothing passes, a fallback pass runs again with only the filters marked
`not_skip_when_fallback`. The selector ranks what is left: the chosen instance first, then
the next-best ones (the gateway's fallbacks).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pilotfish.scheduler.errors import NoSchedulableInstanceError
from pilotfish.scheduler.view.types import InferType, InstanceView, RequestInfo


class Metric(abc.ABC):
    """One number per (instance, request); the registry key is `name` (the spec's constant)."""

    name: ClassVar[str]
    lower_is_better: ClassVar[bool] = True
    # computable from LRS alone; full-mode metrics (CMS status, prediction) set this False
    lite: ClassVar[bool] = False

    @abc.abstractmethod
    def value(self, inst: InstanceView, req: RequestInfo) -> float: ...

    @property
    def sign(self) -> float:
        """Multiplier that makes the better value the smaller one, whatever the direction."""
        return 1.0 if self.lower_is_better else -1.0

    def sort_key(self, value: float) -> float:
        """Ascending key: the better value sorts first."""
        return value * self.sign

    def better(self, a: float, b: float) -> bool:
        """The spec's ValueLess: is `a` strictly better than `b`."""
        return self.sort_key(a) < self.sort_key(b)


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


class InstanceFilter(Filter):
    """Judges each candidate alone."""

    @abc.abstractmethod
    def passes(self, cand: Candidate, req: RequestInfo) -> bool: ...


class GlobalFilter(Filter):
    """Judges the candidates together (failure domains); runs after every InstanceFilter."""

    @abc.abstractmethod
    def apply(self, cands: list[Candidate], req: RequestInfo) -> list[Candidate]: ...


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


class Pipeline:
    """Metrics, filters and selector for one infer type."""

    def __init__(self, filters: Sequence[Filter], selector: Selector) -> None:
        self.instance_filters = [f for f in filters if isinstance(f, InstanceFilter)]
        self.global_filters = [f for f in filters if isinstance(f, GlobalFilter)]
        self.selector = selector
        named: dict[str, Metric] = {}
        for stage in (*filters, selector):
            for metric in stage.metrics:
                named.setdefault(metric.name, metric)
        self.metrics = list(named.values())

    def run(self, instances: Sequence[InstanceView], req: RequestInfo, count: int) -> list[InstanceView]:
        if not instances:
            raise NoSchedulableInstanceError(f"no instance serves model {req.model!r}")
        if len(self.metrics) == 1:  # the common case, without a dict comprehension per instance
            name, value = self.metrics[0].name, self.metrics[0].value
            cands = [Candidate(inst, {name: value(inst, req)}) for inst in instances]
        else:
            cands = [Candidate(inst, {m.name: m.value(inst, req) for m in self.metrics}) for inst in instances]
        passed, blocked = self._filter(cands, req, fallback=False)
        if not passed:
            passed, blocked = self._filter(cands, req, fallback=True)
        if not passed:
            why = ", ".join(f"{name}: {n}" for name, n in blocked.items())
            raise NoSchedulableInstanceError(
                f"all {len(cands)} instances serving {req.model!r} are filtered out ({why})"
            )
        return [c.inst for c in self.selector.select(passed, req, count)]

    def _filter(
        self, cands: list[Candidate], req: RequestInfo, *, fallback: bool
    ) -> tuple[list[Candidate], dict[str, int]]:
        blocked: dict[str, int] = {}
        for flt in self.instance_filters:
            if fallback and not flt.not_skip_when_fallback:
                continue
            kept = [c for c in cands if flt.passes(c, req)]
            if len(kept) < len(cands):
                blocked[flt.describe()] = len(cands) - len(kept)
            cands = kept
        for gflt in self.global_filters:
            if fallback and not gflt.not_skip_when_fallback:
                continue
            kept = gflt.apply(cands, req)
            if len(kept) < len(cands):
                blocked[gflt.describe()] = len(cands) - len(kept)
            cands = kept
        return cands, blocked


@dataclass(frozen=True, slots=True)
class Selection:
    target: InstanceView
    fallbacks: tuple[InstanceView, ...] = ()
    # prefill/decode disaggregation: where decode continues (unused until PD policies exist)
    decode_target: InstanceView | None = None


class Policy:
    """A named set of pipelines, one per infer type (neutral only until PD disaggregation)."""

    def __init__(self, name: str, pipelines: Mapping[InferType, Pipeline]) -> None:
        self.name = name
        self.pipelines = dict(pipelines)

    def schedule(self, instances: Sequence[InstanceView], req: RequestInfo, fallback_count: int) -> Selection:
        pipeline = self.pipelines[InferType.NEUTRAL]
        ranked = pipeline.run(instances, req, 1 + fallback_count)
        return Selection(ranked[0], tuple(ranked[1:]))
