//! Per-worker notification streams. Notifications for a worker that is not
//! subscribed yet are kept (up to a bound) and delivered when it subscribes.

use std::collections::VecDeque;
use std::sync::Mutex;

use dashmap::DashMap;
use kvrail_proto::Notification;
use tokio::sync::mpsc;

/// Notifications kept per unsubscribed worker; older ones are dropped beyond it.
const BACKLOG: usize = 4096;

#[derive(Default)]
struct Mailbox {
    subscriber: Option<mpsc::UnboundedSender<Notification>>,
    backlog: VecDeque<Notification>,
}

/// Routes notifications to workers.
#[derive(Default)]
pub struct NotificationHub {
    mailboxes: DashMap<String, Mutex<Mailbox>>,
}

impl NotificationHub {
    /// Delivers to the worker's live stream, or keeps it for later.
    pub fn send(&self, worker_id: &str, n: Notification) {
        let entry = self.mailboxes.entry(worker_id.to_string()).or_default();
        let Ok(mut mb) = entry.lock() else { return };
        let n = match mb.subscriber.as_ref() {
            Some(sub) => match sub.send(n) {
                Ok(()) => return,
                Err(mpsc::error::SendError(n)) => {
                    mb.subscriber = None;
                    n
                }
            },
            None => n,
        };
        if mb.backlog.len() >= BACKLOG {
            mb.backlog.pop_front();
        }
        mb.backlog.push_back(n);
    }

    /// Replaces any previous subscription of this worker; the backlog comes first.
    pub fn subscribe(&self, worker_id: &str) -> mpsc::UnboundedReceiver<Notification> {
        let (tx, rx) = mpsc::unbounded_channel();
        let entry = self.mailboxes.entry(worker_id.to_string()).or_default();
        if let Ok(mut mb) = entry.lock() {
            for n in mb.backlog.drain(..) {
                let _ = tx.send(n);
            }
            mb.subscriber = Some(tx);
        }
        rx
    }
}
