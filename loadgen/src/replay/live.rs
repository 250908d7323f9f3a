//! The live replay: emulated prefill and decode workers on two real sidecars.
//!
//! Each request starts prefill at its scheduled time (once KV memory is free on
//! both sides), "computes" for its modelled time, stamps each layer's blocks as
//! that layer finishes and pushes them (layer by layer, or all after the last
//! layer); the decode side waits for every piece, verifies every byte against
//! the prefill side's blocks and the request's stamps, and records the first
//! token. Blocks come from free lists, lowest ids first, as in a fresh vLLM pool.
//!
//! With `--prefill-tp`/`--decode-tp` every tensor-parallel rank of both
//! engines is a worker of its own with its own region (the ranks of one side
//! share block ids, as vLLM's ranks do) registered with its KV geometry
//! (HND blocks, the model's heads split as vLLM shards them). Each decode
//! rank takes each of its heads from the first prefill rank holding it:
//! whole blocks where both ranks hold the same heads, head slices
//! otherwise. Every head of every block is checked against the prefill
//! rank it came from and the request's stamps (the reference reshaping).

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use dashmap::DashMap;
use indicatif::{ProgressBar, ProgressStyle};
use kvrail_client::proto::{
    BlockInterior, BlockRange, HeadSlice, KvGeometry, Notification, NotificationKind, RegionLayout,
};
use kvrail_client::{block_offset, blocks, Client, KvRegion, SubmitPath};
use kvrail_core::geometry::{head_sources, rank_heads};
use tokio::sync::{oneshot, Notify};
use tokio_stream::StreamExt;

use super::sim::{Job, Op, Overlap, Record};
use loadgen::cluster::LocalCluster;

/// How requests' blocks are laid out in the emulators' regions.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub layers: u32,
    pub planes: u32,
    /// One KV head's share of one block of one layer and plane, as moved
    /// here (scaled); without `tp`, the whole block (one emulated worker a
    /// side, plain byte layouts).
    pub head_bytes: u64,
    pub pool_blocks: u32,
    pub tp: Option<TpShape>,
}

/// Emulated tensor-parallel ranks on both sides.
#[derive(Debug, Clone, Copy)]
pub struct TpShape {
    pub prefill: u32,
    pub decode: u32,
    pub model: &'static str,
    /// The model's KV heads (1 for an MLA latent, replicated on every rank).
    pub model_kv_heads: u32,
    /// Elements of one head of one token (scaled).
    pub head_size: u32,
    pub element_bytes: u32,
    pub tokens_per_block: u32,
}

impl Geometry {
    /// Ranks on one side (1 without `tp`).
    pub fn ranks(&self, prefill: bool) -> u32 {
        match self.tp {
            None => 1,
            Some(t) if prefill => t.prefill,
            Some(t) => t.decode,
        }
    }

    /// The model heads `rank` holds (one pseudo-head without `tp`).
    pub fn heads(&self, prefill: bool, rank: u32) -> Range<u32> {
        match self.tp {
            None => 0..1,
            Some(t) => rank_heads(t.model_kv_heads, self.ranks(prefill), rank),
        }
    }

    /// One block of one layer and plane on a rank holding `heads` heads.
    pub fn chunk_bytes(&self, heads: u32) -> u64 {
        self.head_bytes * u64::from(heads)
    }

    pub fn layout(&self, heads: u32) -> RegionLayout {
        kvrail_client::dense_layout(
            self.layers,
            self.planes,
            self.pool_blocks,
            self.chunk_bytes(heads),
        )
    }

    fn kv_geometry(&self, heads: &Range<u32>) -> Option<KvGeometry> {
        self.tp.map(|t| KvGeometry {
            model: format!("loadgen/{}", t.model),
            dtype: format!("{}-byte", t.element_bytes),
            element_bytes: t.element_bytes,
            head_size: t.head_size,
            model_kv_heads: t.model_kv_heads,
            head_start: heads.start,
            heads: heads.end - heads.start,
            tokens_per_block: t.tokens_per_block,
            interior: BlockInterior::Hnd as i32,
        })
    }

    /// Who sends what to whom: for each decode rank, each prefill rank it
    /// takes heads from, those heads, and whether they are a slice of the
    /// prefill rank's blocks (false: both hold the same heads, whole blocks
    /// move).
    pub fn routes(&self) -> Vec<Route> {
        let prefill: Vec<Range<u32>> = (0..self.ranks(true)).map(|r| self.heads(true, r)).collect();
        let mut out = Vec::new();
        for d in 0..self.ranks(false) {
            let mine = self.heads(false, d);
            for (src, heads) in head_sources(mine.clone(), &prefill) {
                out.push(Route {
                    src,
                    dst: d as usize,
                    sliced: prefill[src] != mine,
                    heads,
                });
            }
        }
        out
    }
}

/// One prefill rank's heads into one decode rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub src: usize,
    pub dst: usize,
    pub heads: Range<u32>,
    pub sliced: bool,
}

/// One emulated worker (a TP rank) and its region.
struct Rank {
    worker: String,
    kv: Arc<KvRegion>,
    region: u64,
    heads: Range<u32>,
}

impl Rank {
    fn chunk(&self, g: &Geometry) -> usize {
        g.chunk_bytes(self.heads.end - self.heads.start) as usize
    }
}

/// What a live replay measured.
pub struct LiveRun {
    pub records: Vec<Record>,
    pub ops: Vec<Op>,
    /// Bytes that arrived and were compared with their source.
    pub verified_bytes: u64,
    pub wall: Duration,
}

/// A free list of block ids; takers wait until enough are free.
pub(super) struct BlockPool {
    free: Mutex<BTreeSet<u32>>,
    freed: Notify,
    size: u32,
}

impl BlockPool {
    pub(super) fn new(size: u32) -> BlockPool {
        BlockPool {
            free: Mutex::new((0..size).collect()),
            freed: Notify::new(),
            size,
        }
    }

    pub(super) async fn take(&self, n: usize) -> anyhow::Result<Vec<u32>> {
        if n > self.size as usize {
            bail!(
                "a request needs {n} blocks but the pool has {} (raise --pool-bytes)",
                self.size
            );
        }
        loop {
            let freed = self.freed.notified();
            {
                let mut free = self
                    .free
                    .lock()
                    .map_err(|_| anyhow!("pool lock poisoned"))?;
                if free.len() >= n {
                    return Ok((0..n).filter_map(|_| free.pop_first()).collect());
                }
            }
            freed.await;
        }
    }

    pub(super) fn give(&self, ids: &[u32]) {
        if let Ok(mut free) = self.free.lock() {
            free.extend(ids.iter().copied());
        }
        self.freed.notify_waiters();
    }
}

/// What every request task shares.
struct Shared {
    jobs: Vec<Job>,
    schedule: Vec<(f64, f64)>,
    overlap: Overlap,
    geometry: Geometry,
    routes: Vec<Route>,
    prefill_ranks: Vec<Rank>,
    decode_ranks: Vec<Rank>,
    src_pool: BlockPool,
    dst_pool: BlockPool,
    prefill: Client,
    /// Request id of each outstanding push -> who waits for its notification.
    waiters: DashMap<String, oneshot::Sender<(Notification, f64)>>,
    t0: Instant,
    run: String,
    /// Mixed into every stamp, so runs in one invocation differ.
    seed: u64,
    timeout: Duration,
}

impl Shared {
    fn now_ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1000.0
    }

    async fn sleep_until_ms(&self, ms: f64) {
        let at = self.t0 + Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        tokio::time::sleep_until(at.into()).await;
    }
}

/// The word stamped at both ends of each head of a request's block chunk,
/// so a chunk left over from another request (or another head) cannot pass
/// verification.
fn stamp(run: u64, job: usize, layer: u32, plane: u32, k: usize, head: u32) -> u64 {
    let mut z = run
        ^ (job as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(head).wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ (u64::from(layer) << 40)
        ^ (u64::from(plane) << 56)
        ^ k as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Replays `jobs` (prefill at `schedule`) over the cluster's sidecars.
#[allow(clippy::too_many_arguments)]
pub async fn replay(
    cluster: &LocalCluster,
    jobs: &[Job],
    schedule: &[(f64, f64)],
    overlap: Overlap,
    geometry: Geometry,
    submit: SubmitPath,
    label: &str,
    quiet: bool,
) -> anyhow::Result<LiveRun> {
    let tag = format!("{}-{}", std::process::id(), label.replace(' ', "-"));
    let mut files: Vec<Arc<KvRegion>> = Vec::new();
    let mut outcome = Ok(());
    for prefill in [true, false] {
        for r in 0..geometry.ranks(prefill) {
            let heads = geometry.heads(prefill, r);
            let side = if prefill { "p" } else { "d" };
            match KvRegion::create(
                cluster.shm_path(&format!("replay-{side}{r}-{tag}")),
                geometry.layout(heads.end - heads.start),
            ) {
                Ok(kv) => files.push(Arc::new(kv)),
                Err(e) => {
                    outcome = Err(anyhow::Error::from(e));
                    break;
                }
            }
        }
    }
    let result = match outcome {
        Ok(()) => {
            replay_on(
                cluster, jobs, schedule, overlap, geometry, submit, &files, label, quiet,
            )
            .await
        }
        Err(e) => Err(e),
    };
    for f in &files {
        f.unlink();
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn replay_on(
    cluster: &LocalCluster,
    jobs: &[Job],
    schedule: &[(f64, f64)],
    overlap: Overlap,
    geometry: Geometry,
    submit: SubmitPath,
    files: &[Arc<KvRegion>],
    label: &str,
    quiet: bool,
) -> anyhow::Result<LiveRun> {
    let mut p = cluster
        .client(&cluster.prefill)
        .await?
        .with_submit_path(submit);
    let mut d = cluster.client(&cluster.decode).await?;
    let mut files = files.iter();
    let mut prefill_ranks = Vec::new();
    let mut decode_ranks = Vec::new();
    let mut notes = Vec::new();
    for prefill in [true, false] {
        for r in 0..geometry.ranks(prefill) {
            let kv = files.next().context("a rank without its file")?.clone();
            // Random source bytes (stamps go on top), and every destination
            // page touched now so that page allocation is not timed as
            // transfer.
            if prefill {
                crate::demo::fill_random(&kv.memory)?;
            } else {
                kv.memory.fill(0, kv.memory.len(), 0)?;
            }
            let heads = geometry.heads(prefill, r);
            let side = if prefill { "prefill" } else { "decode" };
            let worker = format!("{side}-{r}");
            let client = if prefill { &mut p } else { &mut d };
            let region = client
                .register_with_geometry(
                    &worker,
                    kv.memory.path(),
                    kv.layout,
                    geometry.kv_geometry(&heads),
                    false,
                )
                .await?;
            let rank = Rank {
                worker,
                kv,
                region,
                heads,
            };
            if prefill {
                prefill_ranks.push(rank);
            } else {
                notes.push(d.subscribe(&rank.worker).await?);
                decode_ranks.push(rank);
            }
        }
    }

    let shared = Arc::new(Shared {
        jobs: jobs.to_vec(),
        schedule: schedule.to_vec(),
        overlap,
        geometry,
        routes: geometry.routes(),
        prefill_ranks,
        decode_ranks,
        src_pool: BlockPool::new(geometry.pool_blocks),
        dst_pool: BlockPool::new(geometry.pool_blocks),
        prefill: p,
        waiters: DashMap::new(),
        t0: Instant::now(),
        run: label.to_string(),
        seed: label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }),
        timeout: Duration::from_secs(300),
    });
    // One dispatcher per decode rank's notification stream.
    let dispatchers: Vec<_> = notes
        .into_iter()
        .map(|mut notes| {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Some(n) = notes.next().await {
                    let Ok(n) = n else { break };
                    if let Some((_, tx)) = shared.waiters.remove(&n.request_id) {
                        let _ = tx.send((n, shared.now_ms()));
                    }
                }
            })
        })
        .collect();
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(jobs.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(label.to_string());
    let mut tasks = tokio::task::JoinSet::new();
    for pos in 0..jobs.len() {
        let shared = shared.clone();
        tasks.spawn(async move { (pos, run_request(&shared, pos).await) });
    }
    let mut records: Vec<Option<Record>> = vec![None; jobs.len()];
    let mut ops = Vec::new();
    let mut verified = 0u64;
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (pos, outcome) = joined.context("request task panicked")?;
        match outcome {
            Ok((record, job_ops, bytes)) => {
                records[pos] = Some(record);
                ops.extend(job_ops);
                verified += bytes;
            }
            Err(e) => failures.push(format!("request {}: {e:#}", jobs[pos].index)),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let wall = shared.t0.elapsed();
    for d in dispatchers {
        d.abort();
    }
    if !failures.is_empty() {
        let n = failures.len();
        failures.truncate(5);
        bail!(
            "{label}: {n} requests failed, e.g.\n  {}",
            failures.join("\n  ")
        );
    }
    Ok(LiveRun {
        records: records.into_iter().flatten().collect(),
        ops,
        verified_bytes: verified,
        wall,
    })
}

/// One request: prefill, pushes, wait, verify, free. Returns its record, its
/// pushes and the bytes verified.
async fn run_request(s: &Shared, pos: usize) -> anyhow::Result<(Record, Vec<Op>, u64)> {
    let job = &s.jobs[pos];
    s.sleep_until_ms(s.schedule[pos].0).await;
    let n = job.blocks as usize;
    if n == 0 {
        let start = s.now_ms();
        s.sleep_until_ms(start + job.prefill_ms).await;
        let end = start + job.prefill_ms;
        return Ok((Record::new(job, start, end, end, end), Vec::new(), 0));
    }
    let src_ids = s.src_pool.take(n).await?;
    let dst_ids = match s.dst_pool.take(n).await {
        Ok(ids) => ids,
        Err(e) => {
            s.src_pool.give(&src_ids);
            return Err(e);
        }
    };
    let outcome = transfer(s, job, &src_ids, &dst_ids).await;
    s.src_pool.give(&src_ids);
    s.dst_pool.give(&dst_ids);
    outcome
}

async fn transfer(
    s: &Shared,
    job: &Job,
    src_ids: &[u32],
    dst_ids: &[u32],
) -> anyhow::Result<(Record, Vec<Op>, u64)> {
    let g = s.geometry;
    let start = s.now_ms();
    let mut prefill = s.prefill.clone();
    let mut waits = Vec::new();
    let mut ops = Vec::new();
    let mut layer = 0u32;
    for (k, (at, count)) in s.overlap.pieces(job).into_iter().enumerate() {
        s.sleep_until_ms(start + at).await;
        let layers = layer..layer + count;
        layer += count;
        for rank in &s.prefill_ranks {
            stamp_layers(s, rank, job.index, layers.clone(), src_ids)?;
        }
        let offered = s.now_ms();
        for (r, route) in s.routes.iter().enumerate() {
            let (src, dst) = (&s.prefill_ranks[route.src], &s.decode_ranks[route.dst]);
            let id = format!("{}-{}-{k}-{r}", s.run, job.index);
            let (tx, rx) = oneshot::channel();
            s.waiters.insert(id.clone(), tx);
            let heads = u64::from(route.heads.end - route.heads.start);
            let bytes = u64::from(count)
                * u64::from(g.planes)
                * g.head_bytes
                * heads
                * src_ids.len() as u64;
            let slice = match (route.sliced, g.tp) {
                (true, Some(t)) => Some(HeadSlice {
                    head_start: route.heads.start,
                    head_count: route.heads.end - route.heads.start,
                    tokens: src_ids.len() as u64 * u64::from(t.tokens_per_block),
                    chunk_tokens: t.tokens_per_block,
                }),
                _ => None,
            };
            let from = BlockRange {
                slice,
                ..blocks(src.region, layers.clone(), src_ids.to_vec())
            };
            if let Err(e) = prefill
                .push(
                    &src.worker,
                    &id,
                    "decode",
                    from,
                    blocks(dst.region, layers.clone(), dst_ids.to_vec()),
                )
                .await
            {
                s.waiters.remove(&id);
                bail!("push {id}: {e}");
            }
            waits.push((id, rx, offered, bytes));
        }
    }
    // Prefill ends when the last layer's blocks are written: the modelled time
    // plus what this emulator took to wake and write them.
    let end = waits.last().map_or(start + job.prefill_ms, |w| w.2);
    let first_offer = waits.first().map_or(end, |w| w.2);
    let mut done = end;
    for (id, rx, offered, bytes) in waits {
        let (note, at) = tokio::time::timeout(s.timeout, rx)
            .await
            .map_err(|_| anyhow!("push {id}: no notification within {:?}", s.timeout))?
            .map_err(|_| anyhow!("push {id}: notification stream ended"))?;
        if note.kind != NotificationKind::PushReceived as i32 {
            bail!("push {id} failed: {:?}", note.failure);
        }
        done = done.max(at);
        ops.push(Op {
            start_ms: offered,
            done_ms: at,
            bytes,
        });
    }
    let verified = verify(s, job.index, src_ids, dst_ids)?;
    Ok((
        Record::new(job, start, end, first_offer, done),
        ops,
        verified,
    ))
}

/// Runs of a request's blocks that are consecutive on both sides, as
/// (index of the first within the request, source id, destination id, length):
/// each is one contiguous stretch per layer and plane in both regions.
fn runs(src: &[u32], dst: &[u32]) -> Vec<(usize, u32, u32, usize)> {
    let mut out: Vec<(usize, u32, u32, usize)> = Vec::new();
    for (k, (&a, &b)) in src.iter().zip(dst).enumerate() {
        match out.last_mut() {
            Some((_, s, d, n)) if a == *s + *n as u32 && b == *d + *n as u32 => *n += 1,
            _ => out.push((k, a, b, 1)),
        }
    }
    out
}

fn stamp_layers(
    s: &Shared,
    rank: &Rank,
    job: usize,
    layers: std::ops::Range<u32>,
    ids: &[u32],
) -> anyhow::Result<()> {
    let g = &s.geometry;
    let layout = &rank.kv.layout;
    let chunk = rank.chunk(g);
    let hb = g.head_bytes as usize;
    for layer in layers {
        for plane in 0..g.planes {
            for (k0, a, _, n) in runs(ids, ids) {
                let off = block_offset(layout, layer, plane, a);
                let mut run = rank.kv.memory.io_slices_mut(&[(off, (n * chunk) as u64)])?;
                for (i, block) in run[0].chunks_exact_mut(chunk).enumerate() {
                    for (head, piece) in rank.heads.clone().zip(block.chunks_exact_mut(hb)) {
                        let word = stamp(s.seed, job, layer, plane, k0 + i, head).to_le_bytes();
                        piece[..8].copy_from_slice(&word);
                        piece[hb - 8..].copy_from_slice(&word);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Compares every head of every chunk each decode rank received with the
/// prefill rank it came from, and its stamps: the reference reshaping.
fn verify(s: &Shared, job: usize, src_ids: &[u32], dst_ids: &[u32]) -> anyhow::Result<u64> {
    let g = &s.geometry;
    let hb = g.head_bytes as usize;
    let mut bytes = 0u64;
    let runs = runs(src_ids, dst_ids);
    for route in &s.routes {
        let (src, dst) = (&s.prefill_ranks[route.src], &s.decode_ranks[route.dst]);
        let (src_chunk, dst_chunk) = (src.chunk(g), dst.chunk(g));
        for layer in 0..g.layers {
            for plane in 0..g.planes {
                for &(k0, a, b, n) in &runs {
                    let x = src.kv.memory.io_slices(&[(
                        block_offset(&src.kv.layout, layer, plane, a),
                        (n * src_chunk) as u64,
                    )])?;
                    let y = dst.kv.memory.io_slices(&[(
                        block_offset(&dst.kv.layout, layer, plane, b),
                        (n * dst_chunk) as u64,
                    )])?;
                    for i in 0..n {
                        for head in route.heads.clone() {
                            let at =
                                |chunk: usize, first: u32| i * chunk + (head - first) as usize * hb;
                            let p = &x[0][at(src_chunk, src.heads.start)..][..hb];
                            let q = &y[0][at(dst_chunk, dst.heads.start)..][..hb];
                            let want = stamp(s.seed, job, layer, plane, k0 + i, head).to_le_bytes();
                            if p != q || q[..8] != want || q[hb - 8..] != want {
                                bail!(
                                    "layer {layer} plane {plane} head {head}: block {} of {} -> {} of {} (#{}) differs from what this request sent",
                                    a + i as u32,
                                    src.worker,
                                    b + i as u32,
                                    dst.worker,
                                    k0 + i
                                );
                            }
                        }
                    }
                    bytes += (n * hb) as u64 * u64::from(route.heads.end - route.heads.start);
                }
            }
        }
    }
    Ok(bytes)
}
