//! One peer session: the connections (over one or more rails) between two sidecars,
//! and every transfer travelling over them, in both directions.
//!
//! Slices are striped over the rails by estimated delivery rate and outstanding
//! bytes ([`crate::rail`]); a rail that stalls or loses its connections goes down,
//! its unacknowledged slices are re-sent on the survivors, and the dialing side
//! probes it back. Transfers fail only once every rail has been down past the
//! deadline.
//!
//! Sans-IO: the driver feeds it control messages, slice headers and `now`, and drains
//! [`Transmit`]s (what to write on which connection) and [`Event`]s (what to tell
//! workers). It never touches sockets, memory or clocks.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::budget::{transfer_bytes, MemoryBudget, DEFAULT_PEER_TRANSFER_BYTES};
use crate::error::{PlanError, TransferError};
use crate::geometry::{HeadSlice, KvGeometry};
use crate::layout::RegionLayout;
use crate::placement::{Admitted, OwnedGate, PlacementGate};
use crate::plan::{Access, BlockSelection, Plan};
use crate::rail::{Rail, RailConfig, RailHealth, RailId, RailSignal, RailStats};
use crate::rangeset::RangeSet;
use crate::transfer::{InvalidTransition, TransferEvent, TransferState};
use crate::wire::{pb, Body, ErrorCode, PeerMessage, SliceHeader};

/// Index of a connection inside its session.
pub type ConnId = usize;
/// Most connections one session may hold (they are tracked in a bit mask).
pub const MAX_CONNECTIONS: usize = 64;

/// The slowest rate a reader of a pull served by granting is assumed to
/// move bytes at (see `Session::progress_deadline`): 10 MB/s, far below
/// any RDMA rail, Soft-RoCE included.
pub const PASSIVE_SERVE_FLOOR_BYTES_PER_SEC: u64 = 10_000_000;

/// Transfers a session may hold open at once, each way together: far more
/// than layer-wise streaming keeps in flight (layers x requests), few
/// enough that a peer cannot open transfers until memory runs out.
pub const MAX_TRANSFERS: usize = 1 << 16;
/// Plan segments (contiguous runs of a transfer's blocks) a session may hold
/// at once, about 24 bytes each: one transfer may have up to
/// `plan::MAX_PIECES_PER_TRANSFER`, a session sixteen times that.
pub const MAX_SEGMENTS_HELD: u64 = 1 << 26;

/// Separate placed ranges a receiving transfer may have at least (slices
/// arrived out of order leave gaps); see [`max_placed_ranges`].
pub const MAX_PLACED_RANGES: usize = 1 << 17;

/// Separate placed ranges a transfer of `total` bytes may have: a range is
/// at least one slice, and slices are at least 4 KiB but for the rest of a
/// gap, so a sender keeps under `total / 2048`; a peer sending tiny slices
/// with gaps between them does not (its record would grow with the size).
pub fn max_placed_ranges(total: u64) -> u64 {
    (MAX_PLACED_RANGES as u64).max(total / 2048)
}

/// Default of [`SessionConfig::eager_max_bytes`].
pub const DEFAULT_EAGER_MAX_BYTES: u64 = 64 << 10;

/// Tunables of a session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Largest slice put on a connection at once.
    pub slice_bytes: u64,
    /// Unacknowledged bytes allowed per connection before the scheduler looks elsewhere.
    pub window_bytes: u64,
    /// A transfer that moves no byte for this long fails with a timeout.
    pub progress_timeout: Duration,
    /// Rail striping, health and failover.
    pub rails: RailConfig,
    /// Whether this side rebuilds down rails (the side that dialed the session).
    pub probes_rails: bool,
    /// Transfers of at most this many bytes skip the one-sided grant even
    /// where queue pairs are up: their bytes travel as two-sided slices
    /// behind the open, one flight, where a grant costs a round trip before
    /// the first write (longer than a small transfer's time on the wire).
    pub eager_max_bytes: u64,
    /// A host transfer that one slice per connection of its rail would
    /// carry is cut into that many slices, each at least this large, so that
    /// its connections move it together (where each connection has a thread
    /// of its own to write and read with). A transfer of at most this many
    /// bytes stays one slice; 0: off (slices of `slice_bytes`).
    pub spread_min_slice_bytes: u64,
    /// Largest slice of a transfer whose local memory is staged (GPU memory
    /// copied through pinned host buffers, `LocalTransfer::staged`,
    /// `RegionAccess::staged`). Each staged slice costs device copy calls
    /// that the driver serialises (~60 us for a 1 MiB slice of 32 pieces,
    /// docs/gpu.md), so these slices are larger; the receiving side's
    /// staging buffers must hold them.
    pub staged_slice_bytes: u64,
    /// Memory the open transfers of every session with this peer may hold
    /// together (block ids, generations, plans, queued opens:
    /// [`crate::budget`])...
    pub peer_budget: Arc<MemoryBudget>,
    /// ...and the budget every session of the node draws from together.
    pub node_budget: Arc<MemoryBudget>,
}

/// Default of [`SessionConfig::staged_slice_bytes`].
pub const DEFAULT_STAGED_SLICE_BYTES: u64 = 4 << 20;

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            slice_bytes: 1 << 20,
            window_bytes: 8 << 20,
            progress_timeout: Duration::from_secs(10),
            rails: RailConfig::default(),
            probes_rails: true,
            eager_max_bytes: DEFAULT_EAGER_MAX_BYTES,
            spread_min_slice_bytes: 0,
            staged_slice_bytes: DEFAULT_STAGED_SLICE_BYTES,
            peer_budget: Arc::new(MemoryBudget::new(DEFAULT_PEER_TRANSFER_BYTES)),
            node_budget: Arc::default(),
        }
    }
}

/// What this side needs to know about its own regions to accept a peer's request.
pub trait RegionDirectory {
    /// The layout of a registered region and whether peers may read it.
    fn lookup(&self, region_id: u64) -> Option<RegionAccess>;

    /// Whether every block the selection names is still at the generation it
    /// names (a block the worker released has moved on); the reason if not.
    /// Called before any byte of a peer's request moves.
    fn check_generations(&self, _selection: &BlockSelection) -> Result<(), String> {
        Ok(())
    }
}

/// A region as the session sees it.
#[derive(Debug, Clone)]
pub struct RegionAccess {
    pub layout: RegionLayout,
    pub exposed: bool,
    /// Where peers may reach the region one-sided (RDMA), per rail; empty if nowhere.
    pub keys: Vec<pb::MemoryKey>,
    /// Its bytes go through staging buffers (GPU memory): a pull this side
    /// serves from it is cut into `SessionConfig::staged_slice_bytes` slices.
    pub staged: bool,
    /// What its blocks hold, when the worker said (head-sliced transfers and
    /// the compatibility check need it).
    pub geometry: Option<Arc<KvGeometry>>,
}

/// The peer's answer to a one-sided transfer: where its blocks are, per rail.
#[derive(Debug, Clone)]
struct RemoteGrant {
    /// The peer's side of the transfer: logical offset to peer region offsets.
    plan: Plan,
    keys: Vec<pb::MemoryKey>,
}

/// What a one-sided slice does at the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneSidedOp {
    /// Write our pieces into the peer's (push).
    Write,
    /// Read the peer's pieces into ours (pull).
    Read,
}

/// The peer's half of a one-sided slice: its key on the slice's rail and the
/// (offset, len) ranges of its region, in the same logical order as ours.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSlice {
    pub op: OneSidedOp,
    pub key: pb::MemoryKey,
    pub pieces: Vec<(u64, u64)>,
}

/// What a transfer is from this side's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferKind {
    /// We write our blocks into the peer (started here).
    Push,
    /// The peer writes into our blocks (started there).
    PushReceive,
    /// We read the peer's blocks (started here).
    Pull,
    /// The peer reads our blocks (started there).
    PullServe,
}

impl TransferKind {
    /// Whether this side reads its region and sends the bytes.
    pub fn sends_data(self) -> bool {
        matches!(self, TransferKind::Push | TransferKind::PullServe)
    }
}

/// Something the driver must write.
#[derive(Debug, Clone, PartialEq)]
pub enum Transmit {
    /// A control message.
    Control { conn: ConnId, msg: PeerMessage },
    /// A data slice: gather `pieces` (offset, len) of local region `region_id`.
    Slice {
        conn: ConnId,
        header: SliceHeader,
        len: u32,
        region_id: u64,
        pieces: Vec<(u64, u64)>,
        /// Re-sent after the rail that first carried it failed.
        retransmit: bool,
        /// Set on one-sided connections: the peer memory the slice writes or reads.
        remote: Option<RemoteSlice>,
    },
}

/// Something workers must hear about.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Every byte is placed on the receiving side.
    Done {
        transfer_id: u64,
        request_id: String,
        kind: TransferKind,
        region_id: u64,
        block_ids: Vec<u32>,
        bytes: u64,
        /// A received push's group, as its sender named it (checked).
        receiver_group: Option<pb::ReceiverGroup>,
    },
    /// The transfer ended early.
    Failed {
        transfer_id: u64,
        request_id: String,
        kind: TransferKind,
        region_id: u64,
        error: TransferError,
        /// A received push's group, as its sender named it (checked).
        receiver_group: Option<pb::ReceiverGroup>,
    },
    /// A rail changed state. On `Down` the driver closes the rail's connections.
    Rail(RailChange),
    /// A worker on the peer sent a message to a worker here (sizes checked).
    Message(pb::WorkerMessage),
    /// The peer sent a message that breaks the limits: dropped.
    MessageDropped(crate::message::MessageError),
}

/// One step of a rail's state machine, with its cause.
#[derive(Debug, Clone, PartialEq)]
pub struct RailChange {
    pub rail: RailId,
    pub from: RailHealth,
    pub to: RailHealth,
    pub reason: String,
}

/// What to do with an incoming slice's payload.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceDisposition {
    /// Read the payload into these (offset, len) ranges of local region `region_id`.
    Place {
        region_id: u64,
        pieces: Vec<(u64, u64)>,
    },
    /// Read and drop the payload: its transfer is unknown or already over.
    Discard,
}

#[derive(Debug)]
struct Conn {
    rail: RailId,
    alive: bool,
    /// Carries one-sided slices only (an RDMA queue pair); never control.
    one_sided: bool,
    outstanding: u64,
    /// The slice whose payload is being read from this connection right now.
    placing: Option<SliceHeader>,
}

#[derive(Debug)]
struct Transfer {
    request_id: String,
    kind: TransferKind,
    state: TransferState,
    selection: BlockSelection,
    plan: Arc<Plan>,
    last_progress: Instant,
    // Sender side.
    next_offset: u64,
    resend: VecDeque<(u64, u64)>,
    /// (connection, offset, length, sent at) of unacknowledged slices.
    in_flight: Vec<(ConnId, u64, u64, Instant)>,
    announced: u64,
    /// The open this side sent (a push's or a pull's): it names the peer's
    /// blocks, and is sent again where a connection lost it.
    open_msg: Option<PeerMessage>,
    /// A pull's, or a one-sided push's, open: the connection it went out on
    /// as a control message, until the peer answers (a grant, a first slice).
    /// An open lost with its connection is sent again.
    open_on: Option<ConnId>,
    /// Grants sent again for copies of this transfer's open (bounded).
    regrants: u8,
    /// Small transfers stay on one rail.
    pinned_rail: Option<RailId>,
    /// Its local memory is staged: larger slices (`staged_slice_bytes`).
    staged: bool,
    /// What it holds in memory ([`crate::budget::transfer_bytes`]), counted
    /// against the session's and the node's budgets while it is open.
    held_bytes: u64,
    /// Granted: this side moves the bytes one-sided.
    remote: Option<RemoteGrant>,
    // Both: bytes confirmed placed.
    placed: RangeSet,
    // Receiver side: slices being read into memory right now, admitted by the
    // session (`accept_slice`)...
    placing: u32,
    /// ...or by the transfer's gate, without the session (see `placement`).
    gate: Option<OwnedGate>,
    /// Why it fails, while it is `Failing` (slices still being placed).
    pending_failure: Option<TransferError>,
    /// Lifecycle transitions the table refused (a session bug: the state
    /// stays put, the transfer goes on; counted by the session).
    invalid_transitions: u32,
    /// Receiver side: the group the sender named (`PushOpen.receiver_group`).
    receiver_group: Option<pb::ReceiverGroup>,
}

impl Transfer {
    fn new(
        request_id: String,
        kind: TransferKind,
        selection: BlockSelection,
        plan: Plan,
        now: Instant,
    ) -> Self {
        Self {
            request_id,
            kind,
            state: TransferState::Queued,
            selection,
            plan: Arc::new(plan),
            last_progress: now,
            next_offset: 0,
            resend: VecDeque::new(),
            in_flight: Vec::new(),
            announced: 0,
            open_msg: None,
            open_on: None,
            regrants: 0,
            pinned_rail: None,
            staged: false,
            held_bytes: 0,
            remote: None,
            placed: RangeSet::default(),
            placing: 0,
            gate: None,
            pending_failure: None,
            invalid_transitions: 0,
            receiver_group: None,
        }
    }

    /// Whether bytes are being written into this transfer's memory now (by
    /// slices the session or the gate admitted, or our one-sided READs).
    fn placing_now(&self) -> bool {
        self.placing > 0 || self.gate.as_ref().is_some_and(|g| g.0.placing() > 0)
    }

    /// Admits no slice through the gate any more (the transfer is failing).
    fn close_gate(&self) {
        if let Some(g) = &self.gate {
            g.0.close();
        }
    }

    /// Moves the lifecycle on by `event`. An illegal one is a session bug:
    /// the error is returned (and counted), and the state stays put rather
    /// than taking the daemon down.
    fn advance(&mut self, event: TransferEvent) -> Result<TransferState, InvalidTransition> {
        match self.state.on(event) {
            Ok(next) => {
                self.state = next;
                Ok(next)
            }
            Err(e) => {
                self.invalid_transitions = self.invalid_transitions.saturating_add(1);
                Err(e)
            }
        }
    }

    /// Asked for a grant; nothing moves until it (or a refusal) arrives.
    fn awaiting_grant(&self) -> bool {
        self.state == TransferState::AwaitingGrant
    }

    /// A pull served by granting: the reader moves the bytes, we wait for Complete.
    fn passive(&self) -> bool {
        self.state == TransferState::ServedByGrant
    }

    /// Fails once the slices being placed have landed (the first reason stays).
    fn fail_when_placed(&mut self, error: TransferError) {
        self.pending_failure.get_or_insert(error);
        let _ = self.advance(TransferEvent::FailWhilePlacing);
    }

    /// The completion event of a finished transfer.
    fn into_done(self, transfer_id: u64) -> Event {
        Event::Done {
            transfer_id,
            bytes: self.plan.total_bytes(),
            request_id: self.request_id,
            kind: self.kind,
            region_id: self.selection.region_id,
            block_ids: self.selection.block_ids,
            receiver_group: self.receiver_group,
        }
    }

    /// Whether this side puts the transfer's slices on connections.
    fn schedules(&self) -> bool {
        if self.awaiting_grant() {
            return false;
        }
        match self.kind {
            TransferKind::Push => true,
            TransferKind::PullServe => !self.passive(),
            TransferKind::Pull => self.remote.is_some(),
            TransferKind::PushReceive => false,
        }
    }

    fn has_unsent(&self) -> bool {
        !self.resend.is_empty() || self.next_offset < self.plan.total_bytes()
    }
}

/// A local request to move blocks, already checked against the local region.
#[derive(Debug, Clone)]
pub struct LocalTransfer {
    pub transfer_id: u64,
    pub request_id: String,
    /// Our blocks.
    pub local: BlockSelection,
    pub local_layout: RegionLayout,
    /// What our blocks hold, when the worker said.
    pub local_geometry: Option<Arc<KvGeometry>>,
    /// The peer's blocks.
    pub remote: BlockSelection,
    /// Our blocks go through staging buffers (GPU memory): the transfer is
    /// cut into `SessionConfig::staged_slice_bytes` slices.
    pub staged: bool,
    /// A push's: the receiving worker hears of it with the group's other
    /// members ([`check_receiver_group`]).
    pub receiver_group: Option<pb::ReceiverGroup>,
}

/// Most members of a receiver group.
/// (A group costs the receiver a few counters, whatever its size: 80
/// layers from 16 ranks are 1,280 members.)
pub const MAX_RECEIVER_GROUP_MEMBERS: u32 = 1 << 20;

/// Whether a receiver group is well formed: an id of 1 to
/// [`crate::wire::REQUEST_ID_MAX`] bytes and 1 to
/// [`MAX_RECEIVER_GROUP_MEMBERS`] members.
pub fn check_receiver_group(g: &pb::ReceiverGroup) -> Result<(), String> {
    crate::wire::check_request_id(&g.id).map_err(|e| format!("receiver group: {e}"))?;
    if g.members == 0 || g.members > MAX_RECEIVER_GROUP_MEMBERS {
        return Err(format!(
            "receiver group {:?} has {} members (must be 1..={MAX_RECEIVER_GROUP_MEMBERS})",
            g.id, g.members
        ));
    }
    Ok(())
}

impl LocalTransfer {
    /// The plan of our side: `Access::Read` for a push, `Write` for a pull.
    pub fn plan(&self, access: Access) -> Result<Plan, PlanError> {
        Plan::build_for(
            &self.local_layout,
            self.local_geometry.as_deref(),
            &self.local,
            access,
        )
    }
}

/// One peer session.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    /// Lifecycle transitions the table refused, of transfers already ended.
    invalid_transitions: u64,
    conns: Vec<Conn>,
    rails: Vec<Rail>,
    /// Since when no rail has been able to carry anything.
    all_down_since: Option<Instant>,
    /// Rails the driver should rebuild now.
    probes: VecDeque<RailId>,
    transfers: BTreeMap<u64, Transfer>,
    /// Plan segments the open transfers hold (see [`MAX_SEGMENTS_HELD`]).
    segments_held: u64,
    /// Bytes its transfers hold (see `Transfer::held_bytes`).
    bytes_held: u64,
    /// Transfers ended since the control queue was last rid of the opens of
    /// ended transfers (see `unhold`).
    ended_with_open: usize,
    control: VecDeque<(Option<ConnId>, PeerMessage)>,
    events: VecDeque<Event>,
    /// Transfers this side refused: repeated announcements stay quiet.
    rejected: RecentIds,
    /// Transfers an open created here that this side ended or refused, and
    /// why: a late copy of the open is answered with that abort again, never
    /// served anew.
    ended: Recent<(ErrorCode, String)>,
    /// Transfers this side received in full. A repeated announcement or slice
    /// of one means the sender never got the Complete (it went down with a
    /// connection): it is answered with Complete again.
    received: RecentIds,
}

/// How many transfer ids a [`Recent`] memory keeps.
const RECENT_MEMORY: usize = 4096;

/// A bounded memory of transfer ids, each with a value; the oldest are
/// forgotten first.
#[derive(Debug)]
struct Recent<V> {
    items: HashMap<u64, V>,
    order: VecDeque<u64>,
}

impl<V> Default for Recent<V> {
    fn default() -> Self {
        Self {
            items: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<V> Recent<V> {
    fn remember(&mut self, id: u64, value: V) {
        if self.items.insert(id, value).is_none() {
            self.order.push_back(id);
            if self.order.len() > RECENT_MEMORY {
                if let Some(old) = self.order.pop_front() {
                    self.items.remove(&old);
                }
            }
        }
    }

    fn get(&self, id: u64) -> Option<&V> {
        self.items.get(&id)
    }

    fn contains(&self, id: &u64) -> bool {
        self.items.contains_key(id)
    }
}

/// Transfer ids alone.
type RecentIds = Recent<()>;

impl RecentIds {
    fn insert(&mut self, id: u64) {
        self.remember(id, ());
    }
}

/// Grants one transfer may send again for repeated opens.
pub(crate) const MAX_REGRANTS: u8 = 4;

impl Drop for Session {
    /// A session dropped with transfers open gives their bytes back to the
    /// node's budget (the other sessions draw from it).
    fn drop(&mut self) {
        self.config.peer_budget.give_back(self.bytes_held);
        self.config.node_budget.give_back(self.bytes_held);
    }
}

impl Session {
    pub fn new(config: SessionConfig) -> Self {
        Self {
            config,
            conns: Vec::new(),
            rails: Vec::new(),
            all_down_since: None,
            probes: VecDeque::new(),
            transfers: BTreeMap::new(),
            segments_held: 0,
            bytes_held: 0,
            ended_with_open: 0,
            invalid_transitions: 0,
            control: VecDeque::new(),
            events: VecDeque::new(),
            rejected: RecentIds::default(),
            ended: Recent::default(),
            received: RecentIds::default(),
        }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Adds a handshaken connection on `rail` (a dead connection's slot is reused);
    /// `None` once the session holds [`MAX_CONNECTIONS`] live ones. A down or
    /// probing rail comes back up.
    pub fn add_connection(&mut self, rail: RailId, now: Instant) -> Option<ConnId> {
        self.add_conn(rail, false, now)
    }

    /// Adds a one-sided connection (an RDMA queue pair) on `rail`: it carries the
    /// slices of granted transfers, never control messages.
    pub fn add_one_sided_connection(&mut self, rail: RailId, now: Instant) -> Option<ConnId> {
        self.add_conn(rail, true, now)
    }

    /// Whether a new transfer of `bytes` asks the peer for one-sided access
    /// (see [`SessionConfig::eager_max_bytes`]). Staged memory (GPU) is not
    /// registered with verbs: it always moves two-sided.
    fn goes_one_sided(&self, req: &LocalTransfer, bytes: u64) -> bool {
        !req.staged && bytes > self.config.eager_max_bytes && self.has_one_sided()
    }

    /// Whether a one-sided connection is alive on a rail that carries traffic.
    pub fn has_one_sided(&self) -> bool {
        self.conns
            .iter()
            .any(|c| c.alive && c.one_sided && self.rails[c.rail as usize].health == RailHealth::Up)
    }

    /// Live one-sided connections of `rail`.
    pub fn one_sided_connections(&self, rail: RailId) -> usize {
        live_on(&self.conns, rail)
            .filter(|&i| self.conns[i].one_sided)
            .count()
    }

    fn add_conn(&mut self, rail: RailId, one_sided: bool, now: Instant) -> Option<ConnId> {
        let conn = Conn {
            rail,
            alive: true,
            one_sided,
            outstanding: 0,
            placing: None,
        };
        let id = match self.conns.iter().position(|c| !c.alive) {
            Some(free) => {
                self.conns[free] = conn;
                free
            }
            None if self.conns.len() < MAX_CONNECTIONS => {
                self.conns.push(conn);
                self.conns.len() - 1
            }
            None => return None,
        };
        self.ensure_rail(rail, now);
        self.rail_signal(rail, RailSignal::Connected, "connected", false, now);
        self.update_all_down(now);
        Some(id)
    }

    fn ensure_rail(&mut self, rail: RailId, now: Instant) {
        while self.rails.len() <= rail as usize {
            let next = self.rails.len() as RailId;
            self.rails.push(Rail::new(next, now, &self.config.rails));
        }
    }

    /// A rail whose first connection could not be made: down, and probed later.
    pub fn rail_unreachable(&mut self, rail: RailId, reason: &str, now: Instant) {
        self.ensure_rail(rail, now);
        self.rail_signal(rail, RailSignal::Failed, reason, false, now);
    }

    /// Closes every live connection of `rail` without judging the rail (the dialer
    /// is replacing them); their slices go back to be re-sent. Returns them.
    pub fn retire_rail_connections(&mut self, rail: RailId) -> Vec<ConnId> {
        let ids: Vec<ConnId> = live_on(&self.conns, rail).collect();
        for &conn in &ids {
            self.kill_connection(conn);
        }
        ids
    }

    /// Closes the live one-sided connections of `rail` (the dialer is replacing
    /// its queue pairs); their slices go back to be re-sent. Returns them.
    pub fn retire_one_sided_connections(&mut self, rail: RailId) -> Vec<ConnId> {
        let ids: Vec<ConnId> = live_on(&self.conns, rail)
            .filter(|&i| self.conns[i].one_sided)
            .collect();
        for &conn in &ids {
            self.kill_connection(conn);
        }
        ids
    }

    /// Connections (live or not) that belong to `rail`.
    pub fn rail_connections(&self, rail: RailId) -> Vec<ConnId> {
        (0..self.conns.len())
            .filter(|&i| self.conns[i].rail == rail)
            .collect()
    }

    /// Rails the session knows (connected once, or declared unreachable).
    pub fn rail_count(&self) -> usize {
        self.rails.len()
    }

    /// Per-rail state and counters.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        self.rails
            .iter()
            .map(|r| r.stats(live_on(&self.conns, r.id).count()))
            .collect()
    }

    /// Next rail the driver should rebuild connections for (dialing side only).
    /// Answer with [`Session::add_connection`] or [`Session::probe_failed`].
    pub fn poll_probe(&mut self) -> Option<RailId> {
        self.probes.pop_front()
    }

    /// Rebuilding `rail` failed; it is probed again after a longer backoff.
    pub fn probe_failed(&mut self, rail: RailId, reason: &str, now: Instant) {
        let Some(r) = self.rails.get_mut(rail as usize) else {
            return;
        };
        r.backoff = (r.backoff * 2).min(self.config.rails.probe_backoff_max);
        r.last_probe_error = Some(reason.to_string());
        self.rail_signal(rail, RailSignal::ProbeFailed, reason, false, now);
    }

    /// Whether the session has had no rail for longer than the failover deadline.
    pub fn is_dead(&self, now: Instant) -> bool {
        self.alive_connections() == 0
            && self
                .all_down_since
                .is_some_and(|since| now >= since + self.config.rails.all_down_deadline)
    }

    pub fn alive_connections(&self) -> usize {
        self.conns.iter().filter(|c| c.alive).count()
    }

    pub fn connection_rail(&self, conn: ConnId) -> Option<u32> {
        self.conns.get(conn).map(|c| c.rail)
    }

    /// Lifecycle transitions the table refused, over every transfer this
    /// session has had: always 0 unless the session has a bug (the tests
    /// that drive sessions assert it).
    pub fn invalid_transitions(&self) -> u64 {
        self.invalid_transitions
            + self
                .transfers
                .values()
                .map(|t| u64::from(t.invalid_transitions))
                .sum::<u64>()
    }

    /// Transfers not yet finished.
    pub fn active_transfers(&self) -> usize {
        self.transfers.len()
    }

    /// Whether any unfinished transfer reads or writes local region `region_id`.
    pub fn uses_region(&self, region_id: u64) -> bool {
        self.transfers
            .values()
            .any(|t| t.selection.region_id == region_id)
    }

    /// A local worker released blocks of one of our regions: every transfer of
    /// this session that names any of them fails now (`blocks_released`), and the
    /// peer is told, so that no later slice is read from or placed into them.
    /// Slices being placed into them right now land first (the failure waits for
    /// them, as every failure does: see [`Session::still_placing`]). Returns
    /// the transfers that failed.
    pub fn blocks_released(
        &mut self,
        region_id: u64,
        released: &[u32],
        why: &str,
        now: Instant,
    ) -> Vec<u64> {
        let hit = self.transfers_naming(region_id, released);
        for &id in &hit {
            self.abort(
                id,
                ErrorCode::BlocksReleased,
                why,
                TransferError::Local {
                    code: ErrorCode::BlocksReleased,
                    message: why.to_string(),
                },
                now,
            );
        }
        hit
    }

    /// Tells the peer again that these transfers (ended here) failed: their
    /// first abort went down with a connection that was cut.
    pub fn abort_again(&mut self, ids: &[u64], code: ErrorCode, message: &str) {
        for &id in ids {
            self.control
                .push_back((None, abort_message(id, code, message.to_string())));
        }
    }

    /// The open transfers that name any of `blocks` of our region `region_id`.
    pub fn transfers_naming(&self, region_id: u64, blocks: &[u32]) -> Vec<u64> {
        let blocks: HashSet<u32> = blocks.iter().copied().collect();
        self.transfers
            .iter()
            .filter(|(_, t)| {
                t.selection.region_id == region_id
                    && t.selection.block_ids.iter().any(|b| blocks.contains(b))
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// The connections that carry unacknowledged slices of these transfers (a
    /// writer may still be reading their payload out of our memory), each once.
    pub fn connections_carrying(&self, ids: &[u64]) -> Vec<ConnId> {
        let mut conns: Vec<ConnId> = ids
            .iter()
            .filter_map(|id| self.transfers.get(id))
            .flat_map(|t| t.in_flight.iter().map(|&(conn, ..)| conn))
            .collect();
        conns.sort_unstable();
        conns.dedup();
        conns
    }

    /// Whether any of these transfers still has a slice being placed into our
    /// memory (a failed one ends only once those land).
    pub fn still_placing(&self, ids: &[u64]) -> bool {
        ids.iter()
            .any(|id| self.transfers.get(id).is_some_and(Transfer::placing_now))
    }

    /// Whether a transfer with `plan` that holds `bytes` fits under the
    /// session's caps and the peer's and the node's budgets; on success the
    /// bytes are taken from both, and [`Self::hold`] must follow.
    fn admit(&self, plan: &Plan, bytes: u64) -> Result<(), PlanError> {
        let segments = plan.segments().len() as u64;
        if self.transfers.len() >= MAX_TRANSFERS
            || self.segments_held.saturating_add(segments) > MAX_SEGMENTS_HELD
        {
            return Err(PlanError::SessionFull {
                transfers: self.transfers.len(),
                segments: self.segments_held,
                max_transfers: MAX_TRANSFERS,
                max_segments: MAX_SEGMENTS_HELD,
            });
        }
        let full = |scope, (held, max)| PlanError::MemoryFull {
            scope,
            held,
            wanted: bytes,
            max,
        };
        let c = &self.config;
        c.peer_budget
            .try_take(bytes)
            .map_err(|e| full("peer's sessions", e))?;
        c.node_budget.try_take(bytes).map_err(|e| {
            c.peer_budget.give_back(bytes);
            full("node", e)
        })
    }

    /// Records an open transfer admitted for `bytes` (counted against the
    /// caps until `unhold`).
    fn hold(&mut self, id: u64, mut t: Transfer, bytes: u64) {
        t.held_bytes = bytes;
        self.segments_held += t.plan.segments().len() as u64;
        self.bytes_held += bytes;
        if let Some(old) = self.transfers.insert(id, t) {
            // Callers insert only ids they checked are new; keep the count true anyway.
            self.release(&old);
        }
    }

    fn unhold(&mut self, id: u64) -> Option<Transfer> {
        let t = self.transfers.remove(&id)?;
        self.release(&t);
        self.invalid_transitions += u64::from(t.invalid_transitions);
        // Its open may still wait in the control queue (no live connection
        // took it, the rails are down): such opens go in one pass once they
        // may be half the queue (each pass then pays for the ends that
        // preceded it).
        if t.open_msg.is_some() {
            self.ended_with_open += 1;
            if self.ended_with_open >= 64 && 2 * self.ended_with_open >= self.control.len() {
                let transfers = &self.transfers;
                self.control
                    .retain(|(_, m)| open_id(m).is_none_or(|id| transfers.contains_key(&id)));
                self.ended_with_open = 0;
            }
        }
        Some(t)
    }

    fn release(&mut self, t: &Transfer) {
        self.segments_held -= t.plan.segments().len() as u64;
        self.bytes_held -= t.held_bytes;
        self.config.peer_budget.give_back(t.held_bytes);
        self.config.node_budget.give_back(t.held_bytes);
    }

    /// Bytes this session's open transfers hold.
    pub fn held_bytes(&self) -> u64 {
        self.bytes_held
    }

    /// Starts a push: our `local` blocks go into the peer's `remote` blocks.
    pub fn start_push(&mut self, req: LocalTransfer, now: Instant) -> Result<u64, PlanError> {
        let plan = req.plan(Access::Read)?;
        self.start_push_planned(req, plan, now)
    }

    /// As [`Session::start_push`], with the plan the caller already built
    /// from `req` ([`LocalTransfer::plan`]) while checking the request: a
    /// transfer's plan is built once.
    pub fn start_push_planned(
        &mut self,
        req: LocalTransfer,
        plan: Plan,
        now: Instant,
    ) -> Result<u64, PlanError> {
        let one_sided = self.goes_one_sided(&req, plan.total_bytes());
        let bytes = transfer_bytes(
            &[&req.local],
            &plan,
            selection_bytes(&req.remote),
            u64::from(one_sided),
            &req.request_id,
        );
        self.admit(&plan, bytes)?;
        let open = crate::wire::message(Body::PushOpen(pb::PushOpen {
            transfer_id: req.transfer_id,
            request_id: req.request_id.clone(),
            destination: Some(into_block_set(req.remote)),
            block_bytes: plan.block_bytes(),
            total_bytes: plan.total_bytes(),
            one_sided,
            geometry: req.local_geometry.as_deref().map(KvGeometry::to_wire),
            receiver_group: req.receiver_group,
        }));
        let total = plan.total_bytes();
        let mut t = Transfer::new(req.request_id, TransferKind::Push, req.local, plan, now);
        t.staged = req.staged;
        if one_sided {
            // The grant names where to write; two-sided slices announce themselves.
            let _ = t.advance(TransferEvent::AskedForGrant);
            self.control.push_back((None, open.clone()));
        }
        t.open_msg = Some(open);
        self.hold(req.transfer_id, t, bytes);
        Ok(total)
    }

    /// Starts a pull: the peer's `remote` blocks come into our `local` blocks.
    pub fn start_pull(&mut self, req: LocalTransfer, now: Instant) -> Result<u64, PlanError> {
        let plan = req.plan(Access::Write)?;
        self.start_pull_planned(req, plan, now)
    }

    /// As [`Session::start_pull`], with the plan already built from `req`.
    pub fn start_pull_planned(
        &mut self,
        req: LocalTransfer,
        plan: Plan,
        now: Instant,
    ) -> Result<u64, PlanError> {
        let total = plan.total_bytes();
        let one_sided = self.goes_one_sided(&req, total);
        let bytes = transfer_bytes(
            &[&req.local],
            &plan,
            selection_bytes(&req.remote),
            1,
            &req.request_id,
        );
        self.admit(&plan, bytes)?;
        let open = crate::wire::message(Body::PullOpen(pb::PullOpen {
            transfer_id: req.transfer_id,
            request_id: req.request_id.clone(),
            source: Some(into_block_set(req.remote)),
            block_bytes: plan.block_bytes(),
            total_bytes: total,
            one_sided,
            geometry: req.local_geometry.as_deref().map(KvGeometry::to_wire),
        }));
        self.control.push_back((None, open.clone()));
        let mut t = Transfer::new(req.request_id, TransferKind::Pull, req.local, plan, now);
        t.staged = req.staged;
        if one_sided {
            let _ = t.advance(TransferEvent::AskedForGrant);
        }
        t.open_msg = Some(open);
        self.hold(req.transfer_id, t, bytes);
        Ok(total)
    }

    /// Cancels a transfer this side knows; the peer is told.
    pub fn cancel(&mut self, transfer_id: u64, now: Instant) -> bool {
        if !self.transfers.contains_key(&transfer_id) {
            return false;
        }
        self.abort(
            transfer_id,
            ErrorCode::Cancelled,
            "cancelled by the worker",
            TransferError::Cancelled,
            now,
        );
        true
    }

    /// Fails a transfer for a local reason (the peer is told).
    pub fn fail(&mut self, transfer_id: u64, code: ErrorCode, message: &str, now: Instant) {
        self.abort(
            transfer_id,
            code,
            message,
            TransferError::Local {
                code,
                message: message.to_string(),
            },
            now,
        );
    }

    /// Fails every open transfer with `error` (the link under the session is
    /// gone for good). Transfers with bytes being placed fail once those land.
    pub fn fail_all(&mut self, error: TransferError) {
        let ids: Vec<u64> = self.transfers.keys().copied().collect();
        for id in ids {
            self.fail_locally(id, error.clone());
        }
    }

    /// The peer came back as a new incarnation: every open transfer fails now
    /// (nothing is re-announced to a process that never saw it). Transfers with
    /// bytes being placed into our memory fail once those land.
    pub fn peer_restarted(&mut self, old: u64, new: u64) {
        let ids: Vec<u64> = self.transfers.keys().copied().collect();
        for id in ids {
            self.fail_locally(id, TransferError::PeerRestarted { old, new });
        }
    }

    /// Feeds one control message that arrived on `conn`.
    pub fn handle_control(
        &mut self,
        conn: ConnId,
        body: Body,
        now: Instant,
        regions: &dyn RegionDirectory,
    ) {
        match body {
            Body::PushOpen(open) => self.on_push_open(conn, open, now, regions),
            Body::PullOpen(open) => self.on_pull_open(conn, open, now, regions),
            Body::SliceAck(ack) => {
                // The peer acknowledges only slices we sent; a pull's in-flight
                // slices are our own RDMA reads, settled by their completions.
                let ours_sent = self
                    .transfers
                    .get(&ack.transfer_id)
                    .is_some_and(|t| t.kind.sends_data());
                if ours_sent {
                    self.on_slice_ack(ack, now);
                }
            }
            Body::Complete(c) => self.on_complete(c.transfer_id, now),
            Body::Abort(a) => {
                let code = ErrorCode::try_from(a.code).unwrap_or(ErrorCode::Unspecified);
                if self.transfers.contains_key(&a.transfer_id) {
                    let error = if code == ErrorCode::Cancelled {
                        TransferError::Cancelled
                    } else {
                        TransferError::Peer {
                            code,
                            message: crate::wire::peer_text(a.message),
                        }
                    };
                    self.finish_failed(a.transfer_id, error);
                }
                // An Abort can overtake its PushOpen/PullOpen, or a repeat of
                // it (a push announces itself on each connection it uses, and
                // they may travel on different connections): remember it, so an
                // open that arrives later is dropped instead of starting a
                // receive nobody sends to, which would hold its region until
                // the progress timeout.
                self.remember_rejected(a.transfer_id);
            }
            Body::Ping(p) => self.control.push_back((
                Some(conn),
                crate::wire::message(Body::Pong(pb::Pong { nonce: p.nonce })),
            )),
            Body::Grant(g) => self.on_grant(g, now),
            Body::RailDown(d) => {
                let reason = format!(
                    "peer reported it down: {}",
                    crate::wire::peer_text(d.reason)
                );
                self.rail_signal(d.rail_index, RailSignal::Failed, &reason, false, now);
            }
            Body::WorkerMessage(m) => match crate::message::check(&m) {
                Ok(()) => self.events.push_back(Event::Message(m)),
                // A peer's oversized or nameless message is dropped, not relayed.
                Err(e) => self.events.push_back(Event::MessageDropped(e)),
            },
            // Handshake messages belong to the driver; after it, they are ignored.
            Body::Hello(_)
            | Body::HelloAck(_)
            | Body::Pong(_)
            | Body::RdmaConnect(_)
            | Body::RdmaAccept(_)
            | Body::HelloProof(_) => {}
        }
    }

    fn remember_rejected(&mut self, id: u64) {
        self.rejected.insert(id);
    }

    /// Tells the sender again that `id` arrived in full (see [`Session::received`]).
    fn repeat_complete(&mut self, conn: ConnId, id: u64) {
        self.control.push_back((
            Some(conn),
            crate::wire::message(Body::Complete(pb::Complete { transfer_id: id })),
        ));
    }

    fn reject(&mut self, conn: ConnId, transfer_id: u64, code: ErrorCode, message: String) {
        self.remember_rejected(transfer_id);
        if !self.transfers.contains_key(&transfer_id) {
            self.ended.remember(transfer_id, (code, message.clone()));
        }
        self.control
            .push_back((Some(conn), abort_message(transfer_id, code, message)));
    }

    /// Answers a late copy of an open this side ended (or refused) with the
    /// same abort; false if it did not end that transfer.
    fn answered_as_ended(&mut self, conn: ConnId, id: u64) -> bool {
        let Some((code, message)) = self.ended.get(id).cloned() else {
            return false;
        };
        self.control
            .push_back((Some(conn), abort_message(id, code, message)));
        true
    }

    fn on_push_open(
        &mut self,
        conn: ConnId,
        open: pb::PushOpen,
        now: Instant,
        regions: &dyn RegionDirectory,
    ) {
        let id = open.transfer_id;
        if self.received.contains(&id) {
            self.repeat_complete(conn, id);
            return;
        }
        if self.answered_as_ended(conn, id) {
            return;
        }
        // The sender repeats the announcement on each connection it uses.
        if let Some(t) = self.transfers.get(&id) {
            if open.one_sided
                && t.kind == TransferKind::PushReceive
                && t.request_id == open.request_id
                && selection_of(open.destination.as_ref()) == t.selection
            {
                // A one-sided open sent again: our grant may have died with
                // the connection that carried the first.
                self.grant_again(conn, id, open.block_bytes, open.total_bytes, regions, now);
            }
            return;
        }
        if self.rejected.contains(&id) {
            return;
        }
        if let Err(message) = crate::wire::check_request_id(&open.request_id) {
            return self.reject(conn, id, ErrorCode::Protocol, message);
        }
        if let Some(Err(message)) = open.receiver_group.as_ref().map(check_receiver_group) {
            return self.reject(conn, id, ErrorCode::Protocol, message);
        }
        let selection = selection_of(open.destination.as_ref());
        match accept_plan(
            &selection,
            open.block_bytes,
            open.total_bytes,
            Access::Write,
            regions,
            PeerGeometry::Sent(open.geometry.as_ref()),
        ) {
            Ok((plan, region)) => {
                let bytes = transfer_bytes(&[&selection], &plan, 0, 0, &open.request_id);
                if let Err(full) = self.admit(&plan, bytes) {
                    let (code, message) = (full.wire_code(), full.to_string());
                    self.refused_member(id, &open, selection.region_id, code, &message);
                    return self.reject(conn, id, code, message);
                }
                if open.one_sided {
                    self.control
                        .push_back((Some(conn), grant_message(id, &region, region.keys.clone())));
                }
                let mut t = Transfer::new(
                    open.request_id,
                    TransferKind::PushReceive,
                    selection,
                    plan,
                    now,
                );
                t.receiver_group = open.receiver_group;
                self.hold(id, t, bytes);
            }
            Err((code, message)) => {
                self.refused_member(id, &open, selection.region_id, code, &message);
                self.reject(conn, id, code, message)
            }
        }
    }

    /// A push refused at its open that names a receiver group: the group
    /// hears of it as a failed member (its receiver would otherwise wait for
    /// a member that never comes).
    fn refused_member(
        &mut self,
        id: u64,
        open: &pb::PushOpen,
        region_id: u64,
        code: ErrorCode,
        message: &str,
    ) {
        if open.receiver_group.is_some() {
            self.events.push_back(Event::Failed {
                transfer_id: id,
                request_id: open.request_id.clone(),
                kind: TransferKind::PushReceive,
                region_id,
                error: TransferError::Local {
                    code,
                    message: message.to_string(),
                },
                receiver_group: open.receiver_group.clone(),
            });
        }
    }

    /// Answers an open sent again with our grant, a few times per transfer at
    /// most: a peer that opens it once more after that is told the transfer
    /// failed (and it fails here), rather than waiting out its progress
    /// timeout for a grant that never comes. A serve that declined one-sided
    /// access declines again.
    fn grant_again(
        &mut self,
        conn: ConnId,
        id: u64,
        block_bytes: u64,
        total_bytes: u64,
        regions: &dyn RegionDirectory,
        now: Instant,
    ) {
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        if t.regrants >= MAX_REGRANTS {
            let message = format!(
                "the peer opened transfer {id} again more than {MAX_REGRANTS} times \
                 (each repeat asks for a new grant)"
            );
            let error = TransferError::Peer {
                code: ErrorCode::Protocol,
                message: message.clone(),
            };
            return self.abort(id, ErrorCode::Protocol, &message, error, now);
        }
        let access = match t.kind {
            TransferKind::PushReceive => Access::Write,
            _ => Access::Read,
        };
        let Ok((_, region)) = accept_plan(
            &t.selection,
            block_bytes,
            total_bytes,
            access,
            regions,
            PeerGeometry::Compared,
        ) else {
            return;
        };
        let keys = if t.kind == TransferKind::PullServe && !t.passive() {
            Vec::new()
        } else {
            region.keys.clone()
        };
        t.regrants += 1;
        self.control
            .push_back((Some(conn), grant_message(id, &region, keys)));
    }

    fn on_pull_open(
        &mut self,
        conn: ConnId,
        open: pb::PullOpen,
        now: Instant,
        regions: &dyn RegionDirectory,
    ) {
        let id = open.transfer_id;
        if self.answered_as_ended(conn, id) {
            return;
        }
        if self.rejected.contains(&id) {
            return;
        }
        if let Err(message) = crate::wire::check_request_id(&open.request_id) {
            return self.reject(conn, id, ErrorCode::Protocol, message);
        }
        if let Some(t) = self.transfers.get_mut(&id) {
            if t.kind == TransferKind::PullServe
                && t.request_id == open.request_id
                && selection_of(open.source.as_ref()) == t.selection
                && (open.one_sided || !t.passive())
            {
                // The reader sent its open again, not knowing whether its
                // connection died before we read the first one: serving
                // already. Our grant may have died with it: granted again.
                if open.one_sided {
                    self.grant_again(conn, id, open.block_bytes, open.total_bytes, regions, now);
                }
                return;
            }
            if t.kind == TransferKind::PullServe && t.passive() && !open.one_sided {
                // The reader lost its one-sided paths: send everything after all
                // (it discards what it already has).
                let _ = t.advance(TransferEvent::GrantWithdrawn);
                t.next_offset = 0;
                t.resend.clear();
                t.last_progress = now;
                return;
            }
            self.reject(
                conn,
                id,
                ErrorCode::DuplicateTransfer,
                format!("transfer {id} already exists"),
            );
            return;
        }
        let selection = selection_of(open.source.as_ref());
        match accept_plan(
            &selection,
            open.block_bytes,
            open.total_bytes,
            Access::Read,
            regions,
            PeerGeometry::Sent(open.geometry.as_ref()),
        ) {
            Ok((plan, region)) => {
                let mut t = Transfer::new(
                    open.request_id,
                    TransferKind::PullServe,
                    selection,
                    plan,
                    now,
                );
                t.staged = region.staged;
                let bytes = transfer_bytes(&[&t.selection], &t.plan, 0, 0, &t.request_id);
                if let Err(full) = self.admit(&t.plan, bytes) {
                    return self.reject(conn, id, full.wire_code(), full.to_string());
                }
                if open.one_sided {
                    if !region.keys.is_empty() {
                        let _ = t.advance(TransferEvent::Granted);
                    }
                    self.control
                        .push_back((Some(conn), grant_message(id, &region, region.keys.clone())));
                }
                self.hold(id, t, bytes);
            }
            Err((code, message)) => self.reject(conn, id, code, message),
        }
    }

    /// The peer granted (or declined) one-sided access for a transfer we started.
    fn on_grant(&mut self, g: pb::Grant, now: Instant) {
        let id = g.transfer_id;
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        if !t.awaiting_grant() {
            return;
        }
        let _ = t.advance(TransferEvent::GrantAnswered);
        t.open_on = None;
        t.last_progress = now;
        if g.keys.is_empty() {
            // Declined: the bytes travel as two-sided slices.
            return;
        }
        let access = match t.kind {
            TransferKind::Push => Access::Write,
            _ => Access::Read,
        };
        let layout = g.layout.as_ref().map(layout_of).unwrap_or_default();
        // The peer's geometry, checked before any arithmetic on it (strides
        // that overflow, overlapping blocks).
        let geometry = match g.geometry.as_ref().map(KvGeometry::from_wire).transpose() {
            Ok(geometry) => geometry,
            Err(e) => {
                let message = format!("granted geometry: {e}");
                let error = TransferError::Peer {
                    code: ErrorCode::Protocol,
                    message: message.clone(),
                };
                return self.abort(id, ErrorCode::Protocol, &message, error, now);
            }
        };
        let checked = layout
            .validate(u64::MAX)
            .map_err(|e| format!("granted layout: {e}"))
            .and_then(|()| match &geometry {
                Some(geometry) => geometry
                    .validate(&layout)
                    .map_err(|e| format!("granted geometry: {e}")),
                None => Ok(()),
            })
            .and_then(|()| {
                Plan::build_for(
                    &layout,
                    geometry.as_ref(),
                    &remote_blocks(t.open_msg.as_ref()),
                    access,
                )
                .map_err(|e| e.to_string())
            })
            .and_then(|plan| {
                if plan.total_bytes() != t.plan.total_bytes()
                    || plan.block_bytes() != t.plan.block_bytes()
                {
                    return Err(format!(
                        "granted blocks hold {} bytes in blocks of {}, the transfer moves {} in blocks of {}",
                        plan.total_bytes(),
                        plan.block_bytes(),
                        t.plan.total_bytes(),
                        t.plan.block_bytes()
                    ));
                }
                match g.keys.iter().find(|k| k.length < layout.extent()) {
                    Some(k) => Err(format!(
                        "rail {} key covers {} bytes, the granted layout spans {}",
                        k.rail_index,
                        k.length,
                        layout.extent()
                    )),
                    None => Ok(plan),
                }
            });
        match checked {
            Ok(plan) => {
                t.remote = Some(RemoteGrant { plan, keys: g.keys });
            }
            Err(e) => self.abort(
                id,
                ErrorCode::Protocol,
                &format!("grant does not fit the transfer: {e}"),
                TransferError::Peer {
                    code: ErrorCode::Protocol,
                    message: format!("peer granted memory that does not fit the transfer: {e}"),
                },
                now,
            ),
        }
    }

    /// A one-sided slice completed at this side (the RDMA completion of its
    /// WRITEs and trailer, or of its READs): the bytes are in the destination.
    pub fn one_sided_done(&mut self, conn: ConnId, header: SliceHeader, len: u32, now: Instant) {
        let id = header.transfer_id;
        let ack = pb::SliceAck {
            transfer_id: id,
            offset: header.offset,
            length: u64::from(len),
        };
        if !self.on_slice_ack(ack, now) {
            return;
        }
        let rail = self.conns.get(conn).map(|c| c.rail);
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        if t.kind == TransferKind::Pull {
            t.placing = t.placing.saturating_sub(1);
            let _ = t.advance(TransferEvent::SliceMoved);
            if let Some(r) = rail.and_then(|r| self.rails.get_mut(r as usize)) {
                r.bytes_received += u64::from(len);
            }
            self.settle_received(id, None);
        }
    }

    /// Applies an acknowledgement; false if it matched no slice in flight.
    fn on_slice_ack(&mut self, ack: pb::SliceAck, now: Instant) -> bool {
        let Some(t) = self.transfers.get_mut(&ack.transfer_id) else {
            return false;
        };
        if let Some(pos) = t
            .in_flight
            .iter()
            .position(|&(_, o, l, _)| o == ack.offset && l == ack.length)
        {
            let (conn, off, len, sent_at) = t.in_flight.swap_remove(pos);
            t.placed.insert(off, off + len);
            t.last_progress = now;
            self.release_slice(conn, len);
            if let Some(rail) = self.conns.get(conn).filter(|c| c.alive).map(|c| c.rail) {
                if let Some(r) = self.rails.get_mut(rail as usize) {
                    r.last_progress = now;
                    r.note_rtt(now.saturating_duration_since(sent_at));
                    let busy = r.outstanding > 0;
                    r.estimator.on_acked(len, now, busy);
                }
                self.rail_signal(rail, RailSignal::Acked, "acknowledged", false, now);
            }
            return true;
        }
        false
    }

    /// Takes a slice's bytes off its connection's and rail's outstanding count.
    fn release_slice(&mut self, conn: ConnId, len: u64) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        c.outstanding = c.outstanding.saturating_sub(len);
        if let Some(r) = self.rails.get_mut(c.rail as usize) {
            r.outstanding = r.outstanding.saturating_sub(len);
        }
    }

    fn on_complete(&mut self, transfer_id: u64, now: Instant) {
        let Some(t) = self.transfers.get(&transfer_id) else {
            return;
        };
        if !t.kind.sends_data() {
            return;
        }
        let Some(mut t) = self.unhold(transfer_id) else {
            return;
        };
        // Complete says every byte arrived: for the rails that carried the slices
        // still unacknowledged, that is an acknowledgement (a suspect rail is up).
        let rails: Vec<RailId> = t
            .in_flight
            .iter()
            .filter_map(|&(conn, ..)| self.conns.get(conn).filter(|c| c.alive).map(|c| c.rail))
            .collect();
        self.release_in_flight(&mut t);
        for rail in rails {
            if let Some(r) = self.rails.get_mut(rail as usize) {
                r.last_progress = now;
            }
            self.rail_signal(rail, RailSignal::Acked, "transfer complete", false, now);
        }
        let _ = t.advance(TransferEvent::AllPlaced);
        self.events.push_back(t.into_done(transfer_id));
    }

    fn release_in_flight(&mut self, t: &mut Transfer) {
        for (conn, _, len, _) in t.in_flight.drain(..) {
            self.release_slice(conn, len);
        }
    }

    /// A slice header arrived: where should its payload go?
    pub fn accept_slice(
        &mut self,
        conn: ConnId,
        header: SliceHeader,
        len: u32,
        now: Instant,
    ) -> SliceDisposition {
        let Some(t) = self.transfers.get_mut(&header.transfer_id) else {
            if self.received.contains(&header.transfer_id) {
                self.repeat_complete(conn, header.transfer_id);
            }
            return SliceDisposition::Discard;
        };
        if t.kind.sends_data() || t.pending_failure.is_some() {
            return SliceDisposition::Discard;
        }
        // A slice re-sent after a failover may repeat bytes already placed: each
        // byte range is applied once, and acknowledged again (the first ack
        // may have gone down with its connection: without this one the sender
        // would wait for it for ever).
        let end = header.offset.saturating_add(u64::from(len));
        if t.placed.contains(header.offset, end) {
            self.control.push_back((
                Some(conn),
                crate::wire::message(Body::SliceAck(pb::SliceAck {
                    transfer_id: header.transfer_id,
                    offset: header.offset,
                    length: u64::from(len),
                })),
            ));
            return SliceDisposition::Discard;
        }
        match t.plan.pieces(header.offset, u64::from(len)) {
            Ok(pieces) => {
                let pieces = pieces.collect();
                t.open_on = None;
                t.placing += 1;
                t.last_progress = now;
                if let Some(c) = self.conns.get_mut(conn) {
                    c.placing = Some(header);
                }
                SliceDisposition::Place {
                    region_id: t.selection.region_id,
                    pieces,
                }
            }
            Err(e) => {
                let id = header.transfer_id;
                self.abort(
                    id,
                    ErrorCode::Protocol,
                    &format!("slice outside the transfer: {e}"),
                    // The peer broke the protocol: its side, not ours.
                    TransferError::Peer {
                        code: ErrorCode::Protocol,
                        message: format!("peer sent a slice outside the transfer: {e}"),
                    },
                    now,
                );
                SliceDisposition::Discard
            }
        }
    }

    /// The payload of a slice accepted with [`SliceDisposition::Place`] is now in memory.
    pub fn slice_placed(&mut self, conn: ConnId, header: SliceHeader, len: u32, now: Instant) {
        let id = header.transfer_id;
        let mut one_sided = false;
        let rail = self.conns.get_mut(conn).map(|c| {
            // A staged slice (GPU) was already released from its connection by
            // `slice_read`, which may be placing the next one by now.
            if c.placing == Some(header) {
                c.placing = None;
            }
            one_sided = c.one_sided;
            c.rail
        });
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.placing = t.placing.saturating_sub(1);
        self.record_placed(Some(conn), rail, one_sided, header, len, now);
    }

    /// Counts a slice's bytes placed, acknowledges it and settles its transfer.
    fn record_placed(
        &mut self,
        conn: Option<ConnId>,
        rail: Option<RailId>,
        one_sided: bool,
        header: SliceHeader,
        len: u32,
        now: Instant,
    ) {
        let id = header.transfer_id;
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        if t.pending_failure.is_some() {
            self.settle_received(id, conn);
            return;
        }
        let start = header.offset;
        t.placed.insert(start, start + u64::from(len));
        if t.placed.ranges().len() as u64 > max_placed_ranges(t.plan.total_bytes()) {
            // Each range costs memory and each insert a shift of those after
            // it: a peer sending tiny slices out of order would make both grow
            // with the transfer's size.
            let message = format!(
                "the transfer's bytes arrived in more than {} separate pieces",
                max_placed_ranges(t.plan.total_bytes())
            );
            self.abort(
                id,
                ErrorCode::Protocol,
                &message,
                TransferError::Peer {
                    code: ErrorCode::Protocol,
                    message: format!("the peer's slices: {message}"),
                },
                now,
            );
            return;
        }
        t.last_progress = now;
        let _ = t.advance(TransferEvent::SliceMoved);
        if let Some(r) = rail.and_then(|r| self.rails.get_mut(r as usize)) {
            r.bytes_received += u64::from(len);
        }
        let complete = t.placed.is_complete(t.plan.total_bytes());
        // One-sided senders learn of placement from their own completions.
        if !complete && !one_sided {
            self.control.push_back((
                conn,
                crate::wire::message(Body::SliceAck(pb::SliceAck {
                    transfer_id: id,
                    offset: start,
                    length: u64::from(len),
                })),
            ));
        }
        self.settle_received(id, conn);
    }

    /// The gate through which connections place `transfer_id`'s slices without
    /// the session (see [`crate::placement`]); None if this side does not
    /// receive that transfer's bytes, or no longer does.
    pub fn placement_gate(&mut self, transfer_id: u64) -> Option<Arc<PlacementGate>> {
        let t = self.transfers.get_mut(&transfer_id)?;
        if t.kind.sends_data() || t.pending_failure.is_some() {
            return None;
        }
        // The peer is serving: its open arrived.
        t.open_on = None;
        let region_id = t.selection.region_id;
        let plan = t.plan.clone();
        let gate = t.gate.get_or_insert_with(|| {
            OwnedGate(Arc::new(PlacementGate::new(transfer_id, region_id, plan)))
        });
        Some(gate.0.clone())
    }

    /// Slices a connection placed through their gates since it last merged:
    /// each is counted, acknowledged as `slice_placed` does, and its transfer
    /// settled. `conn`: the connection they came on, None if its slot has
    /// since gone to another (the acknowledgements then go on any).
    pub fn merge_placed(&mut self, conn: Option<ConnId>, placed: Vec<Admitted>, now: Instant) {
        let (rail, one_sided) = conn
            .and_then(|c| self.conns.get(c))
            .map_or((None, false), |c| (Some(c.rail), c.one_sided));
        for slice in placed {
            slice.gate.leave();
            if self.admitted_by_this_session(&slice) {
                self.record_placed(conn, rail, one_sided, slice.header, slice.len, now);
            }
        }
    }

    /// An admitted slice's payload could not be read in full (its connection
    /// broke): its transfer may settle without it.
    pub fn admitted_abandoned(&mut self, slice: Admitted) {
        slice.gate.leave();
        if self.admitted_by_this_session(&slice) {
            self.settle_received(slice.header.transfer_id, None);
        }
    }

    /// Placing an admitted slice failed on this side (the region's file was
    /// truncated under it): its transfer fails with `code`, the peer is told.
    pub fn admitted_failed(
        &mut self,
        slice: Admitted,
        code: ErrorCode,
        reason: &str,
        now: Instant,
    ) {
        slice.gate.leave();
        if self.admitted_by_this_session(&slice) {
            self.fail(slice.header.transfer_id, code, reason, now);
        }
    }

    /// Whether an admitted slice's gate is still that of its open transfer.
    fn admitted_by_this_session(&self, slice: &Admitted) -> bool {
        self.transfers
            .get(&slice.header.transfer_id)
            .and_then(|t| t.gate.as_ref())
            .is_some_and(|g| Arc::ptr_eq(&g.0, &slice.gate))
    }

    /// A slice's payload has been read off its connection into a staging buffer,
    /// from which it is still being copied into place: losing the connection no
    /// longer affects it, and the connection may start on the next slice. The
    /// transfer stays open until `slice_placed` or `placement_failed` settles it.
    pub fn slice_read(&mut self, conn: ConnId, header: SliceHeader) {
        if let Some(c) = self.conns.get_mut(conn) {
            if c.placing == Some(header) {
                c.placing = None;
            }
        }
    }

    /// Placing a slice failed on this side (its device copy): the transfer fails
    /// once nothing else is being placed into it.
    pub fn placement_failed(
        &mut self,
        conn: ConnId,
        header: SliceHeader,
        reason: &str,
        now: Instant,
    ) {
        self.placement_failed_with(conn, header, ErrorCode::Internal, reason, now);
    }

    /// As [`Session::placement_failed`], with the code the peer is told.
    pub fn placement_failed_with(
        &mut self,
        conn: ConnId,
        header: SliceHeader,
        code: ErrorCode,
        reason: &str,
        now: Instant,
    ) {
        self.slice_read(conn, header);
        self.fail(header.transfer_id, code, reason, now);
        self.abandon_placement(header);
    }

    /// A slice accepted for placement could not be read in full (its connection broke).
    pub fn slice_abandoned(&mut self, conn: ConnId, header: SliceHeader) {
        if let Some(c) = self.conns.get_mut(conn) {
            if c.placing != Some(header) {
                // Already settled when the connection was declared dead.
                return;
            }
            c.placing = None;
        }
        self.abandon_placement(header);
    }

    fn abandon_placement(&mut self, header: SliceHeader) {
        let id = header.transfer_id;
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.placing = t.placing.saturating_sub(1);
        self.settle_received(id, None);
    }

    /// Ends a receiving transfer once nothing is being read into its memory any
    /// more: failed if a failure waits, done if every byte is placed. Until then a
    /// slow duplicate on a dying connection could still write into the blocks.
    fn settle_received(&mut self, id: u64, reply_on: Option<ConnId>) {
        let Some(t) = self.transfers.get(&id) else {
            return;
        };
        if t.kind.sends_data() {
            return;
        }
        if let Some(error) = t.pending_failure.clone() {
            if !t.placing_now() {
                self.finish_failed(id, error);
            }
            return;
        }
        if !t.placed.is_complete(t.plan.total_bytes()) {
            return;
        }
        // Every byte is in. The gate admits no more (a duplicate re-sent after
        // a failover would be written while the worker reuses the blocks), and
        // one still being written ends this transfer when it is merged.
        let gate_busy = t.gate.as_ref().is_some_and(|g| g.0.close() > 0);
        if t.placing > 0 || gate_busy {
            return;
        }
        let Some(mut t) = self.unhold(id) else {
            return;
        };
        let _ = t.advance(TransferEvent::AllPlaced);
        self.received.insert(id);
        self.control.push_back((
            reply_on,
            crate::wire::message(Body::Complete(pb::Complete { transfer_id: id })),
        ));
        self.events.push_back(t.into_done(id));
    }

    /// A connection broke. Its unacknowledged slices go back to be re-sent on the
    /// survivors; a rail left with no connection goes down.
    pub fn connection_lost(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(c) = self.conns.get(conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        let rail = c.rail;
        self.kill_connection(conn);
        // Queue pairs are set up over the rail's connections and go with them.
        if !live_on(&self.conns, rail).any(|i| !self.conns[i].one_sided) {
            self.rail_signal(rail, RailSignal::Failed, reason, true, now);
        }
        self.update_all_down(now);
    }

    /// Marks a connection dead: its in-flight slices are queued for re-sending and
    /// a slice being read from it is abandoned.
    fn kill_connection(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        let rail = c.rail;
        let outstanding = c.outstanding;
        c.alive = false;
        c.outstanding = 0;
        let placing = c.placing.take();
        if let Some(r) = self.rails.get_mut(rail as usize) {
            r.outstanding = r.outstanding.saturating_sub(outstanding);
        }
        let bit = 1u64 << conn;
        let mut reads_stopped = Vec::new();
        let mut lost_opens = Vec::new();
        for (&id, t) in self.transfers.iter_mut() {
            t.announced &= !bit;
            if t.open_on == Some(conn) {
                // The peer may never have read it (it died in this connection's
                // buffers); a peer that did ignores the copy (and grants again).
                t.open_on = None;
                lost_opens.extend(t.open_msg.clone());
            }
            let mut i = 0;
            while i < t.in_flight.len() {
                if t.in_flight[i].0 == conn {
                    let (_, off, len, _) = t.in_flight.swap_remove(i);
                    t.resend.push_back((off, len));
                    if t.kind == TransferKind::Pull {
                        // The queue pair is dead: its READs land no more bytes.
                        t.placing = t.placing.saturating_sub(1);
                        reads_stopped.push(id);
                    }
                } else {
                    i += 1;
                }
            }
        }
        for id in reads_stopped {
            self.settle_received(id, None);
        }
        for open in lost_opens {
            self.control.push_back((None, open));
        }
        if let Some(header) = placing {
            self.abandon_placement(header);
        }
    }

    /// Feeds `signal` to a rail's state machine and acts on the change: a rail going
    /// down loses its connections (slices re-sent elsewhere), tells the peer when
    /// the cause is local, and is probed later; a rail coming up starts afresh.
    fn rail_signal(
        &mut self,
        rail: RailId,
        signal: RailSignal,
        reason: &str,
        tell_peer: bool,
        now: Instant,
    ) {
        let probes = self.config.probes_rails;
        let Some(r) = self.rails.get_mut(rail as usize) else {
            return;
        };
        let Some((from, to)) = r.apply(signal) else {
            return;
        };
        match to {
            RailHealth::Down if from.is_connected() => {
                r.last_failure = Some(reason.to_string());
                r.last_probe_error = None;
                if signal == RailSignal::Stalled {
                    r.note_stall();
                }
                r.reset_measurements();
                r.next_probe = probes.then(|| now + r.backoff);
                self.retire_rail_connections(rail);
                if tell_peer && self.alive_connections() > 0 {
                    self.control.push_back((
                        None,
                        crate::wire::message(Body::RailDown(pb::RailDown {
                            rail_index: rail,
                            reason: reason.to_string(),
                        })),
                    ));
                }
            }
            RailHealth::Down => {
                // A failed probe: try again after the (grown) backoff.
                r.next_probe = probes.then(|| now + r.backoff);
            }
            RailHealth::Up if matches!(from, RailHealth::Down | RailHealth::Probing) => {
                r.backoff = self.config.rails.probe_backoff_initial;
                r.next_probe = None;
                r.last_progress = now;
                r.reset_measurements();
            }
            _ => {}
        }
        self.events.push_back(Event::Rail(RailChange {
            rail,
            from,
            to,
            reason: reason.to_string(),
        }));
        self.update_all_down(now);
    }

    /// Starts or clears the clock of "no rail can carry anything".
    fn update_all_down(&mut self, now: Instant) {
        let usable = self
            .conns
            .iter()
            .any(|c| c.alive && self.rails[c.rail as usize].health.is_connected());
        if usable {
            self.all_down_since = None;
        } else if self.all_down_since.is_none() && !self.rails.is_empty() {
            self.all_down_since = Some(now);
        }
    }

    /// "rail 0: stalled ...; rail 1: ..." for the failure every worker hears.
    pub fn rail_causes(&self) -> String {
        self.rails
            .iter()
            .map(|r| {
                let cause = r.last_failure.as_deref().unwrap_or("no connection");
                match &r.last_probe_error {
                    Some(p) => format!("rail {}: {cause} (reconnecting failed: {p})", r.id),
                    None => format!("rail {}: {cause}", r.id),
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// When the next stall check of a busy rail is due.
    fn rail_stall_deadline(&self, r: &Rail) -> Option<Instant> {
        let stall = r.stall_limit(&self.config.rails);
        match r.health {
            RailHealth::Up if r.outstanding > 0 => Some(r.last_progress + stall / 2),
            // A suspect rail always resolves: an acknowledgement makes it up,
            // else it goes down at the stall limit even when nothing is left on
            // it (its transfers ended without acks), and is probed back.
            RailHealth::Suspect => Some(r.last_progress + stall),
            _ => None,
        }
    }

    /// Earliest moment [`Session::handle_timeout`] has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let passive = self.passive_bytes();
        let transfers = self
            .transfers
            .values()
            .filter(|t| t.pending_failure.is_none())
            .map(|t| self.progress_deadline(t, passive));
        let stalls = self
            .rails
            .iter()
            .filter_map(|r| self.rail_stall_deadline(r));
        let probes = self.rails.iter().filter_map(|r| r.next_probe);
        let all_down = self
            .all_down_since
            .filter(|_| !self.transfers.is_empty())
            .map(|since| since + self.config.rails.all_down_deadline);
        transfers.chain(stalls).chain(probes).chain(all_down).min()
    }

    /// Marks stalled rails, queues due probes, and fails transfers that ran out of
    /// rails or made no progress within their deadlines.
    pub fn handle_timeout(&mut self, now: Instant) {
        for i in 0..self.rails.len() {
            let r = &self.rails[i];
            let idle_up = r.outstanding == 0 && r.health == RailHealth::Up;
            if idle_up || !r.health.is_connected() {
                continue;
            }
            let stall = r.stall_limit(&self.config.rails);
            let quiet = now.saturating_duration_since(r.last_progress);
            let rail = r.id;
            let health = r.health;
            let reason = format!("no acknowledgement for {} ms", quiet.as_millis());
            if quiet >= stall {
                if health == RailHealth::Up {
                    self.rail_signal(rail, RailSignal::Stalled, &reason, true, now);
                }
                self.rail_signal(rail, RailSignal::Stalled, &reason, true, now);
            } else if quiet >= stall / 2 && health == RailHealth::Up {
                self.rail_signal(rail, RailSignal::Stalled, &reason, true, now);
            }
        }
        for i in 0..self.rails.len() {
            if self.rails[i].next_probe.is_some_and(|at| now >= at) {
                self.rails[i].next_probe = None;
                let rail = self.rails[i].id;
                self.rail_signal(rail, RailSignal::ProbeDue, "probe due", false, now);
                self.probes.push_back(rail);
            }
        }
        let deadline = self.config.rails.all_down_deadline;
        if self
            .all_down_since
            .is_some_and(|since| now >= since + deadline)
        {
            let causes = self.rail_causes();
            let ids: Vec<u64> = self.transfers.keys().copied().collect();
            for id in ids {
                self.fail_locally(
                    id,
                    TransferError::RailsDown {
                        waited: deadline,
                        causes: causes.clone(),
                    },
                );
            }
        }
        let passive = self.passive_bytes();
        let expired: Vec<(u64, Duration)> = self
            .transfers
            .iter()
            .filter(|(_, t)| {
                t.pending_failure.is_none() && now >= self.progress_deadline(t, passive)
            })
            .map(|(id, t)| (*id, self.progress_deadline(t, passive) - t.last_progress))
            .collect();
        for (id, waited) in expired {
            self.abort(
                id,
                ErrorCode::Internal,
                &format!("no progress for {waited:?}"),
                TransferError::Timeout(waited),
                now,
            );
        }
    }

    /// When a transfer that has made no progress since is failed. A pull
    /// served by granting sees no traffic while the reader moves the bytes,
    /// so it is given the progress timeout plus the time the bytes of all
    /// such serves of this session (`passive`: a reader may work through
    /// them one after another) take at [`PASSIVE_SERVE_FLOOR_BYTES_PER_SEC`]:
    /// long enough for any real reader, and finite, so a peer that never
    /// sends Complete cannot keep the region pinned forever.
    fn progress_deadline(&self, t: &Transfer, passive: u64) -> Instant {
        let mut allowed = self.config.progress_timeout;
        if t.passive() {
            allowed += Duration::from_secs(passive / PASSIVE_SERVE_FLOOR_BYTES_PER_SEC);
        }
        t.last_progress + allowed
    }

    /// Bytes of the pulls this side serves by granting.
    fn passive_bytes(&self) -> u64 {
        self.transfers
            .values()
            .filter(|t| t.passive())
            .map(|t| t.plan.total_bytes())
            .sum()
    }

    fn abort(
        &mut self,
        id: u64,
        code: ErrorCode,
        message: &str,
        error: TransferError,
        _now: Instant,
    ) {
        if self
            .transfers
            .get(&id)
            .is_some_and(|t| matches!(t.kind, TransferKind::PullServe | TransferKind::PushReceive))
        {
            self.ended.remember(id, (code, message.to_string()));
        }
        // Queued even with every rail down: it goes out when one returns, so
        // the peer hears why instead of timing out on a transfer nobody serves.
        self.control
            .push_back((None, abort_message(id, code, message.to_string())));
        self.fail_locally(id, error);
    }

    /// Fails now, or once the slices being placed into our memory have landed.
    fn fail_locally(&mut self, id: u64, error: TransferError) {
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.close_gate();
        if t.placing_now() {
            t.pending_failure = None; // this reason, not an earlier one
            t.fail_when_placed(error);
            return;
        }
        self.finish_failed(id, error);
    }

    fn finish_failed(&mut self, id: u64, error: TransferError) {
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.close_gate();
        if t.placing_now() {
            t.fail_when_placed(error);
            return;
        }
        let Some(mut t) = self.unhold(id) else {
            return;
        };
        self.release_in_flight(&mut t);
        let _ = t.advance(TransferEvent::Abort);
        self.events.push_back(Event::Failed {
            transfer_id: id,
            request_id: t.request_id,
            kind: t.kind,
            region_id: t.selection.region_id,
            error,
            receiver_group: t.receiver_group,
        });
    }

    /// Next thing to write: control messages first, then slices of the oldest
    /// transfer with unsent bytes, each on the rail where it would be acknowledged
    /// soonest (outstanding bytes over estimated rate) among those with window left.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        // With no live connection, control messages wait for a rail to return.
        self.any_alive()?;
        self.fall_back_from_one_sided();
        while let Some((target, msg)) = self.control.pop_front() {
            if let Some(conn) = target
                .filter(|c| self.conns.get(*c).is_some_and(|c| c.alive && !c.one_sided))
                .or_else(|| self.any_alive())
            {
                let opened = match &msg.body {
                    Some(Body::PullOpen(open)) => Some(open.transfer_id),
                    Some(Body::PushOpen(open)) => Some(open.transfer_id),
                    _ => None,
                };
                if let Some(id) = opened {
                    // An open re-queued for a transfer that has since ended
                    // stays unsent.
                    let Some(t) = self.transfers.get_mut(&id) else {
                        continue;
                    };
                    t.open_on = Some(conn);
                }
                return Some(Transmit::Control { conn, msg });
            }
        }
        let fallback_rate = self
            .rails
            .iter()
            .filter_map(|r| r.estimator.rate())
            .fold(1.0, f64::max);
        for (&id, t) in self.transfers.iter_mut() {
            if !t.schedules() || t.pending_failure.is_some() || !t.has_unsent() {
                continue;
            }
            // Granted transfers go one-sided while a granted rail has a queue pair.
            let carrier = match &t.remote {
                Some(g) => {
                    let mask = one_sided_rails(&self.conns, &self.rails, &g.keys);
                    if mask == 0 && t.kind == TransferKind::Pull {
                        continue;
                    }
                    if mask == 0 {
                        Carrier::TwoSided
                    } else {
                        Carrier::OneSided(mask)
                    }
                }
                None => Carrier::TwoSided,
            };
            let (off, avail) = match t.resend.front() {
                Some(&r) => r,
                None => (t.next_offset, t.plan.total_bytes() - t.next_offset),
            };
            if let Some(p) = t.pinned_rail {
                if self.rails.get(p as usize).map(|r| r.health) != Some(RailHealth::Up) {
                    t.pinned_rail = None;
                }
            }
            let pinned = t.pinned_rail;
            let max_slice = if t.staged {
                self.config.staged_slice_bytes
            } else {
                self.config.slice_bytes
            };
            let spread = if t.staged || carrier != Carrier::TwoSided {
                None
            } else {
                Some(Spread {
                    total: t.plan.total_bytes(),
                    min_slice: self.config.spread_min_slice_bytes,
                })
                .filter(|s| s.min_slice > 0)
            };
            let slot_of = |max_slice| Slot {
                pinned,
                avail,
                max_slice,
                carrier,
                spread,
            };
            let mut slot = choose_slot(
                &self.config,
                &self.rails,
                &self.conns,
                slot_of(max_slice),
                fallback_rate,
            );
            if slot.is_none() && max_slice > self.config.slice_bytes {
                // A staged slice does not fit the window left: a host-sized
                // one may (neither this transfer nor those behind it wait).
                slot = choose_slot(
                    &self.config,
                    &self.rails,
                    &self.conns,
                    slot_of(self.config.slice_bytes),
                    fallback_rate,
                );
            }
            let Some((rail, conn, len)) = slot else {
                if pinned.is_some() {
                    // Only its own rail is full; later transfers may use the others.
                    continue;
                }
                return None;
            };
            if t.plan.total_bytes() <= self.config.rails.stripe_threshold {
                t.pinned_rail = Some(rail);
            }
            // A push announces itself on each connection before that connection's first slice.
            let bit = 1u64 << conn;
            if carrier == Carrier::TwoSided && t.announced & bit == 0 {
                if let Some(open) = &t.open_msg {
                    t.announced |= bit;
                    return Some(Transmit::Control {
                        conn,
                        msg: announced_two_sided(open),
                    });
                }
            }
            let retransmit = t.resend.front().is_some();
            if retransmit {
                if let Some(front) = t.resend.front_mut() {
                    // A re-sent range larger than this rail's slices goes out in parts.
                    if front.1 > len {
                        front.0 += len;
                        front.1 -= len;
                    } else {
                        t.resend.pop_front();
                    }
                }
            } else {
                t.next_offset += len;
            }
            let pieces = t
                .plan
                .pieces(off, len)
                .map(|p| p.collect())
                .unwrap_or_default();
            let remote = match (carrier, &t.remote) {
                (Carrier::OneSided(_), Some(g)) => {
                    let key = g.keys.iter().find(|k| k.rail_index == rail).cloned();
                    let pieces = g.plan.pieces(off, len).map(|p| p.collect());
                    match (key, pieces) {
                        (Some(key), Ok(pieces)) => Some(RemoteSlice {
                            op: if t.kind == TransferKind::Pull {
                                OneSidedOp::Read
                            } else {
                                OneSidedOp::Write
                            },
                            key,
                            pieces,
                        }),
                        // one_sided_rails only picks rails with a key, and both plans
                        // hold the same bytes: neither can happen.
                        _ => None,
                    }
                }
                _ => None,
            };
            if t.kind == TransferKind::Pull {
                // Our memory is being written until the READs complete.
                t.placing += 1;
            }
            t.in_flight.push((conn, off, len, now));
            let _ = t.advance(TransferEvent::SliceMoved);
            let region_id = t.selection.region_id;
            self.conns[conn].outstanding += len;
            let r = &mut self.rails[rail as usize];
            if r.outstanding == 0 {
                r.last_progress = now;
                r.estimator.on_busy(now);
            }
            r.outstanding += len;
            r.bytes_sent += len;
            r.slices_sent += 1;
            if retransmit {
                r.slices_retransmitted += 1;
            }
            return Some(Transmit::Slice {
                conn,
                header: SliceHeader {
                    transfer_id: id,
                    offset: off,
                },
                len: len as u32,
                region_id,
                pieces,
                retransmit,
                remote,
            });
        }
        None
    }

    /// Pulls granted one-sided whose queue pairs are all gone ask the peer to send
    /// the bytes over the remaining (two-sided) connections instead.
    fn fall_back_from_one_sided(&mut self) {
        let mut fallen = Vec::new();
        for t in self.transfers.values_mut() {
            let Some(g) = &t.remote else { continue };
            if t.kind != TransferKind::Pull
                || t.placing > 0
                || one_sided_rails(&self.conns, &self.rails, &g.keys) != 0
            {
                continue;
            }
            t.remote = None;
            t.resend.clear();
            if let Some(PeerMessage {
                body: Some(Body::PullOpen(open)),
            }) = &t.open_msg
            {
                let mut open = open.clone();
                open.one_sided = false;
                let open = crate::wire::message(Body::PullOpen(open));
                // A copy re-sent after a cut asks for the same.
                t.open_msg = Some(open.clone());
                fallen.push(open);
            }
        }
        for msg in fallen {
            self.control.push_back((None, msg));
        }
    }

    /// A live connection for control messages, preferring rails that are up.
    fn any_alive(&self) -> Option<ConnId> {
        self.conns
            .iter()
            .position(|c| {
                c.alive && !c.one_sided && self.rails[c.rail as usize].health == RailHealth::Up
            })
            .or_else(|| self.conns.iter().position(|c| c.alive && !c.one_sided))
    }

    /// Next thing to tell workers.
    /// Queues a message to a worker on the peer (any connection carries it).
    pub fn send_message(
        &mut self,
        m: pb::WorkerMessage,
    ) -> Result<(), crate::message::MessageError> {
        crate::message::check(&m)?;
        if self.control.len() >= crate::message::MAX_QUEUED_CONTROL {
            return Err(crate::message::MessageError::Busy(self.control.len()));
        }
        self.control
            .push_back((None, crate::wire::message(Body::WorkerMessage(m))));
        Ok(())
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Bytes placed so far (confirmed by acks on the sending side).
    pub fn progress(&self, transfer_id: u64) -> Option<(TransferState, u64, u64)> {
        self.transfers
            .get(&transfer_id)
            .map(|t| (t.state, t.placed.covered(), t.plan.total_bytes()))
    }
}

/// What a transfer asks of [`choose_slot`].
struct Slot {
    /// Only this rail, if set.
    pinned: Option<RailId>,
    /// Bytes left to place.
    avail: u64,
    /// The transfer's largest slice.
    max_slice: u64,
    carrier: Carrier,
    /// Cut the transfer over the rail's connections (see
    /// `SessionConfig::spread_min_slice_bytes`).
    spread: Option<Spread>,
}

#[derive(Debug, Clone, Copy)]
struct Spread {
    /// The whole transfer's bytes (every slice the same size).
    total: u64,
    min_slice: u64,
}

impl Spread {
    /// The slice for a rail with `live` connections: the transfer's share of
    /// each, at least `min_slice`, on 4 KiB.
    fn slice(self, live: u64) -> u64 {
        let share = self.total.div_ceil(live.max(1)).next_multiple_of(4 << 10);
        share.max(self.min_slice)
    }
}

/// The rail, connection and slice length for the next `avail` bytes: among up
/// rails (only `pinned` if set) with window left, the one that would finish
/// the slice soonest at its estimated rate.
fn choose_slot(
    config: &SessionConfig,
    rails: &[Rail],
    conns: &[Conn],
    slot: Slot,
    fallback_rate: f64,
) -> Option<(RailId, ConnId, u64)> {
    let Slot {
        pinned,
        avail,
        max_slice,
        carrier,
        spread,
    } = slot;
    let cfg = &config.rails;
    let conn_window = config.window_bytes;
    let mut best: Option<(f64, RailId, ConnId, u64)> = None;
    for r in rails {
        if r.health != RailHealth::Up || pinned.is_some_and(|p| p != r.id) {
            continue;
        }
        let live = live_on(conns, r.id)
            .filter(|&i| carrier.carries(&conns[i]))
            .count() as u64;
        if live == 0 {
            continue;
        }
        let mut len = avail.min(r.slice_len(cfg, max_slice));
        if let Some(spread) = spread {
            len = len.min(spread.slice(live));
        }
        let window = r.window(cfg, live * conn_window, len);
        if r.outstanding > 0 && r.outstanding + len > window {
            continue;
        }
        let Some(conn) = pick_connection(conns, r.id, len, conn_window, carrier) else {
            continue;
        };
        let finish = (r.outstanding + len) as f64 / r.assumed_rate(fallback_rate);
        if best.is_none_or(|(f, ..)| finish < f) {
            best = Some((finish, r.id, conn, len));
        }
    }
    best.map(|(_, rail, conn, len)| (rail, conn, len))
}

/// Live connections of `rail`.
fn live_on(conns: &[Conn], rail: RailId) -> impl Iterator<Item = ConnId> + '_ {
    conns
        .iter()
        .enumerate()
        .filter(move |(_, c)| c.alive && c.rail == rail)
        .map(|(i, _)| i)
}

/// Least-loaded live connection of `rail` whose window still takes `len` more
/// bytes (an idle connection always takes one slice, however large).
fn pick_connection(
    conns: &[Conn],
    rail: RailId,
    len: u64,
    window: u64,
    carrier: Carrier,
) -> Option<ConnId> {
    live_on(conns, rail)
        .filter(|&i| carrier.carries(&conns[i]))
        .filter(|&i| conns[i].outstanding == 0 || conns[i].outstanding + len <= window)
        .min_by_key(|&i| (conns[i].outstanding, i))
}

/// Which connections may carry a transfer's slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrier {
    /// Framed slices on stream connections.
    TwoSided,
    /// Queue pairs on the rails of this bit mask.
    OneSided(u64),
}

impl Carrier {
    fn carries(self, c: &Conn) -> bool {
        match self {
            Carrier::TwoSided => !c.one_sided,
            Carrier::OneSided(mask) => c.one_sided && c.rail < 64 && mask & (1 << c.rail) != 0,
        }
    }
}

/// Bit mask of up rails that have a live one-sided connection and a granted key.
fn one_sided_rails(conns: &[Conn], rails: &[Rail], keys: &[pb::MemoryKey]) -> u64 {
    let mut mask = 0u64;
    for c in conns
        .iter()
        .filter(|c| c.alive && c.one_sided && c.rail < 64)
    {
        let up = rails
            .get(c.rail as usize)
            .is_some_and(|r| r.health == RailHealth::Up);
        if up && keys.iter().any(|k| k.rail_index == c.rail) {
            mask |= 1 << c.rail;
        }
    }
    mask
}

/// A push's open as announced before its two-sided slices: a push granted
/// one-sided that now travels two-sided (its queue pairs went) does not ask
/// the receiver for a grant again on every connection.
fn announced_two_sided(open: &PeerMessage) -> PeerMessage {
    match &open.body {
        Some(Body::PushOpen(o)) if o.one_sided => {
            let mut o = o.clone();
            o.one_sided = false;
            crate::wire::message(Body::PushOpen(o))
        }
        _ => open.clone(),
    }
}

fn abort_message(transfer_id: u64, code: ErrorCode, message: String) -> PeerMessage {
    crate::wire::message(Body::Abort(pb::Abort {
        transfer_id,
        code: code as i32,
        message,
    }))
}

fn grant_message(transfer_id: u64, region: &RegionAccess, keys: Vec<pb::MemoryKey>) -> PeerMessage {
    crate::wire::message(Body::Grant(pb::Grant {
        transfer_id,
        layout: Some(layout_message(&region.layout)),
        keys,
        geometry: region.geometry.as_deref().map(KvGeometry::to_wire),
    }))
}

fn layout_message(l: &RegionLayout) -> pb::Layout {
    pb::Layout {
        num_layers: l.num_layers,
        planes_per_layer: l.planes_per_layer,
        num_blocks: l.num_blocks,
        block_bytes: l.block_bytes,
        base_offset: l.base_offset,
        layer_stride: l.layer_stride,
        plane_stride: l.plane_stride,
        block_stride: l.block_stride,
    }
}

fn layout_of(l: &pb::Layout) -> RegionLayout {
    RegionLayout {
        num_layers: l.num_layers,
        planes_per_layer: l.planes_per_layer,
        num_blocks: l.num_blocks,
        block_bytes: l.block_bytes,
        base_offset: l.base_offset,
        layer_stride: l.layer_stride,
        plane_stride: l.plane_stride,
        block_stride: l.block_stride,
    }
}

fn into_block_set(sel: BlockSelection) -> pb::BlockSet {
    pb::BlockSet {
        region_id: sel.region_id,
        layer_start: sel.layer_start,
        layer_count: sel.layer_count,
        block_ids: sel.block_ids,
        generations: sel.generations,
        slice: sel.slice.map(HeadSlice::to_wire),
        first_token: sel.first_token,
    }
}

/// The heap a selection's ids and generations take.
fn selection_bytes(sel: &BlockSelection) -> u64 {
    4 * sel.block_ids.len() as u64 + 8 * sel.generations.len() as u64
}

/// The peer's blocks, as this side's open names them.
fn remote_blocks(open: Option<&PeerMessage>) -> BlockSelection {
    match open.and_then(|m| m.body.as_ref()) {
        Some(Body::PushOpen(o)) => selection_of(o.destination.as_ref()),
        Some(Body::PullOpen(o)) => selection_of(o.source.as_ref()),
        _ => BlockSelection::default(),
    }
}

/// The transfer an open (a `PushOpen` or `PullOpen`) opens.
fn open_id(m: &PeerMessage) -> Option<u64> {
    match m.body.as_ref()? {
        Body::PushOpen(o) => Some(o.transfer_id),
        Body::PullOpen(o) => Some(o.transfer_id),
        _ => None,
    }
}

fn selection_of(set: Option<&pb::BlockSet>) -> BlockSelection {
    set.map(|s| BlockSelection {
        region_id: s.region_id,
        layer_start: s.layer_start,
        layer_count: s.layer_count,
        block_ids: s.block_ids.clone(),
        generations: s.generations.clone(),
        slice: s.slice.as_ref().map(HeadSlice::from_wire),
        first_token: s.first_token,
    })
    .unwrap_or_default()
}

/// Whether a peer's region (as its open describes it) and ours can exchange
/// `selection`: when both carry a geometry they must agree (whole blocks: in
/// everything; head slices: in the model, dtype and head shape), and a head
/// slice needs both.
fn check_peer_geometry(
    selection: &BlockSelection,
    ours: Option<&KvGeometry>,
    sent: Option<&pb::KvGeometry>,
) -> Result<(), PlanError> {
    let theirs = sent.map(KvGeometry::from_wire).transpose()?;
    match (ours, theirs) {
        (Some(ours), Some(theirs)) => {
            Ok(ours.check_compatible(&theirs, selection.slice.is_none())?)
        }
        (_, None) if selection.slice.is_some() => Err(PlanError::Slice(
            "the peer's region was registered without its KV geometry".into(),
        )),
        _ => Ok(()),
    }
}

/// What a peer's open said of its region's geometry.
#[derive(Clone, Copy)]
enum PeerGeometry<'a> {
    /// As its open sent it (compared with ours before anything is built).
    Sent(Option<&'a pb::KvGeometry>),
    /// Already compared when the transfer was opened.
    Compared,
}

/// Validates a peer's request against our region: the plan, or the code and reason to refuse.
fn accept_plan(
    selection: &BlockSelection,
    block_bytes: u64,
    total_bytes: u64,
    access: Access,
    regions: &dyn RegionDirectory,
    peer: PeerGeometry<'_>,
) -> Result<(Plan, RegionAccess), (ErrorCode, String)> {
    let region = regions.lookup(selection.region_id).ok_or_else(|| {
        (
            ErrorCode::UnknownRegion,
            format!("region {} is not registered", selection.region_id),
        )
    })?;
    if access == Access::Read && !region.exposed {
        return Err((
            ErrorCode::NotExposed,
            format!("region {} is not exposed to peers", selection.region_id),
        ));
    }
    if let PeerGeometry::Sent(sent) = peer {
        check_peer_geometry(selection, region.geometry.as_deref(), sent)
            .map_err(|e| (e.wire_code(), e.to_string()))?;
    }
    let plan = Plan::build_for(
        &region.layout,
        region.geometry.as_deref(),
        selection,
        access,
    )
    .map_err(|e| (e.wire_code(), e.to_string()))?;
    regions
        .check_generations(selection)
        .map_err(|why| (ErrorCode::BlocksReleased, why))?;
    if plan.total_bytes() != total_bytes || plan.block_bytes() != block_bytes {
        let e = PlanError::SizeMismatch {
            source_bytes: total_bytes,
            source_block: block_bytes,
            dest_bytes: plan.total_bytes(),
            dest_block: plan.block_bytes(),
        };
        return Err((e.wire_code(), e.to_string()));
    }
    Ok((plan, region))
}

#[cfg(test)]
mod lifecycle_tests {
    use super::*;

    #[test]
    fn an_illegal_transition_is_an_error_the_session_counts() {
        let layout = RegionLayout::dense(1, 1, 2, 64);
        let selection = crate::testkit::sel(1, (0, 1), &[0]);
        let plan = Plan::build(&layout, &selection, Access::Read).expect("plan");
        let now = Instant::now();
        let mut t = Transfer::new("r".into(), TransferKind::Push, selection, plan, now);
        // Nothing moved yet: "every byte placed" is not a way out of Queued.
        assert_eq!(
            t.advance(TransferEvent::AllPlaced),
            Err(InvalidTransition {
                from: TransferState::Queued,
                event: TransferEvent::AllPlaced
            })
        );
        assert_eq!(t.state, TransferState::Queued, "the state stays put");
        assert_eq!(
            t.advance(TransferEvent::SliceMoved),
            Ok(TransferState::InFlight)
        );
        assert_eq!(t.advance(TransferEvent::AllPlaced), Ok(TransferState::Done));
        assert!(
            t.advance(TransferEvent::Abort).is_err(),
            "nothing leaves Done"
        );
        let mut session = Session::new(SessionConfig::default());
        session.hold(7, t, 0);
        assert_eq!(session.invalid_transitions(), 2);
        session.unhold(7);
        assert_eq!(
            session.invalid_transitions(),
            2,
            "kept once the transfer ended"
        );
    }
}
