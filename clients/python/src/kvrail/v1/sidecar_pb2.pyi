from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockInterior(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_INTERIOR_UNSPECIFIED: _ClassVar[BlockInterior]
    BLOCK_INTERIOR_NHD: _ClassVar[BlockInterior]
    BLOCK_INTERIOR_HND: _ClassVar[BlockInterior]
    BLOCK_INTERIOR_HEAD_OPAQUE: _ClassVar[BlockInterior]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_QUEUED: _ClassVar[TransferState]
    TRANSFER_STATE_IN_FLIGHT: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]

class FailureSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_SIDE_UNSPECIFIED: _ClassVar[FailureSide]
    FAILURE_SIDE_LOCAL: _ClassVar[FailureSide]
    FAILURE_SIDE_PEER: _ClassVar[FailureSide]
    FAILURE_SIDE_RAIL: _ClassVar[FailureSide]
    FAILURE_SIDE_TIMEOUT: _ClassVar[FailureSide]
    FAILURE_SIDE_CANCELLED: _ClassVar[FailureSide]

class NotificationKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTIFICATION_KIND_UNSPECIFIED: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_PUSH_DONE: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_PUSH_RECEIVED: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_PULL_DONE: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_PULL_SERVED: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_FAILED: _ClassVar[NotificationKind]
    NOTIFICATION_KIND_MESSAGE: _ClassVar[NotificationKind]
BLOCK_INTERIOR_UNSPECIFIED: BlockInterior
BLOCK_INTERIOR_NHD: BlockInterior
BLOCK_INTERIOR_HND: BlockInterior
BLOCK_INTERIOR_HEAD_OPAQUE: BlockInterior
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_QUEUED: TransferState
TRANSFER_STATE_IN_FLIGHT: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState
FAILURE_SIDE_UNSPECIFIED: FailureSide
FAILURE_SIDE_LOCAL: FailureSide
FAILURE_SIDE_PEER: FailureSide
FAILURE_SIDE_RAIL: FailureSide
FAILURE_SIDE_TIMEOUT: FailureSide
FAILURE_SIDE_CANCELLED: FailureSide
NOTIFICATION_KIND_UNSPECIFIED: NotificationKind
NOTIFICATION_KIND_PUSH_DONE: NotificationKind
NOTIFICATION_KIND_PUSH_RECEIVED: NotificationKind
NOTIFICATION_KIND_PULL_DONE: NotificationKind
NOTIFICATION_KIND_PULL_SERVED: NotificationKind
NOTIFICATION_KIND_FAILED: NotificationKind
NOTIFICATION_KIND_MESSAGE: NotificationKind

class RegionLayout(_message.Message):
    __slots__ = ("num_layers", "planes_per_layer", "num_blocks", "block_bytes", "base_offset", "layer_stride", "plane_stride", "block_stride")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PLANES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PLANE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    planes_per_layer: int
    num_blocks: int
    block_bytes: int
    base_offset: int
    layer_stride: int
    plane_stride: int
    block_stride: int
    def __init__(self, num_layers: _Optional[int] = ..., planes_per_layer: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., base_offset: _Optional[int] = ..., layer_stride: _Optional[int] = ..., plane_stride: _Optional[int] = ..., block_stride: _Optional[int] = ...) -> None: ...

class KvGeometry(_message.Message):
    __slots__ = ("model", "dtype", "element_bytes", "head_size", "model_kv_heads", "head_start", "heads", "tokens_per_block", "interior")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    INTERIOR_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    element_bytes: int
    head_size: int
    model_kv_heads: int
    head_start: int
    heads: int
    tokens_per_block: int
    interior: BlockInterior
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., element_bytes: _Optional[int] = ..., head_size: _Optional[int] = ..., model_kv_heads: _Optional[int] = ..., head_start: _Optional[int] = ..., heads: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., interior: _Optional[_Union[BlockInterior, str]] = ...) -> None: ...

class HeadSlice(_message.Message):
    __slots__ = ("head_start", "head_count", "tokens", "chunk_tokens")
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    head_start: int
    head_count: int
    tokens: int
    chunk_tokens: int
    def __init__(self, head_start: _Optional[int] = ..., head_count: _Optional[int] = ..., tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("worker_id", "shm_path", "layout", "expose_to_peers", "cuda_ipc", "geometry")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPOSE_TO_PEERS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shm_path: str
    layout: RegionLayout
    expose_to_peers: bool
    cuda_ipc: CudaIpcMemory
    geometry: KvGeometry
    def __init__(self, worker_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., layout: _Optional[_Union[RegionLayout, _Mapping]] = ..., expose_to_peers: bool = ..., cuda_ipc: _Optional[_Union[CudaIpcMemory, _Mapping]] = ..., geometry: _Optional[_Union[KvGeometry, _Mapping]] = ...) -> None: ...

class CudaIpcMemory(_message.Message):
    __slots__ = ("handle", "device")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device: int
    def __init__(self, handle: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id", "mapped_bytes")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    mapped_bytes: int
    def __init__(self, region_id: _Optional[int] = ..., mapped_bytes: _Optional[int] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockRange(_message.Message):
    __slots__ = ("region_id", "layer_start", "layer_count", "block_ids", "generations", "slice", "first_token")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    layer_start: int
    layer_count: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    slice: HeadSlice
    first_token: int
    def __init__(self, region_id: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., slice: _Optional[_Union[HeadSlice, _Mapping]] = ..., first_token: _Optional[int] = ...) -> None: ...

class BlockGenerationsRequest(_message.Message):
    __slots__ = ("region_id", "block_ids")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockGenerationsResponse(_message.Message):
    __slots__ = ("generations",)
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generations: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseBlocksRequest(_message.Message):
    __slots__ = ("region_id", "block_ids")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseBlocksResponse(_message.Message):
    __slots__ = ("generations", "transfers_failed")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    transfers_failed: int
    def __init__(self, generations: _Optional[_Iterable[int]] = ..., transfers_failed: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("request_id", "worker_id", "peer", "source", "destination", "group", "receiver_group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    peer: str
    source: BlockRange
    destination: BlockRange
    group: TransferGroup
    receiver_group: TransferGroup
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., peer: _Optional[str] = ..., source: _Optional[_Union[BlockRange, _Mapping]] = ..., destination: _Optional[_Union[BlockRange, _Mapping]] = ..., group: _Optional[_Union[TransferGroup, _Mapping]] = ..., receiver_group: _Optional[_Union[TransferGroup, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "worker_id", "peer", "source", "destination", "group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    peer: str
    source: BlockRange
    destination: BlockRange
    group: TransferGroup
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., peer: _Optional[str] = ..., source: _Optional[_Union[BlockRange, _Mapping]] = ..., destination: _Optional[_Union[BlockRange, _Mapping]] = ..., group: _Optional[_Union[TransferGroup, _Mapping]] = ...) -> None: ...

class TransferGroup(_message.Message):
    __slots__ = ("id", "members")
    ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    members: int
    def __init__(self, id: _Optional[str] = ..., members: _Optional[int] = ...) -> None: ...

class TransferAccepted(_message.Message):
    __slots__ = ("transfer_id", "total_bytes", "segments")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    total_bytes: int
    segments: int
    def __init__(self, transfer_id: _Optional[int] = ..., total_bytes: _Optional[int] = ..., segments: _Optional[int] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("transfer_id", "timeout_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    timeout_ms: int
    def __init__(self, transfer_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    def __init__(self, transfer_id: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    def __init__(self, transfer_id: _Optional[int] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("side", "code", "message")
    SIDE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    side: FailureSide
    code: str
    message: str
    def __init__(self, side: _Optional[_Union[FailureSide, str]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("transfer_id", "request_id", "state", "total_bytes", "bytes_done", "failure", "elapsed_us")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_US_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    request_id: str
    state: TransferState
    total_bytes: int
    bytes_done: int
    failure: Failure
    elapsed_us: int
    def __init__(self, transfer_id: _Optional[int] = ..., request_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., total_bytes: _Optional[int] = ..., bytes_done: _Optional[int] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., elapsed_us: _Optional[int] = ...) -> None: ...

class Notification(_message.Message):
    __slots__ = ("kind", "transfer_id", "request_id", "peer", "region_id", "block_ids", "bytes", "failure", "elapsed_us", "sequence", "incarnation", "payload", "from_worker")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    kind: NotificationKind
    transfer_id: int
    request_id: str
    peer: str
    region_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    failure: Failure
    elapsed_us: int
    sequence: int
    incarnation: int
    payload: bytes
    from_worker: str
    def __init__(self, kind: _Optional[_Union[NotificationKind, str]] = ..., transfer_id: _Optional[int] = ..., request_id: _Optional[str] = ..., peer: _Optional[str] = ..., region_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., elapsed_us: _Optional[int] = ..., sequence: _Optional[int] = ..., incarnation: _Optional[int] = ..., payload: _Optional[bytes] = ..., from_worker: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("worker_id", "after_sequence", "take_over", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_sequence: int
    take_over: bool
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., take_over: bool = ..., incarnation: _Optional[int] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("name", "rails", "connected", "transport", "rail_status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAILS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RAIL_STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rails: _containers.RepeatedScalarFieldContainer[str]
    connected: bool
    transport: str
    rail_status: _containers.RepeatedCompositeFieldContainer[RailStatus]
    def __init__(self, name: _Optional[str] = ..., rails: _Optional[_Iterable[str]] = ..., connected: bool = ..., transport: _Optional[str] = ..., rail_status: _Optional[_Iterable[_Union[RailStatus, _Mapping]]] = ...) -> None: ...

class RailStatus(_message.Message):
    __slots__ = ("rail", "direction", "state", "connections", "bytes_sent", "bytes_received", "slices_sent", "slices_retransmitted", "transitions", "rate_bytes_per_sec", "last_failure")
    RAIL_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SLICES_SENT_FIELD_NUMBER: _ClassVar[int]
    SLICES_RETRANSMITTED_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    RATE_BYTES_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    rail: int
    direction: str
    state: str
    connections: int
    bytes_sent: int
    bytes_received: int
    slices_sent: int
    slices_retransmitted: int
    transitions: int
    rate_bytes_per_sec: float
    last_failure: str
    def __init__(self, rail: _Optional[int] = ..., direction: _Optional[str] = ..., state: _Optional[str] = ..., connections: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., slices_sent: _Optional[int] = ..., slices_retransmitted: _Optional[int] = ..., transitions: _Optional[int] = ..., rate_bytes_per_sec: _Optional[float] = ..., last_failure: _Optional[str] = ...) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("node_name", "peers", "incarnation")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    incarnation: int
    def __init__(self, node_name: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SendMessageRequest(_message.Message):
    __slots__ = ("worker_id", "peer", "to_worker", "topic", "payload")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    peer: str
    to_worker: str
    topic: str
    payload: bytes
    def __init__(self, worker_id: _Optional[str] = ..., peer: _Optional[str] = ..., to_worker: _Optional[str] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class SendMessageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenRingRequest(_message.Message):
    __slots__ = ("worker_id", "shm_path", "notifications", "take_over")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shm_path: str
    notifications: bool
    take_over: bool
    def __init__(self, worker_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., notifications: bool = ..., take_over: bool = ...) -> None: ...

class RingEvent(_message.Message):
    __slots__ = ("version", "incarnation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    incarnation: int
    def __init__(self, version: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RemoveOnExitRequest(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveOnExitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
