"""What metrics and filters read besides the instance: the clock, the prefix index, the profile.

One `PolicyContext` per core, shared by every stage of its policy. `begin(req)` starts a
decision: it reads the wall clock once (staleness and forward prediction use that one `now`,
so a decision is consistent) and clears the per-request prefix match, which the cache
metrics then compute once and share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables
from pilotfish.scheduler.view.types import RequestInfo


def _config_default(name: str) -> Any:
    """SchedulerConfig's default for `name`: a context built without a config (tests, ad-hoc use) agrees
    with one built from the default config (registry.context_from_config), and neither holds its own."""
    return next(f.default for f in msgspec.structs.fields(SchedulerConfig) if f.name == name)


@dataclass(eq=False)
class PolicyContext:
    wall_clock: Callable[[], float] = time.time
    # full mode reads the CMS status and the in-flight account; lite mode the LRS
    full_mode: bool = False
    prefix_index: PrefixIndex | None = None
    tables: LatencyTables = field(default_factory=lambda: LatencyTables(LatencyProfile()))
    # forward-predict prefill progress since the status (predictor-enhanced scheduling)
    predictor_enhanced: bool = False
    instance_staleness_seconds: float = field(default_factory=lambda: _config_default("instance_staleness_seconds"))
    # block size the prefix hashes cover when the request does not say: the gateway's
    default_block_size: int = field(default_factory=lambda: _config_default("kv_events_prefix_block_size"))
    # an engine's token budget per step when its metadata does not say
    default_token_budget: int = field(default_factory=lambda: _config_default("default_max_num_batched_tokens"))
    now: float = 0.0
    _req: RequestInfo | None = None
    _hits: dict[str, int] | None = None

    def begin(self, req: RequestInfo) -> None:
        self.now = self.wall_clock()
        self._req = req
        self._hits = None

    def prefix_hits(self, req: RequestInfo) -> dict[str, int]:
        """Cached prefix tokens per instance id for `req` (instances without a hit are absent)."""
        if self._hits is None or self._req is not req:
            self._req = req
            index = self.prefix_index
            if index is None or not req.prefix_block_hashes:
                self._hits = {}
            else:
                size = req.prefix_block_size or self.default_block_size
                self._hits = index.match(req.prefix_block_hashes, size)
        return self._hits

    def prefix_hit_lengths(self, req: RequestInfo) -> Collection[int]:
        """The distinct values of `prefix_hits(req)`, which the prefix index keeps with its match."""
        index = self.prefix_index
        if index is None or not req.prefix_block_hashes:
            return ()
        return index.hit_lengths(req.prefix_block_hashes, req.prefix_block_size or self.default_block_size)

    def elapsed_since(self, timestamp_ms: int) -> float:
        """Seconds from a status's timestamp to this decision, within [0, staleness window]."""
        if not self.now:
            self.now = self.wall_clock()
        elapsed = self.now - timestamp_ms / 1000.0
        if elapsed <= 0:
            return 0.0
        return min(elapsed, self.instance_staleness_seconds)


_DEFAULT: PolicyContext | None = None


def default_context() -> PolicyContext:
    """A context for stages built without one (tests, ad-hoc use): wall clock, no prefix index."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PolicyContext()
    return _DEFAULT
