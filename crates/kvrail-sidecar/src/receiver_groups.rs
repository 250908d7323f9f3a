//! Receiver groups: pushes into one worker's regions that the worker hears
//! of as one (`PushRequest.receiver_group`), whoever pushed them: e.g.
//! several prefill ranks, on one sidecar or several, each pushing some of a
//! decode rank's heads. The receiving worker gets one PUSH_RECEIVED once all
//! `members` arrived (bytes summed), or one FAILED at the first member that
//! failed; the members ending after that are not reported. A group whose
//! members have not all ended within [`DEADLINE`] of its first fails.
//!
//! Unlike a sender's group (`groups.rs`) nothing is known of a member before
//! it ends: the senders name the group, the receiver only counts. Pure
//! bookkeeping, `now` passed in; the daemon sends the notifications.

use std::time::{Duration, Instant};

use dashmap::DashMap;

use crate::groups::SweepGate;
pub use crate::groups::MAX_GROUPS;

/// Most live receiver groups of one worker: a peer naming groups for it
/// cannot take every other worker's room.
pub const MAX_GROUPS_PER_WORKER: usize = 4096;

/// A group not complete this long after its first member ended fails.
pub const DEADLINE: Duration = Duration::from_secs(600);
/// A failed group is remembered this long (so that its later members stay
/// silent), or until all its members ended.
const FAILED_KEPT: Duration = Duration::from_secs(1200);

/// What one member's end means for its group.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended<F> {
    /// Members are still to come, or the group already reported.
    Pending,
    /// Every member arrived: one PUSH_RECEIVED with these bytes.
    Done { bytes: u64 },
    /// The group's first failure: one FAILED.
    Failed(F),
    /// This member names another member count than the group's first: the
    /// group fails (one FAILED saying so).
    MembersDiffer { members: u32, said: u32 },
    /// [`MAX_GROUPS`] groups are live, or [`MAX_GROUPS_PER_WORKER`] of this
    /// worker's: this group cannot be counted and fails.
    TooMany,
}

struct Received {
    members: u32,
    ended: u32,
    bytes: u64,
    failed: bool,
    first: Instant,
}

/// The live receiver groups of every worker, by (worker, group id).
#[derive(Default)]
pub struct ReceiverGroups {
    live: DashMap<(String, String), Received>,
    /// Live groups per worker.
    per_worker: DashMap<String, usize>,
    sweeps: SweepGate,
}

/// An incomplete group the sweep gave up on.
#[derive(Debug, PartialEq, Eq)]
pub struct Expired {
    pub worker: String,
    pub group: String,
    pub ended: u32,
    pub members: u32,
}

impl ReceiverGroups {
    /// A member of `group` (of `members`, as its sender said) received into
    /// `worker`'s region ended: `Ok(bytes)` placed, or `Err(failure)`.
    pub fn ended<F>(
        &self,
        worker: &str,
        group: &str,
        members: u32,
        result: Result<u64, F>,
        now: Instant,
    ) -> Ended<F> {
        let key = (worker.to_string(), group.to_string());
        if !self.live.contains_key(&key) {
            let mine = self.per_worker.get(worker).map_or(0, |n| *n);
            if self.live.len() >= MAX_GROUPS || mine >= MAX_GROUPS_PER_WORKER {
                return Ended::TooMany;
            }
        }
        let mut g = self.live.entry(key.clone()).or_insert_with(|| {
            *self.per_worker.entry(worker.to_string()).or_insert(0) += 1;
            Received {
                members,
                ended: 0,
                bytes: 0,
                failed: false,
                first: now,
            }
        });
        g.ended += 1;
        let outcome = if g.failed {
            Ended::Pending
        } else if g.members != members {
            g.failed = true;
            Ended::MembersDiffer {
                members: g.members,
                said: members,
            }
        } else {
            match result {
                Err(f) => {
                    g.failed = true;
                    Ended::Failed(f)
                }
                Ok(b) => {
                    g.bytes += b;
                    if g.ended >= g.members {
                        Ended::Done { bytes: g.bytes }
                    } else {
                        Ended::Pending
                    }
                }
            }
        };
        let over = g.ended >= g.members;
        drop(g);
        if over && self.live.remove(&key).is_some() {
            self.forget(worker);
        }
        outcome
    }

    /// One group of `worker`'s is gone.
    fn forget(&self, worker: &str) {
        if let dashmap::mapref::entry::Entry::Occupied(mut n) =
            self.per_worker.entry(worker.to_string())
        {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }

    /// Incomplete groups older than [`DEADLINE`] (removed; the caller
    /// reports each as failed), and failed ones past [`FAILED_KEPT`]
    /// (forgotten). At most once per [`crate::groups::SWEEP_EVERY`].
    pub fn expire(&self, now: Instant) -> Vec<Expired> {
        if !self.sweeps.due(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut gone = Vec::new();
        self.live.retain(|(worker, group), g| {
            let age = now.saturating_duration_since(g.first);
            let keep = if g.failed {
                age <= FAILED_KEPT
            } else if age <= DEADLINE {
                true
            } else {
                out.push(Expired {
                    worker: worker.clone(),
                    group: group.clone(),
                    ended: g.ended,
                    members: g.members,
                });
                false
            };
            if !keep {
                gone.push(worker.clone());
            }
            keep
        });
        for worker in gone {
            self.forget(&worker);
        }
        out
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Result<u64, &'static str>;

    #[test]
    fn members_from_anyone_complete_once_with_their_bytes() {
        let g = ReceiverGroups::default();
        let now = Instant::now();
        assert_eq!(g.ended("d0", "req/load", 3, R::Ok(10), now), Ended::Pending);
        // Another worker's group of the same name is its own.
        assert_eq!(
            g.ended("d1", "req/load", 1, R::Ok(7), now),
            Ended::Done { bytes: 7 }
        );
        assert_eq!(g.ended("d0", "req/load", 3, R::Ok(20), now), Ended::Pending);
        assert_eq!(
            g.ended("d0", "req/load", 3, R::Ok(30), now),
            Ended::Done { bytes: 60 }
        );
        assert!(g.is_empty());
    }

    #[test]
    fn the_first_failure_is_reported_and_later_members_are_silent() {
        let g = ReceiverGroups::default();
        let now = Instant::now();
        assert_eq!(g.ended("d", "x", 3, R::Ok(1), now), Ended::Pending);
        assert_eq!(
            g.ended("d", "x", 3, R::Err("peer died"), now),
            Ended::Failed("peer died")
        );
        assert_eq!(g.ended("d", "x", 3, R::Ok(1), now), Ended::Pending);
        // All ended: forgotten; a new group of the name starts afresh.
        assert!(g.is_empty());
    }

    #[test]
    fn a_member_naming_another_size_fails_the_group() {
        let g = ReceiverGroups::default();
        let now = Instant::now();
        assert_eq!(g.ended("d", "x", 2, R::Ok(1), now), Ended::Pending);
        assert_eq!(
            g.ended("d", "x", 5, R::Ok(1), now),
            Ended::MembersDiffer {
                members: 2,
                said: 5
            }
        );
        assert_eq!(g.len(), 0, "two of its two members ended");
    }

    #[test]
    fn one_worker_cannot_take_every_group() {
        let g = ReceiverGroups::default();
        let now = Instant::now();
        for i in 0..MAX_GROUPS_PER_WORKER {
            assert_eq!(
                g.ended("a", &format!("g{i}"), 2, R::Ok(1), now),
                Ended::Pending
            );
        }
        assert_eq!(g.ended("a", "one-more", 2, R::Ok(1), now), Ended::TooMany);
        // Another worker still has room; a group that ends gives its room back.
        assert_eq!(
            g.ended("b", "g", 1, R::Ok(1), now),
            Ended::Done { bytes: 1 }
        );
        assert_eq!(
            g.ended("a", "g0", 2, R::Ok(1), now),
            Ended::Done { bytes: 2 }
        );
        assert_eq!(
            g.ended("a", "one-more", 1, R::Ok(1), now),
            Ended::Done { bytes: 1 }
        );
        let later = now + DEADLINE + Duration::from_secs(1);
        assert_eq!(g.expire(later).len(), MAX_GROUPS_PER_WORKER - 1);
        assert!(g.is_empty() && g.per_worker.is_empty());
    }

    #[test]
    fn incomplete_groups_expire_and_failed_ones_are_forgotten() {
        let g = ReceiverGroups::default();
        let t0 = Instant::now();
        assert_eq!(g.ended("d", "waits", 3, R::Ok(1), t0), Ended::Pending);
        assert_eq!(
            g.ended("d", "failed", 3, R::Err("x"), t0),
            Ended::Failed("x")
        );
        assert!(g.expire(t0 + Duration::from_secs(1)).is_empty());
        let swept = g.expire(t0 + DEADLINE + Duration::from_secs(2));
        assert_eq!(
            swept,
            vec![Expired {
                worker: "d".into(),
                group: "waits".into(),
                ended: 1,
                members: 3
            }]
        );
        assert_eq!(g.len(), 1, "the failed group stays a while");
        assert!(g
            .expire(t0 + FAILED_KEPT + Duration::from_secs(3))
            .is_empty());
        assert!(g.is_empty());
    }
}
