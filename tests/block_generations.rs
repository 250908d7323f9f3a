//! Block generations, with real sidecars: a transfer that names the generations
//! of the blocks it moves never reads blocks their worker has released (the
//! prefill side freed them) and never writes into blocks released on the
//! receiving side (the decode side aborted the request and reused them). The
//! release is made while the other sidecar is stopped (SIGSTOP), so the
//! transfer is certainly still open when it happens.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::{Duration, Instant};

use kvrail_client::proto::{FailureSide, NotificationKind, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::{metric_sum, scrape, Pair};
use kvrail_examples::{fill, verify};
use tokio_stream::StreamExt;

const LAYERS: u32 = 32;
const BLOCKS: u32 = 64;

async fn wait_moving(c: &mut Client, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = c.get_transfer(id).await.unwrap();
        assert_ne!(st.state, TransferState::Done as i32, "finished too soon");
        if st.bytes_done > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the transfer never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pull_never_reads_blocks_the_prefill_released() {
    let pair = Pair::start(&["--slice-bytes", "65536"]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(LAYERS, 1, BLOCKS, 64 << 10); // 128 MiB
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, true).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let all: Vec<u32> = (0..BLOCKS).collect();
    fill(&p_kv, 11, 0..LAYERS, &all).unwrap();

    // What the prefill hands over with the block ids.
    let gens = p.block_generations(pr, all.clone()).await.unwrap();
    assert_eq!(gens, vec![1; BLOCKS as usize]);
    let mut src = blocks(pr, 0..LAYERS, all.clone());
    src.generations = gens.clone();

    // 1. Released before the pull: refused before a byte moves.
    let (new, failed) = p.release_blocks(pr, vec![3]).await.unwrap();
    assert_eq!((new, failed), (vec![2], 0));
    let t = d
        .pull(
            "d0",
            "early",
            "prefill",
            src.clone(),
            blocks(dr, 0..LAYERS, all.clone()),
        )
        .await
        .unwrap();
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let f = st.failure.expect("the pull must fail");
    assert_eq!(f.code, "blocks_released", "{f:?}");
    assert_eq!(f.side, FailureSide::Peer as i32, "{f:?}");
    assert!(f.message.contains("block 3 of region"), "{f:?}");
    let mut buf = vec![0u8; d_kv.memory.len() as usize];
    d_kv.memory.read_at(0, &mut buf).unwrap();
    assert!(
        buf.iter().all(|&b| b == 0),
        "bytes landed from a refused pull"
    );

    // Bad requests get clear errors and release nothing.
    let e = p.release_blocks(pr, vec![1, BLOCKS]).await.unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    let e = p.release_blocks(pr + 1000, vec![1]).await.unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
    assert_eq!(p.block_generations(pr, vec![1]).await.unwrap(), vec![1]);
    let mut wrong = src.clone();
    wrong.generations.pop();
    let e = d
        .pull(
            "d0",
            "wrong",
            "prefill",
            wrong,
            blocks(dr, 0..LAYERS, all.clone()),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");

    // 2. Released while the pull runs (the decode sidecar stopped, so it cannot
    // finish in between): the pull fails on both sides and the decode worker is
    // told why; it is never told the blocks arrived.
    src.generations = p.block_generations(pr, all.clone()).await.unwrap();
    let mut notes = d.subscribe("d0").await.unwrap();
    let t = d
        .pull(
            "d0",
            "late",
            "prefill",
            src.clone(),
            blocks(dr, 0..LAYERS, all.clone()),
        )
        .await
        .unwrap();
    wait_moving(&mut d, t.transfer_id).await;
    pair.decode.signal("STOP");
    let released = p.release_blocks(pr, vec![40]).await;
    pair.decode.signal("CONT");
    // (A writer blocked mid-write into the stopped peer's socket does not hold
    // the release up: its connection is cut, see the test below.)
    let (_, failed) = released.expect("release while the pull runs");
    assert_eq!(failed, 1, "the serving side must fail the open pull");
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let f = st.failure.expect("the pull must fail");
    assert_eq!(f.code, "blocks_released", "{f:?}");
    assert!(f.message.contains("40"), "{f:?}");
    // (The stream first replays what is retained, the refused pull included.)
    let n = loop {
        let n = tokio::time::timeout(Duration::from_secs(10), notes.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if n.request_id == "late" {
            break n;
        }
    };
    assert_eq!(n.kind, NotificationKind::Failed as i32, "{n:?}");
    assert!(
        n.failure
            .as_ref()
            .is_some_and(|f| f.code == "blocks_released"),
        "{n:?}"
    );

    // 3. With the current generations the pull moves every byte.
    src.generations = p.block_generations(pr, all.clone()).await.unwrap();
    let t = d
        .pull(
            "d0",
            "fresh",
            "prefill",
            src,
            blocks(dr, 0..LAYERS, all.clone()),
        )
        .await
        .unwrap();
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{st:?}");
    verify(&d_kv, 11, 0..LAYERS, &all).unwrap();
    p_kv.unlink();
    d_kv.unlink();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_push_never_writes_into_blocks_the_decode_released() {
    let pair = Pair::start(&["--slice-bytes", "65536"]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(LAYERS, 1, BLOCKS, 64 << 10);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let all: Vec<u32> = (0..BLOCKS).collect();
    fill(&p_kv, 12, 0..LAYERS, &all).unwrap();

    // The decode grants its blocks with their generations.
    let mut dst = blocks(dr, 0..LAYERS, all.clone());
    dst.generations = d.block_generations(dr, all.clone()).await.unwrap();
    let t = p
        .push(
            "p0",
            "req",
            "decode",
            blocks(pr, 0..LAYERS, all.clone()),
            dst,
        )
        .await
        .unwrap();
    wait_moving(&mut p, t.transfer_id).await;
    // The decode aborts the request and reuses block 40 for another one, with
    // the prefill sidecar stopped so the push is certainly unfinished.
    pair.prefill.signal("STOP");
    let (_, failed) = d.release_blocks(dr, vec![40]).await.unwrap();
    let reused = vec![0xabu8; 64 << 10];
    for layer in 0..LAYERS {
        d_kv.write_block(layer, 0, 40, &reused).unwrap();
    }
    pair.prefill.signal("CONT");
    assert_eq!(failed, 1, "the receiving side must fail the open push");
    let st = p
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let f = st.failure.expect("the push must fail");
    assert_eq!(f.code, "blocks_released", "{f:?}");
    assert_eq!(f.side, FailureSide::Peer as i32, "{f:?}");
    // Whatever was in flight, nothing overwrote the reused block afterwards: a
    // later push to the same peer completes, so every earlier frame was handled.
    let later = p
        .push(
            "p0",
            "after",
            "decode",
            blocks(pr, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
        )
        .await
        .unwrap();
    let st = p
        .wait(later.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(st.state, TransferState::Done as i32, "{st:?}");
    for layer in 0..LAYERS {
        assert_eq!(
            d_kv.read_block(layer, 0, 40).unwrap(),
            reused,
            "layer {layer}: a stale write landed in a released block"
        );
    }
    p_kv.unlink();
    d_kv.unlink();
}

/// The prefill's writer is blocked mid-write into a connection the stopped
/// decode does not drain: a release must not wait on that write. Either the
/// rail's stall detection cut the connections first, or the release cuts the
/// one carrying the released transfer (its frame cannot be cut short); the
/// release answers within its wait, the decode is told why its pull failed
/// once it runs again (the news waits for a rail), and the link serves the
/// next pull.
#[tokio::test(flavor = "multi_thread")]
async fn a_release_does_not_wait_on_a_write_the_stopped_peer_never_drains() {
    let pair = Pair::start(&["--slice-bytes", "65536"]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(LAYERS, 1, BLOCKS, 64 << 10); // 128 MiB
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, true).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let all: Vec<u32> = (0..BLOCKS).collect();
    fill(&p_kv, 13, 0..LAYERS, &all).unwrap();
    let mut src = blocks(pr, 0..LAYERS, all.clone());
    src.generations = p.block_generations(pr, all.clone()).await.unwrap();
    let t = d
        .pull(
            "d0",
            "stuck",
            "prefill",
            src.clone(),
            blocks(dr, 0..LAYERS, all.clone()),
        )
        .await
        .unwrap();
    wait_moving(&mut d, t.transfer_id).await;
    pair.decode.signal("STOP");
    // The socket buffers fill and the writer blocks: the prefill's sent bytes
    // stop growing (well short of the 128 MiB). Released soon after, before the
    // rail's stall detection (150-300 ms without acknowledgement) if the
    // machine lets us.
    let metrics = pair.prefill.metrics.unwrap();
    let sent = || metric_sum(&scrape(metrics), "kvrail_bytes_sent_total", &[]);
    let mut last = (sent(), Instant::now());
    while last.1.elapsed() < Duration::from_millis(30) {
        let now = sent();
        if now != last.0 {
            last = (now, Instant::now());
        }
        std::thread::yield_now();
    }
    assert!(last.0 < (128 << 20) as f64, "sent {} bytes", last.0);
    let asked = Instant::now();
    let released = p.release_blocks(pr, vec![40]).await;
    let took = asked.elapsed();
    pair.decode.signal("CONT");
    let (_, failed) = released.expect("the release must not wait on the stuck write");
    assert_eq!(failed, 1, "the serving side must fail the open pull");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // (Whether the writer was stuck when the release came, and so whether the
    // stall detection or the release cut it, depends on timing; say which.)
    let log = pair.prefill.log();
    let how = if log.contains("did not drain") {
        "the release cut the stuck connection"
    } else if log.contains("rail down") {
        "the stall detection cut the stuck connection"
    } else {
        "no write was stuck"
    };
    eprintln!("{how} ({took:?})");
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let f = st.failure.expect("the pull must fail");
    assert_eq!(
        f.code,
        "blocks_released",
        "{f:?}\nprefill:\n{}\ndecode:\n{}",
        pair.prefill.log_tail(30),
        pair.decode.log_tail(30)
    );
    // The link recovers: the next pull of current generations moves its bytes.
    let few: Vec<u32> = (0..4).collect();
    let mut src = blocks(pr, 0..LAYERS, few.clone());
    src.generations = p.block_generations(pr, few.clone()).await.unwrap();
    let t = d
        .pull(
            "d0",
            "after",
            "prefill",
            src,
            blocks(dr, 0..LAYERS, few.clone()),
        )
        .await
        .unwrap();
    let st = d
        .wait(t.transfer_id, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(
        st.state,
        TransferState::Done as i32,
        "{st:?}\nprefill:\n{}\ndecode:\n{}",
        pair.prefill.log_tail(30),
        pair.decode.log_tail(30)
    );
    verify(&d_kv, 13, 0..LAYERS, &few).unwrap();
    p_kv.unlink();
    d_kv.unlink();
}
