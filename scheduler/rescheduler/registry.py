"""Name -> class for every rescheduling policy: adding one is one class and one `register` line."""

from __future__ import annotations

from pilotfish.scheduler.policy.registry import Registry
from pilotfish.scheduler.rescheduler.policies.base import ReschedulingPolicy
from pilotfish.scheduler.rescheduler.policies.binpacking import BinpackingConsolidation, BinpackingMitigation
from pilotfish.scheduler.rescheduler.policies.failover import DecodeFailover, NeutralFailover, PrefillFailover
from pilotfish.scheduler.rescheduler.policies.load_balance import DecodeLoad, NeutralLoad

RESCHEDULING_POLICIES: Registry[ReschedulingPolicy] = Registry("rescheduling policy")
RESCHEDULING_POLICIES.register(DecodeLoad)
RESCHEDULING_POLICIES.register(NeutralLoad)
RESCHEDULING_POLICIES.register(PrefillFailover)
RESCHEDULING_POLICIES.register(DecodeFailover)
RESCHEDULING_POLICIES.register(NeutralFailover)
RESCHEDULING_POLICIES.register(BinpackingMitigation)
RESCHEDULING_POLICIES.register(BinpackingConsolidation)
