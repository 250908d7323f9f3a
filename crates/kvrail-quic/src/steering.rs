//! Each connection of a listener on several sockets kept on the socket that
//! took it, and successive dials spread evenly over them.
//!
//! The kernel's `SO_REUSEPORT` hash of the addresses put up to three of 16
//! connections on one socket (one endpoint task reads them all) and left
//! others idle. Instead, a classic BPF program attached to the socket group
//! picks the socket from the first byte of the packet's destination
//! connection id, modulo the group's size:
//! - the server endpoint on socket `k` issues connection ids whose first
//!   byte is `k`, so every packet after the handshake's first flight comes
//!   back to it;
//! - a dialer's first packets carry a destination id of its choosing: its
//!   first byte counts the dials made, so dials `0, 1, 2, ...` land on sockets
//!   `0, 1, 2, ...` (the other bytes stay random, as RFC 9000 asks).
//!
//! Where the program cannot be attached, the kernel's hash decides, as before.

use std::io;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionId, ConnectionIdGenerator};
use ring::rand::{SecureRandom, SystemRandom};

/// Length of the connection ids a steered endpoint issues (quinn's default).
const CID_LEN: usize = 8;
/// Length of a dialer's first destination id (quinn's default: the most allowed).
const INITIAL_CID_LEN: usize = 20;

fn random_cid(first: u8, len: usize) -> ConnectionId {
    let mut bytes = [0u8; INITIAL_CID_LEN];
    let bytes = &mut bytes[..len];
    // The system's generator does not fail on Linux; were it to, the id is
    // still unique enough for one endpoint's connections (its first byte
    // routes it, quinn rejects a clash).
    let _ = SystemRandom::new().fill(bytes);
    bytes[0] = first;
    ConnectionId::new(bytes)
}

/// Connection ids of the endpoint on socket `socket` of its group.
#[derive(Debug)]
pub(crate) struct SocketCids {
    pub(crate) socket: u8,
}

impl ConnectionIdGenerator for SocketCids {
    fn generate_cid(&mut self) -> ConnectionId {
        random_cid(self.socket, CID_LEN)
    }

    fn cid_len(&self) -> usize {
        CID_LEN
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// The first destination id of each dial of one client configuration:
/// successive dials name successive sockets (the first byte counts them).
pub(crate) fn initial_destination() -> Arc<dyn Fn() -> ConnectionId + Send + Sync> {
    let dials = AtomicU8::new(0);
    Arc::new(move || next_initial(&dials))
}

fn next_initial(dials: &AtomicU8) -> ConnectionId {
    random_cid(dials.fetch_add(1, Ordering::Relaxed), INITIAL_CID_LEN)
}

/// The program: socket = first byte of the destination id, modulo `sockets`
/// (offset 6 in a long header: flags, version, id length; 1 in a short one).
/// The kernel hands a `SO_REUSEPORT` program the UDP payload.
fn program(sockets: u32) -> [(u16, u8, u8, u32); 7] {
    const LD_B_ABS: u16 = 0x30; // BPF_LD | BPF_B | BPF_ABS
    const JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
    const JA: u16 = 0x05; // BPF_JMP | BPF_JA
    const MOD_K: u16 = 0x94; // BPF_ALU | BPF_MOD | BPF_K
    const RET_A: u16 = 0x16; // BPF_RET | BPF_A
    [
        (LD_B_ABS, 0, 0, 0),  // A = flags
        (JSET_K, 0, 2, 0x80), // long header? next : +2
        (LD_B_ABS, 0, 0, 6),  // A = long header's first id byte
        (JA, 0, 0, 1),        // to the modulo
        (LD_B_ABS, 0, 0, 1),  // A = short header's first id byte
        (MOD_K, 0, 0, sockets),
        (RET_A, 0, 0, 0),
    ]
}

/// Attaches the program to the `SO_REUSEPORT` group `socket` belongs to
/// (bound, with `sockets` members bound in order).
#[cfg(target_os = "linux")]
pub(crate) fn attach(socket: &socket2::Socket, sockets: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sockets = u32::try_from(sockets)
        .ok()
        .filter(|&n| (1..=256).contains(&n))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "1 to 256 sockets"))?;
    let mut filter: Vec<libc::sock_filter> = program(sockets)
        .iter()
        .map(|&(code, jt, jf, k)| libc::sock_filter { code, jt, jf, k })
        .collect();
    let fprog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `filter`, which outlives the call; the
    // kernel copies the program and reads exactly `size_of::<sock_fprog>()`
    // bytes of the option value; the descriptor is a live socket we own.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn attach(_socket: &socket2::Socket, _sockets: usize) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "Linux only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_socket_and_dials_count_up() {
        let mut g = SocketCids { socket: 5 };
        let (a, b) = (g.generate_cid(), g.generate_cid());
        assert_eq!((a.len(), a[0], b[0]), (CID_LEN, 5, 5));
        assert_ne!(a, b, "the rest is random");
        let dials = AtomicU8::new(255);
        let (x, y) = (next_initial(&dials), next_initial(&dials));
        assert_eq!(x.len(), INITIAL_CID_LEN);
        assert_eq!((x[0], y[0]), (255, 0));
        assert_ne!(x[1..], y[1..]);
    }
}
