//! The transfer lifecycle, declared as a transition table so that a change of
//! behaviour shows up as a change of this table.

/// Where a transfer is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferState {
    /// Accepted, no byte moved yet.
    Queued,
    /// Slices are moving.
    InFlight,
    /// Every byte placed and confirmed.
    Done,
    /// Ended early; the reason travels with the event.
    Failed,
}

/// What happened to a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferEvent {
    /// A slice was handed to a connection (sender) or placed (receiver).
    SliceMoved,
    /// All bytes are placed.
    AllPlaced,
    /// Rejected, cancelled, timed out or lost its connections.
    Abort,
}

use TransferEvent::*;
use TransferState::*;

/// Every legal transition; anything else is a bug reported as an error value.
pub const TRANSITIONS: &[(TransferState, TransferEvent, TransferState)] = &[
    (Queued, SliceMoved, InFlight),
    (InFlight, SliceMoved, InFlight),
    (InFlight, AllPlaced, Done),
    (Queued, Abort, Failed),
    (InFlight, Abort, Failed),
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
        assert!(Failed.is_final() && Done.is_final() && !InFlight.is_final());
    }
}
