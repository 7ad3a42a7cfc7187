"""What the policy sees: one `InstanceView` per engine and one `RequestInfo` per decision."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pilotfish.protos.cms_pb2 import InstanceStatus
    from pilotfish.scheduler.view.predictor import StepTimeModel


class InferType(enum.IntEnum):
    """The stage an instance serves; the values are cms.proto's InferType, so converting is int()."""

    UNSPECIFIED = 0
    NEUTRAL = 1
    PREFILL = 2
    DECODE = 3


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a request goes: immutable, so a decision can be kept and returned again on a retry."""

    instance_id: str
    address: str  # "host:port" of the engine's OpenAI server
    infer_type: InferType = InferType.NEUTRAL


@dataclass(slots=True)
class LrsLoad:
    """Local real-time state of one instance: load the scheduler dispatched and has not seen released.

    Updated in place at dispatch, report and release, so a decision reads it without a copy.
    """

    num_requests: int = 0
    # prompt tokens plus generated tokens of every held request
    num_tokens: int = 0
    # held requests whose prefill is done (reported prefill_done or a generated token)
    num_decode_requests: int = 0
    # prompt tokens of the held requests whose prefill is not done yet: the prefill work ahead
    # (cached prefixes included: lite mode does not know what the engine has cached)
    prefill_tokens: int = 0
    # monotonic; exported as pilotfish_scheduler_dispatch_total
    num_dispatched: int = 0


@dataclass(slots=True)
class InflightLoad:
    """Full mode: the load of requests dispatched here that no engine status has confirmed yet.

    The sums of the in-flight account's entries on this instance (view/account.py keeps them);
    zero once the engine has admitted everything it was sent.
    """

    requests: int = 0
    # prompt tokens the engine will have to compute (the target's cached prefix excluded)
    prefill_tokens: int = 0
    # requests that will decode here (neutral and decode instances)
    decode_requests: int = 0
    # tokens those requests will hold in the KV cache when they start decoding
    decode_tokens: int = 0


@dataclass(slots=True)
class EngineStatus:
    """The fields of a CMS InstanceStatus that metrics read, copied once when the status is applied.

    Plain attributes, because protobuf field access costs several times more and metrics run
    for every candidate of every decision.
    """

    update_id: int = 0
    timestamp_ms: int = 0
    step_id: int = 0
    schedulable: bool = True
    num_waiting: int = 0
    num_running: int = 0
    num_loading: int = 0
    num_waiting_prefill: int = 0
    num_running_prefill: int = 0
    num_running_decode: int = 0
    uncomputed_prefill_tokens: int = 0
    running_decode_seq_len_sum: int = 0
    used_kv_tokens: int = 0
    total_kv_tokens: int = 0
    unallocated_tokens: int = 0
    num_migrating_out: int = 0
    num_migrating_in: int = 0

    @classmethod
    def from_proto(cls, s: InstanceStatus) -> EngineStatus:
        # positional, in the fields' order: half the cost of keywords, once per status applied
        # (tests/unit/test_scheduler_view.py checks every field lands in its own)
        return cls(
            s.update_id,
            s.timestamp_ms,
            s.step_id,
            s.schedulable,
            s.num_waiting,
            s.num_running,
            s.num_loading,
            s.num_waiting_prefill,
            s.num_running_prefill,
            s.num_running_decode,
            s.uncomputed_prefill_tokens,
            s.running_decode_seq_len_sum,
            s.used_kv_tokens,
            s.total_kv_tokens,
            s.unallocated_tokens,
            s.num_migrating_out,
            s.num_migrating_in,
        )

    @property
    def num_waiting_decode(self) -> int:
        """Waiting requests past their prefill (preempted ones waiting to resume decode)."""
        return max(0, self.num_waiting - self.num_waiting_prefill)


@dataclass(slots=True, eq=False)
class InstanceView:
    """One engine as the policy sees it.

    `lrs` is the lite-mode load (kept in full mode too: it holds the decisions for retries and
    Release). Full mode adds the engine's CMS `status`, the metadata fields below and the
    in-flight account's sums; metrics that need them read those fields.
    """

    endpoint: Endpoint
    # model names the instance serves; empty means any model
    models: frozenset[str] = frozenset()
    lrs: LrsLoad = field(default_factory=LrsLoad)
    status: EngineStatus | None = None  # full mode only; None in lite mode or before the first status
    inflight: InflightLoad = field(default_factory=InflightLoad)
    # failure domains (CMS metadata); empty in lite mode
    node_id: str = ""
    unit_id: str = ""
    # full mode, from CMS metadata: the llumlet's gRPC "host:port" (Migrate, Abort; empty: none)
    # and the engine's KV-event publisher (empty: none)
    llumlet_address: str = ""
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    block_size: int = 16
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    # the online step-time fit (forward prediction); None in lite mode
    step_model: StepTimeModel | None = None

    @property
    def instance_id(self) -> str:
        return self.endpoint.instance_id

    @property
    def infer_type(self) -> InferType:
        return self.endpoint.infer_type

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """The request being scheduled, as the gateway described it (scheduler.proto ScheduleRequest)."""

    request_id: str
    model: str
    prompt_tokens: int = 0
    prefix_block_hashes: tuple[int, ...] = ()
    prefix_block_size: int = 0
    infer_type_hint: InferType = InferType.UNSPECIFIED
    max_tokens: int = 0
    stream: bool = False
    # the gateway's subset hint: when not empty, only instances at these "ip:port" may be picked
    candidate_addresses: frozenset[str] = frozenset()
