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
MIGRATION_METHOD_UNSPECIFIED: MigrationMethod
MIGRATION_METHOD_RECOMPUTE: MigrationMethod
MIGRATION_METHOD_KV_TRANSFER: MigrationMethod

class MigrateRequest(_message.Message):
    __slots__ = ("request_ids", "num_requests", "destination_instance_id", "destination_llumlet_address", "method", "reason")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_LLUMLET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_requests: int
    destination_instance_id: str
    destination_llumlet_address: str
    method: MigrationMethod
    reason: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_requests: _Optional[int] = ..., destination_instance_id: _Optional[str] = ..., destination_llumlet_address: _Optional[str] = ..., method: _Optional[_Union[MigrationMethod, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("migrated_request_ids", "failed_request_ids", "error")
    MIGRATED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    migrated_request_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, migrated_request_ids: _Optional[_Iterable[str]] = ..., failed_request_ids: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

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
