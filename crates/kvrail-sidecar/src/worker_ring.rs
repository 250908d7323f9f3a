//! Worker rings: the sidecar's end of the shared-memory submission and
//! completion queues (layout in `kvrail_core::ring`, docs/ring-format.md).
//!
//! One thread per ring reads submissions (spinning briefly, then sleeping on
//! the ring's futex) and starts each through [`crate::submit`], the same path
//! gRPC pushes and pulls take; the answer (ACCEPTED or REJECTED) and, when
//! asked for, the worker's transfer notifications go to the completion queue.
//! A ring lives as long as the `OpenRing` call that opened it: when the worker
//! goes away its call ends and the ring is closed; when the sidecar closes a
//! ring (overrun, truncated file) it says why in the ring's header and ends
//! the call with that reason.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvrail_core::ring::{
    CloseReason, Completion, CompletionKind, RingBlocks, RingOp, Submission, VERSION,
};
use kvrail_core::BlockSelection;
use kvrail_proto::{Notification, RingEvent};
use kvrail_shm::ring::{Next, SidecarRing};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::Stream;
use tonic::Status;
use tracing::{info, warn};

use crate::daemon::Shared;
use crate::metrics as m;
use crate::notify::NotificationSink;
use crate::submit::{self, Start};

/// Completions held back for a worker that does not read its CQ; past this
/// the ring is closed. Kept well under what the hub retains per worker
/// (`notify::RETAINED`): a worker that resubscribes with the last sequence it
/// read from its ring gets what the closed ring still held, as long as its CQ
/// plus this backlog fit the retention (the default 1,024-entry CQ does).
pub const BACKLOG_MAX: usize = 1024;
/// Rings one sidecar serves at once (each has a thread), and per worker id.
pub const RINGS_MAX: u32 = 256;
pub const RINGS_PER_WORKER_MAX: u32 = 8;
/// Longest sleep between checks of the ring file and of a close request.
const SLEEP: Duration = Duration::from_millis(20);

static RINGS: AtomicU32 = AtomicU32::new(0);
static PER_WORKER: std::sync::LazyLock<dashmap::DashMap<String, u32>> =
    std::sync::LazyLock::new(dashmap::DashMap::new);

/// One ring's share of the limits, given back on drop (every close path).
struct Slot {
    worker_id: String,
}

impl Slot {
    fn take(worker_id: &str) -> Result<Slot, Status> {
        if RINGS.fetch_add(1, Ordering::SeqCst) >= RINGS_MAX {
            RINGS.fetch_sub(1, Ordering::SeqCst);
            return Err(Status::resource_exhausted(format!(
                "this sidecar serves {RINGS_MAX} rings already"
            )));
        }
        let mut n = PER_WORKER.entry(worker_id.to_string()).or_insert(0);
        if *n >= RINGS_PER_WORKER_MAX {
            drop(n);
            RINGS.fetch_sub(1, Ordering::SeqCst);
            return Err(Status::resource_exhausted(format!(
                "worker {worker_id:?} has {RINGS_PER_WORKER_MAX} rings already"
            )));
        }
        *n += 1;
        m::rings_open().increment(1.0);
        Ok(Slot {
            worker_id: worker_id.to_string(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        RINGS.fetch_sub(1, Ordering::SeqCst);
        PER_WORKER.remove_if_mut(&self.worker_id, |_, n| {
            *n = n.saturating_sub(1);
            *n == 0
        });
        m::rings_open().decrement(1.0);
    }
}

/// One served ring.
pub struct RingService {
    ring: SidecarRing,
    worker_id: String,
    shared: Weak<Shared>,
    notifications: bool,
    /// Completions waiting for CQ room, oldest first. Its lock also orders
    /// every publication into the CQ.
    backlog: Mutex<VecDeque<Completion>>,
    closing: AtomicBool,
    reason: AtomicU32,
    /// Ends the worker's `OpenRing` call with the close reason.
    events: mpsc::UnboundedSender<Result<RingEvent, Status>>,
    finished: AtomicBool,
    _slot: Slot,
}

/// Keeps a ring served while the `OpenRing` response stream lives.
pub struct RingStream {
    events: UnboundedReceiverStream<Result<RingEvent, Status>>,
    service: Arc<RingService>,
}

impl Stream for RingStream {
    type Item = Result<RingEvent, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.events).poll_next(cx)
    }
}

impl Drop for RingStream {
    fn drop(&mut self) {
        self.service.request_close(CloseReason::WorkerClosed);
    }
}

/// Whether a ring takes its worker's transfer notifications.
#[derive(Debug, Clone, Copy)]
pub struct Notifications {
    pub wanted: bool,
    /// From a live stream of the same worker held by another process.
    pub take_over: bool,
    /// The process opening the ring.
    pub pid: Option<i32>,
}

/// Opens and starts serving a worker's ring.
pub fn open(
    shared: &Arc<Shared>,
    worker_id: &str,
    path: &str,
    notes: Notifications,
    caller: kvrail_shm::Caller,
) -> Result<RingStream, Status> {
    let notifications = notes.wanted;
    submit::require_text(worker_id, "worker_id")?;
    let slot = Slot::take(worker_id)?;
    let ring = SidecarRing::open(path, caller).map_err(ring_open_status)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let service = Arc::new(RingService {
        ring,
        worker_id: worker_id.to_string(),
        shared: Arc::downgrade(shared),
        notifications,
        backlog: Mutex::new(VecDeque::new()),
        closing: AtomicBool::new(false),
        reason: AtomicU32::new(0),
        events: tx,
        finished: AtomicBool::new(false),
        _slot: slot,
    });
    if notifications {
        let sink: Arc<dyn NotificationSink> = service.clone();
        if let Err(e) = shared
            .hub
            .attach_sink(worker_id, sink, notes.pid, notes.take_over)
        {
            service.ring.close(CloseReason::WorkerClosed);
            return Err(Status::already_exists(e.to_string()));
        }
    }
    let _ = service.events.send(Ok(RingEvent {
        version: VERSION,
        incarnation: shared.incarnation,
    }));
    let handle = tokio::runtime::Handle::current();
    let thread_service = service.clone();
    let spawned = std::thread::Builder::new()
        .name("kvrail-ring".into())
        .spawn(move || {
            // Whatever happens in `serve` (a panic included), the ring is
            // closed, the worker told and the limits given back.
            let finish = FinishOnDrop(thread_service.clone());
            thread_service.serve(&handle);
            drop(finish);
        });
    if let Err(e) = spawned {
        service.finish(CloseReason::SidecarStopping);
        return Err(Status::resource_exhausted(format!(
            "cannot start the ring's thread: {e}"
        )));
    }
    let g = service.ring.geometry();
    info!(worker = %worker_id, path, sq = g.sq_entries, cq = g.cq_entries, slot = g.sq_slot_bytes, notifications, "ring opened");
    Ok(RingStream {
        events: UnboundedReceiverStream::new(rx),
        service,
    })
}

struct FinishOnDrop(Arc<RingService>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        let reason = CloseReason::from_u32(self.0.reason.load(Ordering::Acquire))
            .unwrap_or(CloseReason::SidecarStopping);
        self.0.finish(reason);
    }
}

fn ring_open_status(e: kvrail_shm::ring::RingIoError) -> Status {
    use kvrail_shm::ring::RingIoError as E;
    use kvrail_shm::ShmError;
    match e {
        E::Shm(ShmError::Open { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Status::not_found(format!("ring file: {source}"))
        }
        E::Shm(ShmError::NotOwner { .. }) => Status::permission_denied(e.to_string()),
        E::Shm(ShmError::GuardFull(_)) => Status::resource_exhausted(e.to_string()),
        E::AlreadyOpen => Status::already_exists(e.to_string()),
        e => Status::invalid_argument(format!("ring: {e}")),
    }
}

fn selection(b: RingBlocks) -> BlockSelection {
    BlockSelection {
        region_id: b.region_id,
        layer_start: b.layer_start,
        layer_count: b.layer_count,
        block_ids: b.block_ids(),
        generations: b.generations,
        slice: None,
        first_token: 0,
    }
}

impl RingService {
    fn serve(self: Arc<Self>, handle: &tokio::runtime::Handle) {
        let inline_writes = self
            .shared
            .upgrade()
            .is_some_and(|s| s.config.ring_inline_writes);
        // Spinning after the last submission before sleeping: a worker that
        // streams layer pushes finds the thread awake (no wake-up system call).
        let mut spin = self.shared.upgrade().map_or_else(
            || kvrail_core::ring::SpinPolicy::fixed(Duration::ZERO),
            |s| s.config.ring_spin(),
        );
        let mut since_check = 0u32;
        loop {
            if self.closing.load(Ordering::Acquire) {
                break;
            }
            let backlogged = self.drain_backlog();
            let sleep = if backlogged {
                Duration::from_millis(1)
            } else {
                SLEEP
            };
            let woke = self
                .ring
                .wait(spin.spin(Instant::now()), sleep, &self.closing);
            since_check += 1;
            if !woke || since_check >= 256 {
                since_check = 0;
                if self.ring.is_damaged() {
                    self.request_close(CloseReason::Truncated);
                } else if !self.ring.header_intact() {
                    self.request_close(CloseReason::HeaderChanged);
                }
            }
            let mut found = false;
            loop {
                if self.closing.load(Ordering::Acquire) {
                    break;
                }
                match self.ring.next() {
                    Next::Empty => break,
                    Next::Submission(s) => {
                        crate::trace_points::mark(crate::trace_points::RING_SUBMISSION);
                        if !found {
                            found = true;
                            spin.note_submissions(Instant::now());
                        }
                        crate::link::set_inline_writes_on_this_thread(
                            inline_writes && !self.ring.has_submissions(),
                        );
                        self.start(s, handle);
                        crate::link::set_inline_writes_on_this_thread(false);
                    }
                    Next::Corrupt(user_data, e) => {
                        m::ring_submissions("corrupt").increment(1);
                        self.reject(user_data, String::new(), "bad_descriptor", &e.to_string());
                    }
                    Next::Overrun(reason) => {
                        self.request_close(reason);
                        break;
                    }
                }
            }
        }
        if self.reason.load(Ordering::Acquire) == 0 {
            self.reason
                .store(CloseReason::WorkerClosed as u32, Ordering::Release);
        }
    }

    /// Starts one submission and answers it.
    fn start(&self, s: Submission, handle: &tokio::runtime::Handle) {
        let Some(shared) = self.shared.upgrade() else {
            self.request_close(CloseReason::SidecarStopping);
            return;
        };
        // The peer's answer will come to a runtime worker: keep one awake.
        shared.busy_poll.touch(0);
        let push = s.op == RingOp::Push;
        let (local, remote) = if push {
            (s.source, s.destination)
        } else {
            (s.destination, s.source)
        };
        // The transfer's own path is synchronous once the peer's link is up;
        // only the first transfer to a peer waits here for the dial.
        let started = handle.block_on(submit::start_transfer(
            &shared,
            Start {
                push,
                request_id: &s.request_id,
                worker_id: &self.worker_id,
                peer: &s.peer,
                local: selection(local),
                remote: selection(remote),
                // Ring slots carry no group: grouped transfers go by gRPC.
                group: None,
                receiver_group: None,
            },
        ));
        match started {
            Ok(accepted) => {
                m::ring_submissions("accepted").increment(1);
                self.publish(Completion {
                    kind: CompletionKind::Accepted,
                    failure_side: 0,
                    user_data: s.user_data,
                    transfer_id: accepted.transfer_id,
                    region_id: 0,
                    bytes: accepted.total_bytes,
                    elapsed_us: 0,
                    // ACCEPTED's sequence word is the gRPC reply's `segments`.
                    sequence: accepted.segments,
                    incarnation: 0,
                    request_id: s.request_id,
                    peer: s.peer,
                    code: String::new(),
                    message: String::new(),
                });
            }
            Err(refusal) => {
                m::ring_submissions("rejected").increment(1);
                self.reject(
                    s.user_data,
                    s.request_id,
                    refusal.code,
                    refusal.status.message(),
                );
            }
        }
    }

    fn reject(&self, user_data: u64, request_id: String, code: &str, message: &str) {
        self.publish(Completion {
            kind: CompletionKind::Rejected,
            failure_side: kvrail_proto::FailureSide::Local as u8,
            user_data,
            transfer_id: 0,
            region_id: 0,
            bytes: 0,
            elapsed_us: 0,
            sequence: 0,
            incarnation: 0,
            request_id,
            peer: String::new(),
            code: code.into(),
            message: message.into(),
        });
    }

    /// Publishes a completion in order: behind any backlog, else straight
    /// into the CQ.
    fn publish(&self, c: Completion) {
        crate::trace_points::mark(crate::trace_points::RING_COMPLETION);
        let mut backlog = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if backlog.is_empty() {
            match self.ring.complete(&c) {
                Ok(true) => {
                    crate::trace_points::mark(crate::trace_points::RING_COMPLETION_WRITTEN);
                    return;
                }
                Ok(false) => {}
                Err(_) => {
                    drop(backlog);
                    self.request_close(CloseReason::CompletionOverrun);
                    return;
                }
            }
        }
        if backlog.len() >= BACKLOG_MAX {
            drop(backlog);
            self.request_close(CloseReason::CompletionBacklog);
            return;
        }
        backlog.push_back(c);
        self.ring.set_backlogged(backlog.len() as u64);
        if backlog.len() == 1 {
            // The thread sleeps shorter while something waits for room.
            self.ring.wake_service();
        }
    }

    /// Moves held-back completions into the CQ as room allows; whether any
    /// are still waiting.
    fn drain_backlog(&self) -> bool {
        let mut backlog = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if backlog.is_empty() {
            return false;
        }
        while let Some(c) = backlog.front() {
            match self.ring.complete(c) {
                Ok(true) => {
                    backlog.pop_front();
                }
                Ok(false) => break,
                Err(_) => {
                    drop(backlog);
                    self.request_close(CloseReason::CompletionOverrun);
                    return false;
                }
            }
        }
        self.ring.set_backlogged(backlog.len() as u64);
        !backlog.is_empty()
    }

    fn request_close(&self, reason: CloseReason) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            self.reason.store(reason as u32, Ordering::Release);
        }
        self.ring.wake_service();
    }

    /// Stops serving: tells the worker in the ring's header and on its call.
    fn finish(self: &Arc<Self>, reason: CloseReason) {
        if self.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        self.closing.store(true, Ordering::Release);
        self.ring.close(reason);
        if self.notifications {
            if let Some(shared) = self.shared.upgrade() {
                let sink: Arc<dyn NotificationSink> = self.clone();
                shared.hub.detach_sink(&self.worker_id, &sink);
            }
        }
        let _ = self
            .events
            .send(Err(Status::aborted(format!("ring closed: {reason}"))));
        m::rings_closed(format!("{reason:?}")).increment(1);
        if reason == CloseReason::WorkerClosed {
            info!(worker = %self.worker_id, "ring closed: {reason}");
        } else {
            warn!(worker = %self.worker_id, "ring closed: {reason}");
        }
    }
}

impl NotificationSink for RingService {
    fn deliver(&self, n: &Notification) -> bool {
        if self.closing.load(Ordering::Acquire) || !Completion::fits(&n.request_id, &n.peer) {
            return false;
        }
        let Some(kind) = u8::try_from(n.kind)
            .ok()
            .and_then(CompletionKind::from_u8)
            .filter(|k| (*k as u8) <= CompletionKind::Failed as u8)
        else {
            return false;
        };
        let failure = n.failure.clone().unwrap_or_default();
        self.publish(Completion {
            kind,
            failure_side: u8::try_from(failure.side).unwrap_or(0),
            user_data: 0,
            transfer_id: n.transfer_id,
            region_id: n.region_id,
            bytes: n.bytes,
            elapsed_us: n.elapsed_us,
            sequence: n.sequence,
            incarnation: n.incarnation,
            request_id: n.request_id.clone(),
            peer: n.peer.clone(),
            code: failure.code,
            message: failure.message,
        });
        true
    }
}
