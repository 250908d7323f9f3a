//! The worker's submission ring (docs/ring-format.md): pushes and pulls
//! written into shared memory instead of gRPC calls, answered in a completion
//! queue the worker polls or sleeps on. Submitting is a copy into the ring
//! and, only when the sidecar sleeps, one wake-up system call.
//!
//! ```no_run
//! # async fn f(mut client: kvrail_client::Client, src: kvrail_client::proto::BlockRange,
//! #            dst: kvrail_client::proto::BlockRange) -> Result<(), Box<dyn std::error::Error>> {
//! use kvrail_client::ring::{RingOptions, CompletionKind};
//! let ring = client.open_ring("prefill-0", RingOptions::default()).await?;
//! ring.submit_push("req-1/layer-0", "decode-node", &src, &dst)?;
//! while let Some(c) = ring.wait(std::time::Duration::from_secs(5))? {
//!     if c.kind == CompletionKind::PushDone { break; }
//! }
//! # Ok(()) }
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use kvrail_core::ring::{CloseReason, Completion, CompletionKind, RingGeometry};
use kvrail_core::ring::{RingBlocks, RingError, RingOp, Submission};
use kvrail_proto::{BlockRange, OpenRingRequest};
use kvrail_shm::ring::{RingIoError, WorkerRing};

use crate::{Client, ClientError};

/// Sizes and behaviour of a ring.
#[derive(Debug, Clone, Copy)]
pub struct RingOptions {
    /// Submissions in flight at once (power of two, 2..=4096).
    pub sq_entries: u32,
    /// Completions the worker may leave unread before the sidecar holds
    /// them back (power of two, 4..=65536).
    pub cq_entries: u32,
    /// Bytes per submission slot: block runs and generations must fit
    /// (power of two, 512..=65536); what does not fit is refused with
    /// [`RingSubmitError::TooLarge`], to be sent through gRPC instead.
    pub slot_bytes: u32,
    /// Deliver this worker's transfer notifications to the ring.
    pub notifications: bool,
    /// With `notifications`: take them over from a live Subscribe stream of
    /// this worker held by another process (that stream ends ABORTED);
    /// without it such a ring is refused (ALREADY_EXISTS).
    pub take_over: bool,
    /// How long [`Ring::wait`] spins before it sleeps (default: 50 us with at
    /// least 4 CPUs, else 0: on two cores a spinning waiter takes the core
    /// the sidecar needs to answer).
    pub spin: Duration,
}

impl Default for RingOptions {
    fn default() -> Self {
        Self {
            sq_entries: 256,
            cq_entries: 1024,
            slot_bytes: 4096,
            notifications: true,
            take_over: false,
            spin: default_spin(),
        }
    }
}

fn default_spin() -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    Duration::from_micros(if kvrail_core::ring::spins_with(cpus) {
        50
    } else {
        0
    })
}

/// Why a submission was not written.
#[derive(Debug, thiserror::Error)]
pub enum RingSubmitError {
    #[error("the submission queue is full: wait for completions and submit again")]
    Full,
    #[error("does not fit a ring slot ({0}); use the gRPC call")]
    TooLarge(String),
    #[error("the ring is closed: {0}")]
    Closed(String),
    #[error("ring memory: {0}")]
    Memory(String),
}

impl From<RingIoError> for RingSubmitError {
    fn from(e: RingIoError) -> Self {
        match e {
            RingIoError::Full(_) => Self::Full,
            RingIoError::Layout(RingError::TooLarge(why)) => Self::TooLarge(why),
            RingIoError::Closed(why) => Self::Closed(why),
            e => Self::Memory(e.to_string()),
        }
    }
}

/// A served ring. Dropping it ends the `OpenRing` call (the sidecar stops
/// serving it) and unmaps it.
pub struct Ring {
    ring: Arc<WorkerRing>,
    next_user_data: AtomicU64,
    spin: Duration,
    incarnation: u64,
    watcher: tokio::task::JoinHandle<()>,
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

fn ring_path() -> PathBuf {
    crate::shm_dir().join(format!(
        "kvrail-ring-{}-{:016x}",
        std::process::id(),
        random_u64()
    ))
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl Client {
    /// Creates a ring in shared memory and has the sidecar serve it for
    /// `worker_id`. Fails with `UNIMPLEMENTED` against a sidecar without rings.
    pub async fn open_ring(
        &mut self,
        worker_id: &str,
        options: RingOptions,
    ) -> Result<Ring, ClientError> {
        let geometry =
            RingGeometry::new(options.sq_entries, options.cq_entries, options.slot_bytes)
                .map_err(|e| ClientError::Ring(e.to_string()))?;
        let path = ring_path();
        let ring = Arc::new(
            WorkerRing::create(&path, geometry).map_err(|e| ClientError::Ring(e.to_string()))?,
        );
        let opened = self
            .inner
            .open_ring(OpenRingRequest {
                worker_id: worker_id.into(),
                shm_path: path.to_string_lossy().into_owned(),
                notifications: options.notifications,
                take_over: options.take_over,
            })
            .await;
        // Mapped on both sides (or refused): the name is no longer needed.
        ring.unlink();
        let mut events = opened?.into_inner();
        let first = events.message().await?.ok_or_else(|| {
            ClientError::Ring("the sidecar ended OpenRing without serving the ring".into())
        })?;
        let watched = ring.clone();
        let watcher = tokio::spawn(async move {
            // The call ends when the sidecar closes the ring (it wrote why) or
            // goes away (then nobody would ever answer: say so in the ring).
            while let Ok(Some(_)) = events.message().await {}
            watched.mark_closed(CloseReason::SidecarGone);
        });
        Ok(Ring {
            ring,
            next_user_data: AtomicU64::new(1),
            spin: options.spin,
            incarnation: first.incarnation,
            watcher,
        })
    }
}

impl Client {
    /// Low level: has the sidecar serve a ring file the caller created and
    /// laid out itself (as another language's client would). The ring is
    /// served while the returned stream is kept; its first message says so.
    pub async fn open_ring_file(
        &mut self,
        worker_id: &str,
        path: &std::path::Path,
        notifications: bool,
    ) -> Result<tonic::Streaming<kvrail_proto::RingEvent>, ClientError> {
        Ok(self
            .inner
            .open_ring(OpenRingRequest {
                worker_id: worker_id.into(),
                shm_path: path.to_string_lossy().into_owned(),
                notifications,
                take_over: false,
            })
            .await?
            .into_inner())
    }
}

fn ring_blocks(b: &BlockRange) -> RingBlocks {
    RingBlocks::from_ids(
        b.region_id,
        b.layer_start..b.layer_start.saturating_add(b.layer_count),
        &b.block_ids,
        b.generations.clone(),
    )
}

impl Ring {
    /// The serving sidecar's incarnation (as in notifications).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Why the ring no longer serves, if it does not.
    pub fn closed(&self) -> Option<String> {
        self.ring.closed()
    }

    /// Submits a push; returns its user data (echoed in its ACCEPTED or
    /// REJECTED completion). Never blocks.
    pub fn submit_push(
        &self,
        request_id: &str,
        peer: &str,
        source: &BlockRange,
        destination: &BlockRange,
    ) -> Result<u64, RingSubmitError> {
        self.submit(RingOp::Push, request_id, peer, source, destination)
    }

    /// Submits a pull (`source` on the peer, `destination` here).
    pub fn submit_pull(
        &self,
        request_id: &str,
        peer: &str,
        source: &BlockRange,
        destination: &BlockRange,
    ) -> Result<u64, RingSubmitError> {
        self.submit(RingOp::Pull, request_id, peer, source, destination)
    }

    fn submit(
        &self,
        op: RingOp,
        request_id: &str,
        peer: &str,
        source: &BlockRange,
        destination: &BlockRange,
    ) -> Result<u64, RingSubmitError> {
        let user_data = self.next_user_data.fetch_add(1, Ordering::Relaxed);
        self.ring.submit(&Submission {
            op,
            user_data,
            peer: peer.into(),
            request_id: request_id.into(),
            source: ring_blocks(source),
            destination: ring_blocks(destination),
        })?;
        Ok(user_data)
    }

    /// The next completion, if one is there.
    pub fn poll(&self) -> Result<Option<Completion>, RingSubmitError> {
        Ok(self.ring.poll()?)
    }

    /// Waits (blocking the thread: call it from a thread of its own or
    /// `spawn_blocking`) for the next completion, at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<Option<Completion>, RingSubmitError> {
        Ok(self.ring.wait(self.spin, timeout)?)
    }
}
