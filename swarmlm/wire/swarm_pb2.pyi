from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queued_s", "compute_s", "parse_s", "encode_s", "batched_steps")
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PARSE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    compute_s: float
    parse_s: float
    encode_s: float
    batched_steps: int
    def __init__(self, queued_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., parse_s: _Optional[float] = ..., encode_s: _Optional[float] = ..., batched_steps: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("start_block", "end_block", "batch_size", "max_length", "adapter", "prefix_scope", "prefix_keys", "prompts", "lora", "key_share")
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    start_block: int
    end_block: int
    batch_size: int
    max_length: int
    adapter: str
    prefix_scope: bytes
    prefix_keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompts: Tensor
    lora: _containers.RepeatedCompositeFieldContainer[LoraWeights]
    key_share: bytes
    def __init__(self, start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., batch_size: _Optional[int] = ..., max_length: _Optional[int] = ..., adapter: _Optional[str] = ..., prefix_scope: _Optional[bytes] = ..., prefix_keys: _Optional[_Iterable[bytes]] = ..., prompts: _Optional[_Union[Tensor, _Mapping]] = ..., lora: _Optional[_Iterable[_Union[LoraWeights, _Mapping]]] = ..., key_share: _Optional[bytes] = ...) -> None: ...

class PrefixSave(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PushTarget(_message.Message):
    __slots__ = ("address", "session_id", "step_id", "secret", "push_key")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    PUSH_KEY_FIELD_NUMBER: _ClassVar[int]
    address: str
    session_id: str
    step_id: int
    secret: bytes
    push_key: bytes
    def __init__(self, address: _Optional[str] = ..., session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., secret: _Optional[bytes] = ..., push_key: _Optional[bytes] = ...) -> None: ...

class CacheOp(_message.Message):
    __slots__ = ("truncate_to", "rows")
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    truncate_to: int
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, truncate_to: _Optional[int] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class InferenceStep(_message.Message):
    __slots__ = ("hidden", "attention_mask", "step_id", "push", "cache_op", "keep_route")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    CACHE_OP_FIELD_NUMBER: _ClassVar[int]
    KEEP_ROUTE_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    attention_mask: Tensor
    step_id: int
    push: _containers.RepeatedCompositeFieldContainer[PushTarget]
    cache_op: CacheOp
    keep_route: bool
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., step_id: _Optional[int] = ..., push: _Optional[_Iterable[_Union[PushTarget, _Mapping]]] = ..., cache_op: _Optional[_Union[CacheOp, _Mapping]] = ..., keep_route: _Optional[bool] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("session_id", "open", "step", "save", "secret", "mac")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    open: OpenSession
    step: InferenceStep
    save: PrefixSave
    secret: bytes
    mac: bytes
    def __init__(self, session_id: _Optional[str] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., save: _Optional[_Union[PrefixSave, _Mapping]] = ..., secret: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class InferenceReply(_message.Message):
    __slots__ = ("session_id", "hidden", "timing", "step_id", "position", "error", "pushed", "session_secret", "prefix_tokens", "mac")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hidden: Tensor
    timing: Timing
    step_id: int
    position: int
    error: Error
    pushed: bool
    session_secret: bytes
    prefix_tokens: int
    mac: bytes
    def __init__(self, session_id: _Optional[str] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., step_id: _Optional[int] = ..., position: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., pushed: _Optional[bool] = ..., session_secret: _Optional[bytes] = ..., prefix_tokens: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("session_id", "step", "secret", "mac")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: InferenceStep
    secret: bytes
    mac: bytes
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., secret: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("start_block", "end_block", "hidden", "attention_mask", "prompts", "lora")
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    start_block: int
    end_block: int
    hidden: Tensor
    attention_mask: Tensor
    prompts: Tensor
    lora: _containers.RepeatedCompositeFieldContainer[LoraWeights]
    def __init__(self, start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., prompts: _Optional[_Union[Tensor, _Mapping]] = ..., lora: _Optional[_Iterable[_Union[LoraWeights, _Mapping]]] = ...) -> None: ...

class LoraWeights(_message.Message):
    __slots__ = ("block", "module", "a", "b", "scale")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    block: int
    module: str
    a: Tensor
    b: Tensor
    scale: float
    def __init__(self, block: _Optional[int] = ..., module: _Optional[str] = ..., a: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("start_block", "end_block", "hidden", "attention_mask", "grad_output", "prompts", "lora")
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    start_block: int
    end_block: int
    hidden: Tensor
    attention_mask: Tensor
    grad_output: Tensor
    prompts: Tensor
    lora: _containers.RepeatedCompositeFieldContainer[LoraWeights]
    def __init__(self, start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., grad_output: _Optional[_Union[Tensor, _Mapping]] = ..., prompts: _Optional[_Union[Tensor, _Mapping]] = ..., lora: _Optional[_Iterable[_Union[LoraWeights, _Mapping]]] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("grad_hidden", "grad_prompts", "grad_lora", "timing")
    GRAD_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    GRAD_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_LORA_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    grad_hidden: Tensor
    grad_prompts: Tensor
    grad_lora: _containers.RepeatedCompositeFieldContainer[LoraWeights]
    timing: Timing
    def __init__(self, grad_hidden: _Optional[_Union[Tensor, _Mapping]] = ..., grad_prompts: _Optional[_Union[Tensor, _Mapping]] = ..., grad_lora: _Optional[_Iterable[_Union[LoraWeights, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("hidden", "timing")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    timing: Timing
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("server_id", "model", "start_block", "end_block", "num_blocks", "hidden_size", "dtype", "cache_bytes_total", "cache_bytes_free", "active_sessions", "queue_length", "max_length", "max_batch", "max_message_bytes", "decode_s_per_block", "prefill_a_s", "prefill_b_s", "version", "protocol", "session_bytes_per_block_token", "fingerprint", "quant", "weight_bytes", "adapters", "kv_dtype", "decode_4rows_s_per_block", "decode_16rows_s_per_block", "prefix_cache", "tokens_computed", "gc", "public_key", "signature", "signed_address", "key_share", "frame_port")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_A_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_B_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_PER_BLOCK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_4ROWS_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DECODE_16ROWS_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    GC_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    model: str
    start_block: int
    end_block: int
    num_blocks: int
    hidden_size: int
    dtype: str
    cache_bytes_total: int
    cache_bytes_free: int
    active_sessions: int
    queue_length: int
    max_length: int
    max_batch: int
    max_message_bytes: int
    decode_s_per_block: float
    prefill_a_s: float
    prefill_b_s: float
    version: str
    protocol: int
    session_bytes_per_block_token: int
    fingerprint: str
    quant: str
    weight_bytes: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    kv_dtype: str
    decode_4rows_s_per_block: float
    decode_16rows_s_per_block: float
    prefix_cache: PrefixCacheInfo
    tokens_computed: int
    gc: GcInfo
    public_key: bytes
    signature: bytes
    signed_address: str
    key_share: bytes
    frame_port: int
    def __init__(self, server_id: _Optional[str] = ..., model: _Optional[str] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., cache_bytes_total: _Optional[int] = ..., cache_bytes_free: _Optional[int] = ..., active_sessions: _Optional[int] = ..., queue_length: _Optional[int] = ..., max_length: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., decode_s_per_block: _Optional[float] = ..., prefill_a_s: _Optional[float] = ..., prefill_b_s: _Optional[float] = ..., version: _Optional[str] = ..., protocol: _Optional[int] = ..., session_bytes_per_block_token: _Optional[int] = ..., fingerprint: _Optional[str] = ..., quant: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., kv_dtype: _Optional[str] = ..., decode_4rows_s_per_block: _Optional[float] = ..., decode_16rows_s_per_block: _Optional[float] = ..., prefix_cache: _Optional[_Union[PrefixCacheInfo, _Mapping]] = ..., tokens_computed: _Optional[int] = ..., gc: _Optional[_Union[GcInfo, _Mapping]] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., signed_address: _Optional[str] = ..., key_share: _Optional[bytes] = ..., frame_port: _Optional[int] = ...) -> None: ...

class PrefixCacheInfo(_message.Message):
    __slots__ = ("limit_bytes", "bytes", "entries", "hits", "hit_tokens", "evictions", "tags")
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    limit_bytes: int
    bytes: int
    entries: int
    hits: int
    hit_tokens: int
    evictions: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, limit_bytes: _Optional[int] = ..., bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class GcInfo(_message.Message):
    __slots__ = ("collections", "seconds", "longest_s", "frozen_objects")
    COLLECTIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LONGEST_S_FIELD_NUMBER: _ClassVar[int]
    FROZEN_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    collections: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    longest_s: _containers.RepeatedScalarFieldContainer[float]
    frozen_objects: int
    def __init__(self, collections: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ..., longest_s: _Optional[_Iterable[float]] = ..., frozen_objects: _Optional[int] = ...) -> None: ...
