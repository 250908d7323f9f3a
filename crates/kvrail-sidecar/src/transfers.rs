//! Transfers started by local workers: their status, for Wait/GetTransfer/Cancel.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use dashmap::DashMap;
use kvrail_proto::{TransferState, TransferStatus};
use tokio::sync::Notify;

use crate::link::PeerLink;

/// Finished transfers remembered for late Wait/GetTransfer calls.
const FINISHED_MEMORY: usize = 65_536;

/// One locally started transfer.
pub struct TransferRecord {
    pub id: u64,
    pub request_id: String,
    pub worker_id: String,
    /// The group it completes with (`TransferGroup.id`), if any.
    pub group: Option<String>,
    pub started: Instant,
    pub link: Weak<PeerLink>,
    /// A lock and a `Notify` in the record, not a watch channel: one fewer
    /// allocation (the channel's shared state) on a ring push's path.
    status: Mutex<TransferStatus>,
    /// Woken once, when the status becomes final.
    ended: Notify,
}

impl TransferRecord {
    pub fn new(
        id: u64,
        request_id: String,
        worker_id: String,
        group: Option<String>,
        status: TransferStatus,
        link: Weak<PeerLink>,
    ) -> Self {
        Self {
            id,
            request_id,
            worker_id,
            group,
            started: Instant::now(),
            link,
            status: Mutex::new(status),
            ended: Notify::new(),
        }
    }

    pub fn current(&self) -> TransferStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn is_final(&self) -> bool {
        is_final(&self.status.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Returns once the transfer's status is final (Done or Failed).
    pub async fn ended(&self) {
        loop {
            let notified = self.ended.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a finish between the two wakes it.
            notified.as_mut().enable();
            if self.is_final() {
                return;
            }
            notified.await;
        }
    }
}

/// Whether `s` is Done or Failed.
pub fn is_final(s: &TransferStatus) -> bool {
    s.state == TransferState::Done as i32 || s.state == TransferState::Failed as i32
}

/// The request id is already in use by a live transfer of this worker.
#[derive(Debug)]
pub struct DuplicateRequest;

/// All locally started transfers.
#[derive(Default)]
pub struct TransferTable {
    /// Transfers not finished yet: few, and every push inserts into it, so
    /// it is kept apart from the finished ones (a table of 65,536 records
    /// is out of the cache of the thread that inserts).
    live: DashMap<u64, Arc<TransferRecord>>,
    live_requests: DashMap<(String, String), u64>,
    finished: Mutex<Finished>,
}

/// Finished transfers, oldest first, kept for late Wait/GetTransfer calls.
#[derive(Default)]
struct Finished {
    order: VecDeque<u64>,
    by_id: HashMap<u64, Arc<TransferRecord>>,
}

impl TransferTable {
    /// Claims `(worker, request)` for `transfer_id` until the transfer ends.
    pub fn reserve(
        &self,
        worker_id: &str,
        request_id: &str,
        transfer_id: u64,
    ) -> Result<(), DuplicateRequest> {
        match self
            .live_requests
            .entry((worker_id.to_string(), request_id.to_string()))
        {
            dashmap::Entry::Occupied(_) => Err(DuplicateRequest),
            dashmap::Entry::Vacant(v) => {
                v.insert(transfer_id);
                Ok(())
            }
        }
    }

    pub fn release(&self, worker_id: &str, request_id: &str) {
        self.live_requests
            .remove(&(worker_id.to_string(), request_id.to_string()));
    }

    pub fn insert(&self, record: Arc<TransferRecord>) {
        self.live.insert(record.id, record);
    }

    pub fn get(&self, id: u64) -> Option<Arc<TransferRecord>> {
        // Live first: a finishing record is in the finished table before it
        // leaves the live one, so one of the two always has it.
        self.live.get(&id).map(|r| r.clone()).or_else(|| {
            self.finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .by_id
                .get(&id)
                .cloned()
        })
    }

    /// Records the final status and frees the request id.
    pub fn finish(
        &self,
        id: u64,
        update: impl FnOnce(&mut TransferStatus),
    ) -> Option<Arc<TransferRecord>> {
        // A finished record's status is final already: only live ones change.
        let record = self.live.get(&id).map(|r| r.clone())?;
        {
            let mut s = record.status.lock().unwrap_or_else(|e| e.into_inner());
            if is_final(&s) {
                return None;
            }
            update(&mut s);
            s.elapsed_us = record.started.elapsed().as_micros() as u64;
        }
        record.ended.notify_waiters();
        self.release(&record.worker_id, &record.request_id);
        {
            let mut f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
            f.by_id.insert(id, record.clone());
            f.order.push_back(id);
            while f.order.len() > FINISHED_MEMORY {
                if let Some(old) = f.order.pop_front() {
                    f.by_id.remove(&old);
                }
            }
        }
        self.live.remove(&id);
        Some(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(table: &TransferTable, id: u64) -> Arc<TransferRecord> {
        table.reserve("w", &format!("r{id}"), id).expect("free id");
        let status = TransferStatus {
            transfer_id: id,
            state: TransferState::Queued as i32,
            ..Default::default()
        };
        let rec = Arc::new(TransferRecord::new(
            id,
            format!("r{id}"),
            "w".into(),
            None,
            status,
            Weak::new(),
        ));
        table.insert(rec.clone());
        rec
    }

    /// A Wait started before the end wakes at it, one started after
    /// returns at once, and a second end changes nothing.
    #[tokio::test]
    async fn waiters_wake_once_the_status_is_final_and_it_stays_final() {
        let table = TransferTable::default();
        let rec = record(&table, 1);
        let early = tokio::spawn({
            let rec = rec.clone();
            async move {
                rec.ended().await;
                rec.current()
            }
        });
        tokio::task::yield_now().await;
        assert!(!early.is_finished(), "woke before the end");
        assert!(table
            .finish(1, |s| s.state = TransferState::Done as i32)
            .is_some());
        let seen = tokio::time::timeout(std::time::Duration::from_secs(10), early)
            .await
            .expect("the waiter woke")
            .expect("the waiter ran");
        assert_eq!(seen.state, TransferState::Done as i32);
        tokio::time::timeout(std::time::Duration::from_secs(10), rec.ended())
            .await
            .expect("a late waiter returns at once");
        assert!(table
            .finish(1, |s| s.state = TransferState::Failed as i32)
            .is_none());
        assert_eq!(rec.current().state, TransferState::Done as i32);
        // The request id is free again for this worker.
        assert!(table.reserve("w", "r1", 2).is_ok());
    }

    /// A finished transfer leaves the live table and is still found, with
    /// its final status, until 65,536 later ones have finished.
    #[test]
    fn finished_transfers_are_found_until_the_memory_is_full() {
        let table = TransferTable::default();
        let done = |s: &mut TransferStatus| s.state = TransferState::Done as i32;
        record(&table, 0);
        assert!(table.finish(0, done).is_some());
        assert!(table.live.is_empty(), "a finished record stayed live");
        assert_eq!(table.get(0).map(|r| r.id), Some(0));
        let last = FINISHED_MEMORY as u64;
        for id in 1..last {
            record(&table, id);
            assert!(table.finish(id, done).is_some());
        }
        let first = table.get(0).expect("still remembered");
        assert_eq!(first.current().state, TransferState::Done as i32);
        record(&table, last);
        assert!(table.get(last).is_some(), "a live record is found");
        assert!(table.finish(last, done).is_some());
        assert!(table.get(0).is_none(), "the oldest was not forgotten");
        assert!(table.get(1).is_some() && table.get(last).is_some());
    }
}
