//! Cluster membership as a key-value store (etcd) holds it: one record per
//! sidecar under a cluster prefix, kept alive by the sidecar's lease, and the
//! view each sidecar keeps of the others.
//!
//! Sans-IO: the driver (the sidecar's etcd task) feeds what it read (a
//! snapshot of the prefix, then watch events) and acts on the [`Change`]s
//! that come back: add a peer, retire a restarted one, fail a departed one's
//! transfers. The store says where a peer is and which process and
//! certificate to expect there, never who it is: certificates still
//! authenticate every connection, and a record whose fingerprint does not
//! match the certificate presented is refused (the driver's check).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Version of the record's JSON format; a reader skips records of a newer
/// major format it cannot read (and says so).
pub const RECORD_FORMAT: u32 = 1;

/// Largest record a reader accepts: real ones are a few hundred bytes.
pub const MAX_RECORD_BYTES: usize = 16 * 1024;

/// Members a view holds at most: whoever can write under the prefix cannot
/// grow a sidecar's memory without bound (at most this many records of
/// [`MAX_RECORD_BYTES`]).
pub const MAX_MEMBERS: usize = 10_000;

/// Departed nodes a view remembers (to tell a restart from a join).
pub const MAX_DEPARTED: usize = 4096;

/// Most rail addresses a record may carry.
pub const MAX_RAILS: usize = 16;

/// The keys under `prefix` that hold node records.
pub fn nodes_prefix(prefix: &str) -> String {
    format!("{}/nodes/", prefix.trim_end_matches('/'))
}

/// The key of `node`'s record under `prefix`.
pub fn node_key(prefix: &str, node: &str) -> String {
    format!("{}{node}", nodes_prefix(prefix))
}

/// What one sidecar publishes about itself (JSON, the value of its key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// [`RECORD_FORMAT`] of the writer.
    pub format: u32,
    /// The node name peers know it by (the last part of its key).
    pub node: String,
    /// One address per rail, `IP:PORT`, in rail order.
    pub rails: Vec<String>,
    /// Stream transports it accepts ("tcp", "quic"); RDMA rides on them.
    pub transports: Vec<String>,
    /// What else it offers ("rdma", "gpu", "rings"...), for routers and people.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Its kvrail version.
    pub version: String,
    /// SHA-256 of its node certificate (DER), lower-case hex; none when it
    /// runs without certificates (`--insecure`).
    #[serde(default)]
    pub cert_sha256: Option<String>,
    /// Random per start of its process (never 0): a record with another
    /// incarnation is another process, whatever its name.
    pub incarnation: u64,
}

impl MemberRecord {
    /// The record's value as stored.
    pub fn to_json(&self) -> Vec<u8> {
        // A struct of strings and numbers always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A record read back and checked: its rails parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub record: MemberRecord,
    pub rails: Vec<SocketAddr>,
    /// The store's revision that wrote it.
    pub revision: i64,
}

impl Member {
    pub fn node(&self) -> &str {
        &self.record.node
    }
    pub fn incarnation(&self) -> u64 {
        self.record.incarnation
    }
}

/// Why a record was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record {key:?} is {len} bytes (at most {MAX_RECORD_BYTES})")]
    TooLarge { key: String, len: usize },
    #[error("record {key:?} is not a kvrail member record: {reason}")]
    Malformed { key: String, reason: String },
    #[error("record {key:?} has format {format}; this kvrail reads format {RECORD_FORMAT}")]
    NewerFormat { key: String, format: u32 },
    #[error("record {key:?} names node {node:?}: a record lives under its own node's key")]
    KeyMismatch { key: String, node: String },
    #[error("record {key:?}: {reason}")]
    BadNodeName { key: String, reason: String },
    #[error("record {key:?}: rail address {addr:?} is not IP:PORT")]
    BadRail { key: String, addr: String },
    #[error("record {key:?}: rail address {addr} is unspecified (0.0.0.0 or ::); the node must advertise where it is reached")]
    UnspecifiedRail { key: String, addr: SocketAddr },
    #[error("record {key:?} has {count} rails (1 to {MAX_RAILS})")]
    RailCount { key: String, count: usize },
    #[error("record {key:?} has incarnation 0 (a process's incarnation is never 0)")]
    NoIncarnation { key: String },
    #[error("record {key:?}: certificate fingerprint {value:?} is not 64 hex digits")]
    BadFingerprint { key: String, value: String },
    #[error("record {key:?} not taken: this node already knows {MAX_MEMBERS} members")]
    TooManyMembers { key: String },
}

/// Parses and checks the record stored at `key` under `prefix`.
/// `check_name` holds the node-name rules (the certificate's).
pub fn parse_record(
    prefix: &str,
    key: &str,
    value: &[u8],
    revision: i64,
    check_name: fn(&str) -> Result<(), String>,
) -> Result<Member, RecordError> {
    let k = || key.to_string();
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge {
            key: k(),
            len: value.len(),
        });
    }
    // The format first: a newer writer's record may not parse as ours.
    #[derive(Deserialize)]
    struct Format {
        format: u32,
    }
    let format: Format = serde_json::from_slice(value).map_err(|e| RecordError::Malformed {
        key: k(),
        reason: e.to_string(),
    })?;
    if format.format > RECORD_FORMAT {
        return Err(RecordError::NewerFormat {
            key: k(),
            format: format.format,
        });
    }
    let record: MemberRecord =
        serde_json::from_slice(value).map_err(|e| RecordError::Malformed {
            key: k(),
            reason: e.to_string(),
        })?;
    let expected = nodes_prefix(prefix);
    let name_in_key = key.strip_prefix(&expected).unwrap_or(key);
    if name_in_key != record.node {
        return Err(RecordError::KeyMismatch {
            key: k(),
            node: record.node,
        });
    }
    check_name(&record.node).map_err(|reason| RecordError::BadNodeName { key: k(), reason })?;
    if record.incarnation == 0 {
        return Err(RecordError::NoIncarnation { key: k() });
    }
    if record.rails.is_empty() || record.rails.len() > MAX_RAILS {
        return Err(RecordError::RailCount {
            key: k(),
            count: record.rails.len(),
        });
    }
    let mut rails = Vec::with_capacity(record.rails.len());
    for addr in &record.rails {
        let parsed: SocketAddr = addr.parse().map_err(|_| RecordError::BadRail {
            key: k(),
            addr: addr.clone(),
        })?;
        if parsed.ip().is_unspecified() || parsed.port() == 0 {
            return Err(RecordError::UnspecifiedRail {
                key: k(),
                addr: parsed,
            });
        }
        rails.push(parsed);
    }
    if let Some(fp) = &record.cert_sha256 {
        if fp.len() != 64 || !fp.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(RecordError::BadFingerprint {
                key: k(),
                value: fp.chars().take(80).collect(),
            });
        }
    }
    Ok(Member {
        record,
        rails,
        revision,
    })
}

/// Whether a sidecar registering `own` may overwrite the record already
/// under its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Takeover {
    /// Its own record (written before the store restarted, or by an earlier
    /// lease of this process).
    Own,
    /// An earlier process of this node on the same rail addresses: this
    /// process bound them, so that one no longer listens there (a restart).
    Restart { incarnation: u64 },
    /// Not a record this version reads: overwritten.
    Unreadable,
    /// Another live process may hold the name elsewhere: the record stays
    /// until its lease expires (two sidecars configured with one name must
    /// not take turns).
    Taken {
        incarnation: u64,
        rails: Vec<String>,
    },
}

/// Decides [`Takeover`] for the value `existing` found under `own`'s key.
pub fn takeover(existing: &[u8], own: &MemberRecord) -> Takeover {
    let Ok(theirs) = serde_json::from_slice::<MemberRecord>(existing) else {
        return Takeover::Unreadable;
    };
    if theirs.incarnation == own.incarnation {
        Takeover::Own
    } else if theirs.rails == own.rails {
        Takeover::Restart {
            incarnation: theirs.incarnation,
        }
    } else {
        Takeover::Taken {
            incarnation: theirs.incarnation,
            rails: theirs.rails,
        }
    }
}

/// One thing the store told us.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreEvent {
    Put {
        key: String,
        value: Vec<u8>,
        revision: i64,
    },
    Delete {
        key: String,
        revision: i64,
    },
}

/// What a sidecar does about an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A node joined: it may be dialed (on first use) and accepted.
    Joined(Member),
    /// The same process moved (rails, transports or certificate changed):
    /// connections to the old addresses are closed, new ones use these.
    Updated { old: Member, new: Member },
    /// Another process took the name (a restart): the old one's sessions
    /// are refused and its transfers fail.
    Restarted { old: Member, new: Member },
    /// The node's record is gone (it stopped, or its lease expired): its
    /// transfers fail with this reason.
    Left { old: Member },
    /// A record that is not taken, and why (logged; the node, if known,
    /// keeps its last good record).
    Refused(RecordError),
    /// Another process publishes under this sidecar's own name.
    NameClash { incarnation: u64 },
}

/// A sidecar's view of the cluster: every other node's last good record.
#[derive(Debug, Clone)]
pub struct MemberView {
    prefix: String,
    own: String,
    own_incarnation: u64,
    check_name: fn(&str) -> Result<(), String>,
    members: BTreeMap<String, Member>,
    /// The last record of nodes that left: one that comes back as another
    /// process is a restart (its old process's sessions are refused).
    departed: BTreeMap<String, Member>,
    /// Highest revision applied: older events are stale replays.
    revision: i64,
    max_members: usize,
}

impl MemberView {
    pub fn new(
        prefix: &str,
        own: &str,
        own_incarnation: u64,
        check_name: fn(&str) -> Result<(), String>,
    ) -> MemberView {
        MemberView {
            prefix: prefix.to_string(),
            own: own.to_string(),
            own_incarnation,
            check_name,
            members: BTreeMap::new(),
            departed: BTreeMap::new(),
            revision: 0,
            max_members: MAX_MEMBERS,
        }
    }

    /// The same view holding at most `max` members (tests).
    pub fn with_max_members(mut self, max: usize) -> MemberView {
        self.max_members = max;
        self
    }

    pub fn get(&self, node: &str) -> Option<&Member> {
        self.members.get(node)
    }

    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Highest store revision seen: a watch resumes after it.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The whole prefix as read at `revision` (at start, and after the watch
    /// was lost): nodes missing from it left while we were not watching.
    pub fn resync(&mut self, records: Vec<(String, Vec<u8>, i64)>, revision: i64) -> Vec<Change> {
        let mut changes = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for (key, value, rev) in records {
            if let Some(node) = key.strip_prefix(&nodes_prefix(&self.prefix)) {
                seen.insert(node.to_string());
            }
            changes.extend(self.put(&key, &value, rev));
        }
        let gone: Vec<String> = self
            .members
            .keys()
            .filter(|n| !seen.contains(*n))
            .cloned()
            .collect();
        for node in gone {
            if let Some(old) = self.members.remove(&node) {
                self.remember_departed(&old);
                changes.push(Change::Left { old });
            }
        }
        self.revision = self.revision.max(revision);
        changes
    }

    /// A record read on demand (a lookup of a name the watch has not brought
    /// yet), not from the watch: it joins the view, but the watch's revision
    /// stays, so no watch event before it is skipped.
    pub fn learn(&mut self, key: &str, value: &[u8], revision: i64) -> Option<Change> {
        if self
            .members
            .get(key.strip_prefix(&nodes_prefix(&self.prefix))?)
            .is_some_and(|m| m.revision >= revision)
        {
            return None;
        }
        self.put(key, value, revision)
    }

    /// One watch event.
    pub fn apply(&mut self, event: StoreEvent) -> Option<Change> {
        match event {
            StoreEvent::Put {
                key,
                value,
                revision,
            } => {
                if revision <= self.revision {
                    return None;
                }
                self.revision = revision;
                self.put(&key, &value, revision)
            }
            StoreEvent::Delete { key, revision } => {
                if revision <= self.revision {
                    return None;
                }
                self.revision = revision;
                let node = key.strip_prefix(&nodes_prefix(&self.prefix))?;
                let old = self.members.remove(node)?;
                self.remember_departed(&old);
                Some(Change::Left { old })
            }
        }
    }

    fn remember_departed(&mut self, old: &Member) {
        if self.departed.len() >= MAX_DEPARTED && !self.departed.contains_key(old.node()) {
            // Churn of many names: forget one (its restart then reads as a join).
            let first = self.departed.keys().next().cloned();
            if let Some(first) = first {
                self.departed.remove(&first);
            }
        }
        self.departed.insert(old.node().to_string(), old.clone());
    }

    fn put(&mut self, key: &str, value: &[u8], revision: i64) -> Option<Change> {
        // Other keys under the prefix (engines, routers) are not ours to read.
        let node = key.strip_prefix(&nodes_prefix(&self.prefix))?;
        if node == self.own {
            // Our own record (or an old process's, until its lease expires).
            return match parse_record(&self.prefix, key, value, revision, self.check_name) {
                Ok(m) if m.incarnation() != self.own_incarnation => Some(Change::NameClash {
                    incarnation: m.incarnation(),
                }),
                _ => None,
            };
        }
        let new = match parse_record(&self.prefix, key, value, revision, self.check_name) {
            Ok(m) => m,
            Err(e) => return Some(Change::Refused(e)),
        };
        if self.members.len() >= self.max_members && !self.members.contains_key(node) {
            return Some(Change::Refused(RecordError::TooManyMembers {
                key: key.to_string(),
            }));
        }
        let departed = self.departed.remove(node);
        match self.members.insert(node.to_string(), new.clone()) {
            None => match departed {
                Some(old) if old.incarnation() != new.incarnation() => {
                    Some(Change::Restarted { old, new })
                }
                _ => Some(Change::Joined(new)),
            },
            Some(old) if old.incarnation() != new.incarnation() => {
                Some(Change::Restarted { old, new })
            }
            Some(old) if old.record != new.record => Some(Change::Updated { old, new }),
            // The same record written again (a re-registration after the
            // store came back): nothing changed.
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &str) -> Result<(), String> {
        if n.is_empty() || n.contains('/') {
            Err(format!("bad name {n:?}"))
        } else {
            Ok(())
        }
    }

    fn record(node: &str, port: u16, incarnation: u64) -> MemberRecord {
        MemberRecord {
            format: RECORD_FORMAT,
            node: node.into(),
            rails: vec![format!("10.0.0.1:{port}"), format!("10.0.1.1:{port}")],
            transports: vec!["tcp".into()],
            capabilities: vec![],
            version: "0.1.0".into(),
            cert_sha256: Some("ab".repeat(32)),
            incarnation,
        }
    }

    fn put(view: &MemberView, r: &MemberRecord, revision: i64) -> StoreEvent {
        StoreEvent::Put {
            key: node_key(&view.prefix, &r.node),
            value: r.to_json(),
            revision,
        }
    }

    fn view() -> MemberView {
        MemberView::new("/kvrail/c1", "me", 7, names)
    }

    #[test]
    fn a_record_round_trips_and_its_key_names_its_node() {
        let r = record("a", 5000, 1);
        let key = node_key("/kvrail/c1/", "a");
        assert_eq!(key, "/kvrail/c1/nodes/a");
        let m = parse_record("/kvrail/c1", &key, &r.to_json(), 3, names).expect("parses");
        assert_eq!(m.record, r);
        assert_eq!(m.rails.len(), 2);
        assert_eq!(m.revision, 3);
        let err = parse_record("/kvrail/c1", "/kvrail/c1/nodes/b", &r.to_json(), 3, names);
        assert!(
            matches!(err, Err(RecordError::KeyMismatch { .. })),
            "{err:?}"
        );
    }

    #[test]
    fn bad_records_are_refused_with_what_is_wrong() {
        let key = "/kvrail/c1/nodes/a";
        let parse = |v: &[u8]| parse_record("/kvrail/c1", key, v, 1, names);
        assert!(matches!(
            parse(b"not json"),
            Err(RecordError::Malformed { .. })
        ));
        assert!(matches!(
            parse(&vec![b' '; MAX_RECORD_BYTES + 1]),
            Err(RecordError::TooLarge { .. })
        ));
        let mut r = record("a", 1, 1);
        r.format = RECORD_FORMAT + 1;
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::NewerFormat { .. })
        ));
        let mut r = record("a", 1, 1);
        r.rails = vec!["nowhere".into()];
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::BadRail { .. })
        ));
        r.rails = vec!["0.0.0.0:5000".into()];
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::UnspecifiedRail { .. })
        ));
        r.rails = vec![];
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::RailCount { .. })
        ));
        let mut r = record("a", 1, 0);
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::NoIncarnation { .. })
        ));
        r.incarnation = 1;
        r.cert_sha256 = Some("xyz".into());
        assert!(matches!(
            parse(&r.to_json()),
            Err(RecordError::BadFingerprint { .. })
        ));
        // A newer writer's extra fields are read past.
        let mut json: serde_json::Value =
            serde_json::from_slice(&record("a", 1, 1).to_json()).expect("json");
        json["zone"] = "rack-3".into();
        assert!(parse(json.to_string().as_bytes()).is_ok());
    }

    #[test]
    fn join_update_restart_and_leave_are_told_apart() {
        let mut v = view();
        let a1 = record("a", 5000, 11);
        assert!(matches!(v.apply(put(&v, &a1, 2)), Some(Change::Joined(m)) if m.node() == "a"));
        // The same record again (re-registered after the store came back).
        assert_eq!(v.apply(put(&v, &a1, 3)), None);
        let mut moved = a1.clone();
        moved.rails = vec!["10.0.0.9:5000".into()];
        assert!(matches!(
            v.apply(put(&v, &moved, 4)),
            Some(Change::Updated { .. })
        ));
        let a2 = record("a", 5000, 12);
        match v.apply(put(&v, &a2, 5)) {
            Some(Change::Restarted { old, new }) => {
                assert_eq!(old.incarnation(), 11);
                assert_eq!(new.incarnation(), 12);
            }
            other => panic!("{other:?}"),
        }
        let del = StoreEvent::Delete {
            key: node_key("/kvrail/c1", "a"),
            revision: 6,
        };
        assert!(matches!(v.apply(del), Some(Change::Left { old }) if old.incarnation() == 12));
        assert!(v.get("a").is_none());
        assert_eq!(v.revision(), 6);
        // Back after its record expired: the same process rejoins, another
        // one is a restart.
        assert!(matches!(v.apply(put(&v, &a2, 7)), Some(Change::Joined(_))));
        v.apply(StoreEvent::Delete {
            key: node_key("/kvrail/c1", "a"),
            revision: 8,
        });
        let a3 = record("a", 5001, 13);
        assert!(matches!(
            v.apply(put(&v, &a3, 9)),
            Some(Change::Restarted { old, new }) if old.incarnation() == 12 && new.incarnation() == 13
        ));
    }

    #[test]
    fn stale_events_own_records_and_foreign_keys_change_nothing() {
        let mut v = view();
        let a = record("a", 5000, 11);
        v.apply(put(&v, &a, 10));
        // A replayed older event (a watch resumed from an earlier revision).
        let old = StoreEvent::Delete {
            key: node_key("/kvrail/c1", "a"),
            revision: 9,
        };
        assert_eq!(v.apply(old), None);
        assert!(v.get("a").is_some());
        // Our own record: not a peer.
        assert_eq!(v.apply(put(&v, &record("me", 1, 7), 11)), None);
        assert_eq!(v.len(), 1);
        // Another process under our name.
        assert_eq!(
            v.apply(put(&v, &record("me", 1, 99), 12)),
            Some(Change::NameClash { incarnation: 99 })
        );
        // Keys that are not node records (engines, routers).
        let engine = StoreEvent::Put {
            key: "/kvrail/c1/engines/e1".into(),
            value: b"{}".to_vec(),
            revision: 13,
        };
        assert_eq!(v.apply(engine), None);
        // A bad record for a known node is refused; the good one stays.
        let bad = StoreEvent::Put {
            key: node_key("/kvrail/c1", "a"),
            value: b"{".to_vec(),
            revision: 14,
        };
        assert!(matches!(v.apply(bad), Some(Change::Refused(_))));
        assert_eq!(v.get("a").map(|m| m.incarnation()), Some(11));
    }

    #[test]
    fn a_name_is_taken_over_only_by_its_own_process_or_a_restart_on_its_rails() {
        let own = record("a", 5000, 2);
        assert_eq!(
            takeover(&record("a", 5000, 2).to_json(), &own),
            Takeover::Own
        );
        assert_eq!(
            takeover(&record("a", 5000, 1).to_json(), &own),
            Takeover::Restart { incarnation: 1 }
        );
        assert!(matches!(
            takeover(&record("a", 6000, 1).to_json(), &own),
            Takeover::Taken { incarnation: 1, .. }
        ));
        assert_eq!(takeover(b"garbage", &own), Takeover::Unreadable);
    }

    #[test]
    fn a_record_looked_up_early_does_not_skip_the_watch() {
        let mut v = view();
        v.apply(put(&v, &record("a", 5000, 1), 5));
        // A lookup reads b at revision 9 before the watch brought 6..9.
        let b = record("b", 5000, 2);
        let key = node_key("/kvrail/c1", "b");
        assert!(matches!(
            v.learn(&key, &b.to_json(), 9),
            Some(Change::Joined(_))
        ));
        assert_eq!(v.revision(), 5);
        // The watch's event for c at 7 still counts; b's own event at 9 is no news.
        assert!(matches!(
            v.apply(put(&v, &record("c", 1, 3), 7)),
            Some(Change::Joined(_))
        ));
        assert_eq!(v.apply(put(&v, &b, 9)), None);
        assert_eq!(v.learn(&key, &b.to_json(), 9), None);
    }

    #[test]
    fn a_flood_of_records_is_capped_and_known_members_still_update() {
        let mut v = view().with_max_members(2);
        assert!(matches!(
            v.apply(put(&v, &record("a", 1, 1), 2)),
            Some(Change::Joined(_))
        ));
        assert!(matches!(
            v.apply(put(&v, &record("b", 1, 1), 3)),
            Some(Change::Joined(_))
        ));
        assert!(matches!(
            v.apply(put(&v, &record("c", 1, 1), 4)),
            Some(Change::Refused(RecordError::TooManyMembers { .. }))
        ));
        assert_eq!(v.len(), 2);
        assert!(matches!(
            v.apply(put(&v, &record("a", 1, 2), 5)),
            Some(Change::Restarted { .. })
        ));
    }

    #[test]
    fn a_resync_finds_who_left_while_nobody_watched() {
        let mut v = view();
        for (n, rev) in [("a", 2), ("b", 3), ("c", 4)] {
            v.apply(put(&v, &record(n, 5000, 1), rev));
        }
        let prefix = "/kvrail/c1";
        let snapshot = vec![
            (node_key(prefix, "a"), record("a", 5000, 1).to_json(), 2),
            (node_key(prefix, "c"), record("c", 5000, 2).to_json(), 20),
            (node_key(prefix, "d"), record("d", 5000, 1).to_json(), 21),
        ];
        let changes = v.resync(snapshot, 30);
        let mut kinds: Vec<String> = changes
            .iter()
            .map(|c| match c {
                Change::Joined(m) => format!("joined {}", m.node()),
                Change::Restarted { new, .. } => format!("restarted {}", new.node()),
                Change::Left { old } => format!("left {}", old.node()),
                other => format!("{other:?}"),
            })
            .collect();
        kinds.sort();
        assert_eq!(kinds, ["joined d", "left b", "restarted c"]);
        assert_eq!(v.revision(), 30);
        assert_eq!(v.len(), 3);
    }
}
