//! GPU regions' slices through pinned host buffers: the writer starts each
//! slice's device-to-host copy ahead of its turn; the reader hands received
//! slices to the host-to-device queue and reads on.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

use kvrail_core::wire::{ErrorCode, FRAME_HEADER_LEN, SLICE_HEADER_LEN};
use kvrail_core::ConnId;
use kvrail_cuda::CopyDone;
use kvrail_transport::{FrameReader, FrameWriter, TransportError};
use tokio::sync::oneshot;
use tracing::warn;

use super::frames::Outgoing;
use super::owner::ConnOwner;
use crate::gpu;
use crate::held::ViewToken;
use crate::metrics as m;
use crate::regions::RegionMemory;

/// A staged slice: header, transfer, payload length, and its copy's outcome.
pub(super) type StagedSlice = (
    [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
    u64,
    usize,
    Result<CopyDone, oneshot::error::RecvError>,
);

/// What one write carried.
pub(super) struct Sent {
    pub(super) slices: u64,
    pub(super) bytes: u64,
}

/// A frame waiting for its turn on a connection.
pub(super) enum Queued {
    Ready(Outgoing),
    /// A GPU region's slice being copied into a pinned buffer.
    Staging {
        header: [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        transfer_id: u64,
        len: usize,
        device: Arc<gpu::GpuDevice>,
        copy: oneshot::Receiver<CopyDone>,
        /// The device copy reads the worker's GPU memory until it completes.
        _hold: ViewToken,
    },
}

/// Queues a frame; a GPU region's slice starts its device-to-host copy now.
/// Returns 1 when a copy was started.
pub(super) fn admit(link: &impl ConnOwner, out: Outgoing, queue: &mut VecDeque<Queued>) -> usize {
    if out.abandoned() {
        return 0;
    }
    let Outgoing::Slice {
        header,
        transfer_id,
        region,
        pieces,
        len,
        hold,
    } = out
    else {
        queue.push_back(Queued::Ready(out));
        return 0;
    };
    let RegionMemory::Gpu(g) = &region.memory else {
        queue.push_back(Queued::Ready(Outgoing::Slice {
            header,
            transfer_id,
            region,
            pieces,
            len,
            hold,
        }));
        return 0;
    };
    let started = g.device.pool.take().and_then(|buffer| {
        g.device
            .to_host
            .to_host(g.memory.clone(), &pieces, buffer)
            .map_err(|(e, buffer)| {
                g.device.pool.give(buffer);
                e
            })
    });
    match started {
        Ok(copy) => {
            queue.push_back(Queued::Staging {
                header,
                transfer_id,
                len: len as usize,
                device: g.device.clone(),
                copy,
                _hold: hold,
            });
            1
        }
        Err(e) => {
            device_copy_failed(link, transfer_id, &e.to_string());
            0
        }
    }
}

/// Sends staged slices in one write; a slice whose copy failed is left out
/// (its transfer fails, the connection goes on).
pub(super) async fn send_staged(
    link: &impl ConnOwner,
    writer: &mut dyn FrameWriter,
    staged: Vec<StagedSlice>,
    device: &gpu::GpuDevice,
) -> std::io::Result<Sent> {
    let mut ready = Vec::with_capacity(staged.len());
    for (header, transfer_id, len, done) in staged {
        match done {
            Ok(CopyDone {
                buffer,
                result: Ok(()),
            }) => ready.push((header, len, buffer)),
            Ok(CopyDone {
                buffer,
                result: Err(e),
            }) => {
                device.pool.give(buffer);
                device_copy_failed(link, transfer_id, &e.to_string());
            }
            Err(_) => device_copy_failed(link, transfer_id, "the copy queue stopped"),
        }
    }
    let mut bufs = Vec::with_capacity(ready.len() * 2);
    for (header, len, buffer) in &ready {
        bufs.push(IoSlice::new(header));
        bufs.push(IoSlice::new(&buffer.as_slice()[..*len]));
    }
    let r = writer.write_all_vectored(&mut bufs).await;
    let sent = Sent {
        slices: ready.len() as u64,
        bytes: ready.iter().map(|(_, len, _)| *len as u64).sum(),
    };
    for (_, _, buffer) in ready {
        device.pool.give(buffer);
    }
    r.map(|()| sent)
}

pub(super) fn device_copy_failed(link: &impl ConnOwner, transfer_id: u64, reason: &str) {
    warn!(peer = %link.peer(), transfer = transfer_id, "GPU copy failed: {reason}");
    m::gpu_copy_failures().increment(1);
    link.with_session(|s, now| {
        s.fail(
            transfer_id,
            ErrorCode::Internal,
            &format!("GPU copy failed: {reason}"),
            now,
        )
    });
}

/// Why a staged slice is refused if the device's staging share is closed
/// (it never is while the device is open).
const STAGING_CLOSED: &str = "GPU staging is shut down";

/// Drops a staged slice's payload off the connection and fails its
/// placement with `reason` (the connection goes on).
async fn refuse(
    link: &impl ConnOwner,
    conn: ConnId,
    header: kvrail_core::wire::SliceHeader,
    payload_len: u32,
    reader: &mut dyn FrameReader,
    reason: &str,
) -> Result<(), TransportError> {
    reader.discard(u64::from(payload_len)).await?;
    link.with_session(|s, now| s.placement_failed(conn, header, reason, now));
    Ok(())
}

/// Reads a GPU region's slice into a pinned buffer and hands it to the
/// host-to-device queue; the slice is placed when that copy is done, while this
/// connection already reads the next one.
pub(super) async fn receive_staged<L: ConnOwner>(
    link: &Arc<L>,
    conn: ConnId,
    header: kvrail_core::wire::SliceHeader,
    payload_len: u32,
    pieces: Vec<(u64, u64)>,
    g: &gpu::GpuMemory,
    reader: &mut dyn FrameReader,
) -> Result<(), TransportError> {
    let len = payload_len as usize;
    // Waits while received slices hold the device's share of staging memory,
    // counted by the pinned buffer each takes (the pool's size, or the
    // slice's if larger).
    let staging = &g.device.receive_staging;
    let Ok(mut in_flight) = staging
        .clone()
        .acquire_many_owned(gpu::receive_staging_permits(
            len.max(g.device.pool.buffer_bytes()),
        ))
        .await
    else {
        // Never closed; were it, the slice is refused like a failed copy.
        return refuse(&**link, conn, header, payload_len, reader, STAGING_CLOSED).await;
    };
    let taking = crate::trace_points::Stopwatch::start();
    // A peer may cut larger staged slices than ours (`gpu_slice_bytes`):
    // the pool's buffers grow to them.
    let taken = g.device.pool.take_at_least(len);
    m::gpu_staging_buffer_bytes().set(g.device.pool.buffer_bytes() as f64);
    taking.account(crate::trace_points::SUM_READER_POOL_TAKE);
    let mut buffer = match taken {
        Ok(b) => b,
        Err(e) => return refuse(&**link, conn, header, payload_len, reader, &e.to_string()).await,
    };
    let need = gpu::receive_staging_permits(buffer.len());
    if need > in_flight.num_permits() as u32 {
        // The pool grew meanwhile (another peer's larger slice): count the
        // buffer as it is. All permits are given back before waiting, so two
        // readers never each hold a part and wait for the rest.
        drop(in_flight);
        in_flight = match staging.clone().acquire_many_owned(need).await {
            Ok(p) => p,
            Err(_) => {
                g.device.pool.give(buffer);
                return refuse(&**link, conn, header, payload_len, reader, STAGING_CLOSED).await;
            }
        };
    }
    let reading = crate::trace_points::Stopwatch::start();
    let read = reader
        .read_payload(&mut [std::io::IoSliceMut::new(&mut buffer.as_mut_slice()[..len])])
        .await;
    reading.account(crate::trace_points::SUM_READER_STAGED_READ);
    let submitted = crate::trace_points::Stopwatch::start();
    if let Err(e) = read {
        g.device.pool.give(buffer);
        link.with_session(|s, _| s.slice_abandoned(conn, header));
        return Err(e.into());
    }
    // The bytes are off the connection: its loss no longer concerns this slice.
    link.with_session(|s, _| s.slice_read(conn, header));
    let submitting = crate::trace_points::Stopwatch::start();
    let submitted_copy = g
        .device
        .to_device
        .to_device(g.memory.clone(), &pieces, buffer);
    submitting.account(crate::trace_points::SUM_TO_DEVICE_SUBMIT);
    match submitted_copy {
        Ok(copy) => {
            let link = link.clone();
            let device = g.device.clone();
            tokio::spawn(async move {
                let done = copy.await;
                submitted.account(crate::trace_points::SUM_TO_DEVICE);
                let outcome = match done {
                    Ok(CopyDone { buffer, result }) => {
                        device.pool.give(buffer);
                        result.map_err(|e| e.to_string())
                    }
                    Err(_) => Err("the copy queue stopped".to_string()),
                };
                // The buffer is back (or gone with the queue).
                drop(in_flight);
                match outcome {
                    Ok(()) => {
                        let rail = link.rail_of(conn);
                        m::bytes_received(link.peer(), rail, link.transport())
                            .increment(u64::from(payload_len));
                        m::slices_received(link.peer(), rail, link.transport()).increment(1);
                        m::gpu_staged_bytes("to_device").increment(u64::from(payload_len));
                        link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now));
                    }
                    Err(reason) => {
                        warn!(peer = %link.peer(), transfer = header.transfer_id, "GPU copy failed: {reason}");
                        m::gpu_copy_failures().increment(1);
                        link.with_session(|s, now| s.placement_failed(conn, header, &reason, now));
                    }
                }
            });
        }
        Err((e, buffer)) => {
            g.device.pool.give(buffer);
            let reason = e.to_string();
            link.with_session(|s, now| s.placement_failed(conn, header, &reason, now));
        }
    }
    Ok(())
}
