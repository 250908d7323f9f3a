//! The kvrail sidecar daemon.
//!
//! Data flow: worker -> gRPC API ([`api`]) -> core session (plan, slices) ->
//! transport driver -> wire -> peer's driver -> core (placement, completion) ->
//! peer's API -> peer worker. This crate only wires those parts together.

pub mod api;
pub mod busy_poll;
pub mod config;
pub mod daemon;
pub mod dial;
pub mod doctor;
pub mod exit_files;
pub mod gpu;
pub mod groups;
pub mod held;
pub mod link;
pub mod membership;
pub mod metrics;
pub mod metrics_http;
pub mod netinfo;
pub mod notify;
pub mod peer_changes;
pub mod peer_table;
#[cfg(feature = "profile")]
pub mod profile;
pub mod rdma;
pub mod receiver_groups;
pub mod regions;
pub mod stall_watch;
pub mod startup;
pub mod submit;
pub mod trace_points;
pub mod transfers;
pub mod worker_ring;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use config::{Config, PeerConfig};
pub use startup::Daemon;

/// Flags of `kvrail serve`; each overrides the config file.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see README "Configuration").
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// This node's name (default "node"; letters, digits, '-', '_', '.').
    #[arg(long)]
    pub node: Option<String>,
    /// Unix socket of the local worker API (created with mode 0600; default /tmp/kvrail.sock).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Listen address of a rail, IP:PORT; repeat once per rail.
    #[arg(long, value_parser = config::parse_rail_addr)]
    pub listen: Vec<SocketAddr>,
    /// A peer: NAME=IP:PORT[,IP:PORT...] (one address per rail); repeatable.
    #[arg(long = "peer")]
    pub peers: Vec<String>,
    /// Where peers reach a rail, IP:PORT, when not the listen address; repeat once per rail.
    #[arg(long, value_parser = config::parse_rail_addr)]
    pub advertise: Vec<SocketAddr>,
    /// etcd endpoint of the cluster's membership (http://HOST:PORT); repeatable.
    /// This node registers there and learns its peers there.
    #[arg(long = "etcd")]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of this cluster in etcd (default /kvrail/default).
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// Seconds this node's etcd record outlives its last renewal (default 10).
    #[arg(long)]
    pub etcd_lease_ttl_s: Option<u64>,
    /// CA certificate (PEM) of the etcd servers, for https:// endpoints.
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) to show etcd (with --etcd-key).
    #[arg(long)]
    pub etcd_cert: Option<PathBuf>,
    /// Key (PEM) of --etcd-cert.
    #[arg(long)]
    pub etcd_key: Option<PathBuf>,
    /// TCP connections per rail to each peer (default 4; with RDMA's queue pairs at most 64 over all rails).
    #[arg(long)]
    pub connections_per_rail: Option<usize>,
    /// Slice size in bytes (default 1048576; 4 KiB to 64 MiB).
    #[arg(long)]
    pub slice_bytes: Option<u64>,
    /// Unacknowledged bytes allowed per connection (default 8388608; slice size to 128 MiB).
    #[arg(long)]
    pub window_bytes: Option<u64>,
    /// Fail a transfer after this long without progress (default 10000; 100 to 3600000).
    #[arg(long)]
    pub progress_timeout_ms: Option<u64>,
    /// Declare a rail down after its bytes go unacknowledged this long (default 1000).
    #[arg(long)]
    pub rail_stall_ms: Option<u64>,
    /// Fail transfers once every rail to the peer has been down this long (default 5000).
    #[arg(long)]
    pub rail_deadline_ms: Option<u64>,
    /// Memory all open transfers together may hold: block ids, generations,
    /// plans (default 1073741824; one peer, all its sessions together, half of it).
    #[arg(long)]
    pub max_transfer_state_bytes: Option<u64>,
    /// Serve Prometheus metrics on this address (default: not served).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Do not use RDMA even where devices exist.
    #[arg(long)]
    pub no_rdma: bool,
    /// RDMA device of each rail, comma-separated (default: found by rail address).
    #[arg(long, value_delimiter = ',')]
    pub rdma_devices: Vec<String>,
    /// Queue pairs per rail and peer (default 2; 1 to 8).
    #[arg(long)]
    pub rdma_qps_per_rail: Option<usize>,
    /// Transports in order of preference, comma-separated (default rdma,quic,tcp;
    /// quic is left out when there is no --tls-dir).
    #[arg(long, value_delimiter = ',')]
    pub transports: Vec<String>,
    /// Directory with ca.pem, NODE.pem and NODE.key (see `kvrail certs`).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// QUIC: UDP payload connections start with (default 1200; see docs/quic.md).
    #[arg(long)]
    pub quic_initial_mtu: Option<u16>,
    /// QUIC: largest UDP payload MTU discovery may reach (default 65000; the path's MTU caps it; see docs/quic.md).
    #[arg(long)]
    pub quic_max_udp_payload: Option<u16>,
    /// QUIC: one send call per packet instead of segmentation offload (for comparison).
    #[arg(long)]
    pub no_quic_gso: bool,
    /// Spin of worker ring threads before they sleep, in microseconds, fixed
    /// (default: twice the worker's recent gap between submissions, 50 to
    /// 500, with at least 4 CPUs; else 0).
    #[arg(long)]
    pub ring_spin_us: Option<u64>,
    /// Spin of a connection's reader for its next frame before it sleeps,
    /// in microseconds, while traffic is not bulk (default 50 with at least
    /// 4 CPUs; else 0).
    #[arg(long)]
    pub reader_spin_us: Option<u64>,
    /// Each TCP connection's reader and writer on a thread of their own
    /// (true) or on the shared runtime (false); default: true with at least
    /// 8 CPUs.
    #[arg(long)]
    pub connection_threads: Option<bool>,
    /// A host transfer no larger than a slice per connection is cut into one
    /// slice per connection of at least this many bytes (default 262144
    /// with connection threads, else 0 = off).
    #[arg(long)]
    pub spread_min_slice_bytes: Option<u64>,
    /// RDMA: transfers of at most this many bytes travel behind their open
    /// on the stream connection instead of waiting for the peer's grant
    /// (default 65536; 0: every transfer one-sided).
    #[arg(long)]
    pub rdma_eager_max_bytes: Option<u64>,
    /// After traffic, one runtime worker polls the sockets this long instead
    /// of sleeping (default 0 = off; 1000 helps small pushes on 2-core machines).
    #[arg(long)]
    pub runtime_busy_poll_us: Option<u64>,
    /// Ring threads hand every frame to the connection's writer task (see
    /// `ring_inline_writes` in the configuration; for comparison).
    #[arg(long)]
    pub no_ring_inline_writes: bool,
    /// Runtime tasks hand control frames to the connection's writer task (see
    /// `inline_control_writes` in the configuration; for comparison).
    #[arg(long)]
    pub no_inline_control_writes: bool,
    /// QUIC: kvrail connections per QUIC connection, as streams (default 1).
    #[arg(long)]
    pub quic_streams_per_connection: Option<usize>,
    /// QUIC: UDP sockets each rail listener receives on (default 0: one per core, at most 16, above 4 cores; else 1).
    #[arg(long)]
    pub quic_receive_sockets: Option<usize>,
    /// GPU regions: slices each connection stages ahead of the one it sends (default 3).
    #[arg(long)]
    pub gpu_stage_depth: Option<usize>,
    /// GPU regions: CUDA streams per copy direction (default 1).
    #[arg(long)]
    pub gpu_copy_streams: Option<usize>,
    /// GPU regions: largest slice of a transfer from or into one, in bytes
    /// (default 4 MiB; staged slices cost device copy calls, docs/gpu.md).
    #[arg(long)]
    pub gpu_slice_bytes: Option<u64>,
    /// GPU regions: one copy call per piece even where the driver can batch a
    /// slice's pieces (`gpu_batch_copies = false`; for comparison).
    #[arg(long)]
    pub no_gpu_batch_copies: bool,
    /// Accept and make TCP peer connections without authentication.
    #[arg(long)]
    pub insecure: bool,
    /// Shut down (as on SIGTERM) once process PID is no longer this one's
    /// parent: a harness that starts sidecars (loadgen, the tests) passes its
    /// own, so that they never outlive it, even when it is killed.
    #[arg(long, value_name = "PID")]
    pub parent_pid: Option<u32>,
}

impl ServeArgs {
    /// The effective configuration: file first, then flags.
    pub fn to_config(&self) -> Result<Config, config::ConfigError> {
        let mut c = match &self.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        if let Some(v) = &self.node {
            c.node = v.clone();
        }
        if let Some(v) = &self.socket {
            c.socket = v.clone();
        }
        if !self.listen.is_empty() {
            c.listen = self.listen.clone();
        }
        if !self.advertise.is_empty() {
            c.advertise = self.advertise.clone();
        }
        if !self.etcd_endpoints.is_empty() {
            c.etcd_endpoints = self.etcd_endpoints.clone();
        }
        if let Some(v) = &self.etcd_prefix {
            c.etcd_prefix = v.clone();
        }
        if let Some(v) = self.etcd_lease_ttl_s {
            c.etcd_lease_ttl_s = v;
        }
        for (flag, field) in [
            (&self.etcd_ca, &mut c.etcd_ca),
            (&self.etcd_cert, &mut c.etcd_cert),
            (&self.etcd_key, &mut c.etcd_key),
        ] {
            if flag.is_some() {
                field.clone_from(flag);
            }
        }
        let mut named = std::collections::HashSet::new();
        for p in &self.peers {
            let peer = Config::parse_peer(p)?;
            if !named.insert(peer.name.clone()) {
                return Err(config::ConfigError::Invalid(format!(
                    "--peer {:?} is given twice (a peer's rails go in one --peer, comma-separated)",
                    peer.name
                )));
            }
            // A --peer replaces the configuration file's peer of that name.
            c.peers.retain(|q| q.name != peer.name);
            c.peers.push(peer);
        }
        if let Some(v) = self.connections_per_rail {
            c.connections_per_rail = v;
        }
        if let Some(v) = self.slice_bytes {
            c.slice_bytes = v;
        }
        if let Some(v) = self.window_bytes {
            c.window_bytes = v;
        }
        if let Some(v) = self.progress_timeout_ms {
            c.progress_timeout_ms = v;
        }
        if let Some(v) = self.rail_stall_ms {
            c.rail_stall_ms = v;
        }
        if let Some(v) = self.rail_deadline_ms {
            c.rail_deadline_ms = v;
        }
        if let Some(v) = self.max_transfer_state_bytes {
            c.max_transfer_state_bytes = v;
        }
        if self.metrics_addr.is_some() {
            c.metrics_addr = self.metrics_addr;
        }
        if self.no_rdma {
            c.rdma = false;
        }
        if !self.rdma_devices.is_empty() {
            c.rdma_devices = self.rdma_devices.clone();
        }
        if let Some(v) = self.rdma_qps_per_rail {
            c.rdma_qps_per_rail = v;
        }
        if let Some(v) = &self.tls_dir {
            c.tls_dir = Some(v.clone());
        }
        if let Some(v) = self.ring_spin_us {
            c.ring_spin_us = Some(v);
        }
        if let Some(v) = self.reader_spin_us {
            c.reader_spin_us = Some(v);
        }
        if let Some(v) = self.connection_threads {
            c.connection_threads = Some(v);
        }
        if let Some(v) = self.spread_min_slice_bytes {
            c.spread_min_slice_bytes = Some(v);
        }
        if let Some(v) = self.rdma_eager_max_bytes {
            c.rdma_eager_max_bytes = v;
        }
        if let Some(v) = self.runtime_busy_poll_us {
            c.runtime_busy_poll_us = v;
        }
        if self.no_ring_inline_writes {
            c.ring_inline_writes = false;
        }
        if self.no_inline_control_writes {
            c.inline_control_writes = false;
        }
        if let Some(v) = self.quic_initial_mtu {
            c.quic_initial_mtu = v;
        }
        if let Some(v) = self.quic_max_udp_payload {
            c.quic_max_udp_payload = v;
        }
        if self.no_quic_gso {
            c.quic_gso = false;
        }
        if let Some(v) = self.quic_streams_per_connection {
            c.quic_streams_per_connection = v;
        }
        if let Some(v) = self.quic_receive_sockets {
            c.quic_receive_sockets = v;
        }
        if let Some(v) = self.gpu_stage_depth {
            c.gpu_stage_depth = v;
        }
        if self.no_gpu_batch_copies {
            c.gpu_batch_copies = false;
        }
        if let Some(v) = self.gpu_slice_bytes {
            c.gpu_slice_bytes = v;
        }
        if let Some(v) = self.gpu_copy_streams {
            c.gpu_copy_streams = v;
        }
        if self.insecure {
            c.insecure = true;
        }
        if !self.transports.is_empty() {
            c.transports = self.transports.clone();
        }
        c.validate()?;
        Ok(c)
    }
}

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    #[cfg(feature = "profile")]
    let profile = profile::start_from_env();
    trace_points::start_from_env();
    let config = args.to_config()?;
    if let Some(pid) = args.parent_pid {
        let parent = std::os::unix::process::parent_id();
        if parent != pid {
            anyhow::bail!(
                "--parent-pid {pid} is not this process's parent ({parent}): it has exited, \
                 or a wrapper that forks started this one"
            );
        }
    }
    let daemon = Daemon::start(config).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = parent_gone(args.parent_pid) => {
            tracing::warn!("the process that started this sidecar exited");
        }
    }
    tracing::info!("shutting down");
    #[cfg(feature = "profile")]
    if let Some(p) = &profile {
        p.write();
    }
    trace_points::write();
    daemon.leave().await;
    daemon.shutdown();
    Ok(())
}

/// Resolves once `pid` is no longer this process's parent (never for
/// `None`). Polled: the kernel's parent-death signal follows the thread that
/// forked, not the process, and a runtime's threads come and go.
async fn parent_gone(pid: Option<u32>) {
    let Some(pid) = pid else {
        return std::future::pending().await;
    };
    while std::os::unix::process::parent_id() == pid {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// An error as one line for the terminal: its message, then each cause
/// the message does not already quote (most of ours quote their source).
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
    }
    line
}

/// Runs a command's body and turns its error into `error: ...` on stderr
/// and exit status 1 (no debug dump, whatever `RUST_BACKTRACE` says).
pub fn exit_on_error(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}
