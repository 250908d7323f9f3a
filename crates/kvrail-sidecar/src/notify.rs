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
//! saying so.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use kvrail_proto::{Notification, NotificationKind};
use tokio::sync::mpsc;
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

/// What a subscription stream carries.
pub type Item = Result<Notification, Status>;

/// Bytes of notifications a live stream may have queued and not yet read
/// (each counted at its encoded size plus [`ITEM_OVERHEAD`]). A worker that
/// stops reading its stream (HTTP/2 flow control then stops the server
/// taking from the queue) has the stream ended with RESOURCE_EXHAUSTED
/// instead of the queue growing without end; it resumes with
/// `after_sequence` from what the mailbox retains. Twice what a mailbox
/// retains, so that a resubscription's backlog always fits.
pub const MAX_QUEUED_BYTES: usize = 2 * RETAINED_BYTES;
/// What each queued notification counts beyond its encoded size.
const ITEM_OVERHEAD: usize = 64;

fn queued_size(n: &Notification) -> usize {
    prost::Message::encoded_len(n) + ITEM_OVERHEAD
}

/// The hub's end of a live stream, with what it holds unread.
struct Subscriber {
    tx: mpsc::UnboundedSender<Item>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl Subscriber {
    /// Queues `n`; false (and the stream told why, then ended) when the
    /// stream is gone or already holds [`MAX_QUEUED_BYTES`] unread.
    fn offer(&self, n: Notification) -> bool {
        use std::sync::atomic::Ordering::AcqRel;
        let size = queued_size(&n);
        let before = self.queued.fetch_add(size, AcqRel);
        if before + size > MAX_QUEUED_BYTES {
            self.queued.fetch_sub(size, AcqRel);
            let _ = self.tx.send(Err(Status::resource_exhausted(format!(
                "this stream fell {before} bytes of notifications behind (at most {MAX_QUEUED_BYTES}): \
                 subscribe again with after_sequence = the last sequence read (the sidecar keeps the last {RETAINED})"
            ))));
            return false;
        }
        if self.tx.send(Ok(n)).is_err() {
            self.queued.fetch_sub(size, AcqRel);
            return false;
        }
        true
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A worker's live notification stream (the receiving end).
pub struct Subscription {
    rx: mpsc::UnboundedReceiver<Item>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl Subscription {
    fn took(&self, item: &Item) {
        if let Ok(n) = item {
            self.queued
                .fetch_sub(queued_size(n), std::sync::atomic::Ordering::AcqRel);
        }
    }

    /// The next item if one is queued (tests).
    pub fn try_recv(&mut self) -> Result<Item, mpsc::error::TryRecvError> {
        let item = self.rx.try_recv()?;
        self.took(&item);
        Ok(item)
    }
}

impl tokio_stream::Stream for Subscription {
    type Item = Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Item>> {
        let item = std::task::ready!(self.rx.poll_recv(cx));
        if let Some(item) = &item {
            self.took(item);
        }
        std::task::Poll::Ready(item)
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
    retained_all: std::sync::atomic::AtomicUsize,
    retained_budget: usize,
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
        use std::sync::atomic::Ordering::AcqRel;
        let size = prost::Message::encoded_len(&n);
        while !mb.retained.is_empty()
            && (mb.retained.len() >= RETAINED
                || mb.retained_bytes + size > RETAINED_BYTES
                || self.retained_all.load(std::sync::atomic::Ordering::Acquire) + size
                    > self.retained_budget())
        {
            if let Some(old) = mb.retained.pop_front() {
                let freed = prost::Message::encoded_len(&old);
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
        let delivered = mb.subscriber.as_ref().is_some_and(|sub| sub.offer(n));
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
                            .fetch_sub(mb.retained_bytes, std::sync::atomic::Ordering::AcqRel);
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

    /// Mailboxes kept now.
    pub fn mailbox_count(&self) -> usize {
        self.mailboxes.len()
    }

    /// As [`send`](Self::send), for a worker that has subscribed here at some
    /// point; false (and nothing kept) otherwise, so that a peer cannot make
    /// this sidecar keep notifications for workers it makes up.
    pub fn send_if_known(&self, worker_id: &str, n: Notification) -> bool {
        if !self.mailboxes.contains_key(worker_id) {
            return false;
        }
        self.send(worker_id, n);
        true
    }

    /// Sends the worker's transfer notifications to `sink` from now on.
    pub fn attach_sink(
        &self,
        worker_id: &str,
        sink: Arc<dyn NotificationSink>,
    ) -> Result<(), SubscribeError> {
        let entry = self.mailbox(worker_id);
        let mut mb = entry.lock().unwrap_or_else(|e| e.into_inner());
        if mb.sink.is_some() {
            return Err(SubscribeError::SinkAttached(worker_id.to_string()));
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
    ) -> Result<Subscription, SubscribeError> {
        // A resume point of another process numbers nothing here.
        let after_sequence = if incarnation != 0 && incarnation != self.incarnation {
            0
        } else {
            after_sequence
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let subscription = Subscription {
            rx,
            queued: queued.clone(),
        };
        let subscriber = Subscriber { tx, queued };
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
                let _ = old.tx.send(Err(Status::aborted(
                    "this notification stream was taken over by a newer Subscribe for the same worker",
                )));
            }
        }
        let from = if after_sequence > 0 {
            after_sequence
        } else if incarnation != 0 && incarnation != self.incarnation {
            0
        } else {
            mb.handed
        };
        // The retained notifications fit: they are held to the same bytes.
        for n in mb.retained.iter().filter(|n| n.sequence > from) {
            subscriber.offer(n.clone());
        }
        mb.handed = mb.last;
        mb.subscriber = Some(subscriber);
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
        while let Ok(Ok(n)) = rx.try_recv() {
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
        let mut live = hub.subscribe("live", 0, 0, false).unwrap();
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
        let mut back = hub.subscribe("ghost-0", seen, 7, false).unwrap();
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
        let mut rx = hub.subscribe("w", 0, 0, false).unwrap();
        let kept = drain(&mut rx);
        assert!(!kept.is_empty() && kept.len() < 40, "{} kept", kept.len());
        assert_eq!(kept.last(), Some(&40), "the newest are kept");
        let bytes: usize = kept.len() * prost::Message::encoded_len(&big(1));
        assert!(bytes <= RETAINED_BYTES, "{bytes}");
    }

    /// A worker that stops reading its stream: what the stream holds unread
    /// stays bounded, the stream is ended saying why, and resubscribing
    /// from the last sequence read gets what the mailbox retained.
    #[test]
    fn a_stream_nobody_reads_is_ended_not_grown() {
        let hub = NotificationHub::new(7);
        let big = |id| note_with_blocks(id, 100_000);
        let mut stalled = hub.subscribe("w", 0, 0, false).unwrap();
        for id in 1..=400 {
            hub.send("w", big(id));
        }
        let queued = stalled.queued.load(std::sync::atomic::Ordering::Acquire);
        assert!(queued <= MAX_QUEUED_BYTES, "{queued} bytes queued");
        let mut read = Vec::new();
        let ended = loop {
            match stalled.try_recv() {
                Ok(Ok(n)) => read.push(n.sequence),
                Ok(Err(status)) => break status,
                Err(e) => panic!("the stream was not ended: {e:?} after {}", read.len()),
            }
        };
        assert_eq!(ended.code(), tonic::Code::ResourceExhausted, "{ended:?}");
        assert!(read.len() < 400, "{} read", read.len());
        assert_eq!(stalled.queued.load(std::sync::atomic::Ordering::Acquire), 0);
        let last = *read.last().unwrap();
        let mut again = hub.subscribe("w", last, 7, false).unwrap();
        let rest = drain(&mut again);
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
        let all = hub.retained_all.load(std::sync::atomic::Ordering::Acquire);
        let one = prost::Message::encoded_len(&message(0));
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
        let mut a = hub.subscribe("w", 0, 0, false).unwrap();
        hub.send("w", note(2));
        hub.send("w", note(3));
        // The worker saw 1 and 2; 3 was handed to a stream it is about to drop.
        assert_eq!(drain(&mut a)[..2], [1, 2]);
        drop(a);
        hub.send("w", note(4));
        let mut b = hub.subscribe("w", 2, 0, false).unwrap();
        assert_eq!(drain(&mut b), vec![3, 4]);
        drop(b);
        // A resume point from before a restart (another incarnation) delivers
        // everything retained: this process's 2 numbers nothing the worker saw.
        let mut c = hub.subscribe("w", 2, 99, false).unwrap();
        assert_eq!(drain(&mut c), vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_second_live_subscription_is_refused_unless_it_takes_over() {
        let hub = NotificationHub::default();
        let mut a = hub.subscribe("w", 0, 0, false).unwrap();
        assert!(matches!(
            hub.subscribe("w", 0, 0, false),
            Err(SubscribeError::AlreadySubscribed(_))
        ));
        let mut b = hub.subscribe("w", 0, 0, true).unwrap();
        match a.try_recv() {
            Ok(Err(status)) => assert_eq!(status.code(), tonic::Code::Aborted),
            other => panic!("the old stream must be told: {other:?}"),
        }
        hub.send("w", note(1));
        assert_eq!(drain(&mut b), vec![1]);
    }
}
