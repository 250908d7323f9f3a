//! Memory a peer or a worker can make a sidecar hold, against a real daemon
//! whose RSS is read from /proc while each attack runs: opens naming a million
//! blocks each (12 MiB held per open, before), opens of millions of one-byte
//! generations (128 MiB decoded each, before), a worker re-subscribing
//! without reading (+64 MB per call, before), ring slots naming a million
//! blocks while the peer is stopped (13 MB per slot, before). The limits are
//! the README's (Security): transfer state `--max-transfer-state-bytes`,
//! notifications 1 GiB retained and 1 GiB queued; these tests run with a
//! small transfer budget so that an attack past it is plain in the RSS.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_core::wire::{self, pb, Body};
use kvrail_e2e::{metric_sum, raw_peer, scrape, Pair};

/// The transfer budget these daemons run with.
const BUDGET: u64 = 128 << 20;
/// What decoding may hold on top, per connection being read: one frame
/// (16 MiB) and the open decoded from it (12 MiB), for the 8 sessions an
/// attacker may hold with one connection each; and the allocator's slack.
const TRANSIENT: u64 = (8 * 28) << 20;

/// The resident memory of process `pid` (0 once it is gone).
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    kb << 10
}

/// Samples `pid`'s RSS until stopped; the peak.
struct PeakRss {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl PeakRss {
    fn watch(pid: u32) -> PeakRss {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                p.fetch_max(rss(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        PeakRss { stop, peak, thread }
    }

    fn peak(self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap();
        self.peak.load(Ordering::Relaxed)
    }
}

fn mib(b: u64) -> u64 {
    b >> 20
}

/// An open naming `blocks` contiguous blocks of `region` (from 0), with
/// generations (`generations` of them, 0: any).
fn open(id: u64, region: u64, blocks: u32, generations: usize) -> Vec<u8> {
    wire::encode_control(&wire::message(Body::PushOpen(pb::PushOpen {
        transfer_id: id,
        request_id: format!("big-{id}"),
        destination: Some(pb::BlockSet {
            region_id: region,
            layer_start: 0,
            layer_count: 1,
            block_ids: (0..blocks).collect(),
            generations: vec![0; generations],
            slice: None,
            first_token: 0,
        }),
        block_bytes: 64,
        total_bytes: 64 * u64::from(blocks),
        one_sided: false,
        geometry: None,
        receiver_group: None,
    })))
}

/// Fills worker d0's mailbox as full as it may be: 200 pushes from p0's
/// region `pr` into d0's `dr` whose notifications name 16384 blocks each.
async fn fill_mailbox(p: &mut kvrail_client::Client, pr: u64, dr: u64) {
    let ids: Vec<u32> = (0..16384).collect();
    let mut started = Vec::new();
    for n in 0..200u32 {
        let t = p
            .push(
                "p0",
                &format!("fill-{n}"),
                "decode",
                blocks(pr, 0..1, ids.clone()),
                blocks(dr, 0..1, ids.clone()),
            )
            .await
            .unwrap();
        started.push(t.transfer_id);
    }
    for id in started {
        p.wait(id, Some(Duration::from_secs(30))).await.unwrap();
    }
}

/// A peer posing as `prefill` (an `--insecure` pair) on 8 sessions sends 40
/// opens each naming a million blocks with their generations (1.3 GB of
/// transfer state, had it been kept): what the daemon holds stays within the
/// budget (the rest are refused, saying why), and once the transfers end it
/// is given back.
#[tokio::test(flavor = "multi_thread")]
async fn opens_naming_a_million_blocks_are_held_within_the_budget() {
    let budget = BUDGET.to_string();
    let pair = Pair::start(&[
        "--max-transfer-state-bytes",
        &budget,
        "--progress-timeout-ms",
        "3000",
    ]);
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 1 << 20, 64);
    let kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let region = d.register_region("d0", &kv, false).await.unwrap();
    let pid = pair.decode.pid();
    let base = rss(pid);
    let watch = PeakRss::watch(pid);
    let mut sessions: Vec<TcpStream> = (0..8u64)
        .map(|s| raw_peer::session(pair.decode.listen, 7000 + s))
        .collect();
    let mut id = 1u64;
    for _ in 0..40 {
        for sock in &mut sessions {
            sock.write_all(&open(id, region, 1 << 20, 1 << 20)).unwrap();
            id += 1;
        }
    }
    // Everything sent has been read once the held state stops growing.
    let metrics = pair.decode.metrics.unwrap();
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let held = metric_sum(&scrape(metrics), "kvrail_held_bytes", &["transfer_state"]) as u64;
        if held == last {
            break;
        }
        last = held;
    }
    let peak = watch.peak();
    println!(
        "{} opens of 2^20 blocks: RSS {} MiB before, peak {} MiB; transfer state held {} MiB (budget {} MiB)",
        id - 1,
        mib(base),
        mib(peak),
        mib(last),
        mib(BUDGET)
    );
    assert!(last <= BUDGET, "{last} bytes held");
    assert!(
        peak <= base + BUDGET + TRANSIENT,
        "RSS peaked at {} MiB (base {} MiB)",
        mib(peak),
        mib(base)
    );
    // The transfers expire (no byte comes): the state is given back.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held = metric_sum(&scrape(metrics), "kvrail_held_bytes", &["transfer_state"]) as u64;
        if held == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{held} bytes still held");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The allocator gives freed memory back within moments.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut after = rss(pid);
    while after > base + BUDGET / 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        after = rss(pid);
        println!("  RSS {} MiB", mib(after));
    }
    println!("after the transfers ended: RSS {} MiB", mib(after));
    assert!(
        after <= base + BUDGET / 2,
        "{} MiB not given back (base {} MiB)",
        mib(after),
        mib(base)
    );
    drop(sessions);
    kv.unlink();
}

/// Opens of millions of one-byte generations (16 MiB frames) are refused
/// before they are decoded: 20 at once used to take 470 MiB.
#[tokio::test(flavor = "multi_thread")]
async fn opens_of_one_byte_generations_are_refused_undecoded() {
    let pair = Pair::start(&[]);
    let _up = pair.decode.client().await;
    let pid = pair.decode.pid();
    let base = rss(pid);
    let watch = PeakRss::watch(pid);
    let frame = open(1, 1, 1, 16_000_000);
    assert!(frame.len() < 16 << 20);
    let mut socks: Vec<TcpStream> = (0..8u64)
        .map(|s| raw_peer::session(pair.decode.listen, 8000 + s))
        .collect();
    for _ in 0..3 {
        for s in &mut socks {
            // The daemon cuts the connection at the first: later writes fail.
            let _ = s.write_all(&frame);
        }
    }
    drop(socks);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let peak = watch.peak();
    println!(
        "24 opens of 16M one-byte generations: RSS {} MiB before, peak {} MiB",
        mib(base),
        mib(peak)
    );
    assert!(
        peak <= base + 8 * (16 << 20) + (64 << 20),
        "RSS peaked at {} MiB (base {} MiB)",
        mib(peak),
        mib(base)
    );
    assert!(
        pair.decode.log().contains("generations"),
        "{}",
        pair.decode.log_tail(10)
    );
}

/// A worker re-subscribing with `take_over` and never reading each
/// superseded stream: each call used to copy its mailbox (~64 MB) into a new
/// queue that stayed; now a superseded stream is emptied at once.
#[tokio::test(flavor = "multi_thread")]
async fn re_subscribing_without_reading_holds_one_backlog() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 16384, 64);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    // Fill d0's mailbox: pushes whose notifications name 16384 blocks each.
    let _first = d.subscribe("d0").await.unwrap();
    fill_mailbox(&mut p, pr, dr).await;
    let pid = pair.decode.pid();
    let metrics = pair.decode.metrics.unwrap();
    let base = rss(pid);
    let mut streams = Vec::new();
    for _ in 0..50 {
        // Every notification retained, handed again to each new stream.
        streams.push(d.subscribe_after("d0", 1, true).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let text = scrape(metrics);
    let queued = metric_sum(&text, "kvrail_held_bytes", &["notifications_queued"]) as u64;
    let retained = metric_sum(&text, "kvrail_held_bytes", &["notifications_retained"]) as u64;
    let after = rss(pid);
    println!(
        "50 take-overs unread: {} KiB queued for {} KiB retained; RSS {} -> {} MiB",
        queued >> 10,
        retained >> 10,
        mib(base),
        mib(after)
    );
    assert!(
        queued <= retained,
        "{queued} queued for {retained} retained"
    );
    assert!(
        after <= base + (32 << 20),
        "RSS grew {} MiB",
        mib(after - base.min(after))
    );
    drop(streams);
    p_kv.unlink();
    d_kv.unlink();
}

/// While the peer is stopped, a worker's ring submissions each naming a
/// million blocks (one run in a 4 KiB slot) are accepted until the budget is
/// reached and refused after (each held 13 MB, before: 2.4 GB for 183).
#[tokio::test(flavor = "multi_thread")]
async fn ring_slots_naming_a_million_blocks_are_held_within_the_budget() {
    use kvrail_client::ring::RingOptions;
    use kvrail_core::ring::CompletionKind as K;
    let budget = BUDGET.to_string();
    // The stopped peer's rails stay "up" (not failed over) for the test.
    let pair = Pair::start(&[
        "--max-transfer-state-bytes",
        &budget,
        "--progress-timeout-ms",
        "120000",
        "--rail-stall-ms",
        "60000",
        "--rail-deadline-ms",
        "600000",
    ]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 1 << 20, 64);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    // The session exists; then the peer stops.
    let t = p
        .push(
            "p0",
            "warm",
            "decode",
            blocks(pr, 0..1, vec![0]),
            blocks(dr, 0..1, vec![0]),
        )
        .await
        .unwrap();
    p.wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    pair.decode.signal("STOP");
    let ring = p
        .open_ring(
            "p0",
            RingOptions {
                notifications: false,
                ..RingOptions::default()
            },
        )
        .await
        .unwrap();
    let pid = pair.prefill.pid();
    let base = rss(pid);
    let watch = PeakRss::watch(pid);
    let all: Vec<u32> = (0..1 << 20).collect();
    let (mut accepted, mut refused) = (0, 0);
    for n in 0..200 {
        ring.submit_push(
            &format!("big-{n}"),
            "decode",
            &blocks(pr, 0..1, all.clone()),
            &blocks(dr, 0..1, all.clone()),
        )
        .unwrap();
        loop {
            let c = ring
                .wait(Duration::from_secs(30))
                .unwrap()
                .expect("an answer");
            match c.kind {
                K::Accepted => accepted += 1,
                K::Rejected => {
                    assert!(c.message.contains("at most"), "{}", c.message);
                    refused += 1;
                }
                _ => continue,
            }
            break;
        }
    }
    let peak = watch.peak();
    pair.decode.signal("CONT");
    println!(
        "200 ring pushes of 2^20 blocks to a stopped peer: {accepted} accepted, {refused} refused; RSS {} MiB before, peak {} MiB",
        mib(base),
        mib(peak)
    );
    assert!(refused > 0 && accepted > 0);
    assert!(
        peak <= base + BUDGET + (64 << 20),
        "RSS peaked at {} MiB (base {} MiB)",
        mib(peak),
        mib(base)
    );
    p_kv.unlink();
    d_kv.unlink();
}

/// The bounds of the README's Memory table, summed: a peer flooding opens
/// that name a million blocks on 7 sessions while a worker with a full
/// mailbox takes its stream over 50 times without reading. Each kind of held
/// memory stays within its bound, and the daemon's RSS within the sum of the
/// bounds that apply (transfer budget, one stream's queue, decoding).
#[tokio::test(flavor = "multi_thread")]
async fn every_attack_at_once_stays_within_the_sum_of_the_bounds() {
    let budget = BUDGET.to_string();
    let pair = Pair::start(&[
        "--max-transfer-state-bytes",
        &budget,
        "--progress-timeout-ms",
        "3000",
    ]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 1 << 20, 64);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    // A mailbox as full as it may be: pushes whose notifications name 16384
    // blocks each.
    let _first = d.subscribe("d0").await.unwrap();
    fill_mailbox(&mut p, pr, dr).await;
    let pid = pair.decode.pid();
    let metrics = pair.decode.metrics.unwrap();
    let base = rss(pid);
    let watch = PeakRss::watch(pid);
    let listen = pair.decode.listen;
    let flood = std::thread::spawn(move || {
        let mut sessions: Vec<TcpStream> = (0..7u64)
            .map(|s| raw_peer::session(listen, 9000 + s))
            .collect();
        let mut id = 1u64;
        for _ in 0..40 {
            for sock in &mut sessions {
                // A refused open may close the session: later writes fail.
                let _ = sock.write_all(&open(id, dr, 1 << 20, 1 << 20));
                id += 1;
            }
        }
        sessions
    });
    let mut streams = Vec::new();
    for _ in 0..50 {
        streams.push(d.subscribe_after("d0", 1, true).await.unwrap());
    }
    let sessions = flood.join().unwrap();
    // Everything sent has been read once the held state stops changing.
    let kinds = [
        "transfer_state",
        "notifications_retained",
        "notifications_queued",
    ];
    let held_now = || {
        let text = scrape(metrics);
        kinds.map(|k| metric_sum(&text, "kvrail_held_bytes", &[k]) as u64)
    };
    // Sampled as the gauges move (once a second) until they stop: the most
    // each kind held.
    let (mut last, mut most) = ([u64::MAX; 3], [0u64; 3]);
    loop {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let held = held_now();
        for (m, h) in most.iter_mut().zip(held) {
            *m = (*m).max(h);
        }
        if held == last {
            break;
        }
        last = held;
    }
    let peak = watch.peak();
    // The bounds (README, Security: Memory) for one peer and one worker.
    let bounds = [
        BUDGET,
        64 << 20,  // notifications retained, per worker
        128 << 20, // queued on the one live stream (superseded ones emptied)
    ];
    for ((kind, held), bound) in kinds.iter().zip(most).zip(bounds) {
        println!(
            "{kind:>24}: at most {:>4} MiB held, bound {:>4} MiB",
            mib(held),
            mib(bound)
        );
        assert!(held <= bound, "{kind}: {held} bytes held, bound {bound}");
    }
    let sum: u64 = bounds.iter().sum::<u64>() + TRANSIENT;
    println!(
        "RSS {} MiB before (mailbox full), peak {} MiB; the bounds summed with decoding: {} MiB",
        mib(base),
        mib(peak),
        mib(sum)
    );
    assert!(most.iter().sum::<u64>() <= bounds.iter().sum::<u64>());
    assert!(
        peak <= base + sum,
        "RSS peaked at {} MiB (base {} MiB, bounds {} MiB)",
        mib(peak),
        mib(base),
        mib(sum)
    );
    drop(streams);
    drop(sessions);
    p_kv.unlink();
    d_kv.unlink();
}
