//! The I/O shell around one core [`Session`]: a reader and a writer task per
//! connection, a timer task (deadlines, and probes that rebuild down rails on the
//! dialing side), and the pump that turns the session's transmits into socket
//! writes, its rail changes into closed connections and metrics, and its transfer
//! events into worker notifications.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::IoSlice;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use kvrail_core::wire::{
    self, encode_control, encode_data_header, pb, Body, ErrorCode, FRAME_HEADER_LEN,
    SLICE_HEADER_LEN,
};
use kvrail_core::{
    ConnId, Event, RailChange, RailHealth, RailId, Session, SliceDisposition, Transmit,
};
use kvrail_transport::{read_frame, Connection, Frame, FrameReader, FrameWriter, TransportError};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::AbortHandle;
use tracing::{debug, info, warn};

use crate::config::PeerConfig;
use crate::daemon::Shared;
use crate::gpu;
use crate::held::{HeldPayload, ViewToken};
use crate::metrics as m;
use crate::rdma::{self, OneSidedWork};
use crate::regions::{Region, RegionMemory};
use kvrail_cuda::CopyDone;

/// What a writer task puts on its connection.
enum Outgoing {
    Control(Vec<u8>),
    Slice {
        header: [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        transfer_id: u64,
        region: Arc<Region>,
        pieces: Vec<(u64, u64)>,
        len: u64,
        /// Held until the writer is done with the payload (see `held`).
        hold: ViewToken,
    },
}

/// Where a connection's task takes its work from.
enum Sink {
    Stream(mpsc::UnboundedSender<Outgoing>),
    QueuePair(mpsc::UnboundedSender<OneSidedWork>),
}

struct ConnHandle {
    writer: Option<Sink>,
    reader: Option<AbortHandle>,
    writer_task: Option<AbortHandle>,
    rail: RailId,
    /// Tells a dead connection's late reports from those of the one reusing its slot.
    generation: u64,
}

impl ConnHandle {
    /// Stops both tasks (dropping the socket); false if it was already stopped.
    fn stop(&mut self) -> bool {
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

struct LinkState {
    session: Session,
    conns: Vec<ConnHandle>,
    closed: bool,
    /// Why the link was closed (for the transfers that were still on it).
    closed_because: String,
    next_generation: u64,
    gauges_at: Option<Instant>,
    gauged_rails: usize,
    /// RdmaConnect requests waiting for the peer's RdmaAccept, by nonce.
    rdma_pending: HashMap<u64, oneshot::Sender<pb::RdmaAccept>>,
    /// Rails whose queue pairs are being (re)built right now.
    rdma_building: HashSet<RailId>,
}

/// How an outbound session rebuilds its rails.
#[derive(Clone)]
pub struct DialInfo {
    pub peer: PeerConfig,
    pub session_id: u64,
    /// The acceptor's incarnation seen at this session's first handshake (0:
    /// none yet).
    pub peer_incarnation: Arc<std::sync::atomic::AtomicU64>,
}

/// One session with a peer: the connections we dialed (outbound) or accepted (inbound).
pub struct PeerLink {
    pub peer: String,
    pub transport: &'static str,
    /// "out" for a session this node dialed, "in" for one the peer dialed.
    pub direction: &'static str,
    /// Present on outbound links: what probing dials.
    pub dial: Option<DialInfo>,
    state: Mutex<LinkState>,
    timer: Notify,
    shared: Weak<Shared>,
    me: Weak<PeerLink>,
    /// Payload of this link's sending transfers still queued or held by a writer.
    held: HeldPayload,
}

/// How often the estimated-throughput gauges are refreshed.
const GAUGE_PERIOD: Duration = Duration::from_millis(250);

impl PeerLink {
    pub fn new(
        peer: &str,
        transport: &'static str,
        shared: &Arc<Shared>,
        dial: Option<DialInfo>,
    ) -> Arc<Self> {
        let link = Arc::new_cyclic(|me| Self {
            peer: peer.to_string(),
            transport,
            direction: if dial.is_some() { "out" } else { "in" },
            state: Mutex::new(LinkState {
                session: Session::new(shared.session_config(dial.is_some())),
                conns: Vec::new(),
                closed: false,
                closed_because: String::new(),
                next_generation: 0,
                gauges_at: None,
                gauged_rails: 0,
                rdma_pending: HashMap::new(),
                rdma_building: HashSet::new(),
            }),
            dial,
            timer: Notify::new(),
            shared: Arc::downgrade(shared),
            me: me.clone(),
            held: HeldPayload::default(),
        });
        tokio::spawn(timer_task(Arc::downgrade(&link)));
        link
    }

    fn lock(&self) -> MutexGuard<'_, LinkState> {
        #[cfg(feature = "profile")]
        let _wait = crate::profile::LockWait::start();
        // A panic while holding the lock is a bug; keep serving with the state as is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the link is still in service (its rails may be down for now).
    pub fn is_alive(&self) -> bool {
        !self.lock().closed
    }

    /// Closed, or without a rail for longer than the failover deadline.
    pub fn is_dead(&self) -> bool {
        let st = self.lock();
        st.closed || st.session.is_dead(Instant::now())
    }

    pub fn alive_connections(&self) -> usize {
        self.lock().session.alive_connections()
    }

    /// Reads the session without changing it (nothing to send or report afterwards).
    pub fn inspect<R>(&self, f: impl FnOnce(&Session) -> R) -> R {
        f(&self.lock().session)
    }

    /// A worker released blocks of our region `region_id`: fails the transfers
    /// of this link that name them, then waits (up to `limit`) until none of
    /// them is reading those blocks (a writer's payload views, which the kernel
    /// may still read from) or placing into them (a slice being read off a
    /// connection). How many failed, and whether all of them settled in time.
    pub async fn release_blocks(
        &self,
        region_id: u64,
        blocks: &[u32],
        why: &str,
        limit: Duration,
    ) -> (usize, bool) {
        let naming = self.inspect(|s| s.transfers_naming(region_id, blocks));
        if naming.is_empty() {
            return (0, true);
        }
        // Taken before the failure, which forgets them.
        let views: Vec<_> = naming
            .iter()
            .filter_map(|&id| self.held.views(id))
            .collect();
        let failed = self.with_session(|s, now| s.blocks_released(region_id, blocks, why, now));
        self.rearm_timer();
        let deadline = tokio::time::Instant::now() + limit;
        for v in views {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if !v.released(left).await {
                return (failed.len(), false);
            }
        }
        // A slice being placed finishes within one memcpy of a slice; there is
        // no event for it, so look again shortly.
        while self.inspect(|s| s.still_placing(&failed)) {
            if tokio::time::Instant::now() >= deadline {
                return (failed.len(), false);
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        (failed.len(), true)
    }

    /// Runs `f` on the session, then sends what it queued and reports its events.
    pub fn with_session<R>(&self, f: impl FnOnce(&mut Session, Instant) -> R) -> R {
        let mut st = self.lock();
        let r = f(&mut st.session, Instant::now());
        self.pump(&mut st);
        r
    }

    /// The rail a connection belongs to (0 once it is gone).
    pub fn rail_of(&self, conn: ConnId) -> RailId {
        self.lock().conns.get(conn).map_or(0, |c| c.rail)
    }

    /// Hands a transfer's end to the daemon; a sending transfer's completion
    /// waits until its writers let go of its payload (see `held`).
    fn deliver(&self, shared: &Arc<Shared>, ev: Event) {
        let held = match &ev {
            Event::Done {
                transfer_id, kind, ..
            } if kind.sends_data() => self.held.completed(*transfer_id),
            Event::Failed {
                transfer_id, kind, ..
            } if kind.sends_data() => {
                self.held.failed(*transfer_id);
                None
            }
            _ => None,
        };
        let Some(views) = held else {
            shared.on_event(&self.peer, ev);
            return;
        };
        let (shared, peer) = (shared.clone(), self.peer.clone());
        tokio::spawn(async move {
            if !views.released(HELD_PAYLOAD_LIMIT).await {
                warn!(%peer, "a writer still holds a finished transfer's payload; telling the worker anyway");
            }
            shared.on_event(&peer, ev);
        });
    }

    /// Wakes the timer after a change that may move the next deadline.
    pub fn rearm_timer(&self) {
        self.timer.notify_one();
    }

    fn pump(&self, st: &mut LinkState) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        if st.closed && st.session.active_transfers() > 0 {
            // A closed link runs no timers and carries nothing: whatever is on
            // it (also a transfer started just as it closed) ends now.
            let message = format!("the link to {} closed: {}", self.peer, st.closed_because);
            st.session.fail_all(kvrail_core::TransferError::Local {
                code: ErrorCode::Internal,
                message,
            });
        }
        while let Some(t) = st.session.poll_transmit(now) {
            if let Transmit::Slice {
                conn,
                retransmit: true,
                ..
            } = &t
            {
                let rail = st.conns.get(*conn).map_or(0, |c| c.rail);
                metrics::counter!(m::RAIL_SLICES_RETRANSMITTED, "peer" => self.peer.clone(), "rail" => rail.to_string()).increment(1);
            }
            let (conn, out) = match t {
                Transmit::Control { conn, msg } => (conn, Outgoing::Control(encode_control(&msg))),
                Transmit::Slice {
                    conn,
                    header,
                    len,
                    region_id,
                    pieces,
                    remote,
                    ..
                } => {
                    let Some(region) = shared.registry.get(region_id) else {
                        st.session.fail(
                            header.transfer_id,
                            ErrorCode::RegionGone,
                            "local region was unregistered",
                            now,
                        );
                        continue;
                    };
                    if let Some(remote) = remote {
                        let work = OneSidedWork {
                            header,
                            len,
                            region,
                            pieces,
                            remote,
                        };
                        if let Some(Sink::QueuePair(tx)) =
                            st.conns.get(conn).and_then(|c| c.writer.as_ref())
                        {
                            // A closed channel means the task died; it reports the loss.
                            let _ = tx.send(work);
                        }
                        continue;
                    }
                    (
                        conn,
                        Outgoing::Slice {
                            header: encode_data_header(header, len),
                            transfer_id: header.transfer_id,
                            region,
                            pieces,
                            len: u64::from(len),
                            hold: self.held.token(header.transfer_id),
                        },
                    )
                }
            };
            if let Some(Sink::Stream(tx)) = st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
                // A closed channel means the writer died; its reader reports the loss.
                let _ = tx.send(out);
            }
        }
        while let Some(ev) = st.session.poll_event() {
            match ev {
                Event::Rail(change) => self.on_rail_change(st, change),
                ev => self.deliver(&shared, ev),
            }
        }
        // Refresh periodically, and at once when a rail appears.
        let rails = st.session.rail_count();
        if rails != st.gauged_rails
            || st
                .gauges_at
                .is_none_or(|t| now.duration_since(t) >= GAUGE_PERIOD)
        {
            st.gauges_at = Some(now);
            st.gauged_rails = rails;
            for r in st.session.rail_stats() {
                let labels = self.rail_labels(r.rail);
                metrics::gauge!(m::RAIL_THROUGHPUT, &labels)
                    .set(r.rate_bytes_per_sec.unwrap_or(0.0));
                metrics::gauge!(m::RAIL_STATE, &labels).set(r.health.gauge());
            }
        }
    }

    /// Logs and counts a rail change; a rail gone down loses its connections.
    fn on_rail_change(&self, st: &mut LinkState, c: RailChange) {
        metrics::gauge!(m::RAIL_STATE, &self.rail_labels(c.rail)).set(c.to.gauge());
        metrics::counter!(
            m::RAIL_TRANSITIONS,
            "peer" => self.peer.clone(),
            "rail" => c.rail.to_string(),
            "from" => c.from.as_str(),
            "to" => c.to.as_str()
        )
        .increment(1);
        match c.to {
            RailHealth::Down => {
                warn!(peer = %self.peer, rail = c.rail, direction = self.direction, from = c.from.as_str(), "rail down: {}", c.reason);
                let conns = st.session.rail_connections(c.rail);
                self.stop_connections(st, conns);
            }
            RailHealth::Up => {
                info!(peer = %self.peer, rail = c.rail, direction = self.direction, from = c.from.as_str(), "rail up");
            }
            to => {
                info!(peer = %self.peer, rail = c.rail, direction = self.direction, "rail {}: {}", to.as_str(), c.reason);
            }
        }
    }

    /// Labels of the per-rail series of this session.
    fn rail_labels(&self, rail: RailId) -> [(&'static str, String); 3] {
        [
            ("peer", self.peer.clone()),
            ("rail", rail.to_string()),
            ("direction", self.direction.to_string()),
        ]
    }

    /// Stops the tasks of these connections (those still running) and counts them gone.
    fn stop_connections(&self, st: &mut LinkState, conns: impl IntoIterator<Item = ConnId>) {
        for conn in conns {
            if st.conns.get_mut(conn).is_some_and(ConnHandle::stop) {
                metrics::gauge!(m::PEER_CONNECTIONS, "peer" => self.peer.clone()).decrement(1.0);
            }
        }
    }

    /// Why each rail is down, for errors that name the cause.
    pub fn rail_causes(&self) -> String {
        self.lock().session.rail_causes()
    }

    /// Per-rail state and counters of this session.
    pub fn rail_stats(&self) -> Vec<kvrail_core::RailStats> {
        self.lock().session.rail_stats()
    }

    /// Marks a rail whose first dial failed as down (to be probed).
    pub fn rail_unreachable(&self, rail: RailId, reason: &str) {
        self.with_session(|s, now| s.rail_unreachable(rail, reason, now));
        self.rearm_timer();
    }

    /// Rebuilding `rail` failed; the session backs off before the next probe.
    pub fn probe_failed(&self, rail: RailId, reason: &str) {
        metrics::counter!(m::RAIL_PROBES_FAILED, "peer" => self.peer.clone(), "rail" => rail.to_string()).increment(1);
        debug!(peer = %self.peer, rail, "probe failed: {reason}");
        self.with_session(|s, now| s.probe_failed(rail, reason, now));
        self.rearm_timer();
    }

    /// The dialer is rebuilding `rail`: drop what this side still holds on it,
    /// without judging the rail (its new connections follow at once).
    pub fn retire_rail(&self, rail: RailId) {
        let mut st = self.lock();
        let ids = st.session.retire_rail_connections(rail);
        self.stop_connections(&mut st, ids);
        self.pump(&mut st);
    }

    /// Whether connection `conn` is still open (not retired or failed).
    pub fn is_live(&self, conn: ConnId) -> bool {
        self.lock()
            .conns
            .get(conn)
            .is_some_and(|h| h.writer.is_some())
    }

    /// Adds a handshaken connection on `rail` and starts its tasks.
    pub fn attach(self: &Arc<Self>, conn: Connection, rail: RailId) -> Option<ConnId> {
        self.install(rail, false, |key| {
            let (tx, rx) = mpsc::unbounded_channel();
            let reader = tokio::spawn(reader_task(self.clone(), key, rail, conn.reader));
            let writer = tokio::spawn(writer_task(self.clone(), key, rail, conn.writer, rx));
            (
                Sink::Stream(tx),
                Some(reader.abort_handle()),
                writer.abort_handle(),
            )
        })
    }

    /// Adds a connection to the session (a queue pair if `one_sided`), starts its
    /// tasks with `start` (given the connection's key) and keeps their handles.
    fn install(
        &self,
        rail: RailId,
        one_sided: bool,
        start: impl FnOnce(ConnKey) -> (Sink, Option<AbortHandle>, AbortHandle),
    ) -> Option<ConnId> {
        let mut st = self.lock();
        if st.closed {
            return None;
        }
        let now = Instant::now();
        let id = if one_sided {
            st.session.add_one_sided_connection(rail, now)?
        } else {
            st.session.add_connection(rail, now)?
        };
        st.next_generation += 1;
        let generation = st.next_generation;
        let (sink, reader, writer) = start((id, generation));
        let handle = ConnHandle {
            writer: Some(sink),
            reader,
            writer_task: Some(writer),
            rail,
            generation,
        };
        // The session may reuse a dead connection's slot.
        self.stop_connections(&mut st, [id]);
        match st.conns.get_mut(id) {
            Some(old) => *old = handle,
            None => st.conns.push(handle),
        }
        metrics::gauge!(m::PEER_CONNECTIONS, "peer" => self.peer.clone()).increment(1.0);
        self.pump(&mut st);
        drop(st);
        self.timer.notify_one();
        Some(id)
    }

    /// A connection broke: stop its tasks and let the session re-plan.
    pub fn connection_failed(&self, (conn, generation): (ConnId, u64), reason: &str) {
        let mut st = self.lock();
        let Some(handle) = st.conns.get_mut(conn) else {
            return;
        };
        if handle.generation != generation || handle.writer.is_none() {
            return;
        }
        let rail = handle.rail;
        let queue_pair = matches!(handle.writer, Some(Sink::QueuePair(_)));
        self.stop_connections(&mut st, [conn]);
        warn!(peer = %self.peer, conn, rail, queue_pair, "peer connection lost: {reason}");
        metrics::counter!(m::CONNECTIONS_LOST, "peer" => self.peer.clone(), "rail" => rail.to_string()).increment(1);
        st.session.connection_lost(conn, reason, Instant::now());
        self.pump(&mut st);
        let rebuild = queue_pair && self.dial.is_some() && !st.closed;
        drop(st);
        self.timer.notify_one();
        if rebuild {
            self.spawn_rdma_rebuild(rail);
        }
    }

    /// Rebuilds `rail`'s queue pairs in the background (dialer side).
    pub fn spawn_rdma_rebuild(&self, rail: RailId) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(rebuild_queue_pairs(me, rail));
        }
    }

    /// The registration of a local region on a rail's RDMA device.
    pub fn rdma_mr(&self, region_id: u64, rail: RailId) -> Option<Arc<kvrail_verbs::MemoryRegion>> {
        self.shared.upgrade()?.rdma.mr(region_id, rail)
    }

    /// Queues a driver-level control message on one connection.
    fn send_control(&self, conn: ConnId, body: Body) -> bool {
        let st = self.lock();
        match st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
            Some(Sink::Stream(tx)) => tx
                .send(Outgoing::Control(encode_control(&wire::message(body))))
                .is_ok(),
            _ => false,
        }
    }

    /// Adds a connected queue pair on `rail` as a one-sided connection.
    pub fn attach_qp(
        self: &Arc<Self>,
        qp: kvrail_verbs::QueuePair,
        rail: RailId,
    ) -> Option<ConnId> {
        let busy_poll = self.shared.upgrade()?.rdma.busy_poll;
        self.install(rail, true, |key| {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(rdma::qp_task(self.clone(), key, rail, qp, rx, busy_poll));
            (Sink::QueuePair(tx), None, task.abort_handle())
        })
    }

    /// Dialer: sets up `qps_per_rail` queue pairs on `rail` over its stream
    /// connection `conn`. Ok(n) with the number attached.
    pub async fn setup_rdma(self: &Arc<Self>, rail: RailId, conn: ConnId) -> Result<usize, String> {
        let shared = self.shared.upgrade().ok_or("daemon is shutting down")?;
        let count = shared.rdma.qps_per_rail;
        let mut qps = rdma::create_qps(&shared.rdma, rail, count)?;
        let endpoints = qps
            .iter()
            .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let nonce: u64 = rand::random();
        let (tx, rx) = oneshot::channel();
        self.lock().rdma_pending.insert(nonce, tx);
        let sent = self.send_control(
            conn,
            Body::RdmaConnect(pb::RdmaConnect {
                rail_index: rail,
                nonce,
                qps: endpoints,
            }),
        );
        if !sent {
            self.lock().rdma_pending.remove(&nonce);
            return Err("the rail's connection closed before setup".into());
        }
        let answer = tokio::time::timeout(RDMA_SETUP_TIMEOUT, rx).await;
        self.lock().rdma_pending.remove(&nonce);
        let accept = match answer {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => return Err("the rail's connection closed during setup".into()),
            Err(_) => return Err(format!("no answer from the peer in {RDMA_SETUP_TIMEOUT:?}")),
        };
        if !accept.error.is_empty() {
            return Err(format!("peer: {}", accept.error));
        }
        if accept.qps.len() != qps.len() {
            return Err(format!(
                "peer answered with {} queue pairs for {}",
                accept.qps.len(),
                qps.len()
            ));
        }
        for (qp, remote) in qps.iter_mut().zip(&accept.qps) {
            qp.connect(&rdma::endpoint_of(remote)?)
                .map_err(|e| e.to_string())?;
        }
        let mut attached = 0;
        for qp in qps {
            if self.attach_qp(qp, rail).is_some() {
                attached += 1;
            }
        }
        Ok(attached)
    }

    /// Acceptor: the dialer asks for queue pairs on the rail of connection `conn`.
    fn on_rdma_connect(self: &Arc<Self>, conn: ConnId, req: pb::RdmaConnect) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let rail = self.lock().session.connection_rail(conn);
        {
            // The dialer replaces its queue pairs on this rail: ours are stale.
            let mut st = self.lock();
            let stale = st.session.retire_one_sided_connections(req.rail_index);
            self.stop_connections(&mut st, stale);
            self.pump(&mut st);
        }
        let result = match rail {
            Some(r) if r == req.rail_index => rdma::accept_qps(&shared.rdma, r, &req),
            _ => Err(format!(
                "rail {} does not match the connection's rail {rail:?}",
                req.rail_index
            )),
        };
        let answer = match result {
            Ok(qps) => {
                let endpoints: Result<Vec<_>, _> = qps
                    .iter()
                    .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
                    .collect();
                match endpoints {
                    Ok(endpoints) => {
                        for qp in qps {
                            self.attach_qp(qp, req.rail_index);
                        }
                        info!(peer = %self.peer, rail = req.rail_index, qps = endpoints.len(), "RDMA queue pairs connected");
                        pb::RdmaAccept {
                            nonce: req.nonce,
                            qps: endpoints,
                            error: String::new(),
                        }
                    }
                    Err(e) => pb::RdmaAccept {
                        nonce: req.nonce,
                        qps: vec![],
                        error: e.to_string(),
                    },
                }
            }
            Err(e) => {
                info!(peer = %self.peer, rail = req.rail_index, "declined RDMA queue pairs: {e}");
                pb::RdmaAccept {
                    nonce: req.nonce,
                    qps: vec![],
                    error: e,
                }
            }
        };
        self.send_control(conn, Body::RdmaAccept(answer));
    }

    fn on_rdma_accept(&self, accept: pb::RdmaAccept) {
        if let Some(tx) = self.lock().rdma_pending.remove(&accept.nonce) {
            let _ = tx.send(accept);
        }
    }

    /// Whether an acceptor's `incarnation` is the one this outbound session
    /// started with (the first handshake records it). If the peer restarted,
    /// every transfer of the session fails now and the link closes: the next
    /// request dials a new session.
    pub fn same_peer_incarnation(&self, incarnation: u64) -> bool {
        use std::sync::atomic::Ordering;
        let Some(dial) = &self.dial else {
            return true;
        };
        let seen = match dial.peer_incarnation.compare_exchange(
            0,
            incarnation,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return true,
            Err(seen) => seen,
        };
        if seen == incarnation || incarnation == 0 {
            // 0: an older kvrail that does not say; nothing to compare.
            return true;
        }
        warn!(peer = %self.peer, "the peer restarted (incarnation {seen:#x} -> {incarnation:#x}): failing this session's transfers");
        self.with_session(|s, _| s.peer_restarted(seen, incarnation));
        self.close("the peer restarted");
        false
    }

    /// Closes every connection and stops probing (daemon shutdown, dial refused).
    pub fn close(&self, reason: &str) {
        let handles: Vec<(ConnId, u64)> = {
            let mut st = self.lock();
            st.closed = true;
            st.closed_because = reason.to_string();
            st.conns
                .iter()
                .enumerate()
                .map(|(i, h)| (i, h.generation))
                .collect()
        };
        for h in handles {
            self.connection_failed(h, reason);
        }
        self.timer.notify_one();
    }
}

/// Most frames, and payload bytes, one vectored write gathers from the queue.
const WRITE_BATCH_FRAMES: usize = 64;
const WRITE_BATCH_BYTES: u64 = 4 << 20;

/// A connection's slot and generation.
pub type ConnKey = (ConnId, u64);

/// Longest a transfer's end waits for its payload to be let go: quinn keeps
/// views until they are acknowledged or its connection is dropped, which the
/// rail-stall timers bound well below this.
const HELD_PAYLOAD_LIMIT: Duration = Duration::from_secs(30);

/// How long the peer may take to answer an RdmaConnect.
const RDMA_SETUP_TIMEOUT: Duration = Duration::from_secs(3);

async fn writer_task(
    link: Arc<PeerLink>,
    key: ConnKey,
    rail: u32,
    mut writer: Box<dyn FrameWriter>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let rail_label = rail.to_string();
    let labels = [
        ("peer", link.peer.clone()),
        ("rail", rail_label),
        ("transport", link.transport.to_string()),
    ];
    // Frames in order; slices of GPU regions wait here while their device copy runs.
    let mut queue: VecDeque<Queued> = VecDeque::new();
    let mut staging = 0usize;
    let mut batch: Vec<Outgoing> = Vec::with_capacity(WRITE_BATCH_FRAMES);
    let stage_depth = link
        .shared
        .upgrade()
        .map_or(1, |s| s.config.gpu_stage_depth);
    loop {
        if queue.is_empty() {
            let Some(first) = rx.recv().await else { return };
            staging += link.admit(first, &mut queue);
        }
        // Whatever else is already queued goes out in the same system call, and
        // the next GPU slices start their copies while this one is sent.
        while queue.len() < WRITE_BATCH_FRAMES && staging < stage_depth {
            match rx.try_recv() {
                Ok(o) => staging += link.admit(o, &mut queue),
                Err(_) => break,
            }
        }
        let result = match queue.pop_front() {
            // A staged slice's hold goes once its device copy is done: the pinned
            // buffer is ours.
            Some(Queued::Staging {
                header,
                transfer_id,
                len,
                device,
                copy,
                ..
            }) => {
                staging -= 1;
                let mut staged = vec![(header, transfer_id, len, copy.await)];
                // Slices behind it whose copies are done already share the write.
                while let Some(Queued::Staging { copy, .. }) = queue.front_mut() {
                    let Ok(done) = copy.try_recv() else { break };
                    if let Some(Queued::Staging {
                        header,
                        transfer_id,
                        len,
                        ..
                    }) = queue.pop_front()
                    {
                        staging -= 1;
                        staged.push((header, transfer_id, len, Ok(done)));
                    }
                }
                let sent = link.send_staged(writer.as_mut(), staged, &device).await;
                if let Ok(bytes) = &sent {
                    if bytes.slices > 0 {
                        metrics::counter!(m::BYTES_SENT, &labels).increment(bytes.bytes);
                        metrics::counter!(m::SLICES_SENT, &labels).increment(bytes.slices);
                        metrics::counter!(m::GPU_STAGED_BYTES, "direction" => "to_host")
                            .increment(bytes.bytes);
                    }
                }
                sent.map(|_| ())
            }
            Some(Queued::Ready(first)) => {
                let mut payload = 0;
                let mut next = Some(first);
                while let Some(o) = next.take() {
                    // A transfer that failed while its slices waited: they stay unsent.
                    if o.abandoned() {
                    } else if let Some((transfer_id, why)) = o.truncated_source() {
                        // The worker shrank the file: send nothing of it (its
                        // bytes are gone) and fail that transfer alone.
                        link.with_session(|s, now| {
                            s.fail(transfer_id, ErrorCode::RegionTruncated, &why, now)
                        });
                    } else {
                        payload += o.payload_len();
                        batch.push(o);
                    }
                    if batch.len() >= WRITE_BATCH_FRAMES || payload >= WRITE_BATCH_BYTES {
                        break;
                    }
                    if matches!(queue.front(), Some(Queued::Ready(_))) {
                        if let Some(Queued::Ready(o)) = queue.pop_front() {
                            next = Some(o);
                        }
                    }
                }
                let r = write_batch(writer.as_mut(), &batch).await;
                let slices = batch
                    .iter()
                    .filter(|o| matches!(o, Outgoing::Slice { .. }))
                    .count() as u64;
                if r.is_ok() && slices > 0 {
                    metrics::counter!(m::BYTES_SENT, &labels).increment(payload);
                    metrics::counter!(m::SLICES_SENT, &labels).increment(slices);
                }
                batch.clear();
                r
            }
            None => Ok(()),
        };
        if let Err(e) = result {
            link.connection_failed(key, &format!("write failed: {e}"));
            return;
        }
    }
}

/// A staged slice: header, transfer, payload length, and its copy's outcome.
type StagedSlice = (
    [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
    u64,
    usize,
    Result<CopyDone, oneshot::error::RecvError>,
);

/// What one write carried.
struct Sent {
    slices: u64,
    bytes: u64,
}

/// A frame waiting for its turn on a connection.
enum Queued {
    Ready(Outgoing),
    /// A GPU region's slice being copied into a pinned buffer.
    Staging {
        header: [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        transfer_id: u64,
        len: usize,
        device: Arc<gpu::GpuDevice>,
        copy: oneshot::Receiver<CopyDone>,
        /// The device copy reads the worker's GPU memory until it completes.
        _hold: ViewToken,
    },
}

impl PeerLink {
    /// Queues a frame; a GPU region's slice starts its device-to-host copy now.
    /// Returns 1 when a copy was started.
    fn admit(&self, out: Outgoing, queue: &mut VecDeque<Queued>) -> usize {
        if out.abandoned() {
            return 0;
        }
        let Outgoing::Slice {
            header,
            transfer_id,
            region,
            pieces,
            len,
            hold,
        } = out
        else {
            queue.push_back(Queued::Ready(out));
            return 0;
        };
        let RegionMemory::Gpu(g) = &region.memory else {
            queue.push_back(Queued::Ready(Outgoing::Slice {
                header,
                transfer_id,
                region,
                pieces,
                len,
                hold,
            }));
            return 0;
        };
        let started = g.device.pool.take().and_then(|buffer| {
            g.device
                .to_host
                .to_host(g.memory.clone(), &pieces, buffer)
                .map_err(|(e, buffer)| {
                    g.device.pool.give(buffer);
                    e
                })
        });
        match started {
            Ok(copy) => {
                queue.push_back(Queued::Staging {
                    header,
                    transfer_id,
                    len: len as usize,
                    device: g.device.clone(),
                    copy,
                    _hold: hold,
                });
                1
            }
            Err(e) => {
                self.device_copy_failed(transfer_id, &e.to_string());
                0
            }
        }
    }

    /// Sends staged slices in one write; a slice whose copy failed is left out
    /// (its transfer fails, the connection goes on).
    async fn send_staged(
        &self,
        writer: &mut dyn FrameWriter,
        staged: Vec<StagedSlice>,
        device: &gpu::GpuDevice,
    ) -> std::io::Result<Sent> {
        let mut ready = Vec::with_capacity(staged.len());
        for (header, transfer_id, len, done) in staged {
            match done {
                Ok(CopyDone {
                    buffer,
                    result: Ok(()),
                }) => ready.push((header, len, buffer)),
                Ok(CopyDone {
                    buffer,
                    result: Err(e),
                }) => {
                    device.pool.give(buffer);
                    self.device_copy_failed(transfer_id, &e.to_string());
                }
                Err(_) => self.device_copy_failed(transfer_id, "the copy queue stopped"),
            }
        }
        let mut bufs = Vec::with_capacity(ready.len() * 2);
        for (header, len, buffer) in &ready {
            bufs.push(IoSlice::new(header));
            bufs.push(IoSlice::new(&buffer.as_slice()[..*len]));
        }
        let r = writer.write_all_vectored(&mut bufs).await;
        let sent = Sent {
            slices: ready.len() as u64,
            bytes: ready.iter().map(|(_, len, _)| *len as u64).sum(),
        };
        for (_, _, buffer) in ready {
            device.pool.give(buffer);
        }
        r.map(|()| sent)
    }

    fn device_copy_failed(&self, transfer_id: u64, reason: &str) {
        warn!(peer = %self.peer, transfer = transfer_id, "GPU copy failed: {reason}");
        metrics::counter!(m::GPU_COPY_FAILURES).increment(1);
        self.with_session(|s, now| {
            s.fail(
                transfer_id,
                ErrorCode::Internal,
                &format!("GPU copy failed: {reason}"),
                now,
            )
        });
    }
}

impl Outgoing {
    /// A slice of a transfer that failed since it was queued.
    fn abandoned(&self) -> bool {
        matches!(self, Outgoing::Slice { hold, .. } if hold.abandoned())
    }

    fn payload_len(&self) -> u64 {
        match self {
            Outgoing::Control(_) => 0,
            Outgoing::Slice { len, .. } => *len,
        }
    }

    /// A host slice whose region's file no longer backs its bytes: the
    /// transfer and why.
    fn truncated_source(&self) -> Option<(u64, String)> {
        let Outgoing::Slice {
            transfer_id,
            region,
            pieces,
            ..
        } = self
        else {
            return None;
        };
        let host = region.memory.host()?;
        let end = pieces.iter().map(|(o, l)| o + l).max()?;
        host.check_intact(0, end)
            .err()
            .map(|e| (*transfer_id, e.to_string()))
    }
}

/// Payload pieces at least this long go to a zero-copy writer by reference;
/// shorter ones (and frame headers) are cheaper to copy into one shared chunk.
const ZERO_COPY_MIN: u64 = 16 << 10;

async fn write_batch(writer: &mut dyn FrameWriter, batch: &[Outgoing]) -> std::io::Result<()> {
    if writer.takes_owned_payload() {
        return writer.write_chunks(owned_chunks(batch)?).await;
    }
    let mut bufs = Vec::with_capacity(batch.len() * 2);
    for out in batch {
        match out {
            Outgoing::Control(bytes) => bufs.push(IoSlice::new(bytes)),
            Outgoing::Slice {
                header,
                region,
                pieces,
                ..
            } => {
                let host = staged_host(region)?;
                bufs.push(IoSlice::new(header));
                bufs.extend(host.io_slices(pieces).map_err(std::io::Error::other)?);
            }
        }
    }
    writer.write_all_vectored(&mut bufs).await
}

/// The host memory a ready slice is sent from (GPU slices go through staging).
fn staged_host(region: &Region) -> std::io::Result<&Arc<kvrail_shm::SharedRegion>> {
    region
        .memory
        .shared_host()
        .ok_or_else(|| std::io::Error::other("a GPU slice was not staged"))
}

/// The batch as chunks a zero-copy writer may keep: large payload pieces as
/// views of their mapped region, everything between them copied together.
fn owned_chunks(batch: &[Outgoing]) -> std::io::Result<Vec<Bytes>> {
    let mut chunks = Vec::new();
    let mut small = BytesMut::new();
    for out in batch {
        match out {
            Outgoing::Control(bytes) => small.extend_from_slice(bytes),
            Outgoing::Slice {
                header,
                region,
                pieces,
                hold,
                ..
            } => {
                let host = staged_host(region)?;
                small.extend_from_slice(header);
                for &(offset, len) in pieces {
                    if len >= ZERO_COPY_MIN {
                        if !small.is_empty() {
                            chunks.push(small.split().freeze());
                        }
                        chunks.push(
                            host.shared_bytes(offset, len, hold.clone())
                                .map_err(std::io::Error::other)?,
                        );
                    } else {
                        small.extend_from_slice(
                            host.slice(offset, len).map_err(std::io::Error::other)?,
                        );
                    }
                }
            }
        }
    }
    if !small.is_empty() {
        chunks.push(small.freeze());
    }
    Ok(chunks)
}

async fn reader_task(
    link: Arc<PeerLink>,
    key: ConnKey,
    rail: u32,
    mut reader: Box<dyn FrameReader>,
) {
    let reason = match read_loop(&link, key.0, rail, reader.as_mut()).await {
        Ok(()) => "link closed".to_string(),
        Err(TransportError::Wire(e)) => {
            metrics::counter!(m::FRAMES_REJECTED, "reason" => wire_reason(&e)).increment(1);
            format!("malformed frame: {e}")
        }
        Err(e) => e.to_string(),
    };
    link.connection_failed(key, &reason);
}

fn wire_reason(e: &wire::WireError) -> &'static str {
    match e {
        wire::WireError::BadMagic(_) => "bad_magic",
        wire::WireError::Version(_) => "version",
        wire::WireError::UnknownKind(_) => "unknown_kind",
        wire::WireError::TooLong { .. } => "too_long",
        wire::WireError::ShortData => "short_data",
        wire::WireError::Decode(_) | wire::WireError::EmptyMessage => "decode",
    }
}

async fn read_loop(
    link: &Arc<PeerLink>,
    conn: ConnId,
    rail: u32,
    reader: &mut dyn FrameReader,
) -> Result<(), TransportError> {
    let rail_label = rail.to_string();
    loop {
        let Some(shared) = link.shared.upgrade() else {
            return Ok(());
        };
        match read_frame(reader).await? {
            Frame::Control(Body::RdmaConnect(req)) => link.on_rdma_connect(conn, req),
            Frame::Control(Body::RdmaAccept(a)) => link.on_rdma_accept(a),
            Frame::Control(body) => {
                let dir = shared.directory();
                link.with_session(|s, now| s.handle_control(conn, body, now, &dir));
                link.rearm_timer();
            }
            Frame::Data {
                header,
                payload_len,
            } => match link.with_session(|s, now| s.accept_slice(conn, header, payload_len, now)) {
                SliceDisposition::Place { region_id, pieces } => {
                    let Some(region) = shared.registry.get(region_id) else {
                        reader.discard(u64::from(payload_len)).await?;
                        link.with_session(|s, _| s.slice_abandoned(conn, header));
                        continue;
                    };
                    let host = match &region.memory {
                        RegionMemory::Host(host) => host,
                        RegionMemory::Gpu(g) => {
                            receive_staged(link, conn, header, payload_len, pieces, g, reader)
                                .await?;
                            continue;
                        }
                    };
                    let read = match host.io_slices_mut(&pieces) {
                        Ok(mut bufs) => reader.read_payload(&mut bufs).await,
                        Err(e) => Err(std::io::Error::other(e)),
                    };
                    if let Err(e) = read {
                        link.with_session(|s, _| s.slice_abandoned(conn, header));
                        return Err(e.into());
                    }
                    let end = pieces.iter().map(|(o, l)| o + l).max().unwrap_or(0);
                    if let Err(e) = host.check_intact(0, end) {
                        // The worker shrank the file under us: the bytes went to
                        // zero pages; this transfer fails, the connection goes on.
                        let reason = e.to_string();
                        link.with_session(|s, now| {
                            s.placement_failed_with(
                                conn,
                                header,
                                ErrorCode::RegionTruncated,
                                &reason,
                                now,
                            )
                        });
                        continue;
                    }
                    let labels = [
                        ("peer", link.peer.clone()),
                        ("rail", rail_label.clone()),
                        ("transport", link.transport.to_string()),
                    ];
                    metrics::counter!(m::BYTES_RECEIVED, &labels).increment(u64::from(payload_len));
                    metrics::counter!(m::SLICES_RECEIVED, &labels).increment(1);
                    link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now));
                }
                SliceDisposition::Discard => {
                    debug!(peer = %link.peer, transfer = header.transfer_id, "discarding slice of an unknown or finished transfer");
                    reader.discard(u64::from(payload_len)).await?;
                }
            },
        }
    }
}

/// Reads a GPU region's slice into a pinned buffer and hands it to the
/// host-to-device queue; the slice is placed when that copy is done, while this
/// connection already reads the next one.
async fn receive_staged(
    link: &Arc<PeerLink>,
    conn: ConnId,
    header: kvrail_core::wire::SliceHeader,
    payload_len: u32,
    pieces: Vec<(u64, u64)>,
    g: &gpu::GpuMemory,
    reader: &mut dyn FrameReader,
) -> Result<(), TransportError> {
    let len = payload_len as usize;
    let mut buffer = match g.device.pool.take() {
        Ok(b) if b.len() >= len => b,
        taken => {
            let reason = match taken {
                Ok(b) => {
                    let size = b.len();
                    g.device.pool.give(b);
                    format!("slice of {len} bytes exceeds the {size}-byte staging buffers")
                }
                Err(e) => e.to_string(),
            };
            reader.discard(u64::from(payload_len)).await?;
            link.with_session(|s, now| s.placement_failed(conn, header, &reason, now));
            return Ok(());
        }
    };
    let read = reader
        .read_payload(&mut [std::io::IoSliceMut::new(&mut buffer.as_mut_slice()[..len])])
        .await;
    if let Err(e) = read {
        g.device.pool.give(buffer);
        link.with_session(|s, _| s.slice_abandoned(conn, header));
        return Err(e.into());
    }
    // The bytes are off the connection: its loss no longer concerns this slice.
    link.with_session(|s, _| s.slice_read(conn, header));
    match g
        .device
        .to_device
        .to_device(g.memory.clone(), &pieces, buffer)
    {
        Ok(copy) => {
            let link = link.clone();
            let device = g.device.clone();
            tokio::spawn(async move {
                let outcome = match copy.await {
                    Ok(CopyDone { buffer, result }) => {
                        device.pool.give(buffer);
                        result.map_err(|e| e.to_string())
                    }
                    Err(_) => Err("the copy queue stopped".to_string()),
                };
                match outcome {
                    Ok(()) => {
                        let rail = link.rail_of(conn);
                        let labels = [
                            ("peer", link.peer.clone()),
                            ("rail", rail.to_string()),
                            ("transport", link.transport.to_string()),
                        ];
                        metrics::counter!(m::BYTES_RECEIVED, &labels)
                            .increment(u64::from(payload_len));
                        metrics::counter!(m::SLICES_RECEIVED, &labels).increment(1);
                        metrics::counter!(m::GPU_STAGED_BYTES, "direction" => "to_device")
                            .increment(u64::from(payload_len));
                        link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now));
                    }
                    Err(reason) => {
                        warn!(peer = %link.peer, transfer = header.transfer_id, "GPU copy failed: {reason}");
                        metrics::counter!(m::GPU_COPY_FAILURES).increment(1);
                        link.with_session(|s, now| s.placement_failed(conn, header, &reason, now));
                    }
                }
                link.rearm_timer();
            });
        }
        Err((e, buffer)) => {
            g.device.pool.give(buffer);
            let reason = e.to_string();
            link.with_session(|s, now| s.placement_failed(conn, header, &reason, now));
        }
    }
    Ok(())
}

async fn timer_task(link: Weak<PeerLink>) {
    loop {
        let Some(l) = link.upgrade() else { return };
        let (deadline, closed) = {
            let st = l.lock();
            (st.session.poll_timeout(), st.closed)
        };
        if closed {
            return;
        }
        match deadline {
            Some(d) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(d)) => {
                        let probes = l.with_session(|s, now| {
                            s.handle_timeout(now);
                            std::iter::from_fn(|| s.poll_probe()).collect::<Vec<_>>()
                        });
                        for rail in probes {
                            tokio::spawn(probe_rail(l.clone(), rail));
                        }
                    }
                    _ = l.timer.notified() => {}
                }
            }
            None => l.timer.notified().await,
        }
    }
}

/// Rebuilds the connections of a down rail (outbound links only).
async fn probe_rail(link: Arc<PeerLink>, rail: RailId) {
    let (Some(shared), Some(dial)) = (link.shared.upgrade(), link.dial.as_ref()) else {
        return;
    };
    debug!(peer = %link.peer, rail, "probing rail");
    if let Err(e) = shared.dial_rail(&link, dial, rail, true).await {
        link.probe_failed(rail, &e.to_string());
    }
}

/// Dialer: rebuilds the queue pairs of `rail` after they failed, with backoff,
/// for as long as the rail's stream connections live and none is rebuilt.
async fn rebuild_queue_pairs(link: Arc<PeerLink>, rail: RailId) {
    {
        let mut st = link.lock();
        if !st.rdma_building.insert(rail) {
            return;
        }
    }
    let mut backoff = rdma::QP_RETRY_INITIAL;
    loop {
        tokio::time::sleep(backoff).await;
        let (closed, qps, stream) = {
            let st = link.lock();
            let conns = st.session.rail_connections(rail);
            let stream = conns.into_iter().find(|&c| {
                matches!(
                    st.conns.get(c).and_then(|h| h.writer.as_ref()),
                    Some(Sink::Stream(_))
                )
            });
            (st.closed, st.session.one_sided_connections(rail), stream)
        };
        // Done: closed, rebuilt, or the rail itself is down (its rebuild redoes RDMA).
        let Some(stream) = stream.filter(|_| !closed && qps == 0) else {
            break;
        };
        match link.setup_rdma(rail, stream).await {
            Ok(n) if n > 0 => {
                info!(peer = %link.peer, rail, qps = n, "RDMA queue pairs rebuilt");
                break;
            }
            Ok(_) => break,
            Err(e) => debug!(peer = %link.peer, rail, "RDMA queue pairs not rebuilt yet: {e}"),
        }
        backoff = (backoff * 2).min(rdma::QP_RETRY_MAX);
    }
    link.lock().rdma_building.remove(&rail);
}
