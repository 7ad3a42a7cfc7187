"""Engine health in the data path: outlier ejection from the gateway's outcomes, and probes.

Least-loaded balancing has a black hole: a dead engine fails each request in a millisecond, the
request is released at once, so the dead engine always shows the least load and wins every pick.
Two signals take it out of the candidates:

- **passive** (outlier detection as Envoy defines it): the gateway releases each request with a
  reason; UPSTREAM_ERROR (the engine answered 5xx or could not be reached) is a failure of the
  engine the request was held on, and so is a request the gateway served on another engine than
  the one scheduled (Envoy retried it elsewhere). `consecutive_failures` in a row eject the
  engine for `base_s` x (its ejections in a row), at most `max_s`; then it is let back on
  *probation*: its next failure ejects it again at once (for longer), its next success forgives
  every ejection before (the next one lasts `base_s` again). Any success resets the failure run.
- **stalled** (full mode, `stall`): the engine's statuses keep coming, fresh, while it holds requests
  and its step count stands still for --engine-stall-seconds: a hung GPU or engine loop. The llumlet
  refreshes its record whatever the engine does, so the status looks live, the engine answers its
  probes (vLLM's /health asks whether the engine process lives, not whether it steps) and a request
  there never fails: it hangs. Out until a status shows it stepping again, then on probation.
- **unadmitted** (`unadmitted`): a request sent to the engine that no status of it lists as admitted for
  --engine-admission-seconds, while its statuses keep coming and it admits no request at all since that
  one was sent (full mode; swallowing.py judges it): an HTTP server that takes requests and passes none to its
  engine (a hung API-server loop or proxy) looks idle and healthy otherwise, with an idle engine behind
  it and /health answering. In lite mode (no statuses) the same for a streamed request that gets no
  first token for --engine-first-token-seconds while the engine neither gives one nor finishes a request
  and others answer. A request sent before the engine's last ejection is not judged (the engine may have
  recovered while out), nor one on an engine stalled already.
  `UNADMITTED_IN_A_ROW` such requests eject it as upstream failures would (backoff, then probation,
  where one more ejects it again); a request it serves to its end resets the count.
- **active** (`HealthProber`, where discovery says nothing of readiness): GET each engine's
  health path every interval; `probe_failures` failed probes in a row eject it until a probe
  succeeds, after which it is on probation as above. A probe that succeeds after one failed
  also ends a passive ejection early (the engine was down and is back: a restart), as Envoy's
  `successful_active_health_check_uneject_host` does; an engine that answers its probes all
  along but fails requests sits out its whole backoff.

*Probation is half-open*: an engine let back takes one request at a time (its trial) until that request
shows the engine works (it is admitted or gives its first token, or it succeeds), is released without a
verdict (the client went), or `TRIAL_SECONDS` pass; a failure ejects it again. Meanwhile the core passes it
over where another engine will do (`trials`); it is not ejected, and the candidate groups stay as they are.
So an engine that still swallows or fails its requests gets one per ejection, not every pick it wins until
the next verdict (the unadmitted rule's takes seconds).

An engine is out while either says so. Failed-fast requests must not make an engine look idle:
a request released as an upstream error keeps its load on its engine until that engine next
succeeds, is ejected, or `base_s` passes (`EngineHealth.hold`), so the run of failures that ejects
an engine does not also draw every pick to it.

`EngineHealth` is synchronous, reads an injected clock and does no I/O (the core owns it);
`HealthProber` is the asyncio task the scheduler service runs beside it, on the same loop.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pilotfish.scheduler.config import SchedulerConfig
    from pilotfish.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)

PASSIVE = "upstream_errors"  # the ejection reasons, as the metric's label
PROBE = "health_probes"
STALLED = "stalled"
UNADMITTED = "unadmitted"
# unadmitted requests in a row that eject an engine: one may be slow for a reason of its own (the server
# still fetching its images), and the ranking already shuns an engine holding one
UNADMITTED_IN_A_ROW = 2
# how long a trial request on probation keeps its engine passed over without a verdict
TRIAL_SECONDS = 30.0


@dataclass(slots=True, eq=False)
class _State:
    failures: int = 0  # upstream failures in a row
    probe_failures: int = 0  # failed probes in a row
    ejections: int = 0  # passive ejections in a row: the backoff multiplier, forgiven by a success
    until: float = 0.0  # the passive ejection ends then (0: not passively ejected)
    probe_down: bool = False  # ejected by probes, until one succeeds
    probation: bool = False  # back after an ejection: one failure ejects it again
    down_seen: bool = False  # a probe failed during the passive ejection: a good one ends it
    stalled: bool = False  # its statuses show work and no step for the stall period (full mode)
    unadmitted: int = 0  # requests in a row it did not admit in the admission period
    ejected_at: float = -math.inf  # when it was last ejected: requests sent before say nothing of it since
    total: Counter[str] = field(default_factory=Counter)  # ejections by reason, monotonic
    held: list[str] = field(default_factory=list)  # request ids released as failures, load kept


class EngineHealth:
    """Which engines are ejected, and why; `on_change` is called whenever that set changes."""

    def __init__(
        self,
        consecutive_failures: int,
        base_s: float,
        max_s: float,
        probe_failures: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.consecutive_failures = consecutive_failures
        self.base_s = base_s
        self.max_s = max_s
        self.probe_failures = probe_failures
        self._clock = clock
        self._on_change = on_change
        self._states: dict[str, _State] = {}
        self._ejected: set[str] = set()
        # instance id -> the request it is trying on probation (half-open): passed over while it runs
        self.trials: dict[str, str] = {}
        self._trial_deadlines: list[tuple[float, str, str]] = []  # heap of (deadline, instance id, request id)
        self._returns: list[tuple[float, str]] = []  # heap of (until, instance id) of passive ejections
        self._hold_deadlines: list[tuple[float, str, str]] = []  # heap of (deadline, instance id, request id)

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, clock: Callable[[], float], on_change: Callable[[], None]
    ) -> EngineHealth:
        return cls(
            config.outlier_consecutive_failures,
            config.outlier_base_ejection_seconds,
            config.outlier_max_ejection_seconds,
            config.health_probe_failures,
            clock,
            on_change,
        )

    # -- what the core asks ------------------------------------------------------------------------

    @property
    def ejected(self) -> set[str]:
        """The ejected instance ids (live set: read it, do not keep it)."""
        return self._ejected

    def is_ejected(self, instance_id: str) -> bool:
        return instance_id in self._ejected

    def ejections(self, instance_id: str) -> Counter[str]:
        """Ejections of one instance so far, by reason (PASSIVE, PROBE, STALLED, UNADMITTED)."""
        state = self._states.get(instance_id)
        return state.total if state is not None else Counter()

    def on_probation(self, instance_id: str) -> bool:
        state = self._states.get(instance_id)
        return state is not None and state.probation

    def due(self) -> float:
        """When `tick` next has something to do (inf: nothing pending)."""
        first = self._returns[0][0] if self._returns else math.inf
        if self._trial_deadlines:
            first = min(first, self._trial_deadlines[0][0])
        return min(first, self._hold_deadlines[0][0]) if self._hold_deadlines else first

    # -- the trial of an engine on probation ---------------------------------------------------------

    def dispatched(self, instance_id: str, request_id: str) -> None:
        """A request went to the engine: on probation with no trial running, it is the trial."""
        state = self._states.get(instance_id)
        if state is None or not state.probation or instance_id in self.trials:
            return
        self.trials[instance_id] = request_id
        heapq.heappush(self._trial_deadlines, (self._clock() + TRIAL_SECONDS, instance_id, request_id))

    def admitted(self, instance_id: str) -> None:
        """The engine admitted a request sent to it, or gave one its first token: it passes requests on."""
        self.trials.pop(instance_id, None)

    def released(self, instance_id: str, request_id: str) -> None:
        """A request on the engine was released (whatever the verdict, which came first)."""
        if self.trials.get(instance_id) == request_id:
            del self.trials[instance_id]

    # -- outcomes ----------------------------------------------------------------------------------

    def failure(self, instance_id: str, request_id: str = "") -> list[str]:
        """An upstream failure on `instance_id`. Returns the request ids whose load to drop now;
        `request_id` (a request released as this failure) is held, not returned, unless the
        failure ejects the engine."""
        if self.consecutive_failures <= 0:
            return [request_id] if request_id else []
        state = self._state(instance_id)
        state.failures += 1
        if state.until or state.probe_down:
            # already out: a request sent before the ejection failing late; nothing to hold it for
            return [request_id] if request_id else []
        if state.probation or state.failures >= self.consecutive_failures:
            why = "failed on probation" if state.probation else f"{state.failures} upstream failures in a row"
            self._eject_passive(instance_id, state, why)
            return self._drop_holds(state) + ([request_id] if request_id else [])
        if request_id:
            self.hold(instance_id, state, request_id)
        return []

    def success(self, instance_id: str) -> list[str]:
        """The engine served a request to its end: the failure run is over. Returns the held
        request ids whose load to drop now."""
        state = self._states.get(instance_id)
        if state is None:
            return []
        state.failures = 0
        state.unadmitted = 0
        if not state.until:
            if state.probation:
                log.info("instance %s is healthy again (a success on probation)", instance_id)
            state.probation = False
            state.ejections = 0
            self.trials.pop(instance_id, None)
        return self._drop_holds(state)

    def probe(self, instance_id: str, ok: bool) -> list[str]:
        """One health probe's result. Returns the held request ids whose load to drop now."""
        state = self._state(instance_id)
        if ok:
            state.probe_failures = 0
            back = state.probe_down or (bool(state.until) and state.down_seen)
            if back:
                state.probe_down = False
                state.until = 0.0
                state.down_seen = False
                state.probation = True
                state.failures = 0
                log.warning("instance %s answers its health probe again: back on probation", instance_id)
                self._update(instance_id, state)
            return []
        state.probe_failures += 1
        if state.until:
            state.down_seen = True
        if state.probe_down or state.probe_failures < self.probe_failures:
            return []
        state.probe_down = True
        if not state.until:  # already out on its upstream failures: not a second ejection
            state.total[PROBE] += 1
            log.warning("instance %s ejected: %d health probes failed in a row", instance_id, state.probe_failures)
        self._update(instance_id, state)
        return self._drop_holds(state)

    def stall(self, instance_id: str, stalled: bool) -> list[str]:
        """The engine's statuses show it stalled (work, no step for the stall period), or stepping again.
        Returns the held request ids whose load to drop now."""
        state = self._state(instance_id)
        if stalled == state.stalled:
            return []
        state.stalled = stalled
        if stalled:
            state.ejected_at = self._clock()
            state.total[STALLED] += 1
            log.warning("instance %s ejected: requests on it, and no step for the stall period", instance_id)
        else:
            state.probation = True
            state.failures = 0
            log.warning("instance %s steps again: back on probation", instance_id)
        self._update(instance_id, state)
        return self._drop_holds(state) if stalled else []

    def unadmitted(self, instance_id: str, sent_at: float) -> list[str]:
        """A request sent to the engine at `sent_at` was not admitted (or answered) within the period. Returns
        the held request ids whose load to drop now."""
        state = self._state(instance_id)
        if state.until or state.probe_down or state.stalled or sent_at <= state.ejected_at:
            return []  # out, or sent before its last ejection (on probation: judged by what it gets since)
        state.unadmitted += 1
        if not state.probation and state.unadmitted < UNADMITTED_IN_A_ROW:
            return []
        why = "a request not admitted on probation" if state.probation else f"{state.unadmitted} requests not admitted"
        self._eject_passive(instance_id, state, why, UNADMITTED)
        return self._drop_holds(state)

    def tick(self) -> list[str]:
        """Let back the engines whose ejection ran out, and end holds past their deadline.
        Returns the held request ids whose load to drop now."""
        now = self._clock()
        while self._returns and self._returns[0][0] <= now:
            until, instance_id = heapq.heappop(self._returns)
            state = self._states.get(instance_id)
            if state is None or state.until != until:
                continue  # forgotten, or ejected again since (a later entry holds the new end)
            state.until = 0.0
            state.down_seen = False
            state.probation = True
            state.failures = 0
            if not state.probe_down:
                log.warning("instance %s ejection over: back on probation", instance_id)
            self._update(instance_id, state)
        while self._trial_deadlines and self._trial_deadlines[0][0] <= now:
            _, instance_id, request_id = heapq.heappop(self._trial_deadlines)
            self.released(instance_id, request_id)  # no verdict in time: another request may try
        dropped: list[str] = []
        while self._hold_deadlines and self._hold_deadlines[0][0] <= now:
            _, instance_id, request_id = heapq.heappop(self._hold_deadlines)
            state = self._states.get(instance_id)
            if state is not None and request_id in state.held:
                state.held.remove(request_id)
                dropped.append(request_id)
        return dropped

    def forget(self, instance_id: str) -> None:
        """The instance left the cluster (its held requests go with it)."""
        state = self._states.pop(instance_id, None)
        self.trials.pop(instance_id, None)
        if state is not None and instance_id in self._ejected:
            self._ejected.discard(instance_id)
            self._on_change()

    # -- inside --------------------------------------------------------------------------------------

    def _state(self, instance_id: str) -> _State:
        state = self._states.get(instance_id)
        if state is None:
            state = self._states[instance_id] = _State()
        return state

    def hold(self, instance_id: str, state: _State, request_id: str) -> None:
        if len(state.held) >= max(self.consecutive_failures, 1):
            return  # bounded: the run that long ejects the engine anyway
        state.held.append(request_id)
        heapq.heappush(self._hold_deadlines, (self._clock() + self.base_s, instance_id, request_id))

    def _drop_holds(self, state: _State) -> list[str]:
        held, state.held = state.held, []
        return held  # their heap entries find nothing held and are skipped

    def _eject_passive(self, instance_id: str, state: _State, why: str, reason: str = PASSIVE) -> None:
        state.ejections += 1
        seconds = min(self.base_s * state.ejections, self.max_s)
        state.ejected_at = self._clock()
        state.until = state.ejected_at + seconds
        state.failures = 0
        state.unadmitted = 0
        state.probation = False
        state.down_seen = False
        state.total[reason] += 1
        heapq.heappush(self._returns, (state.until, instance_id))
        log.warning(
            "instance %s ejected for %gs (%s; ejection %d in a row)", instance_id, seconds, why, state.ejections
        )
        self._update(instance_id, state)

    def _update(self, instance_id: str, state: _State) -> None:
        out = bool(state.until) or state.probe_down or state.stalled
        if out or not state.probation:
            self.trials.pop(instance_id, None)  # a verdict, or out again: the trial is over
        if out == (instance_id in self._ejected):
            return
        if out:
            self._ejected.add(instance_id)
        else:
            self._ejected.discard(instance_id)
        self._on_change()


class HealthProber:
    """GET every engine's health path each interval, at most `concurrency` at once, and tell the
    core; runs on the loop that owns the core, so results are applied where they are read."""

    def __init__(self, core: SchedulerCore, config: SchedulerConfig) -> None:
        self._core = core
        self._path = config.health_probe_path
        self._interval = config.health_probe_interval_seconds
        self._timeout = config.health_probe_timeout_seconds
        self._limit = asyncio.Semaphore(config.health_probe_concurrency)
        self.rounds = 0  # probe rounds completed (tests wait on it)

    async def run(self) -> None:
        import aiohttp

        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        # a fresh connection per probe: a probe proves the engine still accepts one
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                started = loop.time()
                targets = [(i.instance_id, i.endpoint.address) for i in self._core.instances()]
                await asyncio.gather(*(self._probe(session, iid, address) for iid, address in targets))
                self.rounds += 1
                await asyncio.sleep(max(0.0, self._interval - (loop.time() - started)))

    async def _probe(self, session: object, instance_id: str, address: str) -> None:
        import aiohttp

        assert isinstance(session, aiohttp.ClientSession)
        async with self._limit:
            try:
                async with session.get(f"http://{address}{self._path}") as resp:
                    ok = resp.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                ok = False
        self._core.probe_result(instance_id, ok)
