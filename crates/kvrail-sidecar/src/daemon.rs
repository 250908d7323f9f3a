//! Wires the parts together: regions, peers, transports, the API and metrics.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dial::{random_nonce, IdentityCredentials};
use dashmap::DashMap;
use kvrail_auth::Identity;
use kvrail_core::handshake::{
    admit_session, Acceptor, AcceptorConfig, AcceptorStep, Credentials, HandshakeError,
    HeldSession, SessionAdmission,
};
use kvrail_core::rail_setup::{self, RdmaStep, SetupVerdict};
use kvrail_core::wire::{self, pb, Body, ErrorCode, PROTOCOL_VERSION};
use kvrail_core::{Event, RailId, SessionConfig, TransferKind};
use kvrail_proto::{Failure, FailureSide, Notification, NotificationKind, TransferState};
use kvrail_transport::ratelog::RateLimitedLog;
use kvrail_transport::{read_handshake_frame, Connection, Frame, Transport};
use tracing::{debug, info, warn};

use crate::busy_poll::BusyPoll;
use crate::config::{Config, PeerConfig};
use crate::gpu::GpuDevices;
use crate::link::{DialInfo, LinkEnv, PeerLink, ProbeFuture};
use crate::metrics as m;
use crate::notify::NotificationHub;
use crate::rdma::RdmaRails;
use crate::regions::Registry;
use crate::transfers::TransferTable;

/// Handshakes one listener runs at once; more connections are closed at once.
pub(crate) const MAX_CONCURRENT_HANDSHAKES: usize = 64;
/// Inbound sessions one peer node may hold at once (a dialer has one per
/// peer; a restart or a doctor run adds one briefly).
pub(crate) const MAX_INBOUND_SESSIONS_PER_PEER: usize = 8;

/// Nodes whose replaced incarnations are remembered (as many as membership
/// holds members).
pub(crate) const MAX_RETIRED_NODES: usize = kvrail_core::membership::MAX_MEMBERS;
/// Longest a handshake reply may take to write (a peer that does not read).
const HANDSHAKE_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest refusal text sent back or logged.
const MAX_REFUSAL_CHARS: usize = 300;

/// Longest connect attempt of a probe rebuilding a down rail.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub use crate::dial::DialError;

pub use crate::peer_table::{LinkNow, PeerSlot, PeerTable};

/// State every task shares.
pub struct Shared {
    pub config: Config,
    pub registry: Registry,
    pub hub: NotificationHub,
    pub transfers: TransferTable,
    /// Transfers that complete as one (`TransferGroup`).
    pub groups: crate::groups::Groups<(String, Failure)>,
    /// Pushes received into a worker's regions it hears of as one.
    pub receiver_groups: crate::receiver_groups::ReceiverGroups,
    /// Static peers and those membership found (`peer_table`).
    pub peers: PeerTable,
    pub inbound: DashMap<(String, u64), Arc<PeerLink>>,
    /// Per peer node, incarnations of its processes that newer ones replaced
    /// (the last few): their new sessions are refused.
    pub retired_incarnations: DashMap<String, Vec<u64>>,
    /// Stream transports (quic, tcp) in our order of preference.
    pub transports: Vec<Arc<dyn Transport>>,
    pub rdma: RdmaRails,
    /// This node's certificate and key (`tls_dir`), if it has them.
    pub identity: Option<Arc<Identity>>,
    /// GPUs opened for workers' device regions.
    pub gpus: GpuDevices,
    /// Worker processes whose exit we watch (to drop their regions).
    pub(crate) watched_workers: DashMap<i32, ()>,
    /// Memory open transfers hold over every session (`max_transfer_state_bytes`)...
    pub transfer_budget: Arc<kvrail_core::budget::MemoryBudget>,
    /// ...and per peer node, over that peer's sessions (only configured
    /// peers' names can have sessions).
    pub peer_budgets: DashMap<String, Arc<kvrail_core::budget::MemoryBudget>>,
    /// Files worker processes asked to have removed when they exit.
    pub exit_files: crate::exit_files::ExitFiles,
    pub(crate) next_transfer: AtomicU64,
    /// Refused handshakes are logged a few per second at most.
    pub refusal_log: RateLimitedLog,
    /// Random per start of this process (never 0): sent in every handshake.
    pub incarnation: u64,
    /// Keeps a runtime worker polling while traffic is recent.
    pub busy_poll: Arc<BusyPoll>,
    /// etcd membership, when `etcd_endpoints` are configured.
    pub membership: std::sync::OnceLock<Arc<crate::membership::Membership>>,
    /// Per QUIC listener (by its address): connections each of its
    /// receiving sockets carries, reported as a gauge.
    pub socket_loads: std::sync::Mutex<Vec<(String, kvrail_transport::SocketLoads)>>,
}

/// Why blocks cannot be released.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("unknown region {0}")]
    UnknownRegion(u64),
    #[error("block {block} out of range (region has {num_blocks}); nothing was released")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    /// Released, and the transfers failed, but bytes of them were still being
    /// copied after the limit: the blocks must not be reused yet.
    #[error("the blocks were released and their transfers failed, but on {links} peer link(s) bytes were still being copied after {waited:?}; do not reuse the blocks yet (release them again to wait again)")]
    StillMoving { links: usize, waited: Duration },
}

/// How long ReleaseBlocks waits for copies of failed transfers to stop.
const RELEASE_SETTLE_LIMIT: Duration = Duration::from_secs(5);

/// A short list of block ids for messages: the first few, then how many more.
fn summarize_blocks(blocks: &[u32]) -> String {
    const SHOWN: usize = 8;
    let head: Vec<String> = blocks.iter().take(SHOWN).map(u32::to_string).collect();
    if blocks.len() > SHOWN {
        format!("{} and {} more", head.join(","), blocks.len() - SHOWN)
    } else {
        head.join(",")
    }
}

/// Why a region could not be unregistered.
#[derive(Debug, thiserror::Error)]
pub enum UnregisterError {
    #[error("unknown region")]
    Unknown,
    #[error("region has transfers in flight")]
    InUse,
    #[error("region's bytes are still held by a sender (try again shortly)")]
    Held,
}

impl Shared {
    /// This daemon as its links see it.
    fn link_env(self: &Arc<Self>) -> std::sync::Weak<crate::link::Env> {
        let weak: std::sync::Weak<Shared> = Arc::downgrade(self);
        weak
    }

    /// The transfer-state budget shared by every session with `peer` (half
    /// the node's: one peer, over all its sessions, cannot take it all).
    fn peer_budget(&self, peer: &str) -> Arc<kvrail_core::budget::MemoryBudget> {
        self.peer_budgets
            .entry(peer.to_string())
            .or_insert_with(|| {
                Arc::new(kvrail_core::budget::MemoryBudget::new(
                    self.transfer_budget.max() / 2,
                ))
            })
            .clone()
    }

    /// Session settings for a session with `peer`; `dialer` sessions rebuild
    /// down rails themselves.
    pub fn session_config(&self, peer: &str, dialer: bool) -> SessionConfig {
        SessionConfig {
            slice_bytes: self.config.slice_bytes,
            window_bytes: self.config.window_bytes,
            progress_timeout: self.config.progress_timeout(),
            rails: self.config.rail_config(),
            probes_rails: dialer,
            eager_max_bytes: self.config.rdma_eager_max_bytes,
            spread_min_slice_bytes: self.config.spread_min_slice_bytes(),
            staged_slice_bytes: self.config.staged_slice_bytes(),
            peer_budget: self.peer_budget(peer),
            node_budget: self.transfer_budget.clone(),
        }
    }

    /// The identity TCP handshakes over `transport` are authenticated with; None
    /// for other transports (QUIC's TLS did it) and with `insecure`.
    fn tcp_identity(&self, transport: &str) -> Option<&Identity> {
        match (transport, self.config.insecure) {
            ("tcp", false) => self.identity.as_deref(),
            _ => None,
        }
    }

    /// Our stream transport called `name`.
    pub fn transport(&self, name: &str) -> Option<&Arc<dyn Transport>> {
        self.transports.iter().find(|t| t.name() == name)
    }

    /// What we offer in handshakes, best first: "rdma" when a rail has a device.
    pub fn offered_transports(&self) -> Vec<String> {
        self.config
            .transport_order()
            .iter()
            .filter(|t| match t.as_str() {
                "rdma" => self.rdma.any(),
                other => self.transport(other).is_some(),
            })
            .cloned()
            .collect()
    }

    pub fn next_transfer_id(&self) -> u64 {
        self.next_transfer.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Drops a region (its RDMA registration and mapping, or its GPU import).
    pub fn unregister_region(&self, id: u64) -> Result<(), UnregisterError> {
        let Some(region) = self.registry.get(id) else {
            return Err(UnregisterError::Unknown);
        };
        if self.region_in_use(id) {
            return Err(UnregisterError::InUse);
        }
        if region
            .memory
            .shared_host()
            .is_some_and(|m| Arc::strong_count(m) > 1)
        {
            // A zero-copy writer still holds views of it; the worker could
            // truncate the file under them once it is unregistered.
            return Err(UnregisterError::Held);
        }
        self.rdma.unregister_region(id);
        self.registry.remove(id);
        m::regions_registered().set(self.registry.len() as f64);
        Ok(())
    }

    /// A worker released blocks of its region: their generations move on, then
    /// every session fails the transfers that name them. Bumping first, then
    /// visiting each session under its lock, leaves no gap: a transfer opened
    /// concurrently either checks its generations after the bump (and is
    /// refused) or is already in the session when it is visited (and fails).
    pub async fn release_blocks(
        &self,
        region_id: u64,
        blocks: &[u32],
    ) -> Result<(Vec<u64>, usize), ReleaseError> {
        let region = self
            .registry
            .get(region_id)
            .ok_or(ReleaseError::UnknownRegion(region_id))?;
        let generations =
            region
                .release(blocks)
                .map_err(|block| ReleaseError::BlockOutOfRange {
                    block,
                    num_blocks: region.layout.num_blocks,
                })?;
        let why = format!(
            "blocks {} of region {region_id} were released by worker {:?}",
            summarize_blocks(blocks),
            region.worker_id
        );
        let mut links: Vec<Arc<PeerLink>> =
            self.inbound.iter().map(|l| l.value().clone()).collect();
        for slot in self.peers.values() {
            // A slot being dialed holds no transfer yet: those start after the
            // dial, under the session lock, and check generations there.
            links.extend(slot.link_now().link());
        }
        let mut failed = 0;
        let mut unsettled = 0;
        for link in links {
            let (n, settled) = link
                .release_blocks(region_id, blocks, &why, RELEASE_SETTLE_LIMIT)
                .await;
            failed += n;
            unsettled += usize::from(!settled);
        }
        if unsettled > 0 {
            return Err(ReleaseError::StillMoving {
                links: unsettled,
                waited: RELEASE_SETTLE_LIMIT,
            });
        }
        Ok((generations, failed))
    }

    /// Whether any session still moves bytes of this region.
    pub fn region_in_use(&self, region_id: u64) -> bool {
        let inbound = self
            .inbound
            .iter()
            .any(|l| l.inspect(|s| s.uses_region(region_id)));
        let outbound = self.peers.values().iter().any(|p| match p.link_now() {
            LinkNow::Up(l) => l.inspect(|s| s.uses_region(region_id)),
            LinkNow::None => false,
            // Being dialed right now: be conservative.
            LinkNow::Dialing => true,
        });
        inbound || outbound
    }

    /// Whether `peer` is known, asking etcd now if membership runs (a name
    /// its watch has not brought yet).
    pub async fn resolve_peer(self: &Arc<Self>, peer: &str) -> bool {
        if self.peers.contains_key(peer) {
            return true;
        }
        match self.membership.get() {
            Some(m) => {
                m.lookup(peer).await;
                self.peers.contains_key(peer)
            }
            None => false,
        }
    }

    /// The live outbound link to `peer`, dialing it if needed.
    pub async fn outbound_link(
        self: &Arc<Self>,
        peer: &str,
    ) -> Result<Option<Arc<PeerLink>>, DialError> {
        let Some(slot) = self.peers.get(peer) else {
            return Ok(None);
        };
        let mut guard = slot.link.lock().await;
        if let Some(link) = guard.as_ref().filter(|l| l.is_alive()) {
            // Fail fast rather than queue behind rails that stayed dead past the deadline.
            if link.is_dead() {
                return Err(DialError::RailsDown {
                    peer: peer.to_string(),
                    causes: link.rail_causes(),
                });
            }
            return Ok(Some(link.clone()));
        }
        let link = self.dial(&slot.config).await?;
        *guard = Some(link.clone());
        Ok(Some(link))
    }

    /// Dials `peer` over our stream transports in order of preference: the first
    /// that reaches it carries the session (and RDMA, if both sides have it).
    async fn dial(self: &Arc<Self>, peer: &PeerConfig) -> Result<Arc<PeerLink>, DialError> {
        let mut skipped = Vec::new();
        let mut last = None;
        for transport in &self.transports {
            match self.dial_over(peer, transport.name()).await {
                Ok((link, rdma)) => {
                    self.log_choice(peer, &link, &skipped, &rdma);
                    return Ok(link);
                }
                Err(e @ DialError::Refused { .. }) => return Err(e),
                Err(e) => {
                    skipped.push(format!("{}: {e}", transport.name()));
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| DialError::Unreachable {
            peer: peer.name.clone(),
            reasons: "no transport configured".into(),
        }))
    }

    /// Logs and exports which transport a peer pair uses, and why.
    fn log_choice(&self, peer: &PeerConfig, link: &PeerLink, skipped: &[String], rdma: &[String]) {
        let rdma_rails = rdma.iter().filter(|r| r.starts_with("rdma")).count();
        let chosen = if rdma_rails > 0 {
            "rdma"
        } else {
            link.transport
        };
        let mut why = vec![format!("order {:?}", self.config.transport_order())];
        why.extend(skipped.iter().cloned());
        why.extend(rdma.iter().cloned());
        info!(peer = %peer.name, transport = chosen, stream = link.transport, reason = %why.join("; "), "transport chosen for peer");
        for t in ["rdma", "quic", "tcp"] {
            m::peer_transport(&peer.name, t).set(if t == chosen { 1.0 } else { 0.0 });
        }
    }

    /// One dial attempt over one stream transport; per rail, what came of RDMA.
    async fn dial_over(
        self: &Arc<Self>,
        peer: &PeerConfig,
        transport: &'static str,
    ) -> Result<(Arc<PeerLink>, Vec<String>), DialError> {
        let dial = DialInfo {
            peer: peer.clone(),
            session_id: rand::random(),
            peer_incarnation: Arc::default(),
        };
        let link = PeerLink::new(
            &peer.name,
            transport,
            self.link_env(),
            self.session_config(&peer.name, true),
            Some(dial.clone()),
        );
        let mut reasons = Vec::new();
        let mut rdma = Vec::new();
        for rail in 0..peer.rails.len() as RailId {
            match self.dial_rail(&link, &dial, rail, false).await {
                Ok(note) => rdma.extend(note),
                Err(DialError::Refused { reason, .. }) => {
                    link.close("handshake refused");
                    return Err(DialError::Refused {
                        peer: peer.name.clone(),
                        reason,
                    });
                }
                Err(e) => {
                    // Probing brings the rail in later.
                    link.rail_unreachable(rail, &e.to_string());
                    reasons.push(format!("rail {rail}: {e}"));
                }
            }
        }
        if link.alive_connections() == 0 {
            link.close("no rail reachable");
            return Err(DialError::Unreachable {
                peer: peer.name.clone(),
                reasons: reasons.join("; "),
            });
        }
        for r in &reasons {
            warn!(peer = %peer.name, "rail unavailable: {r}");
        }
        info!(peer = %peer.name, connections = link.alive_connections(), transport, "connected to peer");
        Ok((link, rdma))
    }

    /// Opens `connections_per_rail` connections on one rail of an outbound link. The
    /// first one (connection index 0) tells the acceptor to drop whatever it still
    /// holds on that rail. Fails if not even the first connection comes up. Says
    /// what came of RDMA on the rail, when it was considered.
    pub async fn dial_rail(
        &self,
        link: &Arc<PeerLink>,
        dial: &DialInfo,
        rail: RailId,
        probing: bool,
    ) -> Result<Option<String>, DialError> {
        let transport = self
            .transport(link.transport)
            .ok_or_else(|| DialError::Unreachable {
                peer: dial.peer.name.clone(),
                reasons: format!("transport {} is not enabled here", link.transport),
            })?
            .clone();
        let (peer, session_id) = (&dial.peer, dial.session_id);
        let unreachable = |reasons: String| DialError::Unreachable {
            peer: peer.name.clone(),
            reasons,
        };
        let addr = *peer
            .rails
            .get(rail as usize)
            .ok_or_else(|| unreachable(format!("no rail {rail} configured")))?;
        let local = self
            .config
            .listen
            .get(rail as usize)
            .filter(|a| !a.ip().is_unspecified() && !a.ip().is_loopback())
            .map(|a| SocketAddr::new(a.ip(), 0));
        // A probe must not hold a rail hostage for the full connect timeout.
        let timeout = if probing {
            self.config.connect_timeout().min(PROBE_TIMEOUT)
        } else {
            self.config.connect_timeout()
        };
        let mut first = None;
        let mut attached = Vec::new();
        let mut peer_offers = Vec::new();
        for index in 0..self.config.connections_per_rail {
            let hello = pb::Hello {
                protocol_version: u32::from(PROTOCOL_VERSION),
                node_name: self.config.node.clone(),
                session_id,
                rail_index: rail,
                connection_index: index as u32,
                transports: self.offered_transports(),
                rail_count: peer.rails.len() as u32,
                expected_peer: peer.name.clone(),
                rail_local_addr: local.map(|a| a.ip().to_string()).unwrap_or_default(),
                rail_peer_addr: addr.to_string(),
                incarnation: self.incarnation,
                ..Default::default()
            };
            let expected_cert = peer.cert_sha256.as_deref();
            match self
                .dial_one(&transport, local, addr, hello, timeout, expected_cert)
                .await
            {
                Ok((conn, ack)) if peer.incarnation.is_some_and(|i| i != ack.incarnation) => {
                    drop(conn);
                    return Err(DialError::Refused {
                        peer: peer.name.clone(),
                        reason: format!(
                            "the process answering at {addr} ({:#x}) is not the one registered for {} ({:#x})",
                            ack.incarnation,
                            peer.name,
                            peer.incarnation.unwrap_or_default()
                        ),
                    });
                }
                Ok((conn, ack)) if !link.same_peer_incarnation(ack.incarnation) => {
                    drop(conn);
                    return Err(DialError::Refused {
                        peer: peer.name.clone(),
                        reason: "the peer restarted; this session's transfers failed and a new session starts".into(),
                    });
                }
                Ok((conn, ack)) => match link.attach(conn, rail) {
                    Some(id) => {
                        first.get_or_insert(id);
                        attached.push(id);
                        peer_offers = ack.transports;
                    }
                    None => return Err(unreachable("session is closed or full".into())),
                },
                Err(e) if index == 0 => return Err(e),
                Err(e) => {
                    // Fewer connections on this rail is still a working rail.
                    warn!(peer = %peer.name, rail, "extra connection failed: {e}");
                    break;
                }
            }
        }
        let lost = probing
            .then(|| rail_setup::lost_while_rebuilt(&attached, |id| link.is_live(id)))
            .flatten();
        if let Some(lost) = lost {
            let reason = format!(
                "{lost} of {} new connections closed while the rail was rebuilt",
                attached.len()
            );
            link.retire_rail(rail);
            link.rail_unreachable(rail, &reason);
            return Err(unreachable(reason));
        }
        let stream = link.transport;
        let on_rail = rail_setup::RdmaOnRail {
            rail,
            rdma_first: self.config.rank("rdma") < self.config.rank(stream),
            device: self
                .rdma
                .device(rail)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            first,
            peer_offers: &peer_offers,
            setup_under_way: link.rdma_setup_under_way(rail),
        };
        let note = match on_rail.step() {
            RdmaStep::Skip => None,
            RdmaStep::StreamsOnly(why) => Some(why),
            RdmaStep::AwaitEarlierSetup(why) => {
                // Should that setup fail for good, the rebuild sets the rail up.
                link.spawn_rdma_rebuild(rail);
                Some(why)
            }
            RdmaStep::SetUp(first) => {
                // Queue pairs ride on the rail's first connection; the stream
                // transport carries on without them.
                let outcome = link.setup_rdma(rail, first).await;
                let qps = outcome.as_ref().map_or(0, |n| *n);
                let verdict = rail_setup::judge_setup(
                    rail,
                    outcome.map_err(|e| (e.to_string(), e.declined_by_peer())),
                );
                Some(match verdict {
                    SetupVerdict::Connected(note) => {
                        info!(peer = %peer.name, rail, qps, "RDMA queue pairs connected");
                        note
                    }
                    SetupVerdict::Declined(note) => {
                        info!(peer = %peer.name, rail, "RDMA not used on this rail, {stream} only: {note}");
                        note
                    }
                    SetupVerdict::Rebuild(note) => {
                        warn!(peer = %peer.name, rail, "{stream} until the queue pairs are rebuilt: {note}");
                        link.spawn_rdma_rebuild(rail);
                        note
                    }
                })
            }
        };
        Ok(note)
    }

    /// One connection and its handshake; the acceptor's answer.
    async fn dial_one(
        &self,
        transport: &Arc<dyn Transport>,
        local: Option<SocketAddr>,
        addr: SocketAddr,
        hello: pb::Hello,
        connect_timeout: Duration,
        expected_cert: Option<&str>,
    ) -> Result<(Connection, pb::HelloAck), DialError> {
        let identity = self.tcp_identity(transport.name());
        crate::dial::handshake(
            transport,
            identity,
            local,
            addr,
            hello,
            connect_timeout,
            expected_cert,
        )
        .await
    }

    /// Handshakes one accepted connection and attaches it to its session.
    pub(crate) async fn accept_one(
        self: Arc<Self>,
        transport: &'static str,
        mut conn: Connection,
        from: SocketAddr,
        spoke: Arc<std::sync::atomic::AtomicBool>,
    ) {
        let offered = self.offered_transports();
        let known = |name: &str| self.peers.contains_key(name);
        let tls_certificate = conn.peer_certificate.clone();
        // TLS proved the certificate is from our CA; it must also be this node's.
        let tls_name_check = |claimed: &str| match &tls_certificate {
            Some(cert) => kvrail_auth::check_name(cert, claimed),
            // QUIC requires a client certificate, so this cannot happen
            // unless that configuration changes: refuse rather than trust.
            None if transport == "quic" => {
                Err("the QUIC connection carries no client certificate".to_string())
            }
            // TCP proves the name with the hello's signature instead.
            None => Ok(()),
        };
        let identity = self.tcp_identity(transport).map(IdentityCredentials);
        // The session cap, before anything is answered: a refused dialer
        // hears why instead of an ack and a close.
        let admit = |hello: &pb::Hello| {
            self.check_registered(hello, tls_certificate.as_deref())?;
            match self.admission(hello) {
                SessionAdmission::Refuse(e) => Err(e),
                _ => Ok(()),
            }
        };
        let mut acceptor = Acceptor::new(
            AcceptorConfig {
                node: &self.config.node,
                rail_count: self.config.listen.len() as u32,
                transports: &offered,
                is_known_peer: &known,
                tls_name_check: Some(&tls_name_check),
                credentials: identity.as_ref().map(|c| c as &dyn Credentials),
                nonce: random_nonce(),
                incarnation: self.incarnation,
                software: env!("CARGO_PKG_VERSION"),
                admit: Some(&admit),
            },
            tokio::time::Instant::now().into_std(),
        );
        let hello = loop {
            let message = tokio::time::timeout_at(
                acceptor.deadline().into(),
                read_handshake_frame(conn.reader.as_mut()),
            )
            .await;
            let now = tokio::time::Instant::now().into_std();
            if matches!(message, Ok(Ok(_))) {
                // No longer evictable (see `startup::accept_loop`).
                spoke.store(true, std::sync::atomic::Ordering::Release);
            }
            if let Ok(Ok(Frame::Control(Body::Hello(hello)))) = &message {
                // A node that registered a moment ago: etcd knows it before
                // our watch says so.
                self.resolve_peer(&hello.node_name).await;
            }
            let step = match message {
                Err(_) => acceptor.on_timeout(),
                Ok(Ok(Frame::Control(body))) => acceptor.on_message(Ok(body), now),
                Ok(Ok(_)) => acceptor.on_data_frame(),
                Ok(Err(e)) => acceptor.on_message(Err(e.to_string()), now),
            };
            let (mut ack, accepted) = match step {
                AcceptorStep::Refuse(e) => {
                    return self
                        .refuse(conn, from, e.to_string(), e.label(), e.code())
                        .await
                }
                AcceptorStep::Accept(hello) => break hello,
                AcceptorStep::AnswerThenAwaitProof(ack) => (ack, None),
                AcceptorStep::AnswerAndAccept(ack, hello) => (ack, Some(hello)),
            };
            ack.rail_mtu = self
                .config
                .listen
                .get(ack.rail_index as usize)
                .and_then(|a| crate::netinfo::mtu_of_address(a.ip()))
                .unwrap_or(0);
            let frame = wire::encode_control(&wire::message(Body::HelloAck(ack)));
            // A peer that does not read must not hold the task (and its buffers).
            let wrote =
                tokio::time::timeout(HANDSHAKE_WRITE_TIMEOUT, conn.writer.write_control(&frame))
                    .await;
            if !matches!(wrote, Ok(Ok(()))) {
                return;
            }
            if let Some(hello) = accepted {
                break hello;
            }
            acceptor.answered(tokio::time::Instant::now().into_std());
        };
        if hello.probe {
            // `kvrail doctor`: every check passed; nothing to attach.
            info!(peer = %hello.node_name, rail = hello.rail_index, %from, "answered a doctor probe");
            let _ = conn.writer.close().await;
            return;
        }
        let key = (hello.node_name.clone(), hello.session_id);
        // Decided again now that the dialer is who it says (the proof came
        // after the first decision): sessions it replaces are closed.
        match self.admission(&hello) {
            SessionAdmission::Join => {}
            SessionAdmission::Refuse(e) => {
                return self
                    .refuse(conn, from, e.to_string(), e.label(), e.code())
                    .await
            }
            SessionAdmission::New { replace } => {
                for old in replace {
                    let Some((_, link)) = self.inbound.remove(&(hello.node_name.clone(), old))
                    else {
                        continue;
                    };
                    let theirs = link.dialer_incarnation.load(Ordering::Acquire);
                    if theirs != 0 && theirs != hello.incarnation && hello.incarnation != 0 {
                        info!(peer = %hello.node_name, old_session = old, "the peer restarted: closing its old process's session");
                        self.retire_incarnation(&hello.node_name, theirs);
                        link.close("replaced by a new process of the same node");
                    } else {
                        info!(peer = %hello.node_name, old_session = old, "closing an idle session: the node opened a new one");
                        link.close("replaced by a newer session of the same node");
                    }
                }
            }
        }
        let link = self
            .inbound
            .entry(key)
            .or_insert_with(|| {
                let link = PeerLink::new(
                    &hello.node_name,
                    transport,
                    self.link_env(),
                    self.session_config(&hello.node_name, false),
                    None,
                );
                link.dialer_incarnation
                    .store(hello.incarnation, Ordering::Release);
                link
            })
            .clone();
        if hello.connection_index == 0 {
            // The dialer is (re)building this rail: what we still hold on it is stale.
            link.retire_rail(hello.rail_index);
        }
        if link.attach(conn, hello.rail_index).is_none() {
            warn!(peer = %hello.node_name, "too many connections in one session; dropping one");
        }
        self.inbound.retain(|_, l| !l.is_dead());
    }

    /// That the dialer is the process membership registered under its name,
    /// with the certificate its record (or the configuration) names: another
    /// process, or another certificate of the CA for the name, is refused.
    fn check_registered(
        &self,
        hello: &pb::Hello,
        tls_certificate: Option<&[u8]>,
    ) -> Result<(), HandshakeError> {
        let Some(slot) = self.peers.get(&hello.node_name) else {
            return Ok(());
        };
        let refuse = |why: String| HandshakeError::NotRegistered {
            node: hello.node_name.clone(),
            why,
        };
        if let Some(expected) = slot.config.incarnation {
            if hello.incarnation != expected {
                return Err(refuse(format!(
                    "registered as process {expected:#x}, this connection comes from process {:#x} (an old process of the node, or one not registered yet)",
                    hello.incarnation
                )));
            }
        }
        if let Some(expected) = &slot.config.cert_sha256 {
            let presented = tls_certificate
                .or((!hello.certificate.is_empty()).then_some(hello.certificate.as_slice()));
            crate::dial::check_fingerprint(presented, expected).map_err(refuse)?;
        }
        Ok(())
    }

    /// The inbound session cap for this hello ([`admit_session`]): the node's
    /// sessions here, what they carry, and its retired incarnations.
    fn admission(&self, hello: &pb::Hello) -> SessionAdmission {
        self.inbound.retain(|_, l| !l.is_dead());
        let held: Vec<HeldSession> = self
            .inbound
            .iter()
            .filter(|e| e.key().0 == hello.node_name)
            .map(|e| HeldSession {
                session_id: e.key().1,
                incarnation: e.value().dialer_incarnation.load(Ordering::Acquire),
                active_transfers: e.value().inspect(|s| s.active_transfers()),
                created: e.value().created,
            })
            .collect();
        let retired = self
            .retired_incarnations
            .get(&hello.node_name)
            .map(|r| r.clone())
            .unwrap_or_default();
        admit_session(
            &hello.node_name,
            hello.session_id,
            hello.incarnation,
            &held,
            &retired,
            MAX_INBOUND_SESSIONS_PER_PEER,
        )
    }

    /// Remembers that `incarnation` of `node` was replaced (see
    /// [`remember_retired`]).
    pub(crate) fn retire_incarnation(&self, node: &str, incarnation: u64) {
        remember_retired(
            &self.retired_incarnations,
            node,
            incarnation,
            MAX_RETIRED_NODES,
        );
    }

    async fn refuse(
        &self,
        mut conn: Connection,
        from: SocketAddr,
        reason: String,
        label: &'static str,
        code: ErrorCode,
    ) {
        // Bounded: a refusal says at most this much, however long the peer's
        // fields were, and a flood of refusals logs a few lines a second.
        let reason: String = reason.chars().take(MAX_REFUSAL_CHARS).collect();
        // Counted before it is logged: whoever reads the log finds the count.
        m::handshakes_refused(label).increment(1);
        if let Some(suppressed) = self.refusal_log.admit() {
            warn!(%from, suppressed, "refused peer handshake: {reason}");
        }
        let abort = wire::message(Body::Abort(pb::Abort {
            transfer_id: 0,
            code: code as i32,
            message: reason,
        }));
        let frame = wire::encode_control(&abort);
        let _ = tokio::time::timeout(HANDSHAKE_WRITE_TIMEOUT, async {
            let _ = conn.writer.write_control(&frame).await;
            let _ = conn.writer.close().await;
        })
        .await;
    }

    /// Why region `id`'s shared-memory file no longer backs its mapping, if so.
    pub fn region_truncated(&self, id: u64) -> Option<String> {
        let region = self.registry.get(id)?;
        let host = region.memory.host()?;
        host.check_intact(0, region.layout.extent())
            .err()
            .map(|e| e.to_string())
    }

    /// Routes a session event to the transfer table and the right worker.
    pub fn on_event(&self, peer: &str, event: Event) {
        crate::trace_points::mark(crate::trace_points::TRANSFER_END);
        // A transfer whose region's file was truncated under the mapping did
        // not really move its bytes: it fails, whatever the protocol concluded.
        let event = match event {
            Event::Done {
                transfer_id,
                request_id,
                kind,
                region_id,
                receiver_group,
                ..
            } if self.region_truncated(region_id).is_some() => Event::Failed {
                transfer_id,
                request_id,
                kind,
                region_id,
                error: kvrail_core::TransferError::Local {
                    code: ErrorCode::RegionTruncated,
                    message: self.region_truncated(region_id).unwrap_or_default(),
                },
                receiver_group,
            },
            other => other,
        };
        match event {
            // Rail changes are the link's business (see `PeerLink::on_rail_change`).
            Event::Rail(_) => {}
            Event::Message(msg) => {
                let to = msg.to_worker.clone();
                let delivered = self.hub.send_if_known(
                    &to,
                    Notification {
                        kind: NotificationKind::Message as i32,
                        request_id: msg.topic,
                        peer: peer.to_string(),
                        payload: msg.payload,
                        from_worker: msg.from_worker,
                        ..Default::default()
                    },
                );
                let outcome = if delivered {
                    "delivered"
                } else {
                    "unknown_worker"
                };
                m::messages_received(outcome).increment(1);
                if !delivered {
                    // Counted above; not logged at warn: a peer could flood the log.
                    debug!(peer, to_worker = %to, "message for a worker that never subscribed here: dropped");
                }
            }
            Event::MessageDropped(e) => {
                m::messages_received("refused").increment(1);
                debug!(peer, "message from the peer refused: {e}");
            }
            Event::Done {
                transfer_id,
                request_id,
                kind,
                region_id,
                block_ids,
                bytes,
                receiver_group,
            } => {
                m::transfers_done(kind).increment(1);
                let nkind = match kind {
                    TransferKind::Push => NotificationKind::PushDone,
                    TransferKind::PushReceive => NotificationKind::PushReceived,
                    TransferKind::Pull => NotificationKind::PullDone,
                    TransferKind::PullServe => NotificationKind::PullServed,
                };
                let (worker, elapsed_us) = match kind {
                    TransferKind::Push | TransferKind::Pull => {
                        let Some(rec) = self.transfers.finish(transfer_id, |s| {
                            s.state = TransferState::Done as i32;
                            s.bytes_done = bytes;
                        }) else {
                            return;
                        };
                        let elapsed = rec.started.elapsed();
                        m::transfer_seconds(kind).record(elapsed.as_secs_f64());
                        if let Some(group) = &rec.group {
                            // The worker hears of the group, once.
                            match self
                                .groups
                                .member_done(&rec.worker_id, group, transfer_id, bytes)
                            {
                                crate::groups::Outcome::Done { bytes } => self.hub.send(
                                    &rec.worker_id,
                                    Notification {
                                        kind: nkind as i32,
                                        request_id: group.clone(),
                                        peer: peer.to_string(),
                                        region_id,
                                        bytes,
                                        elapsed_us: elapsed.as_micros() as u64,
                                        ..Default::default()
                                    },
                                ),
                                // A member that ended after a failure may
                                // complete the failed group's report.
                                other => self.act_on_group(&rec.worker_id, group, other),
                            }
                            return;
                        }
                        (rec.worker_id.clone(), elapsed.as_micros() as u64)
                    }
                    TransferKind::PushReceive | TransferKind::PullServe => {
                        let Some(r) = self.registry.get(region_id) else {
                            return;
                        };
                        if let Some(g) = &receiver_group {
                            self.receiver_group_member_ended(
                                &r.worker_id,
                                g,
                                peer,
                                region_id,
                                Ok(bytes),
                            );
                            return;
                        }
                        (r.worker_id.clone(), 0)
                    }
                };
                self.hub.send(
                    &worker,
                    Notification {
                        kind: nkind as i32,
                        transfer_id,
                        request_id,
                        peer: peer.to_string(),
                        region_id,
                        block_ids,
                        bytes,
                        failure: None,
                        elapsed_us,
                        // Numbered and stamped by the hub.
                        sequence: 0,
                        incarnation: 0,
                        payload: vec![],
                        from_worker: String::new(),
                    },
                );
            }
            Event::Failed {
                transfer_id,
                request_id,
                kind,
                region_id,
                error,
                receiver_group,
            } => {
                m::transfers_failed(kind, error.code()).increment(1);
                let failure = failure_of(&error);
                warn!(
                    peer,
                    transfer_id,
                    request_id,
                    kind = m::kind_label(kind),
                    "transfer failed: {error}"
                );
                let worker = match kind {
                    TransferKind::Push | TransferKind::Pull => {
                        let f = failure.clone();
                        match self.transfers.finish(transfer_id, |s| {
                            s.state = TransferState::Failed as i32;
                            s.failure = Some(f);
                        }) {
                            Some(rec) => match &rec.group {
                                Some(group) => {
                                    self.group_member_failed(
                                        &rec.worker_id,
                                        group,
                                        transfer_id,
                                        peer,
                                        failure,
                                    );
                                    return;
                                }
                                None => rec.worker_id.clone(),
                            },
                            None => return,
                        }
                    }
                    TransferKind::PushReceive | TransferKind::PullServe => {
                        let Some(r) = self.registry.get(region_id) else {
                            return;
                        };
                        if let Some(g) = &receiver_group {
                            self.receiver_group_member_ended(
                                &r.worker_id,
                                g,
                                peer,
                                region_id,
                                Err(failure),
                            );
                            return;
                        }
                        r.worker_id.clone()
                    }
                };
                self.hub.send(
                    &worker,
                    Notification {
                        kind: NotificationKind::Failed as i32,
                        transfer_id,
                        request_id,
                        peer: peer.to_string(),
                        region_id,
                        block_ids: vec![],
                        bytes: 0,
                        failure: Some(failure),
                        elapsed_us: 0,
                        // Numbered and stamped by the hub.
                        sequence: 0,
                        incarnation: 0,
                        payload: vec![],
                        from_worker: String::new(),
                    },
                );
            }
        }
    }
}

impl Shared {
    /// A member of `group` failed: at its group's first failure the other
    /// members still running are cancelled, and the worker gets one FAILED
    /// notification for the group once none of them runs (it may free the
    /// blocks then).
    pub fn group_member_failed(
        &self,
        worker: &str,
        group: &str,
        transfer_id: u64,
        peer: &str,
        failure: Failure,
    ) {
        let outcome =
            self.groups
                .member_failed(worker, group, transfer_id, (peer.to_string(), failure));
        self.act_on_group(worker, group, outcome);
    }

    fn act_on_group(
        &self,
        worker: &str,
        group: &str,
        outcome: crate::groups::Outcome<(String, Failure)>,
    ) {
        match outcome {
            crate::groups::Outcome::Cancel { cancel } => self.cancel_transfers(cancel),
            crate::groups::Outcome::Failed((peer, failure)) => {
                self.send_group_failed(worker, group, &peer, failure)
            }
            crate::groups::Outcome::Pending | crate::groups::Outcome::Done { .. } => {}
        }
    }

    fn send_group_failed(&self, worker: &str, group: &str, peer: &str, failure: Failure) {
        self.hub.send(
            worker,
            Notification {
                kind: NotificationKind::Failed as i32,
                request_id: group.to_string(),
                peer: peer.to_string(),
                failure: Some(failure),
                ..Default::default()
            },
        );
    }

    /// A push received into `worker`'s region as a member of receiver group
    /// `g` ended: the worker hears of the group once (its completion, or its
    /// first failure).
    fn receiver_group_member_ended(
        &self,
        worker: &str,
        g: &kvrail_core::wire::pb::ReceiverGroup,
        peer: &str,
        region_id: u64,
        result: Result<u64, Failure>,
    ) {
        use crate::receiver_groups::Ended;
        let failed = |code: &str, message: String| Failure {
            side: FailureSide::Peer as i32,
            code: code.into(),
            message,
        };
        let failure =
            match self
                .receiver_groups
                .ended(worker, &g.id, g.members, result, Instant::now())
            {
                Ended::Pending => return,
                Ended::Done { bytes } => {
                    self.hub.send(
                        worker,
                        Notification {
                            kind: NotificationKind::PushReceived as i32,
                            request_id: g.id.clone(),
                            peer: peer.to_string(),
                            region_id,
                            bytes,
                            ..Default::default()
                        },
                    );
                    return;
                }
                Ended::Failed(f) => f,
                Ended::MembersDiffer { members, said } => failed(
                    "group_members_differ",
                    format!(
                        "receiver group {:?} has {members} members; a push from {peer} says {said}",
                        g.id
                    ),
                ),
                Ended::TooMany => failed(
                    "too_many_groups",
                    format!(
                        "receiver group {:?}: {} groups are live on this sidecar",
                        g.id,
                        crate::receiver_groups::MAX_GROUPS
                    ),
                ),
            };
        self.send_group_failed(worker, &g.id, peer, failure);
    }

    /// Fails the groups whose worker did not start all their members in time.
    pub fn expire_groups(&self, now: Instant) {
        let incomplete = |group: &str, joined: u32, members: u32| {
            let failure = Failure {
                side: FailureSide::Local as i32,
                code: "group_incomplete".into(),
                message: format!(
                    "transfer group {group:?}: {joined} of its {members} members were started within {:?}",
                    crate::groups::JOIN_DEADLINE
                ),
            };
            (String::new(), failure)
        };
        for s in self.groups.expire(now, incomplete) {
            self.act_on_group(&s.worker, &s.group, s.outcome);
        }
    }

    /// Fails the receiver groups whose members did not all arrive in time
    /// (called every second: a receiving sidecar starts nothing that would
    /// sweep them otherwise).
    pub fn expire_receiver_groups(&self, now: Instant) {
        for e in self.receiver_groups.expire(now) {
            let failure = Failure {
                side: FailureSide::Peer as i32,
                code: "group_incomplete".into(),
                message: format!(
                    "receiver group {:?}: {} of its {} pushes arrived within {:?}",
                    e.group,
                    e.ended,
                    e.members,
                    crate::receiver_groups::DEADLINE
                ),
            };
            self.send_group_failed(&e.worker, &e.group, "", failure);
        }
    }

    /// Cancels transfers off the caller's stack: the caller may hold one of
    /// their links' locks (events are delivered under it).
    fn cancel_transfers(&self, ids: Vec<u64>) {
        let links: Vec<(u64, Arc<PeerLink>)> = ids
            .into_iter()
            .filter_map(|id| {
                let link = self.transfers.get(id)?.link.upgrade()?;
                Some((id, link))
            })
            .collect();
        if links.is_empty() {
            return;
        }
        let cancel = move || {
            for (id, link) in links {
                link.with_session(|s, now| s.cancel(id, now));
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { cancel() });
            }
            Err(_) => {
                std::thread::spawn(cancel);
            }
        }
    }
}

/// The worker-facing description of a core failure.
pub fn failure_of(error: &kvrail_core::TransferError) -> Failure {
    use kvrail_core::FailureSide as S;
    let side = match error.side() {
        S::Local => FailureSide::Local,
        S::Peer => FailureSide::Peer,
        S::Rail => FailureSide::Rail,
        S::Timeout => FailureSide::Timeout,
        S::Cancelled => FailureSide::Cancelled,
    };
    Failure {
        side: side as i32,
        code: error.code().to_string(),
        message: error.to_string(),
    }
}

/// Drops the regions of worker process `pid` once it exits (at most one watch per
/// process), so an exited worker leaves no mapping behind: above all no GPU
/// memory imported from it. Regions still moving bytes go when they are done.
pub fn watch_worker(shared: &Arc<Shared>, pid: i32) {
    if shared.watched_workers.insert(pid, ()).is_some() {
        return;
    }
    let weak = Arc::downgrade(shared);
    tokio::spawn(async move {
        if let Err(e) = kvrail_shm::process_exit(pid).await {
            let Some(shared) = weak.upgrade() else { return };
            shared.watched_workers.remove(&pid);
            if e.raw_os_error() == Some(libc::ESRCH) {
                // Gone already (it asked, then exited; or the credentials
                // were a parent's that exited): what it asked for is due.
                shared.exit_files.exited(pid);
            } else {
                warn!(
                    pid,
                    "cannot watch worker process, its regions stay until unregistered: {e}"
                );
                shared.exit_files.forget(pid);
            }
            return;
        }
        if let Some(shared) = weak.upgrade() {
            shared.exit_files.exited(pid);
        }
        let mut announced = false;
        loop {
            let Some(shared) = weak.upgrade() else { return };
            let mut busy = 0;
            for id in shared.registry.owned_by(pid) {
                match shared.unregister_region(id) {
                    Ok(()) => info!(pid, region = id, "worker exited: region unregistered"),
                    Err(UnregisterError::InUse | UnregisterError::Held) => busy += 1,
                    Err(UnregisterError::Unknown) => {}
                }
            }
            if busy == 0 {
                shared.watched_workers.remove(&pid);
                return;
            }
            if !announced {
                info!(
                    pid,
                    regions = busy,
                    "worker exited: waiting for its transfers to end before dropping its regions"
                );
                announced = true;
            }
            drop(shared);
            // Transfers end by completing, failing or timing out; check again soon.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

impl LinkEnv for Shared {
    type Link = PeerLink;

    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn rdma(&self) -> &RdmaRails {
        &self.rdma
    }

    fn gpu_stage_depth(&self) -> usize {
        self.config.gpu_stage_depth
    }

    fn inline_control_writes(&self) -> bool {
        self.config.inline_control_writes
    }

    fn on_traffic(&self, bytes: u64) {
        self.busy_poll.touch(bytes);
    }

    fn counts_traffic(&self) -> bool {
        self.busy_poll.enabled()
    }

    fn reader_spin_on(&self) -> bool {
        self.busy_poll.reader_spin_on()
    }

    fn reader_spin(&self) -> Option<crate::busy_poll::ReaderSpin> {
        self.busy_poll.reader_spin()
    }

    fn connection_threads(&self) -> bool {
        self.config.connection_threads()
    }

    fn on_event(&self, peer: &str, event: Event) {
        Shared::on_event(self, peer, event);
    }

    fn probe_rail(&self, link: Arc<PeerLink>, dial: DialInfo, rail: RailId) -> ProbeFuture<'_> {
        Box::pin(async move {
            self.dial_rail(&link, &dial, rail, true)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

/// Adds `incarnation` to `node`'s replaced incarnations (its last 16), in a
/// map of at most `max_nodes` nodes: past that an arbitrary other node's are
/// forgotten, so names that come and go cannot grow it.
pub(crate) fn remember_retired(
    map: &DashMap<String, Vec<u64>>,
    node: &str,
    incarnation: u64,
    max_nodes: usize,
) {
    const KEPT: usize = 16;
    if map.len() >= max_nodes && !map.contains_key(node) {
        let other = map.iter().next().map(|e| e.key().clone());
        if let Some(other) = other {
            map.remove(&other);
        }
    }
    let mut retired = map.entry(node.to_string()).or_default();
    if !retired.contains(&incarnation) {
        if retired.len() >= KEPT {
            retired.remove(0);
        }
        retired.push(incarnation);
    }
}

#[cfg(test)]
mod retired_tests {
    use super::*;

    #[test]
    fn retired_incarnations_stay_bounded_per_node_and_in_nodes() {
        let map = DashMap::new();
        for i in 1..=40u64 {
            remember_retired(&map, "a", i, 3);
        }
        let kept = map.get("a").map(|r| r.clone()).unwrap_or_default();
        assert_eq!(kept, (25..=40).collect::<Vec<u64>>());
        remember_retired(&map, "a", 40, 3);
        assert_eq!(map.get("a").map(|r| r.len()), Some(16));
        for n in 0..100 {
            remember_retired(&map, &format!("n{n}"), 1, 3);
            assert!(map.len() <= 3);
        }
        assert!(map.contains_key("n99"));
    }
}
