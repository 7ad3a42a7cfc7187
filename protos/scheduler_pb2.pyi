from pilotfish.protos import cms_pb2 as _cms_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_CRITICAL: _ClassVar[Priority]
    PRIORITY_STANDARD: _ClassVar[Priority]
    PRIORITY_SHEDDABLE: _ClassVar[Priority]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_FINISHED: _ClassVar[ReleaseReason]
    RELEASE_REASON_CLIENT_ABORT: _ClassVar[ReleaseReason]
    RELEASE_REASON_UPSTREAM_ERROR: _ClassVar[ReleaseReason]
    RELEASE_REASON_GATEWAY_ERROR: _ClassVar[ReleaseReason]
    RELEASE_REASON_UPSTREAM_RESET: _ClassVar[ReleaseReason]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_CRITICAL: Priority
PRIORITY_STANDARD: Priority
PRIORITY_SHEDDABLE: Priority
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_FINISHED: ReleaseReason
RELEASE_REASON_CLIENT_ABORT: ReleaseReason
RELEASE_REASON_UPSTREAM_ERROR: ReleaseReason
RELEASE_REASON_GATEWAY_ERROR: ReleaseReason
RELEASE_REASON_UPSTREAM_RESET: ReleaseReason

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "prefix_block_hashes", "prefix_block_size", "infer_type_hint", "max_tokens", "stream", "candidate_addresses", "traceparent", "priority", "flow", "queue_timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INFER_TYPE_HINT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    prefix_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    prefix_block_size: int
    infer_type_hint: _cms_pb2.InferType
    max_tokens: int
    stream: bool
    candidate_addresses: _containers.RepeatedScalarFieldContainer[str]
    traceparent: str
    priority: Priority
    flow: str
    queue_timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prefix_block_hashes: _Optional[_Iterable[int]] = ..., prefix_block_size: _Optional[int] = ..., infer_type_hint: _Optional[_Union[_cms_pb2.InferType, str]] = ..., max_tokens: _Optional[int] = ..., stream: _Optional[bool] = ..., candidate_addresses: _Optional[_Iterable[str]] = ..., traceparent: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., flow: _Optional[str] = ..., queue_timeout_ms: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("instance_id", "address", "infer_type")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INFER_TYPE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    infer_type: _cms_pb2.InferType
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., infer_type: _Optional[_Union[_cms_pb2.InferType, str]] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("target", "decode_target", "fallbacks")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    target: Endpoint
    decode_target: Endpoint
    fallbacks: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, target: _Optional[_Union[Endpoint, _Mapping]] = ..., decode_target: _Optional[_Union[Endpoint, _Mapping]] = ..., fallbacks: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class TokenReport(_message.Message):
    __slots__ = ("request_id", "generated_tokens", "prefill_done", "served_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    SERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    prefill_done: bool
    served_address: str
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., prefill_done: _Optional[bool] = ..., served_address: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[TokenReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[TokenReport, _Mapping]]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("unknown_requests",)
    UNKNOWN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    unknown_requests: int
    def __init__(self, unknown_requests: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reason", "generated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: ReleaseReason
    generated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("seq", "schedule", "report", "release")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    schedule: ScheduleRequest
    report: ReportRequest
    release: ReleaseRequest
    def __init__(self, seq: _Optional[int] = ..., schedule: _Optional[_Union[ScheduleRequest, _Mapping]] = ..., report: _Optional[_Union[ReportRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("seq", "schedule", "error", "queued")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    schedule: ScheduleResponse
    error: SessionError
    queued: QueuedNotice
    def __init__(self, seq: _Optional[int] = ..., schedule: _Optional[_Union[ScheduleResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., queued: _Optional[_Union[QueuedNotice, _Mapping]] = ...) -> None: ...

class QueuedNotice(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
