//! A connection's writer task: frames in order, whatever is queued gathered
//! into one vectored write (or handed to a zero-copy writer as views).

use std::collections::VecDeque;
use std::sync::Arc;

use kvrail_core::wire::ErrorCode;
use kvrail_transport::FrameWriter;
use tokio::sync::mpsc;

use super::conns::ConnKey;
use super::frames::{write_batch, Outgoing, WRITE_BATCH_BYTES, WRITE_BATCH_FRAMES};
use super::gpu_staging::{admit, send_staged, Queued};
use super::owner::ConnOwner;
use crate::metrics as m;

pub(super) async fn writer_task<L: ConnOwner>(
    link: Arc<L>,
    key: ConnKey,
    counters: m::ConnCounters,
    mut writer: Box<dyn FrameWriter>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    queued: Arc<std::sync::atomic::AtomicU64>,
) {
    // Frames in order; slices of GPU regions wait here while their device copy runs.
    let mut queue: VecDeque<Queued> = VecDeque::new();
    let mut staging = 0usize;
    let mut batch: Vec<Outgoing> = Vec::with_capacity(WRITE_BATCH_FRAMES);
    let (stage_depth, counts_traffic) = link
        .env()
        .map_or((1, false), |e| (e.gpu_stage_depth(), e.counts_traffic()));
    // Frames taken off the channel and not yet written (or dropped): those
    // in `queue` between iterations.
    let mut taken = 0u64;
    loop {
        if queue.is_empty() {
            // Everything taken is written (each write took its frames off
            // the count below): the connection is idle unless more is
            // already queued (see `inline`).
            debug_assert_eq!(taken, 0);
            let idle = crate::trace_points::Stopwatch::start();
            let Some(first) = rx.recv().await else { return };
            idle.account(crate::trace_points::SUM_WRITER_IDLE);
            crate::trace_points::mark(crate::trace_points::WRITER_WOKE);
            taken += 1;
            staging += admit(&*link, first, &mut queue);
        }
        // Whatever else is already queued goes out in the same system call, and
        // the next GPU slices start their copies while this one is sent.
        while queue.len() < WRITE_BATCH_FRAMES && staging < stage_depth {
            match rx.try_recv() {
                Ok(o) => {
                    taken += 1;
                    staging += admit(&*link, o, &mut queue);
                }
                Err(_) => break,
            }
        }
        let result = match queue.pop_front() {
            // A staged slice's hold goes once its device copy is done: the pinned
            // buffer is ours.
            Some(Queued::Staging {
                header,
                transfer_id,
                len,
                device,
                copy,
                ..
            }) => {
                staging -= 1;
                let waited = crate::trace_points::Stopwatch::start();
                let done = copy.await;
                waited.account(crate::trace_points::SUM_WRITER_COPY_WAIT);
                let mut staged = vec![(header, transfer_id, len, done)];
                // Slices behind it whose copies are done already share the write.
                while let Some(Queued::Staging { copy, .. }) = queue.front_mut() {
                    let Ok(done) = copy.try_recv() else { break };
                    if let Some(Queued::Staging {
                        header,
                        transfer_id,
                        len,
                        ..
                    }) = queue.pop_front()
                    {
                        staging -= 1;
                        staged.push((header, transfer_id, len, Ok(done)));
                    }
                }
                let writing = crate::trace_points::Stopwatch::start();
                let sent = send_staged(&*link, writer.as_mut(), staged, &device).await;
                writing.account(crate::trace_points::SUM_WRITER_STAGED_WRITE);
                if let Ok(bytes) = &sent {
                    if bytes.slices > 0 {
                        counters.bytes_sent.increment(bytes.bytes);
                        counters.slices_sent.increment(bytes.slices);
                        m::gpu_staged_bytes("to_host").increment(bytes.bytes);
                    }
                }
                sent.map(|_| ())
            }
            Some(Queued::Ready(first)) => {
                let mut payload = 0;
                let mut next = Some(first);
                while let Some(o) = next.take() {
                    // A transfer that failed while its slices waited: they stay unsent.
                    if o.abandoned() {
                    } else if let Some((transfer_id, why)) = o.truncated_source() {
                        // The worker shrank the file: send nothing of it (its
                        // bytes are gone) and fail that transfer alone.
                        link.with_session(|s, now| {
                            s.fail(transfer_id, ErrorCode::RegionTruncated, &why, now)
                        });
                    } else {
                        payload += o.payload_len();
                        batch.push(o);
                    }
                    if batch.len() >= WRITE_BATCH_FRAMES || payload >= WRITE_BATCH_BYTES {
                        break;
                    }
                    if matches!(queue.front(), Some(Queued::Ready(_))) {
                        if let Some(Queued::Ready(o)) = queue.pop_front() {
                            next = Some(o);
                        }
                    }
                }
                crate::trace_points::mark(crate::trace_points::WRITER_WRITE);
                let writing = crate::trace_points::Stopwatch::start();
                let r = write_batch(writer.as_mut(), &batch).await;
                writing.account(crate::trace_points::SUM_WRITER_WRITE);
                crate::trace_points::mark(crate::trace_points::WRITER_WRITTEN);
                let slices = batch
                    .iter()
                    .filter(|o| matches!(o, Outgoing::Slice { .. }))
                    .count() as u64;
                if r.is_ok() && slices > 0 {
                    counters.bytes_sent.increment(payload);
                    counters.slices_sent.increment(slices);
                    if counts_traffic {
                        if let Some(env) = link.env() {
                            env.on_traffic(payload);
                        }
                    }
                }
                batch.clear();
                r
            }
            None => Ok(()),
        };
        if let Err(e) = result {
            link.connection_failed(key, &format!("write failed: {e}"));
            return;
        }
        // Frames taken and no longer waiting here are written (or dropped):
        // they leave the count now, so that it says what waits also when
        // the queue never runs dry (a saturated connection); frames being
        // written stay counted until their write is done (see `inline`).
        let finished = taken - queue.len() as u64;
        if finished > 0 {
            queued.fetch_sub(finished, std::sync::atomic::Ordering::AcqRel);
            taken -= finished;
        }
    }
}
