//! Regions registered by local workers.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use kvrail_core::{LayoutError, RegionAccess, RegionDirectory, RegionLayout};
use kvrail_shm::{SharedRegion, ShmError};

/// A region the sidecar has mapped.
#[derive(Debug)]
pub struct Region {
    pub id: u64,
    pub worker_id: String,
    pub layout: RegionLayout,
    pub exposed: bool,
    pub memory: SharedRegion,
}

/// Why a region cannot be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
}

/// All regions, by id. Ids are never reused, so a stale id cannot name a new region.
#[derive(Debug, Default)]
pub struct Registry {
    regions: DashMap<u64, Arc<Region>>,
    next_id: AtomicU64,
}

impl Registry {
    pub fn register(
        &self,
        worker_id: &str,
        path: &Path,
        layout: RegionLayout,
        exposed: bool,
    ) -> Result<Arc<Region>, RegisterError> {
        let memory = SharedRegion::open(path)?;
        layout.validate(memory.len())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let region = Arc::new(Region {
            id,
            worker_id: worker_id.to_string(),
            layout,
            exposed,
            memory,
        });
        self.regions.insert(id, region.clone());
        Ok(region)
    }

    pub fn get(&self, id: u64) -> Option<Arc<Region>> {
        self.regions.get(&id).map(|r| r.clone())
    }

    pub fn remove(&self, id: u64) -> Option<Arc<Region>> {
        self.regions.remove(&id).map(|(_, r)| r)
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

impl RegionDirectory for Registry {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        self.regions.get(&region_id).map(|r| RegionAccess {
            layout: r.layout,
            exposed: r.exposed,
            keys: Vec::new(),
        })
    }
}
