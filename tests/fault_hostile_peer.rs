//! A hostile peer on a raw socket: oversized frames before authentication, a
//! flood of handshakes, and a request whose plan would be unbounded. Each is
//! refused from the first bytes that show it, the daemon's memory and log stay
//! bounded, and it keeps serving.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_core::wire::{self, pb, Body, ErrorCode, FRAME_HEADER_LEN};
use kvrail_e2e::raw_peer::{self, read_control};
use kvrail_e2e::Pair;
use kvrail_examples::fill;

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// A control frame header announcing `len` body bytes.
fn control_header(len: u32) -> Vec<u8> {
    // Any real control frame's header, with the length replaced.
    let mut frame = wire::encode_control(&wire::message(Body::HelloProof(pb::HelloProof {
        signature: vec![],
    })));
    frame.truncate(FRAME_HEADER_LEN);
    frame[4..8].copy_from_slice(&len.to_le_bytes());
    frame
}

/// Writes `frame` over and over in batches without reading anything back,
/// until the daemon cuts the connection (asserted: reset or broken pipe);
/// how many frames went out. Several times what any bound takes, at most.
fn flood_until_cut(sock: &mut TcpStream, frame: &[u8], what: &str) -> usize {
    let batch: Vec<u8> = frame.repeat(10_000);
    sock.set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut sent = 0usize;
    let cut = loop {
        match sock.write_all(&batch) {
            Ok(()) => sent += 10_000,
            Err(e) => break e,
        }
        assert!(sent < 3_000_000, "never cut after {sent} {what}");
    };
    assert!(
        matches!(
            cut.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        "{cut:?} after {sent} {what}"
    );
    sent
}

/// 64 connections each announce a 16 MiB hello (a 16 MiB node name) and send
/// it without reading anything back. Before the fix each one held ~230 MB and
/// wrote the name into the log; now each is refused from its frame header.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_pre_auth_frames_are_refused_from_the_header() {
    let pair = Pair::start(&[]);
    let _ = pair.decode.client().await;
    let addr: SocketAddr = pair.decode.listen;
    let before = rss(pair.decode.pid());
    let log_before = pair.decode.log().len();

    // Just under the post-handshake frame limit (16 MiB), as the report had it.
    let name = "n".repeat((16 << 20) - 64);
    let hello = wire::message(Body::Hello(pb::Hello {
        protocol_version: 1,
        node_name: name,
        ..Default::default()
    }));
    let frame = std::sync::Arc::new(wire::encode_control(&hello));
    assert!(frame.len() > 16 << 19);
    let mut attackers = Vec::new();
    for _ in 0..64 {
        let frame = frame.clone();
        attackers.push(std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
            // The daemon may close on us mid-write: that is the point.
            let _ = s.write_all(&frame);
            s
        }));
    }
    let mut peak = before;
    let socks: Vec<TcpStream> = attackers.into_iter().map(|t| t.join().unwrap()).collect();
    peak = peak.max(rss(pair.decode.pid()));
    // Still holding the sockets open (never reading): memory stays bounded.
    for _ in 0..20 {
        peak = peak.max(rss(pair.decode.pid()));
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(socks);
    let grew = peak.saturating_sub(before);
    assert!(
        grew < 64 << 20,
        "pre-authentication frames grew the daemon by {} MiB",
        grew >> 20
    );
    let logged = pair.decode.log().len() - log_before;
    assert!(logged < 64 << 10, "{logged} bytes of log for 64 refusals");

    // Also a plain announcement with nothing behind it: refused at once, with
    // a reason that names the limit, not a 5 s handshake timeout.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.write_all(&control_header(16 << 20)).unwrap();
    let started = Instant::now();
    match read_control(&mut s) {
        Some(Body::Abort(a)) => assert!(a.message.contains("16384"), "{}", a.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));

    // And the daemon serves.
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 4, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    fill(&p_kv, 1, 0..1, &[0, 1]).unwrap();
    let t = p
        .push(
            "p0",
            "r",
            "decode",
            blocks(pr, 0..1, vec![0, 1]),
            blocks(dr, 0..1, vec![0, 1]),
        )
        .await
        .unwrap();
    let st = p
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(st.state, TransferState::Done as i32);
    p_kv.unlink();
    d_kv.unlink();
}

/// More connections than the daemon handshakes at once: the excess is closed
/// at once instead of each holding a task and its buffers.
#[tokio::test(flavor = "multi_thread")]
async fn a_handshake_flood_is_capped() {
    let pair = Pair::start(&[]);
    let _ = pair.decode.client().await;
    let addr = pair.decode.listen;
    // 200 connections that never say hello.
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let checks: Vec<_> = idle
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                // Turned away: closed at once. Admitted: silent until the
                // handshake timeout, well after this read gives up.
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let mut b = [0u8; 1];
                matches!(s.read(&mut b), Ok(0))
            })
        })
        .collect();
    let closed = checks
        .into_iter()
        .map(|t| t.join().unwrap())
        .filter(|c| *c)
        .count();
    assert!(
        closed >= 100,
        "only {closed} of 200 idle handshakes were turned away"
    );
    assert!(
        closed <= 200 - 32,
        "{closed}: up to the cap, handshakes must be admitted"
    );
}

/// Idle connections (anyone who reaches the port can open them, and keep
/// reopening them) must not lock a real peer out: with every handshake slot
/// held by a connection that never spoke, a peer's hello still gets its
/// answer, the oldest silent connection making room.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_holding_every_handshake_slot_do_not_lock_peers_out() {
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let addr = pair.decode.listen;
    let idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // Every idle connection is accepted (and holds a slot, or was evicted)
    // before the peer dials: the daemon has answered a call since.
    d.list_peers().await.unwrap();
    // Idle connections younger than 20 ms are not dropped yet: a peer whose
    // dial is closed dials again, as peers do, well within the handshake
    // deadline (5 s) that would free the slots anyway.
    let dialing = Instant::now();
    loop {
        match raw_peer::hello(addr, "prefill", 55) {
            (_, Some(Body::HelloAck(_))) => break,
            (_, None) if dialing.elapsed() < Duration::from_secs(3) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            (_, reply) => panic!("the peer's handshake was refused: {reply:?}"),
        }
    }
    drop(idle);
}

/// A configured peer asks to pull block 0 a million times over 80 layers. Before
/// the fix the plan (80 million segments) got the sidecar OOM-killed; now the
/// request is refused by its shape and the peer told why.
#[tokio::test(flavor = "multi_thread")]
async fn a_pull_open_with_an_unbounded_plan_is_refused() {
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(80, 1, 4, 64);
    let kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let region = d.register_region("d0", &kv, true).await.unwrap();
    let before = rss(pair.decode.pid());

    let mut sock = raw_peer::session(pair.decode.listen, 99);
    let open = pb::PullOpen {
        transfer_id: 1,
        request_id: "greedy".into(),
        source: Some(pb::BlockSet {
            region_id: region,
            layer_start: 0,
            layer_count: 80,
            block_ids: vec![0; 1_000_000],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }),
        block_bytes: 64,
        total_bytes: 80 * 1_000_000 * 64,
        one_sided: false,
        geometry: None,
    };
    let started = Instant::now();
    sock.write_all(&wire::encode_control(&wire::message(Body::PullOpen(open))))
        .unwrap();
    let reply = loop {
        match read_control(&mut sock) {
            Some(Body::Abort(a)) => break a,
            Some(_) => continue,
            None => panic!("no refusal within 10 s (the daemon is building the plan)"),
        }
    };
    assert!(reply.message.contains("pieces"), "{}", reply.message);
    assert!(started.elapsed() < Duration::from_secs(5));
    let grew = rss(pair.decode.pid()).saturating_sub(before);
    assert!(grew < 128 << 20, "grew by {} MiB", grew >> 20);
    assert!(d.list_peers().await.is_ok(), "the daemon answers");
    kv.unlink();
}

/// A peer that keeps sending pings but never reads the pongs: each one used
/// to queue a reply its blocked writer could not write, so the daemon's
/// memory grew for as long as the peer kept going. The connection is cut
/// once its unwritten queue passes a bound, and the daemon keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_never_reads_its_replies_is_cut() {
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let before = rss(pair.decode.pid());
    let mut sock = raw_peer::session(pair.decode.listen, 77);
    // Pings in batches, never reading: the socket buffers fill (a few MiB of
    // pongs), then the daemon's queue, then it must cut the connection, which
    // ends our writes. 3 M pings (~60 MiB) is several times what it takes.
    let ping = wire::encode_control(&wire::message(Body::Ping(pb::Ping { nonce: u64::MAX })));
    flood_until_cut(&mut sock, &ping, "pings");
    let grew = rss(pair.decode.pid()).saturating_sub(before);
    assert!(grew < 256 << 20, "grew by {} MiB", grew >> 20);
    assert!(
        pair.decode.log().contains("does not read"),
        "{}",
        pair.decode.log_tail(10)
    );
    assert!(d.list_peers().await.is_ok(), "the daemon answers");
}

/// Every new session id from a peer used to make a new link (each may hold
/// 64 connections): a peer opening sessions without end could exhaust the
/// daemon's file descriptors. A node holds at most 8 sessions here: an idle
/// one gives way to a new one (a dialer's old sessions may outlive a crash
/// unnoticed), and only when all carry transfers is the new one refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_peer_opening_session_after_session_is_capped() {
    // The held transfers must outlive the test's few seconds of waiting.
    let pair = Pair::start(&["--progress-timeout-ms", "120000"]);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 4, 64);
    let kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let region = d.register_region("d0", &kv, false).await.unwrap();
    let open = |session_id| raw_peer::session(pair.decode.listen, session_id);
    // Idle sessions: twenty in a row are all accepted, older idle ones
    // closed to make room.
    let idle: Vec<TcpStream> = (1000..1020u64).map(open).collect();
    drop(idle);
    // Sessions each carrying a transfer that waits for its bytes: eight at
    // most, the next is told why and closed.
    let mut held = Vec::new();
    let mut refused = None;
    for session_id in 2000..2020u64 {
        // Refused before any ack once eight carry transfers.
        let (mut sock, answer) = raw_peer::hello(pair.decode.listen, "prefill", session_id);
        match answer {
            Some(Body::HelloAck(_)) => {}
            Some(Body::Abort(a)) if a.transfer_id == 0 => {
                assert_eq!(a.code, ErrorCode::TooManySessions as i32, "{a:?}");
                refused = Some((session_id, a.message));
                break;
            }
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
        // A refused session may be closed already: its answer is read below.
        let _ = sock.write_all(&wire::encode_control(&wire::message(Body::PushOpen(push))));
        // A refused session is told at once; an accepted one stays silent.
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        match read_control(&mut sock) {
            Some(Body::Abort(a)) if a.transfer_id == 0 => {
                refused = Some((session_id, a.message));
                break;
            }
            // Silence (the read timed out on an open connection): the
            // transfer waits for its bytes.
            None if still_open(&sock) => held.push((session_id, sock)),
            None => panic!(
                "session {session_id}: no answer, and the connection is closed or holds something unreadable; decode's log ends:\n{}",
                pair.decode.log_tail(30)
            ),
            // Anything else (the transfer refused, say) would leave the
            // session idle, and an idle session gives way to the next one.
            Some(other) => panic!("session {session_id}: answered {other:?}"),
        }
    }
    let (at, why) = refused.expect("sessions carrying transfers were never capped");
    assert!(why.contains("sessions"), "{why}");
    // A held session that was closed or answered after its wait was not
    // held when the next one came: name it.
    let late: Vec<u64> = held
        .iter()
        .filter(|(_, sock)| !still_open(sock))
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(held.len(), 8, "refused at session {at}");
    assert!(
        late.is_empty(),
        "held sessions closed or answered since: {late:?}"
    );
    assert!(d.list_peers().await.is_ok(), "the daemon answers");
    kv.unlink();
}

/// Whether `sock` is open with nothing to read (no answer, no close).
fn still_open(sock: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let _ = sock.set_nonblocking(true);
    let mut reader = sock;
    let open =
        matches!(reader.read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    let _ = sock.set_nonblocking(false);
    open
}

/// A hello carrying a copy of a peer's certificate (public: anyone who saw a
/// handshake has it) and then no proof holds a handshake slot until the
/// handshake's deadline (5 s). With every slot held that way, a real peer
/// that dials again as peers do is answered well before then: the oldest
/// stalled handshake makes room once it has run for 250 ms (younger ones are
/// not pushed out, so a burst of real handshakes finishes).
#[tokio::test(flavor = "multi_thread")]
async fn handshakes_stalled_after_the_hello_do_not_lock_peers_out() {
    use kvrail_auth::generate::{self, Validity};
    use kvrail_auth::{Identity, IdentityFiles};
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    let pair = Pair::start(&["--tls-dir", certs.path().to_str().unwrap()]);
    let _ = pair.decode.client().await;
    let addr = pair.decode.listen;
    let prefill =
        Identity::load("prefill", &IdentityFiles::in_dir(certs.path(), "prefill")).unwrap();
    let hello = |session_id| pb::Hello {
        certificate: prefill.certificate().to_vec(),
        nonce: vec![7; kvrail_core::handshake::NONCE_BYTES],
        ..raw_peer::hello_message("prefill", session_id)
    };
    let connect = || raw_peer::connect(addr);
    // Every slot held by a hello the acceptor answered and now awaits the
    // proof of, which never comes.
    let first_stalled = Instant::now();
    let mut stalled: Vec<TcpStream> = (0..64u64)
        .map(|i| match raw_peer::hello_as(connect(), hello(1000 + i)) {
            (s, Some(Body::HelloAck(_))) => s,
            (_, other) => panic!("stalled hello {i}: {other:?}"),
        })
        .collect();
    let stalled_since = Instant::now();
    let young = stalled_since.duration_since(first_stalled) < Duration::from_millis(200);
    let mut refused = 0;
    let _peer = loop {
        match raw_peer::hello_as(connect(), hello(1)) {
            (sock, Some(Body::HelloAck(_))) => break sock,
            (_, None) => {
                // Closed at once: every slot is young yet. Dial again.
                refused += 1;
                assert!(
                    stalled_since.elapsed() < Duration::from_secs(4),
                    "the stalled handshakes kept a peer out"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            (_, other) => panic!("a peer's hello got {other:?}"),
        }
    };
    // Handshakes under 250 ms old are not pushed out (a burst of real ones
    // finishes): a dial while all were young was closed instead.
    if young {
        assert!(refused >= 1, "a young handshake was pushed out");
    }
    // The oldest stalled handshake made room: its connection is closed.
    let mut b = [0u8; 1];
    let read = stalled[0].read(&mut b);
    assert!(
        match &read {
            Ok(n) => *n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        },
        "the oldest stalled handshake is still open: {read:?}"
    );
    let text = kvrail_e2e::scrape(pair.decode.metrics.unwrap());
    assert!(
        kvrail_e2e::metric_sum(
            &text,
            "kvrail_handshakes_refused_total",
            &["stalled_evicted"]
        ) >= 1.0
    );
    drop(stalled);
}

/// A peer that sends a slice's header and half its payload, then goes silent
/// with its connection open (a partition without a reset looks the same to
/// the reader): the slice used to count as being placed for ever, so its
/// transfer never ended and the region stayed in use. The reader now waits
/// for the rest for the progress timeout, then cuts the connection; the
/// transfer fails and the region can be unregistered.
#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_stops_mid_payload_is_cut_and_its_transfer_ends() {
    let pair = Pair::start(&["--progress-timeout-ms", "1000"]);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 4, 4096);
    let kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let region = d.register_region("d0", &kv, false).await.unwrap();
    let mut sock = raw_peer::session(pair.decode.listen, 5);
    let open = pb::PushOpen {
        transfer_id: 1,
        request_id: "stalls".into(),
        destination: Some(pb::BlockSet {
            region_id: region,
            layer_start: 0,
            layer_count: 1,
            block_ids: vec![0, 1],
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
    sock.write_all(&wire::encode_data_header(
        wire::SliceHeader {
            transfer_id: 1,
            offset: 0,
        },
        8192,
    ))
    .unwrap();
    sock.write_all(&[0xAB; 4096]).unwrap();
    let started = Instant::now();
    // The daemon ends the connection: past whatever it says first (an
    // abort), our read meets the end.
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "the connection was not cut ({e}) after {:?}: {}",
                started.elapsed(),
                pair.decode.log_tail(20)
            ),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "cut after {:?}",
        started.elapsed()
    );
    assert!(
        pair.decode.log().contains("not all of its payload"),
        "{}",
        pair.decode.log_tail(20)
    );
    // The transfer ended with it: the region is free again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match d.unregister_region(region).await {
            Ok(()) => break,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the region stayed in use: {e}; {}",
                    pair.decode.log_tail(20)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Nothing outside the two blocks was written; the next bytes of block 0
    // were never sent.
    let mut rest = vec![0xFFu8; 8192];
    kv.memory.read_at(8192, &mut rest).unwrap();
    assert!(rest.iter().all(|&b| b == 0), "bytes outside the slice");
    assert!(d.list_peers().await.is_ok(), "the daemon answers");
    kv.unlink();
}

/// As above with queue-pair requests: each is declined on the connection it
/// came on (this sidecar has no RDMA, and the rail is wrong anyway), and
/// those answers bypassed the bound on unwritten frames, so a peer that
/// never read them grew the daemon's memory without end. The connection is
/// cut, and the declines are not logged one line each.
#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_never_reads_its_queue_pair_answers_is_cut() {
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let before = rss(pair.decode.pid());
    let mut sock = raw_peer::session(pair.decode.listen, 78);
    let ask = wire::encode_control(&wire::message(Body::RdmaConnect(pb::RdmaConnect {
        rail_index: 5,
        nonce: u64::MAX,
        qps: Vec::new(),
        attempt: 1,
    })));
    let sent = flood_until_cut(&mut sock, &ask, "requests");
    let grew = rss(pair.decode.pid()).saturating_sub(before);
    assert!(grew < 256 << 20, "grew by {} MiB", grew >> 20);
    let log = pair.decode.log();
    assert!(
        log.contains("does not read"),
        "{}",
        pair.decode.log_tail(10)
    );
    let declines = log.matches("declined RDMA queue pairs").count();
    assert!(
        declines < 1000,
        "{declines} decline lines for {sent} requests"
    );
    assert!(d.list_peers().await.is_ok(), "the daemon answers");
}
