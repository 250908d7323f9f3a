//! What production and an attacker do to a sidecar, against real daemons:
//! a peer's sessions over the cap, a restarted peer, a slice trickled into
//! released blocks, a metrics port held open, rings and streams of other
//! workers. (Memory under attack: `fault_memory.rs`; decisions tested
//! deterministically in kvrail-core: `the_session_cap_is_decided_before_anything_is_answered`,
//! `what_open_transfers_hold_is_bounded_per_session_and_per_node`,
//! `an_abort_between_an_open_and_its_repeat_leaves_no_orphan`.)
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_core::wire::{self, pb, Body, ErrorCode};
use kvrail_e2e::raw_peer;
use kvrail_e2e::Pair;
use tonic::Code;

/// A raw session posing as `prefill` (an `--insecure` pair) with process
/// `incarnation`, carrying one transfer that waits for its bytes; None when
/// the handshake was refused (then the refusal's code and reason).
fn busy_session(
    pair: &Pair,
    session_id: u64,
    incarnation: u64,
    region: u64,
) -> Result<TcpStream, (i32, String)> {
    let hello = pb::Hello {
        incarnation,
        ..raw_peer::hello_message("prefill", session_id)
    };
    let (mut sock, answer) = raw_peer::hello_as(raw_peer::connect(pair.decode.listen), hello);
    match answer {
        Some(Body::HelloAck(_)) => {}
        Some(Body::Abort(a)) => return Err((a.code, a.message)),
        other => panic!("session {session_id}: the handshake got {other:?}"),
    }
    let push = pb::PushOpen {
        transfer_id: session_id,
        request_id: format!("held-{session_id}"),
        destination: Some(pb::BlockSet {
            region_id: region,
            layer_start: 0,
            layer_count: 1,
            block_ids: vec![0],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }),
        block_bytes: 64,
        total_bytes: 64,
        one_sided: false,
        geometry: None,
        receiver_group: None,
    };
    sock.write_all(&wire::encode_control(&wire::message(Body::PushOpen(push))))
        .unwrap();
    Ok(sock)
}

/// Eight sessions posing as `prefill` hold transfers: the real prefill's
/// next session is refused before any ack, with the reason and its code,
/// and its worker is told "too many sessions" at once. Before, the session
/// was acked and then closed: the pushes were accepted, failed ten seconds
/// later as a timeout, and the rail flapped hundreds of times.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_over_the_cap_is_refused_before_the_ack_and_the_worker_told() {
    let pair = Pair::start(&["--progress-timeout-ms", "120000"]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 4, 64);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let mut held = Vec::new();
    for id in 100..108u64 {
        held.push(busy_session(&pair, id, 0, dr).expect("eight sessions are allowed"));
    }
    // Settled: each session's transfer is open before the next one comes.
    std::thread::sleep(Duration::from_millis(200));
    let (code, why) = busy_session(&pair, 108, 0, dr).expect_err("a ninth is refused");
    assert_eq!(code, ErrorCode::TooManySessions as i32, "{why}");
    assert!(why.contains("sessions carrying transfers"), "{why}");

    let started = Instant::now();
    let refused = p
        .push(
            "p0",
            "over-the-cap",
            "decode",
            blocks(pr, 0..1, vec![0]),
            blocks(dr, 0..1, vec![1]),
        )
        .await
        .expect_err("the push cannot start");
    assert_eq!(refused.code(), Some(Code::Unavailable), "{refused:?}");
    assert!(
        refused.to_string().contains("sessions carrying transfers"),
        "{refused}"
    );
    assert!(started.elapsed() < Duration::from_secs(5), "told at once");
    drop(held);
    p_kv.unlink();
    d_kv.unlink();
}

/// A peer that restarts gets a new incarnation: its new sessions replace
/// the old process's (which can never resume), even when those still carry
/// transfers; the old process's sessions are refused from then on.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_peer_s_sessions_replace_its_old_ones() {
    let pair = Pair::start(&["--progress-timeout-ms", "120000"]);
    let mut d = pair.decode.client().await;
    let d_kv = KvRegion::create(pair.shm_path("d"), dense_layout(1, 1, 4, 64)).unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let mut old: Vec<TcpStream> = (200..208u64)
        .map(|id| busy_session(&pair, id, 0x77, dr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // The same node from a new process: accepted, and the old sessions closed.
    let new = busy_session(&pair, 300, 0x78, dr).expect("a new process's session is accepted");
    for s in &mut old {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 4096];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
    }
    // The old process cannot come back and evict its successor.
    let (_, why) = busy_session(&pair, 209, 0x77, dr).expect_err("the old process is refused");
    assert!(why.contains("replaced by a newer one"), "{why}");
    drop(new);
    d_kv.unlink();
}

/// Sixteen connections held open in silence used to take every slot of the
/// metrics port: 0 of 100 scrapes succeeded. A scrape now closes the oldest
/// silent one when all are taken.
#[test]
fn held_metrics_connections_do_not_keep_scrapes_out() {
    let pair = Pair::start(&[]);
    let metrics = pair.decode.metrics.unwrap();
    // Served once the daemon is up.
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(metrics).is_err() {
        assert!(Instant::now() < deadline, "the metrics port never opened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let held: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(metrics).unwrap())
        .collect();
    let mut ok = 0;
    for _ in 0..100 {
        let mut s = TcpStream::connect(metrics).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        ok += usize::from(answer.starts_with("HTTP/1.1 200"));
    }
    assert_eq!(ok, 100, "{ok} of 100 scrapes answered");
    drop(held);
}

/// A peer trickles a slice into blocks whose worker then releases them:
/// ReleaseBlocks used to answer UNAVAILABLE after 5 s while bytes kept
/// landing in the released block, and the worker heard FAILED a minute later
/// (the payload deadline). The connection reading the slice is now cut after
/// the writers' grace: ReleaseBlocks succeeds, nothing lands afterwards, the
/// worker is told at once and the region can go.
#[tokio::test(flavor = "multi_thread")]
async fn a_slice_trickled_into_released_blocks_is_cut() {
    use tokio_stream::StreamExt;
    let pair = Pair::start(&["--progress-timeout-ms", "60000"]);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 4, 1 << 20);
    let kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let region = d.register_region("d0", &kv, false).await.unwrap();
    let mut notes = d.subscribe("d0").await.unwrap();
    let mut sock = raw_peer::session(pair.decode.listen, 9);
    let open = pb::PushOpen {
        transfer_id: 1,
        request_id: "trickled".into(),
        destination: Some(pb::BlockSet {
            region_id: region,
            layer_start: 0,
            layer_count: 1,
            block_ids: vec![0],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }),
        block_bytes: 1 << 20,
        total_bytes: 1 << 20,
        one_sided: false,
        geometry: None,
        receiver_group: None,
    };
    sock.write_all(&wire::encode_control(&wire::message(Body::PushOpen(open))))
        .unwrap();
    sock.write_all(&wire::encode_data_header(
        wire::SliceHeader {
            transfer_id: 1,
            offset: 0,
        },
        1 << 20,
    ))
    .unwrap();
    sock.write_all(&[0xAB; 4096]).unwrap();
    // The bytes keep coming, slowly, from another thread.
    let mut trickle = sock.try_clone().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let trickler = std::thread::spawn(move || {
        while !stopped.load(std::sync::atomic::Ordering::Acquire) {
            if trickle.write_all(&[0xCD; 1024]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let (_, failed) = d.release_blocks(region, vec![0]).await.unwrap();
    let took = started.elapsed();
    assert_eq!(failed, 1);
    assert!(took < Duration::from_secs(4), "ReleaseBlocks took {took:?}");
    // Nothing lands after ReleaseBlocks returned.
    let mut after = vec![0u8; 1 << 20];
    kv.memory.read_at(0, &mut after).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut later = vec![0u8; 1 << 20];
    kv.memory.read_at(0, &mut later).unwrap();
    assert!(
        after == later,
        "bytes landed in the released block afterwards"
    );
    // The worker hears of it now, and the region can go.
    let note = tokio::time::timeout(Duration::from_secs(5), notes.next())
        .await
        .expect("the worker is told at once")
        .unwrap()
        .unwrap();
    assert_eq!(note.request_id, "trickled");
    let why = note.failure.map(|f| f.code).unwrap_or_default();
    assert_eq!(why, "blocks_released");
    d.unregister_region(region).await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Release);
    trickler.join().unwrap();
    kv.unlink();
}
