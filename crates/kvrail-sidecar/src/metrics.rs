//! Every metric kvrail exports, named in one place.
//!
//! Labels: `peer` (node name), `rail` (rail index), `transport` (`tcp`, ...),
//! `direction` (`out`: the session this node dialed, `in`: one the peer dialed),
//! `kind` (`push`, `push_receive`, `pull`, `pull_serve`), `reason` (failure code),
//! `outcome` (of a received worker message or a ring submission: `accepted`,
//! `rejected`, `corrupt`).

use std::net::SocketAddr;

use metrics::{Counter, Gauge, Histogram};

use kvrail_core::TransferKind;
use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

pub const BYTES_SENT: &str = "kvrail_bytes_sent_total";
pub const BYTES_RECEIVED: &str = "kvrail_bytes_received_total";
pub const SLICES_SENT: &str = "kvrail_slices_sent_total";
pub const INLINE_WRITES: &str = "kvrail_inline_writes_total";
pub const SLICES_RECEIVED: &str = "kvrail_slices_received_total";
pub const READER_SPIN_FRAMES: &str = "kvrail_reader_spin_frames_total";
pub const TRANSFERS_STARTED: &str = "kvrail_transfers_started_total";
pub const TRANSFERS_DONE: &str = "kvrail_transfers_done_total";
pub const TRANSFERS_FAILED: &str = "kvrail_transfers_failed_total";
pub const TRANSFER_SECONDS: &str = "kvrail_transfer_duration_seconds";
pub const MESSAGES_SENT: &str = "kvrail_messages_sent_total";
pub const MESSAGES_RECEIVED: &str = "kvrail_messages_received_total";
pub const PEER_CONNECTIONS: &str = "kvrail_peer_connections";
pub const CONNECTIONS_LOST: &str = "kvrail_connections_lost_total";
pub const FRAMES_REJECTED: &str = "kvrail_frames_rejected_total";
pub const HANDSHAKES_REFUSED: &str = "kvrail_handshakes_refused_total";
pub const REGIONS_REGISTERED: &str = "kvrail_regions_registered";
pub const RAIL_STATE: &str = "kvrail_rail_state";
pub const RAIL_TRANSITIONS: &str = "kvrail_rail_transitions_total";
pub const RAIL_SLICES_RETRANSMITTED: &str = "kvrail_rail_slices_retransmitted_total";
pub const RAIL_THROUGHPUT: &str = "kvrail_rail_throughput_bytes_per_second";
pub const RAIL_PROBES_FAILED: &str = "kvrail_rail_probes_failed_total";
pub const PEER_TRANSPORT: &str = "kvrail_peer_transport";
pub const MEMBERSHIP_CONNECTED: &str = "kvrail_membership_connected";
pub const MEMBERSHIP_PEERS: &str = "kvrail_membership_peers";
pub const MEMBERSHIP_EVENTS: &str = "kvrail_membership_events_total";
pub const RDMA_BUILD_NANOS: &str = "kvrail_rdma_build_nanoseconds_total";
pub const RDMA_POST_NANOS: &str = "kvrail_rdma_post_nanoseconds_total";
pub const RDMA_WORK_REQUESTS: &str = "kvrail_rdma_work_requests_total";
pub const RDMA_DESCRIPTORS: &str = "kvrail_rdma_descriptors_total";
pub const GPU_STAGED_BYTES: &str = "kvrail_gpu_staged_bytes_total";
pub const GPU_COPY_FAILURES: &str = "kvrail_gpu_copy_failures_total";
pub const GPU_STAGING_BUFFER_BYTES: &str = "kvrail_gpu_staging_buffer_bytes";
pub const RINGS_OPEN: &str = "kvrail_rings_open";
pub const RING_SUBMISSIONS: &str = "kvrail_ring_submissions_total";
pub const RINGS_CLOSED: &str = "kvrail_rings_closed_total";
/// Memory peers and workers make this node hold, by `kind`
/// (`transfer_state`, `notifications_retained`, `notifications_queued`).
pub const HELD_BYTES: &str = "kvrail_held_bytes";
pub const PROCESS_STALLS: &str = "kvrail_process_stalls_total";
pub const QUIC_SOCKET_CONNECTIONS: &str = "kvrail_quic_socket_connections";
pub const PROCESS_STALL_SECONDS: &str = "kvrail_process_stall_seconds";

// Each metric's series, by its label values: the one place a label set is
// built (names and order as the module's header lists them).

fn peer_rail(peer: &str, rail: u32) -> [(&'static str, String); 2] {
    [("peer", peer.to_string()), ("rail", rail.to_string())]
}

fn connection(peer: &str, rail: u32, transport: &str) -> [(&'static str, String); 3] {
    [
        ("peer", peer.to_string()),
        ("rail", rail.to_string()),
        ("transport", transport.to_string()),
    ]
}

fn rail_of_session(peer: &str, rail: u32, direction: &str) -> [(&'static str, String); 3] {
    [
        ("peer", peer.to_string()),
        ("rail", rail.to_string()),
        ("direction", direction.to_string()),
    ]
}

pub fn transfers_started(kind: TransferKind) -> Counter {
    metrics::counter!(TRANSFERS_STARTED, "kind" => kind_label(kind))
}

pub fn transfers_done(kind: TransferKind) -> Counter {
    metrics::counter!(TRANSFERS_DONE, "kind" => kind_label(kind))
}

pub fn transfers_failed(kind: TransferKind, reason: &'static str) -> Counter {
    metrics::counter!(TRANSFERS_FAILED, "kind" => kind_label(kind), "reason" => reason)
}

pub fn transfer_seconds(kind: TransferKind) -> Histogram {
    metrics::histogram!(TRANSFER_SECONDS, "kind" => kind_label(kind))
}

pub fn regions_registered() -> Gauge {
    metrics::gauge!(REGIONS_REGISTERED)
}

pub fn messages_sent() -> Counter {
    metrics::counter!(MESSAGES_SENT)
}

/// `outcome`: delivered, unknown_worker, refused.
pub fn messages_received(outcome: &'static str) -> Counter {
    metrics::counter!(MESSAGES_RECEIVED, "outcome" => outcome)
}

pub fn peer_transport(peer: &str, transport: &'static str) -> Gauge {
    metrics::gauge!(PEER_TRANSPORT, "peer" => peer.to_string(), "transport" => transport)
}

pub fn handshakes_refused(reason: &'static str) -> Counter {
    metrics::counter!(HANDSHAKES_REFUSED, "reason" => reason)
}

pub fn frames_rejected(reason: &'static str) -> Counter {
    metrics::counter!(FRAMES_REJECTED, "reason" => reason)
}

pub fn peer_connections(peer: &str) -> Gauge {
    metrics::gauge!(PEER_CONNECTIONS, "peer" => peer.to_string())
}

pub fn connections_lost(peer: &str, rail: u32) -> Counter {
    metrics::counter!(CONNECTIONS_LOST, &peer_rail(peer, rail))
}

pub fn rail_slices_retransmitted(peer: &str, rail: u32) -> Counter {
    metrics::counter!(RAIL_SLICES_RETRANSMITTED, &peer_rail(peer, rail))
}

pub fn rail_probes_failed(peer: &str, rail: u32) -> Counter {
    metrics::counter!(RAIL_PROBES_FAILED, &peer_rail(peer, rail))
}

pub fn rail_state(peer: &str, rail: u32, direction: &str) -> Gauge {
    metrics::gauge!(RAIL_STATE, &rail_of_session(peer, rail, direction))
}

pub fn rail_throughput(peer: &str, rail: u32, direction: &str) -> Gauge {
    metrics::gauge!(RAIL_THROUGHPUT, &rail_of_session(peer, rail, direction))
}

pub fn rail_transitions(peer: &str, rail: u32, from: &'static str, to: &'static str) -> Counter {
    metrics::counter!(
        RAIL_TRANSITIONS,
        "peer" => peer.to_string(),
        "rail" => rail.to_string(),
        "from" => from,
        "to" => to
    )
}

/// Payload placed by a path outside a connection's reader (one-sided
/// completions, GPU copies): the same series as [`ConnCounters`].
pub fn bytes_received(peer: &str, rail: u32, transport: &str) -> Counter {
    metrics::counter!(BYTES_RECEIVED, &connection(peer, rail, transport))
}

pub fn slices_received(peer: &str, rail: u32, transport: &str) -> Counter {
    metrics::counter!(SLICES_RECEIVED, &connection(peer, rail, transport))
}

/// A queue pair's counters (`transport` rdma).
#[derive(Clone)]
pub struct RdmaCounters {
    pub build_nanos: Counter,
    pub post_nanos: Counter,
    pub work_requests: Counter,
    pub descriptors: Counter,
    pub bytes_sent: Counter,
    pub slices_sent: Counter,
    pub bytes_received: Counter,
    pub slices_received: Counter,
}

impl RdmaCounters {
    pub fn new(peer: &str, rail: u32) -> Self {
        let labels = connection(peer, rail, "rdma");
        RdmaCounters {
            build_nanos: metrics::counter!(RDMA_BUILD_NANOS, &labels),
            post_nanos: metrics::counter!(RDMA_POST_NANOS, &labels),
            work_requests: metrics::counter!(RDMA_WORK_REQUESTS, &labels),
            descriptors: metrics::counter!(RDMA_DESCRIPTORS, &labels),
            bytes_sent: metrics::counter!(BYTES_SENT, &labels),
            slices_sent: metrics::counter!(SLICES_SENT, &labels),
            bytes_received: metrics::counter!(BYTES_RECEIVED, &labels),
            slices_received: metrics::counter!(SLICES_RECEIVED, &labels),
        }
    }
}

/// `direction`: to_host, to_device.
pub fn gpu_staged_bytes(direction: &'static str) -> Counter {
    metrics::counter!(GPU_STAGED_BYTES, "direction" => direction)
}

pub fn gpu_copy_failures() -> Counter {
    metrics::counter!(GPU_COPY_FAILURES)
}

pub fn gpu_staging_buffer_bytes() -> Gauge {
    metrics::gauge!(GPU_STAGING_BUFFER_BYTES)
}

/// `kind`: joined, updated, restarted, left, refused, name_clash.
pub fn membership_events(kind: &'static str) -> Counter {
    metrics::counter!(MEMBERSHIP_EVENTS, "kind" => kind)
}

pub fn membership_connected() -> Gauge {
    metrics::gauge!(MEMBERSHIP_CONNECTED)
}

pub fn membership_peers() -> Gauge {
    metrics::gauge!(MEMBERSHIP_PEERS)
}

/// `cause` of a stall: the whole process did not run.
pub const STALL_PROCESS: &str = "process";
/// `cause` of a stall: the process ran but every async worker was busy.
pub const STALL_RUNTIME: &str = "runtime";

/// `cause`: [`STALL_PROCESS`] or [`STALL_RUNTIME`].
pub fn process_stalls(cause: &'static str) -> Counter {
    metrics::counter!(PROCESS_STALLS, "cause" => cause)
}

/// `cause`: [`STALL_PROCESS`] or [`STALL_RUNTIME`].
pub fn process_stall_seconds(cause: &'static str) -> Histogram {
    metrics::histogram!(PROCESS_STALL_SECONDS, "cause" => cause)
}

/// `kind`: transfer_state, notifications_retained, notifications_queued.
pub fn held_bytes(kind: &'static str) -> Gauge {
    metrics::gauge!(HELD_BYTES, "kind" => kind)
}

pub fn quic_socket_connections(listen: &str, socket: usize) -> Gauge {
    metrics::gauge!(QUIC_SOCKET_CONNECTIONS, "listen" => listen.to_string(), "socket" => socket.to_string())
}

/// `outcome`: accepted, rejected, corrupt.
pub fn ring_submissions(outcome: &'static str) -> Counter {
    metrics::counter!(RING_SUBMISSIONS, "outcome" => outcome)
}

pub fn rings_closed(reason: String) -> Counter {
    metrics::counter!(RINGS_CLOSED, "reason" => reason)
}

pub fn rings_open() -> Gauge {
    metrics::gauge!(RINGS_OPEN)
}

/// Label value of a transfer kind.
pub fn kind_label(kind: TransferKind) -> &'static str {
    match kind {
        TransferKind::Push => "push",
        TransferKind::PushReceive => "push_receive",
        TransferKind::Pull => "pull",
        TransferKind::PullServe => "pull_serve",
    }
}

/// Installs the Prometheus recorder, describes every metric, and serves the
/// text at `addr` (`GET /metrics`) with [`crate::metrics_http`].
pub async fn install(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(TRANSFER_SECONDS.to_string()),
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ],
        )?
        .set_buckets_for_metric(
            Matcher::Full(PROCESS_STALL_SECONDS.to_string()),
            &[0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
        )?
        .install_recorder()?;
    describe();
    crate::metrics_http::serve(addr, handle).await
}

fn describe() {
    describe_counter!(BYTES_SENT, Unit::Bytes, "Payload bytes written to peers");
    describe_counter!(
        GPU_STAGED_BYTES,
        Unit::Bytes,
        "GPU region payload copied through pinned staging buffers (direction to_host or to_device)"
    );
    describe_counter!(GPU_COPY_FAILURES, "GPU staging copies that failed");
    describe_gauge!(
        GPU_STAGING_BUFFER_BYTES,
        Unit::Bytes,
        "Size of a pinned staging buffer (grows to the largest staged slice received)"
    );
    describe_gauge!(RINGS_OPEN, "Worker submission rings being served");
    describe_gauge!(
        HELD_BYTES,
        Unit::Bytes,
        "Memory held for peers and workers, by kind (see README Security)"
    );
    describe_counter!(
        RING_SUBMISSIONS,
        "Submissions read from worker rings, by outcome"
    );
    describe_counter!(RINGS_CLOSED, "Worker rings closed, by reason");
    describe_gauge!(
        QUIC_SOCKET_CONNECTIONS,
        "QUIC connections each receiving socket of a listener carries (by listen address and socket; the kernel spreads connections over a listener's sockets by address hash)"
    );
    describe_counter!(
        PROCESS_STALLS,
        "Times this process did not run for 0.5 s or more (CPU starvation, memory reclaim, a stop)"
    );
    describe_histogram!(
        PROCESS_STALL_SECONDS,
        Unit::Seconds,
        "How long each such stall lasted"
    );
    describe_counter!(
        BYTES_RECEIVED,
        Unit::Bytes,
        "Payload bytes placed into local regions"
    );
    describe_counter!(SLICES_SENT, "Data slices written to peers");
    describe_counter!(
        INLINE_WRITES,
        "Small transfers' frames written by the submitting ring thread (the connection's writer idle)"
    );
    describe_counter!(SLICES_RECEIVED, "Data slices placed into local regions");
    describe_counter!(
        READER_SPIN_FRAMES,
        "Frames a connection's reader found by polling its socket (reader_spin_us) instead of sleeping"
    );
    describe_counter!(TRANSFERS_STARTED, "Transfers started, by kind");
    describe_counter!(TRANSFERS_DONE, "Transfers completed, by kind");
    describe_counter!(TRANSFERS_FAILED, "Transfers failed, by kind and reason");
    describe_counter!(
        MESSAGES_SENT,
        "Worker messages queued to peers (SendMessage)"
    );
    describe_counter!(
        MESSAGES_RECEIVED,
        "Worker messages from peers, by outcome (delivered, unknown_worker, refused)"
    );
    describe_histogram!(
        TRANSFER_SECONDS,
        Unit::Seconds,
        "Transfer time from request to completion, by kind"
    );
    describe_gauge!(PEER_CONNECTIONS, "Live connections per peer");
    describe_counter!(
        CONNECTIONS_LOST,
        "Peer connections that broke, by peer and rail"
    );
    describe_counter!(
        FRAMES_REJECTED,
        "Peer frames refused as malformed, by reason"
    );
    describe_counter!(HANDSHAKES_REFUSED, "Peer handshakes refused, by reason");
    describe_gauge!(
        MEMBERSHIP_CONNECTED,
        "1 while this node is registered in etcd and watching the cluster"
    );
    describe_gauge!(MEMBERSHIP_PEERS, "Peers the etcd membership knows");
    describe_counter!(
        MEMBERSHIP_EVENTS,
        "Membership changes, by kind (joined, updated, restarted, left, refused, name_clash)"
    );
    describe_gauge!(REGIONS_REGISTERED, "Regions currently registered");
    describe_gauge!(
        RAIL_STATE,
        "Rail health by peer, rail and direction (0 up, 1 suspect, 2 down, 3 probing)"
    );
    describe_counter!(
        RAIL_TRANSITIONS,
        "Rail state changes, by peer, rail, from and to"
    );
    describe_counter!(
        RAIL_SLICES_RETRANSMITTED,
        "Slices re-sent on a rail after another rail failed"
    );
    describe_gauge!(
        RAIL_THROUGHPUT,
        "Estimated delivery rate of a rail (what striping weighs it by)"
    );
    describe_counter!(
        RAIL_PROBES_FAILED,
        "Attempts to rebuild a down rail that failed"
    );
    describe_counter!(
        RDMA_BUILD_NANOS,
        Unit::Nanoseconds,
        "Time spent turning slices into RDMA work requests (bounds checks, gather lists)"
    );
    describe_counter!(
        RDMA_POST_NANOS,
        Unit::Nanoseconds,
        "Time spent in ibv_post_send (on Soft-RoCE this includes the emulated NIC's work)"
    );
    describe_counter!(RDMA_WORK_REQUESTS, "RDMA work requests posted");
    describe_counter!(
        RDMA_DESCRIPTORS,
        "Block pieces (per-layer, per-block descriptors) posted over RDMA"
    );
}

/// One connection's data-path counters (`peer`, `rail`, `transport`),
/// registered once: looking a labelled series up costs allocations and a
/// hash per call, paid per slice otherwise.
#[derive(Clone)]
pub struct ConnCounters {
    pub bytes_sent: Counter,
    pub slices_sent: Counter,
    pub bytes_received: Counter,
    pub slices_received: Counter,
    pub reader_spin_frames: Counter,
}

impl ConnCounters {
    pub fn new(peer: &str, rail: u32, transport: &str) -> Self {
        let labels = connection(peer, rail, transport);
        ConnCounters {
            bytes_sent: metrics::counter!(BYTES_SENT, &labels),
            slices_sent: metrics::counter!(SLICES_SENT, &labels),
            bytes_received: metrics::counter!(BYTES_RECEIVED, &labels),
            slices_received: metrics::counter!(SLICES_RECEIVED, &labels),
            reader_spin_frames: metrics::counter!(READER_SPIN_FRAMES, &labels),
        }
    }

    /// The inline-write counter of the same connection (registered only
    /// where a connection can write inline).
    pub fn inline_writes(peer: &str, rail: u32, transport: &str) -> Counter {
        metrics::counter!(INLINE_WRITES, &connection(peer, rail, transport))
    }
}
