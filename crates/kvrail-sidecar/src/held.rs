//! Payload a writer still holds after the session handed it over.
//!
//! TCP copies payload into the kernel when it is written; QUIC's zero-copy path
//! hands quinn views of the worker's memory, which it reads whenever it builds
//! (or rebuilds) packets, until the peer acknowledges them. So every queued
//! slice carries a [`ViewToken`] of its transfer, kept until the writer is done
//! with the bytes (written, or acknowledged for zero-copy). A sending transfer
//! that completed reaches its worker only once every token is gone (at most an
//! acknowledgement's delay: the peer already has every byte), so the worker may
//! unregister or rewrite the blocks at once. A failed one is reported at once,
//! since its peer may be stalled for good; its slices still queued are dropped
//! unsent instead ([`ViewToken::abandoned`]), and the peer is told to abort.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// The held views of one transfer.
#[derive(Default)]
pub struct HeldViews {
    live: AtomicUsize,
    released: Notify,
    /// The transfer failed: whatever of it is not on the wire yet stays off it.
    abandoned: AtomicBool,
}

impl HeldViews {
    /// Waits until no token of this transfer is left, or `limit` passed; says which.
    pub async fn released(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.released.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.live.load(Ordering::Acquire) == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// One holder of a transfer's payload; dropping the last one releases it.
pub struct ViewToken(Arc<HeldViews>);

impl ViewToken {
    fn new(views: &Arc<HeldViews>) -> ViewToken {
        views.live.fetch_add(1, Ordering::AcqRel);
        ViewToken(views.clone())
    }

    /// Whether the transfer failed, so its slice must not be sent any more.
    pub fn abandoned(&self) -> bool {
        self.0.abandoned.load(Ordering::Acquire)
    }
}

impl Clone for ViewToken {
    fn clone(&self) -> Self {
        ViewToken::new(&self.0)
    }
}

impl Drop for ViewToken {
    fn drop(&mut self) {
        if self.0.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.released.notify_waiters();
        }
    }
}

/// The held views of a link's transfers that have payload queued or in flight.
#[derive(Default)]
pub struct HeldPayload {
    transfers: Mutex<HashMap<u64, Arc<HeldViews>>>,
}

impl HeldPayload {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<HeldViews>>> {
        // Plain counters: a panicking holder leaves nothing half-done.
        self.transfers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A token for a slice of `transfer_id` being queued.
    pub fn token(&self, transfer_id: u64) -> ViewToken {
        ViewToken::new(self.lock().entry(transfer_id).or_default())
    }

    /// The transfer completed: its views, if any slice of it is still held. No
    /// slice of an ended transfer is queued any more, so the entry can go.
    pub fn completed(&self, transfer_id: u64) -> Option<Arc<HeldViews>> {
        self.lock()
            .remove(&transfer_id)
            .filter(|views| views.live() > 0)
    }

    /// The transfer failed: its slices still queued are dropped unsent.
    /// The views a transfer's writers hold now, to wait for after failing it.
    pub fn views(&self, transfer_id: u64) -> Option<Arc<HeldViews>> {
        self.lock().get(&transfer_id).cloned()
    }

    pub fn failed(&self, transfer_id: u64) {
        if let Some(views) = self.lock().remove(&transfer_id) {
            views.abandoned.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_end_waits_for_the_last_token() {
        let held = HeldPayload::default();
        let a = held.token(7);
        let b = a.clone();
        let other = held.token(8);
        let views = held.completed(7).expect("two tokens are out");
        assert_eq!(views.live(), 2);
        drop(a);
        assert!(!views.released(Duration::from_millis(20)).await);
        let waiter = tokio::spawn(async move { views.released(Duration::from_secs(5)).await });
        drop(b);
        assert!(waiter.await.unwrap());
        assert!(
            held.completed(9).is_none(),
            "nothing held, nothing to wait for"
        );
        drop(other);
        assert!(held.completed(8).is_none(), "released before the end");
    }

    #[test]
    fn a_failed_transfer_abandons_its_queued_slices() {
        let held = HeldPayload::default();
        let queued = held.token(3);
        let other = held.token(4);
        held.failed(3);
        assert!(queued.abandoned());
        assert!(!other.abandoned());
    }
}
