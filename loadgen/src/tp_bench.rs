//! `bench --only tp`: heterogeneous pushes against the homogeneous push of
//! the same bytes, between the bench's two sidecars. Emulated ranks of a
//! 70B-shaped KV (8 KV heads, head size 128, bf16, HND, blocks of 16 tokens,
//! 8 layers): TP 1 -> TP 1 whole blocks; TP 2 -> TP 1 (two prefill ranks push
//! their heads into one decode rank's blocks at once); TP 1 -> TP 2 (one
//! prefill rank pushes each half of its heads to a decode rank); TP 1 -> TP 1
//! into NHD blocks and back (each head of each token its own run on the NHD
//! side); TP 1 -> TP 1 into blocks of 64 tokens. Rounds alternate the patterns;
//! every pattern's bytes are checked against the reference reshaping, head
//! by head and token by token, once per round.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::blocks;
use kvrail_client::proto::{
    BlockInterior, BlockRange, HeadSlice, KvGeometry, RegionLayout, TransferState,
};
use serde_json::json;

use crate::bench::{round3, Bench};
use crate::stats::gbps;

const LAYERS: u32 = 8;
const KV_HEADS: u32 = 8;
const HEAD_BYTES: u64 = 128 * 2;
const TOKENS_PER_BLOCK: u32 = 16;
/// Blocks per request (every other block of a pool twice as large).
const BLOCKS: u32 = 256;
/// Tokens per request.
const TOKENS: u64 = BLOCKS as u64 * TOKENS_PER_BLOCK as u64;

/// The bytes both files must hold for this part.
pub(crate) const FILE_BYTES: u64 =
    LAYERS as u64 * 2 * 2 * BLOCKS as u64 * KV_HEADS as u64 * TOKENS_PER_BLOCK as u64 * HEAD_BYTES;

/// One emulated rank: its region on one side (a slice of the bench's file).
struct Rank {
    worker: String,
    region: u64,
    layout: RegionLayout,
    heads: std::ops::Range<u32>,
    shape: Shape,
    /// The request's blocks: every other block of the pool.
    ids: Vec<u32>,
}

/// How a rank's blocks hold tokens and heads.
#[derive(Clone, Copy)]
struct Shape {
    tokens_per_block: u32,
    interior: BlockInterior,
}

const HND16: Shape = Shape {
    tokens_per_block: TOKENS_PER_BLOCK,
    interior: BlockInterior::Hnd,
};

impl Rank {
    /// Where one head of one token of the request lives in the file.
    fn offset(&self, layer: u32, plane: u32, token: u64, head: u32) -> u64 {
        let tpb = u64::from(self.shape.tokens_per_block);
        let block = self.ids[(token / tpb) as usize];
        let (t, h) = (token % tpb, u64::from(head - self.heads.start));
        let inner = if self.shape.interior == BlockInterior::Nhd {
            t * u64::from(self.heads.end - self.heads.start) + h
        } else {
            h * tpb + t
        };
        kvrail_client::block_offset(&self.layout, layer, plane, block) + inner * HEAD_BYTES
    }
}

fn layout(heads: u32, shape: Shape, base_offset: u64) -> RegionLayout {
    let block = u64::from(heads) * u64::from(shape.tokens_per_block) * HEAD_BYTES;
    let blocks = (TOKENS / u64::from(shape.tokens_per_block)) as u32;
    let mut l = kvrail_client::dense_layout(LAYERS, 2, 2 * blocks, block);
    l.base_offset = base_offset;
    l
}

fn geometry(heads: std::ops::Range<u32>, shape: Shape) -> KvGeometry {
    KvGeometry {
        model: "bench/70b-kv".into(),
        dtype: "bfloat16".into(),
        element_bytes: 2,
        head_size: 128,
        model_kv_heads: KV_HEADS,
        head_start: heads.start,
        heads: heads.end - heads.start,
        tokens_per_block: shape.tokens_per_block,
        interior: shape.interior as i32,
    }
}

/// The ranks of one side at `tp`: rank r's region sits at r/tp of the file
/// (the TP 1 rank spans all of it).
async fn ranks(
    bench: &mut Bench,
    prefill: bool,
    tp: u32,
    shape: Shape,
) -> anyhow::Result<Vec<Rank>> {
    let mut out = Vec::new();
    let share = FILE_BYTES / u64::from(tp);
    for r in 0..tp {
        let per = KV_HEADS / tp;
        let heads = r * per..(r + 1) * per;
        let l = layout(per, shape, u64::from(r) * share);
        let side = if prefill { "p" } else { "d" };
        let worker = format!(
            "tp{tp}-{}{}-{side}{r}",
            shape.interior.as_str_name(),
            shape.tokens_per_block
        );
        let (client, mem) = if prefill {
            (&mut bench.p, &bench.p_mem)
        } else {
            (&mut bench.d, &bench.d_mem)
        };
        let region = client
            .register_with_geometry(
                &worker,
                mem.path(),
                l,
                Some(geometry(heads.clone(), shape)),
                true,
            )
            .await?;
        let blocks = (TOKENS / u64::from(shape.tokens_per_block)) as u32;
        out.push(Rank {
            worker,
            region,
            layout: l,
            heads,
            shape,
            ids: (0..blocks).map(|b| 2 * b).collect(),
        });
    }
    Ok(out)
}

fn range(rank: &Rank, slice: Option<HeadSlice>) -> BlockRange {
    BlockRange {
        slice,
        ..blocks(rank.region, 0..LAYERS, rank.ids.clone())
    }
}

/// The heads `heads` of every token, between ranks of shapes `a` and `b`.
fn slice(heads: &std::ops::Range<u32>, a: Shape, b: Shape) -> HeadSlice {
    let both_nhd = a.interior == BlockInterior::Nhd && b.interior == BlockInterior::Nhd;
    HeadSlice {
        head_start: heads.start,
        head_count: heads.end - heads.start,
        tokens: TOKENS,
        chunk_tokens: if both_nhd {
            1
        } else {
            a.tokens_per_block.max(b.tokens_per_block)
        },
    }
}

/// One pattern: its name, its pushes (source rank, destination rank,
/// slice), and the ranks its bytes are verified between.
type Pattern<'a> = (
    &'static str,
    Vec<(&'a Rank, &'a Rank, Option<HeadSlice>)>,
    &'a [Rank],
    &'a [Rank],
);

/// Starts every (source rank, destination rank, slice) push at once and
/// waits for all: the time from the first call to the last completion.
async fn push_all(
    bench: &mut Bench,
    pushes: &[(&Rank, &Rank, Option<HeadSlice>)],
    round: usize,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut ids = Vec::new();
    for (i, (src, dst, cut)) in pushes.iter().enumerate() {
        let t = bench
            .p
            .push(
                &src.worker,
                &format!("tp-{round}-{i}-{}", src.worker),
                "decode",
                range(src, *cut),
                range(dst, None),
            )
            .await?;
        ids.push(t.transfer_id);
    }
    for id in ids {
        let s = bench.p.wait(id, Some(Duration::from_secs(120))).await?;
        if s.state != TransferState::Done as i32 {
            bail!("a tp push did not complete: {:?}", s.failure);
        }
    }
    Ok(start.elapsed())
}

/// Whether every decode rank's request blocks hold the source heads, head
/// by head and token by token, wherever each side's shape puts them.
fn verify(bench: &Bench, sources: &[Rank], dests: &[Rank]) -> anyhow::Result<()> {
    let mut a = vec![0u8; HEAD_BYTES as usize];
    let mut b = vec![0u8; HEAD_BYTES as usize];
    for dst in dests {
        for layer in 0..LAYERS {
            for plane in 0..2 {
                for token in 0..TOKENS {
                    for head in dst.heads.clone() {
                        let src = sources
                            .iter()
                            .find(|s| s.heads.contains(&head))
                            .context("no source holds a head")?;
                        bench
                            .p_mem
                            .read_at(src.offset(layer, plane, token, head), &mut a)?;
                        bench
                            .d_mem
                            .read_at(dst.offset(layer, plane, token, head), &mut b)?;
                        if a != b {
                            bail!("head {head} of token {token} (layer {layer}, plane {plane}) differs");
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

pub(crate) async fn run(bench: &mut Bench, rounds: usize) -> anyhow::Result<()> {
    let nhd16 = Shape {
        tokens_per_block: TOKENS_PER_BLOCK,
        interior: BlockInterior::Nhd,
    };
    let hnd64 = Shape {
        tokens_per_block: 4 * TOKENS_PER_BLOCK,
        interior: BlockInterior::Hnd,
    };
    let p1 = ranks(bench, true, 1, HND16).await?;
    let p2 = ranks(bench, true, 2, HND16).await?;
    let d1 = ranks(bench, false, 1, HND16).await?;
    let d2 = ranks(bench, false, 2, HND16).await?;
    let d1_nhd = ranks(bench, false, 1, nhd16).await?;
    let p1_nhd = ranks(bench, true, 1, nhd16).await?;
    let d1_64 = ranks(bench, false, 1, hnd64).await?;
    let bytes = u64::from(LAYERS) * 2 * u64::from(BLOCKS) * p1[0].layout.block_bytes;
    let all = 0..KV_HEADS;
    let patterns: [Pattern<'_>; 6] = [
        ("tp1->tp1", vec![(&p1[0], &d1[0], None)], &p1, &d1),
        (
            "tp2->tp1",
            vec![
                (&p2[0], &d1[0], Some(slice(&p2[0].heads, HND16, HND16))),
                (&p2[1], &d1[0], Some(slice(&p2[1].heads, HND16, HND16))),
            ],
            &p2,
            &d1,
        ),
        (
            "tp1->tp2",
            vec![
                (&p1[0], &d2[0], Some(slice(&d2[0].heads, HND16, HND16))),
                (&p1[0], &d2[1], Some(slice(&d2[1].heads, HND16, HND16))),
            ],
            &p1,
            &d2,
        ),
        (
            "tp1->tp1 hnd->nhd",
            vec![(&p1[0], &d1_nhd[0], Some(slice(&all, HND16, nhd16)))],
            &p1,
            &d1_nhd,
        ),
        (
            "tp1->tp1 nhd->hnd",
            vec![(&p1_nhd[0], &d1[0], Some(slice(&all, nhd16, HND16)))],
            &p1_nhd,
            &d1,
        ),
        (
            "tp1->tp1 16->64 tokens",
            vec![(&p1[0], &d1_64[0], Some(slice(&all, HND16, hnd64)))],
            &p1,
            &d1_64,
        ),
    ];
    // Per pattern: GB/s of each round (each round several pushes' worth).
    let per_round = ((1u64 << 30) / bytes).max(2) as usize;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); patterns.len()];
    for round in 0..=rounds {
        for (k, (name, pushes, sources, dests)) in patterns.iter().enumerate() {
            bench.d_mem.fill(0, bench.d_mem.len(), 0)?;
            let mut total = Duration::ZERO;
            for i in 0..per_round {
                total += push_all(bench, pushes, round * 1000 + k * 100 + i).await?;
            }
            verify(bench, sources, dests).with_context(|| format!("{name} moved wrong bytes"))?;
            // Round 0 warms up (page faults, connections).
            if round > 0 {
                rates[k].push(gbps(bytes * per_round as u64, total));
            }
        }
    }
    let median = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).copied().unwrap_or(0.0)
    };
    let homogeneous = median(&rates[0]);
    let cases: Vec<serde_json::Value> = patterns
        .iter()
        .zip(&rates)
        .map(|((name, pushes, ..), r)| {
            json!({
                "pattern": name,
                "pushes_per_request": pushes.len(),
                "gbps_per_round": r.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
                "gbps_median": round3(median(r)),
                "ratio_vs_homogeneous": round3(median(r) / homogeneous),
            })
        })
        .collect();
    println!(
        "{}",
        json!({
            "bench": "tp",
            "transport": bench.transport,
            "bytes_per_request": bytes,
            "requests_per_round": per_round,
            "rounds": rounds,
            "geometry": "8 KV heads, head size 128, bf16, HND, 16 tokens per block, 8 layers, every other block (the mixed patterns: NHD on one side; the last: 64 tokens per block on the decode)",
            "cases": cases,
        })
    );
    for rank in p1.iter().chain(&p2).chain(&p1_nhd) {
        bench.p.unregister_region(rank.region).await?;
    }
    for rank in d1.iter().chain(&d2).chain(&d1_nhd).chain(&d1_64) {
        bench.d.unregister_region(rank.region).await?;
    }
    Ok(())
}
