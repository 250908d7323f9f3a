//! One-sided (RDMA-style) transfers between two in-memory sessions: each rail has
//! a two-sided connection for control and a one-sided one whose slices the test
//! "fabric" executes by copying between the two sides' regions, as a NIC would,
//! refusing any range outside the granted key.

use std::time::Duration;

use crate::error::TransferError;
use crate::layout::RegionLayout;
use crate::plan::BlockSelection;
use crate::session::*;
use crate::testkit::net::{LinkKind, Net, RailSpec};
use crate::testkit::{deliver, sel};
use crate::wire::ErrorCode;

/// The shared simulated net with, per rail, a stream connection for control
/// (conn = rail) and optionally a queue pair (conn = `QP_BASE` + rail) whose
/// posted work the net executes as a NIC would.
type Fabric = Net;

const QP_BASE: usize = 2;

fn fabric(rails: usize, qps: bool) -> Fabric {
    assert_eq!(rails, QP_BASE);
    let config = SessionConfig {
        slice_bytes: 64 << 10,
        ..SessionConfig::default()
    };
    let mut f = Net::new(
        [config.clone(), config],
        &[RailSpec::shuffling(); QP_BASE],
        0,
    );
    for r in 0..rails {
        assert_eq!(f.connect(r as u32, LinkKind::Stream), r);
        assert_eq!(f.links[r].ids, [r, r]);
    }
    if qps {
        for r in 0..rails {
            let link = f.connect(r as u32, LinkKind::OneSided);
            assert_eq!(f.links[link].ids, [QP_BASE + r; 2]);
        }
    }
    f
}

/// What the one-sided tests do on the net.
trait FabricExt {
    fn transfer(&self, id: u64, local: BlockSelection, remote: BlockSelection) -> LocalTransfer;
    fn counts(&self) -> (usize, usize, usize);
    fn posted_on(&self, rail: usize) -> bool;
    fn drop_posted(&mut self);
    fn deliver_control(&mut self) -> bool;
    fn exchange_control(&mut self);
    fn run(&mut self);
    fn kill_qp(&mut self, rail: usize);
    fn cut_stream(&mut self, conn: usize);
    fn done(&self, side: usize, id: u64) -> bool;
    fn failure(&self, side: usize, id: u64) -> Option<&TransferError>;
}

impl FabricExt for Fabric {
    fn transfer(&self, id: u64, local: BlockSelection, remote: BlockSelection) -> LocalTransfer {
        LocalTransfer {
            transfer_id: id,
            request_id: format!("req-{id}"),
            local_layout: self.sides[0].regions.0[&local.region_id].layout,
            staged: self.sides[0].regions.0[&local.region_id].staged,
            local,
            remote,
            local_geometry: None,
            receiver_group: None,
        }
    }

    /// Slices sent: (two-sided, one-sided writes, one-sided reads).
    fn counts(&self) -> (usize, usize, usize) {
        (
            self.stats.two_sided_slices(),
            self.stats.one_sided_writes,
            self.stats.one_sided_reads,
        )
    }

    /// Whether work posted on `rail`'s queue pair has not run yet.
    fn posted_on(&self, rail: usize) -> bool {
        self.wires[QP_BASE + rail].iter().any(|w| !w.is_empty())
    }

    /// Nothing posted runs (a reader gone silent).
    fn drop_posted(&mut self) {
        for link in QP_BASE..self.wires.len() {
            for w in &mut self.wires[link] {
                w.clear();
            }
        }
    }

    /// Delivers the head of every control wire; false if all were empty.
    fn deliver_control(&mut self) -> bool {
        let mut moved = false;
        for c in 0..QP_BASE {
            for dir in 0..2 {
                if !self.wires[c][dir].is_empty() {
                    self.arrive(c, dir);
                    moved = true;
                }
            }
        }
        moved
    }

    /// A few rounds of control traffic only (the grant arrives, work is posted,
    /// nothing executes yet), so a test can break queue pairs mid-transfer.
    fn exchange_control(&mut self) {
        for _ in 0..4 {
            self.flush();
            self.deliver_control();
        }
        self.flush();
    }

    /// Runs until nothing is in flight: control and posted work in the
    /// order they arrive.
    fn run(&mut self) {
        self.drive();
    }

    /// Both ends of queue pair `rail` fail; its posted work is lost.
    fn kill_qp(&mut self, rail: usize) {
        self.kill(QP_BASE + rail, "queue pair error");
    }

    /// Both ends of stream connection `conn` break; what its wires held is lost.
    fn cut_stream(&mut self, conn: usize) {
        self.kill(conn, "test cut the connection");
    }

    fn done(&self, side: usize, id: u64) -> bool {
        self.sides[side]
            .events
            .iter()
            .any(|e| matches!(e, Event::Done { transfer_id, .. } if *transfer_id == id))
    }

    fn failure(&self, side: usize, id: u64) -> Option<&TransferError> {
        self.sides[side].events.iter().find_map(|e| match e {
            Event::Failed {
                transfer_id, error, ..
            } if *transfer_id == id => Some(error),
            _ => None,
        })
    }
}

fn layout() -> RegionLayout {
    RegionLayout::dense(16, 2, 32, 4096)
}

/// Source region 1 on side `src`, destination 2 on the other, both granting both rails.
fn setup(f: &mut Fabric, src: usize) {
    f.sides[src].regions.add(1, layout(), true, true);
    f.sides[1 - src].regions.add(2, layout(), false, true);
    f.sides[src].regions.grant_rails(1, &[0, 1]);
    f.sides[1 - src].regions.grant_rails(2, &[0, 1]);
}

/// As `setup(f, 0)`, and source region 3 on side 1 with destination 4 on
/// side 0 (for pulls by side 0), both granting both rails.
/// Two rails with queue pairs; side 0 has started pull 9 of side 1's region 1
/// into its region 2 (source and destination blocks returned).
fn started_pull() -> (Fabric, Vec<u32>, Vec<u32>) {
    let mut f = fabric(2, true);
    setup(&mut f, 1);
    let (sb, db) = blocks();
    let req = f.transfer(9, sel(2, (0, 16), &db), sel(1, (0, 16), &sb));
    f.sides[0].session.start_pull(req, f.now).unwrap();
    (f, sb, db)
}

fn setup_both_ways(f: &mut Fabric) {
    setup(f, 0);
    f.sides[1].regions.add(3, layout(), true, true);
    f.sides[1].regions.grant_rails(3, &[0, 1]);
    f.sides[0].regions.add(4, layout(), false, true);
    f.sides[0].regions.grant_rails(4, &[0, 1]);
}

fn blocks() -> (Vec<u32>, Vec<u32>) {
    // Scattered on both sides, so remote pieces are not contiguous either.
    let src: Vec<u32> = (0..16).map(|i| i * 2).collect();
    let dst: Vec<u32> = (0..16).map(|i| 31 - i * 2).collect();
    (src, dst)
}

/// Every selected block of `dst` equals the matching block of `src`.
fn verify(f: &Fabric, src: (usize, u64, &[u32]), dst: (usize, u64, &[u32])) {
    verify_layers(f, 0..layout().num_layers, src, dst);
}

/// As [`verify`], for `layers` only.
fn verify_layers(
    f: &Fabric,
    layers: std::ops::Range<u32>,
    src: (usize, u64, &[u32]),
    dst: (usize, u64, &[u32]),
) {
    let l = layout();
    let s = &f.sides[src.0].regions.0[&src.1].bytes;
    let d = &f.sides[dst.0].regions.0[&dst.1].bytes;
    for layer in layers {
        for plane in 0..l.planes_per_layer {
            for (&a, &b) in src.2.iter().zip(dst.2) {
                let so = l.block_offset(layer, plane, a) as usize;
                let dof = l.block_offset(layer, plane, b) as usize;
                assert!(
                    s[so..so + 4096] == d[dof..dof + 4096],
                    "layer {layer} plane {plane} block {a}->{b} differs"
                );
            }
        }
    }
}

#[test]
fn push_is_written_one_sided_after_the_grant() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    let (sb, db) = blocks();
    let req = f.transfer(7, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.run();
    assert!(f.done(0, 7) && f.done(1, 7), "{:?}", f.sides[0].events);
    assert_eq!(f.counts().0, 0, "no two-sided slice");
    assert!(f.counts().1 >= 2, "writes on both rails: {:?}", f.counts());
    assert_eq!(f.stats.out_of_bounds, 0);
    verify(&f, (0, 1, &sb), (1, 2, &db));
    // Nothing outside the granted blocks was touched.
    let l = layout();
    let d = &f.sides[1].regions.0[&2].bytes;
    for layer in 0..16 {
        for plane in 0..2 {
            for b in (0..32).filter(|b| !db.contains(b)) {
                let o = l.block_offset(layer, plane, b) as usize;
                assert!(d[o..o + 4096].iter().all(|&x| x == 0), "block {b} written");
            }
        }
    }
}

#[test]
fn small_pushes_and_pulls_skip_the_grant_and_travel_behind_their_open() {
    let mut f = fabric(2, true);
    setup_both_ways(&mut f);
    // Two layers of one block: 16 KiB, under the 64 KiB default.
    let push = f.transfer(7, sel(1, (0, 2), &[5]), sel(2, (0, 2), &[9]));
    f.sides[0].session.start_push(push, f.now).unwrap();
    // The open and the slice leave together: one flight, no grant first.
    f.flush();
    assert_eq!(f.wires[0][0].len() + f.wires[1][0].len(), 2);
    let pull = f.transfer(8, sel(4, (0, 2), &[3]), sel(3, (0, 2), &[6]));
    f.sides[0].session.start_pull(pull, f.now).unwrap();
    f.run();
    assert!(f.done(0, 7) && f.done(1, 7), "{:?}", f.sides[0].events);
    assert!(f.done(0, 8) && f.done(1, 8), "{:?}", f.sides[0].events);
    assert_eq!(f.stats.grants, 0, "no grant round trip");
    assert_eq!((f.counts().1, f.counts().2), (0, 0), "nothing one-sided");
    assert!(f.counts().0 >= 2);
    verify_layers(&f, 0..2, (0, 1, &[5]), (1, 2, &[9]));
    verify_layers(&f, 0..2, (1, 3, &[6]), (0, 4, &[3]));
    // Above the limit the same push asks for the grant and writes one-sided.
    let big = f.transfer(10, sel(1, (0, 16), &[5, 6]), sel(2, (0, 16), &[20, 21]));
    f.sides[0].session.start_push(big, f.now).unwrap();
    f.run();
    assert!(f.done(1, 10));
    assert_eq!(f.stats.grants, 1);
    assert!(f.counts().1 >= 1);
    verify(&f, (0, 1, &[5, 6]), (1, 2, &[20, 21]));
}

/// Staged memory (GPU) has no verbs registration: a large push from it and a
/// large pull into it travel two-sided even where queue pairs are up.
#[test]
fn staged_memory_moves_two_sided_over_rdma_rails() {
    let mut f = fabric(2, true);
    setup_both_ways(&mut f);
    for id in [1, 4] {
        f.sides[0].regions.0.get_mut(&id).unwrap().staged = true;
    }
    let (sb, db) = blocks();
    let push = f.transfer(7, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(push, f.now).unwrap();
    let pull = f.transfer(8, sel(4, (0, 16), &db), sel(3, (0, 16), &sb));
    f.sides[0].session.start_pull(pull, f.now).unwrap();
    f.run();
    assert!(f.done(0, 7) && f.done(1, 7), "{:?}", f.sides[0].events);
    assert!(f.done(0, 8) && f.done(1, 8), "{:?}", f.sides[0].events);
    assert_eq!(f.stats.grants, 0, "no grant asked for staged memory");
    assert_eq!((f.counts().1, f.counts().2), (0, 0), "nothing one-sided");
    verify(&f, (0, 1, &sb), (1, 2, &db));
    verify(&f, (1, 3, &sb), (0, 4, &db));
}

#[test]
fn pull_is_read_one_sided_and_the_server_only_grants() {
    let (mut f, sb, db) = started_pull();
    f.run();
    assert!(f.done(0, 9) && f.done(1, 9));
    assert_eq!(f.counts(), (0, 0, f.counts().2));
    assert!(f.counts().2 >= 2);
    verify(&f, (1, 1, &sb), (0, 2, &db));
}

#[test]
fn a_region_without_keys_declines_and_the_push_goes_two_sided() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    f.sides[1].regions.0.get_mut(&2).unwrap().keys.clear();
    let (sb, db) = blocks();
    let req = f.transfer(3, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.run();
    assert!(f.done(0, 3) && f.done(1, 3));
    assert_eq!((f.counts().1, f.counts().2), (0, 0));
    assert!(f.counts().0 > 0);
    verify(&f, (0, 1, &sb), (1, 2, &db));
}

#[test]
fn losing_every_queue_pair_mid_push_finishes_over_streams() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    let (sb, db) = blocks();
    let req = f.transfer(4, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    // Let the grant arrive and some writes go out, then lose rail 1's QP, then rail 0's.
    f.exchange_control();
    assert!(f.counts().1 > 0, "writes were posted before the loss");
    f.kill_qp(1);
    f.kill_qp(0);
    f.run();
    assert!(f.done(0, 4) && f.done(1, 4), "{:?}", f.sides[0].events);
    assert!(f.counts().0 > 0, "the rest went two-sided");
    verify(&f, (0, 1, &sb), (1, 2, &db));
}

#[test]
fn losing_every_queue_pair_mid_pull_asks_the_server_to_send() {
    let mut f = fabric(2, true);
    setup(&mut f, 1);
    let (sb, db) = blocks();
    let req = f.transfer(5, sel(2, (0, 16), &db), sel(1, (0, 16), &sb));
    f.sides[0].session.start_pull(req, f.now).unwrap();
    f.exchange_control();
    assert!(f.counts().2 > 0, "reads were posted before the loss");
    f.kill_qp(0);
    f.kill_qp(1);
    f.run();
    assert!(f.done(0, 5) && f.done(1, 5), "{:?}", f.sides[0].events);
    assert!(f.counts().0 > 0, "the server sent the rest");
    verify(&f, (1, 1, &sb), (0, 2, &db));
}

#[test]
fn one_rail_losing_its_queue_pair_moves_its_slices_to_the_other() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    let (sb, db) = blocks();
    let req = f.transfer(6, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.exchange_control();
    assert!(f.posted_on(1), "rail 1 carried writes");
    f.kill_qp(1);
    f.run();
    assert!(f.done(0, 6) && f.done(1, 6));
    assert_eq!(f.counts().0, 0, "stayed one-sided on rail 0");
    verify(&f, (0, 1, &sb), (1, 2, &db));
}

#[test]
fn a_grant_smaller_than_its_layout_fails_the_transfer() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    for k in &mut f.sides[1].regions.0.get_mut(&2).unwrap().keys {
        k.length = 4096;
    }
    let (sb, db) = blocks();
    let req = f.transfer(8, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.run();
    match f.failure(0, 8) {
        Some(TransferError::Peer { code, message }) => {
            assert_eq!(*code, ErrorCode::Protocol);
            assert!(message.contains("does not fit"), "{message}");
        }
        other => panic!("expected a protocol failure, got {other:?}"),
    }
    assert_eq!(f.counts(), (0, 0, 0), "nothing was written");
    assert!(f.failure(1, 8).is_some(), "the receiver heard of it");
}

/// A one-sided push's or pull's open (or the grant answering it) dies with the
/// stream connection that carried it: the opener sends the open again on the
/// other rail, the peer grants again (serving once), and the transfer
/// completes one-sided instead of waiting out its timeout.
#[test]
fn an_open_or_grant_lost_with_its_connection_is_sent_again() {
    for (push, lose_grant) in [(true, false), (true, true), (false, false), (false, true)] {
        let mut f = fabric(2, true);
        setup(&mut f, if push { 0 } else { 1 });
        let (sb, db) = blocks();
        let req = if push {
            f.transfer(7, sel(1, (0, 16), &sb), sel(2, (0, 16), &db))
        } else {
            f.transfer(7, sel(2, (0, 16), &db), sel(1, (0, 16), &sb))
        };
        if push {
            f.sides[0].session.start_push(req, f.now).unwrap();
        } else {
            f.sides[0].session.start_pull(req, f.now).unwrap();
        }
        f.flush();
        let conn = (0..QP_BASE)
            .find(|&c| !f.wires[c][0].is_empty())
            .expect("the open is on a wire");
        if lose_grant {
            // The peer reads the open; its grant goes back on the same connection.
            let item = f.wires[conn][0].pop_front().unwrap();
            let to = &mut f.sides[1];
            deliver(&mut to.session, &mut to.regions, conn, item, f.now);
            f.flush();
            assert_eq!(f.stats.grants, 1);
        }
        f.cut_stream(conn);
        f.run();
        let case = format!("push {push}, grant lost {lose_grant}");
        assert!(
            f.done(0, 7) && f.done(1, 7),
            "{case}: {:?}",
            f.sides[0].events
        );
        assert!(
            f.failure(0, 7).is_none() && f.failure(1, 7).is_none(),
            "{case}"
        );
        assert_eq!(f.counts().0, 0, "{case}: no two-sided slice");
        assert_eq!(f.stats.out_of_bounds, 0, "{case}");
        if push {
            verify(&f, (0, 1, &sb), (1, 2, &db));
        } else {
            verify(&f, (1, 1, &sb), (0, 2, &db));
        }
    }
}

/// A peer repeating a one-sided open gets a few grants back at most, not one
/// per copy.
#[test]
fn repeated_opens_get_a_bounded_number_of_grants() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    let (sb, db) = blocks();
    let req = f.transfer(7, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.flush();
    let conn = (0..QP_BASE)
        .find(|&c| !f.wires[c][0].is_empty())
        .expect("the open is on a wire");
    let open = f.wires[conn][0].pop_front().unwrap();
    let open_copy = match &open {
        crate::testkit::Item::Control(b) => crate::testkit::Item::Control(b.clone()),
        _ => panic!("the open is a control message"),
    };
    let to = &mut f.sides[1];
    deliver(&mut to.session, &mut to.regions, conn, open, f.now);
    f.flush();
    assert_eq!(f.stats.grants, 1);
    // The same open again, as the pusher would send it after a cut.
    let crate::testkit::Item::Control(body) = open_copy else {
        panic!("not a control item");
    };
    for _ in 0..50 {
        let to = &mut f.sides[1];
        to.session
            .handle_control(conn, body.clone(), f.now, &to.regions);
        f.flush();
    }
    assert_eq!(
        f.stats.grants,
        1 + usize::from(MAX_REGRANTS),
        "fifty copies of the open"
    );
    // Past the bound the receiver fails the transfer and says so, so the
    // pusher fails now instead of waiting out its progress timeout.
    let failure = |events: &[Event]| {
        events.iter().find_map(|e| match e {
            Event::Failed {
                transfer_id: 7,
                error,
                ..
            } => Some(error.clone()),
            _ => None,
        })
    };
    let failed_here = failure(&f.sides[1].events);
    assert!(
        matches!(
            &failed_here,
            Some(TransferError::Peer { code: ErrorCode::Protocol, message }) if message.contains("again more than")
        ),
        "the receiver failed it as the peer's fault: {failed_here:?}"
    );
    while f.deliver_control() {
        f.flush();
    }
    let failed_there = failure(&f.sides[0].events);
    assert!(
        matches!(
            &failed_there,
            Some(TransferError::Peer { code: ErrorCode::Protocol, message }) if message.contains("again more than")
        ),
        "the pusher heard why: {failed_there:?}"
    );
    assert!(
        !f.sides[0]
            .events
            .iter()
            .any(|e| matches!(e, Event::Done { transfer_id: 7, .. })),
        "and did not complete"
    );
}

/// A one-sided pull lost its queue pairs and asked the server to send instead;
/// that (two-sided) open then died with its connection: the copy sent again
/// asks for the same, and the pull completes over the surviving stream.
#[test]
fn a_fallen_back_pull_whose_open_is_lost_asks_again_two_sided() {
    let (mut f, sb, db) = started_pull();
    f.exchange_control();
    f.kill_qp(0);
    f.kill_qp(1);
    f.flush();
    let conn = (0..QP_BASE)
        .find(|&c| {
            f.wires[c][0].iter().any(|i| {
                matches!(i, crate::testkit::Item::Control(crate::wire::Body::PullOpen(o)) if !o.one_sided)
            })
        })
        .expect("the two-sided open is on a wire");
    f.cut_stream(conn);
    f.run();
    assert!(f.done(0, 9) && f.done(1, 9), "{:?}", f.sides[0].events);
    assert_eq!(f.stats.out_of_bounds, 0);
    verify(&f, (1, 1, &sb), (0, 2, &db));
}

/// A pull's in-flight slices are its own RDMA reads, settled by their
/// completions: a SliceAck from the serving peer naming one of them (forged,
/// or a broken peer's) changes nothing, and the pull still finishes.
#[test]
fn a_peer_acknowledging_a_pulls_own_reads_cannot_stall_it() {
    let (mut f, sb, db) = started_pull();
    f.exchange_control();
    let reads: Vec<(u64, u32)> = f
        .wires
        .iter()
        .flatten()
        .flat_map(|w| w.posted())
        .filter(|p| p.from == 0 && p.remote.op == OneSidedOp::Read)
        .map(|p| (p.header.offset, p.len))
        .collect();
    assert!(!reads.is_empty(), "reads are posted after the grant");
    for &(offset, len) in &reads {
        let forged = crate::wire::Body::SliceAck(crate::wire::pb::SliceAck {
            transfer_id: 9,
            offset,
            length: u64::from(len),
        });
        let to = &mut f.sides[0];
        to.session.handle_control(0, forged, f.now, &to.regions);
    }
    f.run();
    assert!(f.done(0, 9) && f.done(1, 9), "{:?}", f.sides[0].events);
    verify(&f, (1, 1, &sb), (0, 2, &db));
}

/// A pull served by granting sees no traffic while the reader moves the
/// bytes, so it has no ordinary progress timeout; a reader that never sends
/// Complete (hostile, or wedged with its connections up) must still not
/// keep the serve, and the region it pins, forever.
#[test]
fn a_granted_pull_whose_reader_never_completes_expires() {
    let (mut f, _, _) = started_pull();
    f.exchange_control();
    assert!(f.stats.grants >= 1, "the server granted");
    // The reader goes silent: nothing it posted runs, nothing more arrives.
    f.drop_posted();
    let server = &mut f.sides[1].session;
    assert_eq!(server.active_transfers(), 1);
    let deadline = server.poll_timeout().expect("the serve has a deadline");
    let timeout = SessionConfig::default().progress_timeout;
    assert!(deadline >= f.now + timeout - Duration::from_millis(100));
    server.handle_timeout(deadline - Duration::from_millis(1));
    f.flush();
    assert!(f.failure(1, 9).is_none(), "not before its deadline");
    let server = &mut f.sides[1].session;
    server.handle_timeout(deadline);
    f.flush();
    assert!(
        matches!(f.failure(1, 9), Some(TransferError::Timeout(_))),
        "{:?}",
        f.sides[1].events
    );
    assert_eq!(f.sides[1].session.active_transfers(), 0, "nothing pinned");
}

/// A grant whose layout's strides overflow (a broken or hostile peer) fails
/// the transfer as a protocol error before any arithmetic on it; nothing is
/// written and no panic, however the build checks overflow.
#[test]
fn a_grant_with_an_overflowing_layout_fails_the_transfer_cleanly() {
    let mut f = fabric(2, true);
    setup(&mut f, 0);
    let (sb, db) = blocks();
    let req = f.transfer(8, sel(1, (0, 16), &sb), sel(2, (0, 16), &db));
    f.sides[0].session.start_push(req, f.now).unwrap();
    f.flush();
    f.deliver_control();
    f.flush();
    let (conn, pos) = (0..QP_BASE)
        .find_map(|c| {
            f.wires[c][1]
                .iter()
                .position(|i| {
                    matches!(
                        i,
                        crate::testkit::Item::Control(crate::wire::Body::Grant(_))
                    )
                })
                .map(|p| (c, p))
        })
        .expect("the receiver granted");
    let Some(crate::testkit::Item::Control(crate::wire::Body::Grant(mut grant))) =
        f.wires[conn][1].remove(pos)
    else {
        panic!("not a grant")
    };
    let layout = grant.layout.as_mut().expect("a grant carries its layout");
    layout.layer_stride = u64::MAX;
    layout.block_stride = u64::MAX / 3;
    let to = &mut f.sides[0];
    to.session
        .handle_control(conn, crate::wire::Body::Grant(grant), f.now, &to.regions);
    f.run();
    match f.failure(0, 8) {
        Some(TransferError::Peer { code, message }) => {
            assert_eq!(*code, ErrorCode::Protocol);
            assert!(message.contains("granted layout"), "{message}");
        }
        other => panic!("expected a protocol failure, got {other:?}"),
    }
    assert_eq!((f.counts().1, f.counts().2), (0, 0), "nothing one-sided");
    assert_eq!(f.stats.out_of_bounds, 0);
}

#[test]
fn a_pull_cancelled_while_its_reads_are_posted_ends_once_they_complete() {
    let (mut f, _, _) = started_pull();
    // The grant arrives and the READs are posted; none has completed.
    f.exchange_control();
    assert!(f.posted_on(0) || f.posted_on(1), "READs posted");
    assert!(f.sides[0].session.cancel(9, f.now));
    assert!(
        f.sides[0].session.still_placing(&[9]),
        "the READs still write into our blocks: the pull waits for them"
    );
    // They complete while it fails: its lifecycle stays in the table (the
    // fabric's sides assert no refused transition when dropped).
    f.run();
    assert!(f.failure(0, 9).is_some(), "the cancelled pull ends failed");
    assert!(!f.sides[0].session.still_placing(&[9]));
}
