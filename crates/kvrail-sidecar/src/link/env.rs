//! What a link needs from the daemon around it, and nothing more: the regions,
//! the RDMA devices, where transfer ends go, and how to dial a rail again. The
//! daemon implements it; a link holds it weakly (the daemon owns the links).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvrail_core::{Event, RailId};

use crate::config::PeerConfig;
use crate::rdma::{Directory, RdmaRails};
use crate::regions::Registry;

/// A rail probe's outcome: Err with why the rail is still unreachable.
pub type ProbeFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// How an outbound session rebuilds its rails.
#[derive(Clone)]
pub struct DialInfo {
    pub peer: PeerConfig,
    pub session_id: u64,
    /// The acceptor's incarnation seen at this session's first handshake (0:
    /// none yet).
    pub peer_incarnation: Arc<std::sync::atomic::AtomicU64>,
}

/// The daemon as a link sees it.
pub trait LinkEnv: Send + Sync + 'static {
    /// The link it serves (`PeerLink`; named here so that this file needs
    /// nothing of the link's).
    type Link;
    /// Regions registered by local workers.
    fn registry(&self) -> &Registry;
    /// RDMA devices and memory registrations of the rails.
    fn rdma(&self) -> &RdmaRails;
    /// GPU slices a connection stages ahead of the one it sends.
    fn gpu_stage_depth(&self) -> usize;
    /// Whether runtime tasks write a connection's control frames themselves
    /// when its writer is idle (see `inline`).
    fn inline_control_writes(&self) -> bool;
    /// A frame of `bytes` payload came or went: the runtime may stay awake
    /// for the next (`busy_poll`).
    fn on_traffic(&self, bytes: u64);
    /// Whether `on_traffic` does anything (the runtime's busy poll or the
    /// readers' spin is on).
    fn counts_traffic(&self) -> bool;
    /// Whether a reader with nothing left to read may poll its socket for
    /// the next frame before it sleeps (cheap: asked per frame).
    fn reader_spin_on(&self) -> bool;
    /// Leave to do so, and for how long (`None`: not now).
    fn reader_spin(&self) -> Option<crate::busy_poll::ReaderSpin>;
    /// Whether a stream connection's reader and writer run on a thread of
    /// their own (see `conn_thread`) rather than on the shared runtime.
    fn connection_threads(&self) -> bool;
    /// A transfer of the link to `peer` ended (or progressed): tell its worker.
    fn on_event(&self, peer: &str, event: Event);
    /// Dials `rail` of an outbound link again (a probe after the rail went down).
    fn probe_rail(&self, link: Arc<Self::Link>, dial: DialInfo, rail: RailId) -> ProbeFuture<'_>;

    /// Regions as the session checks requests against them.
    fn directory(&self) -> Directory<'_> {
        Directory {
            registry: self.registry(),
            rdma: self.rdma(),
        }
    }
}
