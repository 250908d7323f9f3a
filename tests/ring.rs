//! Worker rings (#23) against real sidecars: pushes and pulls through the
//! shared-memory ring land and are answered in the completion queues; a
//! corrupt slot, an overrun, a truncated ring file, a worker killed while it
//! submits and a sidecar restarted under a live ring each get a clear answer,
//! the daemon keeps serving, and nothing is written outside the named blocks.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvrail_client::ring::{CompletionKind as K, RingOptions};
use kvrail_client::{blocks, dense_layout, KvRegion, SharedRegion};
use kvrail_core::ring::{offset, CloseReason, RingGeometry};
use kvrail_e2e::{metric_sum, scrape, Pair};
use kvrail_examples::{fill, verify};
use kvrail_shm::ring::WorkerRing;

const WAIT: Duration = Duration::from_secs(20);

fn opts() -> RingOptions {
    RingOptions {
        sq_entries: 8,
        cq_entries: 16,
        slot_bytes: 1024,
        ..Default::default()
    }
}

/// A ring's completions, each kept until a wait takes it: a fast transfer's
/// PUSH_DONE may be published before its ACCEPTED (docs/ring-format.md), and
/// waiting for the one must not drop the other.
struct Answers<'a> {
    ring: &'a kvrail_client::ring::Ring,
    kept: std::cell::RefCell<Vec<kvrail_client::ring::Completion>>,
}

impl<'a> Answers<'a> {
    fn of(ring: &'a kvrail_client::ring::Ring) -> Self {
        Self {
            ring,
            kept: Default::default(),
        }
    }

    /// The first completion of `request_id` with a kind in `want`, kept or
    /// new; the others stay kept.
    fn wait_for(&self, request_id: &str, want: &[K]) -> kvrail_client::ring::Completion {
        let wanted = |c: &kvrail_client::ring::Completion| {
            c.request_id == request_id && want.contains(&c.kind)
        };
        let mut kept = self.kept.borrow_mut();
        if let Some(i) = kept.iter().position(&wanted) {
            return kept.remove(i);
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "no {want:?} for {request_id} within {WAIT:?} (kept: {kept:?})"
            );
            if let Some(c) = self.ring.wait(left).unwrap() {
                if wanted(&c) {
                    return c;
                }
                kept.push(c);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pushes_and_pulls_through_rings_land_and_are_answered() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, 32, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, true).await.unwrap();
    let dr = d.register_region("d0", &d_kv, true).await.unwrap();
    let p_ring = p.open_ring("p0", opts()).await.unwrap();
    let d_ring = d.open_ring("d0", opts()).await.unwrap();
    let (p_answers, d_answers) = (Answers::of(&p_ring), Answers::of(&d_ring));
    // A second ring taking the same worker's notifications is refused.
    let again = d.open_ring("d0", opts()).await;
    assert_eq!(
        again.err().and_then(|e| e.code()),
        Some(tonic::Code::AlreadyExists)
    );

    fill(&p_kv, 1, 0..4, &[3, 4, 5, 9]).unwrap();
    let ud = p_ring
        .submit_push(
            "push-1",
            "decode",
            &blocks(pr, 0..4, vec![3, 4, 5, 9]),
            &blocks(dr, 0..4, vec![10, 11, 12, 13]),
        )
        .unwrap();
    let accepted = p_answers.wait_for("push-1", &[K::Accepted, K::Rejected]);
    assert_eq!(accepted.kind, K::Accepted, "{accepted:?}");
    assert_eq!(accepted.user_data, ud);
    assert_eq!(accepted.bytes, 4 * 2 * 4 * 4096);
    let got = d_answers.wait_for("push-1", &[K::PushReceived, K::Failed]);
    assert_eq!(got.kind, K::PushReceived, "{got:?}");
    assert_eq!(got.peer, "prefill");
    assert!(got.sequence > 0);
    verify(&d_kv, 1, 0..4, &[10, 11, 12, 13]).unwrap();
    // Nothing outside the named blocks was written.
    for b in (0..32).filter(|b| !(10..14).contains(b)) {
        assert!(d_kv.read_block(0, 0, b).unwrap().iter().all(|&x| x == 0));
    }
    let done = p_answers.wait_for("push-1", &[K::PushDone, K::Failed]);
    assert_eq!(done.kind, K::PushDone, "{done:?}");

    // A pull the other way, started from the decode worker's ring.
    fill(&p_kv, 2, 1..3, &[20, 21]).unwrap();
    d_ring
        .submit_pull(
            "pull-1",
            "prefill",
            &blocks(pr, 1..3, vec![20, 21]),
            &blocks(dr, 1..3, vec![0, 1]),
        )
        .unwrap();
    let done = d_answers.wait_for("pull-1", &[K::PullDone, K::Failed, K::Rejected]);
    assert_eq!(done.kind, K::PullDone, "{done:?}");
    verify(&d_kv, 2, 1..3, &[0, 1]).unwrap();
    let served = p_answers.wait_for("pull-1", &[K::PullServed]);
    assert_eq!(served.peer, "decode");

    // Refusals name what is wrong, and the ring goes on serving.
    p_ring
        .submit_push(
            "to-nobody",
            "nobody",
            &blocks(pr, 0..1, vec![0]),
            &blocks(dr, 0..1, vec![0]),
        )
        .unwrap();
    let r = p_answers.wait_for("to-nobody", &[K::Rejected, K::Accepted]);
    assert_eq!(
        (r.kind, r.code.as_str()),
        (K::Rejected, "not_found"),
        "{r:?}"
    );
    p_ring
        .submit_push(
            "out-of-range",
            "decode",
            &blocks(pr, 0..1, vec![32]),
            &blocks(dr, 0..1, vec![0]),
        )
        .unwrap();
    let r = p_answers.wait_for("out-of-range", &[K::Rejected, K::Accepted]);
    assert_eq!(r.code, "invalid_argument", "{r:?}");
    // More block runs than a slot holds: refused before anything is written.
    let scattered: Vec<u32> = (0..32).step_by(2).collect();
    let many = p_ring.submit_push(
        "too-large",
        "decode",
        &blocks(
            pr,
            0..4,
            scattered.iter().cycle().take(200).copied().collect(),
        ),
        &blocks(
            dr,
            0..4,
            scattered.iter().cycle().take(200).copied().collect(),
        ),
    );
    assert!(
        matches!(many, Err(kvrail_client::ring::RingSubmitError::TooLarge(_))),
        "{many:?}"
    );
    // Flooding without reading: the submission queue says it is full.
    let mut full = false;
    for i in 0..64 {
        match p_ring.submit_push(
            &format!("flood-{i}"),
            "nobody",
            &blocks(pr, 0..1, vec![0]),
            &blocks(dr, 0..1, vec![0]),
        ) {
            Ok(_) => {}
            Err(kvrail_client::ring::RingSubmitError::Full) => {
                full = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let _ = full; // The sidecar may keep up with the flood; either way it answers each.
    p_ring
        .submit_push(
            "after-flood",
            "decode",
            &blocks(pr, 0..1, vec![3]),
            &blocks(dr, 0..1, vec![20]),
        )
        .unwrap_or_else(|_| {
            // Full: read answers, then submit again.
            while p_ring.poll().unwrap().is_some() {}
            std::thread::sleep(Duration::from_millis(50));
            while p_ring.poll().unwrap().is_some() {}
            p_ring
                .submit_push(
                    "after-flood",
                    "decode",
                    &blocks(pr, 0..1, vec![3]),
                    &blocks(dr, 0..1, vec![20]),
                )
                .unwrap()
        });
    let r = p_answers.wait_for("after-flood", &[K::PushDone, K::Failed]);
    assert_eq!(r.kind, K::PushDone, "{r:?}");
    p_kv.unlink();
    d_kv.unlink();
}

/// A ring file laid out by hand and served through the low-level call, so the
/// test can scribble on it as a broken or hostile worker would.
struct HandRing {
    ring: WorkerRing,
    scribble: SharedRegion,
    events: tonic::Streaming<kvrail_client::proto::RingEvent>,
}

async fn hand_ring(
    client: &mut kvrail_client::Client,
    pair: &Pair,
    name: &str,
    worker: &str,
) -> HandRing {
    let path = pair.shm_path(name);
    let ring = WorkerRing::create(&path, RingGeometry::new(4, 8, 1024).unwrap()).unwrap();
    let scribble = SharedRegion::open(&path).unwrap();
    let mut events = client.open_ring_file(worker, &path, false).await.unwrap();
    let first = events.message().await.unwrap().unwrap();
    assert_eq!(first.version, 1);
    ring.unlink();
    HandRing {
        ring,
        scribble,
        events,
    }
}

async fn ring_call_ends(events: &mut tonic::Streaming<kvrail_client::proto::RingEvent>) -> String {
    match tokio::time::timeout(WAIT, events.message()).await {
        Ok(Err(status)) => status.message().to_string(),
        other => panic!("the ring's call should end with a status: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_overrun_and_truncated_rings_are_closed_with_their_reason() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 8, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    let g = RingGeometry::new(4, 8, 1024).unwrap();

    // A corrupt slot: rejected with its user data, and the ring serves on.
    let mut h = hand_ring(&mut p, &pair, "ring-corrupt", "p0").await;
    let sub = |user_data: u64, request: &str| kvrail_core::ring::Submission {
        op: kvrail_core::ring::RingOp::Push,
        user_data,
        peer: "decode".into(),
        request_id: request.into(),
        source: kvrail_core::ring::RingBlocks::from_ids(pr, 0..1, &[1], vec![]),
        destination: kvrail_core::ring::RingBlocks::from_ids(dr, 0..1, &[2], vec![]),
    };
    // Published, then torn: the op byte and a run count overwritten.
    let mut slot = vec![0u8; 1024];
    sub(77, "torn").encode(&mut slot).unwrap();
    slot[0] = 0xee;
    slot[4] = 0xff;
    h.scribble.write_at(g.sq_slot_offset(0), &slot).unwrap();
    h.scribble
        .atomic_u64(offset::SQ_TAIL)
        .unwrap()
        .store(1, std::sync::atomic::Ordering::SeqCst);
    // The worker's own view of the tail moves with a real submission next.
    let c = h.ring.wait(Duration::ZERO, WAIT).unwrap().unwrap();
    assert_eq!(c.kind, K::Rejected);
    assert_eq!(
        (c.user_data, c.code.as_str()),
        (77, "bad_descriptor"),
        "{c:?}"
    );
    assert!(d_kv.read_block(0, 0, 2).unwrap().iter().all(|&x| x == 0));

    // An overrun: the tail moved far past what the ring holds.
    h.scribble
        .atomic_u64(offset::SQ_TAIL)
        .unwrap()
        .store(1000, std::sync::atomic::Ordering::SeqCst);
    // Wake the sidecar as a submission would.
    let bell = h.scribble.atomic_u32(offset::SIDECAR_BELL).unwrap();
    bell.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    kvrail_shm::futex::wake(bell);
    let why = ring_call_ends(&mut h.events).await;
    assert!(why.contains("overrun"), "{why}");
    assert_eq!(
        h.ring.closed().as_deref(),
        Some(CloseReason::SubmissionOverrun.to_string().as_str())
    );

    // A ring file truncated under the sidecar's mapping.
    let mut t = hand_ring(&mut p, &pair, "ring-truncate", "p0").await;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", fd_of(&t.scribble)))
        .ok();
    // The scribble mapping's file: shrink it through /proc (the name is gone).
    if let Some(f) = file {
        f.set_len(4096).unwrap();
    }
    let why = ring_call_ends(&mut t.events).await;
    assert!(why.contains("truncated"), "{why}");

    // A worker id with a NUL is served like any other (it once named the
    // ring's thread, which panicked), and one worker's rings are capped.
    let odd = p.open_ring("\0odd", opts()).await.unwrap();
    drop(odd);
    let quiet = RingOptions {
        notifications: false,
        ..opts()
    };
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(p.open_ring("greedy", quiet).await.unwrap());
    }
    let ninth = p.open_ring("greedy", quiet).await;
    assert_eq!(
        ninth.err().and_then(|e| e.code()),
        Some(tonic::Code::ResourceExhausted)
    );
    drop(held);

    // Through all of it the daemon serves: a fresh ring pushes.
    let ring = p.open_ring("p1", opts()).await.unwrap();
    let answers = Answers::of(&ring);
    fill(&p_kv, 5, 0..1, &[1]).unwrap();
    ring.submit_push(
        "good",
        "decode",
        &blocks(pr, 0..1, vec![1]),
        &blocks(dr, 0..1, vec![2]),
    )
    .unwrap();
    let done = answers.wait_for("good", &[K::PushDone, K::Failed, K::Rejected]);
    assert_eq!(done.kind, K::PushDone, "{done:?}");
    verify(&d_kv, 5, 0..1, &[2]).unwrap();
    p_kv.unlink();
    d_kv.unlink();
}

/// The descriptor of a mapping's file, found through /proc/self/maps.
fn fd_of(region: &SharedRegion) -> i32 {
    let want = region.as_mut_ptr() as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps
        .lines()
        .find(|l| {
            l.split('-')
                .next()
                .and_then(|a| usize::from_str_radix(a, 16).ok())
                == Some(want)
        })
        .unwrap();
    let inode: u64 = line.split_whitespace().nth(4).unwrap().parse().unwrap();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        if let Ok(meta) = std::fs::metadata(entry.path()) {
            use std::os::unix::fs::MetadataExt;
            if meta.ino() == inode {
                return entry.file_name().to_str().unwrap().parse().unwrap();
            }
        }
    }
    panic!("no descriptor for the ring file");
}

/// Run as a child process by the next test: opens a ring and submits until
/// it is killed. Does nothing when run by the test harness itself.
#[tokio::test(flavor = "multi_thread")]
async fn ring_worker_child() {
    let Ok(socket) = std::env::var("KVRAIL_RING_CHILD_SOCKET") else {
        return;
    };
    let region: u64 = std::env::var("KVRAIL_RING_CHILD_REGION")
        .unwrap()
        .parse()
        .unwrap();
    let mut client = kvrail_client::Client::connect(socket).await.unwrap();
    let ring = client.open_ring("child", opts()).await.unwrap();
    println!("RING-OPEN");
    for i in 0u64.. {
        let _ = ring.submit_push(
            &format!("child-{i}"),
            "decode",
            &blocks(region, 0..1, vec![(i % 8) as u32]),
            &blocks(region, 0..1, vec![(i % 8) as u32]),
        );
        while ring.poll().ok().flatten().is_some() {}
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_while_submitting_and_a_restarted_sidecar_leave_clear_state() {
    let mut pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let layout = dense_layout(1, 1, 8, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let pr = p.register_region("child", &p_kv, false).await.unwrap();

    // A worker process killed with SIGKILL in the middle of its submissions.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ring_worker_child", "--nocapture"])
        .env("KVRAIL_RING_CHILD_SOCKET", &pair.prefill.socket)
        .env("KVRAIL_RING_CHILD_REGION", pr.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let opened = lines.any(|l| l.map(|l| l.contains("RING-OPEN")).unwrap_or(false));
        assert!(opened, "the child never opened its ring");
    }
    std::thread::sleep(Duration::from_millis(200)); // let it submit for a while
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        pair.prefill.is_running(),
        "the sidecar died with its worker"
    );
    // The dead worker's ring was closed and its notification sink released:
    // a new ring for the same worker id takes its notifications.
    let deadline = Instant::now() + WAIT;
    let ring = loop {
        match p.open_ring("child", opts()).await {
            Ok(r) => break r,
            Err(e) if e.code() == Some(tonic::Code::AlreadyExists) => {
                assert!(
                    Instant::now() < deadline,
                    "the dead worker's ring is still served"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };

    // The sidecar restarted under the live ring: the worker is told at once.
    pair.prefill.kill();
    let deadline = Instant::now() + WAIT;
    while ring.closed().is_none() {
        assert!(
            Instant::now() < deadline,
            "the worker was not told its sidecar is gone"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        ring.closed().as_deref(),
        Some(CloseReason::SidecarGone.to_string().as_str())
    );
    let r = ring.submit_push(
        "after-restart",
        "decode",
        &blocks(pr, 0..1, vec![0]),
        &blocks(pr, 0..1, vec![0]),
    );
    assert!(
        matches!(r, Err(kvrail_client::ring::RingSubmitError::Closed(_))),
        "{r:?}"
    );
    // What was published before the sidecar died is still read (the killed
    // child's transfers end with notifications to worker "child", which this
    // ring took over), then the wait says the ring is closed.
    let mut drained = 0;
    loop {
        match ring.wait(Duration::from_secs(1)) {
            Err(_) => break,
            Ok(Some(c)) => {
                assert!(c.request_id.starts_with("child-"), "{c:?}");
                drained += 1;
                assert!(drained <= 16, "more completions than the ring holds");
            }
            Ok(None) => panic!("a wait on a closed ring timed out instead of failing"),
        }
    }
    pair.prefill.restart();
    let mut p2 = pair.prefill.client().await;
    let fresh = p2.open_ring("child", opts()).await.unwrap();
    assert!(fresh.closed().is_none());
    p_kv.unlink();
}

/// `Client::push` and `Client::pull` go through the worker's ring by default
/// (the sidecar counts ring submissions), answer exactly as gRPC does (the
/// transfer's id and size; a refusal's gRPC code), fall back to gRPC for what
/// a slot cannot hold, and `SubmitPath::Grpc` keeps them off the ring.
#[tokio::test(flavor = "multi_thread")]
async fn client_transfers_use_the_ring_by_default_with_grpc_answers() {
    use kvrail_client::SubmitPath;
    use kvrail_e2e::{metric_sum, scrape};
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, 32, 4096);
    let p_kv = KvRegion::create(pair.shm_path("dp"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("dd"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, true).await.unwrap();
    let dr = d.register_region("d0", &d_kv, true).await.unwrap();
    let metrics = pair.prefill.metrics.unwrap();
    let through_ring = |outcome: &str| {
        metric_sum(
            &scrape(metrics),
            "kvrail_ring_submissions_total",
            &[&format!("outcome=\"{outcome}\"")],
        )
    };

    let src: Vec<u32> = vec![3, 4, 5, 9];
    let dst: Vec<u32> = vec![10, 11, 12, 20];
    fill(&p_kv, 7, 0..4, &src).unwrap();
    let t = p
        .push(
            "p0",
            "ring-default-push",
            "decode",
            blocks(pr, 0..4, src.clone()),
            blocks(dr, 0..4, dst.clone()),
        )
        .await
        .unwrap();
    assert_eq!(t.total_bytes, 4 * 2 * 4 * 4096);
    assert_eq!(
        t.segments,
        4 * 2 * 2,
        "runs 3..6 and 9, per layer and plane"
    );
    let st = p.wait(t.transfer_id, Some(WAIT)).await.unwrap();
    assert_eq!(st.request_id, "ring-default-push");
    assert_eq!(verify(&d_kv, 7, 0..4, &dst).unwrap(), 4 * 2 * 4 * 4096);
    assert_eq!(through_ring("accepted"), 1.0);

    // A pull, through the same ring.
    let back: Vec<u32> = vec![0, 1];
    let t = p
        .pull(
            "p0",
            "ring-default-pull",
            "decode",
            blocks(dr, 0..4, vec![10, 11]),
            blocks(pr, 0..4, back.clone()),
        )
        .await
        .unwrap();
    p.wait(t.transfer_id, Some(WAIT)).await.unwrap();
    assert_eq!(verify(&p_kv, 7, 0..4, &back).unwrap(), 4 * 2 * 2 * 4096);
    assert_eq!(through_ring("accepted"), 2.0);

    // Refusals carry gRPC's codes: an unknown peer, blocks out of range, a
    // request id already in flight.
    let e = p
        .push(
            "p0",
            "ring-unknown-peer",
            "nobody",
            blocks(pr, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
    let e = p
        .push(
            "p0",
            "ring-out-of-range",
            "decode",
            blocks(pr, 0..1, vec![32]),
            blocks(dr, 0..1, vec![0]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    assert!(through_ring("rejected") >= 1.0);

    // Too many block runs for a slot (every other block of 32, 4 KiB slots
    // hold them, so use a request id no slot takes): gRPC carries it.
    let long_id = "x".repeat(200);
    let before = through_ring("accepted");
    let t = p
        .push(
            "p0",
            &long_id,
            "decode",
            blocks(pr, 0..1, vec![1]),
            blocks(dr, 0..1, vec![1]),
        )
        .await
        .unwrap();
    p.wait(t.transfer_id, Some(WAIT)).await.unwrap();
    assert_eq!(
        through_ring("accepted"),
        before,
        "a 200-byte request id cannot be a ring slot"
    );

    // gRPC on request.
    let mut g = pair
        .prefill
        .client()
        .await
        .with_submit_path(SubmitPath::Grpc);
    let before = through_ring("accepted");
    let t = g
        .push(
            "p0",
            "grpc-push",
            "decode",
            blocks(pr, 0..1, vec![2]),
            blocks(dr, 0..1, vec![2]),
        )
        .await
        .unwrap();
    g.wait(t.transfer_id, Some(WAIT)).await.unwrap();
    assert_eq!(through_ring("accepted"), before);
    p_kv.unlink();
    d_kv.unlink();
}

/// Small ring pushes go out from the ring's thread itself when the
/// connection's writer is idle, and through the writer task while a large
/// push keeps it busy; the receiver answers the lone ones inline too. On one
/// shared connection every byte lands where it was meant to, the stream
/// never breaks, and the inline paths were taken. Readers spin for their
/// next frame on 16-core machines (`reader_spin_us`), not on 2-core ones:
/// both ways here.
#[tokio::test(flavor = "multi_thread")]
async fn inline_small_pushes_and_a_large_push_share_one_connection_intact() {
    small_and_large_pushes_on_one_connection(&pair_with(&["--reader-spin-us", "0"]), "0").await;
}

/// As above with readers polling their sockets for the next frame: it lands
/// the same, and the spin found frames.
#[tokio::test(flavor = "multi_thread")]
async fn readers_spinning_for_their_next_frame_lose_nothing() {
    let pair = pair_with(&["--reader-spin-us", "2000"]);
    let (sent, received) = small_and_large_pushes_on_one_connection(&pair, "2000").await;
    let spun = metric_sum(&sent, "kvrail_reader_spin_frames_total", &[])
        + metric_sum(&received, "kvrail_reader_spin_frames_total", &[]);
    assert!(spun >= 1.0, "no reader found a frame by spinning");
}

/// Connections on threads of their own (`connection_threads`, the default
/// with 8 CPUs or more; readers spinning there too; small pushes spread over
/// both connections): the same pushes land the same, every connection of
/// both sidecars has its thread, and the threads end with their connections
/// when the peer dies.
#[tokio::test(flavor = "multi_thread")]
async fn connections_on_threads_of_their_own_lose_nothing_and_end_with_their_peer() {
    let mut pair = pair_with(&[
        "--connection-threads",
        "true",
        "--reader-spin-us",
        "2000",
        "--connections-per-rail",
        "2",
        // The small pushes (two 4 KiB blocks) in a slice per connection.
        "--spread-min-slice-bytes",
        "4096",
    ]);
    let (sent, received) = small_and_large_pushes_on_one_connection(&pair, "2000").await;
    for (sidecar, text) in [(&pair.prefill, &sent), (&pair.decode, &received)] {
        let connections = metric_sum(text, "kvrail_peer_connections", &[]);
        assert!(
            connections >= 2.0,
            "{}: {connections} connections",
            sidecar.node
        );
        assert_eq!(
            kvrail_e2e::threads_named(sidecar.pid(), "kvrail-conn") as f64,
            connections,
            "{}: a thread per connection",
            sidecar.node
        );
    }
    pair.decode.kill();
    let prefill = pair.prefill.pid();
    let deadline = Instant::now() + WAIT;
    while kvrail_e2e::threads_named(prefill, "kvrail-conn") > 0 {
        assert!(
            Instant::now() < deadline,
            "connection threads outlived their peer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two sidecars with one connection per rail unless `extra` names a count.
fn pair_with(extra: &[&str]) -> Pair {
    let mut args = extra.to_vec();
    if !extra.contains(&"--connections-per-rail") {
        args.extend(["--connections-per-rail", "1"]);
    }
    Pair::start(&args)
}

/// The body of the tests above; returns both sidecars' metrics.
async fn small_and_large_pushes_on_one_connection(
    pair: &Pair,
    reader_spin_us: &str,
) -> (String, String) {
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    // 2 layers x 2 planes x 1024 blocks of 4 KiB.
    let layout = dense_layout(2, 2, 1024, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, true).await.unwrap();
    let dr = d.register_region("d0", &d_kv, true).await.unwrap();
    let ring = p
        .open_ring(
            "p0",
            RingOptions {
                sq_entries: 64,
                cq_entries: 256,
                ..opts()
            },
        )
        .await
        .unwrap();
    let big: Vec<u32> = (0..512).collect();
    fill(&p_kv, 100, 0..2, &big).unwrap();
    // Small push i: source block 512 + i to destination block 1023 - i.
    let small = |i: u32| (512 + i, 1023 - i);
    for i in 0..48 {
        let (src, _) = small(i);
        fill(&p_kv, 1000 + u64::from(i), 0..2, &[src]).unwrap();
    }
    let (mut pending, mut done) = (HashSet::new(), HashSet::new());
    // Interleaved with the 8 MiB push, while its slices are on the wire.
    let r = (pr, dr);
    pending.insert(submit_waiting(&ring, r, "big", &big, &big, &mut done));
    for i in 0..40 {
        let (src, dst) = small(i);
        let req = format!("small-{i}");
        pending.insert(submit_waiting(&ring, r, &req, &[src], &[dst], &mut done));
    }
    drain(&ring, &pending, &mut done);
    // One at a time: the writer is idle before each, so these go inline.
    for i in 40..48 {
        let (src, dst) = small(i);
        let req = format!("small-{i}");
        pending.insert(submit_waiting(&ring, r, &req, &[src], &[dst], &mut done));
        drain(&ring, &pending, &mut done);
    }
    verify(&d_kv, 100, 0..2, &big).unwrap();
    for i in 0..48 {
        let (_, dst) = small(i);
        verify(&d_kv, 1000 + u64::from(i), 0..2, &[dst]).unwrap();
    }
    // Nothing outside the named blocks was written.
    for b in 512..(1024 - 48) {
        for layer in 0..2 {
            assert!(d_kv
                .read_block(layer, 0, b)
                .unwrap()
                .iter()
                .all(|&x| x == 0));
        }
    }
    let sent = scrape(pair.prefill.metrics.unwrap());
    let received = scrape(pair.decode.metrics.unwrap());
    assert!(
        metric_sum(&sent, "kvrail_inline_writes_total", &[]) >= 1.0,
        "no push went out inline"
    );
    // The receiver's reader writes its Complete itself when nothing more
    // waits on the connection (the one-at-a-time pushes).
    assert!(
        metric_sum(&received, "kvrail_inline_writes_total", &[]) >= 1.0,
        "no Complete went back inline"
    );
    for text in [&sent, &received] {
        assert_eq!(metric_sum(text, "kvrail_frames_rejected_total", &[]), 0.0);
        assert_eq!(metric_sum(text, "kvrail_connections_lost_total", &[]), 0.0);
    }
    if reader_spin_us == "0" {
        for text in [&sent, &received] {
            assert_eq!(
                metric_sum(text, "kvrail_reader_spin_frames_total", &[]),
                0.0
            );
        }
    }
    p_kv.unlink();
    d_kv.unlink();
    (sent, received)
}

/// Takes one ring answer: a failure fails the test, PUSH_DONE is noted.
fn answer(c: kvrail_client::ring::Completion, done: &mut HashSet<String>) {
    assert!(!matches!(c.kind, K::Failed | K::Rejected), "{c:?}");
    if c.kind == K::PushDone {
        done.insert(c.request_id);
    }
}

/// Submits a push of `src` blocks (layers 0..2) to `dst`, reading answers
/// while the submission queue is full; returns the request id.
fn submit_waiting(
    ring: &kvrail_client::ring::Ring,
    (pr, dr): (u64, u64),
    req: &str,
    src: &[u32],
    dst: &[u32],
    done: &mut HashSet<String>,
) -> String {
    loop {
        match ring.submit_push(
            req,
            "decode",
            &blocks(pr, 0..2, src.to_vec()),
            &blocks(dr, 0..2, dst.to_vec()),
        ) {
            Ok(_) => return req.to_string(),
            Err(kvrail_client::ring::RingSubmitError::Full) => answer(
                ring.wait(WAIT).unwrap().expect("an answer within 20 s"),
                done,
            ),
            Err(e) => panic!("{e}"),
        }
    }
}

/// Reads answers until every push of `pending` is done.
fn drain(ring: &kvrail_client::ring::Ring, pending: &HashSet<String>, done: &mut HashSet<String>) {
    while !pending.is_subset(done) {
        answer(
            ring.wait(WAIT).unwrap().expect("an answer within 20 s"),
            done,
        );
    }
}
