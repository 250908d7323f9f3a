//! Regions registered by local workers.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use kvrail_core::{KvGeometry, LayoutError, RegionAccess, RegionDirectory, RegionLayout};
use kvrail_cuda::{CudaError, DeviceMemory};
use kvrail_shm::{SharedRegion, ShmError};

use crate::gpu::{GpuDevice, GpuMemory};

/// A region the sidecar has mapped.
pub struct Region {
    pub id: u64,
    pub worker_id: String,
    /// The registering process (from the socket's peer credentials): its regions
    /// are dropped when it exits.
    pub owner_pid: Option<i32>,
    pub layout: RegionLayout,
    /// What the blocks hold, when the worker said (validated against the layout).
    pub geometry: Option<Arc<KvGeometry>>,
    pub exposed: bool,
    pub memory: RegionMemory,
    /// Each block's generation: 1 at registration, one more each time the
    /// worker releases the block. A transfer that names generations moves the
    /// blocks only while they still match.
    generations: Box<[AtomicU64]>,
}

impl Region {
    /// The current generation of each listed block; the first id past the
    /// last block is the error.
    pub fn generations(&self, blocks: &[u32]) -> Result<Vec<u64>, u32> {
        blocks
            .iter()
            .map(|&b| self.generation(b).ok_or(b))
            .collect()
    }

    /// Moves the listed blocks to their next generation; the new generations.
    /// All ids are checked first, so a bad one releases nothing.
    pub fn release(&self, blocks: &[u32]) -> Result<Vec<u64>, u32> {
        self.generations(blocks)?;
        Ok(blocks
            .iter()
            .map(|&b| self.generations[b as usize].fetch_add(1, Ordering::SeqCst) + 1)
            .collect())
    }

    /// Whether the blocks a local request names are still at its generations.
    pub fn check_generations(&self, selection: &kvrail_core::BlockSelection) -> Result<(), String> {
        selection.check_generations(|b| self.generation(b))
    }

    fn generation(&self, block: u32) -> Option<u64> {
        self.generations
            .get(block as usize)
            .map(|g| g.load(Ordering::SeqCst))
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("worker_id", &self.worker_id)
            .field("memory", &self.memory.kind())
            .field("bytes", &self.memory.len())
            .finish()
    }
}

/// Where a region's bytes live.
pub enum RegionMemory {
    /// A shared-memory file, mapped here: sockets and verbs use it directly.
    Host(Arc<SharedRegion>),
    /// A worker's GPU allocation opened from its IPC handle: staged.
    Gpu(GpuMemory),
}

impl RegionMemory {
    pub fn len(&self) -> u64 {
        match self {
            RegionMemory::Host(m) => m.len(),
            RegionMemory::Gpu(g) => g.memory.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes go through pinned staging buffers (GPU memory): larger
    /// slices, never one-sided (`LocalTransfer::staged`), no placement gate.
    pub fn is_staged(&self) -> bool {
        matches!(self, RegionMemory::Gpu(_))
    }

    pub fn host(&self) -> Option<&SharedRegion> {
        self.shared_host().map(Arc::as_ref)
    }

    /// The host mapping itself, for views that outlive the borrow (zero-copy sends).
    pub fn shared_host(&self) -> Option<&Arc<SharedRegion>> {
        match self {
            RegionMemory::Host(m) => Some(m),
            RegionMemory::Gpu(_) => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            RegionMemory::Host(_) => "host",
            RegionMemory::Gpu(_) => "gpu",
        }
    }
}

/// Why a region cannot be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Gpu(#[from] CudaError),
    /// The node's regions already list this many blocks in all.
    #[error("the registered regions already hold {held} blocks; {asked} more would pass the node's {budget} (unregister regions first)")]
    TooManyBlocks { held: u64, asked: u64, budget: u64 },
}

/// Blocks all registered regions may list together. Each costs 8 bytes of
/// generation counter here, and one region may list 2^24: without a node
/// budget, a worker registering one file again and again could make the
/// daemon allocate without end. 2^26 is 64 regions of the largest size.
pub const MAX_REGISTERED_BLOCKS: u64 = 1 << 26;

/// What a worker registers.
pub enum RegionSource<'a> {
    /// A shared-memory file, and who registers it (the registration policy).
    Shm(&'a Path, kvrail_shm::Caller),
    Gpu {
        device: Arc<GpuDevice>,
        handle: &'a [u8],
    },
}

/// All regions, by id. Ids are never reused within a process, and start from a
/// base drawn from the process's incarnation, so an id from before a restart
/// (held by a peer that re-sends, or a worker that did not notice) names no
/// region of the new process either.
#[derive(Debug, Default)]
pub struct Registry {
    regions: DashMap<u64, Arc<Region>>,
    next_id: AtomicU64,
    /// Blocks the regions list in all, and how many they may (see
    /// [`MAX_REGISTERED_BLOCKS`]).
    blocks: AtomicU64,
    block_budget: u64,
}

impl Registry {
    /// A registry whose ids start at `(incarnation's low 32 bits) << 32`.
    pub fn for_incarnation(incarnation: u64) -> Self {
        Registry {
            regions: DashMap::new(),
            next_id: AtomicU64::new((incarnation & 0xffff_ffff) << 32),
            blocks: AtomicU64::new(0),
            block_budget: MAX_REGISTERED_BLOCKS,
        }
    }

    pub fn register(
        &self,
        worker_id: &str,
        owner_pid: Option<i32>,
        source: RegionSource<'_>,
        layout: RegionLayout,
        geometry: Option<KvGeometry>,
        exposed: bool,
    ) -> Result<Arc<Region>, RegisterError> {
        let memory = match source {
            RegionSource::Shm(path, caller) => {
                // Sane first, so that only the layout's extent is mapped.
                layout.validate(u64::MAX)?;
                let m = SharedRegion::open_registered_within(path, caller, layout.extent())?;
                layout.validate(m.len())?;
                RegionMemory::Host(Arc::new(m))
            }
            RegionSource::Gpu { device, handle } => {
                // The layout's extent is what must fit the allocation.
                layout.validate(u64::MAX)?;
                let memory = device.gpu.import(handle, layout.extent())?;
                RegionMemory::Gpu(GpuMemory {
                    device,
                    memory: Arc::new(memory),
                })
            }
        };
        // Taken last, so that nothing after it fails: a refused or failed
        // registration holds none of the budget.
        let asked = u64::from(layout.num_blocks);
        self.blocks
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(asked)
                    .filter(|&total| total <= self.block_budget)
            })
            .map_err(|held| RegisterError::TooManyBlocks {
                held,
                asked,
                budget: self.block_budget,
            })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let region = Arc::new(Region {
            id,
            worker_id: worker_id.to_string(),
            owner_pid,
            layout,
            geometry: geometry.map(Arc::new),
            exposed,
            memory,
            generations: (0..layout.num_blocks).map(|_| AtomicU64::new(1)).collect(),
        });
        self.regions.insert(id, region.clone());
        Ok(region)
    }

    /// Regions registered by process `pid`.
    pub fn owned_by(&self, pid: i32) -> Vec<u64> {
        self.regions
            .iter()
            .filter(|r| r.owner_pid == Some(pid))
            .map(|r| r.id)
            .collect()
    }

    pub fn get(&self, id: u64) -> Option<Arc<Region>> {
        self.regions.get(&id).map(|r| r.clone())
    }

    pub fn remove(&self, id: u64) -> Option<Arc<Region>> {
        let (_, region) = self.regions.remove(&id)?;
        self.blocks
            .fetch_sub(u64::from(region.layout.num_blocks), Ordering::AcqRel);
        Some(region)
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
            staged: r.memory.is_staged(),
            geometry: r.geometry.clone(),
        })
    }

    fn check_generations(&self, selection: &kvrail_core::BlockSelection) -> Result<(), String> {
        match self.regions.get(&selection.region_id) {
            Some(r) => selection.check_generations(|b| r.generation(b)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regions list at most the node's budget of blocks in all; a refused
    /// registration or a failed one takes none of it, and unregistering gives
    /// it back.
    #[test]
    fn registered_blocks_stay_within_the_node_budget() {
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/kvrail-regions-test-{}",
            std::process::id()
        ));
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        let registry = Registry {
            block_budget: 100,
            ..Registry::for_incarnation(1)
        };
        let caller = kvrail_shm::Caller { uid: None };
        let layout = |blocks| RegionLayout::dense(1, 1, blocks, 64);
        let register = |blocks| {
            registry.register(
                "w",
                None,
                RegionSource::Shm(&path, caller),
                layout(blocks),
                None,
                false,
            )
        };
        let a = register(60).unwrap();
        let refused = register(41).unwrap_err();
        assert!(
            matches!(
                refused,
                RegisterError::TooManyBlocks {
                    held: 60,
                    asked: 41,
                    budget: 100
                }
            ),
            "{refused}"
        );
        // A registration that fails otherwise (past the file's end) takes none.
        let too_big = RegionLayout::dense(1, 1, 30, 1 << 20);
        let failed = registry
            .register(
                "w",
                None,
                RegionSource::Shm(&path, caller),
                too_big,
                None,
                false,
            )
            .unwrap_err();
        assert!(
            matches!(failed, RegisterError::Layout(_) | RegisterError::Shm(_)),
            "{failed}"
        );
        let b = register(40).unwrap();
        assert!(register(1).is_err());
        registry.remove(a.id).unwrap();
        register(60).unwrap();
        assert!(registry.remove(b.id).is_some());
        std::fs::remove_file(&path).unwrap();
    }
}
