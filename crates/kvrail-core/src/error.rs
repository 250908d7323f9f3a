//! Errors of the core, each saying who failed.

use std::time::Duration;

use crate::wire::ErrorCode;

/// A region layout that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A layout needs at least one layer, plane and block.
    #[error("layout has a zero dimension (layers, planes and blocks must all be >= 1)")]
    ZeroDimension,
    /// `block_bytes` is zero or larger than 1 GiB.
    #[error("block size {0} is out of range (1 byte ..= 1 GiB)")]
    BlockSize(u64),
    /// More blocks than the sidecar keeps generations for.
    #[error("layout has {0} blocks (at most {max})", max = crate::layout::MAX_BLOCKS)]
    TooManyBlocks(u32),
    /// The strides overflow or describe more than 1 TiB.
    #[error("layout describes an absurdly large region (over 1 TiB or overflowing)")]
    TooLarge,
    /// The layout reaches past the end of the shared-memory file.
    #[error("layout needs {extent} bytes but the region holds {region_len}")]
    ExceedsRegion { extent: u64, region_len: u64 },
    /// Two distinct blocks would share bytes.
    #[error("layout strides make distinct blocks overlap")]
    OverlappingBlocks,
}

/// A block selection that does not fit its region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// `layer_count` is zero.
    #[error("no layers selected")]
    NoLayers,
    /// The layer range leaves the region.
    #[error("layers {start}..{start}+{count} out of range (region has {num_layers})")]
    LayerOutOfRange {
        start: u32,
        count: u32,
        num_layers: u32,
    },
    /// No block ids listed.
    #[error("no blocks selected")]
    NoBlocks,
    /// More block ids than one transfer may carry.
    #[error("{0} blocks in one request exceeds the limit")]
    TooManyBlocks(usize),
    /// More layer x plane x block pieces than one transfer may move: the plan
    /// (and the memory to hold it) would be unbounded.
    #[error(
        "{pieces} block pieces (layers x planes x blocks) in one request exceed the limit of {max}"
    )]
    TooManyPieces { pieces: u64, max: u64 },
    /// A block id past the region's last block.
    #[error("block {block} out of range (region has {num_blocks})")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    /// Generations listed, but not one per block.
    #[error("{generations} generations listed for {blocks} blocks (give none, or one per block)")]
    GenerationCount { blocks: usize, generations: usize },
    /// A destination lists the same block twice.
    #[error("destination block {0} is listed more than once")]
    DuplicateBlock(u32),
    /// Source and destination disagree on size.
    #[error("source carries {source_bytes} bytes in blocks of {source_block} but destination takes {dest_bytes} in blocks of {dest_block}")]
    SizeMismatch {
        source_bytes: u64,
        source_block: u64,
        dest_bytes: u64,
        dest_block: u64,
    },
    /// A slice names bytes outside the transfer's logical stream.
    #[error("range {offset}+{len} lies outside the {total}-byte transfer")]
    OutsideStream { offset: u64, len: u64, total: u64 },
    /// The session with this peer holds as many transfers (or plan pieces)
    /// as it may: wait for some to finish.
    #[error("{transfers} transfers holding {segments} plan pieces are open with this peer (at most {max_transfers} and {max_segments}): wait for some to finish")]
    SessionFull {
        transfers: usize,
        segments: u64,
        max_transfers: usize,
        max_segments: u64,
    },
    /// The transfers open with this peer (`scope` "peer's sessions"), or
    /// with every peer ("node"), hold as much memory as they may.
    #[error("open transfers hold {held} bytes in this {scope} (at most {max}); this one needs {wanted}: wait for some to finish")]
    MemoryFull {
        scope: &'static str,
        held: u64,
        wanted: u64,
        max: u64,
    },
    /// A head-sliced selection for a region registered without geometry.
    #[error(
        "the transfer moves head slices, but this region was registered without its KV geometry"
    )]
    NoGeometry,
    /// A head slice this region cannot serve.
    #[error("head slice: {0}")]
    Slice(String),
    /// The two sides' KV geometries cannot exchange these blocks.
    #[error(transparent)]
    Incompatible(#[from] crate::geometry::GeometryError),
}

impl PlanError {
    /// The wire code a receiver reports for this rejection.
    pub fn wire_code(&self) -> ErrorCode {
        match self {
            PlanError::DuplicateBlock(_) => ErrorCode::OverlappingBlocks,
            PlanError::SizeMismatch { .. } => ErrorCode::SizeMismatch,
            PlanError::OutsideStream { .. } | PlanError::GenerationCount { .. } => {
                ErrorCode::Protocol
            }
            PlanError::SessionFull { .. } | PlanError::MemoryFull { .. } => ErrorCode::Internal,
            PlanError::NoGeometry | PlanError::Slice(_) | PlanError::Incompatible(_) => {
                ErrorCode::IncompatibleLayout
            }
            _ => ErrorCode::OutOfRange,
        }
    }
}

/// Which party ended a transfer that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureSide {
    /// This sidecar (bad local state, region gone, internal fault).
    Local,
    /// The peer sidecar rejected or aborted it.
    Peer,
    /// Every rail that could carry it stayed down past the deadline.
    Rail,
    /// It made no progress before its deadline.
    Timeout,
    /// A worker cancelled it.
    Cancelled,
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The peer refused or aborted the transfer, or broke the protocol.
    #[error("the peer's side failed the transfer ({code:?}): {message}")]
    Peer { code: ErrorCode, message: String },
    /// This sidecar could not go on.
    #[error("local failure ({code:?}): {message}")]
    Local { code: ErrorCode, message: String },
    /// Every rail to the peer stayed down past the failover deadline.
    #[error("every rail to the peer was down for {waited:?}: {causes}")]
    RailsDown { waited: Duration, causes: String },
    /// No progress within the deadline.
    #[error("no progress for {0:?}")]
    Timeout(Duration),
    /// A worker cancelled it.
    #[error("cancelled by the worker")]
    Cancelled,
    /// The peer sidecar restarted (its incarnation changed) while the transfer
    /// was open: what it had of the transfer is gone, so it is never re-announced.
    #[error("the peer sidecar restarted mid-transfer (incarnation {old:#x} -> {new:#x})")]
    PeerRestarted { old: u64, new: u64 },
}

impl TransferError {
    pub fn side(&self) -> FailureSide {
        match self {
            TransferError::Peer { .. } | TransferError::PeerRestarted { .. } => FailureSide::Peer,
            TransferError::Local { .. } => FailureSide::Local,
            TransferError::RailsDown { .. } => FailureSide::Rail,
            TransferError::Timeout(_) => FailureSide::Timeout,
            TransferError::Cancelled => FailureSide::Cancelled,
        }
    }

    /// Stable, machine-readable reason (also the metric label).
    pub fn code(&self) -> &'static str {
        match self {
            TransferError::Peer { code, .. } | TransferError::Local { code, .. } => code.reason(),
            TransferError::RailsDown { .. } => "rails_down",
            TransferError::Timeout(_) => "timeout",
            TransferError::Cancelled => "cancelled",
            TransferError::PeerRestarted { .. } => "peer_restarted",
        }
    }
}
