//! Authenticated peers between two real `kvrail` processes: QUIC is chosen over
//! TCP when both sides have certificates, every byte verified; TCP handshakes are
//! signed with the same certificates. Peers whose certificate is from another CA,
//! expired, or missing are refused (over QUIC by the TLS handshake, over TCP by
//! the signed handshake), logged and counted, and no byte reaches the
//! destination region.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::Path;
use std::time::{Duration, Instant};

use kvrail_auth::generate::{self, Validity};
use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::{metric_sum, scrape, Pair};
use kvrail_examples::{fill, scattered_blocks, verify};

const NUM_BLOCKS: u32 = 64;
const BLOCK_BYTES: u64 = 64 << 10;

/// A cluster directory with a CA and certificates for both nodes.
fn cluster_certs(dir: &Path) {
    generate::cluster(dir, &["prefill", "decode"], Validity::days(1)).unwrap();
}

struct Nodes {
    pair: Pair,
    p: Client,
    d: Client,
    p_kv: KvRegion,
    d_kv: KvRegion,
    p_region: u64,
    d_region: u64,
}

async fn start(certs: &Path, name: &str) -> Nodes {
    let dir = certs.display().to_string();
    let both = ["--tls-dir", &dir, "--slice-bytes", "262144"];
    start_each(&both, &both, name).await
}

async fn start_each(prefill: &[&str], decode: &[&str], name: &str) -> Nodes {
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let pair = Pair::start_each(&lo, &lo, prefill, decode);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, NUM_BLOCKS, BLOCK_BYTES);
    let p_kv = KvRegion::create(pair.shm_path(&format!("{name}-p")), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path(&format!("{name}-d")), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, true).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, true).await.unwrap();
    Nodes {
        pair,
        p,
        d,
        p_kv,
        d_kv,
        p_region,
        d_region,
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        self.p_kv.unlink();
        self.d_kv.unlink();
    }
}

impl Nodes {
    async fn push(&mut self, seed: u64, n: usize) -> (Result<u64, String>, Vec<u32>) {
        let src = scattered_blocks(n, NUM_BLOCKS, seed);
        let dst = scattered_blocks(n, NUM_BLOCKS, seed + 100);
        fill(&self.p_kv, seed, 0..4, &src).unwrap();
        let t = self
            .p
            .push(
                "p0",
                &format!("push-{seed}"),
                "decode",
                blocks(self.p_region, 0..4, src),
                blocks(self.d_region, 0..4, dst.clone()),
            )
            .await
            .map(|t| t.transfer_id)
            .map_err(|e| e.to_string());
        (t, dst)
    }
}

#[tokio::test]
async fn quic_is_chosen_when_both_have_certificates_and_moves_every_byte() {
    let certs = tempfile::tempdir().unwrap();
    cluster_certs(certs.path());
    let mut n = start(certs.path(), "quic-ok").await;
    let (id, dst) = n.push(1, 48).await;
    let s =
        n.p.wait(id.unwrap(), Some(Duration::from_secs(60)))
            .await
            .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(
        verify(&n.d_kv, 1, 0..4, &dst).unwrap(),
        4 * 2 * 48 * BLOCK_BYTES
    );
    // Pull the other way: decode dials prefill, over QUIC too.
    let src = scattered_blocks(32, NUM_BLOCKS, 7);
    let dst: Vec<u32> = (0..NUM_BLOCKS).rev().take(32).collect();
    fill(&n.p_kv, 7, 1..3, &src).unwrap();
    let t =
        n.d.pull(
            "d0",
            "pull-7",
            "prefill",
            blocks(n.p_region, 1..3, src),
            blocks(n.d_region, 1..3, dst.clone()),
        )
        .await
        .unwrap();
    let s =
        n.d.wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await
            .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(
        verify(&n.d_kv, 7, 1..3, &dst).unwrap(),
        2 * 2 * 32 * BLOCK_BYTES
    );

    let peers = n.p.list_peers().await.unwrap();
    assert_eq!(peers.peers[0].transport, "quic", "{peers:?}");
    let text = scrape(n.pair.prefill.metrics.unwrap());
    assert_eq!(
        metric_sum(
            &text,
            "kvrail_peer_transport",
            &["peer=\"decode\"", "transport=\"quic\""]
        ),
        1.0,
        "{text}"
    );
    assert!(metric_sum(&text, "kvrail_bytes_sent_total", &["transport=\"quic\""]) > 0.0);
    assert_eq!(
        metric_sum(&text, "kvrail_bytes_sent_total", &["transport=\"tcp\""]),
        0.0
    );
    assert!(n.pair.prefill.log().contains("transport chosen for peer"));
}

/// Replaces prefill's certificate with one that decode must refuse, over
/// `transport`; decode must count the refusal under `reason`.
async fn refused(name: &str, transport: &str, reason: &str, spoil: impl FnOnce(&Path)) {
    let certs = tempfile::tempdir().unwrap();
    cluster_certs(certs.path());
    spoil(certs.path());
    let dir = certs.path().display().to_string();
    let both = ["--tls-dir", &dir, "--transports", transport];
    let n = start_each(&both, &both, name).await;
    refused_by_decode(n, reason).await;
}

/// Prefill's push fails; decode logs and counts why; no byte reaches decode.
async fn refused_by_decode(mut n: Nodes, reason: &str) {
    let (result, dst) = n.push(3, 8).await;
    match result {
        Err(e) => assert!(e.contains("refused") || e.contains("QUIC"), "{e}"),
        Ok(id) => {
            let s = n.p.wait(id, Some(Duration::from_secs(30))).await.unwrap();
            assert_ne!(s.state, TransferState::Done as i32, "{s:?}");
        }
    }
    // The acceptor says why, and counts it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !n.pair.decode.log().contains("refused peer handshake") {
        assert!(Instant::now() < deadline, "{}", n.pair.decode.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // (Counted before it is logged; polled all the same, as a scrape is a
    // separate connection.)
    loop {
        let text = scrape(n.pair.decode.metrics.unwrap());
        let refused = metric_sum(
            &text,
            "kvrail_handshakes_refused_total",
            &[&format!("reason=\"{reason}\"")],
        );
        if refused >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // No data exchanged: the destination is untouched.
    assert!(verify(&n.d_kv, 3, 0..4, &dst).is_err());
    let mut region = vec![0u8; n.d_kv.memory.len() as usize];
    n.d_kv.memory.read_at(0, &mut region).unwrap();
    assert!(region.iter().all(|&b| b == 0), "bytes reached decode");
}

fn from_another_ca(dir: &Path) {
    let other = tempfile::tempdir().unwrap();
    cluster_certs(other.path());
    for f in ["prefill.pem", "prefill.key"] {
        std::fs::copy(other.path().join(f), dir.join(f)).unwrap();
    }
}

fn expired(dir: &Path) {
    generate::node(dir, "prefill", Validity::expired()).unwrap();
}

#[tokio::test]
async fn a_peer_with_a_certificate_from_another_ca_is_refused() {
    refused("quic-other-ca", "quic", "tls", from_another_ca).await;
}

#[tokio::test]
async fn a_peer_with_an_expired_certificate_is_refused() {
    refused("quic-expired", "quic", "tls", expired).await;
}

#[tokio::test]
async fn tcp_refuses_a_peer_with_a_certificate_from_another_ca() {
    refused("tcp-other-ca", "tcp", "certificate", from_another_ca).await;
}

#[tokio::test]
async fn tcp_refuses_a_peer_with_an_expired_certificate() {
    refused("tcp-expired", "tcp", "certificate", expired).await;
}

/// A node without certificates (`--insecure`) cannot reach one that has them:
/// it has no QUIC, and its TCP hello carries no certificate.
#[tokio::test]
async fn a_peer_without_a_certificate_is_refused() {
    let certs = tempfile::tempdir().unwrap();
    cluster_certs(certs.path());
    let dir = certs.path().display().to_string();
    let n = start_each(&["--insecure"], &["--tls-dir", &dir], "no-cert").await;
    refused_by_decode(n, "no_certificate").await;
}

/// TCP between nodes with certificates: the handshake is signed both ways and
/// the transfer goes through, verified.
#[tokio::test]
async fn tcp_between_nodes_with_certificates_is_authenticated() {
    let certs = tempfile::tempdir().unwrap();
    cluster_certs(certs.path());
    let dir = certs.path().display().to_string();
    let both = ["--tls-dir", &dir, "--transports", "tcp"];
    let mut n = start_each(&both, &both, "tcp-auth").await;
    let (id, dst) = n.push(5, 32).await;
    let s =
        n.p.wait(id.unwrap(), Some(Duration::from_secs(60)))
            .await
            .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(
        verify(&n.d_kv, 5, 0..4, &dst).unwrap(),
        4 * 2 * 32 * BLOCK_BYTES
    );
    let peers = n.p.list_peers().await.unwrap();
    assert_eq!(peers.peers[0].transport, "tcp", "{peers:?}");
    let text = scrape(n.pair.decode.metrics.unwrap());
    assert_eq!(
        metric_sum(&text, "kvrail_handshakes_refused_total", &[]),
        0.0,
        "{text}"
    );
    assert!(metric_sum(&text, "kvrail_bytes_received_total", &["transport=\"tcp\""]) > 0.0);
}
