//! A worker shrinks its registered shared-memory file (by mistake, or while
//! crashing). Before the fix the sidecar died of SIGBUS over QUIC on the
//! sending, receiving and pull-serving side alike, and over TCP the EFAULT tore
//! the whole rail down for 10 s while the receiving worker heard nothing. Now,
//! over both transports and on every side: that worker's transfer fails with a
//! reason that says the file was truncated, both daemons stay up, the
//! connection is kept, and an unrelated transfer goes through at once.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::Path;
use std::time::{Duration, Instant};

use kvrail_auth::generate::{self, Validity};
use kvrail_client::proto::{NotificationKind, TransferState, TransferStatus};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::Pair;
use kvrail_examples::{fill, verify};
use tokio_stream::StreamExt;

const BLOCKS: u32 = 32;
const BLOCK: u64 = 64 << 10;

#[derive(Debug, Clone, Copy)]
enum Side {
    /// The pushing worker's source file.
    Send,
    /// The receiving worker's destination file.
    Receive,
    /// The file a pull reads from.
    PullServe,
}

struct Nodes {
    pair: Pair,
    p: Client,
    d: Client,
    files: Vec<KvRegion>,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for f in &self.files {
            f.unlink();
        }
    }
}

async fn start(transport: &str, certs: &Path) -> Nodes {
    let dir = certs.display().to_string();
    let args: Vec<&str> = match transport {
        "quic" => vec!["--tls-dir", &dir, "--transports", "quic"],
        _ => vec!["--insecure", "--transports", "tcp"],
    };
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let pair = Pair::start_each(&lo, &lo, &args, &args);
    let p = pair.prefill.client().await;
    let d = pair.decode.client().await;
    Nodes {
        pair,
        p,
        d,
        files: Vec::new(),
    }
}

impl Nodes {
    /// A region registered on prefill (`on_prefill`) or decode.
    async fn region(&mut self, name: &str, on_prefill: bool) -> (usize, u64) {
        let layout = dense_layout(1, 1, BLOCKS, BLOCK);
        let kv = KvRegion::create(self.pair.shm_path(name), layout).unwrap();
        let all: Vec<u32> = (0..BLOCKS).collect();
        fill(&kv, 3, 0..1, &all).unwrap();
        let client = if on_prefill { &mut self.p } else { &mut self.d };
        let worker = if on_prefill { "pw" } else { "dw" };
        let id = client.register_region(worker, &kv, true).await.unwrap();
        self.files.push(kv);
        (self.files.len() - 1, id)
    }

    fn truncate(&self, file: usize) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.files[file].memory.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
    }

    async fn push(&mut self, req: &str, src: u64, dst: u64) -> TransferStatus {
        let all: Vec<u32> = (0..BLOCKS).collect();
        let t = self
            .p
            .push(
                "pw",
                req,
                "decode",
                blocks(src, 0..1, all.clone()),
                blocks(dst, 0..1, all),
            )
            .await
            .unwrap();
        self.p
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await
            .unwrap()
    }

    async fn pull(&mut self, req: &str, dst: u64, src: u64) -> TransferStatus {
        let all: Vec<u32> = (0..BLOCKS).collect();
        let t = self
            .d
            .pull(
                "dw",
                req,
                "prefill",
                blocks(src, 0..1, all.clone()),
                blocks(dst, 0..1, all),
            )
            .await
            .unwrap();
        self.d
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await
            .unwrap()
    }
}

async fn case(transport: &str, side: Side, certs: &Path) {
    let mut n = start(transport, certs).await;
    let (p_file, p_id) = n.region("p", true).await;
    let (d_file, d_id) = n.region("d", false).await;
    // Warm the link up, so the case below is about the truncation alone.
    let st = n.push("warm", p_id, d_id).await;
    assert_eq!(st.state, TransferState::Done as i32, "{st:?}");
    let mut decode_notes = n.d.subscribe("dw").await.unwrap();
    while let Ok(Some(_)) =
        tokio::time::timeout(Duration::from_millis(200), decode_notes.next()).await
    {}

    let st = match side {
        Side::Send => {
            n.truncate(p_file);
            n.push("victim", p_id, d_id).await
        }
        Side::Receive => {
            n.truncate(d_file);
            n.push("victim", p_id, d_id).await
        }
        Side::PullServe => {
            n.truncate(p_file);
            n.pull("victim", d_id, p_id).await
        }
    };
    let what = format!("{transport} {side:?}");
    assert_eq!(st.state, TransferState::Failed as i32, "{what}: {st:?}");
    let f = st.failure.unwrap();
    assert!(
        f.message.contains("truncated") || f.code == "region_truncated",
        "{what}: {f:?}"
    );
    assert!(n.pair.prefill.is_running(), "{what}: prefill died");
    assert!(n.pair.decode.is_running(), "{what}: decode died");
    if matches!(side, Side::Receive) {
        // The receiving worker is told too (it heard nothing before the fix).
        let note = tokio::time::timeout(Duration::from_secs(10), decode_notes.next())
            .await
            .expect("the receiving worker was not told")
            .unwrap()
            .unwrap();
        assert_eq!(
            note.kind,
            NotificationKind::Failed as i32,
            "{what}: {note:?}"
        );
    }

    // An unrelated transfer between other regions goes through at once.
    let (_, p2) = n.region("p2", true).await;
    let (d2_file, d2) = n.region("d2", false).await;
    n.files[d2_file]
        .memory
        .fill(0, BLOCK * u64::from(BLOCKS), 0)
        .unwrap();
    let started = Instant::now();
    let st = n.push("bystander", p2, d2).await;
    assert_eq!(st.state, TransferState::Done as i32, "{what}: {st:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{what}: an unrelated push took {:?}",
        started.elapsed()
    );
    let all: Vec<u32> = (0..BLOCKS).collect();
    assert_eq!(
        verify(&n.files[d2_file], 3, 0..1, &all).unwrap(),
        BLOCK * u64::from(BLOCKS)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_file_fails_its_transfer_only_over_tcp_and_quic_on_every_side() {
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    for transport in ["tcp", "quic"] {
        for side in [Side::Send, Side::Receive, Side::PullServe] {
            case(transport, side, certs.path()).await;
        }
    }
}
