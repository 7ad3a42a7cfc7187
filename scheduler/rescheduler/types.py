"""What the planner hands the dispatcher (a pair) and what the dispatcher reports back (a result)."""

from __future__ import annotations

from dataclasses import dataclass

from pilotfish.scheduler.view.types import InstanceView, RequestInfo

# Metrics take a request; rescheduling judges instances alone, as the telemetry scrape does.
PROBE = RequestInfo(request_id="", model="")


@dataclass(frozen=True, slots=True, eq=False)
class MigrationPair:
    """Move some requests from `source` to `destination`, chosen on the source by rule, order and value.

    `rule` is NUM_REQ, TOKEN or RATIO, `order` LCR, FCR, LR, SR, FCW or FCWSR
    and `method` auto, recompute or kv_transfer: llumlet.proto's names (protos/migration_selection.py).
    """

    source: InstanceView
    destination: InstanceView
    policy: str
    rule: str
    order: str
    value: float
    method: str = "auto"

    def __repr__(self) -> str:
        return (
            f"MigrationPair({self.policy}: {self.source.instance_id} -> {self.destination.instance_id}, "
            f"{self.rule} {self.order} {self.value:g})"
        )


@dataclass(frozen=True, slots=True)
class MigrationResult:
    """One Migrate call: `reason` is empty on success, else a short label (the failure counter's)."""

    pair: MigrationPair
    migrated: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    reason: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason
