//! A connection's reader task: frames off the wire, payload straight into the
//! destination blocks, control messages into the session.
//!
//! Host-memory slices are admitted and placed through their transfer's gate
//! (`kvrail_core::placement`), without the link's lock; what the reader placed,
//! and control messages read back to back, go into the session together, in
//! one lock: when enough wait, and always before the reader waits for the peer
//! (so nothing it holds back can stall a sender that waits for it).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use kvrail_core::wire::{self, Body, ErrorCode};
use kvrail_core::{Admission, Admitted, ConnId, ConnPlacer, SliceDisposition};
use kvrail_transport::{read_frame, Frame, FrameReader, TransportError};
use tracing::debug;

use super::conns::ConnKey;
use super::env::LinkEnv;
use super::gpu_staging::receive_staged;
use super::inline;
use super::owner::ConnOwner;
use crate::metrics as m;
use crate::regions::RegionMemory;

/// Control messages read back to back that go into the session in one lock...
const CONTROL_BATCH: usize = 64;
/// ...unless their opens name this many blocks before that (a generation
/// counts twice: eight bytes decoded against an id's four).
const CONTROL_BATCH_BLOCKS: usize = 1 << 16;

pub(super) async fn reader_task<L: ConnOwner>(
    link: Arc<L>,
    key: ConnKey,
    counters: m::ConnCounters,
    mut reader: Box<dyn FrameReader>,
    reading: Arc<AtomicU64>,
    writer_queued: Arc<AtomicU64>,
) {
    let mut held = Held::new(link.clone(), key);
    let read = read_loop(
        &link,
        key.0,
        &counters,
        reader.as_mut(),
        &mut held,
        (&reading, &writer_queued),
    );
    let reason = match read.await {
        Ok(()) => "link closed".to_string(),
        Err(TransportError::Wire(e)) => {
            m::frames_rejected(wire_reason(&e)).increment(1);
            format!("malformed frame: {e}")
        }
        Err(e) => e.to_string(),
    };
    // Slices placed in full count; the one cut off is abandoned.
    held.settle(false);
    link.connection_failed(key, &reason);
}

pub(super) fn wire_reason(e: &wire::WireError) -> &'static str {
    match e {
        wire::WireError::BadMagic(_) => "bad_magic",
        wire::WireError::Version(_) => "version",
        wire::WireError::UnknownKind(_) => "unknown_kind",
        wire::WireError::TooLong { .. } | wire::WireError::MessageTooLong { .. } => "too_long",
        wire::WireError::TooManyEntries { .. } => "too_many_entries",
        wire::WireError::ShortData => "short_data",
        wire::WireError::Decode(_) | wire::WireError::EmptyMessage => "decode",
    }
}

/// What a reader holds back from the session: slices placed through their
/// gates, the one being read, control messages read back to back. Settled in
/// one lock; also when the reader's task is stopped (dropped) mid-read, so
/// that no transfer waits for ever on a slice its gate counted.
struct Held<L: ConnOwner> {
    link: Arc<L>,
    /// The connection's slot and generation: a task dropped late must not
    /// credit its slices to the connection that took the slot since.
    key: ConnKey,
    placer: ConnPlacer,
    /// Admitted, payload being read now.
    reading: Option<Admitted>,
    controls: Vec<Body>,
    /// Blocks (and generations, twice) the opens among `controls` name.
    control_blocks: usize,
}

impl<L: ConnOwner> Held<L> {
    fn new(link: Arc<L>, key: ConnKey) -> Self {
        Self {
            link,
            key,
            placer: ConnPlacer::default(),
            reading: None,
            controls: Vec::new(),
            control_blocks: 0,
        }
    }

    fn is_empty(&self) -> bool {
        !self.placer.has_placed() && self.reading.is_none() && self.controls.is_empty()
    }

    /// Hands everything held to the session, in the order it arrived (the
    /// slices before the control messages after them). `last`: the
    /// connection has no input at hand (its control replies may be written
    /// at once, see `inline`).
    fn settle(&mut self, last: bool) {
        self.settle_then_gate(last, None);
    }

    /// As `settle`, then, in the same lock, the placement gate of transfer
    /// `gate_of` (a slice's first on this connection, whose open may be among
    /// the control messages: one lock instead of two per small transfer).
    /// `None` when nothing was asked or the session has no gate for it.
    fn settle_then_gate(
        &mut self,
        last: bool,
        gate_of: Option<u64>,
    ) -> Option<Arc<kvrail_core::PlacementGate>> {
        if self.is_empty() && gate_of.is_none() {
            return None;
        }
        let placed = self.placer.take_placed();
        let reading = self.reading.take();
        let controls = std::mem::take(&mut self.controls);
        self.control_blocks = 0;
        let env = self.link.env();
        let dir = env.as_ref().map(|env| env.directory());
        inline::with_inline_control(last, || {
            self.link.with_session_from(self.key, |s, conn, now| {
                s.merge_placed(conn, placed, now);
                if let Some(slice) = reading {
                    s.admitted_abandoned(slice);
                }
                // A stale slot's control messages are dropped with it.
                if let (Some(conn), Some(dir)) = (conn, &dir) {
                    for body in controls {
                        s.handle_control(conn, body, now, dir);
                    }
                }
                gate_of.and_then(|id| s.placement_gate(id))
            })
        })
    }

    /// Hands only the placed slices to the session (a slice is being read).
    fn settle_placed(&mut self) {
        let placed = self.placer.take_placed();
        self.link
            .with_session_from(self.key, |s, conn, now| s.merge_placed(conn, placed, now));
    }
}

impl<L: ConnOwner> Drop for Held<L> {
    fn drop(&mut self) {
        // The task was stopped between two polls (never inside the link's
        // lock: a stopped task is dropped by the runtime, later). Outside a
        // runtime (shut down) there is nobody left to tell.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.settle(false);
        }
    }
}

/// Polls `fut` once: its output if it is ready now.
async fn ready_now<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx))).await
}

async fn read_loop<L: ConnOwner>(
    link: &Arc<L>,
    conn: ConnId,
    counters: &m::ConnCounters,
    reader: &mut dyn FrameReader,
    held: &mut Held<L>,
    // The transfer whose payload is being read (see `PayloadDeadline`), and
    // the frames the connection's writer has to write.
    (reading, writer_queued): (&AtomicU64, &AtomicU64),
) -> Result<(), TransportError> {
    loop {
        let Some(env) = link.env() else {
            return Ok(());
        };
        let may_spin = reader.can_spin() && env.reader_spin_on();
        if (!held.is_empty() || may_spin) && !reader.input_pending() {
            // Nothing at hand: the session hears of what is held before this
            // reader waits for the peer.
            held.settle(true);
            // The reply to what was just settled may be microseconds away:
            // poll for it rather than sleep. A yield first, so that a task
            // this one woke (kept in this worker's slot, which others do not
            // steal) runs before the spin, not after it.
            if may_spin {
                tokio::task::yield_now().await;
                if let Some(spin) = env.reader_spin() {
                    // Not while the connection's writer has frames: on a
                    // thread of its own the writer waits for the spin.
                    let writer_busy = || writer_queued.load(Ordering::Acquire) > 0;
                    let until = std::time::Instant::now() + spin.length;
                    if !writer_busy() && reader.spin_for_input(until, &writer_busy) {
                        counters.reader_spin_frames.increment(1);
                    }
                }
            }
        }
        let frame = {
            let mut next = std::pin::pin!(read_frame(reader));
            if held.is_empty() {
                next.await?
            } else {
                match ready_now(&mut next).await {
                    Poll::Ready(frame) => frame?,
                    Poll::Pending => {
                        // Nothing more at hand: the session hears of what is held
                        // before this reader waits for the peer.
                        held.settle(true);
                        next.await?
                    }
                }
            }
        };
        crate::trace_points::mark(crate::trace_points::FRAME_READ);
        env.on_traffic(match &frame {
            Frame::Data { payload_len, .. } => u64::from(*payload_len),
            Frame::Control(_) => 0,
        });
        match frame {
            Frame::Control(Body::RdmaConnect(req)) => {
                held.settle(false);
                link.on_rdma_connect(conn, req)
            }
            Frame::Control(Body::RdmaAccept(a)) => {
                held.settle(false);
                link.on_rdma_accept(a)
            }
            Frame::Control(body) => {
                // An open names up to a million blocks (12 MiB decoded):
                // large ones go to the session at once, not held back with
                // others (64 of them would be held at once).
                let set = match &body {
                    Body::PushOpen(o) => o.destination.as_ref(),
                    Body::PullOpen(o) => o.source.as_ref(),
                    _ => None,
                };
                held.control_blocks +=
                    set.map_or(0, |b| b.block_ids.len() + 2 * b.generations.len());
                held.controls.push(body);
                if held.controls.len() >= CONTROL_BATCH
                    || held.control_blocks >= CONTROL_BATCH_BLOCKS
                {
                    held.settle(false);
                }
            }
            Frame::Data {
                header,
                payload_len,
            } => {
                crate::trace_points::mark(crate::trace_points::SLICE_HEADER);
                let id = header.transfer_id;
                // The first slice of a transfer on this connection learns its
                // gate, in the lock that hands over an open read before it.
                let first = !held.placer.knows(id);
                let mut gate_asked = None;
                if !held.controls.is_empty() {
                    // An open may be among them: it goes in before its slices.
                    gate_asked = Some(held.settle_then_gate(false, first.then_some(id)));
                }
                crate::trace_points::mark(crate::trace_points::SLICE_OPEN_SETTLED);
                let mut admission = held.placer.admit(header, payload_len);
                if matches!(admission, Admission::AskSession) && first {
                    // GPU regions' slices are staged, and ask the session.
                    let gate = match gate_asked {
                        Some(gate) => gate,
                        None => {
                            let placed = held.placer.take_placed();
                            link.with_session_from(held.key, |s, conn, now| {
                                s.merge_placed(conn, placed, now);
                                s.placement_gate(id)
                            })
                        }
                    };
                    let gate = gate.filter(|g| {
                        env.registry()
                            .get(g.region_id())
                            .is_some_and(|r| !r.memory.is_staged())
                    });
                    held.placer.learn(id, gate);
                    crate::trace_points::mark(crate::trace_points::SLICE_GATE_LEARNED);
                    admission = held.placer.admit(header, payload_len);
                }
                // Payload reads have a deadline (not the waits for this
                // node's own staging buffers).
                let mut timed = PayloadDeadline {
                    inner: reader,
                    limit: link.payload_deadline(),
                    transfer: id,
                    reading,
                };
                match admission {
                    Admission::Place(slice) => {
                        place_admitted(&env, counters, &mut timed, held, slice).await?;
                    }
                    Admission::AskSession => {
                        held.settle(false);
                        place_by_session(
                            link,
                            &env,
                            conn,
                            counters,
                            &mut timed,
                            header,
                            payload_len,
                        )
                        .await?;
                    }
                }
            }
        }
    }
}

/// A connection's reader while it reads a slice's payload: a peer that sent
/// a data frame's header must send its payload within the progress timeout
/// plus a second per MiB, or the connection is cut. A peer that stops
/// mid-payload with its connection open (or a partition without a reset)
/// would otherwise leave the slice "being placed" for ever, its transfer
/// never ending and its region in use. A read already complete when first
/// polled arms no timer.
struct PayloadDeadline<'a> {
    inner: &'a mut dyn FrameReader,
    limit: std::time::Duration,
    transfer: u64,
    /// The transfer whose payload this connection is reading now, plus one
    /// (0: none): what a worker's ReleaseBlocks cuts when it takes too long.
    reading: &'a std::sync::atomic::AtomicU64,
}

impl PayloadDeadline<'_> {
    fn mark_reading(&self, reading: bool) {
        let v = if reading {
            self.transfer.wrapping_add(1)
        } else {
            0
        };
        self.reading.store(v, std::sync::atomic::Ordering::Release);
    }
}

/// Bytes a second a payload is allowed at least, on top of the progress
/// timeout (a slow but moving peer keeps its connection).
const PAYLOAD_FLOOR_BYTES_PER_SEC: u64 = 1 << 20;

impl PayloadDeadline<'_> {
    async fn within<T>(
        limit: std::time::Duration,
        transfer: u64,
        len: u64,
        read: impl Future<Output = std::io::Result<T>>,
    ) -> std::io::Result<T> {
        let mut read = std::pin::pin!(read);
        if let Poll::Ready(done) = ready_now(&mut read).await {
            return done;
        }
        let limit = limit + std::time::Duration::from_secs(len / PAYLOAD_FLOOR_BYTES_PER_SEC);
        match tokio::time::timeout(limit, read).await {
            Ok(done) => done,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the peer sent the header of a slice of transfer {transfer} and not all of its payload ({len} bytes) within {limit:?}"
                ),
            )),
        }
    }
}

#[async_trait::async_trait]
impl FrameReader for PayloadDeadline<'_> {
    async fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let len = buf.len() as u64;
        self.mark_reading(true);
        let read = Self::within(self.limit, self.transfer, len, self.inner.read_exact(buf)).await;
        self.mark_reading(false);
        read
    }

    async fn read_payload(&mut self, dst: &mut [std::io::IoSliceMut<'_>]) -> std::io::Result<()> {
        let len = dst.iter().map(|b| b.len() as u64).sum();
        self.mark_reading(true);
        let read = Self::within(self.limit, self.transfer, len, self.inner.read_payload(dst)).await;
        self.mark_reading(false);
        read
    }

    fn input_pending(&mut self) -> bool {
        self.inner.input_pending()
    }

    fn can_spin(&self) -> bool {
        self.inner.can_spin()
    }

    fn spin_for_input(&mut self, until: std::time::Instant, stop: &dyn Fn() -> bool) -> bool {
        self.inner.spin_for_input(until, stop)
    }

    async fn discard(&mut self, len: u64) -> std::io::Result<()> {
        Self::within(self.limit, self.transfer, len, self.inner.discard(len)).await
    }
}

/// Why the bytes just read into `pieces` of `host` did not land: the worker
/// shrank the file under the mapping, so they went to zero pages (the
/// transfer fails, the connection goes on).
fn truncation(host: &kvrail_shm::SharedRegion, pieces: &[(u64, u64)]) -> Option<String> {
    let end = pieces.iter().map(|(o, l)| o + l).max().unwrap_or(0);
    host.check_intact(0, end).err().map(|e| e.to_string())
}

/// Reads a slice its gate admitted into its host region; the session hears of
/// it with the next batch.
async fn place_admitted<L: ConnOwner>(
    env: &Arc<dyn LinkEnv<Link = L>>,
    counters: &m::ConnCounters,
    reader: &mut dyn FrameReader,
    held: &mut Held<L>,
    slice: Admitted,
) -> Result<(), TransportError> {
    let payload_len = slice.len;
    let transfer_id = slice.header.transfer_id;
    let region = env.registry().get(slice.region_id());
    // Owned, so that what is held can be settled while the payload is read.
    let pieces = slice.pieces.clone();
    // From here on the slice is settled however this ends (see `Held`).
    held.reading = Some(slice);
    let host = match region.as_deref().map(|r| &r.memory) {
        Some(RegionMemory::Host(host)) => host,
        // Unregistered since (its transfers fail), or no longer host memory:
        // the payload is dropped, the slice abandoned, and the session
        // decides this transfer's later slices.
        _ => {
            held.placer.learn(transfer_id, None);
            reader.discard(u64::from(payload_len)).await?;
            held.settle(false);
            return Ok(());
        }
    };
    {
        crate::trace_points::mark(crate::trace_points::SLICE_PAYLOAD_START);
        let mut bufs = host.io_slices_mut(&pieces).map_err(std::io::Error::other)?;
        let mut read = std::pin::pin!(reader.read_payload(&mut bufs));
        if !held.placer.has_placed() {
            read.await?;
        } else if let Poll::Ready(r) = ready_now(&mut read).await {
            r?;
        } else {
            // Slices already placed do not wait behind this one's payload.
            held.settle_placed();
            read.await?;
        }
    }
    crate::trace_points::mark(crate::trace_points::SLICE_PAYLOAD_READ);
    if let Some(reason) = truncation(host, &pieces) {
        if let Some(slice) = held.reading.take() {
            let placed = held.placer.take_placed();
            held.link.with_session_from(held.key, |s, conn, now| {
                s.merge_placed(conn, placed, now);
                s.admitted_failed(slice, ErrorCode::RegionTruncated, &reason, now);
            });
        }
        return Ok(());
    }
    counters.bytes_received.increment(u64::from(payload_len));
    counters.slices_received.increment(1);
    if let Some(slice) = held.reading.take() {
        held.placer.placed(slice);
    }
    crate::trace_points::mark(crate::trace_points::SLICE_CHECKED);
    if held.placer.should_merge(true) {
        held.settle(false);
    }
    Ok(())
}

/// A slice the session places itself: of a GPU region, of a transfer this
/// connection has no open gate for, or one the gate could not admit.
async fn place_by_session<L: ConnOwner>(
    link: &Arc<L>,
    env: &Arc<dyn LinkEnv<Link = L>>,
    conn: ConnId,
    counters: &m::ConnCounters,
    reader: &mut dyn FrameReader,
    header: kvrail_core::wire::SliceHeader,
    payload_len: u32,
) -> Result<(), TransportError> {
    match link.with_session(|s, now| s.accept_slice(conn, header, payload_len, now)) {
        SliceDisposition::Place { region_id, pieces } => {
            let Some(region) = env.registry().get(region_id) else {
                reader.discard(u64::from(payload_len)).await?;
                link.with_session(|s, _| s.slice_abandoned(conn, header));
                return Ok(());
            };
            let host = match &region.memory {
                RegionMemory::Host(host) => host,
                RegionMemory::Gpu(g) => {
                    return receive_staged(link, conn, header, payload_len, pieces, g, reader)
                        .await;
                }
            };
            let read = match host.io_slices_mut(&pieces) {
                Ok(mut bufs) => reader.read_payload(&mut bufs).await,
                Err(e) => Err(std::io::Error::other(e)),
            };
            if let Err(e) = read {
                link.with_session(|s, _| s.slice_abandoned(conn, header));
                return Err(e.into());
            }
            if let Some(reason) = truncation(host, &pieces) {
                link.with_session(|s, now| {
                    s.placement_failed_with(conn, header, ErrorCode::RegionTruncated, &reason, now)
                });
                return Ok(());
            }
            counters.bytes_received.increment(u64::from(payload_len));
            counters.slices_received.increment(1);
            let last = !reader.input_pending();
            inline::with_inline_control(last, || {
                link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now))
            });
        }
        SliceDisposition::Discard => {
            debug!(peer = %link.peer(), transfer = header.transfer_id, "discarding slice of an unknown or finished transfer");
            reader.discard(u64::from(payload_len)).await?;
        }
    }
    Ok(())
}
