"""Refused CMS records: counted by reason, logged (WARNING) rate-limited per instance and reason.

A writer that keeps sending what a reader refuses (a broken llumlet, a forger) must show in the
log without flooding it: the first refusal of an (instance, reason) pair logs at once, later ones
at most once per `interval` with the count of those not logged since. Memory is bounded: at most
`limit` pairs are remembered, the least recently logged forgotten first. Many pairs at once (keys
under thousands of names) would still log a line each, so all pairs together log at most
`max_lines` per interval; past that, refusals are counted, not logged, and the next line that is
logged says how many were not.

`RefusedKeys` is the reader's memory of what each refused key held, so an unchanged one is not
decoded, counted or logged again on the next poll.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

LOG_INTERVAL_SECONDS = 30.0
MAX_TRACKED = 1024
# lines all pairs together may log per interval
MAX_LINES = 100
# keys whose refused value `RefusedKeys` remembers: at about 110 bytes a key (two ints in a dict),
# at most about 7.5 MB
MAX_REFUSED_KEYS = 1 << 16


class RefusalLog:
    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL_SECONDS,
        limit: int = MAX_TRACKED,
        what: str = "refused CMS record",
        max_lines: int = MAX_LINES,
    ) -> None:
        self._log = logger
        self._what = what
        self._clock = clock
        self._interval = interval
        self._limit = limit
        # (instance, reason) -> [last logged at, refusals since]
        self._last: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self._max_lines = max_lines
        self._window_start = float("-inf")
        self._window_lines = 0
        self._unlogged = 0  # refusals not logged because the window's lines were spent

    def note(self, instance_id: str, reason: str, message: str, level: int = logging.WARNING) -> bool:
        """Count it; log `message` unless this pair logged within the interval, or all pairs
        together logged `max_lines` in the current one. True if logged."""
        self.counts[reason] += 1
        now = self._clock()
        key = (instance_id, reason)
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self._interval:
            entry[1] += 1
            return False
        if now - self._window_start >= self._interval:
            self._window_start, self._window_lines = now, 0
        if self._window_lines >= self._max_lines:
            self._unlogged += 1
            return False
        self._window_lines += 1
        suppressed = int(entry[1]) if entry is not None else 0
        self._last[key] = [now, 0]
        self._last.move_to_end(key)
        while len(self._last) > self._limit:
            self._last.popitem(last=False)
        more = f" ({suppressed} more not logged since the last line)" if suppressed else ""
        if self._unlogged:
            more += f" ({self._unlogged} refusals of any instance not logged: over {self._max_lines} lines)"
            self._unlogged = 0
        self._log.log(level, "%s of instance %s (%s): %s%s", self._what, instance_id, reason, message, more)
        if self._window_lines == self._max_lines:
            self._log.log(
                level, "%ss: %d lines in %.0f s; the next are counted, not logged, until the interval ends",
                self._what, self._max_lines, self._interval,
            )
        return True

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class RefusedKeys:
    """The value each refused key held, as a fingerprint, so that the same value read again costs a
    lookup: not decoded, counted or logged again until the key changes or leaves Redis.

    Bounded at `limit` keys (MAX_REFUSED_KEYS), each two ints in a dict (key names are not kept:
    Redis allows them up to 512 MB). When full, a newly refused key is not remembered (`add` says
    so) and nothing remembered is evicted: evicting in scan order would forget every key once per
    poll, as a smaller LRU did. Keys are fingerprinted with Python's `hash`, keyed per process, so
    a writer cannot aim a collision; one would only cost a record a second decoding.
    """

    def __init__(self, limit: int = MAX_REFUSED_KEYS) -> None:
        self.limit = limit
        self._values: dict[int, int] = {}

    @staticmethod
    def _value(value_digest: bytes) -> int:
        return int.from_bytes(value_digest[:8], "little")

    def holds(self, key: str | bytes, value_digest: bytes) -> bool:
        """`key` was refused holding the value of this digest."""
        return self._values.get(hash(key)) == self._value(value_digest)

    def add(self, key: str | bytes, value_digest: bytes) -> bool:
        """Remember `key`'s refused value; False when full (and `key` not already remembered)."""
        fingerprint = hash(key)
        if fingerprint not in self._values and len(self._values) >= self.limit:
            return False
        self._values[fingerprint] = self._value(value_digest)
        return True

    def discard(self, key: str | bytes) -> None:
        self._values.pop(hash(key), None)

    def retain(self, present: set[int]) -> None:
        """Forget every key whose fingerprint (`hash(key)`) is not in `present`: keys a full scan
        did not find are gone, and one that comes back is refused (and counted) afresh."""
        for fingerprint in self._values.keys() - present:
            del self._values[fingerprint]

    def __len__(self) -> int:
        return len(self._values)
