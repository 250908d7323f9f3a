//! Memory a peer or a worker can make this node hold for open transfers:
//! block ids and generations, plans and queued opens. Each session counts
//! what its transfers hold against the budget of its peer (shared by every
//! session with that peer, inbound and outbound) and against one budget shared
//! by every session of the node, so that neither one peer nor all of them
//! together can grow it past what is configured. (Payload is not counted
//! here: it lives in the workers' regions, or in bounded staging pools.)

use std::sync::atomic::{AtomicU64, Ordering};

use crate::plan::{BlockSelection, Plan};

/// Default of the node-wide budget: `[SessionConfig::node_budget]`.
pub const DEFAULT_NODE_TRANSFER_BYTES: u64 = 1 << 30;
/// Default of one peer's budget: `[SessionConfig::peer_budget]`.
pub const DEFAULT_PEER_TRANSFER_BYTES: u64 = 512 << 20;

/// Bytes held by open transfers over the whole node, and how many may be.
#[derive(Debug)]
pub struct MemoryBudget {
    held: AtomicU64,
    max: u64,
}

impl MemoryBudget {
    pub fn new(max: u64) -> Self {
        MemoryBudget {
            held: AtomicU64::new(0),
            max,
        }
    }

    /// Takes `bytes` if they fit; the bytes held (before) and the limit if not.
    pub fn try_take(&self, bytes: u64) -> Result<(), (u64, u64)> {
        let mut held = self.held.load(Ordering::Acquire);
        loop {
            if held.saturating_add(bytes) > self.max {
                return Err((held, self.max));
            }
            match self.held.compare_exchange_weak(
                held,
                held + bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => held = now,
            }
        }
    }

    pub fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    pub fn max(&self) -> u64 {
        self.max
    }
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget::new(DEFAULT_NODE_TRANSFER_BYTES)
    }
}

/// What a transfer's own bookkeeping costs beyond its variable-length
/// parts (the record, its maps' entries).
const TRANSFER_OVERHEAD: u64 = 1024;
/// What one plan segment holds.
const SEGMENT_BYTES: u64 = 24;

/// The heap an open transfer holds: its selections (four bytes per block
/// id, eight per generation), its plan's segments, the open it keeps (and
/// `queued_opens` more copies of it waiting to be written), its request id.
pub fn transfer_bytes(
    selections: &[&BlockSelection],
    plan: &Plan,
    open_bytes: u64,
    queued_opens: u64,
    request_id: &str,
) -> u64 {
    let ids: u64 = selections
        .iter()
        .map(|s| 4 * s.block_ids.len() as u64 + 8 * s.generations.len() as u64)
        .sum();
    TRANSFER_OVERHEAD
        + ids
        + SEGMENT_BYTES * plan.segments().len() as u64
        + open_bytes * (1 + queued_opens)
        + request_id.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_gives_what_fits_and_takes_back() {
        let b = MemoryBudget::new(100);
        assert!(b.try_take(60).is_ok());
        assert_eq!(b.try_take(50), Err((60, 100)));
        assert!(b.try_take(40).is_ok());
        assert_eq!(b.held(), 100);
        b.give_back(60);
        assert!(b.try_take(u64::MAX).is_err());
        assert!(b.try_take(60).is_ok());
    }
}
