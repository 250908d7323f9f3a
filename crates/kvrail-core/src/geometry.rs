//! Attention geometry: what a region's KV blocks hold, so that ranks sharded
//! differently (tensor parallelism on either side, other tokens per block,
//! another order of the dimensions inside a block) can exchange the heads
//! they share.
//!
//! A plain transfer moves whole blocks: `(layer, plane, listed block)`, each
//! `block_bytes` long. A *head-sliced* transfer ([`HeadSlice`]) moves model
//! heads `[head_start, head_start + head_count)` of the request's first
//! `tokens` tokens, as one logical stream both sides agree on:
//!
//! ```text
//! for layer, for plane, for chunk of `chunk_tokens` tokens,
//!     for head in the slice, for token in the chunk: one head of one token
//! ```
//!
//! Each side maps that stream onto its own region with its own geometry
//! ([`crate::plan::Plan::build_for`]), coalescing what is contiguous there, so
//! neither side ever names the other's offsets. `chunk_tokens` is the
//! agreement that keeps the runs long: the larger block size when both sides
//! hold heads outside tokens (HND: one run per head and block), 1 when both
//! hold tokens outside heads (NHD: one run per token); mixed orders move one
//! head of one token per piece on the NHD side.

use std::ops::Range;

use crate::layout::RegionLayout;
use crate::wire::pb;

/// Longest model or dtype name a geometry may carry.
pub const MAX_GEOMETRY_NAME_BYTES: usize = 256;

/// How a block (of one plane of one layer) orders what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockInterior {
    /// `[tokens, heads, head_size]` (vLLM's default, "NHD").
    Nhd,
    /// `[heads, tokens, head_size]` (vLLM's "HND"; NixlConnector's only one).
    Hnd,
    /// Each head's bytes contiguous, in an order only the attention kernel
    /// knows (vLLM's CPU backend packs K transposed per head, K and V in one
    /// plane): heads can be sliced, tokens cannot, so both sides must have
    /// the same tokens per block.
    HeadOpaque,
}

impl BlockInterior {
    pub fn name(self) -> &'static str {
        match self {
            BlockInterior::Nhd => "NHD",
            BlockInterior::Hnd => "HND",
            BlockInterior::HeadOpaque => "head-opaque",
        }
    }
}

/// What the blocks of a region hold (one rank's shard of a model's KV cache).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    /// The model's identity (name and revision), compared verbatim.
    pub model: String,
    /// The KV cache's element type ("bfloat16", "float32", "fp8_e4m3").
    pub dtype: String,
    pub element_bytes: u32,
    /// Elements of one head of one token, per plane.
    pub head_size: u32,
    /// KV heads of the whole model.
    pub model_kv_heads: u32,
    /// The first model head this region holds, and how many.
    pub head_start: u32,
    pub heads: u32,
    pub tokens_per_block: u32,
    pub interior: BlockInterior,
}

/// Why a geometry does not describe its layout, or two geometries cannot
/// exchange KV.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("geometry: {0}")]
    Invalid(String),
    #[error(
        "KV layouts are incompatible: {field} is {here} here and {peer} on the peer; \
         nothing was moved"
    )]
    Mismatch {
        field: &'static str,
        here: String,
        peer: String,
    },
}

impl KvGeometry {
    /// Bytes of one head of one token (per plane).
    pub fn token_head_bytes(&self) -> u64 {
        u64::from(self.head_size) * u64::from(self.element_bytes)
    }

    /// The model heads this region holds.
    pub fn head_range(&self) -> Range<u32> {
        self.head_start..self.head_start + self.heads
    }

    /// Checks the geometry on its own and against the blocks it describes.
    pub fn validate(&self, layout: &RegionLayout) -> Result<(), GeometryError> {
        let bad = |why: String| Err(GeometryError::Invalid(why));
        for (what, name) in [("model", &self.model), ("dtype", &self.dtype)] {
            if name.is_empty() || name.len() > MAX_GEOMETRY_NAME_BYTES {
                return bad(format!(
                    "{what} name must be 1..={MAX_GEOMETRY_NAME_BYTES} bytes"
                ));
            }
            if name.chars().any(char::is_control) {
                return bad(format!("{what} name has control characters"));
            }
        }
        if self.element_bytes == 0
            || self.head_size == 0
            || self.heads == 0
            || self.tokens_per_block == 0
        {
            return bad("element size, head size, heads and tokens per block must be > 0".into());
        }
        if u64::from(self.head_start) + u64::from(self.heads) > u64::from(self.model_kv_heads) {
            return bad(format!(
                "heads {}..{} are not among the model's {} KV heads",
                self.head_start,
                u64::from(self.head_start) + u64::from(self.heads),
                self.model_kv_heads
            ));
        }
        let dense = u64::from(self.heads)
            .checked_mul(u64::from(self.tokens_per_block))
            .and_then(|n| n.checked_mul(self.token_head_bytes()));
        match self.interior {
            BlockInterior::Nhd | BlockInterior::Hnd => {
                if dense != Some(layout.block_bytes) {
                    return bad(format!(
                        "{} heads x {} tokens x {} elements x {} bytes is not the layout's {}-byte block",
                        self.heads,
                        self.tokens_per_block,
                        self.head_size,
                        self.element_bytes,
                        layout.block_bytes
                    ));
                }
            }
            BlockInterior::HeadOpaque => {
                if !layout.block_bytes.is_multiple_of(u64::from(self.heads)) {
                    return bad(format!(
                        "a {}-byte block does not split into {} heads",
                        layout.block_bytes, self.heads
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether this side can exchange KV with `peer` at all (a head-sliced
    /// transfer), or block for block (`whole_blocks`): the first difference,
    /// naming both values. Checked before any byte moves.
    pub fn check_compatible(
        &self,
        peer: &KvGeometry,
        whole_blocks: bool,
    ) -> Result<(), GeometryError> {
        fn same<T: PartialEq + std::fmt::Display>(
            field: &'static str,
            here: T,
            peer: T,
        ) -> Result<(), GeometryError> {
            if here == peer {
                Ok(())
            } else {
                Err(GeometryError::Mismatch {
                    field,
                    here: here.to_string(),
                    peer: peer.to_string(),
                })
            }
        }
        same("the model", &self.model, &peer.model)?;
        same("the KV dtype", &self.dtype, &peer.dtype)?;
        same("the element size", self.element_bytes, peer.element_bytes)?;
        same("the head size", self.head_size, peer.head_size)?;
        same(
            "the model's KV heads",
            self.model_kv_heads,
            peer.model_kv_heads,
        )?;
        let opaque = self.interior == BlockInterior::HeadOpaque
            || peer.interior == BlockInterior::HeadOpaque;
        if whole_blocks || opaque {
            same(
                "the block interior",
                self.interior.name(),
                peer.interior.name(),
            )?;
            same(
                "tokens per block",
                self.tokens_per_block,
                peer.tokens_per_block,
            )?;
        }
        if whole_blocks {
            same(
                "the KV heads held",
                format!("{}..{}", self.head_start, self.head_start + self.heads),
                format!("{}..{}", peer.head_start, peer.head_start + peer.heads),
            )?;
        }
        Ok(())
    }
}

/// Which heads of which tokens a head-sliced transfer moves (see the module
/// documentation for the stream's order). Both sides' selections carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlice {
    /// Model heads `[head_start, head_start + head_count)`.
    pub head_start: u32,
    pub head_count: u32,
    /// Tokens moved, from the first listed block's first token: each side
    /// lists exactly the blocks that hold them.
    pub tokens: u64,
    /// Tokens per chunk of the stream ([`chunk_tokens`]).
    pub chunk_tokens: u32,
}

impl HeadSlice {
    pub fn heads(&self) -> Range<u32> {
        self.head_start..self.head_start.saturating_add(self.head_count)
    }
}

/// The stream's chunk for a transfer between `a` and `b`: the one that
/// leaves each side the fewest runs.
pub fn chunk_tokens(a: &KvGeometry, b: &KvGeometry) -> u32 {
    use BlockInterior::*;
    match (a.interior, b.interior) {
        (Nhd, Nhd) => 1,
        _ => a.tokens_per_block.max(b.tokens_per_block),
    }
}

/// The KV heads tensor-parallel rank `rank` of `tp` holds, as vLLM shards
/// them: `model_kv_heads / tp` each, or, with more ranks than heads, one head
/// replicated on `tp / model_kv_heads` consecutive ranks.
pub fn rank_heads(model_kv_heads: u32, tp: u32, rank: u32) -> Range<u32> {
    if tp <= model_kv_heads {
        let per = model_kv_heads / tp;
        rank * per..(rank + 1) * per
    } else {
        let head = rank / (tp / model_kv_heads);
        head..head + 1
    }
}

/// For a destination holding `dest` heads, which source (by index into
/// `sources`, each the heads a source rank holds) sends which heads: each
/// head once, from the first source holding it; consecutive heads from one
/// source are one slice. Heads no source holds are left out (the caller
/// compares the sum with `dest`).
pub fn head_sources(dest: Range<u32>, sources: &[Range<u32>]) -> Vec<(usize, Range<u32>)> {
    let mut out: Vec<(usize, Range<u32>)> = Vec::new();
    for head in dest {
        let Some(src) = sources.iter().position(|s| s.contains(&head)) else {
            continue;
        };
        match out.last_mut() {
            Some((s, r)) if *s == src && r.end == head => r.end = head + 1,
            _ => out.push((src, head..head + 1)),
        }
    }
    out
}

impl BlockInterior {
    fn to_wire(self) -> u32 {
        match self {
            BlockInterior::Nhd => 1,
            BlockInterior::Hnd => 2,
            BlockInterior::HeadOpaque => 3,
        }
    }

    fn from_wire(v: u32) -> Result<Self, GeometryError> {
        match v {
            1 => Ok(BlockInterior::Nhd),
            2 => Ok(BlockInterior::Hnd),
            3 => Ok(BlockInterior::HeadOpaque),
            other => Err(GeometryError::Invalid(format!(
                "unknown block interior {other} (1 NHD, 2 HND, 3 head-opaque)"
            ))),
        }
    }
}

impl KvGeometry {
    pub fn to_wire(&self) -> pb::KvGeometry {
        pb::KvGeometry {
            model: self.model.clone(),
            dtype: self.dtype.clone(),
            element_bytes: self.element_bytes,
            head_size: self.head_size,
            model_kv_heads: self.model_kv_heads,
            head_start: self.head_start,
            heads: self.heads,
            tokens_per_block: self.tokens_per_block,
            interior: self.interior.to_wire(),
        }
    }

    /// A peer's geometry as sent (checked when compared: names are bounded by
    /// the frame, and only equality is asked of them).
    pub fn from_wire(g: &pb::KvGeometry) -> Result<Self, GeometryError> {
        Ok(KvGeometry {
            model: g.model.clone(),
            dtype: g.dtype.clone(),
            element_bytes: g.element_bytes,
            head_size: g.head_size,
            model_kv_heads: g.model_kv_heads,
            head_start: g.head_start,
            heads: g.heads,
            tokens_per_block: g.tokens_per_block,
            interior: BlockInterior::from_wire(g.interior)?,
        })
    }
}

impl HeadSlice {
    pub fn to_wire(self) -> pb::HeadSlice {
        pb::HeadSlice {
            head_start: self.head_start,
            head_count: self.head_count,
            tokens: self.tokens,
            chunk_tokens: self.chunk_tokens,
        }
    }

    pub fn from_wire(s: &pb::HeadSlice) -> Self {
        HeadSlice {
            head_start: s.head_start,
            head_count: s.head_count,
            tokens: s.tokens,
            chunk_tokens: s.chunk_tokens,
        }
    }
}

#[cfg(test)]
#[path = "geometry_tests.rs"]
mod tests;
