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
