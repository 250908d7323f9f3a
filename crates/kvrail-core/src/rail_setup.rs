//! What a dialer decides about a rail it has just dialed (or rebuilt), sans-IO:
//! whether the new connections survived the rebuild, whether and how RDMA
//! queue pairs ride on the rail, and when a failed queue-pair setup is tried
//! again. The sidecar dials, creates the verbs objects and sleeps; every
//! choice is here, tested without sockets or devices.

use std::time::Duration;

use crate::rail::RailId;
use crate::session::ConnId;

/// A rail rebuilt by a probe whose new connections were partly closed
/// meanwhile (the peer reported the old ones down, which took some new ones
/// with it): how many, or None when all of them live. The rail is then
/// started over rather than left short of connections for good. A slot that
/// appears twice was reused by a later connection: it counts as lost too.
pub fn lost_while_rebuilt(attached: &[ConnId], is_live: impl Fn(ConnId) -> bool) -> Option<usize> {
    let mut unique = attached.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let lost = attached.len() - unique.len() + unique.iter().filter(|&&c| !is_live(c)).count();
    (lost > 0).then_some(lost)
}

/// What the dialer knows of RDMA on a rail once its stream connections are up.
#[derive(Debug, Clone)]
pub struct RdmaOnRail<'a> {
    pub rail: RailId,
    /// The configuration ranks RDMA above the stream transport.
    pub rdma_first: bool,
    /// This node's device for the rail, or why there is none.
    pub device: Result<(), String>,
    /// The rail's first stream connection (None: none attached).
    pub first: Option<ConnId>,
    /// The transports the peer's handshake answer offered.
    pub peer_offers: &'a [String],
    /// A setup of this rail's queue pairs is already under way.
    pub setup_under_way: bool,
}

/// What to do about RDMA on a dialed rail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RdmaStep {
    /// Streams only, nothing to say (RDMA not preferred, or no connection).
    Skip,
    /// Streams only, and why (no device here, the peer offers none).
    StreamsOnly(String),
    /// An earlier setup goes on; a second at once would leave the two sides
    /// with different queue pairs. The rail's rebuild (one per rail) takes
    /// over should that one fail, and ends once queue pairs exist.
    AwaitEarlierSetup(String),
    /// Set queue pairs up over this stream connection.
    SetUp(ConnId),
}

impl RdmaOnRail<'_> {
    pub fn step(&self) -> RdmaStep {
        let rail = self.rail;
        if !self.rdma_first {
            return RdmaStep::Skip;
        }
        if let Err(why) = &self.device {
            return RdmaStep::StreamsOnly(format!("rail {rail}: no RDMA here ({why})"));
        }
        let Some(first) = self.first else {
            return RdmaStep::Skip;
        };
        if !self.peer_offers.iter().any(|t| t == "rdma") {
            return RdmaStep::StreamsOnly(format!(
                "rail {rail}: peer offers {:?}, no rdma",
                self.peer_offers
            ));
        }
        if self.setup_under_way {
            return RdmaStep::AwaitEarlierSetup(format!(
                "rail {rail}: queue pairs being set up by an earlier attempt"
            ));
        }
        RdmaStep::SetUp(first)
    }
}

/// How a queue-pair setup ended, as the dialer judges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupVerdict {
    /// Queue pairs attached.
    Connected(String),
    /// The peer said no: streams only on this rail, nothing to rebuild.
    Declined(String),
    /// It failed here or in the exchange: streams until the rail's queue
    /// pairs are rebuilt (in the background, with [`QpRebuild`]).
    Rebuild(String),
}

/// Judges a setup's outcome: `Ok(n)` queue pairs attached, or the error and
/// whether the peer declined.
pub fn judge_setup(rail: RailId, outcome: Result<usize, (String, bool)>) -> SetupVerdict {
    match outcome {
        Ok(n) => SetupVerdict::Connected(format!("rdma on rail {rail}: {n} queue pairs")),
        Err((why, true)) => SetupVerdict::Declined(format!("rail {rail}: {why}")),
        Err((why, false)) => SetupVerdict::Rebuild(format!(
            "rail {rail}: RDMA setup failed ({why}), rebuilding"
        )),
    }
}

/// First wait of a queue-pair rebuild.
pub const QP_RETRY_INITIAL: Duration = Duration::from_millis(250);
/// Longest wait between two attempts.
pub const QP_RETRY_MAX: Duration = Duration::from_secs(2);

/// The background rebuild of one rail's queue pairs: wait, look, try; the
/// wait doubles after each failed attempt, up to a ceiling.
#[derive(Debug, Clone)]
pub struct QpRebuild {
    wait: Duration,
    max: Duration,
}

/// What the rebuild does after a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildStep {
    /// The link closed, queue pairs exist again, or the rail itself is down
    /// (its own rebuild sets RDMA up): done.
    Stop,
    /// Try a setup over this stream connection.
    Try(ConnId),
}

impl Default for QpRebuild {
    fn default() -> Self {
        Self::new(QP_RETRY_INITIAL, QP_RETRY_MAX)
    }
}

impl QpRebuild {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            wait: initial,
            max: max.max(initial),
        }
    }

    /// How long to wait before looking again.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// After the wait: the link's state decides.
    pub fn look(&self, closed: bool, queue_pairs: usize, stream: Option<ConnId>) -> RebuildStep {
        match stream {
            Some(conn) if !closed && queue_pairs == 0 => RebuildStep::Try(conn),
            _ => RebuildStep::Stop,
        }
    }

    /// An attempt's outcome (`Ok(n)`: n queue pairs attached): whether the
    /// rebuild is done. A failure waits twice as long before the next.
    pub fn attempted(&mut self, outcome: Result<usize, ()>) -> bool {
        match outcome {
            // Attached, or none could be (the session closed or full): done.
            Ok(_) => true,
            Err(()) => {
                self.wait = (self.wait * 2).min(self.max);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebuilt_rail_that_lost_connections_is_started_over() {
        assert_eq!(lost_while_rebuilt(&[0, 1, 2], |_| true), None);
        assert_eq!(lost_while_rebuilt(&[0, 1, 2], |c| c != 1), Some(1));
        // Slot 1 reused by a later connection of the same rebuild.
        assert_eq!(lost_while_rebuilt(&[0, 1, 1], |_| true), Some(1));
        assert_eq!(lost_while_rebuilt(&[], |_| false), None);
    }

    fn rail<'a>(offers: &'a [String]) -> RdmaOnRail<'a> {
        RdmaOnRail {
            rail: 1,
            rdma_first: true,
            device: Ok(()),
            first: Some(4),
            peer_offers: offers,
            setup_under_way: false,
        }
    }

    #[test]
    fn rdma_rides_on_the_rails_first_connection_when_both_sides_want_it() {
        let both = ["tcp".to_string(), "rdma".to_string()];
        assert_eq!(rail(&both).step(), RdmaStep::SetUp(4));
        let not_preferred = RdmaOnRail {
            rdma_first: false,
            ..rail(&both)
        };
        assert_eq!(not_preferred.step(), RdmaStep::Skip);
        let no_device = RdmaOnRail {
            device: Err("no device has 10.0.0.1".into()),
            ..rail(&both)
        };
        assert_eq!(
            no_device.step(),
            RdmaStep::StreamsOnly("rail 1: no RDMA here (no device has 10.0.0.1)".into())
        );
        let tcp_only = ["tcp".to_string()];
        assert_eq!(
            rail(&tcp_only).step(),
            RdmaStep::StreamsOnly("rail 1: peer offers [\"tcp\"], no rdma".into())
        );
        let unconnected = RdmaOnRail {
            first: None,
            ..rail(&both)
        };
        assert_eq!(unconnected.step(), RdmaStep::Skip);
        let busy = RdmaOnRail {
            setup_under_way: true,
            ..rail(&both)
        };
        assert!(matches!(busy.step(), RdmaStep::AwaitEarlierSetup(_)));
    }

    #[test]
    fn a_declined_setup_is_not_rebuilt_a_failed_one_is() {
        assert_eq!(
            judge_setup(0, Ok(2)),
            SetupVerdict::Connected("rdma on rail 0: 2 queue pairs".into())
        );
        assert!(matches!(
            judge_setup(0, Err(("peer: no device".into(), true))),
            SetupVerdict::Declined(_)
        ));
        assert_eq!(
            judge_setup(0, Err(("no answer".into(), false))),
            SetupVerdict::Rebuild("rail 0: RDMA setup failed (no answer), rebuilding".into())
        );
    }

    #[test]
    fn the_rebuild_backs_off_to_its_ceiling_and_stops_when_there_is_nothing_to_do() {
        let mut r = QpRebuild::default();
        let mut waits = vec![r.wait()];
        for _ in 0..5 {
            assert_eq!(r.look(false, 0, Some(3)), RebuildStep::Try(3));
            assert!(!r.attempted(Err(())));
            waits.push(r.wait());
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 2000, 2000]);
        assert!(r.attempted(Ok(2)), "rebuilt");
        assert!(r.attempted(Ok(0)), "nothing could be attached: done too");
        assert_eq!(r.look(true, 0, Some(3)), RebuildStep::Stop, "closed");
        assert_eq!(
            r.look(false, 2, Some(3)),
            RebuildStep::Stop,
            "queue pairs exist"
        );
        assert_eq!(
            r.look(false, 0, None),
            RebuildStep::Stop,
            "the rail is down"
        );
    }
}
