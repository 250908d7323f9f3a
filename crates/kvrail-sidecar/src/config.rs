//! Daemon configuration: a TOML file and/or command-line flags (flags win).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// A peer node: its name and one address per rail.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    pub name: String,
    #[serde(deserialize_with = "rail_addrs")]
    pub rails: Vec<SocketAddr>,
    /// SHA-256 (hex) its certificate must have: pinned in the configuration,
    /// or named by its membership record. Unset: any certificate of the
    /// cluster's CA that names it.
    #[serde(default)]
    pub cert_sha256: Option<String>,
    /// The process its membership record names (never set by configuration):
    /// another process answering or calling under its name is refused.
    #[serde(skip)]
    pub incarnation: Option<u64>,
}

/// Everything the daemon needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's name, as peers know it.
    pub node: String,
    /// Unix socket of the local worker API.
    pub socket: PathBuf,
    /// One listen address per local rail.
    #[serde(deserialize_with = "rail_addrs")]
    pub listen: Vec<SocketAddr>,
    pub peers: Vec<PeerConfig>,
    /// Where peers reach this node's rails, one per rail, when that is not
    /// `listen` (a wildcard or NAT'd listen address); published in etcd.
    #[serde(deserialize_with = "rail_addrs")]
    pub advertise: Vec<SocketAddr>,
    /// etcd endpoints (`http://HOST:PORT`) of the cluster's membership: this
    /// node registers there and learns its peers there. Empty: static peers only.
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of this cluster in etcd (records live under PREFIX/nodes/).
    pub etcd_prefix: String,
    /// Lease of this node's record: it disappears this long after the
    /// sidecar stops renewing it (killed, or cut off from etcd).
    pub etcd_lease_ttl_s: u64,
    /// CA certificate (PEM) that signed the etcd servers' certificates:
    /// needed for `https://` endpoints.
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate and key (PEM) this node shows etcd, when etcd
    /// asks for one (`--client-cert-auth`).
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    /// TCP connections opened per rail to each peer.
    pub connections_per_rail: usize,
    pub slice_bytes: u64,
    pub window_bytes: u64,
    pub progress_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// A rail whose bytes go unacknowledged this long is declared down (sooner once
    /// its rate is known, never under 300 ms); half of it makes the rail suspect.
    pub rail_stall_ms: u64,
    /// Transfers fail once every rail to their peer has been down this long.
    pub rail_deadline_ms: u64,
    /// Memory all open transfers together may hold (their block ids,
    /// generations, plans, queued opens; not payload), whoever opened them:
    /// the node's budget, of which one peer session may hold half.
    pub max_transfer_state_bytes: u64,
    /// Longest wait between attempts to rebuild a down rail.
    pub rail_probe_max_ms: u64,
    /// Prometheus `/metrics` listener, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// Use RDMA where a rail has a device (found by its listen address).
    pub rdma: bool,
    /// RDMA device per rail by name (else found by the rail's address).
    pub rdma_devices: Vec<String>,
    /// GID index to use with named devices whose GID table lacks the rail address.
    pub rdma_gid_index: Option<u8>,
    /// Queue pairs per rail and peer.
    pub rdma_qps_per_rail: usize,
    /// Poll completion queues this long before sleeping on the completion channel.
    pub rdma_busy_poll_us: u64,
    /// After traffic, one runtime worker keeps polling the sockets this long
    /// instead of sleeping (see `busy_poll`); 0 (the default): off. 1000 on a
    /// 2-core machine: 4 KiB push p50 ~108 -> ~76 us; no gain on 16 cores.
    /// Not the default: see docs/ring-format.md (a review's open questions).
    pub runtime_busy_poll_us: u64,
    /// How long a worker ring's thread spins for the next submission before
    /// it sleeps on the ring's futex, fixed. Unset: it follows the worker's
    /// pace (twice its recent gap between submissions, 50 to 500 us; see
    /// `kvrail_core::ring::SpinPolicy`) on machines with at least 4 CPUs, and
    /// is 0 on smaller ones (there a spinning thread takes the core the worker
    /// and the sidecar's own tasks need: measured in docs/ring-format.md).
    pub ring_spin_us: Option<u64>,
    /// How long a connection's reader, with nothing left to read, polls its
    /// socket for the next frame before it sleeps in `epoll` (sparing a small
    /// transfer the wake-up), while traffic is not bulk. Unset: 50 us on
    /// machines with at least 4 CPUs, 0 below (200 us, which yields its CPU
    /// each round, measured faster there but is not the default: two CI runs
    /// on 2 cores with it failed in timing-sensitive tests, cause not
    /// measured; docs/ring-format.md).
    pub reader_spin_us: Option<u64>,
    /// Each TCP connection's reader and writer run on a thread of their own,
    /// its socket registered there, instead of on the shared runtime (at
    /// most four such threads per CPU; connections past that share the
    /// runtime). Unset: on with at least 8 CPUs, off below (on 2 CPUs the
    /// extra threads compete with the worker for the cores).
    pub connection_threads: Option<bool>,
    /// A host transfer no larger than a slice per connection of its rail is
    /// cut into one slice per connection, each at least this large, so that
    /// the connections move it together (a 1 MiB push in four 256 KiB
    /// slices). Unset: 262144 with `connection_threads`, 0 (off) without
    /// (on the shared runtime the connections' tasks run one after another).
    /// On four 16-core instances it lowered a 1 MiB push's p50 on each, and
    /// its p99 on three (docs/benchmarks.md).
    pub spread_min_slice_bytes: Option<u64>,
    /// A ring's thread writes a small transfer's frames itself when the
    /// connection's writer is idle (instead of waking the writer task).
    pub ring_inline_writes: bool,
    /// A runtime task that produces only control frames for a connection
    /// (a receiver's acknowledgement or Complete, a Grant) writes them itself
    /// when the connection's writer is idle, instead of waking the writer task.
    pub inline_control_writes: bool,
    /// RDMA: transfers of at most this many bytes travel behind their open
    /// on the rail's stream connection instead of waiting a round trip for
    /// the peer's grant of its memory (0: every transfer one-sided).
    pub rdma_eager_max_bytes: u64,
    /// Queue pair ACK timeout exponent (4.096 us x 2^n per try).
    pub rdma_timeout: u8,
    /// Queue pair retries before it fails (7 retries for ever on Soft-RoCE).
    pub rdma_retry_cnt: u8,
    /// How long a sender waits after our "receiver not ready" NAK (IB encoding:
    /// 12 = 0.64 ms, 26 = 82 ms).
    pub rdma_min_rnr_timer: u8,
    /// Retries after a "receiver not ready" NAK (7 = for ever).
    pub rdma_rnr_retry: u8,
    /// Transports in order of preference; each peer pair uses the first both
    /// sides have ("rdma" rides on the chosen stream transport's connections).
    /// Empty: rdma, quic (when `tls_dir` is set), tcp; see [`Config::transport_order`].
    pub transports: Vec<String>,
    /// Directory of the cluster CA and node certificates (`kvrail certs`):
    /// `ca.pem`, `NODE.pem`, `NODE.key`. Needed for QUIC.
    pub tls_dir: Option<PathBuf>,
    /// Allow TCP peer connections without authentication (no `tls_dir` needed).
    /// Anyone who reaches a rail port can then pose as a peer.
    pub insecure: bool,
    /// QUIC: largest UDP payload MTU discovery may reach.
    pub quic_max_udp_payload: u16,
    /// QUIC: UDP payload a connection starts with (1200 fits any path).
    pub quic_initial_mtu: u16,
    /// GPU regions: slices a connection's writer copies device-to-host ahead of
    /// the one on the wire (each takes a pinned staging buffer, see
    /// `staging_bytes`).
    pub gpu_stage_depth: usize,
    /// GPU regions: CUDA streams per copy direction and device, used in turn
    /// (each with its own waiter thread).
    pub gpu_copy_streams: usize,
    /// GPU regions: largest slice of a transfer from or into one (each
    /// staged slice costs device copy calls the driver serialises, so they
    /// are larger than host slices; docs/gpu.md). At most half of
    /// `window_bytes` is used; staging buffers are the larger of this and
    /// `slice_bytes`.
    pub gpu_slice_bytes: u64,
    /// GPU regions: a slice's scattered pieces go in one `cuMemcpyBatchAsync`
    /// where the driver has it (CUDA 12.8+), not one copy call per piece.
    pub gpu_batch_copies: bool,
    /// QUIC: per-stream and per-connection receive windows, and the send window.
    pub quic_stream_window: u64,
    pub quic_connection_window: u64,
    pub quic_send_window: u64,
    /// QUIC: UDP segmentation offload.
    pub quic_gso: bool,
    /// QUIC: UDP socket send and receive buffer size (the kernel caps it at
    /// `net.core.wmem_max` / `rmem_max`).
    pub quic_socket_buffer: usize,
    /// QUIC: kvrail connections (of `connections_per_rail`) carried as streams
    /// of one QUIC connection; 1 gives each its own QUIC connection and CPU task.
    pub quic_streams_per_connection: usize,
    /// QUIC: UDP sockets each rail listener receives on, sharing its port
    /// (`SO_REUSEPORT`); 0: one per core (at most 16) above 4 cores, else 1.
    pub quic_receive_sockets: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node: "node".into(),
            socket: PathBuf::from("/tmp/kvrail.sock"),
            listen: vec![],
            peers: vec![],
            advertise: vec![],
            etcd_endpoints: vec![],
            etcd_prefix: "/kvrail/default".into(),
            etcd_lease_ttl_s: 10,
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            connections_per_rail: 4,
            slice_bytes: 1 << 20,
            window_bytes: 8 << 20,
            progress_timeout_ms: 10_000,
            connect_timeout_ms: 3_000,
            rail_stall_ms: 1_000,
            rail_deadline_ms: 5_000,
            max_transfer_state_bytes: kvrail_core::budget::DEFAULT_NODE_TRANSFER_BYTES,
            rail_probe_max_ms: 2_000,
            metrics_addr: None,
            rdma: true,
            rdma_devices: vec![],
            rdma_gid_index: None,
            rdma_qps_per_rail: 2,
            rdma_busy_poll_us: 0,
            runtime_busy_poll_us: 0,
            ring_spin_us: None,
            reader_spin_us: None,
            connection_threads: None,
            spread_min_slice_bytes: None,
            ring_inline_writes: true,
            inline_control_writes: true,
            rdma_eager_max_bytes: kvrail_core::session::DEFAULT_EAGER_MAX_BYTES,
            rdma_timeout: 14,
            rdma_retry_cnt: 6,
            rdma_min_rnr_timer: 12,
            rdma_rnr_retry: 7,
            transports: vec![],
            tls_dir: None,
            insecure: false,
            quic_max_udp_payload: 65_000,
            quic_initial_mtu: 1200,
            gpu_stage_depth: 3,
            gpu_copy_streams: 1,
            gpu_slice_bytes: kvrail_core::session::DEFAULT_STAGED_SLICE_BYTES,
            gpu_batch_copies: true,
            quic_stream_window: 32 << 20,
            quic_connection_window: 64 << 20,
            quic_send_window: 64 << 20,
            quic_gso: true,
            quic_socket_buffer: 32 << 20,
            quic_streams_per_connection: 1,
            quic_receive_sockets: 0,
        }
    }
}

/// A rail's address, `IP:PORT`; the error says so, and that host names are
/// not resolved (a rail is one interface's address).
pub fn parse_rail_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse().map_err(|_| {
        format!(
            "{text:?} is not IP:PORT (e.g. 10.0.0.1:7400 or [fd00::1]:7400; host names are not resolved: a rail is an interface's address)"
        )
    })
}

/// Rail addresses in the TOML file, with [`parse_rail_addr`]'s error.
fn rail_addrs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<SocketAddr>, D::Error> {
    let texts: Vec<String> = Deserialize::deserialize(d)?;
    texts
        .iter()
        .map(|t| parse_rail_addr(t).map_err(serde::de::Error::custom))
        .collect()
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid peer {0:?}: expected NAME=IP:PORT[,IP:PORT...], one address per rail (host names are not resolved: a rail is an interface's address)")]
    PeerSyntax(String),
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// The spin of worker ring threads (see [`Config::ring_spin_us`]).
    pub fn ring_spin(&self) -> kvrail_core::ring::SpinPolicy {
        use kvrail_core::ring::SpinPolicy;
        use std::time::Duration;
        if let Some(us) = self.ring_spin_us {
            return SpinPolicy::fixed(Duration::from_micros(us));
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if kvrail_core::ring::spins_with(cpus) {
            SpinPolicy::adaptive(Duration::from_micros(50), Duration::from_micros(500))
        } else {
            SpinPolicy::fixed(Duration::ZERO)
        }
    }

    /// Whether connections run on threads of their own (see
    /// [`Config::connection_threads`]).
    pub fn connection_threads(&self) -> bool {
        self.connection_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) >= 8)
    }

    /// See [`Config::spread_min_slice_bytes`].
    pub fn spread_min_slice_bytes(&self) -> u64 {
        self.spread_min_slice_bytes
            .unwrap_or(if self.connection_threads() {
                256 << 10
            } else {
                0
            })
    }

    /// The spin of connection readers (see [`Config::reader_spin_us`]).
    pub fn reader_spin(&self) -> std::time::Duration {
        let us = self.reader_spin_us.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            if kvrail_core::ring::spins_with(cpus) {
                50
            } else {
                0
            }
        });
        std::time::Duration::from_micros(us)
    }

    /// Largest slice of a staged (GPU) transfer: `gpu_slice_bytes`, at most
    /// half the window (two in flight per connection) unless that is less
    /// than a host slice.
    pub fn staged_slice_bytes(&self) -> u64 {
        self.gpu_slice_bytes
            .min((self.window_bytes / 2).max(self.slice_bytes))
    }

    /// Bytes of one pinned staging buffer: a slice of either kind fits.
    pub fn staging_bytes(&self) -> u64 {
        self.slice_bytes.max(self.staged_slice_bytes())
    }

    /// How long a runtime worker keeps polling after traffic (see
    /// [`Config::runtime_busy_poll_us`]).
    pub fn runtime_busy_poll(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.runtime_busy_poll_us)
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses `NAME=ADDR[,ADDR...]`.
    pub fn parse_peer(spec: &str) -> Result<PeerConfig, ConfigError> {
        let (name, addrs) = spec
            .split_once('=')
            .ok_or_else(|| ConfigError::PeerSyntax(spec.into()))?;
        let rails = addrs
            .split(',')
            .map(|a| parse_rail_addr(a.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| ConfigError::PeerSyntax(spec.into()))?;
        if name.is_empty() || rails.is_empty() {
            return Err(ConfigError::PeerSyntax(spec.into()));
        }
        Ok(PeerConfig {
            name: name.into(),
            rails,
            cert_sha256: None,
            incarnation: None,
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        if let Err(why) = kvrail_auth::check_node_name(&self.node) {
            return Err(ConfigError::Invalid(why));
        }
        if !(100..=3_600_000).contains(&self.progress_timeout_ms) {
            return bad("progress_timeout_ms must be 100..=3600000 (an hour)");
        }
        // At most 32 Ki slices of the smallest size per connection: far below
        // what marks a peer as not reading (64 Ki frames unwritten).
        if self.window_bytes > (128 << 20) {
            return bad("window_bytes must be at most 128 MiB");
        }
        if self.ring_spin_us.is_some_and(|us| us > 1_000_000) {
            return bad("ring_spin_us must be at most 1000000 (1 s)");
        }
        if self.reader_spin_us.is_some_and(|us| us > 1_000_000) {
            return bad("reader_spin_us must be at most 1000000 (1 s)");
        }
        if self.rdma_eager_max_bytes > (64 << 20) {
            return bad("rdma_eager_max_bytes must be at most 64 MiB");
        }
        if self.listen.is_empty() {
            return bad("at least one listen address (rail) is required");
        }
        // Checked alone first: the products below would wrap (in release
        // builds) for a huge value, and a wrapped product passes.
        if !(1..=64).contains(&self.connections_per_rail)
            || self.connections_per_rail * self.listen.len().max(1) > 64
        {
            return bad("connections_per_rail must be 1..=64 (in total over all rails)");
        }
        if !(1..=64).contains(&self.gpu_stage_depth) {
            return bad("gpu_stage_depth must be 1..=64");
        }
        if !(1..=32).contains(&self.gpu_copy_streams) {
            return bad("gpu_copy_streams must be 1..=32");
        }
        if !(4096..=(64 << 20)).contains(&self.slice_bytes) {
            return bad("slice_bytes must be between 4 KiB and 64 MiB");
        }
        if !(4096..=(64 << 20)).contains(&self.gpu_slice_bytes) {
            return bad("gpu_slice_bytes must be between 4 KiB and 64 MiB");
        }
        if !(100..=60_000).contains(&self.rail_stall_ms)
            || !(100..=600_000).contains(&self.rail_deadline_ms)
            || !(50..=60_000).contains(&self.rail_probe_max_ms)
        {
            return bad("rail_stall_ms must be 100..=60000, rail_deadline_ms 100..=600000, rail_probe_max_ms 50..=60000");
        }
        if !((16 << 20)..=(1 << 40)).contains(&self.max_transfer_state_bytes) {
            return bad("max_transfer_state_bytes must be between 16 MiB and 1 TiB");
        }
        if !(1..=8).contains(&self.rdma_qps_per_rail) {
            return bad("rdma_qps_per_rail must be 1..=8");
        }
        // A session holds at most 64 connections: stream connections, and
        // queue pairs where RDMA may be used.
        let qps = if self.rdma && self.wants("rdma") {
            self.rdma_qps_per_rail
        } else {
            0
        };
        let rails = self.listen.len().max(1);
        if (self.connections_per_rail + qps) * rails > 64 {
            return Err(ConfigError::Invalid(format!(
                "connections_per_rail ({}) plus rdma_qps_per_rail ({qps} with RDMA on) times {rails} rail(s) is more than 64 connections per session",
                self.connections_per_rail
            )));
        }
        if self.rdma_timeout > 31
            || self.rdma_retry_cnt > 7
            || self.rdma_min_rnr_timer > 31
            || self.rdma_rnr_retry > 7
        {
            return bad("rdma_timeout and rdma_min_rnr_timer must be 0..=31, rdma_retry_cnt and rdma_rnr_retry 0..=7");
        }
        if self
            .transports
            .iter()
            .any(|t| !["rdma", "quic", "tcp"].contains(&t.as_str()))
        {
            return bad("transports must list some of rdma, quic, tcp");
        }
        if !self
            .transport_order()
            .iter()
            .any(|t| t == "quic" || t == "tcp")
        {
            return bad("transports needs quic or tcp (RDMA sets up over one of them)");
        }
        if self.insecure && self.tls_dir.is_some() {
            // Both would let anyone who reaches a rail port pose as a peer over
            // TCP while the node looks authenticated: choose one.
            return bad("insecure and tls_dir together: with tls_dir, TCP is authenticated (drop --insecure); without it, --insecure runs TCP unauthenticated");
        }
        if self.wants("tcp") && self.tls_dir.is_none() && !self.insecure {
            return bad("tcp between sidecars is authenticated with the node's certificate: set tls_dir (see `kvrail certs`), or pass --insecure to run it unauthenticated");
        }
        if self.transports.iter().any(|t| t == "quic") && self.tls_dir.is_none() {
            return bad("quic needs tls_dir with the cluster's certificates (kvrail certs), or leave quic out of transports");
        }
        if self.quic_streams_per_connection == 0
            || self.quic_streams_per_connection > kvrail_quic::MAX_STREAMS_PER_CONNECTION as usize
        {
            return bad("quic_streams_per_connection must be 1 to 64");
        }
        if self.quic_receive_sockets > 64 {
            return bad("quic_receive_sockets must be 0 (one per core) to 64");
        }
        if !(1200..=65507).contains(&self.quic_max_udp_payload) {
            return bad("quic_max_udp_payload must be 1200 to 65507");
        }
        // Measured on loopback (quinn 0.11): handshakes whose first packet
        // carries 12,000 bytes or more never complete; MTU discovery reaches
        // larger packets from a smaller start.
        if !(1200..=9000).contains(&self.quic_initial_mtu) {
            return bad("quic_initial_mtu must be 1200 to 9000 (discovery raises it to quic_max_udp_payload)");
        }
        if self.runtime_busy_poll_us > 1_000_000 {
            return bad("runtime_busy_poll_us must be at most 1000000 (1 s)");
        }
        if self.window_bytes < self.slice_bytes {
            return bad("window_bytes must be at least slice_bytes");
        }
        if !self.advertise.is_empty() && self.advertise.len() != self.listen.len() {
            return bad("advertise needs one address per rail (as many as listen)");
        }
        if let Some(a) = self
            .advertise
            .iter()
            .find(|a| a.ip().is_unspecified() || a.port() == 0)
        {
            return Err(ConfigError::Invalid(format!(
                "advertise address {a} is not where a peer can reach this node"
            )));
        }
        if !self.etcd_endpoints.is_empty() {
            for e in &self.etcd_endpoints {
                if !(e.starts_with("http://") || e.starts_with("https://")) || e.len() > 512 {
                    return Err(ConfigError::Invalid(format!(
                        "etcd endpoint {e:?}: expected http://HOST:PORT"
                    )));
                }
            }
            if !self.etcd_prefix.starts_with('/')
                || self.etcd_prefix.len() > 256
                || self.etcd_prefix.contains("//")
            {
                return bad(
                    "etcd_prefix must start with '/' (e.g. /kvrail/prod), at most 256 bytes",
                );
            }
            if !(2..=3600).contains(&self.etcd_lease_ttl_s) {
                return bad("etcd_lease_ttl_s must be 2 to 3600");
            }
            let https = self
                .etcd_endpoints
                .iter()
                .filter(|e| e.starts_with("https://"))
                .count();
            if https != 0 && https != self.etcd_endpoints.len() {
                return bad("etcd_endpoints must be all http:// or all https://");
            }
            if https != 0 && self.etcd_ca.is_none() {
                return bad("https:// etcd endpoints need etcd_ca: the CA certificate (PEM) that signed etcd's");
            }
            if https == 0 && (self.etcd_ca.is_some() || self.etcd_cert.is_some()) {
                return bad(
                    "etcd_ca and etcd_cert are for https:// etcd endpoints; these are http://",
                );
            }
            if self.etcd_cert.is_some() != self.etcd_key.is_some() {
                return bad("etcd_cert and etcd_key go together");
            }
            if self.advertise.is_empty() {
                if let Some(a) = self.listen.iter().find(|a| a.ip().is_unspecified()) {
                    return Err(ConfigError::Invalid(format!(
                        "listen address {a} is a wildcard: with etcd_endpoints, set advertise to the addresses peers reach this node at"
                    )));
                }
            }
        }
        for (i, p) in self.peers.iter().enumerate() {
            if let Err(why) = kvrail_auth::check_node_name(&p.name) {
                return Err(ConfigError::Invalid(format!("peer: {why}")));
            }
            if p.name == self.node {
                return bad("a peer cannot have this node's name");
            }
            if self.peers[..i].iter().any(|q| q.name == p.name) {
                return Err(ConfigError::Invalid(format!(
                    "peer {:?} is given twice",
                    p.name
                )));
            }
            if let Some(fp) = &p.cert_sha256 {
                if fp.len() != 64 || !fp.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(ConfigError::Invalid(format!(
                        "peer {:?}: cert_sha256 must be 64 hex digits (sha256sum of the certificate's DER)",
                        p.name
                    )));
                }
            }
            if p.rails.is_empty() || p.rails.len() * self.connections_per_rail > 64 {
                return bad("each peer needs 1 or more rails, at most 64 connections in all");
            }
        }
        Ok(())
    }

    /// The QUIC driver's settings.
    pub fn quic_settings(&self) -> kvrail_quic::QuicSettings {
        kvrail_quic::QuicSettings {
            max_udp_payload: self.quic_max_udp_payload,
            initial_mtu: self.quic_initial_mtu,
            stream_window: self.quic_stream_window,
            connection_window: self.quic_connection_window,
            send_window: self.quic_send_window,
            gso: self.quic_gso,
            socket_buffer: self.quic_socket_buffer,
            streams_per_connection: self.quic_streams_per_connection,
            receive_sockets: self.quic_receive_sockets,
            peer_addresses: self.peer_addresses(),
            ..Default::default()
        }
    }

    /// Where the configured peers dial from: their rails' addresses (their
    /// handshakes are admitted before others').
    pub fn peer_addresses(&self) -> Vec<std::net::IpAddr> {
        let mut ips: Vec<std::net::IpAddr> = self
            .peers
            .iter()
            .flat_map(|p| p.rails.iter().map(|r| r.ip()))
            .collect();
        ips.sort_unstable();
        ips.dedup();
        ips
    }

    /// Where peers reach this node's rails: `advertise`, else `listen`.
    pub fn advertised_rails(&self) -> &[SocketAddr] {
        if self.advertise.is_empty() {
            &self.listen
        } else {
            &self.advertise
        }
    }

    /// Transports in order of preference: as configured, or by default rdma,
    /// quic (only with an identity: QUIC always authenticates), tcp.
    pub fn transport_order(&self) -> Vec<String> {
        if !self.transports.is_empty() {
            return self.transports.clone();
        }
        let mut order = vec!["rdma".to_string()];
        if self.tls_dir.is_some() {
            order.push("quic".into());
        }
        order.push("tcp".into());
        order
    }

    /// Whether `transport` is enabled here.
    pub fn wants(&self, transport: &str) -> bool {
        self.transport_order().iter().any(|t| t == transport)
    }

    /// Where `transport` stands in our preference (lower is better).
    pub fn rank(&self, transport: &str) -> usize {
        self.transport_order()
            .iter()
            .position(|t| t == transport)
            .unwrap_or(usize::MAX)
    }

    pub fn progress_timeout(&self) -> Duration {
        Duration::from_millis(self.progress_timeout_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// Rail scheduling and failover settings for the core.
    pub fn rail_config(&self) -> kvrail_core::RailConfig {
        let stall = Duration::from_millis(self.rail_stall_ms);
        let defaults = kvrail_core::RailConfig::default();
        kvrail_core::RailConfig {
            stall_timeout: stall,
            stall_floor: defaults.stall_floor.min(stall),
            all_down_deadline: Duration::from_millis(self.rail_deadline_ms),
            probe_backoff_max: Duration::from_millis(self.rail_probe_max_ms),
            probe_backoff_initial: defaults
                .probe_backoff_initial
                .min(Duration::from_millis(self.rail_probe_max_ms)),
            stripe_threshold: self.slice_bytes,
            ..defaults
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host name where a rail address goes is refused saying that rails
    /// are IP:PORT, on the command line and in the file alike.
    #[test]
    fn rail_addresses_must_be_ip_and_port_and_say_so() {
        let e = Config::parse_peer("b=localhost:7470")
            .unwrap_err()
            .to_string();
        assert!(e.contains("host names are not resolved"), "{e}");
        let e = parse_rail_addr("localhost:7470").unwrap_err();
        assert!(e.contains("\"localhost:7470\" is not IP:PORT"), "{e}");
        let e = toml::from_str::<Config>("node = \"a\"\nlisten = [\"host:1\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("host names are not resolved"), "{e}");
        let e = toml::from_str::<Config>(
            "node = \"a\"\n[[peers]]\nname = \"b\"\nrails = [\"b.example:7470\"]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"b.example:7470\" is not IP:PORT"), "{e}");
        assert_eq!(
            Config::parse_peer("b=127.0.0.1:1,[::1]:2").unwrap().rails,
            vec![
                "127.0.0.1:1".parse::<SocketAddr>().unwrap(),
                "[::1]:2".parse().unwrap()
            ]
        );
    }

    /// Queue pairs count toward a session's 64 connections only where RDMA
    /// may be used, and the refusal names the setting.
    #[test]
    fn the_connection_limit_counts_queue_pairs_only_with_rdma() {
        let mut c = Config {
            listen: vec!["127.0.0.1:7400".parse().unwrap()],
            connections_per_rail: 63,
            insecure: true,
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("connections_per_rail (63)"), "{e}");
        c.rdma = false;
        c.validate().unwrap();
        c.rdma = true;
        c.transports = vec!["tcp".into()];
        c.validate().unwrap();
        c.connections_per_rail = 65;
        assert!(c.validate().is_err());
    }

    /// A connection count whose product with the rails wraps (2^63 + 1 times
    /// two rails is 2) is refused, not passed on to a daemon that would
    /// never finish dialing.
    #[test]
    fn a_connection_count_whose_product_wraps_is_refused() {
        let c = Config {
            listen: vec![
                "127.0.0.1:7400".parse().unwrap(),
                "127.0.0.1:7401".parse().unwrap(),
            ],
            connections_per_rail: (1 << 63) + 1,
            insecure: true,
            rdma: false,
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("connections_per_rail must be 1..=64"), "{e}");
    }

    #[test]
    fn parses_toml_and_peer_flags() {
        let c: Config = toml::from_str(
            r#"
            node = "decode-0"
            listen = ["127.0.0.1:7400", "127.0.0.1:7401"]
            [[peers]]
            name = "prefill-0"
            rails = ["127.0.0.1:7500", "127.0.0.1:7501"]
            "#,
        )
        .unwrap();
        // TCP without an identity only when asked for in so many words.
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--insecure") && e.contains("tls_dir"), "{e}");
        let c = Config {
            insecure: true,
            ..c
        };
        c.validate().unwrap();
        assert_eq!(c.peers[0].rails.len(), 2);
        assert_eq!(c.connections_per_rail, 4);
        // QUIC is in the default order only with an identity to authenticate with.
        assert_eq!(c.transport_order(), ["rdma", "tcp"]);
        let with_certs = Config {
            tls_dir: Some("/etc/kvrail".into()),
            ..c.clone()
        };
        assert_eq!(with_certs.transport_order(), ["rdma", "quic", "tcp"]);
        // Certificates and --insecure together are refused, not half-applied.
        let e = with_certs.validate().unwrap_err().to_string();
        assert!(e.contains("insecure and tls_dir together"), "{e}");
        let secure = Config {
            insecure: false,
            ..with_certs
        };
        secure.validate().unwrap();
        // Receiving sockets: 0 (chosen by core count) to 64, passed to QUIC.
        let many = Config {
            quic_receive_sockets: 8,
            ..secure.clone()
        };
        many.validate().unwrap();
        assert_eq!(many.quic_settings().receive_sockets, 8);
        let e = Config {
            quic_receive_sockets: 65,
            ..secure
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("quic_receive_sockets"), "{e}");
        // The runtime's busy poll: as configured (0 = off), at most a second.
        let polled = Config {
            runtime_busy_poll_us: 0,
            ..many.clone()
        };
        polled.validate().unwrap();
        assert!(polled.runtime_busy_poll().is_zero());
        let e = Config {
            runtime_busy_poll_us: 2_000_000,
            ..many
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("runtime_busy_poll_us"), "{e}");
        let p = Config::parse_peer("b=127.0.0.1:1,127.0.0.1:2").unwrap();
        assert_eq!(p.rails.len(), 2);
        assert!(Config::parse_peer("b").is_err());
        assert!(Config::parse_peer("b=nope").is_err());
        assert!(toml::from_str::<Config>("nod = 'x'").is_err());
    }

    /// QUIC packet sizes: discovery's upper bound fits one IPv4 datagram; a
    /// connection starts at most at 9000 bytes (larger first packets hung
    /// the handshake on loopback).
    #[test]
    fn quic_packet_sizes_stay_within_what_a_datagram_and_a_handshake_take() {
        let ok = Config {
            insecure: true,
            listen: vec!["127.0.0.1:0".parse().unwrap()],
            ..Config::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.quic_settings().max_udp_payload, 65_000);
        for (bad, field) in [
            (
                Config {
                    quic_max_udp_payload: 65_508,
                    ..ok.clone()
                },
                "quic_max_udp_payload",
            ),
            (
                Config {
                    quic_max_udp_payload: 1_199,
                    ..ok.clone()
                },
                "quic_max_udp_payload",
            ),
            (
                Config {
                    quic_initial_mtu: 12_000,
                    ..ok.clone()
                },
                "quic_initial_mtu",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let largest_start = Config {
            quic_initial_mtu: 9_000,
            ..ok
        };
        largest_start.validate().unwrap();
        assert_eq!(largest_start.quic_settings().initial_mtu, 9_000);
    }

    /// Values that cannot work are refused with the setting's name, and a
    /// node name that would escape the TLS directory is refused.
    #[test]
    fn nonsense_values_and_unsafe_names_are_refused() {
        let ok = Config {
            insecure: true,
            listen: vec!["127.0.0.1:0".parse().unwrap()],
            ..Config::default()
        };
        let peer = |name: &str| PeerConfig {
            name: name.into(),
            rails: vec!["127.0.0.1:1".parse().unwrap()],
            cert_sha256: None,
            incarnation: None,
        };
        for (bad, field) in [
            (
                Config {
                    progress_timeout_ms: 0,
                    ..ok.clone()
                },
                "progress_timeout_ms",
            ),
            (
                Config {
                    window_bytes: u64::MAX,
                    ..ok.clone()
                },
                "window_bytes",
            ),
            (
                Config {
                    ring_spin_us: Some(u64::MAX),
                    ..ok.clone()
                },
                "ring_spin_us",
            ),
            (
                Config {
                    reader_spin_us: Some(2_000_000),
                    ..ok.clone()
                },
                "reader_spin_us",
            ),
            (
                Config {
                    rdma_eager_max_bytes: u64::MAX,
                    ..ok.clone()
                },
                "rdma_eager_max_bytes",
            ),
            (
                Config {
                    node: "a/../b".into(),
                    ..ok.clone()
                },
                "not allowed",
            ),
            (
                Config {
                    peers: vec![peer("../x")],
                    ..ok.clone()
                },
                "peer",
            ),
            (
                Config {
                    peers: vec![peer("b"), peer("b")],
                    ..ok.clone()
                },
                "twice",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn gpu_slices_are_larger_within_half_the_window_and_staging_holds_either() {
        let mib = 1u64 << 20;
        let c = Config::default();
        assert_eq!(c.staged_slice_bytes(), 4 * mib, "the default");
        assert_eq!(c.staging_bytes(), 4 * mib);
        let small_window = Config {
            window_bytes: 4 * mib,
            ..Config::default()
        };
        assert_eq!(small_window.staged_slice_bytes(), 2 * mib, "two in flight");
        let window_of_one_slice = Config {
            window_bytes: mib,
            ..Config::default()
        };
        assert_eq!(window_of_one_slice.staged_slice_bytes(), mib);
        let large_host_slices = Config {
            slice_bytes: 8 * mib,
            window_bytes: 8 * mib,
            ..Config::default()
        };
        assert_eq!(large_host_slices.staged_slice_bytes(), 4 * mib);
        assert_eq!(large_host_slices.staging_bytes(), 8 * mib);
        let good = Config {
            insecure: true,
            listen: vec!["127.0.0.1:7400".parse().unwrap()],
            ..Config::default()
        };
        good.validate().unwrap();
        let bad = Config {
            gpu_slice_bytes: 1,
            ..good
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("gpu_slice_bytes"), "{e}");
    }

    /// The example in deploy/ (what the systemd unit and the DaemonSet
    /// read) is a configuration that runs.
    #[test]
    fn the_deployment_example_is_valid() {
        let c: Config = toml::from_str(include_str!("../../../deploy/kvrail.toml"))
            .expect("deploy/kvrail.toml parses");
        c.validate().expect("deploy/kvrail.toml is valid");
        assert_eq!(c.etcd_endpoints.len(), 3);
        assert_eq!(c.listen.len(), 2);
    }

    /// https:// etcd needs the CA that signed etcd's certificate; a client
    /// certificate needs its key; TLS files for plain http are a mistake.
    #[test]
    fn etcd_tls_settings_are_checked() {
        let base = Config {
            listen: vec!["127.0.0.1:7400".parse().unwrap()],
            insecure: true,
            etcd_endpoints: vec!["https://e1:2379".into(), "https://e2:2379".into()],
            ..Config::default()
        };
        let error = |c: &Config| {
            c.validate()
                .map(|_| String::new())
                .unwrap_or_else(|e| e.to_string())
        };
        assert!(error(&base).contains("need etcd_ca"), "{}", error(&base));
        let with_ca = Config {
            etcd_ca: Some("/etc/etcd/ca.pem".into()),
            ..base.clone()
        };
        with_ca.validate().unwrap();
        let mixed = Config {
            etcd_endpoints: vec!["https://e1:2379".into(), "http://e2:2379".into()],
            ..with_ca.clone()
        };
        assert!(error(&mixed).contains("all http:// or all https://"));
        let half = Config {
            etcd_cert: Some("/etc/kvrail/etcd.pem".into()),
            ..with_ca.clone()
        };
        assert!(error(&half).contains("go together"));
        let plain = Config {
            etcd_endpoints: vec!["http://e1:2379".into()],
            ..with_ca
        };
        assert!(error(&plain).contains("for https://"));
    }
}
