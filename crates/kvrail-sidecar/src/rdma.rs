//! RDMA on the daemon's rails: one device per rail (found by the rail's listen
//! address), every region registered once per device, and queue pairs set up
//! over each rail's first stream connection (`RdmaConnect` / `RdmaAccept`).
//! Each queue pair is a one-sided connection of the core session, driven by one
//! task that posts its slices and reaps its completions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use kvrail_core::wire::{pb, SliceHeader};
use kvrail_core::{RailId, RegionAccess, RegionDirectory, RemoteSlice};
use kvrail_verbs::{Device, Endpoint, MemoryRegion, QpConfig, QueuePair};
use tracing::{info, warn};

use crate::config::Config;
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
            let mr = unsafe {
                dev.register(
                    host.as_mut_ptr(),
                    host.len() as usize,
                    remote_access(region.exposed),
                    owner,
                )
            };
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

/// What a peer granted a region's key may do: write into any region (push
/// destinations; the receiver checks each transfer's blocks before it
/// grants), read only from regions the worker exposed to peers' pulls. A
/// push's grant of an unexposed region must not let the pusher read it.
fn remote_access(exposed: bool) -> kvrail_verbs::RemoteAccess {
    if exposed {
        kvrail_verbs::RemoteAccess::ReadWrite
    } else {
        kvrail_verbs::RemoteAccess::Write
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

/// Acceptor side: connects fresh queue pairs to the dialer's (the request
/// already passed `kvrail_core::qp_setup::check_connect`, which bounds their
/// number).
pub fn accept_qps(
    rdma: &RdmaRails,
    rail: RailId,
    req: &pb::RdmaConnect,
) -> Result<Vec<QueuePair>, String> {
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
