//! The shared-memory submission/completion ring between a worker and its
//! sidecar, layout version 1 (docs/ring-format.md).
//!
//! The worker creates a file in shared memory, writes the [`RingGeometry`]
//! header and hands the path to the sidecar (`OpenRing`). From then on a push
//! or pull is a fixed-size [`Submission`] slot written into the submission
//! queue (SQ) and published by moving `sq_tail`; the sidecar answers with
//! [`Completion`] slots in the completion queue (CQ): `ACCEPTED` or `REJECTED`
//! for each submission, then the worker's transfer notifications. This module
//! holds the layout, the codecs and the index checks; it never touches shared
//! memory itself, so every decision here is tested without a mapping.
//!
//! Everything read from a slot is copied out of shared memory before it is
//! decoded (the other side may rewrite it while we look), and every field is
//! checked: a corrupt slot is an error for that slot, never a panic.

use crate::plan::MAX_BLOCKS_PER_TRANSFER;
use std::time::{Duration, Instant};

/// First bytes of a ring file.
pub const MAGIC: [u8; 8] = *b"KVRRING1";
/// Layout version this module reads and writes.
pub const VERSION: u32 = 1;
/// Bytes before the first SQ slot: the header and the control words.
pub const HEADER_BYTES: u64 = 4096;
/// Size of one CQ slot.
pub const CQ_SLOT_BYTES: u32 = 512;
/// Bounds of the worker-chosen geometry.
pub const SQ_ENTRIES_MAX: u32 = 4096;
pub const CQ_ENTRIES_MAX: u32 = 65536;
pub const SQ_SLOT_BYTES_MIN: u32 = 512;
pub const SQ_SLOT_BYTES_MAX: u32 = 65536;

/// Byte offsets of the header fields and control words. Each control word
/// that one side writes sits on its own 64-byte line, so the two processes do
/// not bounce one cache line between them.
pub mod offset {
    pub const MAGIC: u64 = 0;
    pub const VERSION: u64 = 8;
    pub const SQ_ENTRIES: u64 = 12;
    pub const CQ_ENTRIES: u64 = 16;
    pub const SQ_SLOT_BYTES: u64 = 20;
    pub const CQ_SLOT_BYTES: u64 = 24;
    /// u32, written by the sidecar: [`super::RingState`].
    pub const STATE: u64 = 28;
    /// u32, written by the sidecar when it closes the ring: [`super::CloseReason`].
    pub const CLOSE_REASON: u64 = 32;
    /// u64, written by the worker: submissions published.
    pub const SQ_TAIL: u64 = 64;
    /// u64, written by the sidecar: submissions consumed.
    pub const SQ_HEAD: u64 = 128;
    /// u64, written by the sidecar: completions published.
    pub const CQ_TAIL: u64 = 192;
    /// u64, written by the worker: completions consumed.
    pub const CQ_HEAD: u64 = 256;
    /// u32 futex word the worker bumps to wake a sleeping sidecar.
    pub const SIDECAR_BELL: u64 = 320;
    /// u32, 1 while the sidecar sleeps on its bell.
    pub const SIDECAR_SLEEPING: u64 = 324;
    /// u32 futex word the sidecar bumps to wake a sleeping worker.
    pub const WORKER_BELL: u64 = 384;
    /// u32, 1 while the worker sleeps on its bell.
    pub const WORKER_SLEEPING: u64 = 388;
    /// u64, written by the sidecar: completions it had to keep back because
    /// the CQ was full (they are published once the worker frees slots).
    pub const CQ_BACKLOGGED: u64 = 448;
}

/// What the sidecar says about the ring in the header's `state` word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RingState {
    /// Written by the worker; not yet served.
    Created = 0,
    /// The sidecar serves it.
    Open = 1,
    /// The sidecar stopped serving it; `close_reason` says why.
    Closed = 2,
}

/// Why the sidecar stopped serving a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[repr(u32)]
pub enum CloseReason {
    #[error("the OpenRing call ended (the worker closed the ring or went away)")]
    WorkerClosed = 1,
    #[error("submission queue overrun: the worker published more entries than the ring holds")]
    SubmissionOverrun = 2,
    #[error("completion queue overrun: the worker moved cq_head past cq_tail")]
    CompletionOverrun = 3,
    #[error("the worker does not read its completions (backlog limit reached)")]
    CompletionBacklog = 4,
    #[error("the ring file was truncated under the sidecar's mapping")]
    Truncated = 5,
    #[error("the sidecar is shutting down")]
    SidecarStopping = 6,
    #[error("the worker's header changed while the ring was open")]
    HeaderChanged = 7,
    /// Written by the worker's client when the sidecar's `OpenRing` call ended
    /// without the sidecar closing the ring (it was killed or restarted).
    #[error("the sidecar went away (its OpenRing call ended)")]
    SidecarGone = 8,
}

impl CloseReason {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => CloseReason::WorkerClosed,
            2 => CloseReason::SubmissionOverrun,
            3 => CloseReason::CompletionOverrun,
            4 => CloseReason::CompletionBacklog,
            5 => CloseReason::Truncated,
            6 => CloseReason::SidecarStopping,
            7 => CloseReason::HeaderChanged,
            8 => CloseReason::SidecarGone,
            _ => return None,
        })
    }
}

/// What is wrong with a ring header, a slot, or the indices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("not a kvrail ring (bad magic)")]
    BadMagic,
    #[error("ring layout version {0} (this build reads {VERSION})")]
    Version(u32),
    #[error("ring geometry: {0}")]
    Geometry(String),
    #[error("ring file is {actual} bytes, its geometry needs {needed}")]
    FileSize { needed: u64, actual: u64 },
    #[error("corrupt submission: {0}")]
    Corrupt(String),
    #[error("does not fit one slot: {0}")]
    TooLarge(String),
    #[error("{0}")]
    Overrun(CloseReason),
}

/// The worker-chosen sizes of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingGeometry {
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub sq_slot_bytes: u32,
}

impl RingGeometry {
    pub fn new(sq_entries: u32, cq_entries: u32, sq_slot_bytes: u32) -> Result<Self, RingError> {
        let pow2 = |v: u32, lo: u32, hi: u32, what: &str| {
            if v.is_power_of_two() && (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(RingError::Geometry(format!(
                    "{what} must be a power of two in {lo}..={hi} (got {v})"
                )))
            }
        };
        pow2(sq_entries, 2, SQ_ENTRIES_MAX, "sq_entries")?;
        pow2(cq_entries, 4, CQ_ENTRIES_MAX, "cq_entries")?;
        pow2(
            sq_slot_bytes,
            SQ_SLOT_BYTES_MIN,
            SQ_SLOT_BYTES_MAX,
            "sq_slot_bytes",
        )?;
        Ok(Self {
            sq_entries,
            cq_entries,
            sq_slot_bytes,
        })
    }

    /// Bytes of the largest ring any valid header describes: the sidecar
    /// maps no more of a ring file than this, however large the file.
    pub const MAX_TOTAL_BYTES: u64 = HEADER_BYTES
        + SQ_ENTRIES_MAX as u64 * SQ_SLOT_BYTES_MAX as u64
        + CQ_ENTRIES_MAX as u64 * CQ_SLOT_BYTES as u64;

    /// Bytes of the whole ring file.
    pub fn total_bytes(&self) -> u64 {
        self.cq_offset() + u64::from(self.cq_entries) * u64::from(CQ_SLOT_BYTES)
    }

    fn cq_offset(&self) -> u64 {
        HEADER_BYTES + u64::from(self.sq_entries) * u64::from(self.sq_slot_bytes)
    }

    /// Offset of the SQ slot that submission number `index` uses.
    pub fn sq_slot_offset(&self, index: u64) -> u64 {
        HEADER_BYTES + (index % u64::from(self.sq_entries)) * u64::from(self.sq_slot_bytes)
    }

    /// Offset of the CQ slot that completion number `index` uses.
    pub fn cq_slot_offset(&self, index: u64) -> u64 {
        self.cq_offset() + (index % u64::from(self.cq_entries)) * u64::from(CQ_SLOT_BYTES)
    }

    /// The header's first 28 bytes (magic to the CQ slot size).
    pub fn encode_header(&self) -> [u8; 28] {
        let mut h = [0u8; 28];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.sq_entries.to_le_bytes());
        h[16..20].copy_from_slice(&self.cq_entries.to_le_bytes());
        h[20..24].copy_from_slice(&self.sq_slot_bytes.to_le_bytes());
        h[24..28].copy_from_slice(&CQ_SLOT_BYTES.to_le_bytes());
        h
    }

    /// Reads and checks a header against the file's size.
    pub fn decode_header(h: &[u8], file_bytes: u64) -> Result<Self, RingError> {
        if h.len() < 28 || h[0..8] != MAGIC {
            return Err(RingError::BadMagic);
        }
        let version = le_u32(h, 8);
        if version != VERSION {
            return Err(RingError::Version(version));
        }
        if le_u32(h, 24) != CQ_SLOT_BYTES {
            return Err(RingError::Geometry(format!(
                "cq_slot_bytes must be {CQ_SLOT_BYTES} (got {})",
                le_u32(h, 24)
            )));
        }
        let g = Self::new(le_u32(h, 12), le_u32(h, 16), le_u32(h, 20))?;
        if file_bytes < g.total_bytes() {
            return Err(RingError::FileSize {
                needed: g.total_bytes(),
                actual: file_bytes,
            });
        }
        Ok(g)
    }
}

/// How many published entries a consumer may read, given its own `head` and
/// the producer's `tail`. A tail behind the head or more than `entries` ahead
/// of it is an overrun: the producer broke the protocol.
pub fn available(head: u64, tail: u64, entries: u32) -> Option<u64> {
    let n = tail.checked_sub(head)?;
    (n <= u64::from(entries)).then_some(n)
}

/// Whether a producer at `tail` may publish one more entry, given the
/// consumer's `head`.
pub fn has_room(head: u64, tail: u64, entries: u32) -> bool {
    tail.wrapping_sub(head) < u64::from(entries)
}

/// A run of consecutive block ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    pub start: u32,
    pub count: u32,
}

/// Compacts block ids into runs of consecutive ids, in order.
pub fn runs_of(block_ids: &[u32]) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for &b in block_ids {
        match runs.last_mut() {
            Some(r) if r.start.checked_add(r.count) == Some(b) => r.count += 1,
            _ => runs.push(BlockRun { start: b, count: 1 }),
        }
    }
    runs
}

/// One side of a submission: blocks of a region over a layer range.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RingBlocks {
    pub region_id: u64,
    pub layer_start: u32,
    pub layer_count: u32,
    pub runs: Vec<BlockRun>,
    /// Empty, or one per block (as `BlockRange::generations`).
    pub generations: Vec<u64>,
}

impl RingBlocks {
    pub fn from_ids(
        region_id: u64,
        layers: std::ops::Range<u32>,
        block_ids: &[u32],
        generations: Vec<u64>,
    ) -> Self {
        Self {
            region_id,
            layer_start: layers.start,
            layer_count: layers.end.saturating_sub(layers.start),
            runs: runs_of(block_ids),
            generations,
        }
    }

    /// Number of blocks the runs name.
    pub fn block_count(&self) -> u64 {
        self.runs.iter().map(|r| u64::from(r.count)).sum()
    }

    /// The block ids, in order (the count was bounded by [`Submission::decode`]).
    pub fn block_ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.block_count() as usize);
        for r in &self.runs {
            // `..=` so a run ending at u32::MAX does not overflow (decode checked it).
            out.extend(r.start..=r.start + (r.count - 1));
        }
        out
    }
}

/// Push or pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RingOp {
    Push = 1,
    Pull = 2,
}

/// One push or pull request in an SQ slot. The worker id is not in it: a ring
/// belongs to the worker that opened it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    pub op: RingOp,
    /// Echoed in this submission's ACCEPTED or REJECTED completion.
    pub user_data: u64,
    pub peer: String,
    pub request_id: String,
    pub source: RingBlocks,
    pub destination: RingBlocks,
}

/// Field limits of a submission (longer ones go through gRPC).
pub const PEER_MAX: usize = 64;
pub const REQUEST_ID_MAX: usize = 128;
const SUB_FIXED: usize = 248;

/// A slot's four counts: source runs, destination runs, source generations,
/// destination generations (0 for any the slot is too short to hold).
fn slot_counts(fixed: &[u8]) -> [usize; 4] {
    std::array::from_fn(|i| {
        fixed
            .get(4 + 2 * i..6 + 2 * i)
            .map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])))
    })
}

impl Submission {
    /// Bytes of a slot before its block runs and generations.
    pub const FIXED_BYTES: usize = SUB_FIXED;

    /// Bytes of its slot that the submission whose first
    /// [`Submission::FIXED_BYTES`] bytes are `fixed` says it uses (what
    /// [`Submission::decode`] reads), so that a reader copies those, not the
    /// whole slot. May exceed the slot: decode then refuses it.
    pub fn bytes_used(fixed: &[u8]) -> usize {
        SUB_FIXED + 8 * slot_counts(fixed).iter().sum::<usize>()
    }

    /// Bytes this submission needs in a slot.
    pub fn encoded_len(&self) -> usize {
        SUB_FIXED
            + 8 * (self.source.runs.len()
                + self.destination.runs.len()
                + self.source.generations.len()
                + self.destination.generations.len())
    }

    /// Writes the submission into `slot` (all of it: unused bytes are zeroed).
    pub fn encode(&self, slot: &mut [u8]) -> Result<(), RingError> {
        if self.peer.is_empty() || self.peer.len() > PEER_MAX {
            return Err(RingError::TooLarge(format!(
                "peer name must be 1..={PEER_MAX} bytes"
            )));
        }
        if self.request_id.is_empty() || self.request_id.len() > REQUEST_ID_MAX {
            return Err(RingError::TooLarge(format!(
                "request id must be 1..={REQUEST_ID_MAX} bytes"
            )));
        }
        let counts = [
            self.source.runs.len(),
            self.destination.runs.len(),
            self.source.generations.len(),
            self.destination.generations.len(),
        ];
        if counts.iter().any(|&c| c > usize::from(u16::MAX)) || self.encoded_len() > slot.len() {
            return Err(RingError::TooLarge(format!(
                "{} bytes of block runs and generations for a {}-byte slot",
                self.encoded_len(),
                slot.len()
            )));
        }
        slot.fill(0);
        slot[0] = self.op as u8;
        slot[2] = self.peer.len() as u8;
        slot[3] = self.request_id.len() as u8;
        for (i, c) in counts.iter().enumerate() {
            slot[4 + 2 * i..6 + 2 * i].copy_from_slice(&(*c as u16).to_le_bytes());
        }
        put_u64(slot, 16, self.user_data);
        put_u64(slot, 24, self.source.region_id);
        put_u64(slot, 32, self.destination.region_id);
        put_u32(slot, 40, self.source.layer_start);
        put_u32(slot, 44, self.source.layer_count);
        put_u32(slot, 48, self.destination.layer_start);
        put_u32(slot, 52, self.destination.layer_count);
        slot[56..56 + self.peer.len()].copy_from_slice(self.peer.as_bytes());
        slot[120..120 + self.request_id.len()].copy_from_slice(self.request_id.as_bytes());
        let mut at = SUB_FIXED;
        for r in self.source.runs.iter().chain(&self.destination.runs) {
            put_u32(slot, at, r.start);
            put_u32(slot, at + 4, r.count);
            at += 8;
        }
        for g in self
            .source
            .generations
            .iter()
            .chain(&self.destination.generations)
        {
            put_u64(slot, at, *g);
            at += 8;
        }
        Ok(())
    }

    /// Reads a submission from a copy of its slot, checking every field.
    /// The `user_data` of a corrupt slot is still returned when it could be
    /// read, so the rejection can name it.
    pub fn decode(slot: &[u8]) -> Result<Self, (u64, RingError)> {
        if slot.len() < SUB_FIXED {
            return Err((
                0,
                RingError::Corrupt("slot shorter than a submission".into()),
            ));
        }
        let user_data = le_u64(slot, 16);
        let bad = |why: String| (user_data, RingError::Corrupt(why));
        let op = match slot[0] {
            1 => RingOp::Push,
            2 => RingOp::Pull,
            other => return Err(bad(format!("unknown op {other}"))),
        };
        if slot[1] != 0 || le_u32(slot, 12) != 0 {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let text = |at: usize, len: u8, max: usize, what: &str| {
            let len = usize::from(len);
            if len == 0 || len > max {
                return Err(bad(format!("{what} length {len} (1..={max})")));
            }
            std::str::from_utf8(&slot[at..at + len])
                .map(str::to_owned)
                .map_err(|_| bad(format!("{what} is not UTF-8")))
        };
        let peer = text(56, slot[2], PEER_MAX, "peer")?;
        let request_id = text(120, slot[3], REQUEST_ID_MAX, "request id")?;
        let [src_runs, dst_runs, src_gens, dst_gens] = slot_counts(slot);
        let need = Self::bytes_used(slot);
        if need > slot.len() {
            return Err(bad(format!(
                "runs and generations need {need} bytes, the slot has {}",
                slot.len()
            )));
        }
        let mut at = SUB_FIXED;
        let mut read_runs = |n: usize, what: &str| -> Result<Vec<BlockRun>, (u64, RingError)> {
            let mut runs = Vec::with_capacity(n);
            let mut total = 0u64;
            for _ in 0..n {
                let r = BlockRun {
                    start: le_u32(slot, at),
                    count: le_u32(slot, at + 4),
                };
                at += 8;
                if r.count == 0 || r.start.checked_add(r.count - 1).is_none() {
                    return Err(bad(format!(
                        "{what} block run {}+{} is empty or past block id {}",
                        r.start,
                        r.count,
                        u32::MAX
                    )));
                }
                total += u64::from(r.count);
                runs.push(r);
            }
            if total == 0 || total > MAX_BLOCKS_PER_TRANSFER as u64 {
                return Err(bad(format!(
                    "{what} names {total} blocks (1..={MAX_BLOCKS_PER_TRANSFER})"
                )));
            }
            Ok(runs)
        };
        let src = read_runs(src_runs, "source")?;
        let dst = read_runs(dst_runs, "destination")?;
        let mut read_gens = |n: usize| {
            let g: Vec<u64> = (0..n).map(|i| le_u64(slot, at + 8 * i)).collect();
            at += 8 * n;
            g
        };
        let src_g = read_gens(src_gens);
        let dst_g = read_gens(dst_gens);
        let side = |region_id: u64, layer_at: usize, runs: Vec<BlockRun>, generations: Vec<u64>| {
            RingBlocks {
                region_id,
                layer_start: le_u32(slot, layer_at),
                layer_count: le_u32(slot, layer_at + 4),
                runs,
                generations,
            }
        };
        let source = side(le_u64(slot, 24), 40, src, src_g);
        let destination = side(le_u64(slot, 32), 48, dst, dst_g);
        for (s, what) in [(&source, "source"), (&destination, "destination")] {
            if !s.generations.is_empty() && s.generations.len() as u64 != s.block_count() {
                return Err(bad(format!(
                    "{what}: {} generations for {} blocks (give none or one per block)",
                    s.generations.len(),
                    s.block_count()
                )));
            }
        }
        Ok(Submission {
            op,
            user_data,
            peer,
            request_id,
            source,
            destination,
        })
    }
}

/// What a completion says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CompletionKind {
    /// The notification kinds of the gRPC API, same numbers.
    PushDone = 1,
    PushReceived = 2,
    PullDone = 3,
    PullServed = 4,
    Failed = 5,
    /// A submission was started: `transfer_id` and `bytes` say what it became.
    Accepted = 7,
    /// A submission was refused before anything moved: `code` and `message`
    /// say why, `user_data` which one.
    Rejected = 8,
}

impl CompletionKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::PushDone,
            2 => Self::PushReceived,
            3 => Self::PullDone,
            4 => Self::PullServed,
            5 => Self::Failed,
            7 => Self::Accepted,
            8 => Self::Rejected,
            _ => return None,
        })
    }
}

/// One CQ slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub kind: CompletionKind,
    /// `FailureSide` of the gRPC API (0 when nothing failed).
    pub failure_side: u8,
    pub user_data: u64,
    pub transfer_id: u64,
    pub region_id: u64,
    pub bytes: u64,
    pub elapsed_us: u64,
    /// The notification's sequence and incarnation (0 for ACCEPTED/REJECTED).
    pub sequence: u64,
    pub incarnation: u64,
    pub request_id: String,
    pub peer: String,
    /// Stable failure code, e.g. "blocks_released".
    pub code: String,
    /// Human-readable detail (cut at [`MESSAGE_MAX`] bytes).
    pub message: String,
}

pub const CODE_MAX: usize = 32;
pub const MESSAGE_MAX: usize = 224;
/// Longest peer name a completion holds (notifications naming longer peers
/// go to the gRPC stream).
pub const COMPLETION_PEER_MAX: usize = 64;

impl Completion {
    /// Whether every field fits a slot unabridged (the message may be cut).
    pub fn fits(request_id: &str, peer: &str) -> bool {
        request_id.len() <= REQUEST_ID_MAX && peer.len() <= COMPLETION_PEER_MAX
    }

    /// Writes the completion into a CQ slot. Request id and peer must fit
    /// ([`Completion::fits`]); code and message are cut at a character
    /// boundary.
    pub fn encode(&self, slot: &mut [u8]) -> Result<(), RingError> {
        if slot.len() < CQ_SLOT_BYTES as usize {
            return Err(RingError::TooLarge("CQ slot too small".into()));
        }
        if !Self::fits(&self.request_id, &self.peer) {
            return Err(RingError::TooLarge(format!(
                "request id ({} bytes) or peer ({} bytes) too long for a completion",
                self.request_id.len(),
                self.peer.len()
            )));
        }
        let code = cut(&self.code, CODE_MAX);
        let message = cut(&self.message, MESSAGE_MAX);
        slot[..CQ_SLOT_BYTES as usize].fill(0);
        slot[0] = self.kind as u8;
        slot[1] = self.failure_side;
        slot[2] = self.request_id.len() as u8;
        slot[3] = self.peer.len() as u8;
        slot[4] = code.len() as u8;
        slot[5] = message.len() as u8;
        for (i, v) in [
            self.user_data,
            self.transfer_id,
            self.region_id,
            self.bytes,
            self.elapsed_us,
            self.sequence,
            self.incarnation,
        ]
        .into_iter()
        .enumerate()
        {
            put_u64(slot, 8 + 8 * i, v);
        }
        slot[64..64 + self.request_id.len()].copy_from_slice(self.request_id.as_bytes());
        slot[192..192 + self.peer.len()].copy_from_slice(self.peer.as_bytes());
        slot[256..256 + code.len()].copy_from_slice(code.as_bytes());
        slot[288..288 + message.len()].copy_from_slice(message.as_bytes());
        Ok(())
    }

    /// Reads a completion from a copy of its slot.
    pub fn decode(slot: &[u8]) -> Result<Self, RingError> {
        if slot.len() < CQ_SLOT_BYTES as usize {
            return Err(RingError::Corrupt("CQ slot too small".into()));
        }
        let kind = CompletionKind::from_u8(slot[0])
            .ok_or_else(|| RingError::Corrupt(format!("unknown completion kind {}", slot[0])))?;
        let text = |at: usize, len: u8, max: usize, what: &str| {
            let len = usize::from(len);
            if len > max {
                return Err(RingError::Corrupt(format!("{what} length {len}")));
            }
            std::str::from_utf8(&slot[at..at + len])
                .map(str::to_owned)
                .map_err(|_| RingError::Corrupt(format!("{what} is not UTF-8")))
        };
        Ok(Completion {
            kind,
            failure_side: slot[1],
            user_data: le_u64(slot, 8),
            transfer_id: le_u64(slot, 16),
            region_id: le_u64(slot, 24),
            bytes: le_u64(slot, 32),
            elapsed_us: le_u64(slot, 40),
            sequence: le_u64(slot, 48),
            incarnation: le_u64(slot, 56),
            request_id: text(64, slot[2], REQUEST_ID_MAX, "request id")?,
            peer: text(192, slot[3], COMPLETION_PEER_MAX, "peer")?,
            code: text(256, slot[4], CODE_MAX, "code")?,
            message: text(288, slot[5], MESSAGE_MAX, "message")?,
        })
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Machines with fewer CPUs spin on neither side of a ring: there a spinning
/// thread takes the core that the other side and the sidecar's tasks need
/// (measured in docs/ring-format.md). The clients' waits and the sidecar's
/// ring threads both follow this rule (the Python client states it again).
pub const MIN_CPUS_TO_SPIN: usize = 4;

/// Whether a machine with `cpus` CPUs spins on a ring at all.
pub fn spins_with(cpus: usize) -> bool {
    cpus >= MIN_CPUS_TO_SPIN
}

/// How long a ring's serving thread spins for the next submission before it
/// sleeps on the futex. Spinning saves the worker a wake-up system call and
/// the thread's wake-up latency (about 15 us measured), but only if the next
/// submission comes while it spins. So it follows the worker's pace: twice
/// the recent gap between submissions, within `[floor, ceiling]`. Gaps
/// longer than the ceiling (a pause, a layer's compute) stay out of the
/// average: no spin would have caught them. A ring quiet for longer than the
/// ceiling spins only the floor, so an idle ring's thread mostly sleeps.
/// `now` is passed in.
#[derive(Debug, Clone)]
pub struct SpinPolicy {
    floor: Duration,
    ceiling: Duration,
    last: Option<Instant>,
    /// Moving average of the gaps between submissions no longer than the
    /// ceiling (weight 1/4 to the newest).
    gap: Option<Duration>,
}

impl SpinPolicy {
    /// Spins that follow the worker's pace, between `floor` and `ceiling`.
    pub fn adaptive(floor: Duration, ceiling: Duration) -> Self {
        Self {
            floor: floor.min(ceiling),
            ceiling,
            last: None,
            gap: None,
        }
    }

    /// Always the same spin.
    pub fn fixed(spin: Duration) -> Self {
        Self::adaptive(spin, spin)
    }

    /// Submissions were found at `now`.
    pub fn note_submissions(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let gap = now.saturating_duration_since(last);
            if gap <= self.ceiling {
                self.gap = Some(match self.gap {
                    Some(avg) => (avg * 3 + gap) / 4,
                    None => gap,
                });
            }
        }
        self.last = Some(now);
    }

    /// How long to spin before sleeping at `now`.
    pub fn spin(&self, now: Instant) -> Duration {
        let quiet = self
            .last
            .is_none_or(|last| now.saturating_duration_since(last) > self.ceiling);
        match self.gap {
            Some(gap) if !quiet => (gap * 2).clamp(self.floor, self.ceiling),
            _ => self.floor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Submission {
        Submission {
            op: RingOp::Push,
            user_data: 42,
            peer: "decode".into(),
            request_id: "req-1/layer-3".into(),
            source: RingBlocks::from_ids(7, 3..4, &[1, 2, 3, 9], Vec::new()),
            destination: RingBlocks::from_ids(11, 3..4, &[20, 21, 22, 23], vec![5, 5, 6, 7]),
        }
    }

    #[test]
    fn a_submission_round_trips_through_a_slot() {
        let s = sample();
        assert_eq!(s.source.runs.len(), 2);
        assert_eq!(s.destination.runs.len(), 1);
        let mut slot = vec![0xAAu8; 4096];
        s.encode(&mut slot).unwrap();
        let back = Submission::decode(&slot).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.source.block_ids(), vec![1, 2, 3, 9]);
        assert_eq!(back.destination.block_ids(), vec![20, 21, 22, 23]);
    }

    #[test]
    fn what_does_not_fit_a_slot_is_refused_before_anything_is_written() {
        let mut s = sample();
        s.destination = RingBlocks::from_ids(11, 0..1, &[], (0..600).collect());
        s.destination.runs = (0..600)
            .map(|i| BlockRun {
                start: i * 2,
                count: 1,
            })
            .collect();
        let mut slot = vec![0x55u8; 4096];
        assert!(matches!(s.encode(&mut slot), Err(RingError::TooLarge(_))));
        assert!(slot.iter().all(|&b| b == 0x55));
        let mut s = sample();
        s.request_id = "r".repeat(REQUEST_ID_MAX + 1);
        assert!(matches!(s.encode(&mut slot), Err(RingError::TooLarge(_))));
    }

    #[test]
    fn every_corruption_of_a_slot_is_an_error_naming_the_user_data() {
        let mut slot = vec![0u8; 1024];
        sample().encode(&mut slot).unwrap();
        let cases: Vec<(usize, u8)> = vec![
            (0, 9),     // op
            (1, 1),     // reserved
            (2, 0),     // peer length 0
            (2, 65),    // peer length too long
            (3, 200),   // request id too long
            (4, 0),     // no source runs
            (6, 0xff),  // destination runs past the slot
            (10, 3),    // 3 destination generations for 4 blocks
            (56, 0xff), // peer not UTF-8
            (12, 1),    // reserved word
        ];
        for (at, v) in cases {
            let mut bad = slot.clone();
            bad[at] = v;
            match Submission::decode(&bad) {
                Err((ud, RingError::Corrupt(_))) => assert_eq!(ud, 42, "byte {at}"),
                other => panic!("byte {at} = {v}: {other:?}"),
            }
        }
        // A run past u32::MAX and an empty run.
        let mut bad = slot.clone();
        put_u32(&mut bad, SUB_FIXED, u32::MAX);
        assert!(Submission::decode(&bad).is_err());
        let mut bad = slot.clone();
        put_u32(&mut bad, SUB_FIXED + 4, 0);
        assert!(Submission::decode(&bad).is_err());
        // Runs summing past the per-transfer limit.
        let mut bad = slot.clone();
        put_u32(&mut bad, SUB_FIXED, 0);
        put_u32(&mut bad, SUB_FIXED + 4, u32::MAX);
        assert!(Submission::decode(&bad).is_err());
        assert!(Submission::decode(&slot[..100]).is_err());
    }

    #[test]
    fn random_slots_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let mut good = vec![0u8; 1024];
        sample().encode(&mut good).unwrap();
        for _ in 0..20_000 {
            let mut slot = good.clone();
            for _ in 0..rng.random_range(1..8) {
                let i = rng.random_range(0..slot.len());
                slot[i] = rng.random();
            }
            let _ = Submission::decode(&slot);
            let _ = Completion::decode(&slot[..512]);
        }
    }

    #[test]
    fn a_completion_round_trips_and_cuts_long_text_at_a_char_boundary() {
        let c = Completion {
            kind: CompletionKind::Failed,
            failure_side: 2,
            user_data: 0,
            transfer_id: 9,
            region_id: 3,
            bytes: 4096,
            elapsed_us: 17,
            sequence: 5,
            incarnation: 77,
            request_id: "req".into(),
            peer: "decode".into(),
            code: "blocks_released".into(),
            message: "é".repeat(200),
        };
        let mut slot = vec![0u8; 512];
        c.encode(&mut slot).unwrap();
        let back = Completion::decode(&slot).unwrap();
        assert_eq!(back.message.len(), 224);
        assert_eq!(
            Completion {
                message: back.message.clone(),
                ..c.clone()
            },
            back
        );
        let long = Completion {
            request_id: "r".repeat(129),
            ..c
        };
        assert!(long.encode(&mut slot).is_err());
    }

    #[test]
    fn geometry_and_indices_are_checked() {
        let g = RingGeometry::new(256, 1024, 4096).unwrap();
        let h = g.encode_header();
        assert_eq!(RingGeometry::decode_header(&h, g.total_bytes()).unwrap(), g);
        assert!(matches!(
            RingGeometry::decode_header(&h, g.total_bytes() - 1),
            Err(RingError::FileSize { .. })
        ));
        let mut bad = h;
        bad[0] = b'X';
        assert_eq!(
            RingGeometry::decode_header(&bad, u64::MAX),
            Err(RingError::BadMagic)
        );
        let mut bad = h;
        bad[8] = 2;
        assert_eq!(
            RingGeometry::decode_header(&bad, u64::MAX),
            Err(RingError::Version(2))
        );
        assert!(RingGeometry::new(3, 1024, 4096).is_err());
        assert!(RingGeometry::new(256, 1 << 20, 4096).is_err());
        assert!(RingGeometry::new(256, 1024, 256).is_err());
        assert_eq!(g.sq_slot_offset(256), g.sq_slot_offset(0));
        assert_eq!(g.cq_slot_offset(1), g.cq_slot_offset(0) + 512);
        assert_eq!(available(5, 5, 8), Some(0));
        assert_eq!(available(5, 13, 8), Some(8));
        assert_eq!(available(5, 14, 8), None);
        assert_eq!(available(5, 4, 8), None);
        assert!(has_room(0, 7, 8));
        assert!(!has_room(0, 8, 8));
    }

    #[test]
    fn the_spin_follows_a_steady_worker_and_drops_to_the_floor_when_quiet() {
        let us = Duration::from_micros;
        let t0 = Instant::now();
        let mut p = SpinPolicy::adaptive(us(50), us(500));
        assert_eq!(p.spin(t0), us(50), "no pace known yet");
        p.note_submissions(t0);
        assert_eq!(p.spin(t0), us(50), "one submission is no pace");
        // A worker submitting every 80 us: the thread spins 160 us.
        let mut t = t0;
        for _ in 0..20 {
            t += us(80);
            p.note_submissions(t);
        }
        assert_eq!(p.spin(t), us(160));
        // Quiet for longer than the ceiling (the worker paused): the floor,
        // so an idle ring's thread mostly sleeps.
        assert_eq!(p.spin(t + us(501)), us(50));
        // Every 20 us: twice that is under the floor.
        for _ in 0..40 {
            t += us(20);
            p.note_submissions(t);
        }
        assert_eq!(p.spin(t), us(50));
        // Every 400 us: up to the ceiling.
        for _ in 0..40 {
            t += us(400);
            p.note_submissions(t);
        }
        assert_eq!(p.spin(t), us(500));
        // Bursts of 80 us gaps between 50 ms pauses: the pauses stay out of
        // the average, so the first submissions after a pause find the
        // thread spinning for the burst's pace again.
        for _ in 0..20 {
            t += us(80);
            p.note_submissions(t);
        }
        t += us(50_000);
        p.note_submissions(t);
        t += us(80);
        p.note_submissions(t);
        let spin = p.spin(t);
        assert!(spin >= us(160) && spin < us(200), "{spin:?}");
    }

    #[test]
    fn a_fixed_spin_never_moves() {
        let us = Duration::from_micros;
        let t0 = Instant::now();
        let mut p = SpinPolicy::fixed(us(0));
        for i in 0..10 {
            p.note_submissions(t0 + us(30 * i));
        }
        assert_eq!(p.spin(t0 + us(300)), us(0));
    }

    #[test]
    fn two_cores_do_not_spin_four_do() {
        assert!(!spins_with(1) && !spins_with(2) && !spins_with(3));
        assert!(spins_with(4) && spins_with(16));
    }
}
