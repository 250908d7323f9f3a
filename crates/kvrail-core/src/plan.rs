//! Transfer plans: turn "these blocks of this region" into coalesced byte segments.
//!
//! Both ends of a transfer agree on one *logical byte stream*: for each layer in the
//! range, each plane, each listed block in order, `block_bytes` bytes. Each side maps
//! that stream onto its own region with its own layout, so a peer never names raw
//! offsets in our memory: it can only name logical offsets below the agreed total.

use crate::error::PlanError;
use crate::geometry::{BlockInterior, HeadSlice, KvGeometry};
use crate::layout::RegionLayout;

/// Most blocks one request may list (per side), to bound plan memory.
pub const MAX_BLOCKS_PER_TRANSFER: usize = 1 << 20;

/// Most block pieces (layers x planes x listed blocks) one transfer may move:
/// a plan holds at most one segment per piece. 4 Mi covers 80 layers x K/V x
/// 26,000 blocks (a 400k-token prompt at block size 16) and bounds a plan to
/// 96 MiB however hostile the request.
pub const MAX_PIECES_PER_TRANSFER: u64 = 1 << 22;

/// A worker's description of blocks in one region.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockSelection {
    pub region_id: u64,
    pub layer_start: u32,
    pub layer_count: u32,
    pub block_ids: Vec<u32>,
    /// Empty, or one per block id: the generation each block must still be at
    /// (0 = any). Checked by the sidecar that holds the region.
    pub generations: Vec<u64>,
    /// Move only these heads of these tokens (the region's geometry says
    /// where they are); `None`: whole blocks.
    pub slice: Option<HeadSlice>,
    /// With a slice: the stream's first token is this token of the first
    /// listed block (engines with other block sizes meet mid-block). Each
    /// side has its own; 0 without a slice.
    pub first_token: u32,
}

impl BlockSelection {
    /// The checks that need no layout: at least one layer and one block, not too
    /// many blocks, and (for a destination) no block listed twice. The side that
    /// does not hold the region runs only these; `Plan::build` runs them first.
    pub fn check_shape(&self, access: Access) -> Result<(), PlanError> {
        if self.layer_count == 0 {
            return Err(PlanError::NoLayers);
        }
        if self.block_ids.is_empty() {
            return Err(PlanError::NoBlocks);
        }
        if self.slice.is_none() && self.first_token != 0 {
            return Err(PlanError::Slice(format!(
                "first token {} without a head slice (whole blocks start at their first token)",
                self.first_token
            )));
        }
        if self.block_ids.len() > MAX_BLOCKS_PER_TRANSFER {
            return Err(PlanError::TooManyBlocks(self.block_ids.len()));
        }
        if !self.generations.is_empty() && self.generations.len() != self.block_ids.len() {
            return Err(PlanError::GenerationCount {
                blocks: self.block_ids.len(),
                generations: self.generations.len(),
            });
        }
        // Checked here too (with at least one plane), so the side that does not
        // hold the region refuses before anything is built.
        let pieces = self.block_ids.len() as u64 * u64::from(self.layer_count);
        if pieces > MAX_PIECES_PER_TRANSFER {
            return Err(PlanError::TooManyPieces {
                pieces,
                max: MAX_PIECES_PER_TRANSFER,
            });
        }
        if access == Access::Write {
            let mut sorted = self.block_ids.clone();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(PlanError::DuplicateBlock(w[0]));
            }
        }
        Ok(())
    }
}

impl BlockSelection {
    /// Compares the generations this selection names with the blocks' current
    /// ones (`current(block)`; `None` for a block past the region's end, which
    /// the plan refuses anyway): the reason, naming the first block that moved
    /// on, or `Ok` when none did or no generations were named.
    pub fn check_generations(&self, current: impl Fn(u32) -> Option<u64>) -> Result<(), String> {
        for (&block, &named) in self.block_ids.iter().zip(&self.generations) {
            if named == 0 {
                continue;
            }
            match current(block) {
                Some(now) if now == named => {}
                Some(now) => {
                    return Err(format!(
                        "block {block} of region {} was released by its worker (generation {now}, the request named {named})",
                        self.region_id
                    ))
                }
                None => {}
            }
        }
        Ok(())
    }
}

/// Whether the same block may be listed twice: harmless when reading, never when writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// One contiguous run: logical bytes `[logical, logical+len)` live at region bytes
/// `[offset, offset+len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub logical: u64,
    pub offset: u64,
    pub len: u64,
}

/// The validated mapping of a transfer's logical stream onto one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    segments: Vec<Segment>,
    total: u64,
    block_bytes: u64,
}

impl Plan {
    /// Validates `selection` against `layout` and builds the coalesced segment list.
    pub fn build(
        layout: &RegionLayout,
        selection: &BlockSelection,
        access: Access,
    ) -> Result<Plan, PlanError> {
        Self::build_for(layout, None, selection, access)
    }

    /// As [`Plan::build`], for a region whose blocks `geometry` describes: a
    /// head-sliced selection needs it.
    pub fn build_for(
        layout: &RegionLayout,
        geometry: Option<&KvGeometry>,
        selection: &BlockSelection,
        access: Access,
    ) -> Result<Plan, PlanError> {
        selection.check_shape(access)?;
        if let Some(slice) = &selection.slice {
            let geometry = geometry.ok_or(PlanError::NoGeometry)?;
            return build_sliced(layout, geometry, selection, slice);
        }
        let layer_end = layer_end_within(layout, selection)?;
        let pieces = selection.block_ids.len() as u64
            * u64::from(selection.layer_count)
            * u64::from(layout.planes_per_layer);
        if pieces > MAX_PIECES_PER_TRANSFER {
            return Err(PlanError::TooManyPieces {
                pieces,
                max: MAX_PIECES_PER_TRANSFER,
            });
        }
        check_blocks_within(layout, selection)?;
        let mut segments: Vec<Segment> = Vec::new();
        let mut logical = 0u64;
        for layer in selection.layer_start..layer_end {
            for plane in 0..layout.planes_per_layer {
                for &block in &selection.block_ids {
                    let offset = layout.block_offset(layer, plane, block);
                    match segments.last_mut() {
                        Some(last) if last.offset + last.len == offset => {
                            last.len += layout.block_bytes
                        }
                        _ => segments.push(Segment {
                            logical,
                            offset,
                            len: layout.block_bytes,
                        }),
                    }
                    logical += layout.block_bytes;
                }
            }
        }
        Ok(Plan {
            segments,
            total: logical,
            block_bytes: layout.block_bytes,
        })
    }

    /// Length of the logical stream.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Coalesced runs, in logical order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The region byte ranges `(offset, len)` that back logical bytes `[logical, logical+len)`.
    /// Errors when the range leaves the stream: a peer can never reach past the plan.
    pub fn pieces(&self, logical: u64, len: u64) -> Result<Pieces<'_>, PlanError> {
        let end = logical
            .checked_add(len)
            .filter(|e| *e <= self.total)
            .ok_or(PlanError::OutsideStream {
                offset: logical,
                len,
                total: self.total,
            })?;
        let index = self
            .segments
            .partition_point(|s| s.logical + s.len <= logical);
        Ok(Pieces {
            segments: &self.segments[index..],
            cursor: logical,
            end,
        })
    }
}

/// One past the selection's last layer, if the region has it.
fn layer_end_within(layout: &RegionLayout, selection: &BlockSelection) -> Result<u32, PlanError> {
    selection
        .layer_start
        .checked_add(selection.layer_count)
        .filter(|end| *end <= layout.num_layers)
        .ok_or(PlanError::LayerOutOfRange {
            start: selection.layer_start,
            count: selection.layer_count,
            num_layers: layout.num_layers,
        })
}

/// The first listed block past the region's last one, as the error.
fn check_blocks_within(layout: &RegionLayout, selection: &BlockSelection) -> Result<(), PlanError> {
    match selection
        .block_ids
        .iter()
        .find(|b| **b >= layout.num_blocks)
    {
        Some(&bad) => Err(PlanError::BlockOutOfRange {
            block: bad,
            num_blocks: layout.num_blocks,
        }),
        None => Ok(()),
    }
}

/// Most steps building one head-sliced plan may take (each emits at most one
/// segment): bounds the work a hostile slice can ask for (~0.1 s).
pub const MAX_SLICE_STEPS: u64 = 1 << 26;

/// The plan of a head-sliced selection (see [`crate::geometry`]): the
/// stream's heads of its tokens, mapped onto this region's blocks.
fn build_sliced(
    layout: &RegionLayout,
    g: &KvGeometry,
    selection: &BlockSelection,
    slice: &HeadSlice,
) -> Result<Plan, PlanError> {
    let layer_end = layer_end_within(layout, selection)?;
    check_blocks_within(layout, selection)?;
    let held = g.head_range();
    let wanted = slice.heads();
    let wanted_end = u64::from(slice.head_start) + u64::from(slice.head_count);
    if slice.head_count == 0 || wanted.start < held.start || wanted_end > u64::from(held.end) {
        return Err(PlanError::Slice(format!(
            "heads {}..{} are not among the {}..{} this region holds",
            slice.head_start,
            u64::from(slice.head_start) + u64::from(slice.head_count),
            held.start,
            held.end
        )));
    }
    let tpb = u64::from(g.tokens_per_block);
    let chunk = u64::from(slice.chunk_tokens);
    if slice.tokens == 0 || chunk == 0 {
        return Err(PlanError::Slice("no tokens, or chunks of none".into()));
    }
    let first = u64::from(selection.first_token);
    if first >= tpb {
        return Err(PlanError::Slice(format!(
            "first token {first} is not inside a block of {tpb} tokens"
        )));
    }
    // A peer's token count: checked before any arithmetic on it.
    let span = first.checked_add(slice.tokens).ok_or_else(|| {
        PlanError::Slice(format!(
            "{} tokens from token {first} overflow",
            slice.tokens
        ))
    })?;
    let blocks_needed = span.div_ceil(tpb);
    if blocks_needed != selection.block_ids.len() as u64 {
        return Err(PlanError::Slice(format!(
            "{} tokens from token {first} at {tpb} per block are {blocks_needed} blocks, {} listed",
            slice.tokens,
            selection.block_ids.len()
        )));
    }
    let opaque = g.interior == BlockInterior::HeadOpaque;
    if opaque && (chunk != tpb || first != 0 || !slice.tokens.is_multiple_of(tpb)) {
        return Err(PlanError::Slice(format!(
            "this region's blocks hold heads in an opaque order: the stream must move whole \
             blocks of {tpb} tokens (chunks of {chunk}, {} tokens from token {first})",
            slice.tokens
        )));
    }
    let planes = u64::from(layout.planes_per_layer);
    let layers = u64::from(selection.layer_count);
    let heads = u64::from(slice.head_count);
    let chunks = slice.tokens.div_ceil(chunk);
    let per_head = match g.interior {
        BlockInterior::Nhd => slice.tokens,
        BlockInterior::Hnd => chunks.saturating_add(blocks_needed),
        BlockInterior::HeadOpaque => chunks,
    };
    let steps = layers
        .saturating_mul(planes)
        .saturating_mul(heads)
        .saturating_mul(per_head);
    if steps > MAX_SLICE_STEPS {
        return Err(PlanError::TooManyPieces {
            pieces: steps,
            max: MAX_SLICE_STEPS,
        });
    }
    // The unit the stream is counted in: one head of one token, or (opaque)
    // one head of one block.
    let unit = if opaque {
        layout.block_bytes / u64::from(g.heads)
    } else {
        g.token_head_bytes()
    };
    let mut segments: Vec<Segment> = Vec::new();
    let mut logical = 0u64;
    let mut emit = |offset: u64, len: u64| -> Result<(), PlanError> {
        match segments.last_mut() {
            Some(last) if last.offset + last.len == offset => last.len += len,
            _ => {
                if segments.len() as u64 >= MAX_PIECES_PER_TRANSFER {
                    return Err(PlanError::TooManyPieces {
                        pieces: segments.len() as u64 + 1,
                        max: MAX_PIECES_PER_TRANSFER,
                    });
                }
                segments.push(Segment {
                    logical,
                    offset,
                    len,
                })
            }
        }
        logical += len;
        Ok(())
    };
    let held_heads = u64::from(g.heads);
    for layer in selection.layer_start..layer_end {
        for plane in 0..layout.planes_per_layer {
            // Stream token t is token t + first of the listed blocks.
            let block_at = |t: u64| {
                let id = selection.block_ids[((t + first) / tpb) as usize];
                layout.block_offset(layer, plane, id)
            };
            for c in 0..chunks {
                let (t0, t1) = (c * chunk, ((c + 1) * chunk).min(slice.tokens));
                for head in wanted.clone() {
                    let local = u64::from(head - held.start);
                    match g.interior {
                        BlockInterior::HeadOpaque => emit(block_at(t0) + local * unit, unit)?,
                        BlockInterior::Hnd => {
                            let mut t = t0;
                            while t < t1 {
                                let in_block = (t + first) % tpb;
                                let run = (t1 - t).min(tpb - in_block);
                                let offset = block_at(t) + (local * tpb + in_block) * unit;
                                emit(offset, run * unit)?;
                                t += run;
                            }
                        }
                        BlockInterior::Nhd => {
                            for t in t0..t1 {
                                let offset =
                                    block_at(t) + (((t + first) % tpb) * held_heads + local) * unit;
                                emit(offset, unit)?;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(Plan {
        segments,
        total: logical,
        block_bytes: unit,
    })
}

/// Iterator over the region ranges behind one logical range.
#[derive(Debug)]
pub struct Pieces<'a> {
    segments: &'a [Segment],
    cursor: u64,
    end: u64,
}

impl Iterator for Pieces<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.cursor >= self.end {
            return None;
        }
        let (seg, rest) = self.segments.split_first()?;
        let skip = self.cursor - seg.logical;
        let take = (seg.len - skip).min(self.end - self.cursor);
        self.cursor += take;
        if skip + take == seg.len {
            self.segments = rest;
        }
        Some((seg.offset + skip, take))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PullOpen naming block 0 a million times over 80 layers (an outside
    /// report: the plan it built got the sidecar OOM-killed) is refused by its
    /// shape alone, before any plan is built; so is a valid 1 TiB layout of
    /// 1-byte blocks asked for 2^24 pieces.
    #[test]
    fn hostile_piece_counts_are_refused_before_building() {
        let hostile = BlockSelection {
            region_id: 1,
            layer_start: 0,
            layer_count: 80,
            block_ids: vec![0; 1_000_000],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        };
        assert!(matches!(
            hostile.check_shape(Access::Read),
            Err(PlanError::TooManyPieces {
                pieces: 80_000_000,
                ..
            })
        ));
        let tiny = RegionLayout::dense(1, 1, 1 << 24, 1);
        let all = BlockSelection {
            region_id: 1,
            layer_start: 0,
            layer_count: 1,
            block_ids: (0..1 << 20).collect(),
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        };
        // 2^20 pieces of one plane are fine; with 8 planes the plan is refused.
        assert!(Plan::build(&tiny, &all, Access::Read).is_ok());
        let planes = RegionLayout::dense(1, 8, 1 << 20, 1);
        assert!(matches!(
            Plan::build(&planes, &all, Access::Read),
            Err(PlanError::TooManyPieces { .. })
        ));
    }

    fn sel(layers: (u32, u32), blocks: &[u32]) -> BlockSelection {
        BlockSelection {
            region_id: 1,
            layer_start: layers.0,
            layer_count: layers.1,
            block_ids: blocks.to_vec(),
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }
    }

    #[test]
    fn adjacent_blocks_coalesce_per_plane() {
        let l = RegionLayout::dense(2, 2, 8, 100);
        let p = Plan::build(&l, &sel((0, 2), &[2, 3, 4]), Access::Write).unwrap();
        // 2 layers x 2 planes, each a run of 3 blocks.
        assert_eq!(p.segments().len(), 4);
        assert_eq!(p.total_bytes(), 2 * 2 * 3 * 100);
        assert_eq!(
            p.segments()[1],
            Segment {
                logical: 300,
                offset: 800 + 200,
                len: 300
            }
        );
    }

    #[test]
    fn whole_dense_region_is_one_segment() {
        let l = RegionLayout::dense(3, 2, 4, 64);
        let p = Plan::build(&l, &sel((0, 3), &[0, 1, 2, 3]), Access::Read).unwrap();
        assert_eq!(
            p.segments(),
            &[Segment {
                logical: 0,
                offset: 0,
                len: l.extent()
            }]
        );
    }

    #[test]
    fn shuffled_blocks_do_not_coalesce() {
        let l = RegionLayout::dense(1, 1, 8, 10);
        let p = Plan::build(&l, &sel((0, 1), &[5, 1, 2, 7]), Access::Write).unwrap();
        let offs: Vec<_> = p.segments().iter().map(|s| (s.offset, s.len)).collect();
        assert_eq!(offs, vec![(50, 10), (10, 20), (70, 10)]);
    }

    #[test]
    fn pieces_split_across_segments() {
        let l = RegionLayout::dense(1, 1, 8, 10);
        let p = Plan::build(&l, &sel((0, 1), &[5, 1, 2, 7]), Access::Write).unwrap();
        let got: Vec<_> = p.pieces(5, 30).unwrap().collect();
        assert_eq!(got, vec![(55, 5), (10, 20), (70, 5)]);
        assert!(p.pieces(35, 6).is_err());
        assert!(p.pieces(u64::MAX, 2).is_err());
        assert_eq!(p.pieces(40, 0).unwrap().count(), 0);
    }

    #[test]
    fn validation_errors_are_specific() {
        let l = RegionLayout::dense(4, 2, 8, 16);
        assert_eq!(
            Plan::build(&l, &sel((0, 0), &[1]), Access::Read),
            Err(PlanError::NoLayers)
        );
        assert!(matches!(
            Plan::build(&l, &sel((3, 2), &[1]), Access::Read),
            Err(PlanError::LayerOutOfRange { .. })
        ));
        assert!(matches!(
            Plan::build(&l, &sel((u32::MAX, 2), &[1]), Access::Read),
            Err(PlanError::LayerOutOfRange { .. })
        ));
        assert_eq!(
            Plan::build(&l, &sel((0, 1), &[]), Access::Read),
            Err(PlanError::NoBlocks)
        );
        assert_eq!(
            Plan::build(&l, &sel((0, 1), &[8]), Access::Read),
            Err(PlanError::BlockOutOfRange {
                block: 8,
                num_blocks: 8
            })
        );
        assert_eq!(
            Plan::build(&l, &sel((0, 1), &[3, 1, 3]), Access::Write),
            Err(PlanError::DuplicateBlock(3))
        );
        // Reading a block twice is fine.
        assert!(Plan::build(&l, &sel((0, 1), &[3, 1, 3]), Access::Read).is_ok());
    }
}
