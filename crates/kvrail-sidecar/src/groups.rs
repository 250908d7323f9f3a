//! Transfer groups: several transfers a worker started that complete as one
//! (`TransferGroup` in sidecar.proto), e.g. a decode rank reading its heads
//! from several prefill ranks. The worker gets one notification for the
//! group: done once every member is done, or failed at the first member that
//! fails (the others are then cancelled by the caller).
//!
//! Pure bookkeeping, `now` passed in; the daemon sends the notifications and
//! cancels.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// Most members of one group.
pub const MAX_MEMBERS: u32 = 1024;
/// Most live groups on one sidecar (all workers).
pub const MAX_GROUPS: usize = 65_536;
/// A group whose members were not all started by then fails (and a failed
/// group whose members never ended is forgotten).
pub const JOIN_DEADLINE: Duration = Duration::from_secs(600);
/// Expiry looks at every group at most this often.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

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

/// What a member's end means for its group.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Others are still running (or the group already reported): nothing to send.
    Pending,
    /// Every member is done: one notification with these bytes.
    Done { bytes: u64 },
    /// The first failure: one FAILED notification, and these members
    /// (transfer ids, still running) to cancel.
    Failed { cancel: Vec<u64> },
}

struct Group {
    members: u32,
    push: bool,
    started: Instant,
    /// Members started and not yet ended.
    running: Vec<u64>,
    joined: u32,
    done: u32,
    bytes: u64,
    failed: bool,
}

/// The live groups of every worker, by (worker, group id).
#[derive(Default)]
pub struct Groups {
    live: DashMap<(String, String), Group>,
    last_sweep: Mutex<Option<Instant>>,
}

/// A group that expired before all its members were started.
#[derive(Debug, PartialEq, Eq)]
pub struct Expired {
    pub worker: String,
    pub group: String,
    pub joined: u32,
    pub members: u32,
    /// Members still running, to cancel.
    pub cancel: Vec<u64>,
}

impl Groups {
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
            failed: false,
        });
        if g.failed {
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
    pub fn member_done(&self, worker: &str, group: &str, transfer_id: u64, bytes: u64) -> Outcome {
        let key = (worker.to_string(), group.to_string());
        let Some(mut g) = self.live.get_mut(&key) else {
            return Outcome::Pending;
        };
        g.running.retain(|&t| t != transfer_id);
        g.done += 1;
        g.bytes += bytes;
        let outcome = if g.failed || g.done < g.members {
            Outcome::Pending
        } else {
            Outcome::Done { bytes: g.bytes }
        };
        // A failed group waits for no more members (one started later
        // forms a new group, which expires unless completed).
        let finished = g.running.is_empty() && (g.failed || g.joined == g.members);
        drop(g);
        if finished {
            self.live.remove(&key);
        }
        outcome
    }

    /// A member failed (or was refused after joining).
    pub fn member_failed(&self, worker: &str, group: &str, transfer_id: u64) -> Outcome {
        let key = (worker.to_string(), group.to_string());
        let Some(mut g) = self.live.get_mut(&key) else {
            return Outcome::Pending;
        };
        g.running.retain(|&t| t != transfer_id);
        let outcome = if g.failed {
            Outcome::Pending
        } else {
            g.failed = true;
            Outcome::Failed {
                cancel: g.running.clone(),
            }
        };
        // A failed group stays until its running members ended, so that
        // their ends are swallowed and no member joins it anew.
        let finished = g.running.is_empty();
        drop(g);
        if finished {
            self.live.remove(&key);
        }
        outcome
    }

    /// Groups whose members were not all started within [`JOIN_DEADLINE`]
    /// (to report as failed), at most once per [`SWEEP_EVERY`]. Failed
    /// groups older than that are dropped silently (already reported).
    pub fn expire(&self, now: Instant) -> Vec<Expired> {
        {
            let mut last = self.last_sweep.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY) {
                return Vec::new();
            }
            *last = Some(now);
        }
        let mut out = Vec::new();
        self.live.retain(|(worker, group), g| {
            let old = now.saturating_duration_since(g.started) > JOIN_DEADLINE;
            if old && !g.failed && g.joined < g.members {
                out.push(Expired {
                    worker: worker.clone(),
                    group: group.clone(),
                    joined: g.joined,
                    members: g.members,
                    cancel: std::mem::take(&mut g.running),
                });
                return false;
            }
            !(old && g.failed)
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

    #[test]
    fn a_group_reports_once_when_every_member_is_done() {
        let g = Groups::default();
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
    fn the_first_failure_reports_and_names_the_members_to_cancel() {
        let g = Groups::default();
        let t = Instant::now();
        for id in 1..=3 {
            g.join("w", "req", 3, true, id, t).unwrap();
        }
        assert_eq!(g.member_done("w", "req", 1, 5), Outcome::Pending);
        assert_eq!(
            g.member_failed("w", "req", 2),
            Outcome::Failed { cancel: vec![3] }
        );
        // The cancelled member's end is swallowed, then the group is gone.
        assert_eq!(g.member_failed("w", "req", 3), Outcome::Pending);
        assert!(g.is_empty());
    }

    #[test]
    fn a_failed_group_takes_no_new_member_until_its_members_ended() {
        let g = Groups::default();
        let t = Instant::now();
        g.join("w", "req", 3, false, 1, t).unwrap();
        g.join("w", "req", 3, false, 2, t).unwrap();
        assert!(matches!(
            g.member_failed("w", "req", 1),
            Outcome::Failed { .. }
        ));
        assert_eq!(
            g.join("w", "req", 3, false, 3, t),
            Err(JoinError::Failed("req".into()))
        );
        assert_eq!(g.member_done("w", "req", 2, 7), Outcome::Pending);
        assert!(g.is_empty());
    }

    #[test]
    fn joins_that_break_the_group_are_refused() {
        let g = Groups::default();
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
        let g = Groups::default();
        let t = Instant::now();
        g.join("w", "short", 2, false, 1, t).unwrap();
        g.join("w", "whole", 1, false, 2, t).unwrap();
        assert!(g.expire(t + JOIN_DEADLINE).is_empty());
        // Swept at most once a second.
        assert!(g.expire(t + JOIN_DEADLINE + SWEEP_EVERY / 2).is_empty());
        let gone = g.expire(t + JOIN_DEADLINE + SWEEP_EVERY * 2);
        assert_eq!(
            gone,
            vec![Expired {
                worker: "w".into(),
                group: "short".into(),
                joined: 1,
                members: 2,
                cancel: vec![1],
            }]
        );
        // A complete group runs as long as its members do.
        assert_eq!(g.len(), 1);
    }
}
