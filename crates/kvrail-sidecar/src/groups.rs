//! Transfer groups: several transfers a worker started that complete as one
//! (`TransferGroup` in sidecar.proto), e.g. a decode rank reading its heads
//! from several prefill ranks. The worker gets one notification for the
//! group: done once every member is done, or failed once every member it
//! started has ended after the first failure (the others are cancelled at
//! that failure). A failed group is reported only when none of its members
//! can still write into the worker's blocks: the worker frees them then.
//!
//! Pure bookkeeping, `now` passed in; the daemon sends the notifications and
//! cancels. `F` is what the report of a failed group carries (the first
//! failure).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// Most members of one group.
pub const MAX_MEMBERS: u32 = 1024;
/// Most live groups on one sidecar (all workers).
pub const MAX_GROUPS: usize = 65_536;
/// A group whose members were not all started by then fails.
pub const JOIN_DEADLINE: Duration = Duration::from_secs(600);
/// A failed group whose cancelled members still have not ended by then (after
/// its start) is reported anyway and forgotten.
pub const REPORT_DEADLINE: Duration = Duration::from_secs(1200);
/// Expiry looks at every group at most this often.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// When a sweep over every live group is due: at most once per
/// [`SWEEP_EVERY`] (sender and receiver groups alike).
#[derive(Default)]
pub(crate) struct SweepGate(Mutex<Option<Instant>>);

impl SweepGate {
    /// Whether to sweep at `now` (and, if so, the sweep is counted as done).
    pub(crate) fn due(&self, now: Instant) -> bool {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

/// Why a transfer could not join its group.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JoinError {
    #[error("a group has 1 to {MAX_MEMBERS} members, not {0}")]
    Members(u32),
    #[error("group {group:?} has {members} members; this transfer says {said}")]
    MembersDiffer {
        group: String,
        members: u32,
        said: u32,
    },
    #[error("group {group:?} already has its {members} members")]
    Full { group: String, members: u32 },
    #[error("group {group:?} holds {held}; a group's members are all pushes or all pulls")]
    MixedKinds { group: String, held: &'static str },
    #[error("group {0:?} has already failed")]
    Failed(String),
    #[error("{MAX_GROUPS} transfer groups are live on this sidecar")]
    TooMany,
}

/// What a member's end (or a sweep) means for its group.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<F> {
    /// Nothing to do: members still run, or the group already reported.
    Pending,
    /// Every member is done: one notification with these bytes.
    Done { bytes: u64 },
    /// The group's first failure, with members still running: cancel these
    /// (transfer ids); the group reports once they ended.
    Cancel { cancel: Vec<u64> },
    /// The group failed and none of its members runs any more: one FAILED
    /// notification carrying the first failure.
    Failed(F),
}

struct Group<F> {
    members: u32,
    push: bool,
    started: Instant,
    /// Members started and not yet ended.
    running: Vec<u64>,
    joined: u32,
    done: u32,
    bytes: u64,
    /// The first failure, reported once `running` is empty.
    failure: Option<F>,
}

/// The live groups of every worker, by (worker, group id).
pub struct Groups<F> {
    live: DashMap<(String, String), Group<F>>,
    sweeps: SweepGate,
}

impl<F> Default for Groups<F> {
    fn default() -> Self {
        Self {
            live: DashMap::new(),
            sweeps: SweepGate::default(),
        }
    }
}

/// What a sweep found about one group.
#[derive(Debug, PartialEq, Eq)]
pub struct Swept<F> {
    pub worker: String,
    pub group: String,
    pub outcome: Outcome<F>,
}

impl<F: Clone> Groups<F> {
    /// Adds `transfer_id` to its group (created by its first member).
    pub fn join(
        &self,
        worker: &str,
        group: &str,
        members: u32,
        push: bool,
        transfer_id: u64,
        now: Instant,
    ) -> Result<(), JoinError> {
        if members == 0 || members > MAX_MEMBERS {
            return Err(JoinError::Members(members));
        }
        let key = (worker.to_string(), group.to_string());
        if !self.live.contains_key(&key) && self.live.len() >= MAX_GROUPS {
            return Err(JoinError::TooMany);
        }
        let mut g = self.live.entry(key).or_insert_with(|| Group {
            members,
            push,
            started: now,
            running: Vec::new(),
            joined: 0,
            done: 0,
            bytes: 0,
            failure: None,
        });
        if g.failure.is_some() {
            return Err(JoinError::Failed(group.to_string()));
        }
        if g.members != members {
            return Err(JoinError::MembersDiffer {
                group: group.to_string(),
                members: g.members,
                said: members,
            });
        }
        if g.push != push {
            return Err(JoinError::MixedKinds {
                group: group.to_string(),
                held: if g.push { "pushes" } else { "pulls" },
            });
        }
        if g.joined == g.members {
            return Err(JoinError::Full {
                group: group.to_string(),
                members: g.members,
            });
        }
        g.joined += 1;
        g.running.push(transfer_id);
        Ok(())
    }

    /// A member finished with `bytes` moved.
    pub fn member_done(
        &self,
        worker: &str,
        group: &str,
        transfer_id: u64,
        bytes: u64,
    ) -> Outcome<F> {
        let key = (worker.to_string(), group.to_string());
        let Some(mut g) = self.live.get_mut(&key) else {
            return Outcome::Pending;
        };
        g.running.retain(|&t| t != transfer_id);
        g.done += 1;
        g.bytes += bytes;
        let outcome = match &g.failure {
            // A cancelled member that finished first: its bytes landed
            // before the report, which waited for it.
            Some(f) if g.running.is_empty() => Outcome::Failed(f.clone()),
            Some(_) => Outcome::Pending,
            None if g.done < g.members => Outcome::Pending,
            None => Outcome::Done { bytes: g.bytes },
        };
        let reported = !matches!(outcome, Outcome::Pending);
        drop(g);
        if reported {
            self.live.remove(&key);
        }
        outcome
    }

    /// A member failed (or was refused after joining).
    pub fn member_failed(
        &self,
        worker: &str,
        group: &str,
        transfer_id: u64,
        failure: F,
    ) -> Outcome<F> {
        let key = (worker.to_string(), group.to_string());
        let Some(mut g) = self.live.get_mut(&key) else {
            return Outcome::Pending;
        };
        g.running.retain(|&t| t != transfer_id);
        let first = g.failure.is_none();
        let outcome = Self::fail(&mut g, first.then_some(failure));
        let reported = matches!(outcome, Outcome::Failed(_));
        drop(g);
        if reported {
            // Members started later form a new group, which expires unless
            // completed.
            self.live.remove(&key);
        }
        outcome
    }

    /// Records `failure` if it is the group's first, then: report now if no
    /// member runs, else cancel the running ones (once).
    fn fail(g: &mut Group<F>, failure: Option<F>) -> Outcome<F> {
        let first = failure.is_some();
        if let Some(f) = failure {
            g.failure = Some(f);
        }
        match &g.failure {
            Some(f) if g.running.is_empty() => Outcome::Failed(f.clone()),
            Some(_) if first => Outcome::Cancel {
                cancel: g.running.clone(),
            },
            _ => Outcome::Pending,
        }
    }

    /// Groups whose members were not all started within [`JOIN_DEADLINE`]
    /// fail with `failure(group, joined, members)`; failed groups whose
    /// members outlive [`REPORT_DEADLINE`] are reported anyway. At most once
    /// per [`SWEEP_EVERY`].
    pub fn expire(&self, now: Instant, failure: impl Fn(&str, u32, u32) -> F) -> Vec<Swept<F>> {
        if !self.sweeps.due(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.live.retain(|(worker, group), g| {
            let age = now.saturating_duration_since(g.started);
            let outcome = if g.failure.is_none() && g.joined < g.members && age > JOIN_DEADLINE {
                Self::fail(g, Some(failure(group, g.joined, g.members)))
            } else if age > REPORT_DEADLINE {
                match &g.failure {
                    Some(f) => Outcome::Failed(f.clone()),
                    None => Outcome::Pending,
                }
            } else {
                Outcome::Pending
            };
            let keep = !matches!(outcome, Outcome::Failed(_));
            if !matches!(outcome, Outcome::Pending) {
                out.push(Swept {
                    worker: worker.clone(),
                    group: group.clone(),
                    outcome,
                });
            }
            keep
        });
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

    type G = Groups<&'static str>;

    #[test]
    fn a_group_reports_once_when_every_member_is_done() {
        let g = G::default();
        let t = Instant::now();
        for id in 1..=3 {
            g.join("w", "req", 3, false, id, t).unwrap();
        }
        assert_eq!(g.member_done("w", "req", 2, 10), Outcome::Pending);
        assert_eq!(g.member_done("w", "req", 1, 20), Outcome::Pending);
        assert_eq!(
            g.member_done("w", "req", 3, 30),
            Outcome::Done { bytes: 60 }
        );
        assert!(g.is_empty());
        // A member of a group that is gone is nothing to report.
        assert_eq!(g.member_done("w", "req", 3, 30), Outcome::Pending);
    }

    #[test]
    fn the_first_failure_cancels_the_others_and_reports_once_they_ended() {
        let g = G::default();
        let t = Instant::now();
        for id in 1..=4 {
            g.join("w", "req", 4, true, id, t).unwrap();
        }
        assert_eq!(g.member_done("w", "req", 1, 5), Outcome::Pending);
        assert_eq!(
            g.member_failed("w", "req", 2, "first"),
            Outcome::Cancel { cancel: vec![3, 4] }
        );
        // Still writing: no report yet, and a later failure is not the one
        // reported.
        assert_eq!(
            g.member_failed("w", "req", 3, "cancelled"),
            Outcome::Pending
        );
        assert_eq!(g.len(), 1);
        // The last one finished before its cancel took: now the report.
        assert_eq!(g.member_done("w", "req", 4, 9), Outcome::Failed("first"));
        assert!(g.is_empty());
        assert_eq!(g.member_failed("w", "req", 4, "late"), Outcome::Pending);
    }

    #[test]
    fn a_failure_with_nothing_else_running_reports_at_once() {
        let g = G::default();
        let t = Instant::now();
        g.join("w", "req", 2, false, 1, t).unwrap();
        g.join("w", "req", 2, false, 2, t).unwrap();
        assert_eq!(g.member_done("w", "req", 1, 7), Outcome::Pending);
        assert_eq!(g.member_failed("w", "req", 2, "x"), Outcome::Failed("x"));
        assert!(g.is_empty());
    }

    #[test]
    fn a_failed_group_takes_no_new_member_until_it_reported() {
        let g = G::default();
        let t = Instant::now();
        g.join("w", "req", 3, false, 1, t).unwrap();
        g.join("w", "req", 3, false, 2, t).unwrap();
        assert_eq!(
            g.member_failed("w", "req", 1, "x"),
            Outcome::Cancel { cancel: vec![2] }
        );
        assert_eq!(
            g.join("w", "req", 3, false, 3, t),
            Err(JoinError::Failed("req".into()))
        );
        assert_eq!(g.member_done("w", "req", 2, 7), Outcome::Failed("x"));
        assert!(g.is_empty());
    }

    #[test]
    fn joins_that_break_the_group_are_refused() {
        let g = G::default();
        let t = Instant::now();
        assert_eq!(g.join("w", "a", 0, true, 1, t), Err(JoinError::Members(0)));
        assert_eq!(
            g.join("w", "a", MAX_MEMBERS + 1, true, 1, t),
            Err(JoinError::Members(MAX_MEMBERS + 1))
        );
        g.join("w", "a", 1, true, 1, t).unwrap();
        assert!(matches!(
            g.join("w", "a", 2, true, 2, t),
            Err(JoinError::MembersDiffer { .. })
        ));
        assert!(matches!(
            g.join("w", "a", 1, false, 2, t),
            Err(JoinError::MixedKinds { .. })
        ));
        assert!(matches!(
            g.join("w", "a", 1, true, 2, t),
            Err(JoinError::Full { .. })
        ));
        // Another worker's group of the same name is its own.
        g.join("v", "a", 2, false, 3, t).unwrap();
        assert_eq!(g.len(), 2);
    }

    #[test]
    fn groups_never_completed_by_their_worker_expire() {
        let g = G::default();
        let t = Instant::now();
        g.join("w", "short", 2, false, 1, t).unwrap();
        g.join("w", "whole", 1, false, 2, t).unwrap();
        g.join("w", "none-running", 2, false, 3, t).unwrap();
        assert_eq!(g.member_done("w", "none-running", 3, 1), Outcome::Pending);
        let why = |_: &str, _: u32, _: u32| "incomplete";
        assert!(g.expire(t + JOIN_DEADLINE, why).is_empty());
        // Swept at most once a second.
        assert!(g
            .expire(t + JOIN_DEADLINE + SWEEP_EVERY / 2, why)
            .is_empty());
        let mut swept = g.expire(t + JOIN_DEADLINE + SWEEP_EVERY * 2, why);
        swept.sort_by(|a, b| a.group.cmp(&b.group));
        assert_eq!(
            swept,
            vec![
                // Nothing of it runs: reported now.
                Swept {
                    worker: "w".into(),
                    group: "none-running".into(),
                    outcome: Outcome::Failed("incomplete"),
                },
                // Its running member is cancelled; the report follows its end.
                Swept {
                    worker: "w".into(),
                    group: "short".into(),
                    outcome: Outcome::Cancel { cancel: vec![1] },
                },
            ]
        );
        // A complete group runs as long as its members do.
        assert_eq!(g.len(), 2);
        assert_eq!(
            g.member_failed("w", "short", 1, "cancelled"),
            Outcome::Failed("incomplete")
        );
        // A failed group whose members never end is reported in the end.
        g.join("w", "stuck", 2, false, 4, t).unwrap();
        g.join("w", "stuck", 2, false, 5, t).unwrap();
        assert_eq!(
            g.member_failed("w", "stuck", 4, "first"),
            Outcome::Cancel { cancel: vec![5] }
        );
        let swept = g.expire(t + REPORT_DEADLINE + SWEEP_EVERY * 4, why);
        assert_eq!(
            swept,
            vec![Swept {
                worker: "w".into(),
                group: "stuck".into(),
                outcome: Outcome::Failed("first"),
            }]
        );
        assert_eq!(g.len(), 1, "the complete group stays");
    }
}
