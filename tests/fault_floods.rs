//! Handshake floods against a real sidecar's listeners, while a real peer
//! dials it and moves data: QUIC Initials replayed from many addresses and
//! QUIC connections opened without end by a client of another CA; TCP hellos
//! made with another node's public certificate. Before, the QUIC flood kept
//! the daemon doing TLS and new QUIC dials failed (here: the first push's
//! rails never came up); the TCP flood failed 7 of 15 dials.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail_auth::generate::{self, Validity};
use kvrail_auth::{Identity, IdentityFiles};
use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_e2e::Pair;

/// `n` distinct QUIC Initials (each a new connection's first datagram, as a
/// client with a certificate of another CA sends it), captured on a socket
/// of ours.
async fn captured_initials(n: usize) -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    generate::cluster(dir.path(), &["mallory"], Validity::days(1)).unwrap();
    let id = Identity::load("mallory", &IdentityFiles::in_dir(dir.path(), "mallory")).unwrap();
    let tls = id.client_config().unwrap();
    let client = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ));
    let capture = UdpSocket::bind("127.0.0.1:0").unwrap();
    capture
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let target = capture.local_addr().unwrap();
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut initials = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut buf = vec![0u8; 65536];
    while initials.len() < n {
        // Kept until captured: a dropped connecting closes itself.
        let connecting: Vec<_> = (0..64)
            .map(|_| {
                endpoint
                    .connect_with(client.clone(), target, "decode")
                    .unwrap()
            })
            .collect();
        while let Ok(len) = capture.recv(&mut buf) {
            // The destination connection id (bytes 6.. after its length) tells them apart.
            if len > 6 && buf[0] & 0xc0 == 0xc0 && seen.insert(buf[6..6 + buf[5] as usize].to_vec())
            {
                initials.push(buf[..len].to_vec());
            }
            if initials.len() >= n {
                break;
            }
        }
        drop(connecting);
    }
    initials
}

/// Initials the flood sends a second: each one, before, cost the daemon a
/// TLS handshake (the report saw 124k-222k refused); far more than a
/// listener can do TLS for, far less than what would fill any UDP socket on
/// this machine regardless of what the daemon does with it.
const FLOOD_PER_SEC: u64 = 20_000;

/// The flood: the captured Initials sent again and again to `to` at
/// [`FLOOD_PER_SEC`], each from the next of many sockets (a replay from a
/// new address is a new connection attempt), until `stop`, counted in `sent`.
fn flood(to: SocketAddr, initials: Vec<Vec<u8>>, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) {
    let sockets: Vec<UdpSocket> = (0..256)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let started = Instant::now();
    let mut next = initials.iter().cycle();
    let mut from = sockets.iter().cycle();
    while !stop.load(Ordering::Acquire) {
        // Paced: what is due by now goes out, then a short pause.
        let due = started.elapsed().as_millis() as u64 * FLOOD_PER_SEC / 1000;
        while sent.load(Ordering::Relaxed) < due {
            let _ = from.next().unwrap().send_to(next.next().unwrap(), to);
            sent.fetch_add(1, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A client with a certificate of another CA opening QUIC connections to
/// `to` from 127.0.0.2 as fast as it can (each one's first flight costs the
/// listener a key exchange and a signature), until `stop`.
async fn connect_flood(to: SocketAddr, stop: Arc<AtomicBool>, attempts: Arc<AtomicU64>) {
    let dir = tempfile::tempdir().unwrap();
    generate::cluster(dir.path(), &["mallory"], Validity::days(1)).unwrap();
    let id = Identity::load("mallory", &IdentityFiles::in_dir(dir.path(), "mallory")).unwrap();
    let client = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(id.client_config().unwrap()).unwrap(),
    ));
    let endpoint = quinn::Endpoint::client("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut pending = std::collections::VecDeque::new();
    while !stop.load(Ordering::Acquire) {
        for _ in 0..32 {
            if let Ok(c) = endpoint.connect_with(client.clone(), to, "decode") {
                pending.push_back(tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_millis(300), c).await;
                }));
                attempts.fetch_add(1, Ordering::Relaxed);
            }
        }
        while pending.len() > 2048 {
            let _ = pending.pop_front().unwrap().await;
        }
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_quic_initials_does_not_stop_quic() {
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    let dir = certs.path().display().to_string();
    let quic = [
        "--tls-dir",
        dir.as_str(),
        "--transports",
        "quic",
        "--connections-per-rail",
        "2",
    ];
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let pair = Pair::start_each(&lo, &lo, &quic, &quic);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 64, 64 << 10);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();

    let initials = captured_initials(3000).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (stop, sent, to) = (stop.clone(), sent.clone(), pair.decode.listen);
        std::thread::spawn(move || flood(to, initials, stop, sent))
    };
    let attempts = Arc::new(AtomicU64::new(0));
    let connector = tokio::spawn(connect_flood(
        pair.decode.listen,
        stop.clone(),
        attempts.clone(),
    ));
    // Under the flood: the first push dials its QUIC connections, the rest
    // use them; each must finish, and promptly.
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut first = None;
    let mut n = 0u32;
    while started.elapsed() < Duration::from_secs(10) {
        let t0 = Instant::now();
        let t = p
            .push(
                "p0",
                &format!("under-flood-{n}"),
                "decode",
                blocks(pr, 0..1, vec![n % 64]),
                blocks(dr, 0..1, vec![n % 64]),
            )
            .await
            .unwrap_or_else(|e| panic!("push {n} under the flood refused: {e}"));
        let st = p
            .wait(t.transfer_id, Some(Duration::from_secs(20)))
            .await
            .unwrap();
        assert_eq!(st.state, TransferState::Done as i32, "push {n}: {st:?}");
        match first {
            None => first = Some(t0.elapsed()),
            Some(_) => slowest = slowest.max(t0.elapsed()),
        }
        n += 1;
    }
    stop.store(true, Ordering::Release);
    flooder.join().unwrap();
    connector.await.unwrap();
    let flooded = sent.load(Ordering::Relaxed);
    println!(
        "{} connection attempts from another address",
        attempts.load(Ordering::Relaxed)
    );
    let first = first.unwrap();
    println!("{n} pushes under a flood of {flooded} Initials; the first (dialing) {first:?}, the slowest of the rest {slowest:?}");
    assert!(
        flooded > 150_000,
        "the flood was too small to mean anything: {flooded}"
    );
    // Dialing may wait for a retransmission of its Initial (the flood fills
    // the listener's queue of new ones); the dialed connections then carry on.
    assert!(
        first < Duration::from_secs(8),
        "the first push (dialing) took {first:?}"
    );
    assert!(slowest < Duration::from_secs(2), "slowest push {slowest:?}");
    p_kv.unlink();
    d_kv.unlink();
}

/// Connections from 127.0.0.2 that each send a hello claiming to be
/// `prefill`, with prefill's (public) certificate, and then never prove it:
/// each costs the listener a certificate check and a signature, and holds a
/// handshake slot until its deadline (the last 64 are kept open), until `stop`.
fn hello_flood(to: SocketAddr, certificate: Vec<u8>, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) {
    use kvrail_core::wire::{self, pb, Body};
    use std::io::Write;
    let mut held = std::collections::VecDeque::new();
    while !stop.load(Ordering::Acquire) {
        let sock = socket_from(std::net::Ipv4Addr::new(127, 0, 0, 2), to);
        let Some(mut sock) = sock else { continue };
        let hello = pb::Hello {
            protocol_version: 1,
            node_name: "prefill".into(),
            session_id: rand_u64(),
            transports: vec!["tcp".into()],
            rail_count: 1,
            expected_peer: "decode".into(),
            certificate: certificate.clone(),
            nonce: vec![7; 32],
            ..Default::default()
        };
        if sock
            .write_all(&wire::encode_control(&wire::message(Body::Hello(hello))))
            .is_ok()
        {
            sent.fetch_add(1, Ordering::Relaxed);
        }
        held.push_back(sock);
        if held.len() > 64 {
            held.pop_front();
        }
    }
}

/// A TCP connection to `to` from the address `ip`.
fn socket_from(ip: std::net::Ipv4Addr, to: SocketAddr) -> Option<std::net::TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    s.bind(&SocketAddr::from((ip, 0)).into()).ok()?;
    s.connect_timeout(&to.into(), Duration::from_millis(200))
        .ok()?;
    Some(s.into())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_hellos_with_a_copied_certificate_does_not_lock_peers_out() {
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    let dir = certs.path().display().to_string();
    let tcp = ["--tls-dir", dir.as_str(), "--transports", "tcp"];
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let mut pair = Pair::start_each(&lo, &lo, &tcp, &tcp);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 64, 64 << 10);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let prefill_cert = Identity::load("prefill", &IdentityFiles::in_dir(certs.path(), "prefill"))
        .unwrap()
        .certificate()
        .to_vec();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooders: Vec<_> = (0..8)
        .map(|_| {
            let (stop, sent, to, cert) = (
                stop.clone(),
                sent.clone(),
                pair.decode.listen,
                prefill_cert.clone(),
            );
            std::thread::spawn(move || hello_flood(to, cert, stop, sent))
        })
        .collect();
    // Under the flood, the prefill dials afresh five times (a restart
    // each): every first push gets through, promptly.
    let mut dials = Vec::new();
    for round in 0..5u32 {
        // The flood in full swing before each dial.
        let floods_at = sent.load(Ordering::Relaxed) + 500;
        while sent.load(Ordering::Relaxed) < floods_at {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if round > 0 {
            pair.prefill.kill();
            pair.prefill.restart();
        }
        let mut p = pair.prefill.client().await;
        let pr = p.register_region("p0", &p_kv, false).await.unwrap();
        let t0 = Instant::now();
        let pushed = p
            .push(
                "p0",
                &format!("dial-{round}"),
                "decode",
                blocks(pr, 0..1, vec![round]),
                blocks(dr, 0..1, vec![round]),
            )
            .await;
        let done = match pushed {
            Ok(t) => p
                .wait(t.transfer_id, Some(Duration::from_secs(20)))
                .await
                .ok(),
            Err(e) => panic!("dial {round} under the flood refused: {e}"),
        };
        assert_eq!(
            done.map(|s| s.state),
            Some(TransferState::Done as i32),
            "dial {round}"
        );
        dials.push(t0.elapsed());
    }
    stop.store(true, Ordering::Release);
    for f in flooders {
        f.join().unwrap();
    }
    let flooded = sent.load(Ordering::Relaxed);
    println!("first pushes of 5 dials under {flooded} forged hellos: {dials:?}");
    assert!(
        flooded > 1000,
        "the flood was too small to mean anything: {flooded}"
    );
    let worst = dials.iter().max().unwrap();
    assert!(
        *worst < Duration::from_secs(3),
        "worst first push {worst:?}"
    );
    p_kv.unlink();
    d_kv.unlink();
}
