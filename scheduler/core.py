"""The scheduling core: synchronous, with no I/O, usable in-process by a colocated gateway.

`schedule` picks an instance with the policy and raises its load at once (dispatch is a load
change, so back-to-back decisions spread); `report` applies streamed token progress; `release`
drops the request and its load. State is updated incrementally; no decision copies a snapshot.

Lite mode: instances from --instances, load from the LRS. Full mode: instances and load from
the CMS (`apply_metadata` / `apply_status`, fed by cms.reader), plus the in-flight account
(view/account.py) and forward prediction (view/predictor.py); the LRS still holds each
request's decision for retries and Release.

Engine health (health.py): the gateway's Release reasons and served-elsewhere reports, and the
service's health probes, eject engines; an ejected engine is no candidate for any policy (unless
every engine of the model is ejected), so no pipeline needs a stage for it.

Not thread-safe: one owner (an event loop) calls it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from prometheus_client import CollectorRegistry

from pilotfish.discovery.static import in_subset
from pilotfish.protos import cms_pb2, scheduler_pb2
from pilotfish.scheduler import config as scheduler_config
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NoSchedulableInstanceError,
    UnknownModelError,
)
from pilotfish.scheduler.health import EngineHealth
from pilotfish.scheduler.policy.base import Pipeline, Policy
from pilotfish.scheduler.policy.index import LoadIndex, load_index
from pilotfish.scheduler.policy.metrics.latency import PredictedTtft
from pilotfish.scheduler.policy.registry import build_policy, context_from_config
from pilotfish.scheduler.swallowing import SwallowingWatch
from pilotfish.scheduler.telemetry import Telemetry
from pilotfish.scheduler.view.account import InflightAccount
from pilotfish.scheduler.view.cms_view import CmsTrust, CmsView
from pilotfish.scheduler.view.lrs import LocalRealtimeState, RequestEntry
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.speed import EngineSpeeds
from pilotfish.scheduler.view.types import Endpoint, InferType, InstanceView, LrsLoad, RequestInfo

log = logging.getLogger(__name__)

# below this many candidates a scan is as fast as keeping an index up to date
INDEX_MIN_INSTANCES = 16
_ENGINE_FAILURES = (scheduler_pb2.RELEASE_REASON_UPSTREAM_ERROR, scheduler_pb2.RELEASE_REASON_UPSTREAM_RESET)


@dataclass(frozen=True, slots=True)
class Decision:
    target: Endpoint
    fallbacks: tuple[Endpoint, ...] = ()
    # prefill/decode disaggregation only: where decode continues
    decode_target: Endpoint | None = None


@dataclass(slots=True, eq=False)
class _Stage:
    """The candidates of one model and infer type, in instance-id order, and their index."""

    instances: list[InstanceView]
    pipeline: Pipeline | None
    index: LoadIndex | None = None


@dataclass(slots=True, eq=False)
class _ModelGroups:
    stages: dict[InferType, _Stage] = field(default_factory=dict)


class SchedulerCore:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        static = scheduler_config.validate(config)
        self.config = config
        self.full_mode = config.enable_full_mode_scheduling
        self.ctx = context_from_config(config, wall_clock=wall_clock)
        self._policy = build_policy(config, rng, self.ctx)
        # each metric says what it reads: a prefix index only for a policy whose metrics read one
        metrics = [m for p in self._policy.pipelines.values() for m in p.metrics]
        reads_prefixes = any(m.uses_prefix_cache for m in metrics)
        self.prefix_index: PrefixIndex | None = None
        if reads_prefixes or config.enable_cache_aware_scheduling:
            self.prefix_index = self.ctx.prefix_index = PrefixIndex(config.prefix_index_capacity_blocks)
        self._dirty: set[str] = set()
        # the LRS's changes re-key an index only where a metric reads the LRS (every lite metric; in
        # full mode those that say so): a full-mode default re-keyed an instance for each Release
        reads_lrs = not self.full_mode or any(m.lrs_in_full_mode for m in metrics)
        # engines slower than the fleet (view/speed.py): lite mode learns it from the first tokens' times, full
        # mode from each engine's step durations (CmsView tells it)
        profile = self.ctx.tables.profile
        self.speeds = EngineSpeeds(
            config.slow_engine_ratio if self.full_mode else config.slow_engine_ratio_lite,
            self._changed,
            profile,
            allowance_ms=10 * profile.base_ms,
        )
        self._lrs = LocalRealtimeState(
            config.request_local_account_staleness_seconds,
            clock,
            on_change=self._mark if reads_lrs else None,
            count_releases=not self.full_mode,  # full mode counts answers from the engines' records
            on_first_token=None if self.full_mode else self._first_token,
        )
        # lite mode: the TTFT each dispatch predicts, unscaled, that its first token's time is judged against
        self._lite_ttft = PredictedTtft(self.ctx) if not self.full_mode and config.slow_engine_ratio_lite else None
        # requests whose gateway's Session ended with them held: id -> (drop after, last touch then)
        self._orphans: dict[str, tuple[float, float]] = {}
        self.account = InflightAccount(
            config.request_local_account_staleness_seconds,
            config.account_admission_grace_seconds,
            clock,
            on_change=self._changed,
            overdue_seconds=config.engine_admission_seconds if self.full_mode else 0.0,
            on_admitted=self._admitted,
        )
        self._models = frozenset(config.model)
        self._instances: dict[str, InstanceView] = {}
        self._by_model: dict[str, _ModelGroups] = {}
        self._clock = clock
        # full mode: told when a status or in-flight entry changes an instance's load (flow control drains then)
        self.on_view_change: Callable[[], None] | None = None
        # told when an instance changes while the load index is current: a server then re-keys it
        # (`rekey_changed`) in a callback of its own, so the next Schedule need not (rekey_when_idle)
        self.on_rekey_due: Callable[[], None] | None = None
        self._indexed = False  # whether a load index was ever built (a fleet under INDEX_MIN_INSTANCES has none)
        # ejected engines are no candidates; a change in that set rebuilds the candidate groups
        self.health = EngineHealth.from_config(config, clock, on_change=self._by_model.clear)
        self.cms: CmsView | None = None
        if self.full_mode:
            self.cms = CmsView(
                instances=self._instances,
                add_instance=self.add_instance,
                remove_instance=self.remove_instance,
                changed=self._changed,
                account=self.account,
                prefix_index=self.prefix_index,
                profile=self.ctx.tables.profile,  # the step-time prior, loaded once
                staleness_seconds=config.instance_staleness_seconds,
                clock=clock,
                prior_weight=config.step_time_prior_weight,
                admitted_window_ms=config.account_admitted_window_ms,
                trust=CmsTrust.from_config(config),
                wall_clock=wall_clock,
                # the engines' finished answers, counted where lite mode counts its releases (predicted_stall)
                answered=self._lrs.answered,
                speeds=self.speeds,
                stalled=self._engine_stalled,
                stall_seconds=config.engine_stall_seconds,
            )
        # an engine whose server swallows its requests (swallowing.py)
        self.swallowing = SwallowingWatch(
            self.health,
            self.account,
            self._lrs.get,
            self._drop,
            clock,
            received_at=self.cms.received_at if self.cms is not None else None,
            first_token_due_s=config.engine_first_token_seconds,
        )
        for instance_id, address in static:
            self.add_instance(InstanceView(Endpoint(instance_id, address), models=self._models))
        # a registry per core, never the global one, so several cores can live in one process
        self.registry = registry if registry is not None else CollectorRegistry()
        self._telemetry = Telemetry(self.registry, self)

    @property
    def policy(self) -> Policy:
        return self._policy

    # -- cluster membership (static, discovery, or the CMS) -------------------------------------

    def add_instance(self, inst: InstanceView) -> None:
        """Add or replace an instance; a replaced one keeps its load (same engine, new details)."""
        old = self._instances.get(inst.instance_id)
        if old is not None:
            inst.lrs, inst.speed_scale = old.lrs, old.speed_scale
        self._instances[inst.instance_id] = inst
        self._by_model.clear()

    def remove_instance(self, instance_id: str) -> bool:
        """Forget an instance and every request held on it; False if it was unknown."""
        if self._instances.pop(instance_id, None) is None:
            return False
        self._lrs.drop_instance(instance_id)
        self.account.drop_instance(instance_id)
        self.health.forget(instance_id)
        self.swallowing.forget(instance_id)
        self.speeds.forget(instance_id)
        self._by_model.clear()
        self._dirty.discard(instance_id)
        return True

    def instances(self) -> list[InstanceView]:
        return list(self._instances.values())

    def instance(self, instance_id: str) -> InstanceView:
        return self._instances[instance_id]

    def load(self, instance_id: str) -> LrsLoad:
        return self._instances[instance_id].lrs

    @property
    def account_size(self) -> int:
        """Requests held (dispatched, not yet released): the LRS."""
        return len(self._lrs)

    def holds(self, request_id: str) -> bool:
        """The request is dispatched and not yet released (flow control's per-flow account asks)."""
        return self._lrs.get(request_id) is not None

    @property
    def inflight_size(self) -> int:
        """Full mode: in-flight account entries (dispatched, not yet confirmed by an engine)."""
        return len(self.account)

    @property
    def num_expired(self) -> int:
        return self._lrs.num_expired

    # -- full mode: the CMS feed ---------------------------------------------------------------------

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        return self._cms().apply_metadata(meta)

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        return self._cms().apply_status(status)

    def apply_kv_event(
        self, instance_id: str, stored: Sequence[int] = (), removed: Iterable[int] = (), cleared: bool = False
    ) -> None:
        """An engine's KV-cache event, hashes from cms.prefix_hash (view/kv_events.py feeds it in full mode)."""
        if self.prefix_index is not None:
            self.prefix_index.apply_kv_event(instance_id, stored, removed, cleared)

    def _cms(self) -> CmsView:
        if self.cms is None:
            raise RuntimeError("CMS records need full mode (--enable-full-mode-scheduling)")
        return self.cms

    def _changed(self, inst: InstanceView) -> None:
        self._mark(inst.instance_id)
        if self.on_view_change is not None:
            self.on_view_change()

    def _mark(self, instance_id: str) -> None:
        dirty = self._dirty
        if not dirty and self._indexed and self.on_rekey_due is not None:
            # once until the next re-key: the changes after it wait for the same one. Without an index there is
            # nothing to re-key, and a callback per engine status would cost the loop a turn each
            self.on_rekey_due()
        dirty.add(instance_id)

    # -- candidates ------------------------------------------------------------------------------------

    def _groups(self, model: str) -> _ModelGroups:
        groups = self._by_model.get(model)
        if groups is None:
            if self._models and model not in self._models:
                served = ", ".join(sorted(self._models))
                raise UnknownModelError(f"model {model!r} is not served here (served: {served})")
            serving = sorted((i for i in self._instances.values() if i.serves(model)), key=lambda i: i.instance_id)
            if not serving and self.full_mode and not self._models:
                # full mode learns models from the instances' metadata: none declares this one
                raise UnknownModelError(f"model {model!r} is not served by any instance")
            ejected = self.health.ejected
            if ejected:
                # ejected engines are no candidates, unless every one is (then all are: a pick
                # that may fail beats refusing everything, as Envoy's panic threshold does)
                serving = [i for i in serving if i.instance_id not in ejected] or serving
            groups = _ModelGroups()
            pipelines = self._policy.pipelines
            for inst in serving:
                stage = groups.stages.get(inst.infer_type)
                if stage is None:
                    stage = groups.stages[inst.infer_type] = _Stage([], pipelines.get(inst.infer_type))
                stage.instances.append(inst)
            for stage in groups.stages.values():
                pipeline = stage.pipeline
                if pipeline is not None and pipeline.indexable and len(stage.instances) >= INDEX_MIN_INSTANCES:
                    stage.index = load_index(stage.pipeline, stage.instances)
                    self._indexed = True
            if len(self._by_model) > 1024:  # bound it: with no --model every name is accepted
                self._by_model.clear()
            self._by_model[model] = groups
        return groups

    def rekey_changed(self) -> None:
        """Re-key the instances that changed since the last decision or re-key in every index: what a Schedule
        does first, and what a server does sooner, when its loop is free (rekey_when_idle)."""
        dirty = self._dirty
        if not dirty:
            return
        instances = self._instances
        for groups in self._by_model.values():
            for stage in groups.stages.values():
                index = stage.index
                if index is None:
                    continue
                for instance_id in dirty:
                    inst = instances.get(instance_id)
                    if inst is not None:
                        index.rekey(inst)
        dirty.clear()

    # -- the request path --------------------------------------------------------------------------

    def schedule(self, req: RequestInfo) -> Decision:
        """Pick the instance for `req` (and, disaggregated, its decode instance) and account its load.

        A request id that is still held gets the decision it got before, counted once (a
        gateway retry is idempotent); the same id for a different model is rejected.
        Raises InvalidRequestError, UnknownModelError or NoSchedulableInstanceError.
        """
        started = time.perf_counter()
        if not req.request_id:
            raise InvalidRequestError("request_id is required")
        self.expire()
        held = self._lrs.get(req.request_id)
        if held is not None:
            if held.model != req.model:
                raise DuplicateRequestError(f"request {req.request_id!r} is already held for model {held.model!r}")
            self._lrs.touch(held)
            return cast(Decision, held.decision)
        groups = self._groups(req.model)
        if not groups.stages:
            raise NoSchedulableInstanceError(f"no instance serves model {req.model!r}")
        self.ctx.begin(req)
        self.rekey_changed()
        target, fallbacks, decode = self._decide(groups, req)
        decision = Decision(
            target=target.endpoint,
            fallbacks=tuple(i.endpoint for i in fallbacks),
            decode_target=decode.endpoint if decode is not None else None,
        )
        self._record(req, target, decode, decision)
        self._telemetry.decision_seconds.observe(time.perf_counter() - started)
        self._telemetry.recent.append((started, req.request_id, decision))  # the live page's ring (scheduler/ui)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %s%s (fallbacks %s)",
                req.request_id,
                decision.target.instance_id,
                f" then {decode.instance_id}" if decode is not None else "",
                ",".join(e.instance_id for e in decision.fallbacks),
            )
        return decision

    def _run(self, groups: _ModelGroups, kind: InferType, req: RequestInfo, count: int) -> list[InstanceView]:
        stage = groups.stages.get(kind)
        if stage is None or not stage.instances:
            raise NoSchedulableInstanceError(f"no {kind.name.lower()} instance serves model {req.model!r}")
        if stage.pipeline is None:
            raise NoSchedulableInstanceError(
                f"policy {self._policy.name!r} has no pipeline for {kind.name.lower()} instances"
            )
        trials = self.health.trials
        if trials:  # engines on probation with a trial running: passed over where another will do
            ranked = self._pick(stage, kind, req, count + len(trials))
            return ([i for i in ranked if i.instance_id not in trials] or ranked)[:count]
        return self._pick(stage, kind, req, count)

    def _pick(self, stage: _Stage, kind: InferType, req: RequestInfo, count: int) -> list[InstanceView]:
        assert stage.pipeline is not None
        subset = req.candidate_addresses
        if subset:  # the gateway's subset hint: a scan of the few it allows, never a pick outside
            allowed = [inst for inst in stage.instances if in_subset(inst.endpoint.address, subset)]
            if not allowed:
                raise NoSchedulableInstanceError(
                    f"no {kind.name.lower()} instance in the gateway's subset hint ({len(subset)} entries) "
                    f"serves model {req.model!r}"
                )
            return stage.pipeline.run(allowed, req, count, None)
        return stage.pipeline.run(stage.instances, req, count, stage.index)

    def _decide(
        self, groups: _ModelGroups, req: RequestInfo
    ) -> tuple[InstanceView, list[InstanceView], InstanceView | None]:
        count = 1 + self.config.fallback_count
        hint = req.infer_type_hint
        if hint in (InferType.NEUTRAL, InferType.PREFILL, InferType.DECODE):
            ranked = self._run(groups, hint, req, count)
            return ranked[0], ranked[1:], None
        stages = groups.stages
        if InferType.PREFILL in stages and InferType.DECODE in stages:
            try:
                prefill = self._run(groups, InferType.PREFILL, req, count)
                decode = self._run(groups, InferType.DECODE, req, 1)
                return prefill[0], prefill[1:], decode[0]
            except NoSchedulableInstanceError:
                if InferType.NEUTRAL not in stages:
                    raise
        if InferType.NEUTRAL not in stages:
            raise NoSchedulableInstanceError(
                f"model {req.model!r} has no neutral instances and not both prefill and decode ones"
            )
        ranked = self._run(groups, InferType.NEUTRAL, req, count)
        return ranked[0], ranked[1:], None

    def _record(self, req: RequestInfo, target: InstanceView, decode: InstanceView | None, decision: Decision) -> None:
        predicted = self._predicted_ttft(req, target) if self._lite_ttft is not None else 0.0
        entry = self._lrs.dispatch(req.request_id, req.model, target, req.prompt_tokens, decision)
        entry.predicted_ttft_ms = predicted
        self.health.dispatched(target.instance_id, req.request_id)
        self.swallowing.sent(entry, req.stream)
        if self.full_mode:
            cached = self.ctx.prefix_hits(req).get(target.instance_id, 0) if self.prefix_index is not None else 0
            self.account.dispatch(req.request_id, target, req.prompt_tokens, cached)
            if decode is not None:
                self.account.dispatch(req.request_id, decode, req.prompt_tokens)
        if self.prefix_index is not None and req.prefix_block_hashes:
            self.prefix_index.record_dispatch(target.instance_id, req.prefix_block_hashes)
            if decode is not None:
                self.prefix_index.record_dispatch(decode.instance_id, req.prefix_block_hashes)

    def _predicted_ttft(self, req: RequestInfo, inst: InstanceView) -> float:
        """Lite mode: `predicted_ttft` of the request on `inst` before its dispatch, at the profile's speed (scale
        1): what its first token's time is compared with (view/speed.py)."""
        metric = cast(PredictedTtft, self._lite_ttft)
        return metric.evaluate((*metric.state(inst)[:3], 1.0), inst, req)

    def _first_token(self, entry: RequestEntry, now: float) -> None:
        self.swallowing.first_token(entry.instance_id, now)
        self.health.admitted(entry.instance_id)
        if self._lite_ttft is None:
            return
        inst = self._instances.get(entry.instance_id)
        if inst is not None:
            self.speeds.observe_ttft(inst, (now - entry.dispatched_at) * 1000.0, entry.predicted_ttft_ms)

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool = False) -> bool:
        """Cumulative generated tokens of a held request; False if it is not held."""
        return self._lrs.report(request_id, generated_tokens, prefill_done)

    def report_many(self, reports: Iterable[tuple[str, int, bool]]) -> int:
        """(request_id, generated_tokens, prefill_done) each; returns how many were not held."""
        report = self._lrs.report
        return sum(1 for rid, generated, done in reports if not report(rid, generated, done))

    def reroute(self, request_id: str, address: str) -> bool:
        """The gateway served a held request at `address`, not where it was scheduled (a retry on
        a fallback): its load moves there. False if the request or the address is unknown."""
        held = self._lrs.get(request_id)
        if held is None:
            return False
        inst = next(
            (i for i in self._instances.values() if i.endpoint.address == address and i.serves(held.model)), None
        )
        if inst is None:
            return False
        old_instance_id = held.instance_id
        self._lrs.move(request_id, inst)
        if old_instance_id != inst.instance_id:
            if self.full_mode:
                self.account.move(request_id, old_instance_id, inst, held.prompt_tokens)
            # served elsewhere: the gateway's retry left the scheduled engine before its first byte
            self._drop(self.health.failure(old_instance_id))
        return True

    def release(
        self, request_id: str, reason: int = scheduler_pb2.RELEASE_REASON_UNSPECIFIED, answer_tokens: int = 0
    ) -> bool:
        """Drop the request and its load (held and in-flight) at once; False if it was not held. Idempotent.

        `reason` (scheduler.proto ReleaseReason) feeds engine health: FINISHED is a success of the
        engine the request is held on, UPSTREAM_ERROR or UPSTREAM_RESET (the engine reset the stream
        mid-response, as Envoy's access log tells) a failure, and such a request keeps its load
        there while the engine's run of failures lasts (health.py), so failing fast does not make
        the engine look idle; the others say nothing of the engine. `answer_tokens`: the answer's length as
        the gateway learned it at the end (ReleaseRequest.generated_tokens), counted if above the last report.
        """
        entry = self._lrs.get(request_id)
        inflight = self.account.release(request_id)
        if entry is None:
            return inflight
        if reason in _ENGINE_FAILURES:
            self._drop(self.health.failure(entry.instance_id, request_id))
            self.health.released(entry.instance_id, request_id)  # (with outlier detection off no verdict ends it)
            return True
        self._lrs.release(request_id, answer_tokens)
        if reason == scheduler_pb2.RELEASE_REASON_FINISHED:
            self._drop(self.health.success(entry.instance_id))
            self.swallowing.finished(entry.instance_id)
        self.health.released(entry.instance_id, request_id)  # a trial that ended with no verdict
        return True

    def orphan(self, request_ids: Iterable[str]) -> None:
        """The gateway that placed these requests is gone (its Session ended with them held): each
        is dropped after --orphan-grace-seconds unless a report or a release reaches it first."""
        deadline = self._clock() + self.config.orphan_grace_seconds
        for request_id in request_ids:
            entry = self._lrs.get(request_id)
            if entry is not None:
                self._orphans[request_id] = (deadline, entry.last_touch)

    def _drop_orphans(self) -> int:
        now, dropped = self._clock(), 0
        for request_id, (deadline, touched) in list(self._orphans.items()):
            if deadline > now:
                continue
            del self._orphans[request_id]
            entry = self._lrs.get(request_id)
            if entry is not None and entry.last_touch <= touched:  # nobody spoke for it since
                self.release(request_id)
                dropped += 1
        return dropped

    def probe_result(self, instance_id: str, ok: bool) -> None:
        """One health probe of an engine (health.HealthProber); unknown instances are ignored."""
        if instance_id in self._instances:
            self._drop(self.health.probe(instance_id, ok))

    def _admitted(self, instance_id: str) -> None:
        """Full mode: a status named a request the engine admitted (health.py: a trial on probation passes)."""
        self.health.admitted(instance_id)

    def _engine_stalled(self, inst: InstanceView, stalled: bool) -> None:
        """Full mode: the engine's statuses show it stalled, or stepping again (view/cms_view.py)."""
        self._drop(self.health.stall(inst.instance_id, stalled))

    def _drop(self, request_ids: list[str]) -> None:
        """Release requests whose load engine health had kept (held as failures)."""
        for request_id in request_ids:
            self._lrs.release(request_id)

    def expire(self) -> int:
        """Drop held requests and in-flight entries past the staleness period; returns how many.
        Also lets back engines whose ejection ran out (health.py)."""
        if self.health.due() <= self._clock():
            self._drop(self.health.tick())
        if self._orphans and (orphaned := self._drop_orphans()):
            log.info("dropped %d requests whose gateway's Session ended with them held", orphaned)
        dropped = self._lrs.expire()
        if dropped:
            log.warning(
                "dropped %d held requests with no Report or Release for %gs",
                dropped,
                self._lrs.staleness_seconds,
            )
        if self.swallowing.active:
            self.swallowing.judge()
        if self.full_mode:
            unconfirmed = self.account.expire()
            if unconfirmed:
                log.warning(
                    "dropped %d in-flight entries no engine confirmed within %gs",
                    unconfirmed,
                    self.account.staleness_seconds,
                )
            dropped += unconfirmed
        return dropped
