//! The link to one peer: the I/O shell around one core [`Session`]. `PeerLink`
//! composes the rooms below it and is the only type with methods here:
//!
//! - `conns`: the connections it holds (tasks, way in, slot and generation);
//! - `frames`: what a writer puts on the wire, and how a batch is written;
//! - `reader`, `writer`: a stream connection's two tasks, and `conn_thread`:
//!   the thread of its own they run on where the daemon asks for one;
//! - `gpu_staging`: GPU regions' slices through pinned host buffers;
//! - `queue_pairs`: an RDMA queue pair's task;
//! - `inline`: small frames written by the thread that made them;
//! - `timer`: the deadlines' wake-up, re-armed in one place;
//! - `owner`: what those tasks need from the link (`ConnOwner`), and `env`:
//!   what the link needs from the daemon (`LinkEnv`).
//!
//! The pump turns the session's transmits into socket writes, its rail
//! changes into closed connections and metrics, and its transfer events into
//! worker notifications. None of the rooms imports this file.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvrail_core::rail_setup::RebuildStep;
use kvrail_core::wire::{self, encode_control, encode_data_header, pb, Body, ErrorCode};
use kvrail_core::{ConnId, Event, RailChange, RailHealth, RailId, Session, Transmit};
use kvrail_transport::Connection;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tracing::{debug, info, warn};

use crate::held::HeldPayload;
use crate::metrics as m;
use crate::rdma;
use crate::rdma::OneSidedWork;

mod conn_thread;
mod conns;
mod env;
mod frames;
mod gpu_staging;
mod inline;
mod owner;
mod queue_pairs;
mod reader;
mod timer;
mod writer;

use conn_thread::OwnThread;
pub use conns::ConnKey;
use conns::{conn_bit, ConnHandle, Sink};
pub use env::{DialInfo, LinkEnv, ProbeFuture};
use frames::{EncodedOpen, Outgoing};
pub use inline::set_inline_writes_on_this_thread;
use inline::StreamSink;
use owner::ConnOwner;
use queue_pairs::qp_task;
pub use queue_pairs::RdmaSetupError;
use reader::reader_task;
use timer::{Deadlines, Locked, Timer};
use writer::writer_task;

/// The daemon, as the links it owns see it.
pub type Env = dyn LinkEnv<Link = PeerLink>;

/// Frames a connection's writer may have queued and not written before its
/// peer counts as not reading (see `cut_unread_connections`). Twice what the
/// largest window lets a working connection queue (128 MiB of 4 KiB
/// slices), with their opens and acknowledgements.
const MAX_UNWRITTEN_FRAMES: u64 = 1 << 16;

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
    qp_setups: kvrail_core::qp_setup::QpSetups,
    /// Acceptor: the queue-pair setups taken per rail (a late request is
    /// declined).
    qp_acceptor: kvrail_core::qp_setup::QpAcceptor,
    /// Who waits for each queue-pair setup's outcome, by nonce.
    qp_waiters: HashMap<u64, oneshot::Sender<kvrail_core::qp_setup::SetupOutcome>>,
    /// Rails whose queue pairs are being (re)built right now.
    rdma_building: HashSet<RailId>,
    /// The deadline the timer task sleeps until (None: until nudged).
    timer_armed: Option<Instant>,
}

impl Deadlines for LinkState {
    /// The session's and the queue-pair setups' next deadline.
    fn next_deadline(&self) -> Option<Instant> {
        let session = self.session.poll_timeout();
        let setups = self.qp_setups.poll_timeout();
        session.into_iter().chain(setups).min()
    }

    fn armed(&self) -> Option<Instant> {
        self.timer_armed
    }

    fn closed(&self) -> bool {
        self.closed
    }
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
    timer: Timer,
    env: Weak<Env>,
    me: Weak<PeerLink>,
    /// Payload of this link's sending transfers still queued or held by a writer.
    held: HeldPayload,
    /// When the session began (which idle session gives way first).
    pub created: Instant,
    /// Inbound links: the incarnation of the dialing process (0: not sent),
    /// so a restarted peer's new sessions replace its old ones.
    pub dialer_incarnation: std::sync::atomic::AtomicU64,
    /// How long a reader waits for the rest of a slice whose header it read
    /// (the session's progress timeout): a peer that stops mid-payload and
    /// keeps its connection open has its connection cut, so the slice is
    /// abandoned and its transfer fails or goes on elsewhere, instead of
    /// being held as "being placed" forever.
    payload_deadline: Duration,
}

impl ConnOwner for PeerLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn transport(&self) -> &'static str {
        self.transport
    }

    fn env(&self) -> Option<Arc<Env>> {
        self.env.upgrade()
    }

    fn payload_deadline(&self) -> Duration {
        self.payload_deadline
    }

    fn with_session<R>(&self, f: impl FnOnce(&mut Session, Instant) -> R) -> R {
        PeerLink::with_session(self, f)
    }

    fn with_session_from<R>(
        &self,
        key: ConnKey,
        f: impl FnOnce(&mut Session, Option<ConnId>, Instant) -> R,
    ) -> R {
        PeerLink::with_session_from(self, key, f)
    }

    fn connection_failed(&self, key: ConnKey, reason: &str) {
        PeerLink::connection_failed(self, key, reason)
    }

    fn rail_of(&self, conn: ConnId) -> RailId {
        PeerLink::rail_of(self, conn)
    }

    fn on_rdma_connect(self: &Arc<Self>, conn: ConnId, req: pb::RdmaConnect) {
        PeerLink::on_rdma_connect(self, conn, req)
    }

    fn on_rdma_accept(&self, accept: pb::RdmaAccept) {
        PeerLink::on_rdma_accept(self, accept)
    }
}

/// How often the estimated-throughput gauges are refreshed.
const GAUGE_PERIOD: Duration = Duration::from_millis(250);

impl PeerLink {
    pub fn new(
        peer: &str,
        transport: &'static str,
        env: Weak<Env>,
        session: kvrail_core::SessionConfig,
        dial: Option<DialInfo>,
    ) -> Arc<Self> {
        let link = Arc::new_cyclic(|me| Self {
            peer: peer.to_string(),
            transport,
            direction: if dial.is_some() { "out" } else { "in" },
            created: Instant::now(),
            dialer_incarnation: Default::default(),
            payload_deadline: session.progress_timeout,
            state: Mutex::new(LinkState {
                session: Session::new(session),
                conns: Vec::new(),
                closed: false,
                closed_because: String::new(),
                next_generation: 0,
                gauges_at: None,
                gauged_rails: 0,
                qp_setups: Default::default(),
                qp_acceptor: Default::default(),
                qp_waiters: HashMap::new(),
                rdma_building: HashSet::new(),
                timer_armed: None,
            }),
            dial,
            timer: Timer::default(),
            env,
            me: me.clone(),
            held: HeldPayload::default(),
        });
        tokio::spawn(timer_task(Arc::downgrade(&link)));
        link
    }

    /// The link's state, locked; releasing it after a change re-arms the
    /// timer where the change needs it (see `timer`).
    fn lock(&self) -> Locked<'_, LinkState> {
        #[cfg(feature = "profile")]
        let _wait = crate::profile::LockWait::start();
        // A panic while holding the lock is a bug; keep serving with the state as is.
        Locked::new(
            self.state.lock().unwrap_or_else(|e| e.into_inner()),
            &self.timer,
        )
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
        let (failed, carrying, stall) = {
            let mut st = self.lock();
            // With their generations: a slot reused later is not this connection.
            let carrying: Vec<(ConnId, u64)> = st
                .session
                .connections_carrying(&naming)
                .into_iter()
                .filter_map(|c| st.conns.get(c).map(|h| (c, h.generation)))
                .collect();
            let stall = st.session.config().rails.stall_timeout;
            let failed = st
                .session
                .blocks_released(region_id, blocks, why, Instant::now());
            self.pump(&mut st);
            (failed, carrying, stall)
        };
        let deadline = tokio::time::Instant::now() + limit;
        // A writer holds a view only while its write is in the kernel's hands;
        // one still holding it after the stall limit (or half the worker's
        // wait, if shorter) writes to a peer that does not read (stopped, or
        // its window shut). Nothing of the failed transfer may be sent any
        // more, and the frame cannot be cut short, so those connections go
        // (the session re-plans what else they carried).
        let cut_at = tokio::time::Instant::now() + stall.min(limit / 2);
        let mut cut = false;
        for v in views {
            loop {
                let until = if cut { deadline } else { cut_at };
                let left = until.saturating_duration_since(tokio::time::Instant::now());
                if v.released(left).await {
                    break;
                }
                if cut || tokio::time::Instant::now() >= deadline {
                    return (failed.len(), false);
                }
                cut = true;
                self.cut_stuck_connections(&carrying);
                // The aborts may have been queued behind the stuck writes.
                self.with_session(|s, _| s.abort_again(&failed, ErrorCode::BlocksReleased, why));
            }
        }
        // A slice being placed finishes within one memcpy of a slice, if its
        // peer sends it; there is no event for it, so look again shortly. A
        // peer that trickles it past the writers' grace has the connection
        // reading it cut (the slice, and any byte after it, never lands).
        while self.inspect(|s| s.still_placing(&failed)) {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return (failed.len(), false);
            }
            // On every look: a connection between two reads of the slice
            // (staging, a chunk boundary) shows no payload read at that moment.
            if now >= cut_at {
                self.cut_reading_connections(&failed);
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        (failed.len(), true)
    }

    /// Stops the connections reading a payload of one of `transfers` now
    /// (see `release_blocks`).
    fn cut_reading_connections(&self, transfers: &[u64]) {
        use std::sync::atomic::Ordering;
        let keys: Vec<ConnKey> = {
            let st = self.lock();
            st.conns
                .iter()
                .enumerate()
                .filter(|(_, h)| {
                    h.reading.as_ref().is_some_and(|r| {
                        let now = r.load(Ordering::Acquire);
                        now != 0 && transfers.contains(&(now - 1))
                    })
                })
                .map(|(c, h)| (c, h.generation))
                .collect()
        };
        for key in keys {
            self.connection_failed(
                key,
                "the peer did not finish a slice into blocks its worker released (cut)",
            );
        }
    }

    /// Stops connections whose writers hold a released transfer's payload in a
    /// write the peer does not drain (see `release_blocks`).
    fn cut_stuck_connections(&self, conns: &[(ConnId, u64)]) {
        for &key in conns {
            self.connection_failed(
                key,
                "a write of released blocks did not drain (the peer is not reading)",
            );
        }
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
    fn deliver(&self, env: &Arc<Env>, ev: Event) {
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
            env.on_event(&self.peer, ev);
            return;
        };
        let (env, peer) = (env.clone(), self.peer.clone());
        tokio::spawn(async move {
            if !views.released(HELD_PAYLOAD_LIMIT).await {
                warn!(%peer, "a writer still holds a finished transfer's payload; telling the worker anyway");
            }
            env.on_event(&peer, ev);
        });
    }

    /// As [`PeerLink::with_session`], for what connection `key` read: `f` is
    /// given its slot, or None if the slot has gone to another connection since.
    fn with_session_from<R>(
        &self,
        (conn, generation): ConnKey,
        f: impl FnOnce(&mut Session, Option<ConnId>, Instant) -> R,
    ) -> R {
        let mut st = self.lock();
        let ours = st
            .conns
            .get(conn)
            .is_some_and(|h| h.generation == generation);
        let r = f(&mut st.session, ours.then_some(conn), Instant::now());
        self.pump(&mut st);
        r
    }

    /// Sends what the session queued and reports its events (after every
    /// call into the session, in its lock).
    fn pump(&self, st: &mut LinkState) {
        let Some(env) = self.env.upgrade() else {
            return;
        };
        // A pass that cut connections moves what they held to the others.
        while self.transmit(&env, st) {}
        self.deliver_events(&env, st);
        self.refresh_gauges(st);
    }

    /// One pass of the session's transmits onto the connections; true if it
    /// cut connections whose peer does not read (another pass is due).
    fn transmit(&self, env: &Arc<Env>, st: &mut LinkState) -> bool {
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
        // Ends first: a receiver's worker hears of its data before the
        // acknowledgement to the sender is written (an inline write of it
        // is a system call: handing the ends to the daemon after the lock
        // instead cost 4 KiB ring pushes 6-7 us at p50, see benchmarks.md).
        self.deliver_events(env, st);
        // Each connection's frames are gathered and handed to its sink in
        // one batch; the sink writes them inline or queues them for its
        // writer task, as the caller's context allows (see `inline`).
        let writes = inline::Writes::here(env.inline_control_writes());
        let mut batches: Vec<(ConnId, Vec<Outgoing>)> = Vec::new();
        // Connections handed frames here: only their queues can have grown.
        let mut queued_to = 0u64;
        // A striped push's open is encoded once, not once per connection
        // (its block lists: microseconds for a 1 MiB push of 4 KiB blocks).
        let mut last_open = EncodedOpen::default();
        crate::trace_points::mark(crate::trace_points::PUMP_TRANSMIT);
        while let Some(t) = st.session.poll_transmit(now) {
            if let Transmit::Slice {
                conn,
                retransmit: true,
                ..
            } = &t
            {
                let rail = st.conns.get(*conn).map_or(0, |c| c.rail);
                m::rail_slices_retransmitted(&self.peer, rail).increment(1);
            }
            let (conn, out) = match t {
                Transmit::Control { conn, msg } => (conn, Outgoing::Control(last_open.encode(msg))),
                Transmit::Slice {
                    conn,
                    header,
                    len,
                    region_id,
                    pieces,
                    remote,
                    ..
                } => {
                    let Some(region) = env.registry().get(region_id) else {
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
            match batches.iter_mut().find(|(c, _)| *c == conn) {
                Some((_, frames)) => frames.push(out),
                None => batches.push((conn, vec![out])),
            }
        }
        crate::trace_points::mark(crate::trace_points::PUMP_GATHERED);
        for (conn, frames) in batches {
            if let Some(Sink::Stream(sink)) = st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
                queued_to |= conn_bit(conn);
                sink.send(frames, writes);
            }
        }
        queued_to != 0 && self.cut_unread_connections(st, queued_to, now)
    }

    /// The per-rail gauges: periodically, and at once when a rail appears.
    fn refresh_gauges(&self, st: &mut LinkState) {
        let now = Instant::now();
        let rails = st.session.rail_count();
        if rails != st.gauged_rails
            || st
                .gauges_at
                .is_none_or(|t| now.duration_since(t) >= GAUGE_PERIOD)
        {
            st.gauges_at = Some(now);
            st.gauged_rails = rails;
            for r in st.session.rail_stats() {
                m::rail_throughput(&self.peer, r.rail, self.direction)
                    .set(r.rate_bytes_per_sec.unwrap_or(0.0));
                m::rail_state(&self.peer, r.rail, self.direction).set(r.health.gauge());
            }
        }
    }

    fn deliver_events(&self, env: &Arc<Env>, st: &mut LinkState) {
        while let Some(ev) = st.session.poll_event() {
            match ev {
                Event::Rail(change) => self.on_rail_change(st, change),
                ev => self.deliver(env, ev),
            }
        }
    }

    /// Logs and counts a rail change; a rail gone down loses its connections.
    fn on_rail_change(&self, st: &mut LinkState, c: RailChange) {
        m::rail_state(&self.peer, c.rail, self.direction).set(c.to.gauge());
        m::rail_transitions(&self.peer, c.rail, c.from.as_str(), c.to.as_str()).increment(1);
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

    /// Cuts the connections whose peer has stopped reading while it keeps
    /// sending (each ping, empty slice or repeated open queues a reply that
    /// its writer cannot write): their queues would grow without bound.
    /// True if any was cut.
    fn cut_unread_connections(&self, st: &mut LinkState, queued_to: u64, now: Instant) -> bool {
        let unread: Vec<ConnId> = st
            .conns
            .iter()
            .enumerate()
            .filter(|&(conn, _)| queued_to & conn_bit(conn) != 0)
            .filter(|(_, c)| match c.writer.as_ref() {
                Some(Sink::Stream(sink)) => sink.unwritten() > MAX_UNWRITTEN_FRAMES,
                _ => false,
            })
            .map(|(conn, _)| conn)
            .collect();
        for &conn in &unread {
            let reason = format!(
                "cut: the peer does not read what it asks for ({MAX_UNWRITTEN_FRAMES} frames unwritten)"
            );
            self.lose_connection(st, conn, &reason, now);
        }
        !unread.is_empty()
    }

    /// Stops a connection's tasks, says why, counts it, and tells the
    /// session (which moves what it carried elsewhere on the next pump).
    fn lose_connection(&self, st: &mut LinkState, conn: ConnId, reason: &str, now: Instant) {
        let (rail, queue_pair) = st.conns.get(conn).map_or((0, false), |c| {
            (c.rail, matches!(c.writer, Some(Sink::QueuePair(_))))
        });
        self.stop_connections(st, [conn]);
        warn!(peer = %self.peer, conn, rail, queue_pair, "peer connection lost: {reason}");
        m::connections_lost(&self.peer, rail).increment(1);
        st.session.connection_lost(conn, reason, now);
    }

    /// Stops the tasks of these connections (those still running) and counts them gone.
    fn stop_connections(&self, st: &mut LinkState, conns: impl IntoIterator<Item = ConnId>) {
        for conn in conns {
            if st.conns.get_mut(conn).is_some_and(ConnHandle::stop) {
                m::peer_connections(&self.peer).decrement(1.0);
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
    }

    /// Rebuilding `rail` failed; the session backs off before the next probe.
    pub fn probe_failed(&self, rail: RailId, reason: &str) {
        m::rail_probes_failed(&self.peer, rail).increment(1);
        debug!(peer = %self.peer, rail, "probe failed: {reason}");
        self.with_session(|s, now| s.probe_failed(rail, reason, now));
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
        self.live_generation(conn).is_some()
    }

    /// The generation of connection `conn` while it is open.
    fn live_generation(&self, conn: ConnId) -> Option<u64> {
        let st = self.lock();
        st.conns
            .get(conn)
            .filter(|h| h.writer.is_some())
            .map(|h| h.generation)
    }

    /// Adds a handshaken connection on `rail` and starts its tasks.
    pub fn attach(self: &Arc<Self>, mut conn: Connection, rail: RailId) -> Option<ConnId> {
        // TCP alone can move (QUIC's connections share their endpoint's task).
        let own_thread = (self.transport == "tcp"
            && self
                .env
                .upgrade()
                .is_some_and(|env| env.connection_threads()))
        .then(|| OwnThread::start_for(&mut conn, &self.peer))
        .flatten();
        self.install(rail, false, |key| {
            let (tx, rx) = mpsc::unbounded_channel();
            let inline = conn.writer.inline_writer();
            let counters = m::ConnCounters::new(&self.peer, rail, self.transport);
            let sink = StreamSink {
                tx,
                queued: Arc::default(),
                inline_writes: inline
                    .as_ref()
                    .map(|_| m::ConnCounters::inline_writes(&self.peer, rail, self.transport)),
                inline,
                counters: counters.clone(),
            };
            let queued = sink.queued.clone();
            let reading = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let reader = reader_task(
                self.clone(),
                key,
                counters.clone(),
                conn.reader,
                reading.clone(),
                queued.clone(),
            );
            let writer = writer_task(self.clone(), key, counters, conn.writer, rx, queued);
            let (reader, writer) = match own_thread {
                Some(thread) => thread.run(reader, writer),
                None => (
                    tokio::spawn(reader).abort_handle(),
                    tokio::spawn(writer).abort_handle(),
                ),
            };
            (Sink::Stream(sink), Some((reader, reading)), writer)
        })
    }

    /// Adds a connection to the session (a queue pair if `one_sided`), starts its
    /// tasks with `start` (given the connection's key) and keeps their handles.
    fn install(
        &self,
        rail: RailId,
        one_sided: bool,
        start: impl FnOnce(
            ConnKey,
        ) -> (
            Sink,
            Option<(AbortHandle, Arc<std::sync::atomic::AtomicU64>)>,
            AbortHandle,
        ),
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
        let (reader, reading) = reader.unzip();
        let handle = ConnHandle {
            writer: Some(sink),
            reader,
            reading,
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
        m::peer_connections(&self.peer).increment(1.0);
        self.pump(&mut st);
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
        self.lose_connection(&mut st, conn, reason, Instant::now());
        self.pump(&mut st);
        let rebuild = queue_pair && self.dial.is_some() && !st.closed;
        drop(st);
        if rebuild {
            self.spawn_rdma_rebuild(rail);
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
            // The timer stops with the link: queue-pair setups still waiting
            // end now ("the link closed during setup"), not at a deadline.
            st.qp_waiters.clear();
            st.qp_setups = Default::default();
            st.conns
                .iter()
                .enumerate()
                .map(|(i, h)| (i, h.generation))
                .collect()
        };
        for h in handles {
            self.connection_failed(h, reason);
        }
    }
}

/// Longest a transfer's end waits for its payload to be let go: quinn keeps
/// views until they are acknowledged or its connection is dropped, which the
/// rail-stall timers bound well below this.
const HELD_PAYLOAD_LIMIT: Duration = Duration::from_secs(30);

async fn timer_task(link: Weak<PeerLink>) {
    loop {
        let Some(l) = link.upgrade() else { return };
        let (deadline, closed) = {
            let mut st = l.lock();
            let deadline = st.next_deadline();
            st.timer_armed = deadline;
            (deadline, st.closed)
        };
        if closed {
            return;
        }
        if l.timer.sleep_until(deadline).await {
            let probes = l.with_session(|s, now| {
                s.handle_timeout(now);
                std::iter::from_fn(|| s.poll_probe()).collect::<Vec<_>>()
            });
            l.qp_setups_timed_out();
            for rail in probes {
                tokio::spawn(probe_rail(l.clone(), rail));
            }
        }
    }
}

/// Rebuilds the connections of a down rail (outbound links only).
async fn probe_rail(link: Arc<PeerLink>, rail: RailId) {
    let (Some(env), Some(dial)) = (link.env.upgrade(), link.dial.clone()) else {
        return;
    };
    debug!(peer = %link.peer, rail, "probing rail");
    if let Err(e) = env.probe_rail(link.clone(), dial, rail).await {
        link.probe_failed(rail, &e);
    }
}

// Queue pairs: set up over a rail's stream connection (RdmaConnect /
// RdmaAccept), and rebuilt after they failed.

impl PeerLink {
    /// Rebuilds `rail`'s queue pairs in the background (dialer side).
    pub fn spawn_rdma_rebuild(&self, rail: RailId) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(rebuild_queue_pairs(me, rail));
        }
    }

    /// The registration of a local region on a rail's RDMA device.
    pub fn rdma_mr(&self, region_id: u64, rail: RailId) -> Option<Arc<kvrail_verbs::MemoryRegion>> {
        self.env.upgrade()?.rdma().mr(region_id, rail)
    }

    /// Queues a driver-level control message on one connection. A peer that
    /// keeps asking (queue-pair requests are answered on the connection they
    /// came on) without reading the answers has that connection cut, by the
    /// same rule as what the session queues (`cut_unread_connections`).
    pub(super) fn send_control(&self, conn: ConnId, body: Body) -> bool {
        let mut st = self.lock();
        let queued = match st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
            Some(Sink::Stream(sink)) => sink.queue(Outgoing::Control(
                encode_control(&wire::message(body)).into(),
            )),
            _ => false,
        };
        if self.cut_unread_connections(&mut st, conn_bit(conn), Instant::now()) {
            self.pump(&mut st);
            return false;
        }
        queued
    }

    /// Adds a connected queue pair on `rail` as a one-sided connection.
    pub fn attach_qp(
        self: &Arc<Self>,
        qp: kvrail_verbs::QueuePair,
        rail: RailId,
    ) -> Option<ConnId> {
        let busy_poll = self.env.upgrade()?.rdma().busy_poll;
        self.install(rail, true, |key| {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(qp_task(self.clone(), key, rail, qp, rx, busy_poll));
            (Sink::QueuePair(tx), None, task.abort_handle())
        })
    }

    /// Dialer: sets up `qps_per_rail` queue pairs on `rail` over its stream
    /// connection `conn`. Ok(n) with the number attached.
    pub async fn setup_rdma(
        self: &Arc<Self>,
        rail: RailId,
        conn: ConnId,
    ) -> Result<usize, RdmaSetupError> {
        let env = self.env.upgrade().ok_or("daemon is shutting down")?;
        {
            let mut st = self.lock();
            st.qp_setups.begin(rail)?;
        }
        let _claim = RailClaim {
            link: self,
            rail,
            give_back: |st, rail| st.qp_setups.end(rail),
        };
        let generation = self
            .live_generation(conn)
            .ok_or("the rail's connection closed before setup")?;
        let count = env.rdma().qps_per_rail;
        let mut qps = rdma::create_qps(env.rdma(), rail, count)?;
        let endpoints = qps
            .iter()
            .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let nonce: u64 = rand::random();
        let (tx, rx) = oneshot::channel();
        let request = {
            let mut st = self.lock();
            if st.closed {
                // Its timer is gone: nothing would end the wait.
                return Err("the link closed before setup".into());
            }
            st.qp_waiters.insert(nonce, tx);
            st.qp_setups.start(rail, nonce, endpoints, Instant::now())
        };
        if !self.send_control(conn, Body::RdmaConnect(request)) {
            let mut st = self.lock();
            st.qp_setups.abandon(nonce);
            st.qp_waiters.remove(&nonce);
            return Err("the rail's connection closed before setup".into());
        }
        // The link's timer ends the setup at its deadline (QpSetups), so this
        // always gets an outcome unless the link itself goes away.
        let outcome = rx
            .await
            .map_err(|_| "the link closed during setup".to_string())?;
        let accept_qps = outcome.result?;
        // A rail retired meanwhile took the acceptor's side of these queue
        // pairs with it: attaching ours would revive the rail with queue
        // pairs that reach nothing.
        if self.live_generation(conn) != Some(generation) {
            return Err("the rail's connection closed during setup".into());
        }
        for (qp, remote) in qps.iter_mut().zip(&accept_qps) {
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
    pub(super) fn on_rdma_connect(self: &Arc<Self>, conn: ConnId, req: pb::RdmaConnect) {
        let Some(env) = self.env.upgrade() else {
            return;
        };
        let checked = {
            let mut st = self.lock();
            let rail = st.session.connection_rail(conn);
            st.qp_acceptor.take(&req, rail).map_err(|e| e.to_string())
        };
        // The rail's request is answered however this ends.
        let _taken = checked.is_ok().then_some(RailClaim {
            link: self,
            rail: req.rail_index,
            give_back: |st, rail| st.qp_acceptor.done(rail),
        });
        if checked.is_ok() {
            // The dialer replaces its queue pairs on this rail: ours are stale.
            // (Only a request the check accepted, for the rail it came on.)
            let mut st = self.lock();
            let stale = st.session.retire_one_sided_connections(req.rail_index);
            self.stop_connections(&mut st, stale);
            self.pump(&mut st);
        }
        let result = checked.and_then(|()| rdma::accept_qps(env.rdma(), req.rail_index, &req));
        let outcome = result.and_then(|qps| {
            let endpoints = qps
                .iter()
                .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let asked = qps.len();
            let attached = qps
                .into_iter()
                .filter_map(|qp| self.attach_qp(qp, req.rail_index))
                .count();
            if attached < asked {
                // The dialer drops its side on our refusal: the ones we kept
                // would reach nothing.
                let mut st = self.lock();
                let kept = st.session.retire_one_sided_connections(req.rail_index);
                self.stop_connections(&mut st, kept);
                self.pump(&mut st);
                return Err(format!(
                    "only {attached} of {asked} queue pairs could be attached (session closed or full)"
                ));
            }
            info!(peer = %self.peer, rail = req.rail_index, qps = endpoints.len(), "RDMA queue pairs connected");
            Ok(endpoints)
        });
        if let Err(e) = &outcome {
            // The peer decides how often this happens: rate limited.
            if let Some(suppressed) = QP_DECLINE_LOG.admit() {
                info!(peer = %self.peer, rail = req.rail_index, suppressed, "declined RDMA queue pairs: {e}");
            }
        }
        let answer = kvrail_core::qp_setup::answer(req.nonce, outcome);
        self.send_control(conn, Body::RdmaAccept(answer));
    }

    /// Whether a queue-pair setup of `rail` is under way (dialer).
    pub fn rdma_setup_under_way(&self, rail: RailId) -> bool {
        self.lock().qp_setups.is_busy(rail)
    }

    pub(super) fn on_rdma_accept(&self, accept: pb::RdmaAccept) {
        let mut st = self.lock();
        // An answer to no setup of ours (late or made up) is ignored.
        if let Some(outcome) = st.qp_setups.on_accept(accept) {
            if let Some(tx) = st.qp_waiters.remove(&outcome.nonce) {
                let _ = tx.send(outcome);
            }
        }
    }

    /// Ends the setups whose answer did not come in time.
    pub(super) fn qp_setups_timed_out(&self) {
        let mut st = self.lock();
        for outcome in st.qp_setups.handle_timeout(Instant::now()) {
            if let Some(tx) = st.qp_waiters.remove(&outcome.nonce) {
                let _ = tx.send(outcome);
            }
        }
    }
}

/// Declined queue-pair requests logged, at most a few a second.
static QP_DECLINE_LOG: std::sync::LazyLock<kvrail_transport::ratelog::RateLimitedLog> =
    std::sync::LazyLock::new(|| kvrail_transport::ratelog::RateLimitedLog::new(5));

/// A rail's claim for one queue-pair setup, given back however the setup
/// ends: the dialer's (`QpSetups::begin`/`end`) or the acceptor's
/// (`QpAcceptor::take`/`done`).
struct RailClaim<'a> {
    link: &'a PeerLink,
    rail: RailId,
    give_back: fn(&mut LinkState, RailId),
}

impl Drop for RailClaim<'_> {
    fn drop(&mut self) {
        (self.give_back)(&mut self.link.lock(), self.rail);
    }
}

/// Dialer: rebuilds the queue pairs of `rail` after they failed, with backoff,
/// for as long as the rail's stream connections live and none is rebuilt.
pub(super) async fn rebuild_queue_pairs(link: Arc<PeerLink>, rail: RailId) {
    {
        let mut st = link.lock();
        if !st.rdma_building.insert(rail) {
            return;
        }
    }
    let mut rebuild = kvrail_core::rail_setup::QpRebuild::default();
    loop {
        tokio::time::sleep(rebuild.wait()).await;
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
        let RebuildStep::Try(stream) = rebuild.look(closed, qps, stream) else {
            break;
        };
        let outcome = link.setup_rdma(rail, stream).await;
        match &outcome {
            Ok(n) if *n > 0 => info!(peer = %link.peer, rail, qps = n, "RDMA queue pairs rebuilt"),
            Ok(_) => {}
            Err(e) => debug!(peer = %link.peer, rail, "RDMA queue pairs not rebuilt yet: {e}"),
        }
        if rebuild.attempted(outcome.map_err(|_| ())) {
            break;
        }
    }
    link.lock().rdma_building.remove(&rail);
}
