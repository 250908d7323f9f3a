//! Head-sliced plans against a reference written with plain loops: every
//! prefill TP and decode TP in {1,2,4,8}, block sizes 16 <-> 64 and
//! 32 <-> 128, NHD and HND on either side. Each decode rank's blocks, filled
//! through the two sides' plans (each mapping the agreed logical stream onto
//! its own region), must equal the model's KV reshaped by hand into that
//! rank's geometry, every head read once.

use super::*;
use crate::plan::{Access, BlockSelection, Plan};
use crate::PlanError;

const LAYERS: u32 = 2;
const PLANES: u32 = 2;
const HEAD_SIZE: u32 = 4;
const ELEMENT: u32 = 2;
/// Not a multiple of any block size: the last block is partial.
const TOKENS: u64 = 200;

fn geometry(
    model_kv_heads: u32,
    tp: u32,
    rank: u32,
    tpb: u32,
    interior: BlockInterior,
) -> KvGeometry {
    let heads = rank_heads(model_kv_heads, tp, rank);
    KvGeometry {
        model: "test/llama".into(),
        dtype: "bfloat16".into(),
        element_bytes: ELEMENT,
        head_size: HEAD_SIZE,
        model_kv_heads,
        head_start: heads.start,
        heads: heads.end - heads.start,
        tokens_per_block: tpb,
        interior,
    }
}

/// One rank's region: its layout, its geometry, and the blocks (scattered,
/// not in order) that hold the request's tokens.
struct Rank {
    g: KvGeometry,
    layout: RegionLayout,
    ids: Vec<u32>,
    bytes: Vec<u8>,
}

impl Rank {
    fn new(g: KvGeometry) -> Rank {
        let blocks = TOKENS.div_ceil(u64::from(g.tokens_per_block)) as u32;
        let block_bytes = u64::from(g.heads) * u64::from(g.tokens_per_block) * g.token_head_bytes();
        // Twice the blocks needed, the request's in reverse order with gaps.
        let layout = RegionLayout::dense(LAYERS, PLANES, 2 * blocks, block_bytes);
        let ids = (0..blocks).map(|b| 2 * (blocks - 1 - b) + 1).collect();
        let bytes = vec![0u8; layout.extent() as usize];
        Rank {
            g,
            layout,
            ids,
            bytes,
        }
    }

    /// Where byte `e` of (layer, plane, token, model head) lives, by hand.
    fn offset(&self, layer: u32, plane: u32, token: u64, head: u32, e: u64) -> usize {
        let tpb = u64::from(self.g.tokens_per_block);
        let block = self.ids[(token / tpb) as usize];
        let t = token % tpb;
        let h = u64::from(head - self.g.head_start);
        let hb = self.g.token_head_bytes();
        let inner = match self.g.interior {
            BlockInterior::Nhd => (t * u64::from(self.g.heads) + h) * hb,
            BlockInterior::Hnd => (h * tpb + t) * hb,
            BlockInterior::HeadOpaque => unreachable!("not reshaped by token"),
        };
        (self.layout.block_offset(layer, plane, block) + inner + e) as usize
    }

    fn each_byte(&self, f: impl FnMut(usize, u8)) {
        self.each_byte_of(0..TOKENS, self.g.head_range(), f)
    }

    /// Each byte of the model's KV for `tokens` and `heads`, at its place in
    /// this rank.
    fn each_byte_of(&self, tokens: Range<u64>, heads: Range<u32>, mut f: impl FnMut(usize, u8)) {
        for layer in 0..LAYERS {
            for plane in 0..PLANES {
                for token in tokens.clone() {
                    for head in heads.clone() {
                        for e in 0..self.g.token_head_bytes() {
                            let at = self.offset(layer, plane, token, head, e);
                            f(at, kv_byte(layer, plane, token, head, e));
                        }
                    }
                }
            }
        }
    }

    fn selection(&self, slice: HeadSlice) -> BlockSelection {
        BlockSelection {
            region_id: 1,
            layer_start: 0,
            layer_count: LAYERS,
            block_ids: self.ids.clone(),
            generations: Vec::new(),
            slice: Some(slice),
            first_token: 0,
        }
    }

    /// The blocks holding model tokens `[start, start + slice.tokens)`,
    /// the stream starting `start % tokens_per_block` into the first.
    fn window(&self, slice: HeadSlice, start: u64) -> BlockSelection {
        let tpb = u64::from(self.g.tokens_per_block);
        let (first, end) = (start / tpb, (start + slice.tokens).div_ceil(tpb));
        BlockSelection {
            block_ids: self.ids[first as usize..end as usize].to_vec(),
            first_token: (start % tpb) as u32,
            ..self.selection(slice)
        }
    }
}

/// The model's KV: a byte that tells every coordinate apart.
fn kv_byte(layer: u32, plane: u32, token: u64, head: u32, e: u64) -> u8 {
    let x = (u64::from(layer) * 7919 + u64::from(plane) * 104_729 + token * 31 + u64::from(head))
        * 131
        + e;
    (x % 251) as u8 + 1
}

/// Moves the stream of `slice` from `src` into `dst` through both plans;
/// the bytes moved.
fn transfer(src: &Rank, dst: &mut Rank, slice: HeadSlice) -> u64 {
    transfer_between(src, src.selection(slice), dst, dst.selection(slice))
}

fn transfer_between(
    src: &Rank,
    src_sel: BlockSelection,
    dst: &mut Rank,
    dst_sel: BlockSelection,
) -> u64 {
    let from = Plan::build_for(&src.layout, Some(&src.g), &src_sel, Access::Read).unwrap();
    let to = Plan::build_for(&dst.layout, Some(&dst.g), &dst_sel, Access::Write).unwrap();
    assert_eq!(from.total_bytes(), to.total_bytes());
    assert_eq!(from.block_bytes(), to.block_bytes());
    for seg in from.segments() {
        let mut read = seg.offset as usize;
        for (offset, len) in to.pieces(seg.logical, seg.len).unwrap() {
            let (o, l) = (offset as usize, len as usize);
            dst.bytes[o..o + l].copy_from_slice(&src.bytes[read..read + l]);
            read += l;
        }
    }
    from.total_bytes()
}

#[test]
fn every_tp_pair_block_size_and_order_matches_the_reference_reshaping() {
    use BlockInterior::*;
    let tps = [1u32, 2, 4, 8];
    let block_sizes = [(16u32, 64u32), (64, 16), (32, 128), (128, 32), (16, 16)];
    let mut cases = 0;
    for model_kv_heads in [8u32, 4] {
        for &p_tp in &tps {
            for &d_tp in &tps {
                for &(p_tpb, d_tpb) in &block_sizes {
                    for (p_order, d_order) in [(Nhd, Nhd), (Hnd, Hnd), (Nhd, Hnd), (Hnd, Nhd)] {
                        let prefill: Vec<Rank> = (0..p_tp)
                            .map(|r| {
                                let mut rank =
                                    Rank::new(geometry(model_kv_heads, p_tp, r, p_tpb, p_order));
                                let mut bytes = std::mem::take(&mut rank.bytes);
                                rank.each_byte(|at, v| bytes[at] = v);
                                rank.bytes = bytes;
                                rank
                            })
                            .collect();
                        let held: Vec<Range<u32>> =
                            prefill.iter().map(|r| r.g.head_range()).collect();
                        for d in 0..d_tp {
                            let mut decode =
                                Rank::new(geometry(model_kv_heads, d_tp, d, d_tpb, d_order));
                            let sources = head_sources(decode.g.head_range(), &held);
                            let mut moved = 0;
                            for (src, heads) in sources {
                                let p = &prefill[src];
                                p.g.check_compatible(&decode.g, false).unwrap();
                                let slice = HeadSlice {
                                    head_start: heads.start,
                                    head_count: heads.end - heads.start,
                                    tokens: TOKENS,
                                    chunk_tokens: chunk_tokens(&p.g, &decode.g),
                                };
                                moved += transfer(p, &mut decode, slice);
                            }
                            // Each head once: exactly the rank's share.
                            let share = u64::from(LAYERS * PLANES)
                                * TOKENS
                                * u64::from(decode.g.heads)
                                * decode.g.token_head_bytes();
                            assert_eq!(moved, share);
                            let mut expected = vec![0u8; decode.bytes.len()];
                            decode.each_byte(|at, v| expected[at] = v);
                            assert!(
                                decode.bytes == expected,
                                "heads {model_kv_heads}: TP {p_tp} (tpb {p_tpb}, {p_order:?}) -> \
                                 TP {d_tp} rank {d} (tpb {d_tpb}, {d_order:?})"
                            );
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 4 * 15 * 5 * 4);
}

/// A decode whose prefix cache already holds the first blocks loads the
/// rest: the window starts where its blocks do, which with other block
/// sizes is inside a prefill block (and, named the other way, inside a
/// decode block). Every byte of the window lands where the reference puts
/// it, and nothing outside it is written.
#[test]
fn windows_starting_inside_a_block_match_the_reference() {
    use BlockInterior::*;
    let mut cases = 0;
    for (p_tpb, d_tpb) in [(64u32, 16u32), (16, 64), (128, 32), (32, 128), (16, 16)] {
        for (p_order, d_order) in [(Nhd, Nhd), (Hnd, Hnd), (Nhd, Hnd), (Hnd, Nhd)] {
            for (p_tp, d_tp) in [(1u32, 1u32), (2, 1), (1, 2)] {
                for start in [16u64, 48, 96, 112, 160, 199] {
                    let mut src = Rank::new(geometry(8, p_tp, 0, p_tpb, p_order));
                    let mut bytes = std::mem::take(&mut src.bytes);
                    src.each_byte(|at, v| bytes[at] = v);
                    src.bytes = bytes;
                    let mut dst = Rank::new(geometry(8, d_tp, 0, d_tpb, d_order));
                    let heads = head_sources(dst.g.head_range(), &[src.g.head_range()]);
                    let (_, heads) = heads[0].clone();
                    let slice = HeadSlice {
                        head_start: heads.start,
                        head_count: heads.end - heads.start,
                        tokens: TOKENS - start,
                        chunk_tokens: chunk_tokens(&src.g, &dst.g),
                    };
                    let dst_window = dst.window(slice, start);
                    let moved =
                        transfer_between(&src, src.window(slice, start), &mut dst, dst_window);
                    assert_eq!(
                        moved,
                        u64::from(LAYERS * PLANES)
                            * slice.tokens
                            * u64::from(slice.head_count)
                            * src.g.token_head_bytes()
                    );
                    let mut expected = vec![0u8; dst.bytes.len()];
                    dst.each_byte_of(start..TOKENS, heads.clone(), |at, v| expected[at] = v);
                    assert!(
                        dst.bytes == expected,
                        "TP {p_tp} tpb {p_tpb} {p_order:?} -> TP {d_tp} tpb {d_tpb} {d_order:?}, \
                         from token {start}"
                    );
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 5 * 4 * 3 * 6);
}

/// A first token outside its block, a window longer than its blocks, an
/// offset into opaque blocks, and an offset on whole blocks are refused.
#[test]
fn bad_first_tokens_are_refused() {
    let rank = Rank::new(geometry(8, 1, 0, 16, BlockInterior::Nhd));
    let slice = HeadSlice {
        head_start: 0,
        head_count: 8,
        tokens: 40,
        chunk_tokens: 1,
    };
    let build =
        |sel: &BlockSelection| Plan::build_for(&rank.layout, Some(&rank.g), sel, Access::Read);
    // 40 tokens from token 8: blocks 0..3 (8 + 40 = 48 = 3 blocks).
    assert!(build(&rank.window(slice, 8)).is_ok());
    let outside = BlockSelection {
        first_token: 16,
        ..rank.window(slice, 8)
    };
    let e = build(&outside).unwrap_err().to_string();
    assert!(
        e.contains("first token 16 is not inside a block of 16"),
        "{e}"
    );
    let short = BlockSelection {
        first_token: 9,
        ..rank.window(slice, 8)
    };
    let e = build(&short).unwrap_err().to_string();
    assert!(e.contains("from token 9"), "{e}");
    // A hostile peer's count that wraps past the offset: refused, not
    // planned into blocks it does not list.
    for interior in [BlockInterior::Hnd, BlockInterior::Nhd] {
        let r = Rank::new(geometry(8, 1, 0, 16, interior));
        let wraps = BlockSelection {
            block_ids: r.ids[..1].to_vec(),
            first_token: 2,
            slice: Some(HeadSlice {
                tokens: u64::MAX,
                chunk_tokens: 1,
                ..slice
            }),
            ..r.window(slice, 0)
        };
        let e = Plan::build_for(&r.layout, Some(&r.g), &wraps, Access::Write)
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflow"), "{e}");
    }
    let whole = BlockSelection {
        slice: None,
        first_token: 3,
        ..rank.window(slice, 8)
    };
    let e = Plan::build(&rank.layout, &whole, Access::Read)
        .unwrap_err()
        .to_string();
    assert!(e.contains("without a head slice"), "{e}");
}

/// Both sides HND with the same block size: one run per layer, plane and
/// block on the side whose heads the slice covers, one per head and block
/// on the other (NixlConnector posts one per layer, block and head).
#[test]
fn hnd_runs_are_whole_heads_of_whole_blocks() {
    let prefill = Rank::new(geometry(8, 8, 3, 16, BlockInterior::Hnd));
    let decode = Rank::new(geometry(8, 2, 0, 16, BlockInterior::Hnd));
    let slice = HeadSlice {
        head_start: 3,
        head_count: 1,
        tokens: TOKENS,
        chunk_tokens: 16,
    };
    let blocks = TOKENS.div_ceil(16) as usize;
    let p = Plan::build_for(
        &prefill.layout,
        Some(&prefill.g),
        &prefill.selection(slice),
        Access::Read,
    )
    .unwrap();
    let d = Plan::build_for(
        &decode.layout,
        Some(&decode.g),
        &decode.selection(slice),
        Access::Write,
    )
    .unwrap();
    assert_eq!(p.segments().len(), (LAYERS * PLANES) as usize * blocks);
    assert_eq!(d.segments().len(), (LAYERS * PLANES) as usize * blocks);
}

#[test]
fn head_opaque_blocks_slice_heads_and_refuse_other_block_sizes() {
    let mut g = geometry(4, 2, 1, 32, BlockInterior::HeadOpaque);
    // Per head: K and V of 32 tokens, packed as the kernel likes.
    let layout = RegionLayout::dense(2, 1, 8, 2 * 2 * 32 * 8);
    g.validate(&layout).unwrap();
    let sel = |chunk: u32, tokens: u64| BlockSelection {
        region_id: 1,
        layer_start: 0,
        layer_count: 2,
        block_ids: vec![5, 1],
        generations: Vec::new(),
        slice: Some(HeadSlice {
            head_start: 3,
            head_count: 1,
            tokens,
            chunk_tokens: chunk,
        }),
        first_token: 0,
    };
    let plan = Plan::build_for(&layout, Some(&g), &sel(32, 64), Access::Read).unwrap();
    let head = 2 * 32 * 8;
    assert_eq!(plan.total_bytes(), 2 * 2 * head);
    assert_eq!(
        plan.segments()[0].offset,
        layout.block_offset(0, 0, 5) + head
    );
    assert!(matches!(
        Plan::build_for(&layout, Some(&g), &sel(16, 64), Access::Read),
        Err(PlanError::Slice(_))
    ));
    let decode = KvGeometry {
        tokens_per_block: 16,
        ..g.clone()
    };
    let e = g.check_compatible(&decode, false).unwrap_err().to_string();
    assert!(e.contains("tokens per block is 32 here and 16"), "{e}");
    g.heads = 3;
    assert!(g.validate(&layout).is_err());
}

/// vllm#42895: prefill blocks of 16 tokens and decode blocks of 32 with the
/// same bytes per block passed NixlConnector's check and garbled every
/// request. Whole-block transfers between them are refused naming both
/// values; so are a dtype, a head size and a model that differ.
#[test]
fn mismatches_are_refused_naming_both_sides() {
    let prefill = geometry(8, 2, 0, 16, BlockInterior::Hnd);
    let decode = KvGeometry {
        tokens_per_block: 32,
        heads: 2,
        head_start: 0,
        ..prefill.clone()
    };
    assert_eq!(
        prefill.heads * prefill.tokens_per_block,
        decode.heads * decode.tokens_per_block
    );
    let e = prefill
        .check_compatible(&decode, true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokens per block is 16 here and 32 on the peer"),
        "{e}"
    );
    let other = |f: &dyn Fn(&mut KvGeometry)| {
        let mut g = prefill.clone();
        f(&mut g);
        prefill.check_compatible(&g, false).unwrap_err().to_string()
    };
    assert!(other(&|g| g.dtype = "float16".into()).contains("bfloat16 here and float16"));
    assert!(other(&|g| g.head_size = 8).contains("head size is 4 here and 8"));
    assert!(other(&|g| g.model = "test/other".into()).contains("test/llama here and test/other"));
    // Head slices may differ in TP and block size, not in the model's heads.
    assert!(other(&|g| g.model_kv_heads = 16).contains("KV heads is 8 here and 16"));
    prefill
        .check_compatible(&geometry(8, 8, 5, 64, BlockInterior::Nhd), false)
        .unwrap();
}

#[test]
fn hostile_slices_are_refused_before_building() {
    let rank = Rank::new(geometry(8, 4, 1, 16, BlockInterior::Nhd));
    let with = |slice: HeadSlice, blocks: Vec<u32>| {
        Plan::build_for(
            &rank.layout,
            Some(&rank.g),
            &BlockSelection {
                block_ids: blocks,
                ..rank.selection(slice)
            },
            Access::Write,
        )
    };
    let ok = HeadSlice {
        head_start: 2,
        head_count: 2,
        tokens: TOKENS,
        chunk_tokens: 1,
    };
    assert!(with(ok, rank.ids.clone()).is_ok());
    // Heads this rank does not hold, or wrapping past u32.
    for (start, count) in [(0, 2), (3, 2), (u32::MAX, 2), (2, 0)] {
        let s = HeadSlice {
            head_start: start,
            head_count: count,
            ..ok
        };
        assert!(matches!(
            with(s, rank.ids.clone()),
            Err(PlanError::Slice(_))
        ));
    }
    // More tokens than the listed blocks hold, or fewer.
    for tokens in [TOKENS + 16, 1, 0] {
        let s = HeadSlice { tokens, ..ok };
        assert!(matches!(
            with(s, rank.ids.clone()),
            Err(PlanError::Slice(_))
        ));
    }
    // A million blocks of 16 tokens, NHD, one token per chunk: 2^26 steps
    // and more are refused up front.
    let big = RegionLayout::dense(80, 2, 1 << 20, rank.layout.block_bytes);
    let s = HeadSlice {
        tokens: 16 << 20,
        ..ok
    };
    let e = Plan::build_for(
        &big,
        Some(&rank.g),
        &BlockSelection {
            layer_count: 80,
            block_ids: (0..1 << 20).collect(),
            ..rank.selection(s)
        },
        Access::Read,
    );
    assert!(matches!(e, Err(PlanError::TooManyPieces { .. })), "{e:?}");
    // No geometry: a slice cannot be planned.
    assert!(matches!(
        Plan::build(&rank.layout, &rank.selection(ok), Access::Read),
        Err(PlanError::NoGeometry)
    ));
}

#[test]
fn ranks_hold_heads_as_vllm_shards_them() {
    assert_eq!(rank_heads(8, 2, 1), 4..8);
    assert_eq!(rank_heads(8, 8, 7), 7..8);
    // More ranks than heads: replicated on consecutive ranks.
    assert_eq!(rank_heads(2, 4, 0), 0..1);
    assert_eq!(rank_heads(2, 4, 1), 0..1);
    assert_eq!(rank_heads(2, 4, 3), 1..2);
    // A replicated head is read from one rank only.
    let sources: Vec<_> = (0..4).map(|r| rank_heads(2, 4, r)).collect();
    assert_eq!(head_sources(0..2, &sources), vec![(0, 0..1), (2, 1..2)]);
    assert_eq!(
        head_sources(2..6, &[0..4, 4..8]),
        vec![(0, 2..4), (1, 4..6)]
    );
}
