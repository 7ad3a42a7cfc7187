"""The scheduling core: synchronous, with no I/O, usable in-process by a colocated gateway.

`schedule` picks an instance with the policy and raises its load at once (dispatch is a load
change, so back-to-back decisions spread); `report` applies streamed token progress; `release`
drops the request and its load. State is updated incrementally; no decision copies a snapshot.

Not thread-safe: one owner (an event loop) calls it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry

from pilotfish.scheduler import config as scheduler_config
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NoSchedulableInstanceError,
    UnknownModelError,
)
from pilotfish.scheduler.policy.registry import build_policy
from pilotfish.scheduler.telemetry import Telemetry
from pilotfish.scheduler.view.lrs import LocalRealtimeState
from pilotfish.scheduler.view.types import Endpoint, InstanceView, LrsLoad, RequestInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    target: Endpoint
    fallbacks: tuple[Endpoint, ...] = ()
    # prefill/decode disaggregation only: where decode continues
    decode_target: Endpoint | None = None


class SchedulerCore:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        static = scheduler_config.validate(config)
        self.config = config
        self._policy = build_policy(config, rng)
        self._lrs = LocalRealtimeState(config.request_local_account_staleness_seconds, clock)
        self._models = frozenset(config.model)
        self._instances: dict[str, InstanceView] = {}
        # candidates per model, in instance-id order (the selectors' tie-break); rebuilt on change
        self._by_model: dict[str, list[InstanceView]] = {}
        for instance_id, address in static:
            self.add_instance(InstanceView(Endpoint(instance_id, address), models=self._models))
        # a registry per core, never the global one, so several cores can live in one process
        self.registry = registry if registry is not None else CollectorRegistry()
        self._telemetry = Telemetry(self.registry, self)

    # -- cluster membership (static now; discovery will call these) ---------------------------

    def add_instance(self, inst: InstanceView) -> None:
        """Add or replace an instance; a replaced one keeps its load (same engine, new details)."""
        old = self._instances.get(inst.instance_id)
        if old is not None:
            inst.lrs = old.lrs
        self._instances[inst.instance_id] = inst
        self._by_model.clear()

    def remove_instance(self, instance_id: str) -> bool:
        """Forget an instance and every request held on it; False if it was unknown."""
        if self._instances.pop(instance_id, None) is None:
            return False
        self._lrs.drop_instance(instance_id)
        self._by_model.clear()
        return True

    def instances(self) -> list[InstanceView]:
        return list(self._instances.values())

    def load(self, instance_id: str) -> LrsLoad:
        return self._instances[instance_id].lrs

    @property
    def account_size(self) -> int:
        return len(self._lrs)

    @property
    def num_expired(self) -> int:
        return self._lrs.num_expired

    def _candidates(self, model: str) -> list[InstanceView]:
        cands = self._by_model.get(model)
        if cands is None:
            if self._models and model not in self._models:
                served = ", ".join(sorted(self._models))
                raise UnknownModelError(f"model {model!r} is not served here (served: {served})")
            cands = sorted((i for i in self._instances.values() if i.serves(model)), key=lambda i: i.instance_id)
            if len(self._by_model) > 1024:  # bound it: with no --model every name is accepted
                self._by_model.clear()
            self._by_model[model] = cands
        return cands

    # -- the request path --------------------------------------------------------------------------

    def schedule(self, req: RequestInfo) -> Decision:
        """Pick the instance for `req` and account its load there.

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
        cands = self._candidates(req.model)
        if not cands:
            raise NoSchedulableInstanceError(f"no instance serves model {req.model!r}")
        selection = self._policy.schedule(cands, req, self.config.fallback_count)
        decision = Decision(
            target=selection.target.endpoint,
            fallbacks=tuple(i.endpoint for i in selection.fallbacks),
            decode_target=selection.decode_target.endpoint if selection.decode_target else None,
        )
        self._lrs.dispatch(req.request_id, req.model, selection.target, req.prompt_tokens, decision)
        self._telemetry.decision_seconds.observe(time.perf_counter() - started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %s (fallbacks %s)",
                req.request_id,
                decision.target.instance_id,
                ",".join(e.instance_id for e in decision.fallbacks),
            )
        return decision

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool = False) -> bool:
        """Cumulative generated tokens of a held request; False if it is not held."""
        return self._lrs.report(request_id, generated_tokens, prefill_done)

    def report_many(self, reports: Iterable[tuple[str, int, bool]]) -> int:
        """(request_id, generated_tokens, prefill_done) each; returns how many were not held."""
        report = self._lrs.report
        return sum(1 for rid, generated, done in reports if not report(rid, generated, done))

    def release(self, request_id: str) -> bool:
        """Drop the request and its load; False if it was not held. Idempotent."""
        return self._lrs.release(request_id)

    def expire(self) -> int:
        """Drop held requests untouched for the staleness period; returns how many."""
        dropped = self._lrs.expire()
        if dropped:
            log.warning(
                "dropped %d held requests with no Report or Release for %gs",
                dropped,
                self._lrs.staleness_seconds,
            )
        return dropped
