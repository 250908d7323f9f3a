//! What `kvrail doctor` reads off the host before judging it: interfaces,
//! RDMA ports (sysfs, and verbs for what only verbs knows), the GPU.

use std::net::Ipv6Addr;
use std::path::Path;

use serde::Serialize;

use crate::netinfo::{self, Interface};

/// One GID table entry of an RDMA port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GidEntry {
    pub index: u32,
    pub gid: Ipv6Addr,
    /// "RoCE v2", "RoCE v1" or "IB/RoCE v1".
    pub kind: String,
    /// The netdev the GID belongs to.
    pub netdev: Option<String>,
}

/// One RDMA device port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaPort {
    pub device: String,
    pub port: u8,
    /// sysfs `state`, e.g. "ACTIVE", "DOWN".
    pub state: String,
    /// sysfs `phys_state`, e.g. "LinkUp", "Disabled".
    pub phys_state: String,
    /// "Ethernet" (RoCE) or "InfiniBand".
    pub link_layer: String,
    /// Path MTU in use (verbs; `None` without libibverbs).
    pub active_mtu: Option<u32>,
    pub gids: Vec<GidEntry>,
}

/// The GPU as kvrail would use it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GpuFacts {
    /// A CUDA driver library loads.
    pub driver: bool,
    pub name: Option<String>,
    pub gpudirect_rdma: bool,
    pub dma_buf: bool,
    /// Shares memory with the CPU (DGX Spark's GB10).
    pub integrated: bool,
    /// `nvidia_peermem` loaded (GPUDirect RDMA through the peer-memory API).
    pub peermem: bool,
    pub error: Option<String>,
}

/// Everything the checks judge.
#[derive(Debug, Clone, Serialize)]
pub struct HostFacts {
    pub interfaces: Vec<Interface>,
    /// `net.ipv4.conf.all`: rp_filter, arp_ignore, arp_announce (the kernel uses
    /// the larger of `all` and the interface's own for each).
    pub all_rp_filter: Option<u8>,
    pub all_arp_ignore: Option<u8>,
    pub all_arp_announce: Option<u8>,
    /// Where libibverbs was loaded from, or why it could not be.
    pub verbs_library: Result<String, String>,
    pub rdma_ports: Vec<RdmaPort>,
    pub gpu: GpuFacts,
}

fn read_trimmed(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// "4: ACTIVE" -> "ACTIVE".
fn sysfs_state(s: Option<String>) -> String {
    s.map(|s| match s.split_once(':') {
        Some((_, name)) => name.trim().to_string(),
        None => s,
    })
    .unwrap_or_default()
}

/// The RDMA ports sysfs shows, with their RoCE GID tables.
pub fn rdma_ports() -> Vec<RdmaPort> {
    let root = Path::new("/sys/class/infiniband");
    let mut devices: Vec<String> = std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    devices.sort();
    let mut out = Vec::new();
    for device in devices {
        let ports_dir = root.join(&device).join("ports");
        let mut ports: Vec<u8> = std::fs::read_dir(&ports_dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        ports.sort_unstable();
        for port in ports {
            let p = ports_dir.join(port.to_string());
            let mut gids = Vec::new();
            let mut indexes: Vec<u32> = std::fs::read_dir(p.join("gids"))
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            indexes.sort_unstable();
            for index in indexes {
                let Some(gid) = read_trimmed(p.join("gids").join(index.to_string()))
                    .and_then(|g| g.parse::<Ipv6Addr>().ok())
                    .filter(|g| !g.is_unspecified())
                else {
                    continue;
                };
                gids.push(GidEntry {
                    index,
                    gid,
                    kind: read_trimmed(p.join("gid_attrs/types").join(index.to_string()))
                        .unwrap_or_default(),
                    netdev: read_trimmed(p.join("gid_attrs/ndevs").join(index.to_string())),
                });
            }
            out.push(RdmaPort {
                active_mtu: kvrail_verbs::port_info(&device, port)
                    .ok()
                    .map(|i| i.active_mtu),
                state: sysfs_state(read_trimmed(p.join("state"))),
                phys_state: sysfs_state(read_trimmed(p.join("phys_state"))),
                link_layer: read_trimmed(p.join("link_layer")).unwrap_or_default(),
                device: device.clone(),
                port,
                gids,
            });
        }
    }
    out
}

fn gpu() -> GpuFacts {
    let peermem = Path::new("/sys/module/nvidia_peermem").exists();
    if !kvrail_cuda::Gpu::driver_present() {
        return GpuFacts {
            peermem,
            ..GpuFacts::default()
        };
    }
    let opened = kvrail_cuda::Gpu::open(0).map(|g| (g.name().to_string(), g.capabilities()));
    match opened {
        Ok((name, caps)) => GpuFacts {
            driver: true,
            name: Some(name),
            gpudirect_rdma: caps.gpudirect_rdma,
            dma_buf: caps.dma_buf,
            integrated: caps.integrated,
            peermem,
            error: None,
        },
        Err(e) => GpuFacts {
            driver: true,
            peermem,
            error: Some(e.to_string()),
            ..GpuFacts::default()
        },
    }
}

/// Reads the host.
pub fn gather() -> HostFacts {
    let conf = Path::new("/proc/sys/net/ipv4/conf/all");
    let num = |f: &str| read_trimmed(conf.join(f)).and_then(|v| v.parse().ok());
    HostFacts {
        interfaces: netinfo::interfaces(),
        all_rp_filter: num("rp_filter"),
        all_arp_ignore: num("arp_ignore"),
        all_arp_announce: num("arp_announce"),
        verbs_library: kvrail_verbs::verbs_library().map_err(|e| e.to_string()),
        rdma_ports: rdma_ports(),
        gpu: gpu(),
    }
}
