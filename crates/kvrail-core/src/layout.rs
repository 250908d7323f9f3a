//! Region geometry: where each (layer, plane, block) of a paged KV cache lives.

use crate::error::LayoutError;

/// Largest region a layout may describe (1 TiB): bigger is certainly a bad request.
pub const MAX_REGION_BYTES: u64 = 1 << 40;
/// Largest single block (1 GiB).
pub const MAX_BLOCK_BYTES: u64 = 1 << 30;
/// Most blocks a region may have (16 Mi): the sidecar keeps a generation per
/// block, so a layout of tiny blocks over a sparse file would otherwise make
/// it allocate gigabytes for nothing. vLLM's largest pools are a few
/// hundred thousand blocks.
pub const MAX_BLOCKS: u32 = 1 << 24;

/// Geometry of a registered region.
///
/// Block `(layer, plane, block)` occupies
/// `[base + layer*layer_stride + plane*plane_stride + block*block_stride, .. + block_bytes)`.
/// The strides let one layout describe vLLM's `[2, num_blocks, ...]` per-layer tensors,
/// FlashInfer's `[num_blocks, 2, ...]`, or MLA caches with one plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionLayout {
    pub num_layers: u32,
    pub planes_per_layer: u32,
    pub num_blocks: u32,
    pub block_bytes: u64,
    pub base_offset: u64,
    pub layer_stride: u64,
    pub plane_stride: u64,
    pub block_stride: u64,
}

impl RegionLayout {
    /// A dense vLLM-style layout: layers one after another, each `[planes, num_blocks, block_bytes]`.
    pub fn dense(
        num_layers: u32,
        planes_per_layer: u32,
        num_blocks: u32,
        block_bytes: u64,
    ) -> Self {
        // Saturating, so that absurd dimensions yield a layout `validate` refuses
        // instead of an overflow.
        let plane_stride = u64::from(num_blocks).saturating_mul(block_bytes);
        Self {
            num_layers,
            planes_per_layer,
            num_blocks,
            block_bytes,
            base_offset: 0,
            layer_stride: plane_stride.saturating_mul(u64::from(planes_per_layer)),
            plane_stride,
            block_stride: block_bytes,
        }
    }

    /// One byte past the last byte any block can touch.
    pub fn extent(&self) -> u64 {
        // Only meaningful after `validate`, which rules out overflow.
        self.base_offset
            + u64::from(self.num_layers.saturating_sub(1)) * self.layer_stride
            + u64::from(self.planes_per_layer.saturating_sub(1)) * self.plane_stride
            + u64::from(self.num_blocks.saturating_sub(1)) * self.block_stride
            + self.block_bytes
    }

    /// Offset of one block; the caller has range-checked the indices.
    pub fn block_offset(&self, layer: u32, plane: u32, block: u32) -> u64 {
        self.base_offset
            + u64::from(layer) * self.layer_stride
            + u64::from(plane) * self.plane_stride
            + u64::from(block) * self.block_stride
    }

    /// Checks that the layout is sane, that no two blocks overlap, and that it fits
    /// into `region_len` bytes.
    pub fn validate(&self, region_len: u64) -> Result<(), LayoutError> {
        if self.num_layers == 0 || self.planes_per_layer == 0 || self.num_blocks == 0 {
            return Err(LayoutError::ZeroDimension);
        }
        if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
            return Err(LayoutError::BlockSize(self.block_bytes));
        }
        if self.num_blocks > MAX_BLOCKS {
            return Err(LayoutError::TooManyBlocks(self.num_blocks));
        }
        let extent = checked_extent(self).ok_or(LayoutError::TooLarge)?;
        if extent > MAX_REGION_BYTES {
            return Err(LayoutError::TooLarge);
        }
        if extent > region_len {
            return Err(LayoutError::ExceedsRegion { extent, region_len });
        }
        // Sufficient condition for disjoint blocks: sort the dimensions by stride; each
        // dimension's whole span must fit inside one step of the next larger stride.
        let mut dims = [
            (self.block_stride, u64::from(self.num_blocks)),
            (self.plane_stride, u64::from(self.planes_per_layer)),
            (self.layer_stride, u64::from(self.num_layers)),
        ];
        dims.sort_unstable();
        let mut span = self.block_bytes;
        for (stride, count) in dims {
            if count <= 1 {
                continue;
            }
            if stride < span {
                return Err(LayoutError::OverlappingBlocks);
            }
            span += stride * (count - 1);
        }
        Ok(())
    }
}

fn checked_extent(l: &RegionLayout) -> Option<u64> {
    let a = u64::from(l.num_layers - 1).checked_mul(l.layer_stride)?;
    let b = u64::from(l.planes_per_layer - 1).checked_mul(l.plane_stride)?;
    let c = u64::from(l.num_blocks - 1).checked_mul(l.block_stride)?;
    l.base_offset
        .checked_add(a)?
        .checked_add(b)?
        .checked_add(c)?
        .checked_add(l.block_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_layout_is_valid_and_sized() {
        let l = RegionLayout::dense(4, 2, 16, 4096);
        assert_eq!(l.extent(), 4 * 2 * 16 * 4096);
        l.validate(l.extent()).unwrap();
        assert_eq!(
            l.block_offset(1, 1, 3),
            2 * 16 * 4096 + 16 * 4096 + 3 * 4096
        );
    }

    #[test]
    fn flashinfer_style_interleaved_layout_is_valid() {
        // [num_blocks, 2, block]: planes interleave inside each block slot.
        let l = RegionLayout {
            num_layers: 2,
            planes_per_layer: 2,
            num_blocks: 8,
            block_bytes: 100,
            base_offset: 0,
            layer_stride: 8 * 200,
            plane_stride: 100,
            block_stride: 200,
        };
        l.validate(l.extent()).unwrap();
    }

    #[test]
    fn rejects_bad_layouts() {
        let mut l = RegionLayout::dense(2, 2, 4, 64);
        assert_eq!(
            l.validate(10),
            Err(LayoutError::ExceedsRegion {
                extent: 1024,
                region_len: 10
            })
        );
        l.block_stride = 32;
        assert_eq!(l.validate(1 << 20), Err(LayoutError::OverlappingBlocks));
        let z = RegionLayout {
            num_blocks: 0,
            ..RegionLayout::dense(1, 1, 1, 1)
        };
        assert_eq!(z.validate(1 << 20), Err(LayoutError::ZeroDimension));
        let huge = RegionLayout {
            layer_stride: u64::MAX / 2,
            ..RegionLayout::dense(4, 1, 1, 1)
        };
        assert_eq!(huge.validate(u64::MAX), Err(LayoutError::TooLarge));
        let zero_block = RegionLayout::dense(1, 1, 1, 0);
        assert_eq!(zero_block.validate(1), Err(LayoutError::BlockSize(0)));
        // A generation per block: tiny blocks over a sparse file would cost
        // the sidecar gigabytes (2^27 one-byte blocks: 1 GiB of them).
        let tiny = RegionLayout::dense(1, 2, MAX_BLOCKS + 1, 1);
        assert_eq!(
            tiny.validate(u64::MAX),
            Err(LayoutError::TooManyBlocks(MAX_BLOCKS + 1))
        );
        assert_eq!(
            RegionLayout::dense(1, 2, MAX_BLOCKS, 1).validate(u64::MAX),
            Ok(())
        );
    }
}
