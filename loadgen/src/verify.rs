//! Byte-for-byte checks of moved blocks, shared by `bench` and `demo`.

use anyhow::bail;
use kvrail_client::proto::RegionLayout;
use kvrail_client::{block_offset, SharedRegion};

/// Compares each source block with its destination block (every plane of layers
/// `0..layers`); with `clear`, zeroes each destination block afterwards so a
/// later transfer cannot pass on stale bytes.
pub fn compare_blocks(
    src: &SharedRegion,
    dst: &SharedRegion,
    layout: &RegionLayout,
    layers: u32,
    src_ids: &[u32],
    dst_ids: &[u32],
    clear: bool,
) -> anyhow::Result<()> {
    let len = layout.block_bytes;
    for layer in 0..layers {
        for plane in 0..layout.planes_per_layer {
            for (s, d) in src_ids.iter().zip(dst_ids) {
                let so = block_offset(layout, layer, plane, *s);
                let dof = block_offset(layout, layer, plane, *d);
                let a = src.io_slices(&[(so, len)])?;
                let b = dst.io_slices(&[(dof, len)])?;
                if *a[0] != *b[0] {
                    bail!("layer {layer} plane {plane}: block {s} -> {d} differs");
                }
                if clear {
                    dst.fill(dof, len, 0)?;
                }
            }
        }
    }
    Ok(())
}
