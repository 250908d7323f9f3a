//! What a connection's tasks (reader, writer, queue pair, GPU staging) need
//! from the link that owns them, and nothing more. `PeerLink` implements it;
//! the tasks are generic over it, so that they do not reach into the link.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail_core::wire::pb;
use kvrail_core::{ConnId, RailId, Session};

use super::conns::ConnKey;
use super::env::LinkEnv;

pub(super) trait ConnOwner: Send + Sync + Sized + 'static {
    /// The peer's node name (logs, metric labels).
    fn peer(&self) -> &str;
    /// The stream transport's name (`tcp`, `quic`).
    fn transport(&self) -> &'static str;
    /// The daemon around the link; None once it is shutting down.
    fn env(&self) -> Option<Arc<dyn LinkEnv<Link = Self>>>;
    /// How long a reader waits for the rest of a slice whose header it read.
    fn payload_deadline(&self) -> Duration;
    /// Runs `f` on the session, then sends what it queued and reports its events.
    fn with_session<R>(&self, f: impl FnOnce(&mut Session, Instant) -> R) -> R;
    /// As `with_session`, for what connection `key` read: `f` is given its
    /// slot, or None if the slot has gone to another connection since.
    fn with_session_from<R>(
        &self,
        key: ConnKey,
        f: impl FnOnce(&mut Session, Option<ConnId>, Instant) -> R,
    ) -> R;
    /// The connection broke: its tasks stop and the session re-plans.
    fn connection_failed(&self, key: ConnKey, reason: &str);
    /// The rail a connection belongs to (0 once it is gone).
    fn rail_of(&self, conn: ConnId) -> RailId;
    /// Acceptor: the dialer asks for queue pairs on this connection's rail.
    fn on_rdma_connect(self: &Arc<Self>, conn: ConnId, req: pb::RdmaConnect);
    /// Dialer: the answer to a queue-pair request.
    fn on_rdma_accept(&self, accept: pb::RdmaAccept);
}
