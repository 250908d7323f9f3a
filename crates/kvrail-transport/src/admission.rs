//! Who may start a handshake with a listener now. A handshake costs the
//! listener a signature (and, over QUIC, a key exchange) before it knows who
//! is on the other end, and anyone who reaches the port can ask for one (with
//! a copy of a peer's public certificate, say). So each source address is
//! held to a few handshakes in progress and a rate, and all of them together
//! to a cap; the configured peers' addresses (their rails) are not held to
//! these (a session opens all its connections at once; the listener's own cap
//! and its eviction of stalled handshakes apply to them), so a flood from
//! elsewhere never locks them out.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Handshakes in progress from addresses that are not a peer's, over the
/// whole listener, are at most this less [`RESERVED_FOR_PEERS`].
pub const MAX_HANDSHAKES: usize = 64;
/// Handshakes in progress per source address that is not a peer's...
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 4;
/// ...and the handshakes it may start a second (a burst of twice that).
pub const HANDSHAKES_PER_ADDRESS_PER_SEC: f64 = 20.0;
/// Of [`MAX_HANDSHAKES`], what only peers' addresses may use (a flood from
/// many addresses cannot take it all).
pub const RESERVED_FOR_PEERS: usize = 16;
/// Source addresses tracked at once.
const TRACKED_ADDRESSES: usize = 4096;

/// Shared by a listener's accept loops (see the module doc).
pub struct HandshakeAdmission {
    peers: HashSet<IpAddr>,
    state: Mutex<AdmissionState>,
}

#[derive(Default)]
struct AdmissionState {
    in_progress: usize,
    /// Of them, from addresses that are not a peer's.
    strangers: usize,
    /// Per source address: handshakes in progress, and its token bucket
    /// (tokens, when last filled).
    by_address: HashMap<IpAddr, (usize, f64, Instant)>,
}

/// A handshake admitted; given back when dropped.
pub struct HandshakePermit {
    admission: Arc<HandshakeAdmission>,
    from: IpAddr,
    peer: bool,
}

impl std::fmt::Debug for HandshakePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HandshakePermit({})", self.from)
    }
}

impl HandshakeAdmission {
    /// Admission for a listener whose peers dial from `peers`.
    pub fn new(peers: impl IntoIterator<Item = IpAddr>) -> Arc<Self> {
        Arc::new(HandshakeAdmission {
            // An IPv4 peer reaches a dual-stack listener as ::ffff:a.b.c.d.
            peers: peers.into_iter().map(|ip| ip.to_canonical()).collect(),
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AdmissionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A permit for a handshake from `from` at `now`, or None: the
    /// connection is dropped unanswered.
    pub fn admit(self: &Arc<Self>, from: IpAddr, now: Instant) -> Option<HandshakePermit> {
        let from = from.to_canonical();
        let mut st = self.lock();
        if st.by_address.len() >= TRACKED_ADDRESSES && !st.by_address.contains_key(&from) {
            // Forget addresses with nothing in progress (their buckets refill anyway).
            st.by_address.retain(|_, (n, _, _)| *n > 0);
            if st.by_address.len() >= TRACKED_ADDRESSES {
                return None;
            }
        }
        let peer = self.peers.contains(&from);
        if !peer && st.strangers >= MAX_HANDSHAKES - RESERVED_FOR_PEERS {
            return None;
        }
        let burst = 2.0 * HANDSHAKES_PER_ADDRESS_PER_SEC;
        let (active, tokens, filled) = st.by_address.entry(from).or_insert((0, burst, now));
        if !peer {
            *tokens = (*tokens
                + now.saturating_duration_since(*filled).as_secs_f64()
                    * HANDSHAKES_PER_ADDRESS_PER_SEC)
                .min(burst);
            *filled = now;
            if *active >= MAX_HANDSHAKES_PER_ADDRESS || *tokens < 1.0 {
                return None;
            }
            *tokens -= 1.0;
        }
        *active += 1;
        st.in_progress += 1;
        st.strangers += usize::from(!peer);
        Some(HandshakePermit {
            admission: self.clone(),
            from,
            peer,
        })
    }

    /// Handshakes in progress now.
    pub fn in_progress(&self) -> usize {
        self.lock().in_progress
    }
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut st = self.admission.lock();
        st.in_progress = st.in_progress.saturating_sub(1);
        if !self.peer {
            st.strangers = st.strangers.saturating_sub(1);
        }
        if let Some((active, _, _)) = st.by_address.get_mut(&self.from) {
            *active = active.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An address holds a few handshakes at a time and starts a bounded
    /// number per second; a peer's address is held to neither; all together
    /// are capped; permits given back make room again.
    #[test]
    fn handshakes_are_admitted_per_address_and_in_all() {
        let ip = |n: u8| IpAddr::from([10, 0, 0, n]);
        let a = HandshakeAdmission::new([ip(9)]);
        let now = Instant::now();
        let held: Vec<_> = (0..MAX_HANDSHAKES_PER_ADDRESS)
            .map(|_| a.admit(ip(1), now).unwrap())
            .collect();
        assert!(a.admit(ip(1), now).is_none(), "per address");
        assert!(a.admit(ip(2), now).is_some(), "another address");
        drop(held);
        // The bucket: a burst, then the rate.
        let mut started = 0;
        while let Some(p) = a.admit(ip(3), now) {
            drop(p);
            started += 1;
            assert!(started < 1000);
        }
        assert_eq!(started as f64, 2.0 * HANDSHAKES_PER_ADDRESS_PER_SEC);
        assert!(a.admit(ip(3), now + Duration::from_millis(100)).is_some());
        // A peer opens a session's connections at once, and is not capped
        // here (the listener's own cap and eviction apply).
        let peer: Vec<_> = (0..100).map(|_| a.admit(ip(9), now).unwrap()).collect();
        assert_eq!(a.in_progress(), 100);
        drop(peer);
        assert_eq!(a.in_progress(), 0);
        // Strangers from many addresses leave the peers' reserve free.
        let many: Vec<_> = (0..=255u8)
            .flat_map(|n| a.admit(IpAddr::from([10, 2, 0, n]), now))
            .collect();
        assert_eq!(many.len(), MAX_HANDSHAKES - RESERVED_FOR_PEERS);
        let peer: Vec<_> = (0..RESERVED_FOR_PEERS)
            .map(|_| a.admit(ip(9), now).unwrap())
            .collect();
        assert_eq!(peer.len(), RESERVED_FOR_PEERS);
    }
}
