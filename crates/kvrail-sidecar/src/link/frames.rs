//! What a connection's writer puts on the wire: frames (control messages,
//! and slices whose payload stays in its region until written) and how a
//! batch of them becomes one vectored write or a zero-copy writer's chunks.

use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use kvrail_core::wire::{FRAME_HEADER_LEN, SLICE_HEADER_LEN};
use kvrail_transport::FrameWriter;

use crate::held::ViewToken;
use crate::regions::Region;

/// Most frames, and payload bytes, one vectored write gathers from the queue.
pub(super) const WRITE_BATCH_FRAMES: usize = 64;
pub(super) const WRITE_BATCH_BYTES: u64 = 4 << 20;

/// What a writer task puts on its connection.
pub(super) enum Outgoing {
    Control(Vec<u8>),
    Slice {
        header: [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        transfer_id: u64,
        region: Arc<Region>,
        pieces: Vec<(u64, u64)>,
        len: u64,
        /// Held until the writer is done with the payload (see `held`).
        hold: ViewToken,
    },
}

impl Outgoing {
    /// A slice of a transfer that failed since it was queued.
    pub(super) fn abandoned(&self) -> bool {
        matches!(self, Outgoing::Slice { hold, .. } if hold.abandoned())
    }

    pub(super) fn payload_len(&self) -> u64 {
        match self {
            Outgoing::Control(_) => 0,
            Outgoing::Slice { len, .. } => *len,
        }
    }

    /// A host slice whose region's file no longer backs its bytes: the
    /// transfer and why.
    pub(super) fn truncated_source(&self) -> Option<(u64, String)> {
        let Outgoing::Slice {
            transfer_id,
            region,
            pieces,
            ..
        } = self
        else {
            return None;
        };
        let host = region.memory.host()?;
        let end = pieces.iter().map(|(o, l)| o + l).max()?;
        host.check_intact(0, end)
            .err()
            .map(|e| (*transfer_id, e.to_string()))
    }
}

/// Payload pieces at least this long go to a zero-copy writer by reference;
/// shorter ones (and frame headers) are cheaper to copy into one shared chunk.
pub(super) const ZERO_COPY_MIN: u64 = 16 << 10;

pub(super) async fn write_batch(
    writer: &mut dyn FrameWriter,
    batch: &[Outgoing],
) -> std::io::Result<()> {
    if writer.takes_owned_payload() {
        return writer.write_chunks(owned_chunks(batch)?).await;
    }
    let mut bufs = io_slices(batch)?;
    writer.write_all_vectored(&mut bufs).await
}

/// The batch's bytes in order, as I/O slices: frame headers and control
/// frames, payload straight from its mapped region.
pub(super) fn io_slices(batch: &[Outgoing]) -> std::io::Result<Vec<IoSlice<'_>>> {
    let mut bufs = Vec::with_capacity(batch.len() * 2);
    for out in batch {
        match out {
            Outgoing::Control(bytes) => bufs.push(IoSlice::new(bytes)),
            Outgoing::Slice {
                header,
                region,
                pieces,
                ..
            } => {
                let host = staged_host(region)?;
                bufs.push(IoSlice::new(header));
                bufs.extend(host.io_slices(pieces).map_err(std::io::Error::other)?);
            }
        }
    }
    Ok(bufs)
}

/// The host memory a ready slice is sent from (GPU slices go through staging).
pub(super) fn staged_host(region: &Region) -> std::io::Result<&Arc<kvrail_shm::SharedRegion>> {
    region
        .memory
        .shared_host()
        .ok_or_else(|| std::io::Error::other("a GPU slice was not staged"))
}

/// The batch as chunks a zero-copy writer may keep: large payload pieces as
/// views of their mapped region, everything between them copied together.
pub(super) fn owned_chunks(batch: &[Outgoing]) -> std::io::Result<Vec<Bytes>> {
    let mut chunks = Vec::new();
    let mut small = BytesMut::new();
    for out in batch {
        match out {
            Outgoing::Control(bytes) => small.extend_from_slice(bytes),
            Outgoing::Slice {
                header,
                region,
                pieces,
                hold,
                ..
            } => {
                let host = staged_host(region)?;
                small.extend_from_slice(header);
                for &(offset, len) in pieces {
                    if len >= ZERO_COPY_MIN {
                        if !small.is_empty() {
                            chunks.push(small.split().freeze());
                        }
                        chunks.push(
                            host.shared_bytes(offset, len, hold.clone())
                                .map_err(std::io::Error::other)?,
                        );
                    } else {
                        small.extend_from_slice(
                            host.slice(offset, len).map_err(std::io::Error::other)?,
                        );
                    }
                }
            }
        }
    }
    if !small.is_empty() {
        chunks.push(small.freeze());
    }
    Ok(chunks)
}
