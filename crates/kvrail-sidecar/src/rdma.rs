//! RDMA on the daemon's rails: one device per rail (found by the rail's listen
//! address), every region registered once per device, and queue pairs set up
//! over each rail's first stream connection (`RdmaConnect` / `RdmaAccept`).
//! Each queue pair is a one-sided connection of the core session, driven by one
//! task that posts its slices and reaps its completions.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use kvrail_core::wire::{self, pb, ErrorCode, SliceHeader};
use kvrail_core::{OneSidedOp, RailId, RegionAccess, RegionDirectory, RemoteSlice};
use kvrail_verbs::{
    gather, Completion, Device, Endpoint, MemoryRegion, Opcode, QpConfig, QueuePair, Sge,
    WorkRequest,
};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::config::Config;
use crate::metrics as m;
use crate::peer::{ConnKey, PeerLink};
use crate::regions::{Region, Registry};

/// The daemon's RDMA devices and registrations.
pub struct RdmaRails {
    /// Per local rail: the device, or why there is none.
    devices: Vec<Result<Arc<Device>, String>>,
    /// Per region: its registration on each rail's device (index = rail).
    mrs: DashMap<u64, Vec<Option<Arc<MemoryRegion>>>>,
    pub qp: QpConfig,
    pub qps_per_rail: usize,
    pub busy_poll: Duration,
}

impl RdmaRails {
    /// Opens the device of each rail, unless RDMA is switched off. Logs what it
    /// found and, when there is nothing, why (the daemon then uses streams only).
    pub fn discover(config: &Config) -> Self {
        let devices: Vec<Result<Arc<Device>, String>> = config
            .listen
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                if !config.rdma || !config.wants("rdma") {
                    return Err("RDMA switched off in the configuration".to_string());
                }
                let name = config.rdma_devices.get(i).map(String::as_str);
                open_rail_device(addr, name, config.rdma_gid_index)
            })
            .collect();
        let fallback = config
            .transport_order()
            .iter()
            .filter(|t| t.as_str() != "rdma")
            .cloned()
            .collect::<Vec<_>>()
            .join("/");
        // One reason for every rail (no libibverbs, no RDMA in the kernel, RDMA
        // switched off) is said once rather than per rail.
        let first_err = devices.first().and_then(|d| d.as_ref().err());
        if let Some(why) = first_err.filter(|w| devices.iter().all(|d| d.as_ref().err() == Some(w)))
        {
            info!("RDMA off, serving over {fallback}: {why}");
        } else {
            for (i, d) in devices.iter().enumerate() {
                match d {
                    Ok(d) => info!(
                        rail = i,
                        device = d.name(),
                        port = d.port(),
                        gid_index = d.gid_index(),
                        max_sge = d.limits().max_sge,
                        "RDMA available on rail"
                    ),
                    Err(why) => info!(
                        rail = i,
                        "RDMA unavailable on rail, using {fallback}: {why}"
                    ),
                }
            }
        }
        Self {
            devices,
            mrs: DashMap::new(),
            qp: QpConfig {
                timeout: config.rdma_timeout,
                retry_cnt: config.rdma_retry_cnt,
                min_rnr_timer: config.rdma_min_rnr_timer,
                rnr_retry: config.rdma_rnr_retry,
                ..QpConfig::default()
            },
            qps_per_rail: config.rdma_qps_per_rail,
            busy_poll: Duration::from_micros(config.rdma_busy_poll_us),
        }
    }

    pub fn device(&self, rail: RailId) -> Result<&Arc<Device>, String> {
        match self.devices.get(rail as usize) {
            Some(Ok(d)) => Ok(d),
            Some(Err(why)) => Err(why.clone()),
            None => Err(format!("no local rail {rail}")),
        }
    }

    /// Whether any rail has a device.
    pub fn any(&self) -> bool {
        self.devices.iter().any(Result::is_ok)
    }

    /// Registers a region with every rail's device (once; the registration lives
    /// until the region is unregistered).
    pub fn register_region(&self, region: &Arc<Region>) {
        // GPU memory is not registered with verbs (no dma-buf path yet): its
        // payload is staged and moves over the rail's stream connections.
        let Some(host) = region.memory.host() else {
            return;
        };
        let mut per_rail = Vec::with_capacity(self.devices.len());
        for (rail, dev) in self.devices.iter().enumerate() {
            let Ok(dev) = dev else {
                per_rail.push(None);
                continue;
            };
            let owner: Arc<dyn std::any::Any + Send + Sync> = region.clone();
            // SAFETY: the mapping lives as long as the Region, which the MR keeps
            // alive through `owner`.
            let mr = unsafe { dev.register(host.as_mut_ptr(), host.len() as usize, owner) };
            match mr {
                Ok(mr) => per_rail.push(Some(Arc::new(mr))),
                Err(e) => {
                    warn!(
                        region = region.id,
                        rail, "cannot register region for RDMA, peers will use TCP for it: {e}"
                    );
                    per_rail.push(None);
                }
            }
        }
        if per_rail.iter().any(Option::is_some) {
            self.mrs.insert(region.id, per_rail);
        }
    }

    pub fn unregister_region(&self, region_id: u64) {
        self.mrs.remove(&region_id);
    }

    pub fn mr(&self, region_id: u64, rail: RailId) -> Option<Arc<MemoryRegion>> {
        self.mrs.get(&region_id)?.get(rail as usize)?.clone()
    }

    /// The keys a peer needs to reach a region one-sided, in rail order.
    pub fn keys(&self, region_id: u64) -> Vec<pb::MemoryKey> {
        let Some(per_rail) = self.mrs.get(&region_id) else {
            return Vec::new();
        };
        per_rail
            .iter()
            .enumerate()
            .filter_map(|(rail, mr)| {
                let mr = mr.as_ref()?;
                Some(pb::MemoryKey {
                    rail_index: rail as RailId,
                    addr: mr.addr,
                    length: mr.len,
                    rkey: mr.rkey,
                })
            })
            .collect()
    }
}

fn open_rail_device(
    addr: &SocketAddr,
    name: Option<&str>,
    gid_index: Option<u8>,
) -> Result<Arc<Device>, String> {
    if addr.ip().is_unspecified() && name.is_none() {
        return Err(format!(
            "rail listens on {addr}: a rail address (or rdma_devices) is needed to find its device"
        ));
    }
    Device::open(addr.ip(), name, gid_index).map_err(|e| e.to_string())
}

/// Regions as the session sees them, with their RDMA keys.
pub struct Directory<'a> {
    pub registry: &'a Registry,
    pub rdma: &'a RdmaRails,
}

impl RegionDirectory for Directory<'_> {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        let mut access = self.registry.lookup(region_id)?;
        access.keys = self.rdma.keys(region_id);
        Some(access)
    }

    fn check_generations(&self, selection: &kvrail_core::BlockSelection) -> Result<(), String> {
        self.registry.check_generations(selection)
    }
}

pub fn endpoint_msg(e: &Endpoint) -> pb::RdmaEndpoint {
    pb::RdmaEndpoint {
        qp_num: e.qp_num,
        psn: e.psn,
        gid: e.gid.to_vec(),
        mtu: e.mtu,
    }
}

pub fn endpoint_of(m: &pb::RdmaEndpoint) -> Result<Endpoint, String> {
    let gid: [u8; 16] = m
        .gid
        .as_slice()
        .try_into()
        .map_err(|_| format!("GID of {} bytes (16 expected)", m.gid.len()))?;
    Ok(Endpoint {
        qp_num: m.qp_num,
        psn: m.psn,
        gid,
        mtu: m.mtu,
    })
}

/// Creates `count` queue pairs on `rail`'s device (INIT, receives posted).
pub fn create_qps(rdma: &RdmaRails, rail: RailId, count: usize) -> Result<Vec<QueuePair>, String> {
    let dev = rdma.device(rail)?;
    dev.check_port().map_err(|e| e.to_string())?;
    (0..count)
        .map(|_| QueuePair::create(dev, rdma.qp).map_err(|e| e.to_string()))
        .collect()
}

/// Acceptor side: connects fresh queue pairs to the dialer's and answers.
pub fn accept_qps(
    rdma: &RdmaRails,
    rail: RailId,
    req: &pb::RdmaConnect,
) -> Result<Vec<QueuePair>, String> {
    if req.qps.is_empty() || req.qps.len() > 16 {
        return Err(format!(
            "{} queue pairs asked (1..=16 allowed)",
            req.qps.len()
        ));
    }
    let mut qps = create_qps(rdma, rail, req.qps.len())?;
    for (qp, remote) in qps.iter_mut().zip(&req.qps) {
        qp.connect(&endpoint_of(remote)?)
            .map_err(|e| e.to_string())?;
    }
    Ok(qps)
}

/// A one-sided slice for a queue pair task.
pub struct OneSidedWork {
    pub header: SliceHeader,
    pub len: u32,
    pub region: Arc<Region>,
    pub pieces: Vec<(u64, u64)>,
    pub remote: RemoteSlice,
}

/// A slice posted and not yet completed.
struct Posted {
    header: SliceHeader,
    len: u32,
    work_requests: u32,
    op: OneSidedOp,
}

/// Why a slice could not be posted.
enum PostError {
    /// The slice itself is bad (the transfer fails; the queue pair lives on).
    Slice(ErrorCode, String),
}

/// Drives one queue pair: posts what the session schedules on it, reaps its
/// completions, and reports trailers (receiver) and completions (initiator).
pub async fn qp_task(
    link: Arc<PeerLink>,
    key: ConnKey,
    rail: RailId,
    mut qp: QueuePair,
    mut rx: mpsc::UnboundedReceiver<OneSidedWork>,
    rdma_busy_poll: Duration,
) {
    let reason = run_qp(&link, key, rail, &mut qp, &mut rx, rdma_busy_poll).await;
    link.connection_failed(key, &reason);
}

async fn run_qp(
    link: &Arc<PeerLink>,
    key: ConnKey,
    rail: RailId,
    qp: &mut QueuePair,
    rx: &mut mpsc::UnboundedReceiver<OneSidedWork>,
    busy_poll: Duration,
) -> String {
    let conn = key.0;
    let labels = [
        ("peer", link.peer.clone()),
        ("rail", rail.to_string()),
        ("transport", "rdma".to_string()),
    ];
    let max_sge = qp.device().limits().max_sge.clamp(1, 30) as usize;
    let mut free_slots = qp.send_depth();
    let mut posted: HashMap<u64, Posted> = HashMap::new();
    let mut next_token: u64 = 1;
    let mut waiting: VecDeque<OneSidedWork> = VecDeque::new();
    let mut completions: Vec<Completion> = Vec::new();
    let mut wrs: Vec<WorkRequest> = Vec::new();
    let mut input_open = true;
    loop {
        // Post what fits in the send queue, oldest first.
        while let Some(work) = waiting.pop_front() {
            let token = next_token;
            let started = Instant::now();
            match build(link, rail, &work, token, max_sge, &mut wrs) {
                Ok(()) => {}
                Err(PostError::Slice(code, msg)) => {
                    warn!(peer = %link.peer, rail, transfer = work.header.transfer_id, "{msg}");
                    link.with_session(|s, now| s.fail(work.header.transfer_id, code, &msg, now));
                    continue;
                }
            }
            let built = started.elapsed();
            let n = wrs.len() as u32;
            if n > qp.send_depth() {
                let msg = format!(
                    "slice needs {n} work requests, the send queue holds {}",
                    qp.send_depth()
                );
                link.with_session(|s, now| {
                    s.fail(work.header.transfer_id, ErrorCode::Internal, &msg, now)
                });
                continue;
            }
            if n > free_slots {
                waiting.push_front(work);
                break;
            }
            let posting = Instant::now();
            if let Err(e) = qp.post(&wrs) {
                return format!("posting to the queue pair failed: {e}");
            }
            metrics::counter!(m::RDMA_BUILD_NANOS, &labels).increment(built.as_nanos() as u64);
            metrics::counter!(m::RDMA_POST_NANOS, &labels)
                .increment(posting.elapsed().as_nanos() as u64);
            metrics::counter!(m::RDMA_WORK_REQUESTS, &labels).increment(u64::from(n));
            metrics::counter!(m::RDMA_DESCRIPTORS, &labels).increment(work.pieces.len() as u64);
            free_slots -= n;
            next_token += 1;
            posted.insert(
                token,
                Posted {
                    header: work.header,
                    len: work.len,
                    work_requests: n,
                    op: work.remote.op,
                },
            );
        }
        completions.clear();
        tokio::select! {
            r = qp.wait(&mut completions, busy_poll) => {
                if let Err(e) = r {
                    return format!("completion queue failed: {e}");
                }
            }
            w = rx.recv(), if input_open && waiting.is_empty() => {
                match w {
                    Some(w) => waiting.push_back(w),
                    None => input_open = false,
                }
                continue;
            }
        }
        for c in completions.drain(..) {
            if let Some(e) = c.error {
                if e.flushed {
                    continue;
                }
                let failed = posted.get(&c.wr_id).map(|p| p.header.transfer_id);
                if let (true, Some(id)) = (e.remote_access, failed) {
                    let msg = format!(
                        "peer refused our access to its memory on rail {rail} ({e}): a stale or foreign memory key, or an address outside its grant"
                    );
                    link.with_session(|s, now| s.fail(id, ErrorCode::Protocol, &msg, now));
                }
                return format!("queue pair failed: {e}");
            }
            if let Some(bytes) = c.received {
                match wire::decode_slice_trailer(&bytes) {
                    Some((header, len)) => {
                        link.with_session(|s, now| {
                            if let kvrail_core::SliceDisposition::Place { .. } =
                                s.accept_slice(conn, header, len, now)
                            {
                                s.slice_placed(conn, header, len, now);
                            }
                        });
                        metrics::counter!(m::BYTES_RECEIVED, &labels).increment(u64::from(len));
                        metrics::counter!(m::SLICES_RECEIVED, &labels).increment(1);
                        link.rearm_timer();
                    }
                    None => return format!("malformed slice trailer of {} bytes", bytes.len()),
                }
                continue;
            }
            let Some(p) = posted.remove(&c.wr_id) else {
                continue;
            };
            free_slots += p.work_requests;
            link.with_session(|s, now| s.one_sided_done(conn, p.header, p.len, now));
            let (bytes, slices) = match p.op {
                OneSidedOp::Write => (m::BYTES_SENT, m::SLICES_SENT),
                OneSidedOp::Read => (m::BYTES_RECEIVED, m::SLICES_RECEIVED),
            };
            metrics::counter!(bytes, &labels).increment(u64::from(p.len));
            metrics::counter!(slices, &labels).increment(1);
            link.rearm_timer();
        }
        if !input_open && posted.is_empty() && waiting.is_empty() {
            return "queue pair closed".into();
        }
    }
}

/// Builds the work requests of one slice into `wrs`, checking every local range
/// against our registration and every remote one against the peer's grant.
fn build(
    link: &Arc<PeerLink>,
    rail: RailId,
    work: &OneSidedWork,
    token: u64,
    max_sge: usize,
    wrs: &mut Vec<WorkRequest>,
) -> Result<(), PostError> {
    wrs.clear();
    let id = work.header.transfer_id;
    let mr = link.rdma_mr(work.region.id, rail).ok_or_else(|| {
        PostError::Slice(
            ErrorCode::RegionGone,
            format!(
                "region {} is not registered for RDMA on rail {rail}",
                work.region.id
            ),
        )
    })?;
    let key = &work.remote.key;
    let mut local = Vec::with_capacity(work.pieces.len());
    for &(off, len) in &work.pieces {
        let addr = mr.addr + off;
        if !mr.contains(addr, len) {
            return Err(PostError::Slice(
                ErrorCode::Internal,
                format!(
                    "local range {off}+{len} lies outside region {}",
                    work.region.id
                ),
            ));
        }
        local.push((addr, len));
    }
    let mut remote = Vec::with_capacity(work.remote.pieces.len());
    for &(off, len) in &work.remote.pieces {
        let inside = off.checked_add(len).is_some_and(|end| end <= key.length);
        if !inside {
            return Err(PostError::Slice(
                ErrorCode::OutOfRange,
                format!(
                    "transfer {id}: peer range {off}+{len} lies outside its grant of {} bytes; nothing posted",
                    key.length
                ),
            ));
        }
        remote.push((key.addr + off, len));
    }
    // The same plan serves both: each request covers one contiguous remote extent.
    let opcode = match work.remote.op {
        OneSidedOp::Write => Opcode::Write,
        OneSidedOp::Read => Opcode::Read,
    };
    let planned = gather(&local, &remote, max_sge)
        .map_err(|e| PostError::Slice(ErrorCode::Internal, format!("transfer {id}: {e}")))?;
    for (raddr, sges) in planned {
        wrs.push(WorkRequest {
            opcode,
            wr_id: 0,
            sges: sges
                .into_iter()
                .map(|(addr, len)| Sge {
                    addr,
                    len,
                    lkey: mr.lkey,
                })
                .collect(),
            remote_addr: raddr,
            rkey: key.rkey,
            inline: Vec::new(),
            signaled: false,
        });
    }
    match work.remote.op {
        OneSidedOp::Write => {
            // The trailer follows the writes on the same queue pair, so when the
            // receiver sees it every byte before it is in place.
            let trailer = wire::encode_slice_trailer(
                SliceHeader {
                    transfer_id: id,
                    offset: work.header.offset,
                },
                work.len,
            )
            .to_vec();
            wrs.push(WorkRequest {
                opcode: Opcode::Send,
                wr_id: token,
                sges: Vec::new(),
                remote_addr: 0,
                rkey: 0,
                inline: trailer,
                signaled: true,
            });
        }
        OneSidedOp::Read => {
            if let Some(last) = wrs.last_mut() {
                last.wr_id = token;
                last.signaled = true;
            }
        }
    }
    if wrs.is_empty() {
        return Err(PostError::Slice(
            ErrorCode::Internal,
            format!("transfer {id}: empty slice"),
        ));
    }
    Ok(())
}

/// Backoff between attempts to rebuild a rail's queue pairs.
pub const QP_RETRY_INITIAL: Duration = Duration::from_millis(250);
pub const QP_RETRY_MAX: Duration = Duration::from_secs(2);
