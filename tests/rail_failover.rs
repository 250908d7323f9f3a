//! Dual-rail striping and failover over real links: two network namespaces (two
//! nodes) joined by two veth pairs (two rails) shaped with `tc`, one `kvrail`
//! process per namespace. Rails are cut mid-transfer (link down, or every packet
//! dropped) and brought back. Needs root; otherwise each test prints why it skips.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::time::{Duration, Instant};

use kvrail_client::proto::{FailureSide, RailStatus, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_examples::{fill, verify};
use loadgen::cluster::{ClusterOptions, LocalCluster};
use loadgen::netlab::{self, Cut, NetLab, RailShape};

/// 128 blocks of 512 KiB per plane, 2 planes: 128 MiB per transfer.
const BLOCKS: u32 = 128;
const BLOCK_BYTES: u64 = 512 << 10;
const TOTAL: u64 = 2 * BLOCKS as u64 * BLOCK_BYTES;

struct Lab {
    // Field order: the sidecars stop before the namespaces go.
    cluster: LocalCluster,
    lab: NetLab,
    p: Client,
    src: KvRegion,
    dst: KvRegion,
    src_id: u64,
    dst_id: u64,
}

/// Two 1 Gbit/s rails and a sidecar on each side, or `None` (printed) without root.
async fn lab(test: &str, extra: &[&str]) -> Option<Lab> {
    lab_over(test, extra, "tcp").await
}

/// As [`lab`], the sidecars using only `transport` (both have certificates).
async fn lab_over(test: &str, extra: &[&str], transport: &str) -> Option<Lab> {
    if let Some(why) = netlab::unavailable() {
        kvrail_e2e::skip_or_fail(test, &why);
        return None;
    }
    let shape = RailShape {
        rate: "1gbit".into(),
        delay: None,
    };
    let lab = NetLab::create(&[shape.clone(), shape]).unwrap();
    let mut opts = ClusterOptions::new(4, 1 << 20, 8 << 20);
    opts.kvrail_binary = Some(kvrail_e2e::binary("kvrail"));
    opts.extra_args = extra.iter().map(|s| s.to_string()).collect();
    opts.transports = vec![transport.to_string()];
    let cluster = LocalCluster::start_in_lab(&opts, &lab, 2).await.unwrap();
    let mut p = cluster.client(&cluster.prefill).await.unwrap();
    let mut d = cluster.client(&cluster.decode).await.unwrap();
    let layout = dense_layout(1, 2, BLOCKS, BLOCK_BYTES);
    let src = KvRegion::create(cluster.shm_path(&format!("{test}-src")), layout).unwrap();
    let dst = KvRegion::create(cluster.shm_path(&format!("{test}-dst")), layout).unwrap();
    let src_id = p.register_region("p0", &src, false).await.unwrap();
    let dst_id = d.register_region("d0", &dst, false).await.unwrap();
    Some(Lab {
        cluster,
        lab,
        p,
        src,
        dst,
        src_id,
        dst_id,
    })
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.src.unlink();
        self.dst.unlink();
    }
}

impl Lab {
    /// Starts a 128 MiB push of the whole region; the pattern depends on `seed`.
    async fn start_push(&mut self, req: &str, seed: u64) -> u64 {
        let all: Vec<u32> = (0..BLOCKS).collect();
        fill(&self.src, seed, 0..1, &all).unwrap();
        self.dst.memory.fill(0, self.dst.memory.len(), 0).unwrap();
        self.p
            .push(
                "p0",
                req,
                "decode",
                blocks(self.src_id, 0..1, all.clone()),
                blocks(self.dst_id, 0..1, all),
            )
            .await
            .unwrap()
            .transfer_id
    }

    fn verify(&self, seed: u64) {
        let all: Vec<u32> = (0..BLOCKS).collect();
        assert_eq!(verify(&self.dst, seed, 0..1, &all).unwrap(), TOTAL);
    }

    /// The prefill node's rails towards decode, in its outbound session.
    async fn rails(&mut self) -> Vec<RailStatus> {
        let peers = self.p.list_peers().await.unwrap();
        let mut r: Vec<RailStatus> = peers.peers[0]
            .rail_status
            .iter()
            .filter(|r| r.direction == "out")
            .cloned()
            .collect();
        r.sort_by_key(|r| r.rail);
        r
    }

    /// Polls until rail `rail` carried `bytes` more than `base` (a transfer is under way).
    async fn until_rail_carried(&mut self, rail: usize, base: u64, bytes: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.rails().await[rail].bytes_sent < base + bytes {
            assert!(Instant::now() < deadline, "rail {rail} carried nothing");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Polls until rail `rail` is up again; returns how long that took.
    async fn until_rail_up(&mut self, rail: usize, limit: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let r = self.rails().await;
            if r[rail].state == "up" && r[rail].connections > 0 {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < limit,
                "rail {rail} not back within {limit:?}: {r:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.cluster.dir.path().join("prefill.log")).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rail_striping_spreads_a_push_over_both_rails() {
    let Some(mut l) = lab("striping", &[]).await else {
        return;
    };
    let id = l.start_push("striped", 1).await;
    let st = l.p.wait(id, Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{:?}", st.failure);
    l.verify(1);
    let rails = l.rails().await;
    assert_eq!(rails.len(), 2);
    for r in &rails {
        let share = r.bytes_sent as f64 / TOTAL as f64;
        assert!(
            (0.35..=0.65).contains(&share),
            "rail {} carried {share:.2} of the bytes: {rails:?}",
            r.rail
        );
        assert_eq!(r.state, "up");
        assert!(r.rate_bytes_per_sec > 0.0, "no throughput estimate: {r:?}");
    }
    assert_eq!(rails.iter().map(|r| r.slices_retransmitted).sum::<u64>(), 0);
}

async fn cut_mid_transfer_then_restore(how: Cut, test: &str, transport: &str) {
    let Some(mut l) = lab_over(test, &[], transport).await else {
        return;
    };
    let id = l.start_push("cut", 2).await;
    l.until_rail_carried(1, 0, TOTAL / 8).await;
    let peers = l.p.list_peers().await.unwrap();
    assert!(
        peers.peers.iter().all(|p| p.transport == transport),
        "{peers:?}"
    );
    l.lab.cut(1, how).unwrap();
    let st = l.p.wait(id, Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{:?}", st.failure);
    l.verify(2);
    let rails = l.rails().await;
    // Down, or already being probed (and failing: the rail is still cut).
    assert!(
        matches!(rails[1].state.as_str(), "down" | "probing"),
        "{rails:?}"
    );
    assert!(!rails[1].last_failure.is_empty());
    assert!(rails[0].slices_retransmitted > 0, "{rails:?}");
    // Bring it back: probing re-admits it within 5 s, and it carries the next push.
    l.lab.restore(1).unwrap();
    let back = l.until_rail_up(1, Duration::from_secs(5)).await;
    println!("{test}: rail 1 back {back:?} after the restore");
    let before = l.rails().await[1].bytes_sent;
    let id = l.start_push("after", 3).await;
    let st = l.p.wait(id, Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{:?}", st.failure);
    l.verify(3);
    let carried = l.rails().await[1].bytes_sent - before;
    assert!(
        carried > TOTAL / 4,
        "rail 1 carried {carried} after returning"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn rail_link_down_mid_transfer_fails_over_and_comes_back() {
    cut_mid_transfer_then_restore(Cut::LinkDown, "link-down", "tcp").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rail_dropping_every_packet_mid_transfer_fails_over_and_comes_back() {
    cut_mid_transfer_then_restore(Cut::DropAll, "drop-all", "tcp").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn quic_rail_link_down_mid_transfer_fails_over_and_comes_back() {
    cut_mid_transfer_then_restore(Cut::LinkDown, "quic-link-down", "quic").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rail_both_cut_fails_with_the_cause_then_serves_again() {
    let Some(mut l) = lab("both-cut", &["--rail-deadline-ms", "2000"]).await else {
        return;
    };
    let id = l.start_push("doomed", 4).await;
    l.until_rail_carried(0, 0, TOTAL / 8).await;
    l.lab.cut(0, Cut::DropAll).unwrap();
    l.lab.cut(1, Cut::DropAll).unwrap();
    let cut = Instant::now();
    let st = l.p.wait(id, Some(Duration::from_secs(30))).await.unwrap();
    let took = cut.elapsed();
    assert_eq!(st.state, TransferState::Failed as i32);
    let f = st.failure.unwrap();
    assert_eq!(f.side, FailureSide::Rail as i32, "{f:?}");
    assert_eq!(f.code, "rails_down", "{f:?}");
    assert!(f.message.contains("no acknowledgement"), "{}", f.message);
    // Stall detection (at most 1 s) plus the 2 s deadline, with scheduling slack.
    assert!(took <= Duration::from_millis(3500), "failed after {took:?}");
    // The daemon is healthy: it answers, and once a rail is back it moves bytes.
    l.lab.restore(0).unwrap();
    l.until_rail_up(0, Duration::from_secs(5)).await;
    let id = l.start_push("after", 5).await;
    let st = l.p.wait(id, Some(Duration::from_secs(60))).await.unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{:?}", st.failure);
    l.verify(5);
}
