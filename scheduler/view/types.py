"""What the policy sees: one `InstanceView` per engine and one `RequestInfo` per decision."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pilotfish.protos.cms_pb2 import InstanceStatus


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
    # monotonic; exported as pilotfish_scheduler_dispatch_total
    num_dispatched: int = 0


@dataclass(slots=True, eq=False)
class InstanceView:
    """One engine as the policy sees it.

    `lrs` is the lite-mode load. Full mode adds the engine's CMS status (forward-predicted to
    the decision time) and the in-flight account beside it; metrics that need them read those
    fields, lite metrics keep reading `lrs`.
    """

    endpoint: Endpoint
    # model names the instance serves; empty means any model
    models: frozenset[str] = frozenset()
    lrs: LrsLoad = field(default_factory=LrsLoad)
    status: InstanceStatus | None = None  # full mode only; None in lite mode

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
