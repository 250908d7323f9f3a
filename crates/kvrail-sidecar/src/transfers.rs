//! Transfers started by local workers: their status, for Wait/GetTransfer/Cancel.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use dashmap::DashMap;
use kvrail_proto::{TransferState, TransferStatus};
use tokio::sync::watch;

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
    pub status: watch::Sender<TransferStatus>,
    pub link: Weak<PeerLink>,
}

impl TransferRecord {
    pub fn current(&self) -> TransferStatus {
        self.status.borrow().clone()
    }
}

/// The request id is already in use by a live transfer of this worker.
#[derive(Debug)]
pub struct DuplicateRequest;

/// All locally started transfers.
#[derive(Default)]
pub struct TransferTable {
    by_id: DashMap<u64, Arc<TransferRecord>>,
    live_requests: DashMap<(String, String), u64>,
    finished: Mutex<VecDeque<u64>>,
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
        self.by_id.insert(record.id, record);
    }

    pub fn get(&self, id: u64) -> Option<Arc<TransferRecord>> {
        self.by_id.get(&id).map(|r| r.clone())
    }

    /// Records the final status and frees the request id.
    pub fn finish(
        &self,
        id: u64,
        update: impl FnOnce(&mut TransferStatus),
    ) -> Option<Arc<TransferRecord>> {
        let record = self.get(id)?;
        let mut was_final = false;
        record.status.send_modify(|s| {
            was_final =
                s.state == TransferState::Done as i32 || s.state == TransferState::Failed as i32;
            if !was_final {
                update(s);
                s.elapsed_us = record.started.elapsed().as_micros() as u64;
            }
        });
        if was_final {
            return None;
        }
        self.release(&record.worker_id, &record.request_id);
        if let Ok(mut f) = self.finished.lock() {
            f.push_back(id);
            while f.len() > FINISHED_MEMORY {
                if let Some(old) = f.pop_front() {
                    self.by_id.remove(&old);
                }
            }
        }
        Some(record)
    }
}
