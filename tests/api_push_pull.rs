//! Two real kvrail processes on loopback move verified KV blocks both ways.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use kvrail_client::proto::{NotificationKind, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::{command, metric_sum, scrape, Pair};
use kvrail_examples::{fill, scattered_blocks, verify};
use tokio_stream::StreamExt;

/// Runs the example workers: `first` must print READY before `second` starts.
fn run_examples(first: (&str, Vec<String>), second: (&str, Vec<String>)) -> (String, String) {
    let mut a = command(first.0)
        .args(&first.1)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start first worker");
    let mut lines = BufReader::new(a.stdout.take().expect("stdout")).lines();
    let ready = lines
        .next()
        .expect("first worker printed nothing")
        .expect("read");
    assert!(ready.starts_with("READY"), "{ready}");
    let b = command(second.0)
        .args(&second.1)
        .output()
        .expect("run second worker");
    assert!(
        b.status.success(),
        "{} failed: {}",
        second.0,
        String::from_utf8_lossy(&b.stderr)
    );
    let status = a.wait().expect("wait first worker");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "{} failed", first.0);
    (
        rest.join("\n"),
        String::from_utf8_lossy(&b.stdout).into_owned(),
    )
}

fn worker_args(socket: &std::path::Path, handoff: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        "--socket".to_string(),
        socket.display().to_string(),
        "--handoff".into(),
        handoff.display().to_string(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn example_workers_push_and_verify() {
    let pair = Pair::start(&[]);
    pair.prefill.client().await;
    pair.decode.client().await;
    let handoff = pair.dir.path().join("push.json");
    let (decode_out, prefill_out) = run_examples(
        (
            "decode_worker",
            worker_args(&pair.decode.socket, &handoff, &[]),
        ),
        (
            "prefill_worker",
            worker_args(&pair.prefill.socket, &handoff, &["--peer", "decode"]),
        ),
    );
    // 8 layers x K,V x 64 blocks x 32 KiB.
    assert!(
        decode_out.contains("VERIFIED 33554432 bytes"),
        "{decode_out}"
    );
    assert!(
        prefill_out.contains("PUSHED 33554432 bytes"),
        "{prefill_out}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn example_workers_pull_and_verify() {
    let pair = Pair::start(&[]);
    pair.prefill.client().await;
    pair.decode.client().await;
    let handoff = pair.dir.path().join("pull.json");
    let (prefill_out, decode_out) = run_examples(
        (
            "prefill_worker",
            worker_args(&pair.prefill.socket, &handoff, &["--expose"]),
        ),
        (
            "decode_worker",
            worker_args(
                &pair.decode.socket,
                &handoff,
                &["--pull", "--peer", "prefill"],
            ),
        ),
    );
    assert!(
        decode_out.contains("VERIFIED 33554432 bytes"),
        "{decode_out}"
    );
    assert!(
        prefill_out.contains("SERVED 33554432 bytes"),
        "{prefill_out}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn push_and_pull_both_directions_with_notifications() {
    let pair = Pair::start(&["--slice-bytes", "262144"]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, 128, 16384);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, true).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, true).await.unwrap();
    let mut p_notes = p.subscribe("p0").await.unwrap();
    let mut d_notes = d.subscribe("d0").await.unwrap();

    // prefill -> decode push of layers 1..3, shuffled destination blocks.
    let src = scattered_blocks(40, 128, 1);
    let dst = scattered_blocks(40, 128, 2);
    fill(&p_kv, 7, 1..3, &src).unwrap();
    let t = p
        .push(
            "p0",
            "r-push",
            "decode",
            blocks(p_region, 1..3, src.clone()),
            blocks(d_region, 1..3, dst.clone()),
        )
        .await
        .unwrap();
    assert_eq!(t.total_bytes, 2 * 2 * 40 * 16384);
    let s = p
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(s.bytes_done, t.total_bytes);
    let n = d_notes.next().await.unwrap().unwrap();
    assert_eq!(n.kind, NotificationKind::PushReceived as i32);
    assert_eq!(
        (n.request_id.as_str(), n.region_id, n.peer.as_str()),
        ("r-push", d_region, "prefill")
    );
    assert_eq!(n.block_ids, dst);
    let n = p_notes.next().await.unwrap().unwrap();
    assert_eq!(n.kind, NotificationKind::PushDone as i32);
    assert_eq!(verify(&d_kv, 7, 1..3, &dst).unwrap(), t.total_bytes);
    // Layer 0 and 3 of the destination blocks were not named: still zero.
    assert!(d_kv
        .read_block(0, 0, dst[0])
        .unwrap()
        .iter()
        .all(|b| *b == 0));
    assert!(d_kv
        .read_block(3, 1, dst[5])
        .unwrap()
        .iter()
        .all(|b| *b == 0));

    // decode pulls other blocks from prefill.
    let src2 = scattered_blocks(30, 128, 3);
    let dst2: Vec<u32> = (0..128).filter(|b| !dst.contains(b)).take(30).collect();
    fill(&p_kv, 9, 0..4, &src2).unwrap();
    let t = d
        .pull(
            "d0",
            "r-pull",
            "prefill",
            blocks(p_region, 0..4, src2.clone()),
            blocks(d_region, 0..4, dst2.clone()),
        )
        .await
        .unwrap();
    let s = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(verify(&d_kv, 9, 0..4, &dst2).unwrap(), t.total_bytes);
    let n = d_notes.next().await.unwrap().unwrap();
    assert_eq!(n.kind, NotificationKind::PullDone as i32);
    let n = p_notes.next().await.unwrap().unwrap();
    assert_eq!(
        (n.kind, n.request_id.as_str()),
        (NotificationKind::PullServed as i32, "r-pull")
    );

    // And the other way round: decode pushes into prefill.
    let back = scattered_blocks(16, 128, 4);
    fill(&d_kv, 11, 0..4, &back).unwrap();
    let t = d
        .push(
            "d0",
            "r-back",
            "prefill",
            blocks(d_region, 0..4, back.clone()),
            blocks(p_region, 0..4, back.clone()),
        )
        .await
        .unwrap();
    let s = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32);
    assert_eq!(verify(&p_kv, 11, 0..4, &back).unwrap(), t.total_bytes);

    // Metrics saw it.
    let text = scrape(pair.prefill.metrics.unwrap());
    for name in [
        "kvrail_bytes_sent_total",
        "kvrail_transfers_done_total",
        "kvrail_transfer_duration_seconds_bucket",
        "kvrail_bytes_received_total",
        "kvrail_rail_state",
        "kvrail_rail_throughput_bytes_per_second",
    ] {
        assert!(text.contains(name), "{name} missing from metrics:\n{text}");
    }
    assert!(text.contains("peer=\"decode\""), "{text}");
    // Registered at connect time, so present before any byte moved: the
    // counts say the transfers went through them.
    assert!(
        metric_sum(&text, "kvrail_bytes_sent_total", &[]) > 0.0,
        "{text}"
    );
    assert!(
        metric_sum(&text, "kvrail_bytes_received_total", &[]) > 0.0,
        "{text}"
    );
    p_kv.unlink();
    d_kv.unlink();
}

#[tokio::test(flavor = "multi_thread")]
async fn many_concurrent_pushes_all_land() {
    let pair = Pair::start(&[]);
    let p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(2, 2, 512, 8192);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let mut pc = p.clone();
    let p_region = pc.register_region("p0", &p_kv, false).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, false).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..32u32 {
        let ids: Vec<u32> = (i * 16..i * 16 + 16).collect();
        fill(&p_kv, u64::from(i), 0..2, &ids).unwrap();
        let mut c: Client = p.clone();
        tasks.push(tokio::spawn(async move {
            let t = c
                .push(
                    "p0",
                    &format!("req-{i}"),
                    "decode",
                    blocks(p_region, 0..2, ids.clone()),
                    blocks(d_region, 0..2, ids.clone()),
                )
                .await
                .unwrap();
            c.wait(t.transfer_id, Some(Duration::from_secs(30)))
                .await
                .unwrap()
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let s = t.await.unwrap();
        assert_eq!(s.state, TransferState::Done as i32, "req-{i}: {s:?}");
        let ids: Vec<u32> = (i as u32 * 16..i as u32 * 16 + 16).collect();
        verify(&d_kv, i as u64, 0..2, &ids).unwrap();
    }
    p_kv.unlink();
    d_kv.unlink();
}
