"""binpacking_mitigation and binpacking_consolidation: adaptive PD's rescheduling, by predicted TPOT.

Both look at decode instances only, healthy and not prefill-reserved, and return at most one pair
per cycle. Predicted TPOT is the scheduler's `predicted_tpot` metric for a request-free probe:
the TPOT the decode batch would have with one more request, which is what a migrated request
joining a destination sees (and what the slo policy's dispatch filter compares).

- mitigation: the instance furthest above tpot-slo x --tpot-migrate-out-ceil-threshold sends
  requests (the configured rule, order and value) to the least-loaded one below
  tpot-slo x --tpot-slo-dispatch-threshold;
- consolidation: the least-loaded instance below tpot-slo x --tpot-migrate-out-floor-threshold
  that decodes anything sends all its running requests to the most-loaded one still below
  tpot-slo x --tpot-slo-dispatch-threshold (and at least as loaded), freeing it for prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pilotfish.config import ConfigError
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.metrics.latency import PredictedTpot
from pilotfish.scheduler.policy.metrics.load import DecodeBatchSize
from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
from pilotfish.scheduler.rescheduler.types import PROBE, MigrationPair
from pilotfish.scheduler.view.types import InferType, InstanceView

# "decode batch size > 0.1": at least one decode request
MIN_DECODE_BATCH = 0.1
# consolidation empties its source: every running request, shortest first
DRAIN = {"rule": "RATIO", "order": "SR", "value": 1.0}


def prefill_reserved(inst: InstanceView) -> bool:
    """A decode instance adaptive PD has given prefill work (it prefills now): neither sends nor
    receives decode requests, so the prefill it was freed for is not slowed down."""
    s = inst.status
    return s is not None and (s.num_waiting_prefill + s.num_running_prefill > 0 or s.uncomputed_prefill_tokens > 0)


@dataclass(frozen=True, slots=True)
class _Decode:
    inst: InstanceView
    tpot: float
    batch: float


class BinpackingPolicy(ReschedulingPolicy):
    infer_type = InferType.DECODE

    @classmethod
    def check_config(cls, config: SchedulerConfig) -> None:
        if not config.tpot_slo:
            raise ConfigError(f"--tpot-slo: {cls.name} compares predicted TPOT with the SLO; give it in ms")
        ceil, floor = config.tpot_migrate_out_ceil_threshold, config.tpot_migrate_out_floor_threshold
        if floor >= ceil:
            raise ConfigError(
                f"--tpot-migrate-out-floor-threshold: {floor:g} is not below --tpot-migrate-out-ceil-threshold {ceil:g}"
            )
        if config.tpot_slo_dispatch_threshold > ceil:
            # a mitigation destination could then be a mitigation source the cycle after
            raise ConfigError(
                f"--tpot-slo-dispatch-threshold: {config.tpot_slo_dispatch_threshold:g} is above "
                f"--tpot-migrate-out-ceil-threshold {ceil:g} (0.85 is a usual choice)"
            )

    def __init__(self, config: SchedulerConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self._tpot = PredictedTpot(ctx)
        self._batch = DecodeBatchSize(ctx)
        self.dispatch_limit = config.tpot_slo * config.tpot_slo_dispatch_threshold

    def decode_instances(self, instances: Sequence[InstanceView]) -> list[_Decode]:
        return [
            _Decode(i, self._tpot.value(i, PROBE), self._batch.value(i, PROBE))
            for i in self.balanced(instances)
            if not prefill_reserved(i)
        ]


class BinpackingMitigation(BinpackingPolicy):
    name = "binpacking_mitigation"

    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        ceil = self.config.tpot_slo * self.config.tpot_migrate_out_ceil_threshold
        decode = self.decode_instances(instances)
        sources = [d for d in decode if d.tpot >= ceil]
        destinations = [d for d in decode if d.tpot < self.dispatch_limit]
        if not sources or not destinations:
            return []
        src = max(sources, key=lambda d: (d.tpot, d.inst.instance_id))
        dst = min(destinations, key=lambda d: (d.tpot, d.inst.instance_id))
        return [self.pair(src.inst, dst.inst)]


class BinpackingConsolidation(BinpackingPolicy):
    name = "binpacking_consolidation"

    def pairs(self, instances: Sequence[InstanceView]) -> list[MigrationPair]:
        floor = self.config.tpot_slo * self.config.tpot_migrate_out_floor_threshold
        decode = [d for d in self.decode_instances(instances) if d.batch > MIN_DECODE_BATCH]
        sources = [d for d in decode if d.tpot < floor]
        if not sources:
            return []
        src = min(sources, key=lambda d: (d.tpot, d.batch, d.inst.instance_id))
        # at least as loaded as the source: packing never runs downhill, so two light
        # instances do not trade their requests back and forth
        destinations = [d for d in decode if d is not src and src.tpot <= d.tpot < self.dispatch_limit]
        if not destinations:
            return []
        dst = max(destinations, key=lambda d: (d.tpot, d.inst.instance_id))
        return [self.pair(src.inst, dst.inst, **DRAIN)]
