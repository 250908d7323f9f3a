//! Starting and stopping the daemon: checks the configuration, loads the node's
//! identity, opens the transports, binds every rail listener and the worker API
//! socket, and hands each accepted peer connection to the shared state.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use kvrail_auth::{Identity, IdentityFiles};
use kvrail_quic::QuicTransport;
use kvrail_transport::tcp::TcpTransport;
use kvrail_transport::{Listener, Transport};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::busy_poll::BusyPoll;
use crate::config::Config;
use crate::daemon::{Shared, MAX_CONCURRENT_HANDSHAKES};
use crate::gpu::GpuDevices;
use crate::membership::{Membership, MembershipConfig, OnChange};
use crate::metrics as m;
use crate::notify::NotificationHub;
use crate::rdma::RdmaRails;
use crate::regions::Registry;
use crate::transfers::TransferTable;
use kvrail_core::membership::{MemberRecord, RECORD_FORMAT};
use kvrail_transport::ratelog::RateLimitedLog;

/// A running daemon.
pub struct Daemon {
    pub shared: Arc<Shared>,
    pub socket: PathBuf,
    pub listen: Vec<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
    bound_socket: Option<crate::api::BoundSocket>,
}

impl Daemon {
    /// Binds every listener and the API socket, then serves in the background.
    pub async fn start(config: Config) -> anyhow::Result<Daemon> {
        config.validate()?;
        kvrail_shm::keep_heap_pages();
        // A worker that shrinks its file must not be able to kill the daemon.
        if let Err(e) = kvrail_shm::guard::install() {
            warn!("cannot install the SIGBUS guard (a truncated region file would kill the daemon): {e}");
        }
        let identity = match &config.tls_dir {
            Some(dir) => Some(Arc::new(
                Identity::load(&config.node, &IdentityFiles::in_dir(dir, &config.node))
                    .map_err(|e| identity_error(e, dir, &config.node))?,
            )),
            None => None,
        };
        let etcd_tls = crate::membership::EtcdTls::load(
            config.etcd_ca.as_deref(),
            config.etcd_cert.as_deref(),
            config.etcd_key.as_deref(),
        )?;
        if config.insecure && config.wants("tcp") {
            warn!("--insecure: tcp peer connections are not authenticated; anyone who reaches a rail port can pose as a peer");
        }
        // This start of the process: peers compare it across reconnects.
        let incarnation = rand::random::<u64>() | 1;
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        for name in &config.transport_order() {
            match name.as_str() {
                "tcp" => transports.push(Arc::new(TcpTransport)),
                "quic" => {
                    let identity = identity
                        .as_ref()
                        .ok_or_else(|| anyhow::anyhow!("quic needs tls_dir"))?;
                    transports.push(Arc::new(QuicTransport::new(
                        identity,
                        &config.quic_settings(),
                    )?));
                }
                _ => {}
            }
        }
        let peers = crate::daemon::PeerTable::from_config(&config.peers);
        let shared = Arc::new(Shared {
            config: config.clone(),
            registry: Registry::for_incarnation(incarnation),
            incarnation,
            hub: NotificationHub::new(incarnation),
            transfers: TransferTable::default(),
            groups: crate::groups::Groups::default(),
            receiver_groups: crate::receiver_groups::ReceiverGroups::default(),
            peers,
            inbound: DashMap::new(),
            transports: transports.clone(),
            rdma: RdmaRails::discover(&config),
            identity: identity.clone(),
            gpus: GpuDevices::new(
                config.staging_bytes() as usize,
                config.gpu_copy_streams,
                config.gpu_batch_copies,
            ),
            watched_workers: DashMap::new(),
            exit_files: Default::default(),
            peer_budgets: DashMap::new(),
            retired_incarnations: DashMap::new(),
            transfer_budget: Arc::new(kvrail_core::budget::MemoryBudget::new(
                config.max_transfer_state_bytes,
            )),
            refusal_log: RateLimitedLog::new(5),
            // As region ids: an id a worker kept from before a restart names
            // no transfer of this incarnation (until 2^32 transfers later).
            next_transfer: AtomicU64::new((incarnation & 0xffff_ffff) << 32),
            busy_poll: BusyPoll::new(config.runtime_busy_poll(), config.reader_spin()),
            membership: std::sync::OnceLock::new(),
            socket_loads: std::sync::Mutex::default(),
        });
        if let Some(addr) = config.metrics_addr {
            m::install(addr).await?;
            info!(%addr, "serving Prometheus metrics");
        }
        let mut tasks = Vec::new();
        let mut listen = Vec::new();
        let serving = async {
            for addr in &config.listen {
                // Every transport on the rail's address and one port number (TCP
                // and UDP), the first one's when the port was left to the system.
                let mut bound: Option<SocketAddr> = None;
                for transport in &transports {
                    let at = bound.unwrap_or(*addr);
                    let listener = transport.listen(at).await.map_err(|e| {
                        anyhow::anyhow!("cannot listen on {at} ({}): {e}", transport.name())
                    })?;
                    bound.get_or_insert(listener.local_addr()?);
                    if let (Some(loads), Ok(mut all)) =
                        (listener.socket_loads(), shared.socket_loads.lock())
                    {
                        all.push((listener.local_addr()?.to_string(), loads));
                    }
                    tasks.push(tokio::spawn(accept_loop(
                        shared.clone(),
                        transport.name(),
                        listener,
                    )));
                }
                listen.extend(bound);
            }
            crate::api::serve(shared.clone(), &config.socket).await
        };
        let (api, bound_socket) = match serving.await {
            Ok(api) => api,
            Err(e) => {
                // Not serving after all: the listeners already up stop too.
                for t in &tasks {
                    t.abort();
                }
                return Err(e);
            }
        };
        tasks.push(api);
        tasks.push(tokio::spawn(report_held_bytes(Arc::downgrade(&shared))));
        tasks.push(tokio::spawn(crate::stall_watch::run()));
        if shared.busy_poll.runtime_spin() {
            tasks.push(tokio::spawn(shared.busy_poll.clone().run()));
        }
        if !config.etcd_endpoints.is_empty() {
            // Registered once the listeners are up: a peer that reads the
            // record can connect.
            let weak = Arc::downgrade(&shared);
            let on_change: OnChange = Arc::new(move |change| {
                if let Some(shared) = weak.upgrade() {
                    crate::peer_changes::apply(&shared, change);
                }
            });
            let membership = Membership::start(
                MembershipConfig {
                    endpoints: config.etcd_endpoints.clone(),
                    prefix: config.etcd_prefix.clone(),
                    lease_ttl_s: config.etcd_lease_ttl_s,
                    record: member_record(&shared),
                    tls: etcd_tls,
                },
                on_change,
            );
            let _ = shared.membership.set(Arc::new(membership));
        }
        info!(node = %config.node, socket = %config.socket.display(), ?listen, transports = ?shared.offered_transports(), "kvrail sidecar ready");
        Ok(Daemon {
            shared,
            socket: config.socket.clone(),
            listen,
            tasks,
            bound_socket,
        })
    }

    /// Leaves the etcd membership (deletes this node's record), if any:
    /// peers learn of it at once instead of at the lease's expiry.
    pub async fn leave(&self) {
        if let Some(m) = self.shared.membership.get() {
            m.leave().await;
        }
    }

    /// Stops serving and closes every peer connection.
    pub fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        for l in self.shared.inbound.iter() {
            l.close("daemon shutting down");
        }
        for slot in self.shared.peers.values() {
            if let Some(l) = slot.link_now().link() {
                l.close("daemon shutting down");
            }
        }
        if let Some(bound) = self.bound_socket {
            bound.remove_if_ours(&self.socket);
        }
    }
}

/// This node's membership record as peers read it.
fn member_record(shared: &Shared) -> MemberRecord {
    let config = &shared.config;
    let mut capabilities = Vec::new();
    if shared.rdma.any() {
        capabilities.push("rdma".to_string());
    }
    capabilities.push("rings".to_string());
    MemberRecord {
        format: RECORD_FORMAT,
        node: config.node.clone(),
        rails: config
            .advertised_rails()
            .iter()
            .map(|a| a.to_string())
            .collect(),
        transports: shared.offered_transports(),
        capabilities,
        version: env!("CARGO_PKG_VERSION").to_string(),
        cert_sha256: shared
            .identity
            .as_ref()
            .map(|id| kvrail_auth::certificate_sha256(id.certificate())),
        incarnation: shared.incarnation,
    }
}

/// Memory given back that makes it worth returning the heap's free pages to
/// the system (see `kvrail_shm::release_free_heap`).
const RELEASE_HEAP_AFTER: u64 = 32 << 20;

/// Sets the held-memory gauges once a second (see README Security), and
/// returns the heap's free pages once much of what was held has been let go.
async fn report_held_bytes(shared: std::sync::Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut high: u64 = 0;
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.expire_receiver_groups(std::time::Instant::now());
        let (retained, queued) = shared.hub.held_bytes();
        let transfers = shared.transfer_budget.held();
        for (kind, bytes) in [
            ("transfer_state", transfers),
            ("notifications_retained", retained as u64),
            ("notifications_queued", queued as u64),
        ] {
            m::held_bytes(kind).set(bytes as f64);
        }
        if let Ok(all) = shared.socket_loads.lock() {
            for (listen, loads) in all.iter() {
                publish_socket_loads(listen, loads);
            }
        }
        let held = transfers + retained as u64 + queued as u64;
        high = high.max(held);
        if high - held >= RELEASE_HEAP_AFTER {
            tokio::task::spawn_blocking(kvrail_shm::release_free_heap);
            high = held;
        }
    }
}

/// A handshake being run for an accepted connection.
struct PendingHandshake {
    /// Its first frame arrived (until then, aborting it loses nothing).
    spoke: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::AbortHandle,
    accepted: std::time::Instant,
    from: SocketAddr,
}

/// A handshake that has spoken may be dropped for a newcomer once it has run
/// this long: real ones take a round trip and a signature (milliseconds).
const STALLED_HANDSHAKE_AGE: Duration = Duration::from_millis(250);

/// A connection that has not spoken yet may be dropped for a newcomer once
/// it has had this long to: a real peer's hello follows its connect at once,
/// but it is read only when its task runs.
const SILENT_HANDSHAKE_AGE: Duration = Duration::from_millis(20);

/// Sets the per-socket connection gauge of the listener at `listen`.
fn publish_socket_loads(listen: &str, loads: &kvrail_transport::SocketLoads) {
    for (socket, n) in loads().into_iter().enumerate() {
        m::quic_socket_connections(listen, socket).set(n as f64);
    }
}

async fn accept_loop(
    shared: Arc<Shared>,
    transport: &'static str,
    mut listener: Box<dyn Listener>,
) {
    // Published at each accept (closes are caught by the 1 s report).
    let loads = listener
        .socket_loads()
        .zip(listener.local_addr().ok().map(|a| a.to_string()));
    // Handshakes in progress at once, per listener: each holds at most one
    // bounded handshake frame, so pre-authentication memory is bounded too.
    // When all are taken, the oldest that has not sent a frame within
    // SILENT_HANDSHAKE_AGE makes room, else the oldest of all once it has run for
    // STALLED_HANDSHAKE_AGE (a hello with a copy of a peer's public
    // certificate, then no proof, would hold a slot until the handshake's
    // deadline), else the newcomer is closed: connections that only sit
    // there (anyone who reaches the port can open them) cannot lock real
    // peers out, and a burst of real handshakes (a reconnect storm) does not
    // push out the ones about to finish.
    let mut pending: std::collections::VecDeque<PendingHandshake> = Default::default();
    // Per source address first: a few handshakes in progress and a rate each
    // (a handshake costs a signature), the peers' rail addresses before others.
    let admission =
        kvrail_transport::admission::HandshakeAdmission::new(shared.config.peer_addresses());
    loop {
        match listener.accept().await {
            Ok((conn, from)) => {
                if let Some((loads, listen)) = &loads {
                    publish_socket_loads(listen, loads);
                }
                let Some(permit) = admission.admit(from.ip(), std::time::Instant::now()) else {
                    m::handshakes_refused("rate_limited").increment(1);
                    if let Some(suppressed) = shared.refusal_log.admit() {
                        warn!(%from, suppressed, "refused peer connection: its address has too many handshakes in progress, or started too many");
                    }
                    drop(conn);
                    continue;
                };
                pending.retain(|p| !p.task.is_finished());
                if pending.len() >= MAX_CONCURRENT_HANDSHAKES {
                    let silent = pending.iter().position(|p| {
                        !p.spoke.load(std::sync::atomic::Ordering::Acquire)
                            && p.accepted.elapsed() >= SILENT_HANDSHAKE_AGE
                    });
                    let stalled = pending
                        .front()
                        .is_some_and(|p| p.accepted.elapsed() >= STALLED_HANDSHAKE_AGE);
                    let evict = match (silent, stalled) {
                        (Some(i), _) => Some((i, "silent_evicted")),
                        (None, true) => Some((0, "stalled_evicted")),
                        (None, false) => None,
                    };
                    match evict.and_then(|(i, reason)| Some((pending.remove(i)?, reason))) {
                        Some((evicted, reason)) => {
                            evicted.task.abort();
                            m::handshakes_refused(reason).increment(1);
                            if let Some(suppressed) = shared.refusal_log.admit() {
                                warn!(from = %evicted.from, suppressed, reason, "{MAX_CONCURRENT_HANDSHAKES} peer handshakes in progress: the oldest was dropped to make room");
                            }
                        }
                        None => {
                            m::handshakes_refused("too_many_handshakes").increment(1);
                            if let Some(suppressed) = shared.refusal_log.admit() {
                                warn!(%from, suppressed, "refused peer connection: {MAX_CONCURRENT_HANDSHAKES} handshakes already in progress");
                            }
                            drop(conn);
                            continue;
                        }
                    }
                }
                let spoke = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let shared = shared.clone();
                let heard = spoke.clone();
                let task = tokio::spawn(async move {
                    shared.accept_one(transport, conn, from, heard).await;
                    drop(permit);
                });
                pending.push_back(PendingHandshake {
                    spoke,
                    task: task.abort_handle(),
                    accepted: std::time::Instant::now(),
                    from,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                // A TLS handshake failed: a peer without a certificate of our CA.
                m::handshakes_refused("tls").increment(1);
                if let Some(suppressed) = shared.refusal_log.admit() {
                    warn!(transport, suppressed, "refused peer handshake: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {
                warn!(transport, "peer connection dropped during setup: {e}");
            }
            Err(e) => {
                warn!(transport, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why the node's identity could not be loaded, with what to do about a
/// missing file.
fn identity_error(e: kvrail_auth::AuthError, dir: &std::path::Path, node: &str) -> anyhow::Error {
    let missing = match &e {
        kvrail_auth::AuthError::Read { path, source }
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            path.file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
        }
        _ => None,
    };
    match missing.as_deref() {
        Some("ca.pem") => anyhow::anyhow!(
            "node identity: {e}; copy the cluster's ca.pem into {} (made once by `kvrail certs init --dir DIR`)",
            dir.display()
        ),
        Some(_) => anyhow::anyhow!(
            "node identity: {e}; make this node's certificate with `kvrail certs node --dir CA_DIR {node}` and copy {node}.pem and {node}.key into {} (this node is named {node:?}: --node)",
            dir.display()
        ),
        None => anyhow::anyhow!("node identity: {e}"),
    }
}
