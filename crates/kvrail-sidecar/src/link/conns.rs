//! The link's connections as it holds them: each one's tasks, the way
//! frames reach it, and the key (slot and generation) that tells a dead
//! connection's late reports from those of the one reusing its slot.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvrail_core::{ConnId, RailId};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::inline::StreamSink;
use crate::rdma::OneSidedWork;

/// A connection's slot and generation.
pub type ConnKey = (ConnId, u64);

/// A connection's bit in a set of at most 64 (a session's connections);
/// ids past 63, if there ever were any, share the last bit.
pub(super) fn conn_bit(conn: ConnId) -> u64 {
    1u64 << conn.min(63)
}

/// Where a connection's task takes its work from.
pub(super) enum Sink {
    Stream(StreamSink),
    QueuePair(mpsc::UnboundedSender<OneSidedWork>),
}

/// A connection of the link: its tasks, the way in to them, and which
/// connection it is.
pub(super) struct ConnHandle {
    pub(super) writer: Option<Sink>,
    pub(super) reader: Option<AbortHandle>,
    /// The transfer (plus one; 0: none) whose payload the reader is reading
    /// now (stream connections).
    pub(super) reading: Option<Arc<AtomicU64>>,
    pub(super) writer_task: Option<AbortHandle>,
    pub(super) rail: RailId,
    /// Tells a dead connection's late reports from those of the one reusing its slot.
    pub(super) generation: u64,
}

impl ConnHandle {
    /// Stops both tasks (dropping the socket); false if it was already stopped.
    pub(super) fn stop(&mut self) -> bool {
        if self.writer.take().is_none() {
            return false;
        }
        for task in [self.reader.take(), self.writer_task.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
        true
    }
}
