//! Types and gRPC stubs of the kvrail local worker API (`kvrail.v1`).
#![allow(clippy::doc_markdown, missing_docs)]

/// Everything generated from `proto/kvrail/v1/sidecar.proto`, checked in so
/// that binaries carry no build-machine paths (`tests/generated_code.rs` keeps
/// the file current).
pub mod v1 {
    include!("generated/kvrail.v1.rs");
}

pub use v1::*;

impl From<&v1::RegionLayout> for kvrail_core::RegionLayout {
    fn from(l: &v1::RegionLayout) -> Self {
        Self {
            num_layers: l.num_layers,
            planes_per_layer: l.planes_per_layer,
            num_blocks: l.num_blocks,
            block_bytes: l.block_bytes,
            base_offset: l.base_offset,
            layer_stride: l.layer_stride,
            plane_stride: l.plane_stride,
            block_stride: l.block_stride,
        }
    }
}

impl From<kvrail_core::RegionLayout> for v1::RegionLayout {
    fn from(l: kvrail_core::RegionLayout) -> Self {
        Self {
            num_layers: l.num_layers,
            planes_per_layer: l.planes_per_layer,
            num_blocks: l.num_blocks,
            block_bytes: l.block_bytes,
            base_offset: l.base_offset,
            layer_stride: l.layer_stride,
            plane_stride: l.plane_stride,
            block_stride: l.block_stride,
        }
    }
}

impl TryFrom<&v1::KvGeometry> for kvrail_core::KvGeometry {
    type Error = String;

    fn try_from(g: &v1::KvGeometry) -> Result<Self, String> {
        use kvrail_core::BlockInterior as I;
        let interior = match v1::BlockInterior::try_from(g.interior) {
            Ok(v1::BlockInterior::Nhd) => I::Nhd,
            Ok(v1::BlockInterior::Hnd) => I::Hnd,
            Ok(v1::BlockInterior::HeadOpaque) => I::HeadOpaque,
            _ => {
                return Err(format!(
                    "geometry: interior {} is not NHD (1), HND (2) or HEAD_OPAQUE (3)",
                    g.interior
                ))
            }
        };
        Ok(Self {
            model: g.model.clone(),
            dtype: g.dtype.clone(),
            element_bytes: g.element_bytes,
            head_size: g.head_size,
            model_kv_heads: g.model_kv_heads,
            head_start: g.head_start,
            heads: g.heads,
            tokens_per_block: g.tokens_per_block,
            interior,
        })
    }
}

impl From<&v1::HeadSlice> for kvrail_core::HeadSlice {
    fn from(s: &v1::HeadSlice) -> Self {
        Self {
            head_start: s.head_start,
            head_count: s.head_count,
            tokens: s.tokens,
            chunk_tokens: s.chunk_tokens,
        }
    }
}
