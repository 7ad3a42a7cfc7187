"""Where a request goes: the scheduler's choice, or round-robin when the scheduler can't answer.

The gateway keeps its own list of engines (discovery) so a dead or slow scheduler never stops
traffic: each failed or late Schedule call falls back to round-robin, and after enough
consecutive failures a circuit breaker skips the scheduler entirely for a while, then lets one
probe through to detect its recovery. The scheduler itself is a backend: remote over gRPC
(scheduler_client.py) or colocated in this process (colocated.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pilotfish.discovery.static import Instance, in_subset
from pilotfish.ext_proc.openai import RequestError
from pilotfish.protos import scheduler_pb2

log = logging.getLogger(__name__)

SCHEDULER = "scheduler"
FALLBACK = "fallback"


@dataclass(slots=True)
class Decision:
    instance_id: str
    address: str
    source: str  # SCHEDULER or FALLBACK
    fallbacks: tuple[str, ...] = ()
    # prefill/decode disaggregation: the decode engine (then `address` is the prefill engine's)
    decode_address: str = ""
    decode_instance_id: str = ""


class SchedulerUnavailable(Exception):
    """The scheduler did not answer (down, late, overloaded): route without it."""


class SchedulerBackend(Protocol):
    async def schedule(self, request: scheduler_pb2.ScheduleRequest) -> Decision: ...
    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None: ...
    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None: ...
    def instance_added(self, instance: Instance) -> None: ...
    def instance_removed(self, instance_id: str) -> None: ...
    async def close(self) -> None: ...


class RoundRobin:
    def __init__(self, instances: list[Instance]) -> None:
        self._instances = list(instances)
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self._instances)

    def add(self, instance: Instance) -> None:
        """Add, or replace the instance with the same id (a new address)."""
        self._instances = [i for i in self._instances if i.instance_id != instance.instance_id] + [instance]

    def remove(self, instance_id: str) -> None:
        self._instances = [i for i in self._instances if i.instance_id != instance_id]

    def pick(self, subset: frozenset[str] = frozenset()) -> Instance:
        """The next engine in turn; with a subset hint, the next one in it."""
        instances = [i for i in self._instances if in_subset(i.address, subset)] if subset else self._instances
        if not instances:
            if subset:
                raise RequestError(503, "no engine in the gateway's subset hint is known to the picker")
            raise RequestError(503, "no inference engine is known to the gateway")
        inst = instances[self._next % len(instances)]
        self._next += 1
        return inst


class CircuitBreaker:
    """Closed until `threshold` consecutive failures; then open for `open_seconds`; then one probe."""

    def __init__(self, threshold: int, open_seconds: float) -> None:
        self.threshold = threshold
        self.open_seconds = open_seconds
        self.failures = 0
        self._open_until = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold

    def allow(self) -> bool:
        if not self.is_open:
            return True
        if self._probing or time.monotonic() < self._open_until:
            return False
        self._probing = True  # half-open: exactly one call finds out whether it recovered
        return True

    def success(self) -> None:
        self.failures = 0
        self._probing = False

    def failure(self) -> None:
        self.failures += 1
        self._probing = False
        if self.failures >= self.threshold:
            self._open_until = time.monotonic() + self.open_seconds


class Router:
    """Schedule through the backend with round-robin fallback; Report and Release pass through."""

    def __init__(self, backend: SchedulerBackend | None, instances: list[Instance], breaker: CircuitBreaker) -> None:
        self._backend = backend
        self._round_robin = RoundRobin(instances)
        self.breaker = breaker
        self.on_breaker_change: Callable[[bool], None] = lambda is_open: None

    async def choose(self, request: scheduler_pb2.ScheduleRequest) -> Decision:
        if self._backend is not None and self.breaker.allow():
            try:
                decision = await self._backend.schedule(request)
            except RequestError:
                self._breaker_success()  # the scheduler answered; the request was at fault
                raise
            except SchedulerUnavailable as exc:
                self.breaker.failure()
                self.on_breaker_change(self.breaker.is_open)
                log.debug("Schedule failed (%s); routing round-robin", exc)
            else:
                self._breaker_success()
                return decision
        inst = self._round_robin.pick(frozenset(request.candidate_addresses))
        return Decision(inst.instance_id, inst.address, FALLBACK)

    def _breaker_success(self) -> None:
        was_open = self.breaker.is_open
        self.breaker.success()
        if was_open:
            self.on_breaker_change(False)

    def pick_round_robin(self, subset: frozenset[str] = frozenset()) -> Instance:
        return self._round_robin.pick(subset)

    def instance_added(self, instance: Instance) -> None:
        """Discovery saw an engine become ready: fallback routing (and a colocated core) may use it."""
        self._round_robin.add(instance)
        if self._backend is not None:
            self._backend.instance_added(instance)

    def instance_removed(self, instance_id: str) -> None:
        self._round_robin.remove(instance_id)
        if self._backend is not None:
            self._backend.instance_removed(instance_id)

    def report(self, request_id: str, generated_tokens: int, prefill_done: bool, served_address: str = "") -> None:
        if self._backend is not None:
            self._backend.report(request_id, generated_tokens, prefill_done, served_address)

    def release(self, request_id: str, reason: int, answer_tokens: int = 0) -> None:
        if self._backend is not None:
            self._backend.release(request_id, reason, answer_tokens)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()
