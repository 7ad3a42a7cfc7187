"""Refused CMS records: counted by reason, logged (WARNING) rate-limited per instance and reason.

A writer that keeps sending what a reader refuses (a broken llumlet, a forger) must show in the
log without flooding it: the first refusal of an (instance, reason) pair logs at once, later ones
at most once per `interval` with the count of those not logged since. Memory is bounded: at most
`limit` pairs are remembered, the least recently logged forgotten first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

LOG_INTERVAL_SECONDS = 30.0
MAX_TRACKED = 1024


class RefusalLog:
    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL_SECONDS,
        limit: int = MAX_TRACKED,
        what: str = "refused CMS record",
    ) -> None:
        self._log = logger
        self._what = what
        self._clock = clock
        self._interval = interval
        self._limit = limit
        # (instance, reason) -> [last logged at, refusals since]
        self._last: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def note(self, instance_id: str, reason: str, message: str, level: int = logging.WARNING) -> bool:
        """Count it; log `message` unless this pair logged within the interval. True if logged."""
        self.counts[reason] += 1
        now = self._clock()
        key = (instance_id, reason)
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self._interval:
            entry[1] += 1
            return False
        suppressed = int(entry[1]) if entry is not None else 0
        self._last[key] = [now, 0]
        self._last.move_to_end(key)
        while len(self._last) > self._limit:
            self._last.popitem(last=False)
        more = f" ({suppressed} more not logged since the last line)" if suppressed else ""
        self._log.log(level, "%s of instance %s (%s): %s%s", self._what, instance_id, reason, message, more)
        return True

    @property
    def total(self) -> int:
        return sum(self.counts.values())
