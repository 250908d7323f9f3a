//! Pieces shared by the in-memory session tests: regions as plain byte vectors.

use std::collections::HashMap;

use crate::layout::RegionLayout;
use crate::plan::BlockSelection;
use crate::session::{RegionAccess, RegionDirectory};

pub struct Region {
    pub layout: RegionLayout,
    pub bytes: Vec<u8>,
    pub exposed: bool,
}

#[derive(Default)]
pub struct Regions(pub HashMap<u64, Region>);

impl RegionDirectory for Regions {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        self.0.get(&region_id).map(|r| RegionAccess {
            layout: r.layout,
            exposed: r.exposed,
        })
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8 + 1)
        .collect()
}

pub fn sel(region: u64, layers: (u32, u32), blocks: &[u32]) -> BlockSelection {
    BlockSelection {
        region_id: region,
        layer_start: layers.0,
        layer_count: layers.1,
        block_ids: blocks.to_vec(),
    }
}
