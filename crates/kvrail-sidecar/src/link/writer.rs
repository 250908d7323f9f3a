//! A connection's writer task: frames in order, whatever is queued gathered
//! into one vectored write (or handed to a zero-copy writer as views).

use super::*;

pub(super) async fn writer_task(
    link: Arc<PeerLink>,
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
        .env
        .upgrade()
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
            staging += link.admit(first, &mut queue);
        }
        // Whatever else is already queued goes out in the same system call, and
        // the next GPU slices start their copies while this one is sent.
        while queue.len() < WRITE_BATCH_FRAMES && staging < stage_depth {
            match rx.try_recv() {
                Ok(o) => {
                    taken += 1;
                    staging += link.admit(o, &mut queue);
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
                let sent = link.send_staged(writer.as_mut(), staged, &device).await;
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
                        if let Some(env) = link.env.upgrade() {
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
