//! The live replay: emulated prefill and decode workers on two real sidecars.
//!
//! Each request starts prefill at its scheduled time (once KV memory is free on
//! both sides), "computes" for its modelled time, stamps each layer's blocks as
//! that layer finishes and pushes them (layer by layer, or all after the last
//! layer); the decode side waits for every piece, verifies every byte against
//! the prefill side's blocks and the request's stamps, and records the first
//! token. Blocks come from free lists, lowest ids first, as in a fresh vLLM pool.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use dashmap::DashMap;
use indicatif::{ProgressBar, ProgressStyle};
use kvrail_client::proto::{Notification, NotificationKind, RegionLayout};
use kvrail_client::{block_offset, blocks, Client, KvRegion, SubmitPath};
use tokio::sync::{oneshot, Notify};
use tokio_stream::StreamExt;

use super::sim::{Job, Op, Overlap, Record};
use loadgen::cluster::LocalCluster;

/// How requests' blocks are laid out in the emulators' regions.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub layers: u32,
    pub planes: u32,
    /// One block of one layer and plane, as moved here (scaled).
    pub chunk_bytes: u64,
    pub pool_blocks: u32,
}

impl Geometry {
    pub fn layout(&self) -> RegionLayout {
        kvrail_client::dense_layout(self.layers, self.planes, self.pool_blocks, self.chunk_bytes)
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
struct Pool {
    free: Mutex<BTreeSet<u32>>,
    freed: Notify,
    size: u32,
}

impl Pool {
    fn new(size: u32) -> Pool {
        Pool {
            free: Mutex::new((0..size).collect()),
            freed: Notify::new(),
            size,
        }
    }

    async fn take(&self, n: usize) -> anyhow::Result<Vec<u32>> {
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

    fn give(&self, ids: &[u32]) {
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
    src: Arc<KvRegion>,
    dst: Arc<KvRegion>,
    src_pool: Pool,
    dst_pool: Pool,
    prefill: Client,
    src_region: u64,
    dst_region: u64,
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

/// The word stamped at both ends of a request's block chunk, so a chunk left
/// over from another request cannot pass verification.
fn stamp(run: u64, job: usize, layer: u32, plane: u32, k: usize) -> u64 {
    let mut z = run
        ^ (job as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
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
    let layout = geometry.layout();
    let tag = format!("{}-{}", std::process::id(), label.replace(' ', "-"));
    let src = Arc::new(KvRegion::create(
        cluster.shm_path(&format!("replay-p-{tag}")),
        layout,
    )?);
    let dst = Arc::new(KvRegion::create(
        cluster.shm_path(&format!("replay-d-{tag}")),
        layout,
    )?);
    let result = replay_on(
        cluster, jobs, schedule, overlap, geometry, submit, &src, &dst, label, quiet,
    )
    .await;
    src.unlink();
    dst.unlink();
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
    src: &Arc<KvRegion>,
    dst: &Arc<KvRegion>,
    label: &str,
    quiet: bool,
) -> anyhow::Result<LiveRun> {
    // Random source bytes (stamps go on top), and every destination page
    // touched now so that page allocation is not timed as transfer.
    crate::demo::fill_random(&src.memory)?;
    dst.memory.fill(0, dst.memory.len(), 0)?;
    let mut p = cluster
        .client(&cluster.prefill)
        .await?
        .with_submit_path(submit);
    let mut d = cluster.client(&cluster.decode).await?;
    let src_region = p.register_region("prefill-0", src, false).await?;
    let dst_region = d.register_region("decode-0", dst, false).await?;
    let mut notes = d.subscribe("decode-0").await?;

    let shared = Arc::new(Shared {
        jobs: jobs.to_vec(),
        schedule: schedule.to_vec(),
        overlap,
        geometry,
        src: src.clone(),
        dst: dst.clone(),
        src_pool: Pool::new(geometry.pool_blocks),
        dst_pool: Pool::new(geometry.pool_blocks),
        prefill: p,
        src_region,
        dst_region,
        waiters: DashMap::new(),
        t0: Instant::now(),
        run: label.to_string(),
        seed: label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }),
        timeout: Duration::from_secs(300),
    });
    let dispatcher = {
        let shared = shared.clone();
        tokio::spawn(async move {
            while let Some(n) = notes.next().await {
                let Ok(n) = n else { break };
                if let Some((_, tx)) = shared.waiters.remove(&n.request_id) {
                    let _ = tx.send((n, shared.now_ms()));
                }
            }
        })
    };
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
    dispatcher.abort();
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
        stamp_layers(s, job.index, layers.clone(), src_ids)?;
        let id = format!("{}-{}-{k}", s.run, job.index);
        let (tx, rx) = oneshot::channel();
        s.waiters.insert(id.clone(), tx);
        let offered = s.now_ms();
        let bytes = u64::from(count) * u64::from(g.planes) * g.chunk_bytes * src_ids.len() as u64;
        if let Err(e) = prefill
            .push(
                "prefill-0",
                &id,
                "decode",
                blocks(s.src_region, layers.clone(), src_ids.to_vec()),
                blocks(s.dst_region, layers, dst_ids.to_vec()),
            )
            .await
        {
            s.waiters.remove(&id);
            bail!("push {id}: {e}");
        }
        waits.push((id, rx, offered, bytes));
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
    job: usize,
    layers: std::ops::Range<u32>,
    ids: &[u32],
) -> anyhow::Result<()> {
    let layout = &s.src.layout;
    let chunk = s.geometry.chunk_bytes as usize;
    for layer in layers {
        for plane in 0..s.geometry.planes {
            for (k0, a, _, n) in runs(ids, ids) {
                let off = block_offset(layout, layer, plane, a);
                let mut run = s.src.memory.io_slices_mut(&[(off, (n * chunk) as u64)])?;
                for (i, piece) in run[0].chunks_exact_mut(chunk).enumerate() {
                    let word = stamp(s.seed, job, layer, plane, k0 + i).to_le_bytes();
                    piece[..8].copy_from_slice(&word);
                    piece[chunk - 8..].copy_from_slice(&word);
                }
            }
        }
    }
    Ok(())
}

/// Compares every chunk of the request with its source, and its stamps.
fn verify(s: &Shared, job: usize, src_ids: &[u32], dst_ids: &[u32]) -> anyhow::Result<u64> {
    let layout = &s.src.layout;
    let chunk = s.geometry.chunk_bytes as usize;
    let mut bytes = 0u64;
    let runs = runs(src_ids, dst_ids);
    for layer in 0..s.geometry.layers {
        for plane in 0..s.geometry.planes {
            for &(k0, a, b, n) in &runs {
                let len = (n * chunk) as u64;
                let x = s
                    .src
                    .memory
                    .io_slices(&[(block_offset(layout, layer, plane, a), len)])?;
                let y = s
                    .dst
                    .memory
                    .io_slices(&[(block_offset(layout, layer, plane, b), len)])?;
                let bad = if *x[0] != *y[0] {
                    x[0].chunks_exact(chunk)
                        .zip(y[0].chunks_exact(chunk))
                        .position(|(p, q)| p != q)
                } else {
                    y[0].chunks_exact(chunk).enumerate().position(|(i, q)| {
                        let want = stamp(s.seed, job, layer, plane, k0 + i).to_le_bytes();
                        q[..8] != want || q[chunk - 8..] != want
                    })
                };
                if let Some(i) = bad {
                    bail!(
                        "layer {layer} plane {plane}: block {} -> {} (#{}) differs from what this request sent",
                        a + i as u32,
                        b + i as u32,
                        k0 + i
                    );
                }
                bytes += len;
            }
        }
    }
    Ok(bytes)
}
