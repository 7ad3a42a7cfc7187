"""What the llumlet's writers share: the backoff while Redis is away and the line they log about themselves."""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("pilotfish.llumlet")

# Backoff while Redis is unreachable: the state keeps changing meanwhile and only the latest
# matters, so a short cap gets the CMS current again soon after Redis returns.
BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class Outage:
    """A writer's failed CMS writes: one WARNING as an outage starts and one as it ends, the backoff between."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.failures = 0  # in a row, the current outage
        self.total = 0

    def failed(self, exc: Exception) -> float:
        """Count a failure; the seconds to wait before the next try."""
        self.total += 1
        if self.failures == 0:
            log.warning("llumlet %s: CMS write failed, retrying with backoff: %s", self.instance_id, exc)
        self.failures += 1
        return BACKOFF_S[min(self.failures, len(BACKOFF_S)) - 1]

    def succeeded(self) -> None:
        if self.failures:
            log.warning("llumlet %s: CMS reachable again after %d failed writes", self.instance_id, self.failures)
        self.failures = 0


def export_summary(
    exports: int,
    staleness_us: Sequence[float],
    *,
    where: str,
    steps: int = 0,
    hook_cpu_ns: int = 0,
    engine_cpu_ns: int = 0,
    exporter_cpu_ns: int = 0,
    exporter: str = "export thread",
    inline_exports: int = 0,
    inline_write_cpu_ns: int = 0,
    extra: str = "",
) -> str:
    """One line: writes, event -> Redis staleness, and (with the hooks' CPU accounted) CPU per step.

    `bench llumlet` reads it from vLLM's log: keep the figures' words ('hooks', the exporter's
    name, 'writing') before their 'N us'.
    """
    if not staleness_us:
        return "no load changes exported" + extra
    ordered = sorted(staleness_us)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    text = (
        f"{exports} status writes ({where}); "
        f"event -> Redis staleness p50 {pick(0.5):.0f} us, "
        f"p99 {pick(0.99):.0f} us, max {ordered[-1]:.0f} us over the last {len(ordered)} writes"
    )
    if steps and hook_cpu_ns and engine_cpu_ns > 0:
        text += (
            f"; CPU per step: hooks {hook_cpu_ns / steps / 1000:.1f} us "
            f"({100 * hook_cpu_ns / engine_cpu_ns:.2f}% of the engine thread's "
            f"{engine_cpu_ns / steps / 1000:.0f} us), {exporter} {exporter_cpu_ns / steps / 1000:.1f} us"
        )
        if inline_exports:
            writes = inline_exports / steps
            text += f"; of the hooks, writing {inline_write_cpu_ns / steps / 1000:.1f} us ({writes:.2f} writes)"
    return text + extra
