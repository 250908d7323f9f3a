//! kvrail-verbs: the RDMA verbs driver, and the only crate that calls libibverbs.
//!
//! - [`Device`]: one opened RDMA device port, found by the rail's IP address (its
//!   RoCE v2 GID) or by name, with its protection domain and limits.
//! - [`MemoryRegion`]: a registered region (`ibv_reg_mr`), kept alive with its owner.
//! - [`QueuePair`]: a reliable-connected queue pair with its own completion queue
//!   and completion channel, connected to a peer's [`Endpoint`], posting chained
//!   work requests built by [`gather`] and waited on through tokio's `AsyncFd`.
//!
//! Without the `rdma` feature (or on a host with no RDMA devices, or a kernel
//! without RDMA support, where `ibv_get_device_list` fails with ENOSYS) every
//! lookup answers [`VerbsError::Unavailable`] with the reason, and the daemon
//! uses its stream transports.

use std::io;
use std::net::IpAddr;

#[cfg(feature = "rdma")]
mod ffi;
#[cfg(not(feature = "rdma"))]
mod stub;
#[cfg(feature = "rdma")]
mod sys;

#[cfg(feature = "rdma")]
pub use ffi::{device_names, port_info, verbs_library, Device, MemoryRegion, QueuePair};
#[cfg(not(feature = "rdma"))]
pub use stub::{device_names, port_info, verbs_library, Device, MemoryRegion, QueuePair};

/// What a peer holding a registration's key may do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteAccess {
    /// Nothing: local use only (receive buffers, sources of our WRITEs).
    None,
    /// RDMA WRITE into it (push destinations).
    Write,
    /// RDMA WRITE and READ (regions exposed to peers' pulls).
    ReadWrite,
}

/// Why a verbs operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA on this host (or in this build): use another transport.
    #[error("RDMA unavailable: {0}")]
    Unavailable(String),
    /// No device port holds a GID for the rail's address.
    #[error("no RDMA device has a GID for {0}")]
    NoDeviceFor(IpAddr),
    /// A verbs call failed.
    #[error("{op} on {device}: {source}")]
    Call {
        op: &'static str,
        device: String,
        source: io::Error,
    },
    /// The port cannot carry traffic now.
    #[error("port {port} of {device} is {state}")]
    PortNotActive {
        device: String,
        port: u8,
        state: &'static str,
    },
    /// Work that the queue pair or the peer's key cannot take; nothing was posted.
    #[error("work request rejected before posting: {0}")]
    Rejected(String),
}

/// A queue pair's address, exchanged with the peer over the control connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub qp_num: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    /// Active path MTU in bytes (256..4096).
    pub mtu: u32,
}

/// A device port's state as verbs reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// "active", "down", ...
    pub state: &'static str,
    pub active: bool,
    /// Path MTU in use, in bytes (256..4096).
    pub active_mtu: u32,
    pub max_mtu: u32,
    /// RoCE (Ethernet link layer) rather than InfiniBand.
    pub ethernet: bool,
}

/// Device limits that shape work requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_sge: u32,
    pub max_qp_wr: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_cqe: u32,
}

/// Queue pair tunables.
#[derive(Debug, Clone, Copy)]
pub struct QpConfig {
    /// Send queue slots (work requests in flight, signalled or not).
    pub send_depth: u32,
    /// Receive slots for slice trailers.
    pub recv_depth: u32,
    /// Local ACK timeout exponent: 4.096 us x 2^timeout per try.
    pub timeout: u8,
    /// Retries before the queue pair fails (7 means "for ever" on Soft-RoCE: avoid).
    pub retry_cnt: u8,
    /// How long a sender waits after our "receiver not ready" NAK (IB encoding:
    /// 12 = 0.64 ms, 20 = 10.24 ms, 26 = 81.92 ms, 31 = 491.52 ms).
    pub min_rnr_timer: u8,
    /// Retries after a "receiver not ready" NAK (7 = for ever).
    pub rnr_retry: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        Self {
            send_depth: 4096,
            recv_depth: 256,
            // About 67 ms per try and 0.5 s before a dead path fails the queue pair.
            timeout: 14,
            retry_cnt: 6,
            // 0.64 ms: receivers re-post their slots as soon as they reap them.
            min_rnr_timer: 12,
            rnr_retry: 7,
        }
    }
}

/// Bytes a receive slot holds (the slice trailer is 24).
pub const RECV_SLOT_BYTES: u32 = 64;

/// What one work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// Local gather list into remote memory.
    Write,
    /// Remote memory into the local scatter list.
    Read,
    /// Inline bytes into the peer's next receive slot (ordered after earlier writes).
    Send,
}

/// One local scatter/gather entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A work request ready for posting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    pub opcode: Opcode,
    pub wr_id: u64,
    pub sges: Vec<Sge>,
    /// Remote address and key (Write/Read).
    pub remote_addr: u64,
    pub rkey: u32,
    /// Inline payload (Send).
    pub inline: Vec<u8>,
    pub signaled: bool,
}

/// A finished work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// `None` on success, else the failure as the device reports it.
    pub error: Option<CompletionError>,
    /// A receive: the bytes that arrived in its slot.
    pub received: Option<Vec<u8>>,
}

/// A failed completion: the queue pair is in the error state after it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text} (status {status}, vendor error {vendor_err:#x})")]
pub struct CompletionError {
    pub status: u32,
    pub text: String,
    pub vendor_err: u32,
    /// The peer refused our key or address: a stale or foreign rkey, or a bounds error.
    pub remote_access: bool,
    /// Flushed because the queue pair had already failed (not the first error).
    pub flushed: bool,
}

/// One planned work request: the remote address and the local (address, length) entries.
pub type Planned = (u64, Vec<(u64, u32)>);

/// Splits one slice into work requests: each targets one contiguous remote
/// extent and gathers (or scatters) at most `max_sge` local entries. `local` and
/// `remote` are (address, length) lists of equal total length, in the same order;
/// adjacent entries are merged first, so contiguous blocks cost one entry.
pub fn gather(
    local: &[(u64, u64)],
    remote: &[(u64, u64)],
    max_sge: usize,
) -> Result<Vec<Planned>, VerbsError> {
    let local = merge(local);
    let remote = merge(remote);
    let total = |v: &[(u64, u64)]| v.iter().map(|p| p.1).sum::<u64>();
    if total(&local) != total(&remote) {
        return Err(VerbsError::Rejected(format!(
            "local pieces hold {} bytes, remote pieces {}",
            total(&local),
            total(&remote)
        )));
    }
    if max_sge == 0 {
        return Err(VerbsError::Rejected("device allows no SGE".into()));
    }
    // One SGE and one message are at most 2 GiB (a u32 length with room to spare).
    const MAX_PIECE: u64 = 1 << 31;
    let mut out: Vec<Planned> = Vec::new();
    let mut li = 0usize;
    let mut loff = 0u64;
    for &(raddr, rlen) in &remote {
        let mut rdone = 0u64;
        while rdone < rlen {
            let mut sges = Vec::new();
            let mut wr_len = 0u64;
            while rdone < rlen && sges.len() < max_sge && wr_len < MAX_PIECE {
                let (laddr, llen) = local[li];
                let take = (llen - loff).min(rlen - rdone).min(MAX_PIECE - wr_len);
                sges.push((laddr + loff, take as u32));
                loff += take;
                rdone += take;
                wr_len += take;
                if loff == llen {
                    li += 1;
                    loff = 0;
                }
            }
            out.push((raddr + rdone - wr_len, sges));
        }
    }
    Ok(out)
}

fn merge(pieces: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(pieces.len());
    for &(a, l) in pieces.iter().filter(|p| p.1 > 0) {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == a => last.1 += l,
            _ => out.push((a, l)),
        }
    }
    out
}

/// The IPv6 form of an address as it appears in a RoCE v2 GID table.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_both_sides_is_one_request_one_sge() {
        let wrs = gather(&[(100, 50), (150, 50)], &[(1000, 60), (1060, 40)], 4).unwrap();
        assert_eq!(wrs, vec![(1000, vec![(100, 100)])]);
    }

    #[test]
    fn scattered_remote_splits_requests_and_local_entries() {
        let wrs = gather(&[(0, 100)], &[(1000, 30), (2000, 70)], 4).unwrap();
        assert_eq!(wrs, vec![(1000, vec![(0, 30)]), (2000, vec![(30, 70)])]);
    }

    #[test]
    fn scattered_local_gathers_up_to_max_sge() {
        let local: Vec<(u64, u64)> = (0..5).map(|i| (i * 100, 10)).collect();
        let wrs = gather(&local, &[(5000, 50)], 2).unwrap();
        assert_eq!(
            wrs,
            vec![
                (5000, vec![(0, 10), (100, 10)]),
                (5020, vec![(200, 10), (300, 10)]),
                (5040, vec![(400, 10)]),
            ]
        );
    }

    #[test]
    fn every_byte_is_mapped_once_in_order() {
        // Irregular pieces on both sides: walking the requests must reproduce the
        // byte-for-byte pairing of the two lists.
        let local = [(0u64, 7u64), (50, 13), (90, 1), (200, 29)];
        let remote = [(1000u64, 20u64), (3000, 5), (4000, 25)];
        let wrs = gather(&local, &remote, 3).unwrap();
        let flat =
            |v: &[(u64, u64)]| -> Vec<u64> { v.iter().flat_map(|&(a, l)| a..a + l).collect() };
        let mut pairs = Vec::new();
        for (raddr, sges) in &wrs {
            assert!(sges.len() <= 3);
            let mut r = *raddr;
            for &(a, l) in sges {
                for i in 0..u64::from(l) {
                    pairs.push((a + i, r));
                    r += 1;
                }
            }
        }
        let expected: Vec<(u64, u64)> = flat(&local).into_iter().zip(flat(&remote)).collect();
        assert_eq!(pairs, expected);
    }

    #[test]
    fn unequal_totals_are_rejected() {
        assert!(matches!(
            gather(&[(0, 10)], &[(0, 11)], 4),
            Err(VerbsError::Rejected(_))
        ));
    }

    #[test]
    fn ipv4_gid_is_v4_mapped() {
        let g = gid_of("169.254.100.1".parse().unwrap());
        assert_eq!(&g[10..], &[0xff, 0xff, 169, 254, 100, 1]);
        assert!(g[..10].iter().all(|&b| b == 0));
    }
}
