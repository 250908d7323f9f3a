//! The queue-pair setup exchange of one rail, sans-IO: the dialer offers its
//! queue pairs' endpoints in an `RdmaConnect` on one of the rail's stream
//! connections; the acceptor checks the request, creates as many queue pairs,
//! and answers with their endpoints (or why not) in an `RdmaAccept` carrying
//! the same nonce. Every decision of the exchange is here, with `now` passed
//! in; the sidecar creates and connects the verbs objects and moves the
//! messages.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::rail::RailId;
use crate::wire::pb;

/// Most queue pairs one request may ask for (each costs device resources on
/// the acceptor, so a peer may not ask for arbitrarily many).
pub const MAX_QPS_PER_REQUEST: usize = 16;

/// How long the dialer waits for the acceptor's answer.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(3);

/// Why queue pairs were not set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QpSetupError {
    /// Acceptor: the request names another rail than the connection it came on.
    #[error("rail {asked} does not match the connection's rail {actual:?}")]
    WrongRail {
        asked: RailId,
        actual: Option<RailId>,
    },
    /// Acceptor: too few or too many queue pairs asked.
    #[error("{0} queue pairs asked (1..={MAX_QPS_PER_REQUEST} allowed)")]
    Count(usize),
    /// Dialer: the acceptor declined, saying why.
    #[error("peer: {0}")]
    Declined(String),
    /// Dialer: the answer has another number of queue pairs than asked.
    #[error("peer answered with {got} queue pairs for {asked}")]
    Mismatch { got: usize, asked: usize },
    /// Dialer: no answer in time.
    #[error("no answer from the peer in {0:?}")]
    Timeout(Duration),
    /// Another setup of this rail is under way (on the dialer; on the
    /// acceptor, a request read on another connection and not answered yet).
    #[error("another queue-pair setup of rail {0} is under way")]
    Busy(RailId),
    /// Acceptor: the request is older than one already taken for its rail
    /// (it timed out at the dialer, which has moved on).
    #[error("setup {attempt} of rail {rail} is stale: setup {latest} was already taken")]
    Stale {
        rail: RailId,
        attempt: u64,
        latest: u64,
    },
}

/// Acceptor: whether to create queue pairs for `req`, which arrived on a
/// connection of `connection_rail` (`None`: the connection is gone).
pub fn check_connect(
    req: &pb::RdmaConnect,
    connection_rail: Option<RailId>,
) -> Result<(), QpSetupError> {
    if connection_rail != Some(req.rail_index) {
        return Err(QpSetupError::WrongRail {
            asked: req.rail_index,
            actual: connection_rail,
        });
    }
    if req.qps.is_empty() || req.qps.len() > MAX_QPS_PER_REQUEST {
        return Err(QpSetupError::Count(req.qps.len()));
    }
    Ok(())
}

/// Acceptor: the setups taken per rail, so that a request read late (after
/// its successor, which may come on another connection) is declined instead
/// of replacing the queue pairs the dialer now uses.
/// Requests of one rail are also taken one at a time: two read at once on
/// different connections would each retire the other's queue pairs.
#[derive(Debug, Default)]
pub struct QpAcceptor {
    latest: HashMap<RailId, u64>,
    busy: HashSet<RailId>,
}

impl QpAcceptor {
    /// [`check_connect`], then whether `req` is newer than every request
    /// taken for its rail and no other is being answered; a request that
    /// passes is taken (recorded), and its rail is busy until
    /// [`QpAcceptor::done`]. A request numbered 0 (from a dialer that does
    /// not number them) is neither compared nor recorded.
    pub fn take(
        &mut self,
        req: &pb::RdmaConnect,
        connection_rail: Option<RailId>,
    ) -> Result<(), QpSetupError> {
        check_connect(req, connection_rail)?;
        let rail = req.rail_index;
        if self.busy.contains(&rail) {
            return Err(QpSetupError::Busy(rail));
        }
        if req.attempt != 0 {
            if let Some(&latest) = self.latest.get(&rail) {
                if req.attempt <= latest {
                    return Err(QpSetupError::Stale {
                        rail,
                        attempt: req.attempt,
                        latest,
                    });
                }
            }
            self.latest.insert(rail, req.attempt);
        }
        self.busy.insert(rail);
        Ok(())
    }

    /// The request taken for `rail` was answered.
    pub fn done(&mut self, rail: RailId) {
        self.busy.remove(&rail);
    }
}

/// Acceptor: the answer to the request with `nonce`: our queue pairs'
/// endpoints, or why there are none.
pub fn answer(nonce: u64, outcome: Result<Vec<pb::RdmaEndpoint>, String>) -> pb::RdmaAccept {
    match outcome {
        Ok(qps) => pb::RdmaAccept {
            nonce,
            qps,
            error: String::new(),
        },
        Err(error) => pb::RdmaAccept {
            nonce,
            qps: Vec::new(),
            error,
        },
    }
}

/// A request the dialer is waiting on.
#[derive(Debug, Clone)]
struct Pending {
    rail: RailId,
    asked: usize,
    deadline: Instant,
}

/// Dialer: the setups in flight, by nonce.
#[derive(Debug, Default)]
pub struct QpSetups {
    pending: HashMap<u64, Pending>,
    /// Rails with a setup under way, from its offer until its queue pairs are
    /// attached or it failed (see [`QpSetups::begin`]).
    busy: HashSet<RailId>,
    /// Setups started per rail (the requests' `attempt`, see [`QpAcceptor`]).
    attempts: HashMap<RailId, u64>,
}

/// What became of one setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetupOutcome {
    pub nonce: u64,
    pub rail: RailId,
    /// The acceptor's endpoints, one per queue pair offered, in order.
    pub result: Result<Vec<pb::RdmaEndpoint>, QpSetupError>,
}

impl QpSetups {
    /// Claims `rail` for one setup, to be given back with [`QpSetups::end`]
    /// once its queue pairs are attached or it failed. The acceptor keeps
    /// only the queue pairs of the newest request it took for a rail and
    /// retires the others, while the dialer attaches every set whose answer
    /// came: two setups of one rail at once (a rail's probe and the rebuild
    /// of its queue pairs, each on its own connection) could leave the
    /// dialer writing to queue pairs the acceptor had destroyed. (A request
    /// that timed out is declined by its number, see [`QpAcceptor`].)
    pub fn begin(&mut self, rail: RailId) -> Result<(), QpSetupError> {
        if self.busy.insert(rail) {
            Ok(())
        } else {
            Err(QpSetupError::Busy(rail))
        }
    }

    /// Gives `rail` back (see [`QpSetups::begin`]).
    pub fn end(&mut self, rail: RailId) {
        self.busy.remove(&rail);
    }

    /// Whether a setup of `rail` is under way.
    pub fn is_busy(&self, rail: RailId) -> bool {
        self.busy.contains(&rail)
    }

    /// Starts a setup on `rail` offering `endpoints`: the message to send.
    /// `nonce` must be fresh (random); a reused one replaces the older setup.
    pub fn start(
        &mut self,
        rail: RailId,
        nonce: u64,
        endpoints: Vec<pb::RdmaEndpoint>,
        now: Instant,
    ) -> pb::RdmaConnect {
        self.pending.insert(
            nonce,
            Pending {
                rail,
                asked: endpoints.len(),
                deadline: now + SETUP_TIMEOUT,
            },
        );
        let attempt = self.attempts.entry(rail).or_insert(0);
        *attempt += 1;
        pb::RdmaConnect {
            rail_index: rail,
            nonce,
            qps: endpoints,
            attempt: *attempt,
        }
    }

    /// The acceptor answered. `None` for an answer to no setup of ours (late,
    /// after a timeout, or made up): it is ignored.
    pub fn on_accept(&mut self, accept: pb::RdmaAccept) -> Option<SetupOutcome> {
        let p = self.pending.remove(&accept.nonce)?;
        let result = if !accept.error.is_empty() {
            Err(QpSetupError::Declined(accept.error))
        } else if accept.qps.len() != p.asked {
            Err(QpSetupError::Mismatch {
                got: accept.qps.len(),
                asked: p.asked,
            })
        } else {
            Ok(accept.qps)
        };
        Some(SetupOutcome {
            nonce: accept.nonce,
            rail: p.rail,
            result,
        })
    }

    /// The connection carrying the setup closed: it ends without an answer.
    pub fn abandon(&mut self, nonce: u64) -> bool {
        self.pending.remove(&nonce).is_some()
    }

    /// When the next setup times out.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.deadline).min()
    }

    /// Setups whose answer did not come by `now`.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<SetupOutcome> {
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(n, _)| *n)
            .collect();
        expired
            .into_iter()
            .filter_map(|nonce| {
                let p = self.pending.remove(&nonce)?;
                Some(SetupOutcome {
                    nonce,
                    rail: p.rail,
                    result: Err(QpSetupError::Timeout(SETUP_TIMEOUT)),
                })
            })
            .collect()
    }

    /// Setups in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(n: usize) -> Vec<pb::RdmaEndpoint> {
        (0..n)
            .map(|i| pb::RdmaEndpoint {
                qp_num: i as u32 + 1,
                ..Default::default()
            })
            .collect()
    }

    /// Both ends driven against each other: the acceptor sees the dialer's
    /// request, the dialer the acceptor's answer.
    #[test]
    fn a_setup_round_trip_yields_the_acceptors_endpoints() {
        let t0 = Instant::now();
        let mut dialer = QpSetups::default();
        let req = dialer.start(1, 42, endpoints(2), t0);
        assert_eq!(dialer.poll_timeout(), Some(t0 + SETUP_TIMEOUT));
        check_connect(&req, Some(1)).unwrap();
        let ours = endpoints(req.qps.len());
        let out = dialer
            .on_accept(answer(req.nonce, Ok(ours.clone())))
            .unwrap();
        assert_eq!(out.rail, 1);
        assert_eq!(out.result, Ok(ours));
        assert_eq!(dialer.in_flight(), 0);
        assert_eq!(dialer.poll_timeout(), None);
        // The same answer again (or one to no request) is ignored.
        assert!(dialer.on_accept(answer(42, Ok(endpoints(2)))).is_none());
    }

    #[test]
    fn the_acceptor_refuses_other_rails_and_bad_counts() {
        let mut dialer = QpSetups::default();
        let now = Instant::now();
        let req = dialer.start(1, 7, endpoints(2), now);
        assert_eq!(
            check_connect(&req, Some(0)),
            Err(QpSetupError::WrongRail {
                asked: 1,
                actual: Some(0)
            })
        );
        assert!(matches!(
            check_connect(&req, None),
            Err(QpSetupError::WrongRail { actual: None, .. })
        ));
        let none = dialer.start(1, 8, Vec::new(), now);
        assert_eq!(check_connect(&none, Some(1)), Err(QpSetupError::Count(0)));
        let many = dialer.start(1, 9, endpoints(MAX_QPS_PER_REQUEST + 1), now);
        assert_eq!(
            check_connect(&many, Some(1)),
            Err(QpSetupError::Count(MAX_QPS_PER_REQUEST + 1))
        );
        // The refusal reaches the dialer with its reason.
        let why = check_connect(&req, Some(0)).unwrap_err().to_string();
        let out = dialer.on_accept(answer(7, Err(why.clone()))).unwrap();
        assert_eq!(out.result, Err(QpSetupError::Declined(why)));
    }

    /// The dialer's first request on a rail timed out and is read by the
    /// acceptor after its second (sent on another connection): the first is
    /// declined and the second's queue pairs stay. Rails count apart.
    #[test]
    fn a_request_read_after_its_successor_is_declined() {
        let t0 = Instant::now();
        let mut dialer = QpSetups::default();
        let mut acceptor = QpAcceptor::default();
        let first = dialer.start(0, 1, endpoints(2), t0);
        assert_eq!(dialer.handle_timeout(t0 + SETUP_TIMEOUT).len(), 1);
        let second = dialer.start(0, 2, endpoints(2), t0 + SETUP_TIMEOUT);
        assert_eq!((first.attempt, second.attempt), (1, 2));
        let other_rail = dialer.start(1, 3, endpoints(2), t0);
        assert_eq!(other_rail.attempt, 1);
        acceptor.take(&second, Some(0)).unwrap();
        // Read while the second is being answered: busy, whatever its number.
        assert_eq!(acceptor.take(&first, Some(0)), Err(QpSetupError::Busy(0)));
        acceptor.done(0);
        assert_eq!(
            acceptor.take(&first, Some(0)),
            Err(QpSetupError::Stale {
                rail: 0,
                attempt: 1,
                latest: 2
            })
        );
        // A copy of the taken request is stale too; the other rail is not.
        assert!(matches!(
            acceptor.take(&second, Some(0)),
            Err(QpSetupError::Stale { .. })
        ));
        acceptor.take(&other_rail, Some(1)).unwrap();
        // A request for the wrong rail is refused as before, and is not taken.
        let third = dialer.start(0, 4, endpoints(2), t0 + SETUP_TIMEOUT);
        assert!(matches!(
            acceptor.take(&third, Some(1)),
            Err(QpSetupError::WrongRail { .. })
        ));
        acceptor.take(&third, Some(0)).unwrap();
        acceptor.done(0);
        // Unnumbered requests (an older dialer) are always taken in turn.
        let unnumbered = pb::RdmaConnect {
            attempt: 0,
            ..third.clone()
        };
        acceptor.take(&unnumbered, Some(0)).unwrap();
        acceptor.done(0);
        acceptor.take(&unnumbered, Some(0)).unwrap();
    }

    #[test]
    fn a_rail_has_one_setup_at_a_time() {
        let mut dialer = QpSetups::default();
        dialer.begin(0).unwrap();
        assert!(dialer.is_busy(0));
        assert_eq!(dialer.begin(0), Err(QpSetupError::Busy(0)));
        // Other rails are set up meanwhile.
        dialer.begin(1).unwrap();
        dialer.end(0);
        assert!(!dialer.is_busy(0));
        dialer.begin(0).unwrap();
        assert_eq!(dialer.begin(1), Err(QpSetupError::Busy(1)));
    }

    #[test]
    fn short_answers_and_silence_fail_the_setup() {
        let t0 = Instant::now();
        let mut dialer = QpSetups::default();
        dialer.start(0, 1, endpoints(4), t0);
        let out = dialer.on_accept(answer(1, Ok(endpoints(3)))).unwrap();
        assert_eq!(out.result, Err(QpSetupError::Mismatch { got: 3, asked: 4 }));
        dialer.start(0, 2, endpoints(2), t0);
        dialer.start(1, 3, endpoints(2), t0 + Duration::from_secs(1));
        assert!(dialer
            .handle_timeout(t0 + SETUP_TIMEOUT - Duration::from_millis(1))
            .is_empty());
        let expired = dialer.handle_timeout(t0 + SETUP_TIMEOUT);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].nonce, 2);
        assert_eq!(expired[0].result, Err(QpSetupError::Timeout(SETUP_TIMEOUT)));
        // A late answer to the timed-out setup is ignored; the other goes on.
        assert!(dialer.on_accept(answer(2, Ok(endpoints(2)))).is_none());
        assert_eq!(dialer.in_flight(), 1);
        assert!(dialer.abandon(3));
        assert_eq!(dialer.in_flight(), 0);
    }
}
