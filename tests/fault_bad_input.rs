//! Bad input from workers and peers: each case gets a specific error, the daemon
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.
//! stays up, and no byte lands outside the named destination blocks.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvrail_client::proto::{
    FailureSide, NotificationKind, RegionLayout, TransferState, TransferStatus,
};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_core::wire::{self, pb, Body, SliceHeader};
use kvrail_e2e::raw_peer::{self, read_control};
use kvrail_e2e::Pair;
use kvrail_examples::{fill, verify};
use tokio_stream::StreamExt;
use tonic::Code;

struct Setup {
    pair: Pair,
    p: Client,
    d: Client,
    p_kv: KvRegion,
    d_kv: KvRegion,
    p_region: u64,
    d_region: u64,
}

async fn setup(extra: &[&str]) -> Setup {
    let pair = Pair::start(extra);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, 64, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, false).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, false).await.unwrap();
    fill(&p_kv, 3, 0..4, &(0..64).collect::<Vec<_>>()).unwrap();
    Setup {
        pair,
        p,
        d,
        p_kv,
        d_kv,
        p_region,
        d_region,
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.p_kv.unlink();
        self.d_kv.unlink();
    }
}

fn zeros(kv: &KvRegion) -> bool {
    let mut buf = vec![0u8; kv.memory.len() as usize];
    kv.memory.read_at(0, &mut buf).unwrap();
    buf.iter().all(|b| *b == 0)
}

async fn push(
    s: &mut Setup,
    req: &str,
    src: Vec<u32>,
    dst_layers: std::ops::Range<u32>,
    dst: Vec<u32>,
) -> Result<u64, Code> {
    let layers = dst_layers.clone();
    s.p.push(
        "p0",
        req,
        "decode",
        blocks(s.p_region, 0..layers.len() as u32, src),
        blocks(s.d_region, dst_layers, dst),
    )
    .await
    .map(|t| t.transfer_id)
    .map_err(|e| e.code().unwrap())
}

async fn wait(c: &mut Client, id: u64) -> TransferStatus {
    c.wait(id, Some(Duration::from_secs(30))).await.unwrap()
}

/// A warm-up push so that the link is up before a test freezes the peer.
async fn warm_up(s: &mut Setup) {
    let id = push(s, "warm-up", vec![63], 3..4, vec![63]).await.unwrap();
    assert_eq!(wait(&mut s.p, id).await.state, TransferState::Done as i32);
}

#[tokio::test(flavor = "multi_thread")]
async fn worker_requests_are_validated_with_specific_codes() {
    let mut s = setup(&[]).await;
    let (pr, dr) = (s.p_region, s.d_region);
    // (source, destination, peer, request id, expected code, what it checks)
    let cases = [
        (
            blocks(999, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
            "decode",
            "a",
            Code::NotFound,
            "unknown local region",
        ),
        (
            blocks(pr, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
            "nobody",
            "a",
            Code::NotFound,
            "unknown peer",
        ),
        (
            blocks(pr, 0..1, vec![64]),
            blocks(dr, 0..1, vec![0]),
            "decode",
            "a",
            Code::InvalidArgument,
            "block out of range",
        ),
        (
            blocks(pr, 2..5, vec![0]),
            blocks(dr, 0..3, vec![0]),
            "decode",
            "a",
            Code::InvalidArgument,
            "layer out of range",
        ),
        (
            blocks(pr, 0..1, vec![]),
            blocks(dr, 0..1, vec![]),
            "decode",
            "a",
            Code::InvalidArgument,
            "zero blocks",
        ),
        (
            blocks(pr, 0..0, vec![1]),
            blocks(dr, 0..0, vec![1]),
            "decode",
            "a",
            Code::InvalidArgument,
            "zero layers",
        ),
        (
            blocks(pr, 0..1, vec![1, 2]),
            blocks(dr, 0..1, vec![5, 5]),
            "decode",
            "a",
            Code::InvalidArgument,
            "overlapping destination",
        ),
        (
            blocks(pr, 0..1, vec![1, 2]),
            blocks(dr, 0..1, vec![5]),
            "decode",
            "a",
            Code::InvalidArgument,
            "size mismatch",
        ),
        (
            blocks(pr, 0..1, vec![1]),
            blocks(dr, 0..1, vec![5]),
            "decode",
            "",
            Code::InvalidArgument,
            "empty request id",
        ),
        (
            blocks(pr, 0..1, vec![0; 2_000_000]),
            blocks(dr, 0..1, vec![0]),
            "decode",
            "a",
            Code::InvalidArgument,
            "absurd block count",
        ),
    ];
    for (src, dst, peer, req, code, what) in cases {
        let got =
            s.p.push("p0", req, peer, src, dst)
                .await
                .map_err(|e| e.code().unwrap());
        assert_eq!(got.unwrap_err(), code, "{what}");
    }

    // Region registration.
    let layout = dense_layout(4, 2, 64, 4096);
    let missing = s.pair.dir.path().join("missing");
    assert_eq!(
        s.p.register_path("p0", &missing, layout, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::NotFound)
    );
    let small = s.pair.shm_path("small");
    std::fs::write(&small, vec![0u8; 4096]).unwrap();
    assert_eq!(
        s.p.register_path("p0", &small, layout, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::InvalidArgument),
        "layout larger than file"
    );
    let zero_block = RegionLayout {
        block_bytes: 0,
        ..layout
    };
    assert_eq!(
        s.p.register_path("p0", &small, zero_block, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::InvalidArgument)
    );
    let absurd = RegionLayout {
        layer_stride: u64::MAX / 2,
        ..layout
    };
    assert_eq!(
        s.p.register_path("p0", &small, absurd, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::InvalidArgument)
    );
    let overlapping = RegionLayout {
        block_stride: 100,
        ..dense_layout(1, 1, 4, 4096)
    };
    assert_eq!(
        s.p.register_path("p0", &small, overlapping, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        s.p.register_path("p0", s.pair.dir.path(), layout, false)
            .await
            .unwrap_err()
            .code(),
        Some(Code::InvalidArgument),
        "directory"
    );
    std::fs::remove_file(&small).unwrap();

    assert_eq!(
        s.p.wait(12345, None).await.unwrap_err().code(),
        Some(Code::NotFound)
    );
    assert_eq!(
        s.p.unregister_region(12345).await.unwrap_err().code(),
        Some(Code::NotFound)
    );
    // Nothing of the above reached the peer.
    assert!(zeros(&s.d_kv));
}

#[tokio::test(flavor = "multi_thread")]
async fn peer_side_rejections_fail_the_transfer_and_leave_memory_untouched() {
    let mut s = setup(&[]).await;
    let mut notes = s.p.subscribe("p0").await.unwrap();
    let dr = s.d_region;
    type Case = (Vec<u32>, std::ops::Range<u32>, Vec<u32>, u64, &'static str);
    let cases: Vec<Case> = vec![
        (vec![0], 0..1, vec![0], 999, "unknown_region"),
        (vec![0, 1], 0..1, vec![3, 64], dr, "out_of_range"),
        (vec![0], 3..5, vec![1], dr, "out_of_range"),
    ];
    for (i, (src, layers, dst, region, code)) in cases.into_iter().enumerate() {
        let req = format!("bad-{i}");
        let t =
            s.p.push(
                "p0",
                &req,
                "decode",
                blocks(s.p_region, 0..layers.len() as u32, src),
                blocks(region, layers, dst),
            )
            .await
            .unwrap();
        let st = wait(&mut s.p, t.transfer_id).await;
        assert_eq!(st.state, TransferState::Failed as i32, "{req}: {st:?}");
        let f = st.failure.unwrap();
        assert_eq!(
            (f.side, f.code.as_str()),
            (FailureSide::Peer as i32, code),
            "{req}: {}",
            f.message
        );
        let n = notes.next().await.unwrap().unwrap();
        assert_eq!(
            (n.kind, n.request_id.as_str()),
            (NotificationKind::Failed as i32, req.as_str())
        );
    }
    // Pulling a region that is not exposed.
    let t =
        s.d.pull(
            "d0",
            "pull-unexposed",
            "prefill",
            blocks(s.p_region, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
        )
        .await
        .unwrap();
    let st = wait(&mut s.d, t.transfer_id).await;
    assert_eq!(st.failure.unwrap().code, "not_exposed");
    assert!(
        zeros(&s.d_kv),
        "a rejected transfer wrote into the destination"
    );
    // The same request ids work once their transfers are over, and the daemons still serve.
    let id = push(&mut s, "bad-0", vec![5], 2..3, vec![9]).await.unwrap();
    assert_eq!(wait(&mut s.p, id).await.state, TransferState::Done as i32);
}

#[tokio::test(flavor = "multi_thread")]
async fn duplicate_request_ids_are_refused_while_live() {
    let mut s = setup(&[]).await;
    warm_up(&mut s).await;
    s.pair.decode.signal("STOP");
    let first = push(&mut s, "dup", vec![1], 0..1, vec![1]).await.unwrap();
    assert_eq!(
        push(&mut s, "dup", vec![2], 0..1, vec![2])
            .await
            .unwrap_err(),
        Code::AlreadyExists
    );
    // Still in flight: its source region cannot be unregistered under it.
    assert_eq!(
        s.p.unregister_region(s.p_region).await.unwrap_err().code(),
        Some(Code::FailedPrecondition)
    );
    s.pair.decode.signal("CONT");
    assert_eq!(
        wait(&mut s.p, first).await.state,
        TransferState::Done as i32
    );
    let again = push(&mut s, "dup", vec![2], 0..1, vec![2]).await.unwrap();
    assert_eq!(
        wait(&mut s.p, again).await.state,
        TransferState::Done as i32
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_peer_times_out_and_cancel_is_reported() {
    let mut s = setup(&["--progress-timeout-ms", "400"]).await;
    warm_up(&mut s).await;
    s.pair.decode.signal("STOP");
    let stalled = push(&mut s, "stall", vec![1], 0..1, vec![1]).await.unwrap();
    let st = wait(&mut s.p, stalled).await;
    let f = st.failure.expect("must fail");
    assert_eq!(
        (f.side, f.code.as_str()),
        (FailureSide::Timeout as i32, "timeout"),
        "{}",
        f.message
    );

    let cancelled = push(&mut s, "cancel-me", vec![2], 0..1, vec![2])
        .await
        .unwrap();
    let st = s.p.cancel(cancelled).await.unwrap();
    assert_eq!(st.state, TransferState::Failed as i32);
    assert_eq!(st.failure.unwrap().side, FailureSide::Cancelled as i32);
    s.pair.decode.signal("CONT");
    let ok = push(&mut s, "after", vec![3], 0..1, vec![3]).await.unwrap();
    assert_eq!(wait(&mut s.p, ok).await.state, TransferState::Done as i32);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_dying_mid_transfer_fails_it_and_the_daemon_stays_up() {
    let mut s = setup(&["--rail-deadline-ms", "1000"]).await;
    warm_up(&mut s).await;
    s.pair.decode.signal("STOP");
    let all: Vec<u32> = (0..64).collect();
    let id = push(&mut s, "doomed", all.clone(), 0..4, all)
        .await
        .unwrap();
    s.pair.decode.kill();
    let st = wait(&mut s.p, id).await;
    let f = st.failure.expect("must fail");
    assert_eq!(
        (f.side, f.code.as_str()),
        (FailureSide::Rail as i32, "rails_down"),
        "{}",
        f.message
    );
    assert!(s.pair.prefill.is_running());
    // The daemon answers, and says plainly that the peer is gone.
    let peers = s.p.list_peers().await.unwrap();
    assert!(!peers.peers[0].connected);
    let err = push(&mut s, "next", vec![1], 0..1, vec![1])
        .await
        .unwrap_err();
    assert_eq!(err, Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread")]
async fn garbled_truncated_and_out_of_range_peer_frames_are_contained() {
    let mut s = setup(&[]).await;
    let addr = s.pair.decode.listen;

    // Not kvrail at all.
    let mut junk = TcpStream::connect(addr).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxx")
        .unwrap();
    junk.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 256];
    let n = junk.read(&mut buf).unwrap_or(0);
    assert!(
        n == 0 || buf[..2] == *b"KR",
        "the daemon must answer garbage with a refusal or a close"
    );

    // A node that is not a configured peer.
    let (_, reply) = raw_peer::hello(addr, "mallory", 77);
    assert!(
        matches!(reply, Some(Body::Abort(ref a)) if a.message.contains("mallory")),
        "{reply:?}"
    );

    // A configured peer that sends a slice outside the transfer it opened.
    let (mut sock, reply) = raw_peer::hello(addr, "prefill", 77);
    assert!(matches!(reply, Some(Body::HelloAck(_))), "{reply:?}");
    let open = pb::PushOpen {
        transfer_id: 1,
        request_id: "evil".into(),
        destination: Some(pb::BlockSet {
            region_id: s.d_region,
            layer_start: 0,
            layer_count: 1,
            block_ids: vec![4],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }),
        block_bytes: 4096,
        total_bytes: 8192,
        one_sided: false,
        geometry: None,
        receiver_group: None,
    };
    sock.write_all(&wire::encode_control(&wire::message(Body::PushOpen(open))))
        .unwrap();
    let payload = vec![0xAAu8; 4096];
    sock.write_all(&wire::encode_data_header(
        SliceHeader {
            transfer_id: 1,
            offset: 6000,
        },
        4096,
    ))
    .unwrap();
    sock.write_all(&payload).unwrap();
    let reply = read_control(&mut sock);
    assert!(
        matches!(reply, Some(Body::Abort(ref a)) if a.transfer_id == 1),
        "{reply:?}"
    );
    // A slice for a transfer that was never opened, then a truncated frame, then a close.
    sock.write_all(&wire::encode_data_header(
        SliceHeader {
            transfer_id: 99,
            offset: 0,
        },
        4096,
    ))
    .unwrap();
    sock.write_all(&payload).unwrap();
    sock.write_all(&wire::encode_data_header(
        SliceHeader {
            transfer_id: 99,
            offset: 0,
        },
        65536,
    ))
    .unwrap();
    sock.write_all(&payload[..100]).unwrap();
    drop(sock);

    // A garbled frame in the middle of a session.
    let (mut sock, _) = raw_peer::hello(addr, "prefill", 77);
    sock.write_all(b"KR\x01\x09garbage-after-a-good-hello")
        .unwrap();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest);

    assert!(zeros(&s.d_kv), "bytes landed in the decode region");
    assert!(s.pair.decode.is_running());
    let log = s.pair.decode.log();
    assert!(log.contains("refused peer handshake"), "{log}");
    assert!(log.contains("malformed frame"), "{log}");
    // The daemon still moves real transfers, verified.
    let all: Vec<u32> = (0..64).collect();
    let id = push(&mut s, "after-abuse", all.clone(), 0..4, all.clone())
        .await
        .unwrap();
    assert_eq!(wait(&mut s.p, id).await.state, TransferState::Done as i32);
    verify(&s.d_kv, 3, 0..4, &all).unwrap();
}
