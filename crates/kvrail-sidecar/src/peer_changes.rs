//! What the daemon does when membership (etcd) says a peer joined, moved,
//! restarted or left: the peer table's slots, retired incarnations and the
//! links that must close.

use std::sync::Arc;
use std::time::Duration;

use kvrail_core::membership::{Change, Member};
use tracing::{info, warn};

use crate::config::PeerConfig;
use crate::daemon::{LinkNow, PeerSlot, Shared};

fn slot_for(member: &Member) -> Arc<PeerSlot> {
    PeerSlot::new(PeerConfig {
        name: member.node().to_string(),
        rails: member.rails.clone(),
        cert_sha256: member.record.cert_sha256.clone(),
        incarnation: Some(member.incarnation()),
    })
}

/// Closes what we hold with `node`: the outbound link of `slot` and every
/// inbound session of `incarnation` (all of the node's when None).
fn close_links(
    shared: &Shared,
    node: &str,
    slot: Option<&PeerSlot>,
    incarnation: Option<u64>,
    why: &str,
) {
    if let Some(link) = slot.and_then(|s| s.link_now().link()) {
        link.close(why);
    }
    for entry in shared.inbound.iter() {
        let theirs = entry
            .value()
            .dialer_incarnation
            .load(std::sync::atomic::Ordering::Acquire);
        if entry.key().0 == node && incarnation.is_none_or(|i| i == theirs) {
            entry.value().close(why);
        }
    }
}

/// Makes `member`'s record the peer's slot: the same process at the same
/// place keeps its slot (and link), anything else gets a new slot and the
/// old one's links (those of `incarnation`, or all) close with `why`.
fn upsert(shared: &Shared, member: &Member, incarnation: Option<u64>, why: &str) {
    let fresh = slot_for(member);
    if let Some(current) = shared.peers.get_any(member.node()) {
        if current.config == fresh.config {
            current.set_departed(false);
            return;
        }
    }
    let replaced = shared.peers.insert(fresh);
    close_links(shared, member.node(), replaced.as_deref(), incarnation, why);
}

/// How long a departed peer's sessions may sit idle before they close and
/// its slot is forgotten (a node cut off from etcd keeps sessions it uses).
const DEPARTED_IDLE_GRACE: Duration = Duration::from_secs(30);
const DEPARTED_CHECK: Duration = Duration::from_secs(1);

/// What of `node` is here: any live session (or a dial of one), and any
/// that carries transfers.
#[derive(Debug, Default, Clone, Copy)]
struct Presence {
    connected: bool,
    busy: bool,
}

fn presence(shared: &Shared, node: &str, slot: &PeerSlot) -> Presence {
    let mut p = match slot.link_now() {
        LinkNow::Up(l) => Presence {
            connected: l.is_alive(),
            busy: l.is_alive() && l.inspect(|s| s.active_transfers()) > 0,
        },
        LinkNow::None => Presence::default(),
        LinkNow::Dialing => Presence {
            connected: true,
            busy: true,
        },
    };
    for e in shared.inbound.iter() {
        if p.busy {
            break;
        }
        if e.key().0 == node && e.value().is_alive() {
            p.connected = true;
            p.busy = e.value().inspect(|s| s.active_transfers()) > 0;
        }
    }
    p
}

/// Forgets a departed peer's slot: at once when nothing of it is connected
/// (so records written and deleted under new names cannot grow the table),
/// else once its sessions sat idle for [`DEPARTED_IDLE_GRACE`] (they close
/// then). A peer that comes back before that keeps its slot and sessions.
fn forget_when_idle(shared: &Arc<Shared>, node: String, slot: Arc<PeerSlot>) {
    if !presence(shared, &node, &slot).connected {
        shared.peers.remove_if(&node, &slot);
        shared.peer_budgets.remove(&node);
        return;
    }
    let weak = Arc::downgrade(shared);
    tokio::spawn(async move {
        let mut idle_since = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(DEPARTED_CHECK).await;
            let Some(shared) = weak.upgrade() else { return };
            if !slot.is_departed() {
                return; // back, as the same process
            }
            let here = presence(&shared, &node, &slot);
            if here.busy {
                idle_since = tokio::time::Instant::now();
                continue;
            }
            if here.connected && idle_since.elapsed() < DEPARTED_IDLE_GRACE {
                continue;
            }
            if shared.peers.remove_if(&node, &slot) {
                let why = format!("peer {node} left the cluster (its membership record is gone) and its sessions were idle");
                close_links(&shared, &node, Some(&slot), None, &why);
                shared.peer_budgets.remove(&node);
            }
            return;
        }
    });
}

/// Applies one membership change to the peer table.
pub fn apply(shared: &Arc<Shared>, change: Change) {
    let is_static = |node: &str| shared.peers.get(node).is_some_and(|s| s.is_static());
    match change {
        Change::Joined(member) => {
            if is_static(member.node()) {
                info!(
                    peer = member.node(),
                    "membership: a configured peer registered; its configured rails are kept"
                );
                return;
            }
            info!(peer = member.node(), rails = ?member.rails, incarnation = format_args!("{:#x}", member.incarnation()), "membership: peer joined");
            let why = format!(
                "peer {} registered again with another record",
                member.node()
            );
            upsert(shared, &member, None, &why);
        }
        Change::Updated { new, .. } => {
            if is_static(new.node()) {
                return;
            }
            info!(peer = new.node(), rails = ?new.rails, "membership: peer moved; new connections go to its new record");
            let why = format!(
                "peer {} changed its membership record (rails or certificate)",
                new.node()
            );
            upsert(shared, &new, Some(new.incarnation()), &why);
        }
        Change::Restarted { old, new } => {
            info!(
                peer = new.node(),
                old_incarnation = format_args!("{:#x}", old.incarnation()),
                new_incarnation = format_args!("{:#x}", new.incarnation()),
                "membership: peer restarted; its old process's sessions are refused"
            );
            shared.retire_incarnation(new.node(), old.incarnation());
            let why = format!(
                "peer {} restarted (incarnation {:#x} -> {:#x}, from its membership record)",
                new.node(),
                old.incarnation(),
                new.incarnation()
            );
            if is_static(new.node()) {
                close_links(shared, new.node(), None, Some(old.incarnation()), &why);
                return;
            }
            upsert(shared, &new, Some(old.incarnation()), &why);
        }
        Change::Left { old } => {
            if is_static(old.node()) {
                info!(
                    peer = old.node(),
                    "membership: a configured peer's record is gone; it stays configured"
                );
                return;
            }
            info!(peer = old.node(), "membership: peer left (its record was deleted or its lease expired); sessions still up finish what they carry");
            if let Some(slot) = shared.peers.get_any(old.node()) {
                slot.set_departed(true);
                forget_when_idle(shared, old.node().to_string(), slot);
            }
        }
        Change::Refused(e) => {
            if let Some(suppressed) = shared.refusal_log.admit() {
                warn!(suppressed, "membership: {e}");
            }
        }
        Change::NameClash { incarnation } => {
            warn!(
                other_incarnation = format_args!("{incarnation:#x}"),
                "membership: another process registered under this node's name (an old process whose lease has not expired yet, or a second sidecar configured with the same name)"
            );
        }
    }
}
