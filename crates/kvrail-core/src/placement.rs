//! Placing received slices without the session's lock.
//!
//! A driver that reads several connections of one peer on several threads
//! would otherwise take the session (one per peer) twice per slice: once to
//! learn where the payload goes, once to record it placed. Instead each
//! receiving transfer has a [`PlacementGate`], shared with the connections'
//! readers: it admits a slice without the session (the transfer's plan maps the
//! slice to region ranges; one atomic counts the slices being written into the
//! transfer's memory), and each connection's [`ConnPlacer`] keeps what it has
//! placed until the driver merges the batch into the session
//! ([`crate::Session::merge_placed`]): acknowledgements, completion and failure
//! stay the session's decisions, taken once per batch.
//!
//! Safety of the memory it guards is the count's job: the session closes a
//! gate before it fails or finishes its transfer, no slice is admitted after
//! that, and the transfer ends (the worker may reuse its blocks) only once
//! every admitted slice has been merged or abandoned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::plan::Plan;
use crate::wire::SliceHeader;

/// Merge a connection's placed slices once this many wait...
pub const MERGE_SLICES: usize = 16;
/// ...or once they hold this many bytes (well under a connection's window, so
/// that holding their acknowledgements back never stalls the sender).
pub const MERGE_BYTES: u64 = 2 << 20;
/// How many transfers' gates (or their absence) one connection caches.
const KNOWN_GATES: usize = 256;

/// The state bit of a gate that admits nothing more.
const CLOSED: u64 = 1 << 63;

/// One receiving transfer's admission of slices, shared by the connections
/// that read them.
#[derive(Debug)]
pub struct PlacementGate {
    transfer_id: u64,
    region_id: u64,
    plan: Arc<Plan>,
    /// [`CLOSED`], or'ed with the number of slices admitted and not yet merged
    /// or abandoned.
    state: AtomicU64,
}

impl PlacementGate {
    pub(crate) fn new(transfer_id: u64, region_id: u64, plan: Arc<Plan>) -> Self {
        Self {
            transfer_id,
            region_id,
            plan,
            state: AtomicU64::new(0),
        }
    }

    pub fn transfer_id(&self) -> u64 {
        self.transfer_id
    }

    /// The local region the transfer's bytes go into.
    pub fn region_id(&self) -> u64 {
        self.region_id
    }

    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Slices admitted and not yet merged or abandoned.
    pub fn placing(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// Admits nothing from now on; returns how many admitted slices are still
    /// being placed.
    pub(crate) fn close(&self) -> u64 {
        self.state.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED
    }

    fn try_enter(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSED != 0 {
                return false;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// One admitted slice is settled (merged or abandoned).
    pub(crate) fn leave(&self) {
        let before = self.state.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before & !CLOSED > 0, "gate left more often than entered");
    }
}

/// The session's handle on a transfer's gate: dropping it (the transfer ends)
/// closes the gate, so a reader holding a copy admits nothing more.
#[derive(Debug)]
pub(crate) struct OwnedGate(pub(crate) Arc<PlacementGate>);

impl Drop for OwnedGate {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A slice admitted through its transfer's gate: read its payload into
/// `pieces` of region [`Admitted::region_id`], then hand it back to the session
/// as placed ([`ConnPlacer::placed`], then [`crate::Session::merge_placed`]),
/// failed ([`crate::Session::admitted_failed`]) or abandoned
/// ([`crate::Session::admitted_abandoned`]). Until then its transfer cannot
/// end: one that is dropped instead never does.
#[must_use = "an admitted slice holds its transfer open until the session settles it"]
#[derive(Debug)]
pub struct Admitted {
    pub(crate) gate: Arc<PlacementGate>,
    pub header: SliceHeader,
    pub len: u32,
    /// Region (offset, len) ranges, in the payload's order.
    pub pieces: Vec<(u64, u64)>,
}

impl Admitted {
    pub fn region_id(&self) -> u64 {
        self.gate.region_id
    }
}

/// What a connection may do with an incoming slice on its own.
#[derive(Debug)]
pub enum Admission {
    /// Place it: the gate admitted it.
    Place(Admitted),
    /// Ask the session ([`crate::Session::accept_slice`], or learn the
    /// transfer's gate first if [`ConnPlacer::knows`] says this connection has
    /// not asked yet): an unknown, closed or finished transfer, or a slice
    /// outside the transfer, on which the session decides.
    AskSession,
}

/// One connection's side of placement: the gates it has learnt, and the slices
/// it has placed since they were last merged into the session.
#[derive(Debug, Default)]
pub struct ConnPlacer {
    /// By transfer id: its gate, or None where every slice goes to the session.
    gates: HashMap<u64, Option<Arc<PlacementGate>>>,
    placed: Vec<Admitted>,
    placed_bytes: u64,
}

impl ConnPlacer {
    /// Admits a slice through its transfer's gate, if this connection knows an
    /// open one and the slice lies inside the transfer.
    pub fn admit(&mut self, header: SliceHeader, len: u32) -> Admission {
        let Some(Some(gate)) = self.gates.get(&header.transfer_id) else {
            return Admission::AskSession;
        };
        let Ok(pieces) = gate.plan.pieces(header.offset, u64::from(len)) else {
            // The session aborts the transfer with the reason.
            return Admission::AskSession;
        };
        let pieces = pieces.collect();
        if !gate.try_enter() {
            // The transfer ended or is failing: remember that the session
            // decides its slices from now on.
            self.gates.insert(header.transfer_id, None);
            return Admission::AskSession;
        }
        Admission::Place(Admitted {
            gate: gate.clone(),
            header,
            len,
            pieces,
        })
    }

    /// Whether this connection has learnt how to place `transfer_id`'s slices.
    pub fn knows(&self, transfer_id: u64) -> bool {
        self.gates.contains_key(&transfer_id)
    }

    /// Remembers a transfer's gate ([`crate::Session::placement_gate`]), or
    /// that its slices go to the session (None).
    pub fn learn(&mut self, transfer_id: u64, gate: Option<Arc<PlacementGate>>) {
        if self.gates.len() >= KNOWN_GATES {
            self.gates
                .retain(|_, g| g.as_ref().is_some_and(|g| !g.is_closed()));
            if self.gates.len() >= KNOWN_GATES {
                self.gates.clear();
            }
        }
        self.gates.insert(transfer_id, gate);
    }

    /// A slice's payload is in place; it waits for the next merge.
    pub fn placed(&mut self, slice: Admitted) {
        self.placed_bytes += u64::from(slice.len);
        self.placed.push(slice);
    }

    /// Whether the placed slices should be merged now: the connection has no
    /// further input at hand, or enough of them wait.
    pub fn should_merge(&self, more_input: bool) -> bool {
        !self.placed.is_empty()
            && (!more_input
                || self.placed.len() >= MERGE_SLICES
                || self.placed_bytes >= MERGE_BYTES)
    }

    pub fn has_placed(&self) -> bool {
        !self.placed.is_empty()
    }

    /// The placed slices, for [`crate::Session::merge_placed`].
    pub fn take_placed(&mut self) -> Vec<Admitted> {
        self.placed_bytes = 0;
        std::mem::take(&mut self.placed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::RegionLayout;
    use crate::plan::{Access, BlockSelection};

    /// A placer that knows one open gate over `blocks` blocks of `block_bytes`.
    fn placer(blocks: u32, block_bytes: u64) -> (ConnPlacer, Arc<PlacementGate>) {
        let layout = RegionLayout::dense(1, 1, blocks, block_bytes);
        let selection = BlockSelection {
            region_id: 3,
            layer_start: 0,
            layer_count: 1,
            block_ids: (0..blocks).collect(),
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        };
        let plan = Plan::build(&layout, &selection, Access::Write).unwrap();
        let gate = Arc::new(PlacementGate::new(7, 3, Arc::new(plan)));
        let mut placer = ConnPlacer::default();
        placer.learn(7, Some(gate.clone()));
        (placer, gate)
    }

    fn place(placer: &mut ConnPlacer, offset: u64, len: u32) {
        let header = SliceHeader {
            transfer_id: 7,
            offset,
        };
        match placer.admit(header, len) {
            Admission::Place(s) => placer.placed(s),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_batch_merges_at_its_slice_and_byte_limits_or_when_input_runs_dry() {
        // Small slices: the count decides.
        let (mut small, gate) = placer(64, 1024);
        for i in 0..MERGE_SLICES as u64 - 1 {
            place(&mut small, i * 1024, 1024);
            assert!(!small.should_merge(true), "after {} slices", i + 1);
            assert!(small.should_merge(false), "nothing more at hand");
        }
        place(&mut small, 15 * 1024, 1024);
        assert!(small.should_merge(true));
        assert_eq!(gate.placing(), MERGE_SLICES as u64);
        assert_eq!(small.take_placed().len(), MERGE_SLICES);
        assert!(!small.should_merge(false), "nothing left to merge");
        // Large slices: the bytes decide.
        let (mut large, _) = placer(4, 1 << 20);
        place(&mut large, 0, 1 << 20);
        assert!(!large.should_merge(true));
        place(&mut large, 1 << 20, 1 << 20);
        assert!(large.should_merge(true), "2 MiB wait");
    }

    #[test]
    fn a_closed_gate_admits_nothing_and_counts_what_it_admitted() {
        let (mut placer, gate) = placer(4, 100);
        place(&mut placer, 0, 100);
        assert_eq!(gate.close(), 1);
        assert!(gate.is_closed());
        let header = SliceHeader {
            transfer_id: 7,
            offset: 100,
        };
        assert!(matches!(placer.admit(header, 100), Admission::AskSession));
        assert!(placer.knows(7), "remembered as the session's to decide");
        for slice in placer.take_placed() {
            slice.gate.leave();
        }
        assert_eq!(gate.placing(), 0);
    }
}
