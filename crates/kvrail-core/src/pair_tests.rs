//! Two sessions joined in memory, driven deterministically (seeded interleaving,
//! simulated clock): the behaviour of the protocol without any socket.

use std::time::{Duration, Instant};

use crate::error::{FailureSide, TransferError};
use crate::layout::RegionLayout;
use crate::placement::{Admission, Admitted, ConnPlacer};
use crate::plan::BlockSelection;
use crate::rail::{RailConfig, RailHealth};
use crate::session::*;
use crate::testkit::net::{LinkKind, Net, RailSpec};
use crate::testkit::{deliver, sel, Item};
use crate::wire::{ErrorCode, SliceHeader};

thread_local! {
    /// Whether pairs made on this thread place slices through gates.
    static THROUGH_GATES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a test once with slices placed by the session, once through gates.
fn each_placement(test: fn()) {
    for gates in [false, true] {
        THROUGH_GATES.with(|g| g.set(gates));
        test();
    }
    THROUGH_GATES.with(|g| g.set(false));
}

/// Two endpoints on the shared simulated net: connections alternate between
/// two rails, items arrive in a seeded random order across connections (in
/// order on each), and the clock moves only as items arrive.
type Pair = Net;

/// A pair with `conns` connections, their ids the same on both sides.
fn pair(conns: usize, config: SessionConfig, seed: u64) -> Pair {
    let specs = [RailSpec::shuffling(); 2];
    let mut net = Net::new([config.clone(), config], &specs, seed);
    if THROUGH_GATES.with(|g| g.get()) {
        net.place_through_gates();
    }
    for c in 0..conns {
        let link = net.connect((c % 2) as u32, LinkKind::Stream);
        assert_eq!(net.links[link].ids, [link, link]);
    }
    net
}

/// What the pair tests do on the net.
trait PairExt {
    fn reconnect(&mut self);
    fn add_region(&mut self, side: usize, id: u64, layout: RegionLayout, fill: bool, exposed: bool);
    fn local(
        &mut self,
        side: usize,
        local: BlockSelection,
        remote: BlockSelection,
    ) -> LocalTransfer;
    fn push(&mut self, local: BlockSelection, remote: BlockSelection) -> u64;
    fn pull(&mut self, local: BlockSelection, remote: BlockSelection) -> u64;
    fn take_open(&mut self) -> crate::wire::Body;
    fn cut(&mut self, conn: usize);
    fn block(&self, side: usize, region: u64, layer: u32, plane: u32, block: u32) -> &[u8];
    fn done_kinds(&self, side: usize) -> Vec<TransferKind>;
    fn failures(&self, side: usize) -> Vec<TransferError>;
}

impl PairExt for Pair {
    /// Opens one more connection on rail 0 (both sides).
    fn reconnect(&mut self) {
        self.connect(0, LinkKind::Stream);
    }

    fn add_region(
        &mut self,
        side: usize,
        id: u64,
        layout: RegionLayout,
        fill: bool,
        exposed: bool,
    ) {
        self.sides[side].regions.add(id, layout, fill, exposed);
    }

    fn local(
        &mut self,
        side: usize,
        local: BlockSelection,
        remote: BlockSelection,
    ) -> LocalTransfer {
        let region = &self.sides[side].regions.0[&local.region_id];
        let (layout, staged) = (region.layout, region.staged);
        let id = self.next_transfer_id();
        LocalTransfer {
            transfer_id: id,
            request_id: format!("req-{id}"),
            local,
            local_layout: layout,
            remote,
            staged,
            local_geometry: None,
            receiver_group: None,
        }
    }

    fn push(&mut self, local: BlockSelection, remote: BlockSelection) -> u64 {
        let req = self.local(0, local, remote);
        let id = req.transfer_id;
        let now = self.now;
        self.sides[0].session.start_push(req, now).unwrap();
        id
    }

    fn pull(&mut self, local: BlockSelection, remote: BlockSelection) -> u64 {
        let req = self.local(0, local, remote);
        let id = req.transfer_id;
        let now = self.now;
        self.sides[0].session.start_pull(req, now).unwrap();
        id
    }

    /// Flushes, then takes side 0's open off connection 0 and drops what
    /// followed it there (its slices): the receiver can be handed the open
    /// alone.
    fn take_open(&mut self) -> crate::wire::Body {
        self.flush();
        let Some(Item::Control(open)) = self.wires[0][0].pop_front() else {
            panic!("expected the open")
        };
        self.wires[0][0].clear();
        open
    }

    /// Both ends of connection `conn` break; what its wires held is lost.
    fn cut(&mut self, conn: usize) {
        self.kill(conn, "test cut the connection");
    }

    fn block(&self, side: usize, region: u64, layer: u32, plane: u32, block: u32) -> &[u8] {
        let r = &self.sides[side].regions.0[&region];
        let off = r.layout.block_offset(layer, plane, block) as usize;
        &r.bytes[off..off + r.layout.block_bytes as usize]
    }

    fn done_kinds(&self, side: usize) -> Vec<TransferKind> {
        self.sides[side]
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Done { kind, .. } => Some(*kind),
                _ => None,
            })
            .collect()
    }

    fn failures(&self, side: usize) -> Vec<TransferError> {
        self.sides[side]
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Failed { error, .. } => Some(error.clone()),
                _ => None,
            })
            .collect()
    }
}

fn small_slices() -> SessionConfig {
    SessionConfig {
        slice_bytes: 1000,
        window_bytes: 4000,
        progress_timeout: Duration::from_secs(5),
        rails: RailConfig {
            // Tiny transfers here still stripe; pinning has its own test.
            stripe_threshold: 2000,
            ..RailConfig::default()
        },
        ..SessionConfig::default()
    }
}

/// Checks that dst blocks hold the src blocks and every other dst byte is still zero.
fn assert_moved(
    p: &Pair,
    src: (usize, u64, &[u32]),
    dst: (usize, u64, &[u32]),
    layers: (u32, u32),
) {
    let dst_layout = p.sides[dst.0].regions.0[&dst.1].layout;
    for layer in layers.0..layers.0 + layers.1 {
        for plane in 0..dst_layout.planes_per_layer {
            for (s, d) in src.2.iter().zip(dst.2) {
                assert_eq!(
                    p.block(src.0, src.1, layer, plane, *s),
                    p.block(dst.0, dst.1, layer, plane, *d),
                    "layer {layer} plane {plane} block {s}->{d}"
                );
            }
        }
    }
    // Bytes outside the named destination blocks stayed untouched.
    let mut expected_nonzero = 0usize;
    for layer in layers.0..layers.0 + layers.1 {
        for _ in 0..dst_layout.planes_per_layer {
            expected_nonzero += dst.2.len() * dst_layout.block_bytes as usize;
        }
        let _ = layer;
    }
    let nonzero = p.sides[dst.0].regions.0[&dst.1]
        .bytes
        .iter()
        .filter(|b| **b != 0)
        .count();
    assert_eq!(
        nonzero, expected_nonzero,
        "bytes landed outside the destination blocks"
    );
}

fn push_moves_shuffled_blocks_and_nothing_else_case() {
    for seed in 0..20 {
        let mut p = pair(3, small_slices(), seed);
        p.add_region(0, 1, RegionLayout::dense(4, 2, 16, 300), true, false);
        p.add_region(1, 9, RegionLayout::dense(4, 2, 16, 300), false, false);
        let src = [0, 1, 2, 3, 7, 8];
        let dst = [15, 3, 4, 5, 0, 9];
        p.push(sel(1, (1, 2), &src), sel(9, (1, 2), &dst));
        p.drive();
        assert_eq!(p.done_kinds(0), vec![TransferKind::Push]);
        assert_eq!(p.done_kinds(1), vec![TransferKind::PushReceive]);
        assert_moved(&p, (0, 1, &src), (1, 9, &dst), (1, 2));
        assert_eq!(
            p.sides[0].session.active_transfers() + p.sides[1].session.active_transfers(),
            0
        );
    }
}

fn pull_reads_exposed_blocks_case() {
    let mut p = pair(2, small_slices(), 7);
    p.add_region(0, 2, RegionLayout::dense(2, 2, 8, 512), false, false);
    p.add_region(1, 5, RegionLayout::dense(2, 2, 8, 512), true, true);
    p.pull(sel(2, (0, 2), &[6, 4, 2]), sel(5, (0, 2), &[1, 2, 3]));
    p.drive();
    assert_eq!(p.done_kinds(0), vec![TransferKind::Pull]);
    assert_eq!(p.done_kinds(1), vec![TransferKind::PullServe]);
    assert_moved(&p, (1, 5, &[1, 2, 3]), (0, 2, &[6, 4, 2]), (0, 2));
}

/// Transfers of staged (GPU) memory go out in `staged_slice_bytes` slices,
/// host ones in `slice_bytes`, whichever side asked: the pusher cuts its
/// staged source, a server its staged source for a pull. A staged
/// destination does not change how the sender (host memory) cuts.
#[test]
fn staged_memory_moves_in_its_own_larger_slices() {
    let config = SessionConfig {
        staged_slice_bytes: 4000,
        window_bytes: 16000,
        ..small_slices()
    };
    let blocks: Vec<u32> = (0..16).collect();
    // (sources staged, destinations staged)
    for (staged, staged_destinations) in [(false, false), (true, false), (false, true)] {
        // A push from side 0's region 1, and a pull of side 1's region 3.
        let mut p = pair(2, config.clone(), 5);
        p.add_region(0, 1, RegionLayout::dense(1, 1, 16, 1000), true, false);
        p.add_region(1, 2, RegionLayout::dense(1, 1, 16, 1000), false, false);
        p.add_region(1, 3, RegionLayout::dense(1, 1, 16, 1000), true, true);
        p.add_region(0, 4, RegionLayout::dense(1, 1, 16, 1000), false, false);
        p.sides[0].regions.0.get_mut(&1).unwrap().staged = staged;
        p.sides[1].regions.0.get_mut(&3).unwrap().staged = staged;
        p.sides[1].regions.0.get_mut(&2).unwrap().staged = staged_destinations;
        p.sides[0].regions.0.get_mut(&4).unwrap().staged = staged_destinations;
        p.push(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
        p.drive();
        p.pull(sel(4, (0, 1), &blocks), sel(3, (0, 1), &blocks));
        p.drive();
        assert_eq!(
            p.done_kinds(0),
            vec![TransferKind::Push, TransferKind::Pull]
        );
        assert_moved(&p, (0, 1, &blocks), (1, 2, &blocks), (0, 1));
        assert_moved(&p, (1, 3, &blocks), (0, 4, &blocks), (0, 1));
        let largest = if staged { 4000 } else { 1000 };
        for (dir, what) in [(0, "push"), (1, "served pull")] {
            let lens = &p.stats.slice_lens[dir];
            assert_eq!(lens.iter().sum::<usize>(), 16_000, "{what}");
            assert_eq!(
                lens.iter().max(),
                Some(&largest),
                "{what} of staged={staged} memory: slices {lens:?}"
            );
        }
    }
}

#[test]
fn slices_stripe_over_every_connection() {
    let mut p = pair(4, small_slices(), 3);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 1000), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 1000), false, false);
    let blocks: Vec<u32> = (0..64).collect();
    p.push(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
    p.drive();
    assert_eq!(p.done_kinds(1), vec![TransferKind::PushReceive]);
    assert_eq!(p.stats.slices_per_link.iter().sum::<usize>(), 64);
    for (conn, n) in p.stats.slices_per_link.iter().enumerate() {
        assert!(*n >= 8, "connection {conn} carried only {n} of 64 slices");
    }
}

/// With `spread_min_slice_bytes`, a host push that one slice per
/// connection would carry goes out as that many equal slices, one on each
/// connection of its (pinned) rail; a push no larger than the minimum stays
/// one slice, a slightly larger one takes slices of the minimum, and
/// without the setting a push of one slice's size is one slice.
#[test]
fn a_push_of_a_slice_or_less_spreads_over_its_rails_connections() {
    let config = |spread| SessionConfig {
        slice_bytes: 256 << 10,
        window_bytes: 1 << 20,
        spread_min_slice_bytes: spread,
        ..SessionConfig::default()
    };
    // (spread, blocks of 4 KiB pushed, slice lengths expected)
    let cases: [(u64, u32, &[usize]); 4] = [
        (8 << 10, 64, &[64 << 10; 4]),
        (8 << 10, 1, &[4 << 10]),
        (8 << 10, 3, &[8 << 10, 4 << 10]),
        (0, 64, &[256 << 10]),
    ];
    for (spread, n, expected) in cases {
        // Eight connections over two rails: four on each.
        let mut p = pair(8, config(spread), 11);
        p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 4096), true, false);
        p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 4096), false, false);
        let blocks: Vec<u32> = (0..n).collect();
        p.push(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
        p.drive();
        assert_eq!(p.done_kinds(1), vec![TransferKind::PushReceive]);
        assert_moved(&p, (0, 1, &blocks), (1, 2, &blocks), (0, 1));
        let mut lens = p.stats.slice_lens[0].clone();
        lens.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(lens, expected, "spread {spread}, {n} blocks");
        // Each slice on a connection of its own, all on one rail.
        let used: Vec<usize> = (0..8).filter(|&l| p.stats.slices_per_link[l] > 0).collect();
        assert_eq!(used.len(), expected.len(), "links used: {used:?}");
        assert!(
            used.iter().all(|l| l % 2 == used[0] % 2),
            "one rail: {used:?}"
        );
    }
}

#[test]
fn receiver_rejections_reach_the_sender_with_their_reason() {
    let cases: Vec<(BlockSelection, BlockSelection, ErrorCode)> = vec![
        (
            sel(1, (0, 1), &[0]),
            sel(77, (0, 1), &[0]),
            ErrorCode::UnknownRegion,
        ),
        (
            sel(1, (0, 1), &[0]),
            sel(2, (0, 1), &[99]),
            ErrorCode::OutOfRange,
        ),
        (
            sel(1, (0, 1), &[0, 1]),
            sel(2, (0, 1), &[3, 3]),
            ErrorCode::OverlappingBlocks,
        ),
        (
            sel(1, (0, 1), &[0, 1]),
            sel(2, (0, 1), &[3]),
            ErrorCode::SizeMismatch,
        ),
        (
            sel(1, (0, 1), &[0]),
            sel(2, (1, 4), &[0]),
            ErrorCode::OutOfRange,
        ),
    ];
    for (src, dst, code) in cases {
        let mut p = pair(2, small_slices(), 1);
        p.add_region(0, 1, RegionLayout::dense(2, 2, 8, 256), true, false);
        p.add_region(1, 2, RegionLayout::dense(2, 2, 8, 256), false, false);
        p.push(src, dst);
        p.drive();
        let f = p.failures(0);
        assert_eq!(f.len(), 1, "{code:?}");
        assert!(
            matches!(&f[0], TransferError::Peer { code: c, .. } if *c == code),
            "{code:?}: {f:?}"
        );
        assert_eq!(f[0].side(), FailureSide::Peer);
        assert!(
            p.sides[1].regions.0[&2].bytes.iter().all(|b| *b == 0),
            "{code:?} wrote into the region"
        );
        assert_eq!(p.sides[1].session.active_transfers(), 0);
    }
}

#[test]
fn pull_from_an_unexposed_region_is_refused() {
    let mut p = pair(1, small_slices(), 1);
    p.add_region(0, 2, RegionLayout::dense(1, 1, 4, 64), false, false);
    p.add_region(1, 5, RegionLayout::dense(1, 1, 4, 64), true, false);
    p.pull(sel(2, (0, 1), &[0]), sel(5, (0, 1), &[0]));
    p.drive();
    assert!(matches!(
        &p.failures(0)[..],
        [TransferError::Peer {
            code: ErrorCode::NotExposed,
            ..
        }]
    ));
}

fn a_lost_connection_is_survived_by_resending_on_the_others_case() {
    for cut_at in [3, 10, 25, 60] {
        let mut p = pair(3, small_slices(), cut_at);
        p.add_region(0, 1, RegionLayout::dense(2, 2, 32, 700), true, false);
        p.add_region(1, 2, RegionLayout::dense(2, 2, 32, 700), false, false);
        let blocks: Vec<u32> = (0..32).rev().collect();
        let dst: Vec<u32> = (0..32).collect();
        p.push(sel(1, (0, 2), &blocks), sel(2, (0, 2), &dst));
        for _ in 0..cut_at {
            p.step();
        }
        p.cut(1);
        p.drive();
        assert_eq!(p.done_kinds(0), vec![TransferKind::Push], "cut at {cut_at}");
        assert_moved(&p, (0, 1, &blocks), (1, 2, &dst), (0, 2));
    }
}

fn losing_every_connection_fails_both_sides_case() {
    let mut p = pair(2, small_slices(), 5);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 1000), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 1000), false, false);
    let blocks: Vec<u32> = (0..64).collect();
    p.push(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
    for _ in 0..10 {
        p.step();
    }
    p.cut(0);
    p.cut(1);
    p.flush();
    // Rails may come back: nothing fails before the failover deadline...
    let deadline = p.sides[0].session.config().rails.all_down_deadline;
    let before = p.now + deadline - Duration::from_millis(1);
    for side in 0..2 {
        p.sides[side].session.handle_timeout(before);
    }
    p.flush();
    assert!(p.failures(0).is_empty() && p.failures(1).is_empty());
    // ...and everything fails, naming the rails' causes, once it passes.
    for side in 0..2 {
        p.sides[side].session.handle_timeout(p.now + deadline);
    }
    p.flush();
    for side in 0..2 {
        let failures = p.failures(side);
        let [TransferError::RailsDown { causes, .. }] = &failures[..] else {
            panic!("side {side}: {failures:?}");
        };
        assert!(causes.contains("test cut the connection"), "{causes}");
        assert_eq!(failures[0].side(), FailureSide::Rail);
    }
}

#[test]
fn a_silent_peer_times_out() {
    let mut p = pair(1, small_slices(), 5);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 64), true, false);
    p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[0]));
    p.flush(); // sent, never delivered
    let start = p.now;
    // Follow the session's own deadlines until the transfer fails.
    let mut rail_states = Vec::new();
    let mut seen = p.sides[0].events.len();
    while p.failures(0).is_empty() {
        let at = p.sides[0].session.poll_timeout().unwrap();
        p.now = at;
        p.sides[0].session.handle_timeout(at);
        p.flush();
        for e in &p.sides[0].events[seen..] {
            if let Event::Rail(c) = e {
                rail_states.push((c.to, at - start));
            }
        }
        seen = p.sides[0].events.len();
    }
    // The rail is suspected at half the stall deadline and dropped at the deadline;
    // the transfer itself gives up at its progress deadline.
    let stall = Duration::from_secs(1);
    assert_eq!(
        rail_states[..2],
        [(RailHealth::Suspect, stall / 2), (RailHealth::Down, stall)]
    );
    assert!(matches!(&p.failures(0)[..], [TransferError::Timeout(_)]));
    assert_eq!(p.now - start, Duration::from_secs(5));
}

fn cancel_tells_the_peer_and_stops_case() {
    let mut p = pair(2, small_slices(), 9);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 1000), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 1000), false, false);
    let blocks: Vec<u32> = (0..64).collect();
    let id = p.push(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
    for _ in 0..8 {
        p.step();
    }
    let now = p.now;
    assert!(p.sides[0].session.cancel(id, now));
    p.drive();
    assert!(matches!(&p.failures(0)[..], [TransferError::Cancelled]));
    assert!(matches!(&p.failures(1)[..], [TransferError::Cancelled]));
    assert_eq!(p.sides[1].session.active_transfers(), 0);
}

#[test]
fn a_slice_outside_the_transfer_is_discarded_and_aborts_it() {
    let mut p = pair(1, small_slices(), 2);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    // Deliver only the announcement.
    let open = p.take_open();
    let now = p.now;
    let b = &mut p.sides[1];
    b.session.handle_control(0, open, now, &b.regions);
    let bad = SliceHeader {
        transfer_id: id,
        offset: 50,
    };
    assert_eq!(
        b.session.accept_slice(0, bad, 100, now),
        SliceDisposition::Discard
    );
    assert_eq!(
        b.session.accept_slice(
            0,
            SliceHeader {
                transfer_id: 999,
                offset: 0
            },
            10,
            now
        ),
        SliceDisposition::Discard
    );
    p.flush();
    assert!(matches!(
        &p.failures(1)[..],
        [TransferError::Peer {
            code: ErrorCode::Protocol,
            ..
        }]
    ));
    p.drive();
    assert!(matches!(
        &p.failures(0)[..],
        [TransferError::Peer {
            code: ErrorCode::Protocol,
            ..
        }]
    ));
    assert!(p.sides[1].regions.0[&2].bytes.iter().all(|b| *b == 0));
}

#[test]
fn failure_waits_for_slices_still_being_placed() {
    let mut p = pair(1, small_slices(), 2);
    p.add_region(0, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    p.add_region(1, 5, RegionLayout::dense(1, 1, 4, 100), true, true);
    let id = p.pull(sel(2, (0, 1), &[0, 1]), sel(5, (0, 1), &[0, 1]));
    let now = p.now;
    let a = &mut p.sides[0].session;
    let h = SliceHeader {
        transfer_id: id,
        offset: 0,
    };
    assert!(matches!(
        a.accept_slice(0, h, 100, now),
        SliceDisposition::Place { .. }
    ));
    // The worker cancels while the payload is still being read into its blocks.
    assert!(a.cancel(id, now));
    assert!(
        a.poll_event().is_none(),
        "must not report failure while memory is being written"
    );
    a.slice_placed(0, h, 100, now);
    assert!(matches!(
        a.poll_event(),
        Some(Event::Failed {
            error: TransferError::Cancelled,
            ..
        })
    ));
}

fn many_concurrent_transfers_both_ways_all_complete_case() {
    let mut p = pair(4, small_slices(), 11);
    p.add_region(0, 1, RegionLayout::dense(2, 2, 64, 333), true, true);
    p.add_region(1, 2, RegionLayout::dense(2, 2, 64, 333), true, true);
    p.add_region(0, 3, RegionLayout::dense(2, 2, 64, 333), false, false);
    p.add_region(1, 4, RegionLayout::dense(2, 2, 64, 333), false, false);
    for i in 0..8u32 {
        let b: Vec<u32> = (i * 8..i * 8 + 8).collect();
        p.push(sel(1, (0, 2), &b), sel(4, (0, 2), &b));
        p.pull(sel(3, (0, 2), &b), sel(2, (0, 2), &b));
    }
    p.drive();
    assert_eq!(p.done_kinds(0).len(), 16);
    assert_eq!(p.done_kinds(1).len(), 16);
    if p.through_gates() {
        // Every slice but each connection's first of each transfer.
        assert!(
            p.stats.admitted_by_gates > p.stats.slices_per_link.iter().sum::<usize>() / 2,
            "{} of {}",
            p.stats.admitted_by_gates,
            p.stats.slices_per_link.iter().sum::<usize>()
        );
    }
    assert_eq!(
        p.sides[1].regions.0[&4].bytes,
        p.sides[0].regions.0[&1].bytes
    );
    assert_eq!(
        p.sides[0].regions.0[&3].bytes,
        p.sides[1].regions.0[&2].bytes
    );
}

/// An Abort that overtakes its PushOpen (another connection, a reordering): the
/// open that arrives after it creates no receive, so nothing waits for a
/// progress timeout or holds the region.
#[test]
fn an_abort_that_overtakes_its_open_leaves_no_orphan() {
    let mut p = pair(2, small_slices(), 12);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    let open = p.take_open();
    p.wires[1][0].clear();
    let now = p.now;
    let abort = crate::wire::message(crate::wire::Body::Abort(crate::wire::pb::Abort {
        transfer_id: id,
        code: ErrorCode::Cancelled as i32,
        message: "cancelled".into(),
    }));
    let b = &mut p.sides[1];
    let Some(crate::wire::Body::Abort(a)) = abort.body else {
        unreachable!()
    };
    b.session
        .handle_control(1, crate::wire::Body::Abort(a), now, &b.regions);
    b.session.handle_control(0, open, now, &b.regions);
    assert_eq!(b.session.active_transfers(), 0);
    assert!(b.session.progress(id).is_none());
}

/// A push announces itself on each connection it uses; an Abort that
/// arrives after the first announcement and before a repeat on another
/// connection must not let the repeat start a new receive (it held the
/// region for the progress timeout, and then failed with a timeout).
#[test]
fn an_abort_between_an_open_and_its_repeat_leaves_no_orphan() {
    let mut p = pair(2, small_slices(), 13);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    let open = p.take_open();
    p.wires[1][0].clear();
    let now = p.now;
    let b = &mut p.sides[1];
    b.session.handle_control(0, open.clone(), now, &b.regions);
    assert_eq!(b.session.active_transfers(), 1);
    let abort = crate::wire::Body::Abort(crate::wire::pb::Abort {
        transfer_id: id,
        code: ErrorCode::Cancelled as i32,
        message: "cancelled".into(),
    });
    b.session.handle_control(0, abort, now, &b.regions);
    assert_eq!(b.session.active_transfers(), 0);
    // The same open, repeated on the second connection, arrives last.
    b.session.handle_control(1, open, now, &b.regions);
    assert_eq!(b.session.active_transfers(), 0);
    assert!(b.session.progress(id).is_none());
}

fn with_generations(mut s: BlockSelection, generations: &[u64]) -> BlockSelection {
    s.generations = generations.to_vec();
    s
}

#[test]
fn a_pull_naming_released_blocks_is_refused_before_a_byte_moves() {
    let mut p = pair(2, small_slices(), 21);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 8, 1000), false, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 8, 1000), true, true);
    // The prefill worker released block 5 after the decode learnt its generation.
    p.sides[1].regions.release(2, &[5]);
    p.pull(
        sel(1, (0, 1), &[0, 1, 2]),
        with_generations(sel(2, (0, 1), &[4, 5, 6]), &[1, 1, 1]),
    );
    p.drive();
    let [TransferError::Peer { code, message }] = &p.failures(0)[..] else {
        panic!("{:?}", p.failures(0));
    };
    assert_eq!(*code, ErrorCode::BlocksReleased);
    assert!(
        message.contains("block 5 of region 2") && message.contains("generation 2"),
        "{message}"
    );
    assert!(p.sides[0].regions.0[&1].bytes.iter().all(|&b| b == 0));
    // Naming the current generations (or none) moves the blocks.
    p.pull(
        sel(1, (0, 1), &[0, 1, 2]),
        with_generations(sel(2, (0, 1), &[4, 5, 6]), &[1, 2, 0]),
    );
    p.drive();
    assert_eq!(p.failures(0).len(), 1);
    assert!(p.sides[0].regions.0[&1].bytes[..3000]
        .iter()
        .all(|&b| b != 0));
}

fn blocks_released_mid_transfer_fail_it_on_both_sides_case() {
    for (releasing_side, region) in [(1usize, 2u64), (0, 1)] {
        let mut p = pair(2, small_slices(), 22);
        p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 1000), false, false);
        p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 1000), true, true);
        let blocks: Vec<u32> = (0..64).collect();
        let id = p.pull(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
        for _ in 0..12 {
            p.step();
        }
        let now = p.now;
        let side = &mut p.sides[releasing_side];
        // The serving side knows which connections carry the pull's slices
        // (those a stuck writer would hold); the receiving side sends none.
        let carrying = side.session.connections_carrying(&[id, id + 1000]);
        if releasing_side == 1 {
            assert!(!carrying.is_empty(), "slices of the pull are on the wire");
            assert!(carrying.windows(2).all(|w| w[0] < w[1]), "{carrying:?}");
        } else {
            assert!(carrying.is_empty(), "{carrying:?}");
        }
        side.regions.release(region, &[40]);
        assert_eq!(
            side.session
                .blocks_released(region, &[40], "block 40 released by the worker", now),
            vec![id]
        );
        // Releasing blocks no transfer names fails nothing.
        assert_eq!(
            side.session
                .blocks_released(region + 10, &[40], "other", now),
            Vec::<u64>::new()
        );
        p.drive();
        for s in 0..2 {
            let f = p.failures(s);
            assert_eq!(f.len(), 1, "side {s}: {f:?}");
            assert_eq!(f[0].code(), "blocks_released", "side {s}: {f:?}");
            let expected = if s == releasing_side {
                FailureSide::Local
            } else {
                FailureSide::Peer
            };
            assert_eq!(f[0].side(), expected);
            assert!(
                !p.sides[s]
                    .events
                    .iter()
                    .any(|e| matches!(e, Event::Done { transfer_id, .. } if *transfer_id == id)),
                "side {s} finished a transfer whose blocks were released"
            );
            assert_eq!(p.sides[s].session.active_transfers(), 0);
        }
    }
}

#[test]
fn a_worker_message_crosses_and_an_oversized_one_is_dropped_on_receipt() {
    let mut p = pair(2, small_slices(), 41);
    let msg = |payload: usize| crate::wire::pb::WorkerMessage {
        from_worker: "decode-0".into(),
        to_worker: "prefill-0".into(),
        topic: "grant/7".into(),
        payload: vec![3; payload],
    };
    p.sides[1].session.send_message(msg(100)).unwrap();
    // The sender refuses what breaks the limits.
    assert!(p.sides[1]
        .session
        .send_message(msg(crate::message::MAX_PAYLOAD_BYTES + 1))
        .is_err());
    p.drive();
    let got: Vec<_> = p.sides[0]
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Message(m) => Some(m.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(got, vec![msg(100)]);
    // A hostile peer's oversized message, bypassing its own checks, is dropped.
    let body = crate::wire::pb::peer_message::Body::WorkerMessage(msg(
        crate::message::MAX_PAYLOAD_BYTES + 1,
    ));
    let now = p.now;
    p.sides[0]
        .session
        .handle_control(0, body, now, &p.sides[0].regions);
    p.flush();
    assert!(matches!(
        p.sides[0].events.last(),
        Some(Event::MessageDropped(
            crate::message::MessageError::TooLong {
                field: "payload",
                ..
            }
        ))
    ));
}

#[test]
fn messages_beyond_the_queue_limit_are_refused_not_queued() {
    let mut p = pair(1, small_slices(), 42);
    let msg = crate::wire::pb::WorkerMessage {
        from_worker: "a".into(),
        to_worker: "b".into(),
        topic: "t".into(),
        payload: vec![],
    };
    // Nothing is flushed: every message stays queued.
    for _ in 0..crate::message::MAX_QUEUED_CONTROL {
        p.sides[0].session.send_message(msg.clone()).unwrap();
    }
    assert!(matches!(
        p.sides[0].session.send_message(msg.clone()),
        Err(crate::message::MessageError::Busy(_))
    ));
    p.drive();
    assert!(p.sides[0].session.send_message(msg).is_ok());
}

/// Everything the receiver says is lost, then the rail's connections die (a
/// rail declared down while its acks were still queued behind a slow peer) and
/// new ones replace them: the slices re-sent there were placed already. The
/// receiver must acknowledge them again, and repeat the Complete that was lost,
/// or the sender waits for ever.
fn placed_slices_resent_after_lost_acks_are_acknowledged_again_case() {
    for (seed, cut_after) in (0..12).zip([2, 5, 9, 1000].into_iter().cycle()) {
        let mut p = pair(2, small_slices(), seed);
        p.add_region(0, 1, RegionLayout::dense(2, 2, 32, 700), true, false);
        p.add_region(1, 2, RegionLayout::dense(2, 2, 32, 700), false, false);
        let blocks: Vec<u32> = (0..32).rev().collect();
        let dst: Vec<u32> = (0..32).collect();
        p.push(sel(1, (0, 2), &blocks), sel(2, (0, 2), &dst));
        let mut steps = 0;
        loop {
            p.flush();
            for w in &mut p.wires {
                w[1].clear();
            }
            steps += 1;
            if steps > cut_after || !p.step() {
                break;
            }
        }
        for w in &mut p.wires {
            w[1].clear();
        }
        p.cut(0);
        p.cut(1);
        for _ in 0..2 {
            p.reconnect();
        }
        // Each side told the other of the first cut over the second connection
        // before it died too; that news is stale now that the rail is rebuilt.
        p.flush();
        for w in &mut p.wires {
            for dir in w.iter_mut() {
                dir.retain(|i| !matches!(i, Item::Control(crate::wire::Body::RailDown(_))));
            }
        }
        p.drive();
        assert_eq!(
            p.done_kinds(0),
            vec![TransferKind::Push],
            "seed {seed}, cut after {cut_after}: {:?}",
            p.failures(0),
        );
        assert_eq!(
            p.done_kinds(1),
            vec![TransferKind::PushReceive],
            "seed {seed}"
        );
        assert_moved(&p, (0, 1, &blocks), (1, 2, &dst), (0, 2));
    }
}

// Each of these runs with slices placed by the session and through gates.

#[test]
fn push_moves_shuffled_blocks_and_nothing_else() {
    each_placement(push_moves_shuffled_blocks_and_nothing_else_case);
}

#[test]
fn pull_reads_exposed_blocks() {
    each_placement(pull_reads_exposed_blocks_case);
}

#[test]
fn a_lost_connection_is_survived_by_resending_on_the_others() {
    each_placement(a_lost_connection_is_survived_by_resending_on_the_others_case);
}

#[test]
fn many_concurrent_transfers_both_ways_all_complete() {
    each_placement(many_concurrent_transfers_both_ways_all_complete_case);
}

#[test]
fn blocks_released_mid_transfer_fail_it_on_both_sides() {
    each_placement(blocks_released_mid_transfer_fail_it_on_both_sides_case);
}

#[test]
fn placed_slices_resent_after_lost_acks_are_acknowledged_again() {
    each_placement(placed_slices_resent_after_lost_acks_are_acknowledged_again_case);
}

#[test]
fn losing_every_connection_fails_both_sides() {
    each_placement(losing_every_connection_fails_both_sides_case);
}

#[test]
fn cancel_tells_the_peer_and_stops() {
    each_placement(cancel_tells_the_peer_and_stops_case);
}

/// A pull of two 100-byte blocks with its gate learnt by a placer (side 0 receives).
fn pull_with_gate() -> (Pair, u64, ConnPlacer) {
    let mut p = pair(1, small_slices(), 2);
    p.add_region(0, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    p.add_region(1, 5, RegionLayout::dense(1, 1, 4, 100), true, true);
    let id = p.pull(sel(2, (0, 1), &[0, 1]), sel(5, (0, 1), &[0, 1]));
    let mut placer = ConnPlacer::default();
    let gate = p.sides[0].session.placement_gate(id);
    assert!(gate.is_some());
    placer.learn(id, gate);
    (p, id, placer)
}

fn slice(transfer_id: u64, offset: u64) -> SliceHeader {
    SliceHeader {
        transfer_id,
        offset,
    }
}

/// The 100-byte slice at `offset`, which the placer's open gate must admit.
fn admit(placer: &mut ConnPlacer, transfer_id: u64, offset: u64) -> Admitted {
    match placer.admit(slice(transfer_id, offset), 100) {
        Admission::Place(s) => s,
        other => panic!("an open gate refused the slice at {offset}: {other:?}"),
    }
}

#[test]
fn failure_waits_for_slices_admitted_through_a_gate() {
    let (mut p, id, mut placer) = pull_with_gate();
    let now = p.now;
    let first = admit(&mut placer, id, 0);
    assert_eq!(first.pieces, vec![(0, 100)]);
    let a = &mut p.sides[0].session;
    // The worker cancels while the payload is still being read into its blocks.
    assert!(a.cancel(id, now));
    assert!(a.still_placing(&[id]));
    assert!(
        a.poll_event().is_none(),
        "must not report failure while memory is being written"
    );
    // Nothing more is admitted once the transfer fails.
    assert!(matches!(
        placer.admit(slice(id, 100), 100),
        Admission::AskSession
    ));
    assert!(a.placement_gate(id).is_none());
    placer.placed(first);
    a.merge_placed(Some(0), placer.take_placed(), now);
    assert!(!a.still_placing(&[id]));
    assert!(matches!(
        a.poll_event(),
        Some(Event::Failed {
            error: TransferError::Cancelled,
            ..
        })
    ));
    assert_eq!(a.active_transfers(), 0);
}

#[test]
fn an_abandoned_admission_settles_its_failing_transfer() {
    let (mut p, id, mut placer) = pull_with_gate();
    let now = p.now;
    let first = admit(&mut placer, id, 100);
    let a = &mut p.sides[0].session;
    a.fail(id, ErrorCode::Internal, "test", now);
    assert!(a.poll_event().is_none());
    a.admitted_abandoned(first);
    assert!(matches!(a.poll_event(), Some(Event::Failed { .. })));
}

#[test]
fn a_placement_failure_fails_the_transfer_with_its_code() {
    let (mut p, id, mut placer) = pull_with_gate();
    let now = p.now;
    let first = admit(&mut placer, id, 0);
    let a = &mut p.sides[0].session;
    a.admitted_failed(first, ErrorCode::RegionTruncated, "file truncated", now);
    match a.poll_event() {
        Some(Event::Failed { error, .. }) => assert_eq!(error.code(), "region_truncated"),
        other => panic!("expected the failure, got {other:?}"),
    }
    // The peer is told.
    p.flush();
    assert!(p.wires[0][0]
        .iter()
        .any(|i| matches!(i, Item::Control(crate::wire::Body::Abort(_)))));
}

#[test]
fn a_gate_admits_nothing_outside_its_transfer_and_the_session_aborts_it() {
    let (mut p, id, mut placer) = pull_with_gate();
    let now = p.now;
    for (offset, len) in [(150, 100), (200, 1), (u64::MAX - 10, 100)] {
        assert!(
            matches!(placer.admit(slice(id, offset), len), Admission::AskSession),
            "{offset}+{len}"
        );
    }
    // The session decides: the transfer aborts, and nothing is admitted after.
    let a = &mut p.sides[0].session;
    assert_eq!(
        a.accept_slice(0, slice(id, 150), 100, now),
        SliceDisposition::Discard
    );
    assert!(matches!(
        placer.admit(slice(id, 0), 100),
        Admission::AskSession
    ));
    assert!(matches!(
        a.poll_event(),
        Some(Event::Failed {
            error: TransferError::Peer {
                code: ErrorCode::Protocol,
                ..
            },
            ..
        })
    ));
}

/// A duplicate (re-sent after a failover) admitted on one connection while the
/// last new bytes are merged from another: the transfer is complete, but it
/// must not end while the duplicate is still being written into its blocks.
#[test]
fn a_complete_transfer_ends_only_after_a_duplicate_being_written() {
    let (mut p, id, mut first) = pull_with_gate();
    let now = p.now;
    let a = &mut p.sides[0].session;
    let mut second = ConnPlacer::default();
    second.learn(id, a.placement_gate(id));
    let s = admit(&mut first, id, 0);
    first.placed(s);
    a.merge_placed(Some(0), first.take_placed(), now);
    let s = admit(&mut second, id, 100);
    second.placed(s);
    let duplicate = admit(&mut first, id, 0);
    a.merge_placed(Some(0), second.take_placed(), now);
    assert!(
        a.poll_event().is_none(),
        "done while a duplicate is being written"
    );
    assert!(a.still_placing(&[id]));
    // Nothing more is admitted: the session answers repeats from now on.
    assert!(matches!(
        first.admit(slice(id, 100), 100),
        Admission::AskSession
    ));
    assert_eq!(
        a.accept_slice(0, slice(id, 100), 100, now),
        SliceDisposition::Discard
    );
    first.placed(duplicate);
    a.merge_placed(Some(0), first.take_placed(), now);
    assert!(matches!(
        a.poll_event(),
        Some(Event::Done {
            kind: TransferKind::Pull,
            ..
        })
    ));
    assert_eq!(a.active_transfers(), 0);
}

#[test]
fn only_receivers_have_gates_and_merging_completes_them() {
    let mut p = pair(1, small_slices(), 4);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[0]));
    assert!(p.sides[0].session.placement_gate(id).is_none(), "a sender");
    assert!(
        p.sides[0].session.placement_gate(id + 1).is_none(),
        "unknown"
    );
    // A receiver: every slice admitted and placed completes only once merged.
    let (mut p, id, mut placer) = pull_with_gate();
    let now = p.now;
    for offset in [100, 0] {
        let s = admit(&mut placer, id, offset);
        placer.placed(s);
    }
    assert!(placer.should_merge(false));
    assert!(!placer.should_merge(true), "two small slices wait for more");
    let a = &mut p.sides[0].session;
    assert!(a.poll_event().is_none());
    a.merge_placed(Some(0), placer.take_placed(), now);
    assert!(matches!(
        a.poll_event(),
        Some(Event::Done {
            kind: TransferKind::Pull,
            bytes: 200,
            ..
        })
    ));
    // The gate closed with its transfer: a repeated slice goes to the session,
    // which repeats its Complete.
    assert!(matches!(
        placer.admit(slice(id, 0), 100),
        Admission::AskSession
    ));
}

/// Blocks released while every rail is down: the serving side fails the pull at
/// once and tells the puller when a connection returns, so the puller hears
/// "blocks released" instead of timing out on a transfer nobody serves.
#[test]
fn a_release_with_every_rail_down_reaches_the_peer_when_one_returns() {
    let mut p = pair(1, small_slices(), 31);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 64, 1000), false, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 64, 1000), true, true);
    let blocks: Vec<u32> = (0..64).collect();
    let id = p.pull(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
    for _ in 0..12 {
        p.step();
    }
    p.cut(0);
    assert_eq!(p.sides[1].session.alive_connections(), 0);
    let now = p.now;
    p.sides[1].regions.release(2, &[40]);
    assert_eq!(
        p.sides[1]
            .session
            .blocks_released(2, &[40], "block 40 released by the worker", now),
        vec![id]
    );
    p.reconnect();
    p.drive();
    let f = p.failures(0);
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].code(), "blocks_released", "{f:?}");
    assert_eq!(f[0].side(), FailureSide::Peer, "{f:?}");
    assert_eq!(p.sides[0].session.active_transfers(), 0);
    assert_eq!(
        p.sides[1].session.active_transfers(),
        0,
        "nothing served anew"
    );
}

/// The serving side ended a pull (its blocks were released) and the abort was
/// lost with the slices in flight; the reader, having heard nothing, sends its
/// open again after a cut: it gets the same abort back, and nothing of the
/// released blocks is served anew.
#[test]
fn a_late_open_of_a_pull_the_server_ended_gets_its_abort_again() {
    let mut p = pair(2, small_slices(), 43);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 16, 1000), false, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 16, 1000), true, true);
    let blocks: Vec<u32> = (0..16).collect();
    let id = p.pull(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
    p.flush();
    let conn = (0..p.wires.len())
        .find(|&c| !p.wires[c][0].is_empty())
        .expect("the open is on a wire");
    let open = p.wires[conn][0].pop_front().unwrap();
    let side = &mut p.sides[1];
    deliver(&mut side.session, &mut side.regions, conn, open, p.now);
    let now = p.now;
    p.sides[1].regions.release(2, &[5]);
    assert_eq!(
        p.sides[1]
            .session
            .blocks_released(2, &[5], "block 5 released by the worker", now),
        vec![id]
    );
    // Everything the server sent (slices, the abort) is lost.
    p.flush();
    for w in &mut p.wires {
        w[1].clear();
    }
    p.cut(conn);
    p.drive();
    let f = p.failures(0);
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].code(), "blocks_released", "{f:?}");
    assert!(f[0].to_string().contains("block 5"), "{f:?}");
    assert_eq!(
        p.sides[1].session.active_transfers(),
        0,
        "nothing served anew"
    );
    assert!(p.done_kinds(1).is_empty(), "{:?}", p.done_kinds(1));
    assert!(
        p.sides[0].regions.0[&1].bytes.iter().all(|&b| b == 0),
        "no byte of the released pull landed"
    );
}

/// A pull's open dies with its connection, unread (`deliver_first` false) or
/// after the peer read it and began serving (true): the reader sends it again
/// on a survivor, the peer serves once, and the pull completes instead of
/// waiting out its timeout.
#[test]
fn a_pull_whose_open_died_with_its_connection_completes() {
    for deliver_first in [false, true] {
        let mut p = pair(2, small_slices(), 41);
        p.add_region(0, 1, RegionLayout::dense(1, 1, 16, 1000), false, false);
        p.add_region(1, 2, RegionLayout::dense(1, 1, 16, 1000), true, true);
        let blocks: Vec<u32> = (0..16).collect();
        p.pull(sel(1, (0, 1), &blocks), sel(2, (0, 1), &blocks));
        p.flush();
        let conn = (0..p.wires.len())
            .find(|&c| {
                p.wires[c][0]
                    .iter()
                    .any(|i| matches!(i, Item::Control(crate::wire::Body::PullOpen(_))))
            })
            .expect("the open is on a wire");
        if deliver_first {
            let item = p.wires[conn][0].pop_front().unwrap();
            let side = &mut p.sides[1];
            deliver(&mut side.session, &mut side.regions, conn, item, p.now);
            assert_eq!(p.sides[1].session.active_transfers(), 1, "serving");
        }
        p.cut(conn);
        p.drive();
        assert_eq!(
            p.done_kinds(0),
            vec![TransferKind::Pull],
            "deliver first {deliver_first}: {:?}",
            p.failures(0)
        );
        assert_eq!(p.failures(1), vec![], "deliver first {deliver_first}");
        assert_moved(&p, (1, 2, &blocks), (0, 1, &blocks), (0, 1));
    }
}

/// A peer's open with a request id longer than any worker may give is
/// refused (ids reach worker notifications and logs), and a peer's abort
/// message is cut before it reaches the worker.
#[test]
fn a_peers_oversized_request_id_is_refused_and_its_long_messages_are_cut() {
    let mut p = pair(1, small_slices(), 2);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    let crate::wire::Body::PushOpen(mut open) = p.take_open() else {
        panic!("expected a push's open")
    };
    open.request_id = "r".repeat(crate::wire::REQUEST_ID_MAX + 1);
    let now = p.now;
    let b = &mut p.sides[1];
    b.session
        .handle_control(0, crate::wire::Body::PushOpen(open), now, &b.regions);
    assert_eq!(b.session.active_transfers(), 0, "nothing accepted");
    p.drive();
    assert!(matches!(
        &p.failures(0)[..],
        [TransferError::Peer {
            code: ErrorCode::Protocol,
            ..
        }]
    ));

    // A second transfer, aborted by the peer with a megabyte of text.
    let id2 = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    assert_ne!(id, id2);
    let abort = crate::wire::Body::Abort(crate::wire::pb::Abort {
        transfer_id: id2,
        code: ErrorCode::Internal as i32,
        message: "é".repeat(1 << 19),
    });
    let now = p.now;
    let a = &mut p.sides[0];
    a.session.handle_control(0, abort, now, &a.regions);
    p.flush();
    let failures = p.failures(0);
    let Some(TransferError::Peer { message, .. }) = failures.last() else {
        panic!("expected the peer's abort: {failures:?}")
    };
    assert!(
        message.len() <= crate::wire::PEER_TEXT_MAX + 64,
        "{} bytes reached the worker",
        message.len()
    );
    assert!(message.ends_with("more bytes cut)"), "marked as cut");
}

/// PushOpens naming a million contiguous blocks each coalesce into one plan
/// segment, but the receiving side keeps every id and generation (~12 MiB):
/// hundreds of them took a daemon to an OOM kill. What open transfers hold
/// is counted against the session's cap and the node's budget (shared by
/// every session); past them the peer is refused and told why, and what
/// ended gives its bytes back.
#[test]
fn what_open_transfers_hold_is_bounded_per_session_and_per_node() {
    use crate::budget::MemoryBudget;
    let node = std::sync::Arc::new(MemoryBudget::new(100 << 20));
    let config = SessionConfig {
        peer_budget: std::sync::Arc::new(MemoryBudget::new(64 << 20)),
        node_budget: node.clone(),
        ..small_slices()
    };
    let mut p = pair(1, config.clone(), 3);
    let blocks = crate::plan::MAX_BLOCKS_PER_TRANSFER as u32;
    p.add_region(1, 2, RegionLayout::dense(1, 1, blocks, 1), false, false);
    let open = |id: u64| {
        crate::wire::Body::PushOpen(crate::wire::pb::PushOpen {
            transfer_id: id,
            request_id: format!("r{id}"),
            destination: Some(crate::wire::pb::BlockSet {
                region_id: 2,
                layer_start: 0,
                layer_count: 1,
                block_ids: (0..blocks).collect(),
                generations: vec![0; blocks as usize],
                slice: None,
                first_token: 0,
            }),
            block_bytes: 1,
            total_bytes: u64::from(blocks),
            one_sided: false,
            geometry: None,
            receiver_group: None,
        })
    };
    let now = p.now;
    let b = &mut p.sides[1];
    for id in 1..=10 {
        b.session.handle_control(0, open(id), now, &b.regions);
    }
    // 12 MiB and a bit each: five fit the peer's 64 MiB.
    let open_now = b.session.active_transfers();
    assert_eq!(open_now, 5);
    assert!(b.session.held_bytes() <= 64 << 20);
    assert_eq!(node.held(), b.session.held_bytes());
    let refusals = abort_messages(&mut b.session, now);
    assert_eq!(refusals.len(), 10 - open_now, "{refusals:?}");
    assert!(
        refusals[0].contains("in this peer's sessions"),
        "{}",
        refusals[0]
    );
    // A second session of another peer draws from the node's budget too.
    let other_peer = SessionConfig {
        peer_budget: std::sync::Arc::new(MemoryBudget::new(64 << 20)),
        ..config
    };
    let mut q = pair(1, other_peer, 4);
    q.add_region(1, 2, RegionLayout::dense(1, 1, blocks, 1), false, false);
    let c = &mut q.sides[1];
    for id in 1..=10 {
        c.session.handle_control(0, open(id), now, &c.regions);
    }
    assert!(node.held() <= 100 << 20, "{}", node.held());
    assert!(c.session.active_transfers() < open_now);
    // Transfers that end (here: nothing came for them) give their bytes
    // back; so does a dropped session.
    p.sides[1]
        .session
        .handle_timeout(now + Duration::from_secs(600));
    assert_eq!(p.sides[1].session.active_transfers(), 0);
    assert_eq!(p.sides[1].session.held_bytes(), 0);
    drop(q);
    assert_eq!(node.held(), 0);
}

/// A session holds at most `MAX_TRANSFERS` open transfers: a worker asking
/// for more is told to wait (and the session's memory stays bounded), and a
/// peer opening more has the extra ones refused, the peer told why.
#[test]
fn a_session_holds_a_bounded_number_of_transfers_each_way() {
    let mut p = pair(1, small_slices(), 2);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 4, 100), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 100), false, false);
    for _ in 0..MAX_TRANSFERS {
        p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    }
    let req = p.local(0, sel(1, (0, 1), &[0]), sel(2, (0, 1), &[1]));
    let now = p.now;
    let full = p.sides[0].session.start_push(req, now).unwrap_err();
    assert!(
        matches!(full, crate::error::PlanError::SessionFull { .. }),
        "{full}"
    );
    assert!(full.to_string().contains("wait"), "{full}");

    // The receiving side, opened by a peer: the first MAX_TRANSFERS are
    // accepted, the next is refused.
    let b = &mut p.sides[1];
    for id in 1..=(MAX_TRANSFERS as u64 + 1) {
        let open = crate::wire::Body::PushOpen(crate::wire::pb::PushOpen {
            transfer_id: id,
            request_id: format!("r{id}"),
            destination: Some(crate::wire::pb::BlockSet {
                region_id: 2,
                layer_start: 0,
                layer_count: 1,
                block_ids: vec![1],
                generations: Vec::new(),
                slice: None,
                first_token: 0,
            }),
            block_bytes: 100,
            total_bytes: 100,
            one_sided: false,
            geometry: None,
            receiver_group: None,
        });
        b.session.handle_control(0, open, now, &b.regions);
    }
    assert_eq!(b.session.active_transfers(), MAX_TRANSFERS);
    let refused = std::iter::from_fn(|| b.session.poll_transmit(now))
        .filter_map(|t| match t {
            Transmit::Control { msg, .. } => match msg.body {
                Some(crate::wire::Body::Abort(a)) => Some(a),
                _ => None,
            },
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].transfer_id, MAX_TRANSFERS as u64 + 1);
    assert!(
        refused[0].message.contains("at most"),
        "{}",
        refused[0].message
    );
}

/// A peer sending a transfer as tiny slices with gaps between them makes the
/// receiver's record of placed ranges grow with every slice: past
/// `MAX_PLACED_RANGES` the transfer is aborted as a protocol error instead
/// of growing until memory runs out.
#[test]
fn a_transfer_cut_into_too_many_separate_pieces_is_aborted() {
    let mut p = pair(1, small_slices(), 2);
    let total = 2 * (MAX_PLACED_RANGES as u64 + 8);
    assert_eq!(max_placed_ranges(total), MAX_PLACED_RANGES as u64);
    p.add_region(0, 1, RegionLayout::dense(1, 1, 1, total), true, false);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 1, total), false, false);
    let id = p.push(sel(1, (0, 1), &[0]), sel(2, (0, 1), &[0]));
    let open = p.take_open();
    let now = p.now;
    let b = &mut p.sides[1];
    b.session.handle_control(0, open, now, &b.regions);
    let mut aborted_at = None;
    for i in 0..(MAX_PLACED_RANGES as u64 + 8) {
        let h = SliceHeader {
            transfer_id: id,
            offset: 2 * i,
        };
        match b.session.accept_slice(0, h, 1, now) {
            SliceDisposition::Place { .. } => b.session.slice_placed(0, h, 1, now),
            _ => {
                aborted_at = Some(i);
                break;
            }
        }
    }
    assert_eq!(aborted_at, Some(MAX_PLACED_RANGES as u64 + 1));
    assert_eq!(b.session.active_transfers(), 0);
    p.flush();
    assert!(matches!(
        &p.failures(1)[..],
        [TransferError::Peer {
            code: ErrorCode::Protocol,
            ..
        }]
    ));
}

/// A peer naming a receiver group with no id, a too long one, or with no or
/// too many members, is refused before anything is held.
#[test]
fn malformed_receiver_groups_are_refused_before_anything_is_held() {
    let mut p = pair(1, small_slices(), 5);
    p.add_region(1, 2, RegionLayout::dense(1, 1, 4, 64), false, false);
    let open = |id: u64, group: crate::wire::pb::ReceiverGroup| {
        crate::wire::Body::PushOpen(crate::wire::pb::PushOpen {
            transfer_id: id,
            request_id: format!("r{id}"),
            destination: Some(crate::wire::pb::BlockSet {
                region_id: 2,
                layer_start: 0,
                layer_count: 1,
                block_ids: vec![id as u32],
                ..Default::default()
            }),
            block_bytes: 64,
            total_bytes: 64,
            receiver_group: Some(group),
            ..Default::default()
        })
    };
    let group = |id: &str, members| crate::wire::pb::ReceiverGroup {
        id: id.into(),
        members,
    };
    let now = p.now;
    let b = &mut p.sides[1];
    for (id, g) in [
        (1, group("", 2)),
        (2, group("g", 0)),
        (
            3,
            group("g", crate::session::MAX_RECEIVER_GROUP_MEMBERS + 1),
        ),
        (0, group(&"x".repeat(crate::wire::REQUEST_ID_MAX + 1), 1)),
    ] {
        b.session.handle_control(0, open(id, g), now, &b.regions);
    }
    assert_eq!(b.session.active_transfers(), 0);
    let refusals = abort_messages(&mut b.session, now);
    assert_eq!(refusals.len(), 4, "{refusals:?}");
    assert!(
        refusals.iter().all(|m| m.contains("receiver group")),
        "{refusals:?}"
    );
    let too_many = format!("{} members", crate::session::MAX_RECEIVER_GROUP_MEMBERS + 1);
    assert!(refusals[2].contains(&too_many), "{refusals:?}");

    // A well-formed group's member refused at its open (a block that does
    // not exist) is reported to the group as failed, once.
    let mut bad = match open(9, group("g", 2)) {
        crate::wire::Body::PushOpen(o) => o,
        _ => unreachable!(),
    };
    if let Some(d) = bad.destination.as_mut() {
        d.block_ids = vec![99];
    }
    b.session
        .handle_control(0, crate::wire::Body::PushOpen(bad.clone()), now, &b.regions);
    b.session
        .handle_control(0, crate::wire::Body::PushOpen(bad), now, &b.regions);
    let failed: Vec<_> = std::iter::from_fn(|| b.session.poll_event())
        .filter_map(|e| match e {
            Event::Failed {
                transfer_id,
                receiver_group: Some(g),
                ..
            } => Some((transfer_id, g.id)),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec![(9, "g".to_string())]);
}

/// The messages of the aborts a session has to send now (its refusals).
fn abort_messages(session: &mut Session, now: Instant) -> Vec<String> {
    std::iter::from_fn(|| session.poll_transmit(now))
        .filter_map(|t| match t {
            Transmit::Control { msg, .. } => match msg.body {
                Some(crate::wire::Body::Abort(a)) => Some(a.message),
                _ => None,
            },
            _ => None,
        })
        .collect()
}
