//! What QUIC costs on this machine with no kvrail on top: raw quinn throughput
//! with kvrail's settings and identities, and the packet cipher's cost per byte.
//! `loadgen bench --only quic-floor` reports both beside kvrail's QUIC and TCP
//! points, so the gap between them can be apportioned.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvrail_auth::Identity;
use quinn::VarInt;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};

use crate::{invalid, QuicSettings, QuicTransport};

/// The packet cipher (AES-128-GCM, as negotiated between kvrail nodes) per byte
/// on one core: sealing on the sender, opening on the receiver.
#[derive(Debug, Clone, Copy)]
pub struct CipherCost {
    /// Encrypting, per payload byte.
    pub seal_ns_per_byte: f64,
    /// Decrypting, per payload byte (with a copy of the packet, as quinn's
    /// receive path copies each datagram).
    pub open_ns_per_byte: f64,
}

/// Seals and opens `packet`-byte payloads for about `budget` each, as quinn
/// does for every packet (ring, the provider kvrail's TLS uses).
pub fn packet_cipher_cost(packet: usize, budget: Duration) -> io::Result<CipherCost> {
    let key = || {
        UnboundKey::new(&AES_128_GCM, &[7u8; 16])
            .map(LessSafeKey::new)
            .map_err(|_| invalid("AES-128-GCM key"))
    };
    let (sealer, opener) = (key()?, key()?);
    let nonce = |n: u64| {
        let mut b = [0u8; 12];
        b[4..].copy_from_slice(&n.to_be_bytes());
        Nonce::assume_unique_for_key(b)
    };
    let mut buf = vec![0x5au8; packet];
    let header = [0u8; 24];
    // Seal: as many packets as fit the budget, keeping one to open.
    let start = Instant::now();
    let mut sealed = 0u64;
    let mut tag = None;
    while start.elapsed() < budget || sealed == 0 {
        let t = sealer
            .seal_in_place_separate_tag(nonce(sealed), Aad::from(&header), &mut buf)
            .map_err(|_| invalid("seal"))?;
        tag = Some((sealed, t));
        sealed += 1;
    }
    let seal_time = start.elapsed();
    let Some((last, tag)) = tag else {
        return Err(invalid("nothing sealed"));
    };
    let mut packet_with_tag = buf.clone();
    packet_with_tag.extend_from_slice(tag.as_ref());
    let start = Instant::now();
    let mut opened = 0u64;
    while start.elapsed() < budget || opened == 0 {
        let mut p = packet_with_tag.clone();
        opener
            .open_in_place(nonce(last), Aad::from(&header), &mut p)
            .map_err(|_| invalid("open"))?;
        opened += 1;
    }
    let open_time = start.elapsed();
    let per_byte = |t: Duration, n: u64| t.as_nanos() as f64 / (n as f64 * packet as f64);
    Ok(CipherCost {
        seal_ns_per_byte: per_byte(seal_time, sealed),
        // Includes copying the packet back, as quinn's receive path copies each datagram.
        open_ns_per_byte: per_byte(open_time, opened),
    })
}

/// Where the raw probe's receiver puts what it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// Dropped unread; the sender resends one cache-hot megabyte.
    Dropped,
    /// Copied into a region of `region_bytes` per connection (round and
    /// round), sent from one as large: what a transfer between regions that
    /// do not fit in cache must do at least (kvrail copies each chunk into
    /// its destination blocks).
    IntoRegions { region_bytes: usize },
}

/// Raw quinn: `bytes` over `connections` connections from `sender` to
/// `receiver`, each side on its own runtime of `threads` worker threads (as two
/// processes would be), with kvrail's settings: zero-copy writes, reads
/// landing as `landing` says. The receiver listens on one port with
/// `listeners` UDP sockets (see `QuicSettings::receive_sockets`; 1: every
/// datagram through one socket).
#[allow(clippy::too_many_arguments)]
pub fn raw_throughput(
    sender: &Identity,
    receiver: &Identity,
    settings: &QuicSettings,
    connections: usize,
    threads: usize,
    listeners: usize,
    bytes: u64,
    landing: Landing,
) -> io::Result<RawThroughput> {
    let region_bytes = match landing {
        Landing::Dropped => 0,
        Landing::IntoRegions { region_bytes } => region_bytes.max(1 << 20),
    };
    // Written once, so that its pages are there (as a worker's are).
    let region = move || vec![0x5au8; region_bytes];
    let send_side = QuicTransport::new(sender, settings)?;
    let receive_side = QuicTransport::new(receiver, settings)?;
    let receiver_name = receiver.node().to_string();
    let connections = connections.max(1);
    let per_connection = bytes / connections as u64;
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .enable_all()
            .build()
    };
    let server_rt = runtime()?;
    let listeners = listeners.clamp(1, connections);
    let endpoints = {
        let _guard = server_rt.enter();
        let mut settings = receive_side.settings.clone();
        settings.receive_sockets = listeners;
        settings.listener_endpoints(([127, 0, 0, 1], 0).into(), receive_side.server.clone())?
    };
    let addr = endpoints
        .first()
        .ok_or_else(|| io::Error::other("no endpoint"))?
        .local_addr()?;
    let server_endpoints = endpoints.clone();
    let server = std::thread::spawn(move || {
        server_rt.block_on(async move {
            // The kernel picks each connection's socket by its addresses' hash.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            for endpoint in &endpoints {
                let (endpoint, tx) = (endpoint.clone(), tx.clone());
                tokio::spawn(async move {
                    while let Some(incoming) = endpoint.accept().await {
                        if tx.send(incoming).is_err() {
                            return;
                        }
                    }
                });
            }
            let mut tasks = Vec::new();
            for _ in 0..connections {
                let incoming = rx
                    .recv()
                    .await
                    .ok_or_else(|| io::Error::other("endpoint closed"))?;
                let mut into = region();
                tasks.push(tokio::spawn(async move {
                    let conn = incoming.await.map_err(io::Error::other)?;
                    let (mut send, mut recv) = conn.accept_bi().await.map_err(io::Error::other)?;
                    let mut n = 0u64;
                    let mut at = 0usize;
                    while let Some(chunk) = recv
                        .read_chunk(usize::MAX, true)
                        .await
                        .map_err(io::Error::other)?
                    {
                        n += chunk.bytes.len() as u64;
                        let mut bytes = &chunk.bytes[..];
                        while !bytes.is_empty() && !into.is_empty() {
                            if at == into.len() {
                                at = 0;
                            }
                            let k = bytes.len().min(into.len() - at);
                            kvrail_shm::copy_streaming(&mut into[at..at + k], &bytes[..k]);
                            (bytes, at) = (&bytes[k..], at + k);
                        }
                    }
                    send.write_all(&n.to_le_bytes())
                        .await
                        .map_err(io::Error::other)?;
                    send.finish().map_err(io::Error::other)?;
                    let _ = send.stopped().await;
                    Ok::<_, io::Error>(())
                }));
            }
            for t in tasks {
                t.await.map_err(io::Error::other)??;
            }
            Ok::<_, io::Error>(())
        })
    });
    let client_rt = runtime()?;
    let sent = client_rt.block_on(async move {
        let mut streams = Vec::new();
        for _ in 0..connections {
            let endpoint = send_side
                .settings
                .endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), None)?;
            let conn = endpoint
                .connect_with(send_side.client.clone(), addr, &receiver_name)
                .map_err(invalid)?
                .await
                .map_err(io::Error::other)?;
            let (send, recv) = conn.open_bi().await.map_err(io::Error::other)?;
            streams.push((endpoint, conn, send, recv));
        }
        let hot = Bytes::from(vec![0x5au8; 1 << 20]);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (endpoint, conn, mut send, mut recv) in streams {
            let data = if region_bytes == 0 {
                hot.clone()
            } else {
                Bytes::from(region())
            };
            tasks.push(tokio::spawn(async move {
                let mut left = per_connection;
                let mut at = 0usize;
                while left > 0 {
                    if at == data.len() {
                        at = 0;
                    }
                    // Megabyte writes, as kvrail's slices.
                    let n = (left.min(1 << 20) as usize).min(data.len() - at);
                    send.write_chunk(data.slice(at..at + n))
                        .await
                        .map_err(io::Error::other)?;
                    left -= n as u64;
                    at += n;
                }
                send.finish().map_err(io::Error::other)?;
                let mut count = [0u8; 8];
                recv.read_exact(&mut count)
                    .await
                    .map_err(io::Error::other)?;
                if u64::from_le_bytes(count) != per_connection {
                    return Err(io::Error::other("the receiver counted other bytes"));
                }
                drop((conn, endpoint));
                Ok::<_, io::Error>(())
            }));
        }
        for t in tasks {
            t.await.map_err(io::Error::other)??;
        }
        Ok::<_, io::Error>(start.elapsed())
    });
    if sent.is_err() {
        // The receiver may still wait for connections that will never come.
        for e in &server_endpoints {
            e.close(VarInt::from_u32(0), b"probe failed");
        }
    }
    let received = server
        .join()
        .map_err(|_| io::Error::other("receiver thread panicked"));
    let elapsed = sent?;
    received??;
    Ok(RawThroughput {
        bytes: per_connection * connections as u64,
        elapsed,
    })
}

/// What [`raw_throughput`] moved, and how long it took.
#[derive(Debug, Clone, Copy)]
pub struct RawThroughput {
    pub bytes: u64,
    pub elapsed: Duration,
}

impl RawThroughput {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrail_auth::generate::{self, Validity};
    use kvrail_auth::IdentityFiles;

    #[test]
    fn the_floor_measures_something() {
        let cost = packet_cipher_cost(6550, Duration::from_millis(20)).unwrap();
        assert!(cost.seal_ns_per_byte > 0.0 && cost.open_ns_per_byte > 0.0);
        let dir = tempfile::tempdir().unwrap();
        generate::cluster(dir.path(), &["a", "b"], Validity::days(1)).unwrap();
        let id = |n: &str| Identity::load(n, &IdentityFiles::in_dir(dir.path(), n)).unwrap();
        for landing in [
            Landing::Dropped,
            Landing::IntoRegions {
                region_bytes: 3 << 20,
            },
        ] {
            // 8 MiB through 3 MiB regions: round and round, mid-chunk.
            let raw = raw_throughput(
                &id("a"),
                &id("b"),
                &QuicSettings::default(),
                2,
                1,
                2,
                8 << 20,
                landing,
            )
            .unwrap();
            assert_eq!(raw.bytes, 8 << 20, "{landing:?}");
            assert!(raw.gbps() > 0.0);
        }
        // A receiver that is not ours: the client fails and the receiver thread
        // is closed and joined instead of waiting for connections for ever.
        let other = tempfile::tempdir().unwrap();
        generate::cluster(other.path(), &["b"], Validity::days(1)).unwrap();
        let stranger = Identity::load("b", &IdentityFiles::in_dir(other.path(), "b")).unwrap();
        assert!(raw_throughput(
            &id("a"),
            &stranger,
            &QuicSettings::default(),
            1,
            1,
            1,
            1 << 20,
            Landing::Dropped,
        )
        .is_err());
    }
}
