from pilotfish.protos import cms_pb2 as _cms_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_METHOD_UNSPECIFIED: _ClassVar[MigrationMethod]
    MIGRATION_METHOD_RECOMPUTE: _ClassVar[MigrationMethod]
    MIGRATION_METHOD_KV_TRANSFER: _ClassVar[MigrationMethod]

class SelectRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SELECT_RULE_UNSPECIFIED: _ClassVar[SelectRule]
    SELECT_RULE_NUM_REQ: _ClassVar[SelectRule]
    SELECT_RULE_TOKEN: _ClassVar[SelectRule]
    SELECT_RULE_RATIO: _ClassVar[SelectRule]

class SelectOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SELECT_ORDER_UNSPECIFIED: _ClassVar[SelectOrder]
    SELECT_ORDER_LCR: _ClassVar[SelectOrder]
    SELECT_ORDER_FCR: _ClassVar[SelectOrder]
    SELECT_ORDER_LR: _ClassVar[SelectOrder]
    SELECT_ORDER_SR: _ClassVar[SelectOrder]
    SELECT_ORDER_FCW: _ClassVar[SelectOrder]
    SELECT_ORDER_FCWSR: _ClassVar[SelectOrder]
MIGRATION_METHOD_UNSPECIFIED: MigrationMethod
MIGRATION_METHOD_RECOMPUTE: MigrationMethod
MIGRATION_METHOD_KV_TRANSFER: MigrationMethod
SELECT_RULE_UNSPECIFIED: SelectRule
SELECT_RULE_NUM_REQ: SelectRule
SELECT_RULE_TOKEN: SelectRule
SELECT_RULE_RATIO: SelectRule
SELECT_ORDER_UNSPECIFIED: SelectOrder
SELECT_ORDER_LCR: SelectOrder
SELECT_ORDER_FCR: SelectOrder
SELECT_ORDER_LR: SelectOrder
SELECT_ORDER_SR: SelectOrder
SELECT_ORDER_FCW: SelectOrder
SELECT_ORDER_FCWSR: SelectOrder

class MigrateRequest(_message.Message):
    __slots__ = ("request_ids", "num_requests", "destination_instance_id", "destination_llumlet_address", "method", "reason", "source_instance_id", "select_rule", "select_order", "select_value")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_LLUMLET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SELECT_RULE_FIELD_NUMBER: _ClassVar[int]
    SELECT_ORDER_FIELD_NUMBER: _ClassVar[int]
    SELECT_VALUE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_requests: int
    destination_instance_id: str
    destination_llumlet_address: str
    method: MigrationMethod
    reason: str
    source_instance_id: str
    select_rule: SelectRule
    select_order: SelectOrder
    select_value: float
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_requests: _Optional[int] = ..., destination_instance_id: _Optional[str] = ..., destination_llumlet_address: _Optional[str] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., reason: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., select_rule: _Optional[_Union[SelectRule, str]] = ..., select_order: _Optional[_Union[SelectOrder, str]] = ..., select_value: _Optional[float] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("migrated_request_ids", "failed_request_ids", "error")
    MIGRATED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    migrated_request_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, migrated_request_ids: _Optional[_Iterable[str]] = ..., failed_request_ids: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class MigrateInRequest(_message.Message):
    __slots__ = ("request_id", "source_instance_id", "prompt_token_ids", "output_token_ids", "max_tokens", "sampling_params_json", "method", "arrival_time_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_instance_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling_params_json: bytes
    method: MigrationMethod
    arrival_time_ms: int
    def __init__(self, request_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling_params_json: _Optional[bytes] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., arrival_time_ms: _Optional[int] = ...) -> None: ...

class MigrateInChunk(_message.Message):
    __slots__ = ("accepted", "token_ids", "finish_reason", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
