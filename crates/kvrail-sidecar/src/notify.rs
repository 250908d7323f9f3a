//! Per-worker notification streams.
//!
//! Every notification of a worker gets the next number of that worker's
//! sequence (from 1). The last [`RETAINED`] are kept whether or not they were
//! delivered, so a worker that resubscribes with the last sequence it saw
//! (`after_sequence`) gets exactly what it missed; a gap in the numbers it
//! receives means older ones were dropped from the retention. A fresh subscribe
//! (`after_sequence` 0) gets what no subscriber was handed yet.
//!
//! One live subscription per worker: a second one is refused (ALREADY_EXISTS)
//! unless it asks to take over, and then the first stream ends with ABORTED
//! saying so. A stream the hub gives up (taken over, fallen too far behind)
//! has its queue emptied at once: what it held unread is dropped (the mailbox
//! still retains it for a resume), whether or not its reader ever reads again.
//!
//! Memory: a worker's mailbox retains at most [`RETAINED_BYTES`], all of them
//! [`RETAINED_BYTES_ALL`]; a live stream queues at most [`MAX_QUEUED_BYTES`]
//! unread, all of them [`MAX_QUEUED_BYTES_ALL`]. Sizes are what a
//! notification holds on the heap ([`held_size`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use dashmap::DashMap;
use kvrail_proto::{Notification, NotificationKind};
use tonic::Status;

/// Notifications kept per worker for resubscription...
pub const RETAINED: usize = 4096;
/// ...and at most this many bytes of them (a Done notification lists the
/// transfer's blocks: up to a million ids).
pub const RETAINED_BYTES: usize = 64 << 20;
/// Bytes retained over all mailboxes: peers can send messages to every
/// worker that subscribed here, and each mailbox keeps up to
/// [`RETAINED_BYTES`]. Past it, a mailbox that takes a notification lets go
/// of its own oldest first (each keeps at least its newest).
pub const RETAINED_BYTES_ALL: usize = 1 << 30;
/// Mailboxes kept; past it, those of workers with no live stream and no ring
/// go (each worker id named by any call makes one).
pub const MAX_MAILBOXES: usize = 4096;
/// Messages from peers to workers that have not subscribed here (yet) are
/// held this long, at most [`EARLY_MESSAGES`] of them over all workers: a
/// worker whose sidecar just restarted subscribes again a moment after its
/// peers' messages (a push grant) may already be on their way.
pub const EARLY_MESSAGE_TTL: std::time::Duration = std::time::Duration::from_secs(30);
/// See [`EARLY_MESSAGE_TTL`] (with 16 KiB payloads: at most 4 MiB).
pub const EARLY_MESSAGES: usize = 256;

/// What a subscription stream carries.
pub type Item = Result<Notification, Status>;

/// Bytes of notifications a live stream may have queued and not yet read.
/// A worker that stops reading its stream (HTTP/2 flow control then stops
/// the server taking from the queue) has the stream ended with
/// RESOURCE_EXHAUSTED instead of the queue growing without end; it resumes
/// with `after_sequence` from what the mailbox retains. Twice what a mailbox
/// retains, so that a resubscription's backlog always fits.
pub const MAX_QUEUED_BYTES: usize = 2 * RETAINED_BYTES;
/// Bytes queued unread over all live streams: past it, the stream that
/// would go over is ended as one that fell behind.
pub const MAX_QUEUED_BYTES_ALL: usize = 1 << 30;
/// What each notification counts beyond its variable-length fields.
const ITEM_OVERHEAD: usize = std::mem::size_of::<Notification>() + 64;

/// The heap a notification holds (its block ids at four bytes each, its
/// strings and payload), which every bound here counts.
pub fn held_size(n: &Notification) -> usize {
    ITEM_OVERHEAD
        + 4 * n.block_ids.len()
        + n.request_id.len()
        + n.peer.len()
        + n.payload.len()
        + n.from_worker.len()
        + n.failure
            .as_ref()
            .map_or(0, |f| f.code.len() + f.message.len())
}

/// One stream's queue, shared by the hub (which fills it, and empties it
/// when it gives the stream up) and the stream (which drains it).
struct StreamQueue {
    state: Mutex<QueueState>,
    /// Bytes queued over all streams (the hub's count).
    all: Arc<AtomicUsize>,
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Item>,
    /// [`held_size`] of the notifications in `items`.
    bytes: usize,
    /// Nothing more comes: the hub ended the stream (its last item says why).
    ended: bool,
    /// The stream was dropped: nothing will read.
    reader_gone: bool,
    waker: Option<Waker>,
}

impl StreamQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops everything queued (and its bytes from the count).
    fn clear(&self, st: &mut QueueState) {
        self.all.fetch_sub(st.bytes, Ordering::AcqRel);
        st.items.clear();
        st.bytes = 0;
    }
}

/// The hub's end of a live stream.
struct Subscriber {
    queue: Arc<StreamQueue>,
    /// The process that subscribed (None: not known).
    pid: Option<i32>,
}

impl Subscriber {
    /// Queues `n`; false (and the stream ended, telling why) when the stream
    /// is gone or would hold more than [`MAX_QUEUED_BYTES`] unread (or the
    /// node more than `all_budget`).
    fn offer(&self, n: Notification, all_budget: usize) -> bool {
        let size = held_size(&n);
        let q = &self.queue;
        let mut st = q.lock();
        if st.ended || st.reader_gone {
            return false;
        }
        if st.bytes + size > MAX_QUEUED_BYTES {
            let why = format!(
                "this stream fell {} bytes of notifications behind (at most {MAX_QUEUED_BYTES}): \
                 subscribe again with after_sequence = the last sequence read (the sidecar keeps the last {RETAINED})",
                st.bytes
            );
            self.end(&mut st, Status::resource_exhausted(why));
            return false;
        }
        if q.all.fetch_add(size, Ordering::AcqRel) + size > all_budget {
            q.all.fetch_sub(size, Ordering::AcqRel);
            let why = format!(
                "this node's notification streams hold {all_budget} bytes unread: this one, {} bytes behind, \
                 is ended; subscribe again with after_sequence = the last sequence read",
                st.bytes
            );
            self.end(&mut st, Status::resource_exhausted(why));
            return false;
        }
        st.items.push_back(Ok(n));
        st.bytes += size;
        if let Some(w) = st.waker.take() {
            w.wake();
        }
        true
    }

    /// Ends the stream now: what it held unread is dropped, and `status`
    /// is the one item left, read next.
    fn cut(&self, status: Status) {
        let mut st = self.queue.lock();
        if !st.ended {
            self.end(&mut st, status);
        }
    }

    fn end(&self, st: &mut QueueState, status: Status) {
        self.queue.clear(st);
        st.items.push_back(Err(status));
        st.ended = true;
        if let Some(w) = st.waker.take() {
            w.wake();
        }
    }

    fn is_closed(&self) -> bool {
        let st = self.queue.lock();
        st.ended || st.reader_gone
    }
}

/// A worker's live notification stream (the receiving end).
pub struct Subscription {
    queue: Arc<StreamQueue>,
}

impl Subscription {
    fn pop(&self, st: &mut QueueState) -> Option<Item> {
        let item = st.items.pop_front()?;
        if let Ok(n) = &item {
            let size = held_size(n);
            st.bytes -= size;
            self.queue.all.fetch_sub(size, Ordering::AcqRel);
        }
        Some(item)
    }

    /// The next item if one is queued: `None` when nothing is (tests).
    pub fn try_recv(&mut self) -> Option<Item> {
        let mut st = self.queue.lock();
        self.pop(&mut st)
    }

    /// Bytes queued unread.
    pub fn queued_bytes(&self) -> usize {
        self.queue.lock().bytes
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut st = self.queue.lock();
        st.reader_gone = true;
        self.queue.clear(&mut st);
    }
}

impl tokio_stream::Stream for Subscription {
    type Item = Item;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Item>> {
        let mut st = self.queue.lock();
        if let Some(item) = self.pop(&mut st) {
            return Poll::Ready(Some(item));
        }
        if st.ended {
            return Poll::Ready(None);
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Where a worker's transfer notifications go instead of its stream: the
/// completion queue of its ring.
pub trait NotificationSink: Send + Sync {
    /// Delivers `n` (or queues it for delivery); false when it cannot take
    /// it, and then the stream gets it.
    fn deliver(&self, n: &Notification) -> bool;
}

#[derive(Default)]
struct Mailbox {
    subscriber: Option<Subscriber>,
    /// The worker's ring, when it asked for notifications there. Messages
    /// (with payloads up to 16 KiB) always go to the stream.
    sink: Option<Arc<dyn NotificationSink>>,
    /// The last notifications, oldest first, with their sequence numbers.
    retained: VecDeque<Notification>,
    /// Sequence of the newest notification.
    last: u64,
    /// Newest sequence handed to a subscriber.
    handed: u64,
    /// Encoded size of `retained`.
    retained_bytes: usize,
}

impl Mailbox {
    /// Nobody listens: no live stream, no ring.
    fn idle(&self) -> bool {
        self.sink.is_none() && self.subscriber.as_ref().is_none_or(|s| s.is_closed())
    }
}

/// Why a subscription was refused.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("worker {0:?} already has a live notification stream (set take_over to replace it)")]
    AlreadySubscribed(String),
    #[error("worker {0:?} already has a ring taking its notifications")]
    SinkAttached(String),
    #[error("worker {worker:?} has a live notification stream in another process ({holder}): a ring takes its notifications only with take_over")]
    HeldElsewhere { worker: String, holder: String },
}

/// Routes notifications to workers.
#[derive(Default)]
pub struct NotificationHub {
    mailboxes: DashMap<String, Mutex<Mailbox>>,
    /// This process's incarnation, stamped on every notification.
    incarnation: u64,
    /// The highest sequence any mailbox has given.
    high_water: std::sync::atomic::AtomicU64,
    /// Bytes retained over all mailboxes, and how many may be (0:
    /// [`RETAINED_BYTES_ALL`]; tests set less).
    retained_all: AtomicUsize,
    retained_budget: usize,
    /// Bytes queued unread over all live streams, and how many may be (0:
    /// [`MAX_QUEUED_BYTES_ALL`]; tests set less).
    queued_all: Arc<AtomicUsize>,
    queued_budget: usize,
    /// Messages for workers without a mailbox yet, oldest first (see
    /// [`EARLY_MESSAGE_TTL`]).
    early: Mutex<VecDeque<(std::time::Instant, String, Notification)>>,
    /// Mailboxes were dropped to make room (see [`MAX_MAILBOXES`]): new ones
    /// then start their sequence above every number given so far, so that a
    /// worker whose mailbox went and resumes from its last sequence misses
    /// nothing.
    evicted: std::sync::atomic::AtomicBool,
}

impl NotificationHub {
    pub fn new(incarnation: u64) -> Self {
        NotificationHub {
            mailboxes: DashMap::new(),
            incarnation,
            ..Default::default()
        }
    }

    /// Numbers the notification, keeps it, and delivers it to the worker's live
    /// stream if there is one.
    pub fn send(&self, worker_id: &str, mut n: Notification) {
        let entry = self.mailbox(worker_id);
        let Ok(mut mb) = entry.lock() else { return };
        mb.last += 1;
        n.sequence = mb.last;
        self.high_water
            .fetch_max(mb.last, std::sync::atomic::Ordering::Relaxed);
        n.incarnation = self.incarnation;
        use Ordering::AcqRel;
        let size = held_size(&n);
        while !mb.retained.is_empty()
            && (mb.retained.len() >= RETAINED
                || mb.retained_bytes + size > RETAINED_BYTES
                || self.retained_all.load(Ordering::Acquire) + size > self.retained_budget())
        {
            if let Some(old) = mb.retained.pop_front() {
                let freed = held_size(&old);
                mb.retained_bytes -= freed;
                self.retained_all.fetch_sub(freed, AcqRel);
            }
        }
        mb.retained_bytes += size;
        self.retained_all.fetch_add(size, AcqRel);
        mb.retained.push_back(n.clone());
        if n.kind != NotificationKind::Message as i32 {
            if let Some(sink) = &mb.sink {
                if sink.deliver(&n) {
                    mb.handed = mb.last;
                    return;
                }
            }
        }
        let budget = self.queued_budget();
        let delivered = mb
            .subscriber
            .as_ref()
            .is_some_and(|sub| sub.offer(n, budget));
        if delivered {
            mb.handed = mb.last;
        } else {
            mb.subscriber = None;
        }
    }

    /// The worker's mailbox, made if need be; at [`MAX_MAILBOXES`], the idle
    /// ones make room first.
    fn mailbox(&self, worker_id: &str) -> dashmap::mapref::one::RefMut<'_, String, Mutex<Mailbox>> {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.mailboxes.contains_key(worker_id) && self.mailboxes.len() >= MAX_MAILBOXES {
            self.evicted.store(true, Relaxed);
            self.mailboxes.retain(|_, mb| {
                mb.try_lock().map_or(true, |mb| {
                    if mb.idle() {
                        self.retained_all
                            .fetch_sub(mb.retained_bytes, Ordering::AcqRel);
                    }
                    !mb.idle()
                })
            });
        }
        self.mailboxes
            .entry(worker_id.to_string())
            .or_insert_with(|| {
                let start = if self.evicted.load(Relaxed) {
                    self.high_water.load(Relaxed)
                } else {
                    0
                };
                Mutex::new(Mailbox {
                    last: start,
                    handed: start,
                    ..Mailbox::default()
                })
            })
    }

    fn retained_budget(&self) -> usize {
        match self.retained_budget {
            0 => RETAINED_BYTES_ALL,
            budget => budget,
        }
    }

    fn queued_budget(&self) -> usize {
        match self.queued_budget {
            0 => MAX_QUEUED_BYTES_ALL,
            budget => budget,
        }
    }

    /// Bytes this hub holds: retained in mailboxes, and queued unread on
    /// live streams.
    pub fn held_bytes(&self) -> (usize, usize) {
        (
            self.retained_all.load(Ordering::Acquire),
            self.queued_all.load(Ordering::Acquire),
        )
    }

    /// Mailboxes kept now.
    pub fn mailbox_count(&self) -> usize {
        self.mailboxes.len()
    }

    /// As [`send`](Self::send), for a worker that has subscribed here at some
    /// point; false otherwise, and then the notification is held for a while
    /// in a small pool shared by all unknown workers ([`EARLY_MESSAGES`],
    /// [`EARLY_MESSAGE_TTL`]), delivered if that worker subscribes in time:
    /// a peer cannot make this sidecar keep more for workers it makes up.
    pub fn send_if_known(&self, worker_id: &str, n: Notification) -> bool {
        if !self.mailboxes.contains_key(worker_id) {
            let now = std::time::Instant::now();
            let mut early = self.early.lock().unwrap_or_else(|e| e.into_inner());
            while early
                .front()
                .is_some_and(|(at, _, _)| now.duration_since(*at) > EARLY_MESSAGE_TTL)
                || early.len() >= EARLY_MESSAGES
            {
                early.pop_front();
            }
            early.push_back((now, worker_id.to_string(), n));
            drop(early);
            // The worker may have subscribed meanwhile (after the check
            // above, before the push): it takes what waits for it now.
            if self.mailboxes.contains_key(worker_id) {
                for n in self.take_early(worker_id) {
                    self.send(worker_id, n);
                }
                return true;
            }
            return false;
        }
        self.send(worker_id, n);
        true
    }

    /// The held early messages of `worker_id` (still fresh), oldest first.
    fn take_early(&self, worker_id: &str) -> Vec<Notification> {
        let mut early = self.early.lock().unwrap_or_else(|e| e.into_inner());
        if early.is_empty() {
            return Vec::new();
        }
        let now = std::time::Instant::now();
        let mut mine = Vec::new();
        early.retain(|(at, _, _)| now.duration_since(*at) <= EARLY_MESSAGE_TTL);
        let mut kept = VecDeque::with_capacity(early.len());
        for (at, to, n) in early.drain(..) {
            if to == worker_id {
                mine.push(n);
            } else {
                kept.push_back((at, to, n));
            }
        }
        *early = kept;
        mine
    }

    /// Sends the worker's transfer notifications to `sink` (the ring of
    /// process `pid`) from now on. A live stream of the same worker held by
    /// another process keeps them unless `take_over`: then it is ended,
    /// ABORTED, saying so (as a Subscribe's take-over does). The same process
    /// keeps its stream (for messages) beside its ring.
    pub fn attach_sink(
        &self,
        worker_id: &str,
        sink: Arc<dyn NotificationSink>,
        pid: Option<i32>,
        take_over: bool,
    ) -> Result<(), SubscribeError> {
        let entry = self.mailbox(worker_id);
        let mut mb = entry.lock().unwrap_or_else(|e| e.into_inner());
        if mb.sink.is_some() {
            return Err(SubscribeError::SinkAttached(worker_id.to_string()));
        }
        if let Some(sub) = mb.subscriber.as_ref().filter(|s| !s.is_closed()) {
            let same_process = pid.is_some() && sub.pid == pid;
            if !same_process {
                if !take_over {
                    let holder = sub.pid.map_or("pid unknown".into(), |p| format!("pid {p}"));
                    return Err(SubscribeError::HeldElsewhere {
                        worker: worker_id.to_string(),
                        holder,
                    });
                }
                sub.cut(Status::aborted(
                    "this worker's notifications were taken over by a ring (OpenRing with take_over)",
                ));
                mb.subscriber = None;
            }
        }
        mb.sink = Some(sink);
        Ok(())
    }

    /// Undoes [`attach_sink`](Self::attach_sink) if `sink` is still the one
    /// attached.
    pub fn detach_sink(&self, worker_id: &str, sink: &Arc<dyn NotificationSink>) {
        if let Some(entry) = self.mailboxes.get(worker_id) {
            let mut mb = entry.lock().unwrap_or_else(|e| e.into_inner());
            if mb.sink.as_ref().is_some_and(|s| Arc::ptr_eq(s, sink)) {
                mb.sink = None;
            }
        }
    }

    /// Opens the worker's stream: what it missed first (after `after_sequence`,
    /// or what was never handed out when that is 0), then live notifications.
    pub fn subscribe(
        &self,
        worker_id: &str,
        after_sequence: u64,
        incarnation: u64,
        take_over: bool,
        pid: Option<i32>,
    ) -> Result<Subscription, SubscribeError> {
        // A resume point of another process numbers nothing here.
        let after_sequence = if incarnation != 0 && incarnation != self.incarnation {
            0
        } else {
            after_sequence
        };
        let queue = Arc::new(StreamQueue {
            state: Mutex::new(QueueState::default()),
            all: self.queued_all.clone(),
        });
        let subscription = Subscription {
            queue: queue.clone(),
        };
        let subscriber = Subscriber { queue, pid };
        let entry = self.mailbox(worker_id);
        let Ok(mut mb) = entry.lock() else {
            return Ok(subscription);
        };
        if let Some(old) = mb.subscriber.take() {
            if !old.is_closed() {
                if !take_over {
                    mb.subscriber = Some(old);
                    return Err(SubscribeError::AlreadySubscribed(worker_id.to_string()));
                }
                // Emptied now: a stream nobody reads must not keep its
                // backlog (each take-over would add one).
                old.cut(Status::aborted(
                    "this notification stream was taken over by a newer Subscribe for the same worker",
                ));
            }
        }
        let from = if after_sequence > 0 {
            after_sequence
        } else if incarnation != 0 && incarnation != self.incarnation {
            0
        } else {
            mb.handed
        };
        // The retained notifications fit one stream (they are held to half
        // its bytes); past the node's budget the new stream is ended saying so.
        let budget = self.queued_budget();
        for n in mb.retained.iter().filter(|n| n.sequence > from) {
            if !subscriber.offer(n.clone(), budget) {
                break;
            }
        }
        mb.handed = mb.last;
        mb.subscriber = Some(subscriber);
        drop(mb);
        drop(entry);
        for n in self.take_early(worker_id) {
            self.send(worker_id, n);
        }
        Ok(subscription)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(id: u64) -> Notification {
        Notification {
            transfer_id: id,
            ..Default::default()
        }
    }

    /// A notification listing `blocks` block ids.
    fn note_with_blocks(id: u64, blocks: u32) -> Notification {
        Notification {
            block_ids: (0..blocks).map(|b| b | 0x0100_0000).collect(),
            ..note(id)
        }
    }

    fn drain(rx: &mut Subscription) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(Ok(n)) = rx.try_recv() {
            out.push(n.sequence);
        }
        out
    }

    /// Worker ids are whatever callers write: each used to make a mailbox
    /// kept forever. Past the cap, idle ones go; a worker with a live stream
    /// keeps its own.
    #[test]
    fn mailboxes_of_made_up_workers_are_bounded_and_live_ones_kept() {
        let hub = NotificationHub::new(7);
        let mut live = hub.subscribe("live", 0, 0, false, None).unwrap();
        for i in 0..(MAX_MAILBOXES * 2) {
            hub.send(&format!("ghost-{i}"), note(i as u64));
        }
        assert!(
            hub.mailbox_count() <= MAX_MAILBOXES,
            "{}",
            hub.mailbox_count()
        );
        hub.send("live", note(1));
        assert_eq!(
            drain(&mut live),
            vec![1],
            "the live worker's mailbox stayed"
        );
        // A worker whose mailbox went, resuming from the last sequence it
        // saw, still gets what came since: numbering restarts above it.
        let seen = 1;
        hub.send("ghost-0", note(99));
        let mut back = hub.subscribe("ghost-0", seen, 7, false, None).unwrap();
        let got = drain(&mut back);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0] > seen, "{got:?}");
    }

    /// A Done notification lists the transfer's blocks (up to a million ids):
    /// 4096 of them would be gigabytes. What is kept stays under
    /// `RETAINED_BYTES`, newest first.
    #[test]
    fn retained_notifications_are_bounded_in_bytes() {
        let hub = NotificationHub::new(7);
        let big = |id| note_with_blocks(id, 1_000_000);
        for id in 1..=40 {
            hub.send("w", big(id));
        }
        let mut rx = hub.subscribe("w", 0, 0, false, None).unwrap();
        let kept = drain(&mut rx);
        assert!(!kept.is_empty() && kept.len() < 40, "{} kept", kept.len());
        assert_eq!(kept.last(), Some(&40), "the newest are kept");
        let bytes: usize = kept.len() * held_size(&big(1));
        assert!(bytes <= RETAINED_BYTES, "{bytes}");
    }

    /// A worker that stops reading its stream: what the stream holds unread
    /// stays bounded, the stream is ended saying why, and resubscribing
    /// from the last sequence read gets what the mailbox retained.
    #[test]
    fn a_stream_nobody_reads_is_ended_not_grown() {
        let hub = NotificationHub::new(7);
        let big = |id| note_with_blocks(id, 100_000);
        let mut stalled = hub.subscribe("w", 0, 0, false, None).unwrap();
        hub.send("w", big(1));
        assert_eq!(drain(&mut stalled), vec![1]);
        // Then the worker stops reading.
        for id in 2..=400 {
            hub.send("w", big(id));
        }
        let queued = stalled.queued_bytes();
        assert!(queued <= MAX_QUEUED_BYTES, "{queued} bytes queued");
        // Ended at once: what it held unread went with it.
        let ended = match stalled.try_recv() {
            Some(Err(status)) => status,
            other => panic!("the stream was not ended: {other:?}"),
        };
        assert_eq!(ended.code(), tonic::Code::ResourceExhausted, "{ended:?}");
        assert_eq!(stalled.queued_bytes(), 0);
        assert_eq!(hub.held_bytes().1, 0, "nothing queued anywhere");
        // Resuming from the last sequence read gets what the mailbox retained.
        let mut again = hub.subscribe("w", 1, 7, false, None).unwrap();
        let rest = drain(&mut again);
        assert!(
            !rest.is_empty() && rest.len() < 399,
            "{} retained",
            rest.len()
        );
        assert_eq!(rest.last(), Some(&400), "the newest are retained");
        assert!(rest.windows(2).all(|w| w[1] == w[0] + 1), "in order");
    }

    /// Peers can send messages to every worker that subscribed here: what
    /// all mailboxes retain stays under the node's budget, each mailbox
    /// keeping its newest.
    #[test]
    fn what_all_mailboxes_retain_is_bounded() {
        let hub = NotificationHub {
            retained_budget: 1 << 20,
            ..NotificationHub::new(7)
        };
        let message = |id| Notification {
            transfer_id: id,
            payload: vec![7; 16 << 10],
            kind: NotificationKind::Message as i32,
            ..Default::default()
        };
        for w in 0..16 {
            for id in 0..200 {
                hub.send(&format!("w{w}"), message(id));
            }
        }
        // The budget, past which each mailbox keeps only its newest.
        let all = hub.retained_all.load(Ordering::Acquire);
        let one = held_size(&message(0));
        assert!(all <= (1 << 20) + 16 * one, "{all} bytes retained");
        let kept: usize = (0..16)
            .map(|w| {
                hub.mailboxes
                    .get(&format!("w{w}"))
                    .unwrap()
                    .lock()
                    .unwrap()
                    .retained
                    .len()
            })
            .sum();
        assert!(kept < 16 * 200 / 4, "{kept} kept of {}", 16 * 200);
        for w in 0..16 {
            let mb = hub.mailboxes.get(&format!("w{w}")).unwrap();
            let mb = mb.lock().unwrap();
            assert_eq!(mb.retained.back().map(|n| n.transfer_id), Some(199));
        }
    }

    #[test]
    fn resubscribing_after_the_last_seen_sequence_misses_nothing() {
        let hub = NotificationHub::new(7);
        hub.send("w", note(1));
        let mut a = hub.subscribe("w", 0, 0, false, None).unwrap();
        hub.send("w", note(2));
        hub.send("w", note(3));
        // The worker saw 1 and 2; 3 was handed to a stream it is about to drop.
        assert_eq!(drain(&mut a)[..2], [1, 2]);
        drop(a);
        hub.send("w", note(4));
        let mut b = hub.subscribe("w", 2, 0, false, None).unwrap();
        assert_eq!(drain(&mut b), vec![3, 4]);
        drop(b);
        // A resume point from before a restart (another incarnation) delivers
        // everything retained: this process's 2 numbers nothing the worker saw.
        let mut c = hub.subscribe("w", 2, 99, false, None).unwrap();
        assert_eq!(drain(&mut c), vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_second_live_subscription_is_refused_unless_it_takes_over() {
        let hub = NotificationHub::default();
        let mut a = hub.subscribe("w", 0, 0, false, None).unwrap();
        assert!(matches!(
            hub.subscribe("w", 0, 0, false, None),
            Err(SubscribeError::AlreadySubscribed(_))
        ));
        let mut b = hub.subscribe("w", 0, 0, true, None).unwrap();
        match a.try_recv() {
            Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Aborted),
            other => panic!("the old stream must be told: {other:?}"),
        }
        hub.send("w", note(1));
        assert_eq!(drain(&mut b), vec![1]);
    }

    /// Each take-over of a stream nobody reads used to leave the old
    /// stream's queue (a copy of the mailbox) in memory for as long as its
    /// connection lived: +64 MB per Subscribe. The superseded stream is
    /// emptied at once: its next item is the ABORTED, and the node holds
    /// one stream's backlog however often it is taken over.
    #[test]
    fn taking_over_a_stream_nobody_reads_drops_its_backlog() {
        let hub = NotificationHub::new(7);
        for id in 1..=64 {
            hub.send("w", note_with_blocks(id, 10_000));
        }
        let one = hub.retained_all.load(Ordering::Acquire);
        let mut streams = Vec::new();
        for _ in 0..20 {
            streams.push(hub.subscribe("w", 1, 7, true, None).unwrap());
        }
        let (_, queued) = hub.held_bytes();
        assert!(
            queued <= one,
            "{queued} bytes queued for one {one}-byte mailbox"
        );
        let (live, superseded) = streams.split_last_mut().unwrap();
        for s in superseded {
            assert_eq!(s.queued_bytes(), 0);
            match s.try_recv() {
                Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Aborted),
                other => panic!("a superseded stream must say so first: {other:?}"),
            }
            assert!(s.try_recv().is_none());
        }
        assert_eq!(drain(live).len(), 63);
        drop(streams);
        assert_eq!(hub.held_bytes().1, 0);
    }

    /// Over all live streams, what is queued unread stays under the node's
    /// budget: the stream that would go over is ended saying why.
    #[test]
    fn all_streams_together_queue_at_most_the_node_budget() {
        let hub = NotificationHub {
            queued_budget: 4 << 20,
            ..NotificationHub::new(7)
        };
        let mut streams: Vec<_> = (0..8)
            .map(|w| hub.subscribe(&format!("w{w}"), 0, 0, false, None).unwrap())
            .collect();
        for id in 0..100 {
            for w in 0..8 {
                hub.send(&format!("w{w}"), note_with_blocks(id, 10_000));
            }
        }
        assert!(hub.held_bytes().1 <= 4 << 20, "{:?}", hub.held_bytes());
        let mut ended = 0;
        for s in &mut streams {
            let why_ended = std::iter::from_fn(|| s.try_recv()).any(|i| {
                i.is_err_and(|st| {
                    st.code() == tonic::Code::ResourceExhausted
                        && st.message().contains("notification streams hold")
                })
            });
            ended += usize::from(why_ended);
        }
        assert!(ended > 0);
    }

    struct NullSink;

    impl NotificationSink for NullSink {
        fn deliver(&self, _: &Notification) -> bool {
            true
        }
    }

    /// A ring asking for a worker's notifications while another process
    /// holds that worker's live stream is refused, unless it takes them
    /// over (the stream is then told); the same process keeps both.
    #[test]
    fn a_ring_takes_another_process_s_notifications_only_when_asked() {
        let hub = NotificationHub::new(7);
        let mut victim = hub.subscribe("w", 0, 0, false, Some(100)).unwrap();
        let sink: Arc<dyn NotificationSink> = Arc::new(NullSink);
        assert!(matches!(
            hub.attach_sink("w", sink.clone(), Some(200), false),
            Err(SubscribeError::HeldElsewhere { .. })
        ));
        hub.send("w", note(1));
        assert_eq!(
            drain(&mut victim),
            vec![1],
            "the stream kept its notifications"
        );
        // Its own process: stream and ring side by side.
        hub.attach_sink("w", sink.clone(), Some(100), false)
            .unwrap();
        hub.detach_sink("w", &sink);
        hub.attach_sink("w", sink.clone(), Some(200), true).unwrap();
        match victim.try_recv() {
            Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Aborted),
            other => panic!("the stream must be told: {other:?}"),
        }
    }

    fn message(id: u64) -> Notification {
        Notification {
            transfer_id: id,
            kind: NotificationKind::Message as i32,
            ..Default::default()
        }
    }

    /// A peer's message to a worker that has not subscribed here yet (its
    /// sidecar just restarted) is held a while and delivered when it does;
    /// what is held for unknown workers stays small.
    #[test]
    fn messages_to_a_worker_not_yet_subscribed_wait_for_it_boundedly() {
        let hub = NotificationHub::new(7);
        assert!(!hub.send_if_known("late", message(1)));
        for i in 0..(EARLY_MESSAGES as u64 * 2) {
            hub.send_if_known(&format!("ghost-{i}"), message(i));
        }
        assert!(!hub.send_if_known("late", message(2)));
        assert!(hub.early.lock().unwrap().len() <= EARLY_MESSAGES);
        assert_eq!(hub.mailbox_count(), 0, "no mailbox for made-up workers");
        let mut s = hub.subscribe("late", 0, 0, false, None).unwrap();
        let got: Vec<u64> = std::iter::from_fn(|| s.try_recv())
            .map(|i| i.unwrap().transfer_id)
            .collect();
        // The first was pushed out by the flood; the one after it came through.
        assert_eq!(got, vec![2]);
        assert!(hub.send_if_known("late", message(3)));
    }
}
