"""inferTypeFilter: block instances whose infer type is not the stage being scheduled."""

from __future__ import annotations

from typing import Any

from pilotfish.config import ConfigError
from pilotfish.scheduler.policy.base import Candidate, InstanceFilter
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.view.types import InferType, RequestInfo


class InferTypeFilter(InstanceFilter):
    """Passes an instance whose infer type is `infer_type` (neutral, prefill or decode)."""

    name = "infer_type"

    def __init__(
        self, infer_type: str = "neutral", *, not_skip_when_fallback: bool = True, ctx: PolicyContext | None = None
    ) -> None:
        super().__init__(not_skip_when_fallback=not_skip_when_fallback)
        try:
            self.infer_type = InferType[infer_type.upper()]
        except KeyError:
            raise ConfigError(f"infer_type filter: unknown infer type {infer_type!r}") from None

    def params(self) -> dict[str, Any]:
        return {"infer_type": self.infer_type.name.lower()}

    def passes(self, cand: Candidate, req: RequestInfo) -> bool:
        return cand.inst.infer_type == self.infer_type
