//! Rails: one network path to a peer (a local interface or address paired with a
//! peer address) carrying one or more connections.
//!
//! Each rail has a health state machine, declared below as a transition table, a
//! delivery-rate estimate that the scheduler weighs rails by, and the counters the
//! sidecar exports as per-rail metrics.

use std::time::{Duration, Instant};

/// Index of a rail inside a session (the position of its address in the peer's config).
pub type RailId = u32;

/// How usable a rail is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RailHealth {
    /// Carries new slices.
    Up,
    /// Unacknowledged bytes have waited too long: no new slices, but what is on it
    /// may still arrive.
    Suspect,
    /// Dead: its connections are closed and their slices re-sent elsewhere.
    Down,
    /// The dialing side is rebuilding its connections.
    Probing,
}

impl RailHealth {
    pub fn as_str(self) -> &'static str {
        match self {
            RailHealth::Up => "up",
            RailHealth::Suspect => "suspect",
            RailHealth::Down => "down",
            RailHealth::Probing => "probing",
        }
    }

    /// Numeric value of the state gauge (0 up, 1 suspect, 2 down, 3 probing).
    pub fn gauge(self) -> f64 {
        match self {
            RailHealth::Up => 0.0,
            RailHealth::Suspect => 1.0,
            RailHealth::Down => 2.0,
            RailHealth::Probing => 3.0,
        }
    }

    /// Whether slices already on the rail may still complete.
    pub fn is_connected(self) -> bool {
        matches!(self, RailHealth::Up | RailHealth::Suspect)
    }
}

/// What happened to a rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailSignal {
    /// The peer acknowledged bytes sent on the rail.
    Acked,
    /// Bytes on the rail went unacknowledged past a stall deadline.
    Stalled,
    /// Its last connection broke, or the peer reported the rail dead.
    Failed,
    /// The backoff after going down ran out: time to rebuild connections.
    ProbeDue,
    /// A connection on the rail completed its handshake.
    Connected,
    /// Rebuilding the connections failed.
    ProbeFailed,
}

/// A signal the rail's current state does not accept (a bug in the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rail in state {from:?} cannot take {signal:?}")]
pub struct IllegalRailTransition {
    pub from: RailHealth,
    pub signal: RailSignal,
}

use RailHealth as H;
use RailSignal as S;

/// Every legal (state, signal) -> state move. Anything else is an error value.
pub const RAIL_TRANSITIONS: &[(RailHealth, RailSignal, RailHealth)] = &[
    (H::Up, S::Acked, H::Up),
    (H::Up, S::Connected, H::Up),
    (H::Up, S::Stalled, H::Suspect),
    (H::Up, S::Failed, H::Down),
    (H::Suspect, S::Acked, H::Up),
    (H::Suspect, S::Connected, H::Suspect),
    (H::Suspect, S::Stalled, H::Down),
    (H::Suspect, S::Failed, H::Down),
    (H::Down, S::Failed, H::Down),
    (H::Down, S::ProbeDue, H::Probing),
    (H::Down, S::Connected, H::Up),
    (H::Probing, S::Connected, H::Up),
    (H::Probing, S::ProbeFailed, H::Down),
    (H::Probing, S::Failed, H::Down),
];

impl RailHealth {
    /// The state after `signal`, per [`RAIL_TRANSITIONS`].
    pub fn on(self, signal: RailSignal) -> Result<RailHealth, IllegalRailTransition> {
        RAIL_TRANSITIONS
            .iter()
            .find(|(from, s, _)| *from == self && *s == signal)
            .map(|(_, _, to)| *to)
            .ok_or(IllegalRailTransition { from: self, signal })
    }
}

/// Tunables of rail scheduling and health.
#[derive(Debug, Clone)]
pub struct RailConfig {
    /// Longest a rail's unacknowledged bytes may wait for an ack before it goes
    /// down (half of it makes it suspect). Once the rail's rate is known the
    /// deadline shrinks to 8x the time its queue should take to drain, but never
    /// below `stall_floor`.
    pub stall_timeout: Duration,
    pub stall_floor: Duration,
    /// Transfers fail once every rail has been down this long.
    pub all_down_deadline: Duration,
    /// First wait before probing a down rail; doubles per failed probe.
    pub probe_backoff_initial: Duration,
    /// Longest wait between probes.
    pub probe_backoff_max: Duration,
    /// Queueing a rail may hold beyond its round trip (at its estimated rate): the
    /// window is rate x (round trip + this).
    pub queue_target: Duration,
    /// Window of a rail whose rate is not measured yet.
    pub initial_window_bytes: u64,
    /// Smallest slice the per-rail slice sizing may choose.
    pub min_slice_bytes: u64,
    /// Transfers up to this size stay on one rail instead of being striped.
    pub stripe_threshold: u64,
}

impl Default for RailConfig {
    fn default() -> Self {
        Self {
            stall_timeout: Duration::from_millis(1000),
            stall_floor: Duration::from_millis(300),
            all_down_deadline: Duration::from_secs(5),
            probe_backoff_initial: Duration::from_millis(250),
            probe_backoff_max: Duration::from_secs(2),
            queue_target: Duration::from_millis(25),
            initial_window_bytes: 4 << 20,
            min_slice_bytes: 128 << 10,
            stripe_threshold: 1 << 20,
        }
    }
}

/// Most doublings of the stall limit of a rail that keeps stalling (8x: under
/// the transfers' own progress timeout, so a dead rail is still found first).
const MAX_STALL_DOUBLINGS: u32 = 3;

/// Delivery rate of a rail, measured over the time it had bytes outstanding.
#[derive(Debug, Clone, Default)]
pub struct RateEstimator {
    rate: Option<f64>,
    sample_start: Option<Instant>,
    sample_bytes: u64,
}

/// Shortest busy interval that makes one rate sample (shorter ones are noise).
const MIN_SAMPLE: Duration = Duration::from_millis(5);
/// Weight of a new sample in the moving average.
const EWMA_GAIN: f64 = 0.25;

impl RateEstimator {
    /// Bytes per second, once measured.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The rail went from idle to busy.
    pub fn on_busy(&mut self, now: Instant) {
        self.sample_start = Some(now);
        self.sample_bytes = 0;
    }

    /// `len` bytes were acknowledged; `still_busy` says whether more are outstanding.
    pub fn on_acked(&mut self, len: u64, now: Instant, still_busy: bool) {
        let Some(start) = self.sample_start else {
            return;
        };
        self.sample_bytes += len;
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= MIN_SAMPLE {
            let sample = self.sample_bytes as f64 / elapsed.as_secs_f64();
            self.rate = Some(match self.rate {
                Some(r) => r + EWMA_GAIN * (sample - r),
                None => sample,
            });
            self.sample_start = Some(now);
            self.sample_bytes = 0;
        }
        if !still_busy {
            self.sample_start = None;
        }
    }

    /// Forgets everything (a rebuilt rail may be a different path).
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

/// A snapshot of one rail, for metrics and the API.
#[derive(Debug, Clone, PartialEq)]
pub struct RailStats {
    pub rail: RailId,
    pub health: RailHealth,
    pub connections: usize,
    pub outstanding_bytes: u64,
    pub bytes_sent: u64,
    pub slices_sent: u64,
    pub slices_retransmitted: u64,
    pub bytes_received: u64,
    pub transitions: u64,
    /// Estimated delivery rate in bytes per second, once measured.
    pub rate_bytes_per_sec: Option<f64>,
    /// Why it last went down, if it did.
    pub last_failure: Option<String>,
    /// Why the last attempt to rebuild it failed, if one did.
    pub last_probe_error: Option<String>,
}

/// One rail's state inside a session.
#[derive(Debug, Clone)]
pub(crate) struct Rail {
    pub id: RailId,
    pub health: RailHealth,
    pub outstanding: u64,
    /// Last ack, or when the rail became busy: the stall clock.
    pub last_progress: Instant,
    pub estimator: RateEstimator,
    /// Shortest send-to-ack time seen: the rail's round trip without queueing.
    pub min_rtt: Option<Duration>,
    /// Times in a row the rail went down for want of acks with no rate measured
    /// in between. The peer answered every probe, so the path is alive but slower
    /// than the defaults assume (a loaded host, a slow fallback): until a rate is
    /// measured it gets small slices, a window of two, and a stall limit doubled
    /// per stall, instead of cutting and resending the same big slices for ever.
    pub stalls_in_a_row: u32,
    pub backoff: Duration,
    pub next_probe: Option<Instant>,
    pub last_failure: Option<String>,
    pub last_probe_error: Option<String>,
    pub bytes_sent: u64,
    pub slices_sent: u64,
    pub slices_retransmitted: u64,
    pub bytes_received: u64,
    pub transitions: u64,
}

impl Rail {
    pub fn new(id: RailId, now: Instant, config: &RailConfig) -> Self {
        Self {
            id,
            health: RailHealth::Up,
            outstanding: 0,
            last_progress: now,
            estimator: RateEstimator::default(),
            min_rtt: None,
            stalls_in_a_row: 0,
            backoff: config.probe_backoff_initial,
            next_probe: None,
            last_failure: None,
            last_probe_error: None,
            bytes_sent: 0,
            slices_sent: 0,
            slices_retransmitted: 0,
            bytes_received: 0,
            transitions: 0,
        }
    }

    /// Applies `signal`; `Some((from, to))` when the state changed.
    pub fn apply(&mut self, signal: RailSignal) -> Option<(RailHealth, RailHealth)> {
        // Signals that do not apply in the current state (an ack racing a failure,
        // say) leave the rail as it is: the table is the whole truth.
        let to = self.health.on(signal).ok()?;
        let from = self.health;
        if to == from {
            return None;
        }
        self.health = to;
        self.transitions += 1;
        Some((from, to))
    }

    /// How long the rail's unacknowledged bytes may go without an ack before it is
    /// declared down (see [`RailConfig::stall_timeout`]).
    pub fn stall_limit(&self, config: &RailConfig) -> Duration {
        if self.is_cautious() {
            return config.stall_timeout * (1 << self.stalls_in_a_row.min(MAX_STALL_DOUBLINGS));
        }
        match self.estimator.rate() {
            Some(rate) => {
                let drain = self.outstanding as f64 / rate.max(1.0)
                    + self.min_rtt.unwrap_or_default().as_secs_f64();
                Duration::from_secs_f64(8.0 * drain).clamp(
                    config.stall_floor,
                    config.stall_timeout.max(config.stall_floor),
                )
            }
            None => config.stall_timeout,
        }
    }

    /// The rail stalled (see [`Rail::stalls_in_a_row`]); called before its
    /// measurements are reset.
    pub fn note_stall(&mut self) {
        self.stalls_in_a_row = match self.estimator.rate() {
            // It was moving at a known rate: a new episode.
            Some(_) => 1,
            None => self.stalls_in_a_row.saturating_add(1),
        };
    }

    /// Stalled before and not measured since: small slices, short queue.
    fn is_cautious(&self) -> bool {
        self.stalls_in_a_row > 0 && self.estimator.rate().is_none()
    }

    pub fn note_rtt(&mut self, rtt: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
    }

    /// Forgets what was measured (a rebuilt rail may be a different path).
    pub fn reset_measurements(&mut self) {
        self.estimator.reset();
        self.min_rtt = None;
    }

    /// Bytes per second the scheduler assumes: the estimate, else `fallback`.
    pub fn assumed_rate(&self, fallback: f64) -> f64 {
        self.estimator.rate().unwrap_or(fallback).max(1.0)
    }

    /// Bytes the rail may hold unacknowledged: its rate times (round trip +
    /// `queue_target`), within [2 slices, `cap`]. Small until the rate is known, so
    /// that a slow rail is not handed a long queue before anyone knows it is slow.
    pub fn window(&self, config: &RailConfig, cap: u64, slice: u64) -> u64 {
        let floor = 2 * slice;
        if self.is_cautious() {
            return floor;
        }
        match self.estimator.rate() {
            Some(rate) => {
                let horizon = config.queue_target + self.min_rtt.unwrap_or_default();
                let w = (rate * horizon.as_secs_f64()) as u64;
                w.clamp(floor, cap.max(floor))
            }
            None => config.initial_window_bytes.clamp(floor, cap.max(floor)),
        }
    }

    /// Slice size for this rail: an eighth of its window, within
    /// [`min_slice_bytes`, `max_slice`], so a slow rail never holds a long tail.
    pub fn slice_len(&self, config: &RailConfig, max_slice: u64) -> u64 {
        if self.is_cautious() {
            return config.min_slice_bytes.min(max_slice);
        }
        match self.estimator.rate() {
            Some(rate) => {
                let s = (rate * config.queue_target.as_secs_f64() / 8.0) as u64;
                s.clamp(config.min_slice_bytes.min(max_slice), max_slice)
            }
            None => max_slice,
        }
    }

    pub fn stats(&self, connections: usize) -> RailStats {
        RailStats {
            rail: self.id,
            health: self.health,
            connections,
            outstanding_bytes: self.outstanding,
            bytes_sent: self.bytes_sent,
            slices_sent: self.slices_sent,
            slices_retransmitted: self.slices_retransmitted,
            bytes_received: self.bytes_received,
            transitions: self.transitions,
            rate_bytes_per_sec: self.estimator.rate(),
            last_failure: self.last_failure.clone(),
            last_probe_error: self.last_probe_error.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_has_a_way_back_up() {
        for from in [H::Up, H::Suspect, H::Down, H::Probing] {
            let mut state = from;
            // Down probes, then connects; Suspect is cleared by an ack.
            for signal in [S::Acked, S::ProbeDue, S::Connected, S::Acked] {
                state = state.on(signal).unwrap_or(state);
            }
            assert_eq!(state, H::Up, "from {from:?}");
        }
    }

    #[test]
    fn stalls_escalate_and_illegal_moves_are_errors() {
        assert_eq!(H::Up.on(S::Stalled), Ok(H::Suspect));
        assert_eq!(H::Suspect.on(S::Stalled), Ok(H::Down));
        assert_eq!(
            H::Up.on(S::ProbeDue),
            Err(IllegalRailTransition {
                from: H::Up,
                signal: S::ProbeDue
            })
        );
        assert!(H::Down.on(S::Acked).is_err());
        assert!(H::Probing.on(S::Stalled).is_err());
    }

    #[test]
    fn table_has_no_duplicate_entries() {
        for (i, a) in RAIL_TRANSITIONS.iter().enumerate() {
            for b in &RAIL_TRANSITIONS[i + 1..] {
                assert!(!(a.0 == b.0 && a.1 == b.1), "duplicate {a:?} / {b:?}");
            }
        }
    }

    #[test]
    fn estimator_measures_busy_time_only() {
        let t0 = Instant::now();
        let mut e = RateEstimator::default();
        e.on_busy(t0);
        // 10 MB in 10 ms = 1 GB/s.
        e.on_acked(10_000_000, t0 + Duration::from_millis(10), false);
        let r = e.rate().unwrap();
        assert!((r - 1e9).abs() < 1e6, "{r}");
        // A long idle gap, then 1 MB in 10 ms: the gap does not count.
        let t1 = t0 + Duration::from_secs(5);
        e.on_busy(t1);
        e.on_acked(1_000_000, t1 + Duration::from_millis(10), false);
        let r2 = e.rate().unwrap();
        assert!((r2 - (1e9 + 0.25 * (1e8 - 1e9))).abs() < 1e6, "{r2}");
    }

    #[test]
    fn window_and_slices_follow_the_rate() {
        let cfg = RailConfig::default();
        let t0 = Instant::now();
        let mut rail = Rail::new(0, t0, &cfg);
        assert_eq!(rail.window(&cfg, 32 << 20, 1 << 20), 4 << 20);
        rail.estimator.on_busy(t0);
        // 125 MB/s (1 Gbit/s): 25 ms of queue is 3.1 MB, slices of 390 KB.
        rail.estimator
            .on_acked(1_250_000, t0 + Duration::from_millis(10), false);
        let w = rail.window(&cfg, 32 << 20, rail.slice_len(&cfg, 1 << 20));
        assert!((3_000_000..3_200_000).contains(&w), "{w}");
        let s = rail.slice_len(&cfg, 1 << 20);
        assert!((380_000..400_000).contains(&s), "{s}");
    }
}
