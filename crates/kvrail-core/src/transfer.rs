//! The transfer lifecycle, declared as a transition table so that a change of
//! behaviour shows up as a change of this table (and of its snapshot,
//! `transfer_lifecycle.dot`, which the tests compare it with).

/// Where a transfer is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferState {
    /// Accepted, no byte moved yet.
    Queued,
    /// Opened one-sided: nothing moves until the peer grants access to its
    /// memory (then this side moves the bytes) or declines (then slices do).
    AwaitingGrant,
    /// A pull this side serves by granting: the reader moves the bytes with
    /// one-sided reads; this side waits for its Complete.
    ServedByGrant,
    /// Slices are moving.
    InFlight,
    /// Failed, but slices are still being written into its memory: it ends
    /// once they have landed (nothing else is admitted meanwhile).
    Failing,
    /// Every byte placed and confirmed.
    Done,
    /// Ended early; the reason travels with the event.
    Failed,
}

/// What happened to a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferEvent {
    /// Opened one-sided: asks the peer for a grant.
    AskedForGrant,
    /// The peer's grant (or its refusal) arrived.
    GrantAnswered,
    /// This side granted the reader one-sided access to the blocks it serves.
    Granted,
    /// The reader lost its one-sided paths: this side sends the bytes after all.
    GrantWithdrawn,
    /// A slice was handed to a connection (sender) or placed (receiver).
    SliceMoved,
    /// All bytes are placed.
    AllPlaced,
    /// Failed while slices are still being placed into its memory.
    FailWhilePlacing,
    /// Rejected, cancelled, timed out or lost its connections.
    Abort,
}

use TransferEvent::*;
use TransferState::*;

/// Every legal transition; anything else is a bug reported as an error value.
pub const TRANSITIONS: &[(TransferState, TransferEvent, TransferState)] = &[
    (Queued, AskedForGrant, AwaitingGrant),
    (AwaitingGrant, GrantAnswered, Queued),
    (Queued, Granted, ServedByGrant),
    (ServedByGrant, GrantWithdrawn, Queued),
    (Queued, SliceMoved, InFlight),
    (InFlight, SliceMoved, InFlight),
    // A peer that declines a one-sided pull sends two-sided slices, which
    // may arrive on another connection before its answer does.
    (AwaitingGrant, SliceMoved, AwaitingGrant),
    (AwaitingGrant, AllPlaced, Done),
    (InFlight, AllPlaced, Done),
    // A pull served by granting ends with the reader's Complete.
    (ServedByGrant, AllPlaced, Done),
    (Queued, FailWhilePlacing, Failing),
    (AwaitingGrant, FailWhilePlacing, Failing),
    (InFlight, FailWhilePlacing, Failing),
    (Failing, FailWhilePlacing, Failing),
    // One-sided READs posted before the failure complete while it waits.
    (Failing, SliceMoved, Failing),
    (Queued, Abort, Failed),
    (AwaitingGrant, Abort, Failed),
    (ServedByGrant, Abort, Failed),
    (InFlight, Abort, Failed),
    (Failing, Abort, Failed),
];

/// A transition the table does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("transfer cannot go from {from:?} on {event:?}")]
pub struct InvalidTransition {
    pub from: TransferState,
    pub event: TransferEvent,
}

impl TransferState {
    /// Looks the transition up in [`TRANSITIONS`].
    pub fn on(self, event: TransferEvent) -> Result<TransferState, InvalidTransition> {
        TRANSITIONS
            .iter()
            .find(|(from, ev, _)| *from == self && *ev == event)
            .map(|(_, _, to)| *to)
            .ok_or(InvalidTransition { from: self, event })
    }

    pub fn is_final(self) -> bool {
        matches!(self, Done | Failed)
    }
}

/// The table as a Graphviz graph, one edge per transition in table order.
pub fn lifecycle_dot() -> String {
    let mut out = String::from("digraph transfer_lifecycle {\n");
    for (from, event, to) in TRANSITIONS {
        out.push_str(&format!("  {from:?} -> {to:?} [label=\"{event:?}\"];\n"));
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_drives_the_lifecycle() {
        let s = Queued.on(SliceMoved).unwrap().on(SliceMoved).unwrap();
        assert_eq!(s, InFlight);
        assert_eq!(s.on(AllPlaced), Ok(Done));
        assert_eq!(
            Done.on(Abort),
            Err(InvalidTransition {
                from: Done,
                event: Abort
            })
        );
        assert_eq!(
            Queued.on(AllPlaced),
            Err(InvalidTransition {
                from: Queued,
                event: AllPlaced
            })
        );
        // A failing transfer only ends; one served by grant moves no slice.
        assert!(Failing.on(AllPlaced).is_err());
        assert_eq!(
            ServedByGrant.on(SliceMoved).unwrap_err().to_string(),
            "transfer cannot go from ServedByGrant on SliceMoved"
        );
        assert_eq!(AwaitingGrant.on(SliceMoved), Ok(AwaitingGrant));
        assert!(Failed.is_final() && Done.is_final() && !InFlight.is_final());
    }

    #[test]
    fn final_states_have_no_way_out_and_every_state_can_fail() {
        for (from, _, _) in TRANSITIONS {
            assert!(!from.is_final(), "a transition out of {from:?}");
        }
        for state in [Queued, AwaitingGrant, ServedByGrant, InFlight, Failing] {
            assert_eq!(state.on(Abort), Ok(Failed), "{state:?}");
        }
    }

    /// The table's snapshot: a change of the lifecycle is a change of this
    /// file, seen in review (`KVRAIL_BLESS=1` writes it anew).
    #[test]
    fn the_lifecycle_matches_its_snapshot() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/transfer_lifecycle.dot");
        let now = lifecycle_dot();
        if std::env::var_os("KVRAIL_BLESS").is_some() {
            std::fs::write(&path, &now).expect("write the snapshot");
        }
        let kept = std::fs::read_to_string(&path).expect("the snapshot is checked in");
        assert_eq!(
            kept, now,
            "the transfer lifecycle changed: review it, then run with KVRAIL_BLESS=1"
        );
    }
}
