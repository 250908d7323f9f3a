//! kvrail-core: the sans-IO heart of kvrail.
//!
//! Regions and block handles ([`layout`], [`plan`]), slicing and connection
//! scheduling, the transfer state machine ([`transfer`]) and the peer session
//! ([`session`]), the peer handshake ([`handshake`]), the queue-pair setup exchange ([`qp_setup`]), plus the wire
//! framing ([`wire`]). No sockets, no clock, no
//! threads: drivers feed events and `now` in and drain what to send out.

pub mod budget;
pub mod error;
pub mod geometry;
pub mod handshake;
pub mod layout;
pub mod membership;
pub mod message;
pub mod placement;
pub mod plan;
pub mod qp_setup;
pub mod rail;
pub mod rail_setup;
pub mod rangeset;
pub mod ring;
pub mod session;
pub mod transfer;
pub mod wire;

pub use error::{FailureSide, LayoutError, PlanError, TransferError};
pub use geometry::{BlockInterior, HeadSlice, KvGeometry};
pub use layout::RegionLayout;
pub use placement::{Admission, Admitted, ConnPlacer, PlacementGate};
pub use plan::{Access, BlockSelection, Plan, Segment, MAX_BLOCKS_PER_TRANSFER};
pub use rail::{RailConfig, RailHealth, RailId, RailStats};
pub use session::{
    ConnId, Event, LocalTransfer, OneSidedOp, RailChange, RegionAccess, RegionDirectory,
    RemoteSlice, Session, SessionConfig, SliceDisposition, TransferKind, Transmit,
};
pub use transfer::{InvalidTransition, TransferEvent, TransferState};

#[cfg(test)]
mod handshake_tests;
#[cfg(test)]
mod one_sided_tests;
#[cfg(test)]
mod pair_tests;
#[cfg(test)]
mod rail_sim_tests;
#[cfg(test)]
mod testkit;
