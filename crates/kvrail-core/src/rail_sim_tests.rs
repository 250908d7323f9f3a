//! Two sessions joined by simulated rails, each with a rate, a latency, loss and
//! scripted cuts, on a simulated clock: striping ratios and every failover path,
//! deterministic and in milliseconds. Side 0 dialed the session (it probes down
//! rails back); side 1 accepted it.

use std::time::Duration;

use crate::error::{FailureSide, TransferError};
use crate::layout::RegionLayout;
use crate::rail::{RailConfig, RailHealth, RailId};
use crate::session::*;
use crate::testkit::net::{Fault, Net, RailAction as Action, RailSpec};
use crate::testkit::sel;

const MB: f64 = 1e6;

/// The shared simulated net, its rails rated: striping and failover in
/// simulated time.
type Sim = Net;

fn rail(rate_mb: f64) -> RailSpec {
    RailSpec::rated(rate_mb)
}

fn config() -> SessionConfig {
    SessionConfig {
        slice_bytes: 1 << 20,
        window_bytes: 8 << 20,
        progress_timeout: Duration::from_secs(10),
        rails: RailConfig::default(),
        probes_rails: true,
        eager_max_bytes: DEFAULT_EAGER_MAX_BYTES,
        staged_slice_bytes: 4 << 20,
        ..SessionConfig::default()
    }
}

/// Rails as `specs`, `conns_per_rail` connections on each; side 0 probes.
fn sim(specs: &[RailSpec], conns_per_rail: usize, seed: u64) -> Sim {
    let mk = |probes| SessionConfig {
        probes_rails: probes,
        ..config()
    };
    let mut net = Net::new([mk(true), mk(false)], specs, seed);
    net.connect_rails(conns_per_rail);
    net.answer_probes = true;
    net.close_down_rails = true;
    net
}

/// What the rail tests do on the net.
trait SimExt {
    fn add_region(&mut self, side: usize, id: u64, layout: RegionLayout, fill: bool);
    fn request(&mut self, side: usize, local: u64, remote: u64, blocks: &[u32]) -> LocalTransfer;
    fn push(&mut self, src: u64, dst: u64, blocks: &[u32]) -> u64;
    fn pull(&mut self, dst: u64, src: u64, blocks: &[u32]) -> u64;
    fn outcome(&self, side: usize, id: u64) -> Option<(Duration, Result<u64, TransferError>)>;
    fn run_transfer(&mut self, id: u64, limit: Duration) -> (Duration, Result<u64, TransferError>);
    fn rail_bytes_sent(&self, side: usize) -> Vec<u64>;
    fn rail_changes(&self, side: usize, rail: RailId) -> Vec<(Duration, RailHealth)>;
    fn assert_copied(&self, src: (usize, u64), dst: (usize, u64));
}

impl SimExt for Sim {
    fn add_region(&mut self, side: usize, id: u64, layout: RegionLayout, fill: bool) {
        self.sides[side].regions.add(id, layout, fill, true);
    }

    fn request(&mut self, side: usize, local: u64, remote: u64, blocks: &[u32]) -> LocalTransfer {
        let layout = self.sides[side].regions.0[&local].layout;
        let id = self.next_transfer_id();
        LocalTransfer {
            transfer_id: id,
            request_id: format!("req-{id}"),
            local: sel(local, (0, layout.num_layers), blocks),
            local_layout: layout,
            remote: sel(remote, (0, layout.num_layers), blocks),
            staged: false,
            local_geometry: None,
            receiver_group: None,
        }
    }

    fn push(&mut self, src: u64, dst: u64, blocks: &[u32]) -> u64 {
        let req = self.request(0, src, dst, blocks);
        let id = req.transfer_id;
        self.sides[0].session.start_push(req, self.now).unwrap();
        id
    }

    fn pull(&mut self, dst: u64, src: u64, blocks: &[u32]) -> u64 {
        let req = self.request(0, dst, src, blocks);
        let id = req.transfer_id;
        self.sides[0].session.start_pull(req, self.now).unwrap();
        id
    }

    /// When transfer `id` ended on side `side`: its time and outcome.
    fn outcome(&self, side: usize, id: u64) -> Option<(Duration, Result<u64, TransferError>)> {
        self.sides[side].timed_events().find_map(|(at, e)| match e {
            Event::Done {
                transfer_id, bytes, ..
            } if *transfer_id == id => Some((at, Ok(*bytes))),
            Event::Failed {
                transfer_id, error, ..
            } if *transfer_id == id => Some((at, Err(error.clone()))),
            _ => None,
        })
    }

    fn run_transfer(&mut self, id: u64, limit: Duration) -> (Duration, Result<u64, TransferError>) {
        self.run_until(limit, |s| s.outcome(0, id).is_some());
        self.outcome(0, id).expect("transfer did not end in time")
    }

    fn rail_bytes_sent(&self, side: usize) -> Vec<u64> {
        self.sides[side]
            .session
            .rail_stats()
            .iter()
            .map(|r| r.bytes_sent)
            .collect()
    }

    fn rail_changes(&self, side: usize, rail: RailId) -> Vec<(Duration, RailHealth)> {
        self.sides[side]
            .timed_events()
            .filter_map(|(at, e)| match e {
                Event::Rail(c) if c.rail == rail => Some((at, c.to)),
                _ => None,
            })
            .collect()
    }

    fn assert_copied(&self, src: (usize, u64), dst: (usize, u64)) {
        let a = &self.sides[src.0].regions.0[&src.1].bytes;
        let b = &self.sides[dst.0].regions.0[&dst.1].bytes;
        assert!(a == b, "destination differs from source");
    }
}

/// 32 MiB in 1 KiB... no: 256 blocks of 128 KiB, a realistic KV block size.
const BLOCKS: u32 = 256;
const BLOCK_BYTES: u64 = 128 << 10;
const TOTAL: u64 = BLOCKS as u64 * BLOCK_BYTES;

fn bulk(specs: &[RailSpec], seed: u64) -> (Sim, Vec<u32>) {
    let mut sim = sim(specs, 2, seed);
    let layout = RegionLayout::dense(1, 1, BLOCKS, BLOCK_BYTES);
    sim.add_region(0, 1, layout, true);
    sim.add_region(1, 2, layout, false);
    // Scattered order: nothing coalesces, so slices gather many pieces.
    let blocks: Vec<u32> = (0..BLOCKS).map(|i| (i * 37) % BLOCKS).collect();
    (sim, blocks)
}

/// Seconds a 32 MiB push takes over `specs`, and the bytes each rail carried.
fn push_time(specs: &[RailSpec]) -> (f64, Vec<u64>) {
    let (mut sim, blocks) = bulk(specs, 1);
    let id = sim.push(1, 2, &blocks);
    let (at, result) = sim.run_transfer(id, Duration::from_secs(30));
    assert_eq!(result, Ok(TOTAL));
    sim.assert_copied((0, 1), (1, 2));
    (at.as_secs_f64(), sim.rail_bytes_sent(0))
}

#[test]
fn equal_rails_double_the_throughput_and_split_evenly() {
    let (single, _) = push_time(&[rail(100.0)]);
    let (dual, split) = push_time(&[rail(100.0), rail(100.0)]);
    let speedup = single / dual;
    assert!(
        speedup >= 1.9,
        "dual-rail speedup {speedup:.2} (single {single:.3}s, dual {dual:.3}s)"
    );
    let share = split[0] as f64 / TOTAL as f64;
    assert!(
        (0.45..=0.55).contains(&share),
        "rail 0 carried {share:.2} of the bytes"
    );
    assert_eq!(split.iter().sum::<u64>(), TOTAL, "nothing re-sent");
}

#[test]
fn unequal_rails_are_both_kept_full() {
    // 1:3 rates: the pair should reach >= 0.9 of the sum, split about 1:3.
    let (dual, split) = push_time(&[rail(50.0), rail(150.0)]);
    let ideal = TOTAL as f64 / (200.0 * MB);
    let efficiency = ideal / dual;
    assert!(
        efficiency >= 0.9,
        "{efficiency:.2} of the summed rate ({dual:.3}s vs ideal {ideal:.3}s)"
    );
    let slow_share = split[0] as f64 / TOTAL as f64;
    assert!(
        (0.2..=0.3).contains(&slow_share),
        "slow rail carried {slow_share:.2}"
    );
}

#[test]
fn latency_does_not_starve_a_rail() {
    // 20 ms each way: the windows must cover the round trip.
    let slow = |r| RailSpec {
        latency: Duration::from_millis(20),
        ..rail(r)
    };
    let (dual, split) = push_time(&[slow(100.0), slow(100.0)]);
    // Ideal: the bytes at the summed rate, plus a round trip for the last ack.
    let ideal = TOTAL as f64 / (200.0 * MB) + 0.040;
    assert!(dual <= ideal * 1.15, "{dual:.3}s vs ideal {ideal:.3}s");
    assert!(split.iter().all(|&b| b > TOTAL / 3), "{split:?}");
}

#[test]
fn a_small_transfer_stays_on_one_rail() {
    let (mut sim, _) = bulk(&[rail(100.0), rail(100.0)], 1);
    // Keep rail 0 busy so the small transfer should pick rail 1.
    let big: Vec<u32> = (0..64).collect();
    let first = sim.push(1, 2, &big);
    let small = sim.push(1, 2, &[200, 201, 202, 203]); // 512 KiB
    sim.flush();
    let before = sim.rail_bytes_sent(0);
    let (_, r) = sim.run_transfer(small, Duration::from_secs(5));
    assert_eq!(r, Ok(4 * BLOCK_BYTES));
    sim.run_transfer(first, Duration::from_secs(5)).1.unwrap();
    // The small transfer's slices all went over one rail: replay it alone to see which.
    let (mut alone, _) = bulk(&[rail(100.0), rail(100.0)], 1);
    let id = alone.push(1, 2, &[200, 201, 202, 203]);
    alone.run_transfer(id, Duration::from_secs(5)).1.unwrap();
    let split = alone.rail_bytes_sent(0);
    assert!(
        split.contains(&0) && split.contains(&(4 * BLOCK_BYTES)),
        "{split:?}"
    );
    assert!(
        before.iter().all(|&b| b > 0),
        "the big transfer used both rails: {before:?}"
    );
}

fn cut_midway(fault: Fault, seed: u64) -> (Sim, f64, f64) {
    let (single, _) = push_time(&[rail(100.0)]);
    let (mut sim, blocks) = bulk(&[rail(100.0), rail(100.0)], seed);
    sim.at(Duration::from_millis(80), 1, Action::Cut(fault));
    let id = sim.push(1, 2, &blocks);
    let (at, result) = sim.run_transfer(id, Duration::from_secs(30));
    assert_eq!(result, Ok(TOTAL), "{fault:?}");
    sim.assert_copied((0, 1), (1, 2));
    (sim, at.as_secs_f64(), single)
}

#[test]
fn a_black_holed_rail_fails_over_without_loss() {
    let (sim, took, single) = cut_midway(Fault::BlackHole, 3);
    // Noticed by the stall deadline: suspect at half of it, down at it.
    let changes = sim.rail_changes(0, 1);
    assert_eq!(changes[0].1, RailHealth::Suspect, "{changes:?}");
    assert_eq!(changes[1].1, RailHealth::Down, "{changes:?}");
    let stall = config().rails.stall_timeout.as_secs_f64();
    assert!(
        changes[1].0.as_secs_f64() <= 0.08 + stall + 0.01,
        "{changes:?}"
    );
    // The accepting side heard it from the peer over the surviving rail.
    assert!(sim
        .rail_changes(1, 1)
        .iter()
        .any(|c| c.1 == RailHealth::Down));
    let stats = &sim.sides[0].session.rail_stats();
    assert!(stats[0].slices_retransmitted > 0, "{stats:?}");
    assert_eq!(stats[1].slices_retransmitted, 0);
    assert!(
        took <= 2.0 * single,
        "took {took:.3}s vs single rail {single:.3}s"
    );
}

#[test]
fn a_reset_rail_fails_over_at_once() {
    let (sim, took, single) = cut_midway(Fault::Reset, 4);
    let changes = sim.rail_changes(0, 1);
    // An error needs no stall deadline: straight down at the cut.
    assert_eq!(changes[0], (Duration::from_millis(80), RailHealth::Down));
    assert!(
        took <= single * 1.1,
        "took {took:.3}s vs single rail {single:.3}s"
    );
}

#[test]
fn a_rail_that_returns_carries_traffic_again() {
    let (mut sim, blocks) = bulk(&[rail(100.0), rail(100.0)], 5);
    sim.at(Duration::from_millis(50), 1, Action::Cut(Fault::BlackHole));
    sim.at(Duration::from_millis(1500), 1, Action::Restore);
    let first = sim.push(1, 2, &blocks);
    sim.run_transfer(first, Duration::from_secs(30)).1.unwrap();
    sim.assert_copied((0, 1), (1, 2));
    // Probing finds the rail again once it is back.
    let restored = Duration::from_millis(1500);
    sim.run_until(Duration::from_secs(20), |s| {
        s.elapsed() > restored && s.rail_changes(0, 1).last().map(|c| c.1) == Some(RailHealth::Up)
    });
    let changes = sim.rail_changes(0, 1);
    let (up_again, _) = *changes
        .iter()
        .find(|(at, h)| *h == RailHealth::Up && *at >= restored)
        .unwrap_or_else(|| panic!("rail 1 never came back: {changes:?}"));
    // Probes back off to at most 2 s: re-admitted within that of returning.
    assert!(up_again <= restored + Duration::from_secs(2), "{changes:?}");
    assert!(changes.iter().any(|c| c.1 == RailHealth::Probing));
    // The acceptor replaced its stale connections and sees the rail up too.
    assert_eq!(
        sim.rail_changes(1, 1).last().map(|c| c.1),
        Some(RailHealth::Up)
    );
    // And the next transfer uses it.
    sim.sides[1].regions.0.get_mut(&2).unwrap().bytes.fill(0);
    let before = sim.rail_bytes_sent(0)[1];
    let second = sim.push(1, 2, &blocks);
    sim.run_transfer(second, Duration::from_secs(30)).1.unwrap();
    sim.assert_copied((0, 1), (1, 2));
    let carried = sim.rail_bytes_sent(0)[1] - before;
    assert!(
        carried > TOTAL / 3,
        "rail 1 carried {carried} of {TOTAL} after returning"
    );
}

#[test]
fn both_rails_cut_fails_within_the_deadline_then_recovers() {
    let (mut sim, blocks) = bulk(&[rail(100.0), rail(100.0)], 6);
    let cut = Duration::from_millis(60);
    sim.at(cut, 0, Action::Cut(Fault::BlackHole));
    sim.at(cut, 1, Action::Cut(Fault::BlackHole));
    let id = sim.push(1, 2, &blocks);
    let (at, result) = sim.run_transfer(id, Duration::from_secs(30));
    let Err(error) = result else {
        panic!("transfer succeeded over dead rails")
    };
    assert_eq!(error.side(), FailureSide::Rail);
    assert!(matches!(error, TransferError::RailsDown { .. }), "{error}");
    assert!(error.to_string().contains("no acknowledgement"), "{error}");
    let rails = config().rails;
    assert!(
        at <= cut + rails.stall_timeout + rails.all_down_deadline + Duration::from_millis(10),
        "failed at {at:?}"
    );
    // The receiver hears nothing on dead rails: its own progress deadline ends it.
    sim.run_until(Duration::from_secs(30), |s| s.outcome(1, id).is_some());
    assert!(sim.outcome(1, id).unwrap().1.is_err());
    // A rail comes back: once probed up, the next transfer goes through.
    let back = sim.elapsed() + Duration::from_millis(100);
    sim.at(back, 0, Action::Restore);
    sim.run_until(back + Duration::from_secs(5), |s| {
        s.sides[0].session.rail_stats()[0].health == RailHealth::Up
    });
    sim.sides[1].regions.0.get_mut(&2).unwrap().bytes.fill(0);
    let next = sim.push(1, 2, &blocks);
    let (_, result) = sim.run_transfer(next, Duration::from_secs(60));
    assert_eq!(result, Ok(TOTAL));
    sim.assert_copied((0, 1), (1, 2));
}

#[test]
fn a_pull_survives_the_serving_side_losing_a_rail() {
    // Here the accepting side sends the data and sees the stall; the dialer learns
    // of it from a RailDown message and probes the rail back.
    let (mut sim, blocks) = bulk(&[rail(100.0), rail(100.0)], 7);
    let layout = RegionLayout::dense(1, 1, BLOCKS, BLOCK_BYTES);
    sim.add_region(1, 3, layout, true);
    sim.add_region(0, 4, layout, false);
    sim.at(Duration::from_millis(80), 0, Action::Cut(Fault::BlackHole));
    sim.at(Duration::from_millis(600), 0, Action::Restore);
    let id = sim.pull(4, 3, &blocks);
    let (_, result) = sim.run_transfer(id, Duration::from_secs(30));
    assert_eq!(result, Ok(TOTAL));
    sim.assert_copied((1, 3), (0, 4));
    assert!(sim.sides[1].session.rail_stats()[1].slices_retransmitted > 0);
    sim.run_until(Duration::from_secs(10), |s| {
        s.rail_changes(0, 0).last().map(|c| c.1) == Some(RailHealth::Up)
    });
    let changes = sim.rail_changes(0, 0);
    assert!(
        changes.iter().any(|c| c.1 == RailHealth::Down),
        "{changes:?}"
    );
    assert_eq!(
        changes.last().map(|c| c.1),
        Some(RailHealth::Up),
        "{changes:?}"
    );
}

#[test]
fn a_lossy_rail_still_delivers_every_byte() {
    let lossy = RailSpec {
        loss: 0.05,
        ..rail(100.0)
    };
    let (mut sim, blocks) = bulk(&[lossy, rail(100.0)], 8);
    let id = sim.push(1, 2, &blocks);
    let (_, result) = sim.run_transfer(id, Duration::from_secs(30));
    assert_eq!(result, Ok(TOTAL));
    sim.assert_copied((0, 1), (1, 2));
}

#[test]
fn a_flapping_rail_never_loses_bytes_or_connection_slots() {
    let (mut sim, blocks) = bulk(&[rail(100.0), rail(100.0)], 9);
    for k in 0..12u64 {
        let base = Duration::from_millis(400 * k);
        let fault = if k % 2 == 0 {
            Fault::Reset
        } else {
            Fault::BlackHole
        };
        sim.at(base + Duration::from_millis(30), 1, Action::Cut(fault));
        sim.at(base + Duration::from_millis(200), 1, Action::Restore);
    }
    for round in 0..8 {
        sim.sides[1].regions.0.get_mut(&2).unwrap().bytes.fill(0);
        let id = sim.push(1, 2, &blocks);
        let (_, result) = sim.run_transfer(id, Duration::from_secs(120));
        assert_eq!(result, Ok(TOTAL), "round {round}");
        sim.assert_copied((0, 1), (1, 2));
    }
    let flaps = sim
        .rail_changes(0, 1)
        .iter()
        .filter(|c| c.1 == RailHealth::Down)
        .count();
    assert!(flaps >= 3, "rail 1 went down only {flaps} times");
}

/// A receiver stopped for 0.7 s while one single-slice push is in flight (a GC
/// pause, SIGSTOP, CPU starvation): the push completes, and the rail that went
/// suspect must resolve (back up), so later pushes go through. It used to stay
/// suspect for good: the push's Complete released its slice without telling the
/// rail, and nothing outstanding meant no stall deadline either.
#[test]
fn a_paused_receiver_never_wedges_a_rail() {
    let mut sim = sim(&[rail(100.0)], 2, 21);
    let layout = RegionLayout::dense(1, 1, 16, 64 << 10);
    sim.add_region(0, 1, layout, true);
    sim.add_region(1, 2, layout, false);
    // 1 MiB: one slice.
    let blocks: Vec<u32> = (0..16).collect();
    let id = sim.push(1, 2, &blocks);
    sim.pause_receiver(Duration::from_millis(700));
    let (_, result) = sim.run_transfer(id, Duration::from_secs(30));
    assert_eq!(result, Ok(16 << 16));
    let changes = sim.rail_changes(0, 0);
    assert!(
        changes.iter().any(|c| c.1 == RailHealth::Suspect),
        "the pause should have made the rail suspect: {changes:?}"
    );
    // Whatever it went through, the rail ends up carrying traffic again.
    sim.run_until(Duration::from_secs(10), |s| {
        s.sides[0].session.rail_stats()[0].health == RailHealth::Up
    });
    assert_eq!(
        sim.sides[0].session.rail_stats()[0].health,
        RailHealth::Up,
        "{:?}",
        sim.rail_changes(0, 0)
    );
    for round in 0..5 {
        let id = sim.push(1, 2, &blocks);
        let (_, result) = sim.run_transfer(id, Duration::from_secs(60));
        assert_eq!(result, Ok(16 << 16), "push {round} after the pause");
    }
}

/// A suspect rail with nothing left outstanding (its slices' transfers were
/// cancelled) still resolves: down after the stall limit, then probed back up.
#[test]
fn a_suspect_rail_with_nothing_outstanding_still_resolves() {
    let mut sim = sim(&[rail(100.0)], 2, 22);
    let layout = RegionLayout::dense(1, 1, 16, 64 << 10);
    sim.add_region(0, 1, layout, true);
    sim.add_region(1, 2, layout, false);
    let blocks: Vec<u32> = (0..16).collect();
    let id = sim.push(1, 2, &blocks);
    sim.pause_receiver(Duration::from_secs(3));
    sim.run_until(Duration::from_secs(2), |s| {
        s.sides[0].session.rail_stats()[0].health == RailHealth::Suspect
    });
    assert_eq!(
        sim.sides[0].session.rail_stats()[0].health,
        RailHealth::Suspect
    );
    let now = sim.now;
    sim.sides[0].session.cancel(id, now);
    sim.run_until(Duration::from_secs(20), |s| {
        s.sides[0].session.rail_stats()[0].health == RailHealth::Up && !s.is_paused(1)
    });
    let changes = sim.rail_changes(0, 0);
    assert_eq!(
        sim.sides[0].session.rail_stats()[0].health,
        RailHealth::Up,
        "{changes:?}"
    );
    let id = sim.push(1, 2, &blocks);
    let (_, result) = sim.run_transfer(id, Duration::from_secs(60));
    assert_eq!(result, Ok(16 << 16));
}

/// A rail that is alive but slower than the stall limit assumes (a 1 MiB slice
/// takes longer than a second to be acknowledged: a loaded host, a slow
/// fallback path) must still carry the transfer: after a stall it restarts
/// with small slices and a longer patience instead of cutting and resending the
/// same big slices for ever.
#[test]
fn a_slow_but_alive_rail_still_completes() {
    let mut sim = sim(&[rail(0.8)], 2, 23);
    const N: u32 = 64;
    let layout = RegionLayout::dense(1, 1, N, BLOCK_BYTES);
    sim.add_region(0, 1, layout, true);
    sim.add_region(1, 2, layout, false);
    let blocks: Vec<u32> = (0..N).collect();
    let id = sim.push(1, 2, &blocks);
    let (at, result) = sim.run_transfer(id, Duration::from_secs(120));
    let changes = sim.rail_changes(0, 0);
    assert_eq!(result, Ok(N as u64 * BLOCK_BYTES), "{changes:?}");
    sim.assert_copied((0, 1), (1, 2));
    let ideal = (N as u64 * BLOCK_BYTES) as f64 / (0.8 * MB);
    assert!(
        at.as_secs_f64() <= 2.0 * ideal,
        "{:.1}s against an ideal {ideal:.1}s: {changes:?}",
        at.as_secs_f64()
    );
}
