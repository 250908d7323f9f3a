//! Descriptors a heterogeneous-TP hand-off posts: a NixlConnector-style
//! plan (one descriptor per layer, K/V plane, block and remote rank's head
//! slice) against kvrail's (each side's coalesced plan of the head-sliced
//! stream, cut into wire slices), on the same request. No sidecars: what is
//! measured is building the descriptors and walking what each post gathers
//! and scatters, per decode rank, in this process.

use std::time::Instant;

use kvrail_core::geometry::{chunk_tokens, head_sources, rank_heads};
use kvrail_core::plan::{Access, BlockSelection, Plan};
use kvrail_core::{BlockInterior, HeadSlice, KvGeometry, RegionLayout};
use serde_json::{json, Value};

/// Llama-3.1-70B's KV geometry.
const LAYERS: u32 = 80;
const KV_HEADS: u32 = 8;
const HEAD_SIZE: u32 = 128;
const ELEMENT: u32 = 2;

struct Side {
    geometry: KvGeometry,
    layout: RegionLayout,
    ids: Vec<u32>,
}

fn side(tp: u32, rank: u32, tokens_per_block: u32, tokens: u64) -> Side {
    let heads = rank_heads(KV_HEADS, tp, rank);
    let geometry = KvGeometry {
        model: "meta-llama/Llama-3.1-70B".into(),
        dtype: "bfloat16".into(),
        element_bytes: ELEMENT,
        head_size: HEAD_SIZE,
        model_kv_heads: KV_HEADS,
        head_start: heads.start,
        heads: heads.end - heads.start,
        tokens_per_block,
        interior: BlockInterior::Hnd,
    };
    let blocks = tokens.div_ceil(u64::from(tokens_per_block)) as u32;
    let block_bytes =
        u64::from(geometry.heads) * u64::from(tokens_per_block) * geometry.token_head_bytes();
    // The request's blocks one apart in a pool twice as large, as a busy
    // engine's free list hands them out: no two adjacent.
    let layout = RegionLayout::dense(LAYERS, 2, 2 * blocks, block_bytes);
    Side {
        geometry,
        layout,
        ids: (0..blocks).map(|b| 2 * b).collect(),
    }
}

fn selection(s: &Side, slice: HeadSlice) -> BlockSelection {
    BlockSelection {
        region_id: 1,
        layer_start: 0,
        layer_count: LAYERS,
        block_ids: s.ids.clone(),
        generations: Vec::new(),
        slice: Some(slice),
        first_token: 0,
    }
}

/// One NixlConnector-style descriptor: a local and a remote address, a length.
struct Descriptor {
    _local: u64,
    _remote: u64,
    _len: u64,
}

/// Decode rank `rank` of `d_tp` reading the KV of `tokens` tokens from
/// prefill TP `p_tp`: both plans' descriptors and the time to build them.
fn decode_rank(p_tp: u32, d_tp: u32, rank: u32, tpb: u32, tokens: u64, slice_bytes: u64) -> Value {
    let dest = side(d_tp, rank, tpb, tokens);
    let sources: Vec<Side> = (0..p_tp).map(|r| side(p_tp, r, tpb, tokens)).collect();
    let held: Vec<_> = sources.iter().map(|s| s.geometry.head_range()).collect();
    let pairs = head_sources(dest.geometry.head_range(), &held);

    // NixlConnector: per remote rank, one descriptor per layer, plane and
    // block (the head slice of an HND block is contiguous on both sides).
    let started = Instant::now();
    let mut nixl: Vec<Descriptor> = Vec::new();
    for (src, heads) in &pairs {
        let s = &sources[*src];
        let unit = s.geometry.token_head_bytes() * u64::from(tpb);
        let len = unit * u64::from(heads.end - heads.start);
        for layer in 0..LAYERS {
            for plane in 0..2 {
                for (&local, &remote) in dest.ids.iter().zip(&s.ids) {
                    let dh = u64::from(heads.start - dest.geometry.head_start);
                    let sh = u64::from(heads.start - s.geometry.head_start);
                    nixl.push(Descriptor {
                        _local: dest.layout.block_offset(layer, plane, local) + dh * unit,
                        _remote: s.layout.block_offset(layer, plane, remote) + sh * unit,
                        _len: len,
                    });
                }
            }
        }
    }
    let nixl_ms = started.elapsed().as_secs_f64() * 1e3;
    let nixl_count = nixl.len();
    drop(nixl);

    // kvrail: each side plans the stream once; the sender posts one wire
    // slice per `slice_bytes`, gathering its pieces, and the receiver
    // scatters each into its own.
    let started = Instant::now();
    let (mut posts, mut source_runs, mut dest_runs, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut pieces_walked = 0u64;
    for (src, heads) in &pairs {
        let s = &sources[*src];
        let slice = HeadSlice {
            head_start: heads.start,
            head_count: heads.end - heads.start,
            tokens,
            chunk_tokens: chunk_tokens(&s.geometry, &dest.geometry),
        };
        let from = Plan::build_for(
            &s.layout,
            Some(&s.geometry),
            &selection(s, slice),
            Access::Read,
        );
        let to = Plan::build_for(
            &dest.layout,
            Some(&dest.geometry),
            &selection(&dest, slice),
            Access::Write,
        );
        let (Ok(from), Ok(to)) = (from, to) else {
            return json!({"error": "a plan was refused"});
        };
        source_runs += from.segments().len() as u64;
        dest_runs += to.segments().len() as u64;
        let total = from.total_bytes();
        bytes += total;
        let mut at = 0;
        while at < total {
            let len = slice_bytes.min(total - at);
            if let (Ok(g), Ok(s)) = (from.pieces(at, len), to.pieces(at, len)) {
                pieces_walked += (g.count() + s.count()) as u64;
            }
            posts += 1;
            at += len;
        }
    }
    let kvrail_ms = started.elapsed().as_secs_f64() * 1e3;
    json!({
        "decode_rank": rank,
        "prefill_ranks_read": pairs.len(),
        "bytes": bytes,
        "nixl_style": {"descriptors": nixl_count, "build_ms": nixl_ms},
        "kvrail": {
            "posts": posts,
            "slice_bytes": slice_bytes,
            "source_runs": source_runs,
            "dest_runs": dest_runs,
            "pieces_gathered_and_scattered": pieces_walked,
            "plan_and_post_ms": kvrail_ms,
        },
        "fewer_descriptors": nixl_count as f64 / posts.max(1) as f64,
    })
}

/// The report for 70B at `tokens` tokens: prefill TP 8 -> decode TP 2 and
/// TP 2 -> TP 8, decode rank 0 of each.
pub fn report(tokens: u64, tokens_per_block: u32, slice_bytes: u64) -> Value {
    let cases: Vec<Value> = [(8u32, 2u32), (2, 8)]
        .iter()
        .map(|&(p, d)| {
            json!({
                "prefill_tp": p,
                "decode_tp": d,
                "result": decode_rank(p, d, 0, tokens_per_block, tokens, slice_bytes),
            })
        })
        .collect();
    json!({
        "model": "Llama-3.1-70B geometry (80 layers, 8 KV heads, head size 128, bf16, HND)",
        "tokens": tokens,
        "tokens_per_block": tokens_per_block,
        "cases": cases,
    })
}
