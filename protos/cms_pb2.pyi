from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFER_TYPE_UNSPECIFIED: _ClassVar[InferType]
    INFER_TYPE_NEUTRAL: _ClassVar[InferType]
    INFER_TYPE_PREFILL: _ClassVar[InferType]
    INFER_TYPE_DECODE: _ClassVar[InferType]
INFER_TYPE_UNSPECIFIED: InferType
INFER_TYPE_NEUTRAL: InferType
INFER_TYPE_PREFILL: InferType
INFER_TYPE_DECODE: InferType

class InstanceMetadata(_message.Message):
    __slots__ = ("instance_id", "host", "http_port", "llumlet_port", "model", "infer_type", "block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "dp_rank", "dp_size", "node_id", "unit_id", "update_id", "timestamp_ms", "kv_events_endpoint", "kv_events_topic")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    LLUMLET_PORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INFER_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    host: str
    http_port: int
    llumlet_port: int
    model: str
    infer_type: InferType
    block_size: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    dp_rank: int
    dp_size: int
    node_id: str
    unit_id: str
    update_id: int
    timestamp_ms: int
    kv_events_endpoint: str
    kv_events_topic: str
    def __init__(self, instance_id: _Optional[str] = ..., host: _Optional[str] = ..., http_port: _Optional[int] = ..., llumlet_port: _Optional[int] = ..., model: _Optional[str] = ..., infer_type: _Optional[_Union[InferType, str]] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., node_id: _Optional[str] = ..., unit_id: _Optional[str] = ..., update_id: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_topic: _Optional[str] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "update_id", "timestamp_ms", "step_id", "schedulable", "num_waiting", "num_running", "num_loading", "num_waiting_prefill", "num_running_prefill", "num_running_decode", "uncomputed_prefill_tokens", "running_decode_seq_len_sum", "used_kv_tokens", "total_kv_tokens", "unallocated_tokens", "last_step_duration_us", "last_step_prefill_tokens", "last_step_decode_batch", "last_step_seq_len_sum", "admitted_request_ids", "num_preempted_total", "num_migrating_out", "num_migrating_in", "epoch", "num_finished_total", "finished_output_tokens_total", "admitted_total")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_DECODE_FIELD_NUMBER: _ClassVar[int]
    UNCOMPUTED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_DECODE_SEQ_LEN_SUM_FIELD_NUMBER: _ClassVar[int]
    USED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNALLOCATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_DURATION_US_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_SEQ_LEN_SUM_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATING_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATING_IN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_OUTPUT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    update_id: int
    timestamp_ms: int
    step_id: int
    schedulable: bool
    num_waiting: int
    num_running: int
    num_loading: int
    num_waiting_prefill: int
    num_running_prefill: int
    num_running_decode: int
    uncomputed_prefill_tokens: int
    running_decode_seq_len_sum: int
    used_kv_tokens: int
    total_kv_tokens: int
    unallocated_tokens: int
    last_step_duration_us: int
    last_step_prefill_tokens: int
    last_step_decode_batch: int
    last_step_seq_len_sum: int
    admitted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_preempted_total: int
    num_migrating_out: int
    num_migrating_in: int
    epoch: int
    num_finished_total: int
    finished_output_tokens_total: int
    admitted_total: int
    def __init__(self, instance_id: _Optional[str] = ..., update_id: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., step_id: _Optional[int] = ..., schedulable: _Optional[bool] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_loading: _Optional[int] = ..., num_waiting_prefill: _Optional[int] = ..., num_running_prefill: _Optional[int] = ..., num_running_decode: _Optional[int] = ..., uncomputed_prefill_tokens: _Optional[int] = ..., running_decode_seq_len_sum: _Optional[int] = ..., used_kv_tokens: _Optional[int] = ..., total_kv_tokens: _Optional[int] = ..., unallocated_tokens: _Optional[int] = ..., last_step_duration_us: _Optional[int] = ..., last_step_prefill_tokens: _Optional[int] = ..., last_step_decode_batch: _Optional[int] = ..., last_step_seq_len_sum: _Optional[int] = ..., admitted_request_ids: _Optional[_Iterable[str]] = ..., num_preempted_total: _Optional[int] = ..., num_migrating_out: _Optional[int] = ..., num_migrating_in: _Optional[int] = ..., epoch: _Optional[int] = ..., num_finished_total: _Optional[int] = ..., finished_output_tokens_total: _Optional[int] = ..., admitted_total: _Optional[int] = ...) -> None: ...
