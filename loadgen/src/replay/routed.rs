//! `loadgen replay --cluster N:M`: the trace over N prefill and M decode
//! sidecars that find each other through etcd, each request routed to a
//! prefill and a decode instance by the router's policies (round robin, or
//! least-loaded by queued tokens, as `kvrail.vllm_router` does), one run per
//! policy. Each prefill sidecar stands for one prefill instance (its requests
//! queue for it, prefill time from the model's curve); once a request's
//! prefill ends, its KV is pushed to the chosen decode sidecar, which is named
//! by node only (resolved through etcd), and every byte is compared with its
//! source. TTFT per policy.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use serde_json::json;

use super::live::BlockPool;
use super::sim::{self, Job, Record};
use crate::stats::human_bytes;
use loadgen::etcd_nodes::{EtcdNodes, EtcdProcess, NodeOptions};

/// How a request's instances are picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Policy, String> {
        match s {
            "round_robin" => Ok(Policy::RoundRobin),
            "least_loaded" => Ok(Policy::LeastLoaded),
            _ => Err(format!("{s:?}: want round_robin or least_loaded")),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
        }
    }
}

/// `N:M`: prefill and decode sidecars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterShape {
    pub prefill: usize,
    pub decode: usize,
}

impl ClusterShape {
    pub fn parse(s: &str) -> Result<ClusterShape, String> {
        let (p, d) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: want PREFILL:DECODE, e.g. 4:4"))?;
        let n = |v: &str| {
            v.trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| format!("{s:?}: each side 1..=64"))
        };
        Ok(ClusterShape {
            prefill: n(p)?,
            decode: n(d)?,
        })
    }
}

/// The instances of one role and the tokens this router queued on each:
/// the same rules as `kvrail.routing.Pools` (ties and round robin go in turn).
#[derive(Debug, Clone)]
pub struct Pools {
    policy: Policy,
    turn: usize,
    queued: Vec<u64>,
}

impl Pools {
    pub fn new(policy: Policy, instances: usize) -> Pools {
        Pools {
            policy,
            turn: 0,
            queued: vec![0; instances],
        }
    }

    /// The instance for `tokens`, queued on it until [`Pools::release`].
    pub fn pick(&mut self, tokens: u64) -> usize {
        let n = self.queued.len();
        let order = (0..n).map(|k| (self.turn + k) % n);
        let chosen = match self.policy {
            Policy::RoundRobin => self.turn % n,
            Policy::LeastLoaded => order
                .min_by_key(|&i| self.queued[i])
                .unwrap_or(self.turn % n),
        };
        self.turn = chosen + 1;
        self.queued[chosen] += tokens;
        chosen
    }

    pub fn release(&mut self, instance: usize, tokens: u64) {
        self.queued[instance] = self.queued[instance].saturating_sub(tokens);
    }
}

/// One emulated worker: its region on its node's sidecar and free blocks.
struct Worker {
    client: Client,
    kv: Arc<KvRegion>,
    region: u64,
    pool: BlockPool,
}

/// The routing state every request task shares.
struct Router {
    prefill: Pools,
    decode: Pools,
    /// When each prefill instance is free again (replay ms).
    busy_until: Vec<f64>,
}

struct Run {
    jobs: Vec<Job>,
    prefill: Vec<Worker>,
    decode: Vec<Worker>,
    decode_names: Vec<String>,
    router: Mutex<Router>,
    layers: u32,
    planes: u32,
    t0: Instant,
    seed: u64,
    timeout: Duration,
}

/// What one policy's run measured.
pub struct PolicyRun {
    pub policy: Policy,
    pub records: Vec<Record>,
    pub verified_bytes: u64,
    pub per_prefill: Vec<usize>,
    pub per_decode: Vec<usize>,
    pub wall: Duration,
}

/// Flags the cluster run takes from `loadgen replay`.
pub struct ClusterArgs {
    pub shape: ClusterShape,
    pub policies: Vec<Policy>,
    pub etcd: Option<String>,
    pub layers: u32,
    pub planes: u32,
    pub chunk_bytes: u64,
    pub pool_bytes: u64,
    pub connections: usize,
    pub slice_bytes: u64,
    pub sidecar_args: Vec<String>,
}

pub async fn run(a: &ClusterArgs, jobs: &[Job]) -> anyhow::Result<Vec<PolicyRun>> {
    let local_etcd;
    let etcd_url = match &a.etcd {
        Some(url) => url.clone(),
        None => {
            local_etcd = EtcdProcess::start()?;
            local_etcd.url.clone()
        }
    };
    let opts = NodeOptions {
        program: (std::env::current_exe()?, "sidecar"),
        etcd_url: etcd_url.clone(),
        connections_per_rail: a.connections,
        slice_bytes: a.slice_bytes,
        extra_args: a.sidecar_args.clone(),
    };
    let started = Instant::now();
    let nodes = EtcdNodes::start(a.shape.prefill, a.shape.decode, &opts).await?;
    eprintln!(
        "cluster: {} prefill and {} decode sidecars up in {:.1} s, registered in etcd at {etcd_url} (no static peers)",
        a.shape.prefill,
        a.shape.decode,
        started.elapsed().as_secs_f64()
    );
    let block_set = u64::from(a.layers) * u64::from(a.planes) * a.chunk_bytes;
    let pool_blocks = u32::try_from((a.pool_bytes / block_set).max(1))?;
    let layout = dense_layout(a.layers, a.planes, pool_blocks, a.chunk_bytes);
    let mut files = Vec::new();
    let mut out = Vec::new();
    let result = async {
        let mut workers = |side: &[loadgen::cluster::SidecarProcess], tag: &str| {
            side.iter()
                .enumerate()
                .map(|(i, s)| {
                    let kv = Arc::new(KvRegion::create(
                        nodes.shm_path(&format!("cluster-{tag}{i}")),
                        layout,
                    )?);
                    files.push(kv.clone());
                    Ok((s.socket.clone(), kv))
                })
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let prefill_files = workers(&nodes.prefill, "p")?;
        let decode_files = workers(&nodes.decode, "d")?;
        let mut prefill = Vec::new();
        for (socket, kv) in prefill_files {
            prefill.push(worker(&socket, kv, pool_blocks, true).await?);
        }
        let mut decode = Vec::new();
        for (socket, kv) in decode_files {
            decode.push(worker(&socket, kv, pool_blocks, false).await?);
        }
        for (k, &policy) in a.policies.iter().enumerate() {
            let run = Arc::new(Run {
                jobs: jobs.to_vec(),
                prefill: std::mem::take(&mut prefill),
                decode: std::mem::take(&mut decode),
                decode_names: nodes.decode.iter().map(|s| s.node.clone()).collect(),
                router: Mutex::new(Router {
                    prefill: Pools::new(policy, a.shape.prefill),
                    decode: Pools::new(policy, a.shape.decode),
                    busy_until: vec![0.0; a.shape.prefill],
                }),
                layers: a.layers,
                planes: a.planes,
                t0: Instant::now(),
                seed: rand::random::<u64>() ^ k as u64,
                timeout: Duration::from_secs(120),
            });
            let measured = replay(run.clone(), policy).await?;
            let run =
                Arc::try_unwrap(run).map_err(|_| anyhow!("a request task outlived its run"))?;
            prefill = run.prefill;
            decode = run.decode;
            out.push(measured);
        }
        anyhow::Ok(())
    }
    .await;
    for f in &files {
        f.unlink();
    }
    result?;
    Ok(out)
}

async fn worker(
    socket: &std::path::Path,
    kv: Arc<KvRegion>,
    pool_blocks: u32,
    source: bool,
) -> anyhow::Result<Worker> {
    let mut client = Client::connect(socket).await?;
    let region = client.register_region("w", &kv, false).await?;
    if source {
        // Random bytes in every source block (stamps go on top per request).
        let mut bytes = vec![0u8; kv.layout.block_bytes as usize];
        for b in 0..pool_blocks {
            for layer in 0..kv.layout.num_layers {
                for plane in 0..kv.layout.planes_per_layer {
                    rand::Rng::fill(&mut rand::rng(), &mut bytes[..]);
                    kv.write_block(layer, plane, b, &bytes)?;
                }
            }
        }
    }
    Ok(Worker {
        client,
        kv,
        region,
        pool: BlockPool::new(pool_blocks),
    })
}

async fn replay(run: Arc<Run>, policy: Policy) -> anyhow::Result<PolicyRun> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for pos in 0..run.jobs.len() {
        let run = run.clone();
        tasks.push(tokio::spawn(async move {
            let at = run.t0 + Duration::from_secs_f64(run.jobs[pos].arrival_ms / 1000.0);
            tokio::time::sleep_until(at.into()).await;
            request(&run, pos).await
        }));
    }
    let mut records = Vec::new();
    let mut verified = 0;
    let mut per_prefill = vec![0; run.prefill.len()];
    let mut per_decode = vec![0; run.decode.len()];
    for t in tasks {
        let (record, bytes, p, d) = t.await.context("a request task panicked")??;
        records.push(record);
        verified += bytes;
        per_prefill[p] += 1;
        per_decode[d] += 1;
    }
    records.sort_by_key(|r| r.index);
    Ok(PolicyRun {
        policy,
        records,
        verified_bytes: verified,
        per_prefill,
        per_decode,
        wall: started.elapsed(),
    })
}

fn now_ms(run: &Run) -> f64 {
    run.t0.elapsed().as_secs_f64() * 1000.0
}

/// One request: routed, prefilled (emulated), its KV pushed to the decode
/// node named by etcd, checked byte for byte. (record, bytes, prefill, decode).
async fn request(run: &Run, pos: usize) -> anyhow::Result<(Record, u64, usize, usize)> {
    let job = &run.jobs[pos];
    let tokens = job.prompt_tokens;
    let (p, start, end) = {
        let mut r = run
            .router
            .lock()
            .map_err(|_| anyhow!("router lock poisoned"))?;
        let p = r.prefill.pick(tokens);
        let start = r.busy_until[p].max(job.arrival_ms);
        let end = start + job.prefill_ms;
        r.busy_until[p] = end;
        (p, start, end)
    };
    let n = usize::try_from(job.blocks)?;
    let src = run.prefill[p].pool.take(n).await?;
    // Written while the prefill is emulated, as a real prefill writes its KV.
    if let Err(e) = stamp_source(run, job, p, &src) {
        run.prefill[p].pool.give(&src);
        return Err(e);
    }
    tokio::time::sleep_until((run.t0 + Duration::from_secs_f64(end / 1000.0)).into()).await;
    let d = {
        let mut r = run
            .router
            .lock()
            .map_err(|_| anyhow!("router lock poisoned"))?;
        r.prefill.release(p, tokens);
        r.decode.pick(tokens)
    };
    let outcome = push_and_verify(run, job, p, d, &src).await;
    run.prefill[p].pool.give(&src);
    if let Ok(mut r) = run.router.lock() {
        r.decode.release(d, tokens);
    }
    let (first_offer, done, bytes) = outcome?;
    Ok((Record::new(job, start, end, first_offer, done), bytes, p, d))
}

async fn push_and_verify(
    run: &Run,
    job: &Job,
    p: usize,
    d: usize,
    src: &[u32],
) -> anyhow::Result<(f64, f64, u64)> {
    let dst = run.decode[d].pool.take(src.len()).await?;
    let result = async {
        let (pw, dw) = (&run.prefill[p], &run.decode[d]);
        let offered = now_ms(run);
        if !src.is_empty() {
            let mut client = pw.client.clone();
            let t = client
                .push(
                    "w",
                    &format!("job-{}-{}", job.index, run.seed),
                    &run.decode_names[d],
                    blocks(pw.region, 0..run.layers, src.to_vec()),
                    blocks(dw.region, 0..run.layers, dst.clone()),
                )
                .await?;
            let status = client.wait(t.transfer_id, Some(run.timeout)).await?;
            if status.state != kvrail_client::proto::TransferState::Done as i32 {
                bail!(
                    "request {} to {}: {:?}",
                    job.index,
                    run.decode_names[d],
                    status.failure
                );
            }
        }
        let done = now_ms(run);
        let mut bytes = 0;
        for (&s, &t) in src.iter().zip(&dst) {
            for layer in 0..run.layers {
                for plane in 0..run.planes {
                    let sent = pw.kv.read_block(layer, plane, s)?;
                    let got = dw.kv.read_block(layer, plane, t)?;
                    if sent != got {
                        bail!(
                            "request {}: block {s} -> {t}, layer {layer}, plane {plane} differs at {}",
                            job.index,
                            run.decode_names[d]
                        );
                    }
                    bytes += got.len() as u64;
                }
            }
        }
        Ok((offered, done, bytes))
    }
    .await;
    run.decode[d].pool.give(&dst);
    result
}

/// A stamp per block, layer and plane of the request's source blocks: bytes
/// left from another request (or another block) cannot pass the comparison
/// with the destination.
fn stamp_source(run: &Run, job: &Job, p: usize, src: &[u32]) -> anyhow::Result<()> {
    let kv = &run.prefill[p].kv;
    for (k, &b) in src.iter().enumerate() {
        for layer in 0..run.layers {
            for plane in 0..run.planes {
                let word = stamp(run.seed, job.index, k, layer, plane);
                kv.memory
                    .write_at(kv.block_offset(layer, plane, b), &word.to_le_bytes())?;
            }
        }
    }
    Ok(())
}

fn stamp(seed: u64, job: usize, k: usize, layer: u32, plane: u32) -> u64 {
    let mut z = seed
        ^ (job as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (k as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ (u64::from(layer) << 40)
        ^ (u64::from(plane) << 56);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^ (z >> 31)
}

/// Prints one JSON line per policy and a table, and checks what was moved.
pub fn report(runs: &[PolicyRun], shape: ClusterShape) -> anyhow::Result<()> {
    for r in runs {
        let moved: u64 = r.records.iter().map(|x| x.kv_bytes).sum();
        let s = sim::summarize(&r.records);
        println!(
            "{}",
            json!({
                "replay": "cluster",
                "cluster": format!("{}:{}", shape.prefill, shape.decode),
                "policy": r.policy.label(),
                "requests": r.records.len(),
                "verified_bytes": r.verified_bytes,
                "kv_bytes_full_scale": moved,
                "per_prefill": r.per_prefill,
                "per_decode": r.per_decode,
                "wall_s": r.wall.as_secs_f64(),
                "summary": s,
            })
        );
        eprintln!(
            "{:>13}: TTFT p50 {:8.1} ms  p90 {:8.1}  p99 {:8.1}  queue p50 {:7.1} ms  {} verified  per prefill {:?}  per decode {:?}",
            r.policy.label(),
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms,
            s.queue_p50_ms,
            human_bytes(r.verified_bytes),
            r.per_prefill,
            r.per_decode
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_goes_in_turn_and_least_loaded_by_queued_tokens() {
        let mut rr = Pools::new(Policy::RoundRobin, 3);
        let picks: Vec<usize> = (0..6).map(|_| rr.pick(5)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        let mut ll = Pools::new(Policy::LeastLoaded, 3);
        assert_eq!(ll.pick(1000), 0);
        let picks: Vec<usize> = (0..4).map(|_| ll.pick(10)).collect();
        assert_eq!(picks, [1, 2, 1, 2]);
        ll.release(0, 1000);
        assert_eq!(ll.pick(10), 0);
    }

    #[test]
    fn shapes_parse() {
        assert_eq!(
            ClusterShape::parse("4:2"),
            Ok(ClusterShape {
                prefill: 4,
                decode: 2
            })
        );
        for bad in ["4", "0:1", "1:65", "a:b", ""] {
            assert!(ClusterShape::parse(bad).is_err(), "{bad}");
        }
        assert!(Policy::parse("random").is_err());
    }
}
