//! Shared by the example workers: a checkable KV pattern, and the hand-off file
//! through which a decode worker tells a prefill worker where its blocks are
//! (in vLLM this travels as `kv_transfer_params` through the router).

use std::path::Path;

use kvrail_client::KvRegion;
use serde::{Deserialize, Serialize};

/// Where the other worker's blocks are.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Handoff {
    pub node: String,
    pub region_id: u64,
    pub layers: u32,
    pub block_ids: Vec<u32>,
    pub request_id: String,
}

impl Handoff {
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(self)?)?;
        // Rename so the reader never sees half a file.
        std::fs::rename(tmp, path)?;
        Ok(())
    }

    pub fn read(path: &Path) -> anyhow::Result<Self> {
        Ok(serde_json::from_slice(&std::fs::read(path)?)?)
    }
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The bytes of the `ordinal`-th block of a request, for one layer and plane.
pub fn block_pattern(seed: u64, layer: u32, plane: u32, ordinal: u32, len: usize) -> Vec<u8> {
    let key = mix(seed ^ (u64::from(layer) << 40) ^ (u64::from(plane) << 32) ^ u64::from(ordinal));
    let mut out = Vec::with_capacity(len + 8);
    let mut w = 0u64;
    while out.len() < len {
        out.extend_from_slice(&mix(key.wrapping_add(w)).to_le_bytes());
        w += 1;
    }
    out.truncate(len);
    out
}

/// Writes the pattern of a request into `block_ids` of `kv` (every plane of `layers`).
pub fn fill(
    kv: &KvRegion,
    seed: u64,
    layers: std::ops::Range<u32>,
    block_ids: &[u32],
) -> anyhow::Result<()> {
    let len = kv.layout.block_bytes as usize;
    for layer in layers {
        for plane in 0..kv.layout.planes_per_layer {
            for (ordinal, &b) in block_ids.iter().enumerate() {
                kv.write_block(
                    layer,
                    plane,
                    b,
                    &block_pattern(seed, layer, plane, ordinal as u32, len),
                )?;
            }
        }
    }
    Ok(())
}

/// Checks that `block_ids` of `kv` hold the request's pattern; returns bytes checked.
pub fn verify(
    kv: &KvRegion,
    seed: u64,
    layers: std::ops::Range<u32>,
    block_ids: &[u32],
) -> anyhow::Result<u64> {
    let len = kv.layout.block_bytes as usize;
    let mut checked = 0u64;
    for layer in layers {
        for plane in 0..kv.layout.planes_per_layer {
            for (ordinal, &b) in block_ids.iter().enumerate() {
                let got = kv.read_block(layer, plane, b)?;
                if got != block_pattern(seed, layer, plane, ordinal as u32, len) {
                    let at = got
                        .iter()
                        .zip(block_pattern(seed, layer, plane, ordinal as u32, len))
                        .position(|(a, b)| *a != b)
                        .unwrap_or(0);
                    anyhow::bail!(
                        "layer {layer} plane {plane} block {b} (#{ordinal}) differs at byte {at}"
                    );
                }
                checked += len as u64;
            }
        }
    }
    Ok(checked)
}

/// Picks `n` distinct block ids out of `num_blocks`, shuffled like a fragmented free list.
pub fn scattered_blocks(n: usize, num_blocks: u32, seed: u64) -> Vec<u32> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut all: Vec<u32> = (0..num_blocks).collect();
    all.shuffle(&mut rng);
    all.truncate(n);
    all
}
