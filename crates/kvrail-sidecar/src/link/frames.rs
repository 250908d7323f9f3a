//! What a connection's writer puts on the wire: frames (control messages,
//! and slices whose payload stays in its region until written) and how a
//! batch of them becomes one vectored write or a zero-copy writer's chunks.

use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use kvrail_core::wire::{encode_control, pb, Body, FRAME_HEADER_LEN, SLICE_HEADER_LEN};
use kvrail_transport::FrameWriter;

use crate::held::ViewToken;
use crate::regions::Region;

/// Most frames, and payload bytes, one vectored write gathers from the queue.
pub(super) const WRITE_BATCH_FRAMES: usize = 64;
pub(super) const WRITE_BATCH_BYTES: u64 = 4 << 20;

/// What a writer task puts on its connection.
pub(super) enum Outgoing {
    /// An encoded control frame (shared: a push's open goes to each
    /// connection that carries its slices, encoded once).
    Control(Bytes),
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

/// The push open a pump pass encoded last: the same open met again (the
/// session announces a push on each connection before that connection's first
/// slice) is shared rather than encoded again. Compared whole, so any other
/// message, or an open that differs in anything, is encoded as usual.
#[derive(Default)]
pub(super) struct EncodedOpen(Option<(pb::PeerMessage, Bytes)>);

impl EncodedOpen {
    /// `msg` encoded; an open is kept (moved, not copied) for the next call.
    pub(super) fn encode(&mut self, msg: pb::PeerMessage) -> Bytes {
        if let Some((seen, bytes)) = &self.0 {
            if *seen == msg {
                return bytes.clone();
            }
        }
        let bytes = Bytes::from(encode_control(&msg));
        if matches!(msg.body, Some(Body::PushOpen(_))) {
            self.0 = Some((msg, bytes.clone()));
        }
        bytes
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvrail_core::wire;

    fn push_open(transfer_id: u64, one_sided: bool) -> pb::PeerMessage {
        wire::message(Body::PushOpen(pb::PushOpen {
            transfer_id,
            request_id: "r".into(),
            destination: Some(pb::BlockSet {
                region_id: 7,
                layer_count: 1,
                block_ids: (0..256).collect(),
                generations: (1..=256).collect(),
                ..Default::default()
            }),
            block_bytes: 4096,
            total_bytes: 1 << 20,
            one_sided,
            ..Default::default()
        }))
    }

    /// An open met again shares the first encoding; anything that differs
    /// (another transfer, the one-sided flag, another kind of message) gets
    /// its own, and every result is what `encode_control` makes.
    #[test]
    fn an_open_met_again_shares_its_encoding_and_nothing_else_does() {
        let mut last = EncodedOpen::default();
        let a = push_open(1, false);
        let first = last.encode(a.clone());
        let again = last.encode(a.clone());
        assert_eq!(first.as_ptr(), again.as_ptr(), "the same open is shared");
        assert_eq!(&first[..], &encode_control(&a)[..]);
        for other in [
            push_open(2, false),
            push_open(1, true),
            wire::message(Body::Abort(pb::Abort {
                transfer_id: 1,
                code: 0,
                message: String::new(),
            })),
        ] {
            let expected = encode_control(&other);
            let bytes = last.encode(other);
            assert_ne!(bytes.as_ptr(), first.as_ptr());
            assert_eq!(&bytes[..], &expected[..]);
        }
        // The last open encoded is the one remembered.
        let b = push_open(1, true);
        assert_eq!(last.encode(b.clone()).as_ptr(), last.encode(b).as_ptr());
    }
}
