//! A receiving sidecar paused for 0.7 s (SIGSTOP, then SIGCONT: a GC pause, CPU
//! starvation, a short hiccup) must not wedge the direction: the transfers in
//! flight end, and every later push goes through. Before the fix the rail stayed
//! `suspect` for good and every later push failed with "no progress".
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::Pair;
use kvrail_examples::{fill, verify};

struct Setup {
    pair: Pair,
    p: Client,
    p_kv: KvRegion,
    d_kv: KvRegion,
    p_region: u64,
    d_region: u64,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.p_kv.unlink();
        self.d_kv.unlink();
    }
}

/// 256 blocks of 64 KiB on one layer and plane: a 16-block push is one 1 MiB slice.
async fn setup() -> Setup {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 256, 64 << 10);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, false).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, false).await.unwrap();
    fill(&p_kv, 5, 0..1, &(0..256).collect::<Vec<_>>()).unwrap();
    Setup {
        pair,
        p,
        p_kv,
        d_kv,
        p_region,
        d_region,
    }
}

async fn push(s: &mut Setup, req: &str, ids: Vec<u32>) -> u64 {
    s.p.push(
        "p0",
        req,
        "decode",
        blocks(s.p_region, 0..1, ids.clone()),
        blocks(s.d_region, 0..1, ids),
    )
    .await
    .unwrap()
    .transfer_id
}

async fn state(s: &mut Setup, id: u64) -> (i32, String) {
    let st = s.p.wait(id, Some(Duration::from_secs(60))).await.unwrap();
    (st.state, st.failure.map(|f| f.message).unwrap_or_default())
}

/// The decode sidecar is stopped from `since` for `pause` in all (the fault
/// itself is a duration), then continued.
fn resume_decode_after(s: &Setup, since: std::time::Instant, pause: Duration) {
    std::thread::sleep(pause.saturating_sub(since.elapsed()));
    s.pair.decode.signal("CONT");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_receiver_does_not_wedge_later_pushes() {
    let mut s = setup().await;
    let warm = push(&mut s, "warm", (240..256).collect()).await;
    assert_eq!(state(&mut s, warm).await.0, TransferState::Done as i32);

    // Stopped before the push, so its one slice is in flight while it sleeps.
    s.pair.decode.signal("STOP");
    let stopped = std::time::Instant::now();
    let first = push(&mut s, "during-pause", (0..16).collect()).await;
    resume_decode_after(&s, stopped, Duration::from_millis(700));
    assert_eq!(
        state(&mut s, first).await,
        (TransferState::Done as i32, String::new())
    );
    for round in 0..5u32 {
        let ids: Vec<u32> = (16 + round * 16..32 + round * 16).collect();
        let id = push(&mut s, &format!("after-{round}"), ids).await;
        assert_eq!(
            state(&mut s, id).await,
            (TransferState::Done as i32, String::new()),
            "push {round} after the pause\n{}",
            s.pair.prefill.log()
        );
    }
    assert_eq!(
        verify(&s.d_kv, 5, 0..1, &(0..96).collect::<Vec<_>>()).unwrap(),
        96 << 16
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn many_concurrent_pushes_across_a_pause_all_end_and_the_direction_lives() {
    let mut s = setup().await;
    let warm = push(&mut s, "warm", vec![255]).await;
    assert_eq!(state(&mut s, warm).await.0, TransferState::Done as i32);

    // 240 one-block pushes in flight while the receiver is stopped.
    s.pair.decode.signal("STOP");
    let stopped = std::time::Instant::now();
    let mut ids = Vec::new();
    for b in 0..240u32 {
        ids.push((b, push(&mut s, &format!("burst-{b}"), vec![b]).await));
    }
    resume_decode_after(&s, stopped, Duration::from_millis(700));
    let mut done = 0;
    for (b, id) in ids {
        let (st, why) = state(&mut s, id).await;
        assert!(
            st == TransferState::Done as i32 || !why.is_empty(),
            "block {b}: ended without a reason"
        );
        done += u32::from(st == TransferState::Done as i32);
    }
    assert_eq!(done, 240, "a 0.7 s pause must not fail transfers");
    let after = push(&mut s, "after", (0..16).collect()).await;
    assert_eq!(
        state(&mut s, after).await,
        (TransferState::Done as i32, String::new())
    );
}

/// A pulling sidecar paused mid-pull for 2.5 s: the serving side sees its
/// rail stall and goes down, and it cannot redial (the puller dialed it).
/// The pull must still end Done once the puller runs again.
#[tokio::test(flavor = "multi_thread")]
async fn a_puller_paused_mid_pull_still_gets_every_byte() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 1024, 256 << 10);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, true).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, false).await.unwrap();
    let ids: Vec<u32> = (0..1024).collect();
    fill(&p_kv, 7, 0..1, &ids).unwrap();
    let t = d
        .pull(
            "d0",
            "paused-pull",
            "prefill",
            blocks(p_region, 0..1, ids.clone()),
            blocks(d_region, 0..1, ids.clone()),
        )
        .await
        .unwrap();
    pair.decode.signal("STOP");
    let stopped = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(stopped.elapsed()));
    pair.decode.signal("CONT");
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    let log = pair.prefill.log();
    assert_eq!(
        st.state,
        TransferState::Done as i32,
        "{st:?}\nprefill log:\n{log}\ndecode log:\n{}",
        pair.decode.log()
    );
    assert_eq!(verify(&d_kv, 7, 0..1, &ids).unwrap(), 1024 << 18);
    println!(
        "serving side saw a rail go down: {}",
        log.contains("rail down")
    );
    // The paused side says so once it runs again.
    kvrail_e2e::wait_until("the paused sidecar logs its stall", || {
        pair.decode.log().contains("this process did not run for")
    });
    p_kv.unlink();
    d_kv.unlink();
}
