//! The peers this sidecar may dial and accept: the configured (static) ones
//! and those membership (etcd) names, each with its outbound link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use tokio::sync::Mutex as AsyncMutex;

use crate::config::PeerConfig;
use crate::link::PeerLink;

/// A slot's outbound link, seen without waiting.
pub enum LinkNow {
    None,
    Up(Arc<PeerLink>),
    /// A dial holds the slot: no transfer runs on what it makes yet.
    Dialing,
}

impl LinkNow {
    pub fn link(self) -> Option<Arc<PeerLink>> {
        match self {
            LinkNow::Up(link) => Some(link),
            LinkNow::None | LinkNow::Dialing => None,
        }
    }
}

/// An outbound peer: its configuration and the link we dialed, if any.
pub struct PeerSlot {
    /// Its `incarnation` is set for a membership record's peer (the process
    /// the record names) and unset for a configured one (`peers`, `--peer`),
    /// which is kept whatever etcd says.
    pub config: PeerConfig,
    pub link: AsyncMutex<Option<Arc<PeerLink>>>,
    /// Its membership record is gone: nothing new starts with it (no
    /// transfer, dial or session), while the sessions already up go on
    /// (a node cut off from etcd still serves them; a dead one's fail with
    /// their rails). Kept so that releases and unregistrations still see
    /// its link.
    departed: AtomicBool,
}

impl PeerSlot {
    pub fn new(config: PeerConfig) -> Arc<PeerSlot> {
        Arc::new(PeerSlot {
            config,
            link: AsyncMutex::new(None),
            departed: AtomicBool::new(false),
        })
    }

    /// Configured, not learnt from etcd.
    pub fn is_static(&self) -> bool {
        self.config.incarnation.is_none()
    }

    pub fn is_departed(&self) -> bool {
        self.departed.load(Ordering::Acquire)
    }

    pub fn set_departed(&self, departed: bool) {
        self.departed.store(departed, Ordering::Release);
    }

    /// Its outbound link as it is now, without waiting for a dial.
    pub fn link_now(&self) -> LinkNow {
        match self.link.try_lock() {
            Ok(guard) => match guard.as_ref() {
                Some(link) => LinkNow::Up(link.clone()),
                None => LinkNow::None,
            },
            Err(_) => LinkNow::Dialing,
        }
    }
}

/// Peers by node name. Slots are replaced whole (a peer that moved or
/// restarted gets a new slot; the old one's link is closed by whoever
/// replaced it), so a holder of an old slot never sees a mix.
#[derive(Default)]
pub struct PeerTable {
    slots: RwLock<HashMap<String, Arc<PeerSlot>>>,
}

impl PeerTable {
    pub fn from_config(peers: &[PeerConfig]) -> PeerTable {
        let table = PeerTable::default();
        for p in peers {
            table.insert(PeerSlot::new(p.clone()));
        }
        table
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<PeerSlot>>> {
        // A panic elsewhere while holding the lock leaves a consistent map
        // (every write is one insert or remove).
        self.slots.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<PeerSlot>>> {
        self.slots.write().unwrap_or_else(|p| p.into_inner())
    }

    /// `name`'s slot, departed or not.
    pub fn get_any(&self, name: &str) -> Option<Arc<PeerSlot>> {
        self.read().get(name).cloned()
    }

    /// `name`'s slot, unless it departed.
    pub fn get(&self, name: &str) -> Option<Arc<PeerSlot>> {
        self.get_any(name).filter(|s| !s.is_departed())
    }

    /// Whether `name` is a peer now (configured, or registered in etcd).
    pub fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Peers now (departed ones left out).
    pub fn len(&self) -> usize {
        self.read().values().filter(|s| !s.is_departed()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every peer now, by name (departed ones left out).
    pub fn entries(&self) -> Vec<(String, Arc<PeerSlot>)> {
        self.read()
            .iter()
            .filter(|(_, s)| !s.is_departed())
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect()
    }

    /// Every slot at this moment, departed ones too (their links may still
    /// carry transfers).
    pub fn values(&self) -> Vec<Arc<PeerSlot>> {
        self.read().values().cloned().collect()
    }

    /// Removes `name`'s slot if it is still `slot` (a newer one stays).
    pub fn remove_if(&self, name: &str, slot: &Arc<PeerSlot>) -> bool {
        let mut slots = self.write();
        if slots.get(name).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(name);
            true
        } else {
            false
        }
    }

    /// Puts `slot` under its name; the slot it replaced, if any.
    pub fn insert(&self, slot: Arc<PeerSlot>) -> Option<Arc<PeerSlot>> {
        self.write().insert(slot.config.name.clone(), slot)
    }
}
