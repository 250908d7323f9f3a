//! `loadgen soak`: two real sidecars under load and chaos for a given time.
//!
//! Workers push and pull random numbers of blocks with a concurrency that
//! wanders up to `--max-concurrency`, while a chaos task pauses (SIGSTOP and
//! SIGCONT), kills and restarts either sidecar, and truncates a worker's file
//! under a transfer; and the decode worker aborts requests as vLLM's
//! connector does when a client goes away (a pull cancelled, a push's
//! destination blocks released), after which nothing may land in them. Every transfer must end done or failed with a reason;
//! every done transfer's destination blocks are compared byte for byte with
//! what the source wrote; every done push must reach the receiving worker as a
//! notification (unless that sidecar was killed before delivering it); a canary
//! region that nothing targets must stay zero. Both daemons' RSS, descriptors
//! and threads are sampled; the summary states the private RSS slope of every process
//! lifetime long enough to judge. One JSON line per sample, one at the end; a
//! finding makes the exit status 1.
//!
//! A worker's discipline the soak keeps, as a real one must: destination blocks
//! of a transfer that failed are not reused until the receiving sidecar can no
//! longer be placing bytes of it (its progress timeout; see docs/soak.md).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::proto::{NotificationKind, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_stream::StreamExt;

use crate::stats::parse_size;
use loadgen::cluster::{ClusterOptions, LocalCluster, SidecarProcess};

/// Flags of `loadgen soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// How long to run: `90s`, `30m`, `1h`.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Most transfers in flight at once (the concurrency wanders up to it).
    #[arg(long, default_value_t = 256)]
    pub max_concurrency: usize,
    /// tcp or quic.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "quic"])]
    pub transport: String,
    /// Faults to inject, comma-separated: pause, kill, cut (rail connections
    /// reset for 0.3-3 s; TCP, needs root), truncate, abort (the decode worker
    /// aborts one request in 8: cancels a pull, releases a push's blocks).
    #[arg(long, value_delimiter = ',', default_value = "pause,kill,cut,truncate,abort", value_parser = ["pause", "kill", "cut", "truncate", "abort"])]
    pub chaos: Vec<String>,
    /// Mean time between faults.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub chaos_every: Duration,
    /// Mean time between kills (when `kill` is in --chaos); rarer than other
    /// faults so that each daemon lives long enough for its memory to be judged.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub kill_every: Duration,
    /// Time between resource samples.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub sample_every: Duration,
    /// Blocks per region (each block id is 2 layers x K/V).
    #[arg(long, default_value_t = 2048)]
    pub blocks: u32,
    #[arg(long, default_value = "16K", value_parser = parse_size)]
    pub block_bytes: u64,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The `kvrail` binary to run (default: this binary's built-in sidecar).
    #[arg(long)]
    pub kvrail_binary: Option<std::path::PathBuf>,
}

/// Parses `90s`, `30m`, `1h`, `500ms`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let digits: String = s.chars().take_while(|c| c.is_ascii_digit()).collect();
    let n: u64 = digits.parse().map_err(|_| format!("bad duration {s:?}"))?;
    match &s[digits.len()..] {
        "" | "s" => Ok(Duration::from_secs(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        u => Err(format!("bad duration unit {u:?} in {s:?}")),
    }
}

const LAYERS: Range<u32> = 0..2;
/// How long a failed transfer's destination blocks stay out of use: past the
/// receiving sidecar's progress timeout (10 s), nothing of it can still land.
const QUARANTINE: Duration = Duration::from_secs(15);
/// How long a done push's notification may take before it counts as lost.
const NOTE_GRACE: Duration = Duration::from_secs(30);

/// The pattern of one request's block: every byte depends on the request, the
/// piece and its position, so a stale or misplaced write shows.
fn pattern(seq: u64, layer: u32, plane: u32, ordinal: usize, len: usize) -> Vec<u8> {
    let mut x = seq
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(layer) << 48 | u64::from(plane) << 40 | ordinal as u64)
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A side's client and its current region ids (new ones after each restart).
#[derive(Clone)]
struct Side {
    client: Client,
    region: u64,
    /// Bumped when the sidecar is killed: what was in flight died with it.
    epoch: u64,
}

#[derive(Default)]
struct Counts {
    started: u64,
    done: u64,
    verified_bytes: u64,
    failed: BTreeMap<String, u64>,
    refused: BTreeMap<String, u64>,
    /// Ended without any reason: a finding.
    no_reason: u64,
    no_reason_first: Vec<String>,
    /// Neither done nor failed 180 s after it started: a finding.
    stuck: Vec<String>,
    /// Done, but the destination does not hold the source's bytes: a finding.
    misdelivered: Vec<String>,
    notes_received: u64,
    /// Notifications lost with a killed receiving sidecar (expected).
    notes_excused: u64,
    /// Notifications lost otherwise: a finding.
    notes_missing: Vec<String>,
    /// Requests the decode worker aborted: ended failed as cancelled or
    /// released, or done before the abort took effect.
    aborted: u64,
    aborted_after_done: u64,
    /// Bytes that landed in a push's destination after its worker released
    /// the blocks: a finding.
    landed_after_release: Vec<String>,
    pauses: u64,
    cuts: u64,
    kills: u64,
    truncations: u64,
    truncation_failures_seen: u64,
}

#[derive(Default)]
struct NoteBook {
    /// Done pushes whose notification has not arrived: (done at, decode epoch).
    pending: HashMap<String, (Instant, u64)>,
    /// Notifications that arrived before their push's wait returned.
    early: std::collections::HashSet<String>,
}

struct World {
    p: Mutex<Side>,
    d: Mutex<Side>,
    src: KvRegion,
    dst: KvRegion,
    canary: KvRegion,
    free_src: Mutex<Vec<u32>>,
    free_dst: Mutex<Vec<u32>>,
    /// Destination blocks of failed transfers, usable again from then.
    quarantine: Mutex<Vec<(Instant, Vec<u32>)>>,
    /// Pushes and their notifications, matched under one lock (two locks let a
    /// notification and its push's return pass each other unmatched).
    notes: Mutex<NoteBook>,
    counts: Mutex<Counts>,
    seq: AtomicU64,
    inflight: AtomicU64,
    /// The decode worker aborts requests (`--chaos abort`).
    aborts: bool,
}

impl World {
    fn take(list: &Mutex<Vec<u32>>, n: usize, rng: &mut StdRng) -> Option<Vec<u32>> {
        let mut l = list.lock().ok()?;
        if l.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let i = rng.random_range(0..l.len());
            out.push(l.swap_remove(i));
        }
        Some(out)
    }

    fn give(list: &Mutex<Vec<u32>>, ids: Vec<u32>) {
        if let Ok(mut l) = list.lock() {
            l.extend(ids);
        }
    }

    fn release_quarantined(&self) {
        let now = Instant::now();
        let ready: Vec<Vec<u32>> = match self.quarantine.lock() {
            Ok(mut q) => {
                let (ready, keep) = q.drain(..).partition(|(at, _)| *at <= now);
                *q = keep;
                ready.into_iter().map(|(_, ids)| ids).collect()
            }
            Err(_) => return,
        };
        for ids in ready {
            self.zero(&ids);
            Self::give(&self.free_dst, ids);
        }
    }

    fn zero(&self, ids: &[u32]) {
        let len = self.dst.layout.block_bytes as usize;
        for layer in LAYERS {
            for plane in 0..self.dst.layout.planes_per_layer {
                for &b in ids {
                    let _ = self.dst.write_block(layer, plane, b, &vec![0; len]);
                }
            }
        }
    }

    fn count(&self, f: impl FnOnce(&mut Counts)) {
        if let Ok(mut c) = self.counts.lock() {
            f(&mut c);
        }
    }
}

/// One push (prefill -> decode) or pull (decode reads prefill), start to end.
async fn one_transfer(world: Arc<World>, mut rng: StdRng) {
    let n = rng.random_range(1..=16usize);
    let Some(src) = World::take(&world.free_src, n, &mut rng) else {
        return;
    };
    let Some(dst) = World::take(&world.free_dst, n, &mut rng) else {
        World::give(&world.free_src, src);
        return;
    };
    let seq = world.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let len = world.src.layout.block_bytes as usize;
    for layer in LAYERS {
        for plane in 0..world.src.layout.planes_per_layer {
            for (i, &b) in src.iter().enumerate() {
                let _ = world
                    .src
                    .write_block(layer, plane, b, &pattern(seq, layer, plane, i, len));
            }
        }
    }
    let push = rng.random_bool(0.7);
    let req = format!("soak-{seq}");
    let (p, d) = match (world.p.lock(), world.d.lock()) {
        (Ok(p), Ok(d)) => (p.clone(), d.clone()),
        _ => return,
    };
    world.count(|c| c.started += 1);
    world.inflight.fetch_add(1, Ordering::Relaxed);
    let (mut client, epoch_of) = if push {
        (p.client.clone(), "prefill")
    } else {
        (d.client.clone(), "decode")
    };
    // The decode worker aborts one request in 8, a moment after it started.
    let abort = world.aborts && rng.random_bool(0.125);
    let mut destination = blocks(d.region, LAYERS, dst.clone());
    if abort && push {
        // As vLLM's connector grants them: a push naming the blocks'
        // generations fails once the decode releases them, wherever it is.
        destination.generations = d
            .client
            .clone()
            .block_generations(d.region, dst.clone())
            .await
            .unwrap_or_default();
    }
    let started = if push {
        client
            .push(
                "soak-p",
                &req,
                "decode",
                blocks(p.region, LAYERS, src.clone()),
                destination,
            )
            .await
    } else {
        client
            .pull(
                "soak-d",
                &req,
                "prefill",
                blocks(p.region, LAYERS, src.clone()),
                blocks(d.region, LAYERS, dst.clone()),
            )
            .await
    };
    let mut released_as = None;
    if let (true, Ok(t)) = (abort, &started) {
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..3_000))).await;
        let mut dc = d.client.clone();
        if push {
            // What vLLM's connector does with a push-mode request aborted
            // while its layers arrive: the blocks' generations move on, and
            // every transfer naming them fails before this returns.
            if dc.release_blocks(d.region, dst.clone()).await.is_ok() {
                released_as = Some(read_blocks(&world.dst, &dst));
            }
        } else {
            let _ = dc.cancel(t.transfer_id).await;
        }
    }
    let outcome = match started {
        Err(e) => Err(("refused", e.code().map(|c| format!("{c:?}")), e.to_string())),
        Ok(t) => match client
            .wait(t.transfer_id, Some(Duration::from_secs(180)))
            .await
        {
            Ok(st) if st.state == TransferState::Done as i32 => Ok(()),
            Ok(st) if st.state != TransferState::Failed as i32 => Err((
                "stuck",
                None,
                format!(
                    "{req} still {:?} after 180 s ({} of {} bytes)",
                    TransferState::try_from(st.state).unwrap_or(TransferState::Queued),
                    st.bytes_done,
                    st.total_bytes
                ),
            )),
            Ok(st) => {
                let f = st.failure.unwrap_or_default();
                Err(("failed", Some(f.code.clone()), f.message))
            }
            Err(e) => Err((
                "failed",
                Some(format!("{epoch_of} api: {:?}", e.code())),
                e.to_string(),
            )),
        },
    };
    world.inflight.fetch_sub(1, Ordering::Relaxed);
    if abort {
        // Released blocks: nothing may land in them from then on.
        if let Some(before) = &released_as {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if read_blocks(&world.dst, &dst) != *before {
                world.count(|c| c.landed_after_release.push(req.clone()));
            }
        }
        let done = outcome.is_ok();
        world.count(|c| {
            c.aborted += 1;
            c.aborted_after_done += u64::from(done);
        });
    }
    match outcome {
        Ok(()) => {
            let mut bad = None;
            for layer in LAYERS {
                for plane in 0..world.dst.layout.planes_per_layer {
                    for (i, &b) in dst.iter().enumerate() {
                        let got = world.dst.read_block(layer, plane, b).unwrap_or_default();
                        if got != pattern(seq, layer, plane, i, len) {
                            bad = Some(format!(
                                "{req}: layer {layer} plane {plane} block {b} differs"
                            ));
                        }
                    }
                }
            }
            let bytes = (n * len * 2 * LAYERS.len()) as u64;
            world.count(|c| match bad {
                Some(b) => c.misdelivered.push(b),
                None => {
                    c.done += 1;
                    c.verified_bytes += bytes;
                }
            });
            if push {
                if let Ok(mut notes) = world.notes.lock() {
                    if !notes.early.remove(&req) {
                        notes.pending.insert(req, (Instant::now(), d.epoch));
                    }
                }
            }
            world.zero(&dst);
            World::give(&world.free_dst, dst);
        }
        Err((how, code, message)) => {
            world.count(|c| {
                if how == "stuck" {
                    c.stuck.push(message.clone());
                } else if message.trim().is_empty() && code.as_deref().unwrap_or("").is_empty() {
                    c.no_reason += 1;
                    c.no_reason_first.push(format!("{req} ({how})"));
                }
                let key = code.unwrap_or_else(|| "unknown".into());
                if message.contains("truncated") {
                    c.truncation_failures_seen += 1;
                }
                let map = if how == "refused" {
                    &mut c.refused
                } else {
                    &mut c.failed
                };
                *map.entry(key).or_default() += 1;
            });
            if let Ok(mut q) = world.quarantine.lock() {
                q.push((Instant::now() + QUARANTINE, dst));
            }
        }
    }
    World::give(&world.free_src, src);
}

/// Every byte of `ids` (each layer and plane), in order.
fn read_blocks(kv: &KvRegion, ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in LAYERS {
        for plane in 0..kv.layout.planes_per_layer {
            for &b in ids {
                out.extend(kv.read_block(layer, plane, b).unwrap_or_default());
            }
        }
    }
    out
}

/// Memory each kind of held state takes in a sidecar (`kvrail_held_bytes`).
fn held_bytes(cluster: &LocalCluster, side: &SidecarProcess) -> serde_json::Value {
    let Ok(text) = cluster.scrape(side) else {
        return json!(null);
    };
    let kind = |k: &str| loadgen::prometheus::sum(&text, "kvrail_held_bytes", &[k]) as u64;
    json!({
        "transfer_state": kind("transfer_state"),
        "notifications_retained": kind("notifications_retained"),
        "notifications_queued": kind("notifications_queued"),
    })
}

/// Follows the decode worker's notifications across sidecar restarts.
async fn follow_notes(world: Arc<World>, socket: std::path::PathBuf, stop: Arc<AtomicU64>) {
    // The resume point: the last notification seen, and the sidecar process
    // (incarnation) that numbered it.
    let (mut last_seq, mut incarnation) = (0u64, 0u64);
    while stop.load(Ordering::Relaxed) == 0 {
        let Ok(mut c) = Client::connect(&socket).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(mut stream) = c.resume("soak-d", last_seq, incarnation, true).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while let Ok(Some(Ok(n))) =
            tokio::time::timeout(Duration::from_millis(500), stream.next()).await
        {
            (last_seq, incarnation) = (n.sequence, n.incarnation);
            if n.kind == NotificationKind::PushReceived as i32 {
                if let Ok(mut notes) = world.notes.lock() {
                    if notes.pending.remove(&n.request_id).is_none() {
                        // Its push's wait has not returned yet (or it failed there).
                        notes.early.insert(n.request_id.clone());
                    }
                }
                world.count(|c| c.notes_received += 1);
            }
            if stop.load(Ordering::Relaxed) != 0 {
                return;
            }
        }
    }
}

fn check_notes(world: &World, final_check: bool) {
    let now = Instant::now();
    let d_epoch = world.d.lock().map(|d| d.epoch).unwrap_or(0);
    let late: Vec<(String, u64)> = match world.notes.lock() {
        Ok(mut notes) => {
            let p = &mut notes.pending;
            let keys: Vec<String> = p
                .iter()
                .filter(|(_, (at, _))| final_check || now.duration_since(*at) > NOTE_GRACE)
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| p.remove(&k).map(|(_, e)| (k, e)))
                .collect()
        }
        Err(_) => return,
    };
    world.count(|c| {
        for (req, epoch) in late {
            if epoch != d_epoch {
                c.notes_excused += 1;
            } else {
                c.notes_missing.push(req);
            }
        }
    });
}

/// RSS (kB), open descriptors and threads of a process.
fn resources(pid: u32) -> serde_json::Value {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    // RssAnon: the process's own memory. VmRSS also counts the pages of the
    // workers' shared regions it has touched, which grows towards their size
    // as more blocks are used, leak or not.
    json!({"pid": pid, "rss_kb": field("VmRSS:"), "rss_anon_kb": field("RssAnon:"), "fds": fds, "threads": field("Threads:")})
}

async fn register(
    cluster: &LocalCluster,
    side: &SidecarProcess,
    worker: &str,
    kv: &KvRegion,
) -> anyhow::Result<(Client, u64)> {
    let mut c = cluster.client(side).await?;
    let id = c.register_region(worker, kv, true).await?;
    Ok((c, id))
}

/// One truncation case: a victim region on prefill is truncated, and a push
/// from it (into a region of its own on decode) must fail saying so, without
/// touching anything else.
async fn truncation(cluster: &LocalCluster, block_bytes: u64, seq: u64) -> anyhow::Result<bool> {
    let layout = dense_layout(2, 2, 8, block_bytes);
    let kv = KvRegion::create(cluster.shm_path(&format!("victim-{seq}")), layout)?;
    let target = KvRegion::create(cluster.shm_path(&format!("victim-dst-{seq}")), layout)?;
    let (mut c, id) = register(cluster, &cluster.prefill, "soak-victim", &kv).await?;
    let (mut dc, tid) = register(cluster, &cluster.decode, "soak-victim-dst", &target).await?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(kv.memory.path())?
        .set_len(4096)?;
    let t = c
        .push(
            "soak-victim",
            &format!("victim-{seq}"),
            "decode",
            blocks(id, 0..2, (0..8).collect()),
            blocks(tid, 0..2, (0..8).collect()),
        )
        .await;
    let failed_as_truncated = match t {
        Err(e) => e.to_string().contains("truncated"),
        Ok(t) => {
            let st = c.wait(t.transfer_id, Some(Duration::from_secs(60))).await?;
            st.state == TransferState::Failed as i32
                && st.failure.is_some_and(|f| {
                    f.code == "region_truncated" || f.message.contains("truncated")
                })
        }
    };
    let _ = c.unregister_region(id).await;
    let _ = dc.unregister_region(tid).await;
    kv.unlink();
    target.unlink();
    Ok(failed_as_truncated)
}

/// Resets every TCP connection to or from `port` (needs root and the kernel's
/// socket-destroy support, as `ss -K` does).
fn cut_connections(port: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("ss")
        .args([
            "-K",
            "-t",
            "(",
            "sport",
            "=",
            &format!(":{port}"),
            "or",
            "dport",
            "=",
            &format!(":{port}"),
            ")",
        ])
        .output()
        .context("run ss -K (iproute2) to cut a rail")?;
    if !out.status.success() {
        bail!(
            "ss -K failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    if args.max_concurrency == 0 || args.max_concurrency > 1000 {
        bail!("--max-concurrency must be 1..=1000");
    }
    if args.chaos.iter().any(|c| c == "cut") && args.transport != "tcp" {
        bail!("--chaos cut resets TCP connections: use it with --transport tcp");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut opts = ClusterOptions::new(4, 1 << 20, 8 << 20);
    opts.kvrail_binary = args.kvrail_binary.clone();
    opts.metrics = true;
    opts.tls = args.transport == "quic";
    opts.transports = vec![args.transport.clone()];
    let mut cluster = LocalCluster::start(&opts).await?;
    let layout = dense_layout(2, 2, args.blocks, args.block_bytes);
    let src = KvRegion::create(cluster.shm_path("soak-src"), layout)?;
    let dst = KvRegion::create(cluster.shm_path("soak-dst"), layout)?;
    let canary_layout = dense_layout(2, 2, 8, args.block_bytes);
    let canary = KvRegion::create(cluster.shm_path("soak-canary"), canary_layout)?;
    let (pc, pr) = register(&cluster, &cluster.prefill, "soak-p", &src).await?;
    let (dc, dr) = register(&cluster, &cluster.decode, "soak-d", &dst).await?;
    // Registered, exposed, never named by any request: it must stay zero.
    register(&cluster, &cluster.decode, "soak-canary", &canary).await?;
    let world = Arc::new(World {
        p: Mutex::new(Side {
            client: pc,
            region: pr,
            epoch: 0,
        }),
        d: Mutex::new(Side {
            client: dc,
            region: dr,
            epoch: 0,
        }),
        src,
        dst,
        canary,
        free_src: Mutex::new((0..args.blocks).collect()),
        free_dst: Mutex::new((0..args.blocks).collect()),
        quarantine: Mutex::new(Vec::new()),
        notes: Mutex::new(NoteBook::default()),
        counts: Mutex::new(Counts::default()),
        seq: AtomicU64::new(0),
        inflight: AtomicU64::new(0),
        aborts: args.chaos.iter().any(|c| c == "abort"),
    });
    let stop = Arc::new(AtomicU64::new(0));
    let notes = tokio::spawn(follow_notes(
        world.clone(),
        cluster.decode.socket.clone(),
        stop.clone(),
    ));
    eprintln!(
        "soak: {:?} over {}, up to {} in flight, chaos {:?} every ~{:?} (kills every ~{:?}), seed {seed}",
        args.duration,
        args.transport,
        args.max_concurrency,
        args.chaos,
        args.chaos_every,
        args.kill_every
    );
    let start = Instant::now();
    let mut next_sample = start;
    let mut next_chaos = start + args.chaos_every;
    let mut next_kill = start + args.kill_every.mul_f64(rng.random_range(0.5..1.5));
    let others: Vec<String> = args
        .chaos
        .iter()
        .filter(|c| c.as_str() != "kill" && c.as_str() != "abort")
        .cloned()
        .collect();
    let mut concurrency = 1 + args.max_concurrency / 4;
    let mut next_retarget = start;
    let mut samples = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < args.duration {
        let now = Instant::now();
        if now >= next_retarget {
            concurrency = rng.random_range(1..=args.max_concurrency);
            next_retarget = now + Duration::from_secs(rng.random_range(2..10));
        }
        while tasks.len() < concurrency {
            tasks.spawn(one_transfer(
                world.clone(),
                StdRng::seed_from_u64(rng.random()),
            ));
        }
        world.release_quarantined();
        check_notes(&world, false);
        if now >= next_sample {
            next_sample = now + args.sample_every;
            let c = world
                .counts
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?;
            let line = json!({
                "soak": "sample",
                "t": start.elapsed().as_secs_f64(),
                "prefill": resources(cluster.prefill.pid()),
                "decode": resources(cluster.decode.pid()),
                "prefill_held": held_bytes(&cluster, &cluster.prefill),
                "decode_held": held_bytes(&cluster, &cluster.decode),
                "aborted": c.aborted,
                "concurrency": concurrency,
                "inflight": world.inflight.load(Ordering::Relaxed),
                "started": c.started, "done": c.done,
                "failed": c.failed.values().sum::<u64>(),
                "refused": c.refused.values().sum::<u64>(),
                "verified_gib": c.verified_bytes as f64 / (1u64 << 30) as f64,
                "misdelivered": c.misdelivered.len(),
                "no_reason": c.no_reason,
                "stuck": c.stuck.len(),
                "notes_missing": c.notes_missing.len(),
            });
            println!("{line}");
            samples.push(line);
        }
        let kill_due = args.chaos.iter().any(|c| c == "kill") && now >= next_kill;
        if kill_due || (now >= next_chaos && !others.is_empty()) {
            let action = if kill_due {
                next_kill = now + args.kill_every.mul_f64(rng.random_range(0.5..1.5));
                "kill"
            } else {
                next_chaos = now + args.chaos_every.mul_f64(rng.random_range(0.5..1.5));
                others[rng.random_range(0..others.len())].as_str()
            };
            let on_prefill = rng.random_bool(0.5);
            match action {
                "pause" => {
                    let side = if on_prefill {
                        &cluster.prefill
                    } else {
                        &cluster.decode
                    };
                    side.signal("STOP")?;
                    tokio::time::sleep(Duration::from_millis(rng.random_range(200..2000))).await;
                    side.signal("CONT")?;
                    world.count(|c| c.pauses += 1);
                }
                "kill" => {
                    if on_prefill {
                        cluster.prefill.restart()?;
                        let (c, r) = register(&cluster, &cluster.prefill, "soak-p", &world.src)
                            .await
                            .context("re-register on the restarted prefill")?;
                        if let Ok(mut p) = world.p.lock() {
                            *p = Side {
                                client: c,
                                region: r,
                                epoch: p.epoch + 1,
                            };
                        }
                    } else {
                        cluster.decode.restart()?;
                        let (c, r) = register(&cluster, &cluster.decode, "soak-d", &world.dst)
                            .await
                            .context("re-register on the restarted decode")?;
                        register(&cluster, &cluster.decode, "soak-canary", &world.canary).await?;
                        if let Ok(mut d) = world.d.lock() {
                            *d = Side {
                                client: c,
                                region: r,
                                epoch: d.epoch + 1,
                            };
                        }
                    }
                    world.count(|c| c.kills += 1);
                }
                "cut" => {
                    // The rail is cut for a while: every TCP connection on it is
                    // reset (ss -K), again and again, so that reconnections fail
                    // too until the cut ends.
                    let ports: Vec<String> = cluster
                        .prefill
                        .listen_addrs()
                        .into_iter()
                        .chain(cluster.decode.listen_addrs())
                        .filter_map(|a| a.rsplit(':').next().map(str::to_string))
                        .collect();
                    let until = Instant::now() + Duration::from_millis(rng.random_range(300..3000));
                    let mut cut = Ok(());
                    while cut.is_ok() && Instant::now() < until {
                        cut = ports.iter().try_for_each(|port| cut_connections(port));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    match cut {
                        Ok(()) => world.count(|c| c.cuts += 1),
                        Err(e) => eprintln!("soak: a rail cut could not run: {e:#}"),
                    }
                }
                "truncate" => {
                    let seq = world.seq.fetch_add(1, Ordering::Relaxed);
                    match truncation(&cluster, args.block_bytes, seq).await {
                        Ok(ok) => world.count(|c| {
                            c.truncations += 1;
                            if ok {
                                c.truncation_failures_seen += 1;
                            }
                        }),
                        Err(e) => eprintln!("soak: truncation case could not run: {e}"),
                    }
                }
                other => bail!("unknown chaos action {other:?} (pause, kill, cut, truncate)"),
            }
        }
        // Reap finished transfers; wait a moment when nothing finished.
        tokio::select! {
            _ = tasks.join_next() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    while tasks.join_next().await.is_some() {}
    // Give the last notifications their grace, then judge.
    let settle = Instant::now() + Duration::from_secs(5);
    while Instant::now() < settle
        && world
            .notes
            .lock()
            .map(|n| !n.pending.is_empty())
            .unwrap_or(false)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(1, Ordering::Relaxed);
    let _ = notes.await;
    check_notes(&world, true);
    let canary_dirty = {
        let mut buf = vec![0u8; world.canary.memory.len() as usize];
        world.canary.memory.read_at(0, &mut buf)?;
        buf.iter().filter(|b| **b != 0).count()
    };
    let alive = (cluster.prefill.is_running(), cluster.decode.is_running());
    // With nothing in flight, no transfer state may be held. The gauge is set
    // once a second: wait for it to read zero, for at most three updates.
    let held_deadline = Instant::now() + Duration::from_secs(3);
    let held_at_end = loop {
        let held = [
            held_bytes(&cluster, &cluster.prefill),
            held_bytes(&cluster, &cluster.decode),
        ];
        let state: u64 = held
            .iter()
            .map(|h| h["transfer_state"].as_u64().unwrap_or(0))
            .sum();
        if state == 0 || Instant::now() >= held_deadline {
            break held;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let state_leaked: u64 = held_at_end
        .iter()
        .map(|h| h["transfer_state"].as_u64().unwrap_or(0))
        .sum();
    let c = world
        .counts
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let slopes = rss_slopes(&samples);
    let findings = c.misdelivered.len() as u64
        + c.landed_after_release.len() as u64
        + u64::from(state_leaked > 0)
        + c.no_reason
        + c.stuck.len() as u64
        + c.notes_missing.len() as u64
        + canary_dirty as u64
        + u64::from(!alive.0)
        + u64::from(!alive.1);
    let summary = json!({
        "soak": "summary",
        "seconds": start.elapsed().as_secs_f64(),
        "seed": seed,
        "transport": args.transport,
        "max_concurrency": args.max_concurrency,
        "started": c.started,
        "done": c.done,
        "verified_gib": c.verified_bytes as f64 / (1u64 << 30) as f64,
        "failed_by_code": c.failed,
        "refused_by_code": c.refused,
        "ended_without_reason": c.no_reason,
        "ended_without_reason_first": c.no_reason_first.iter().take(20).collect::<Vec<_>>(),
        "stuck": c.stuck.len(),
        "stuck_first": c.stuck.iter().take(20).collect::<Vec<_>>(),
        "misdelivered": c.misdelivered.len(),
        "misdelivered_first": c.misdelivered.iter().take(20).collect::<Vec<_>>(),
        "canary_bytes_touched": canary_dirty,
        "notifications_received": c.notes_received,
        "notifications_lost_with_a_killed_sidecar": c.notes_excused,
        "notifications_missing": c.notes_missing.len(),
        "notifications_missing_first": c.notes_missing.iter().take(20).collect::<Vec<_>>(),
        "aborted": c.aborted,
        "aborted_after_done": c.aborted_after_done,
        "landed_after_release": c.landed_after_release.len(),
        "landed_after_release_first": c.landed_after_release.iter().take(20).collect::<Vec<_>>(),
        "held_bytes_at_end": {"prefill": held_at_end[0], "decode": held_at_end[1]},
        "pauses": c.pauses,
        "rail_cuts": c.cuts,
        // Received for pushes whose worker never saw them done (their wait
        // failed, e.g. the prefill sidecar was killed after the decode's end).
        "notifications_for_unfinished_pushes": world.notes.lock().map(|n| n.early.len()).unwrap_or(0),
        "kills": c.kills,
        "truncations": c.truncations,
        "truncated_transfers_failed_as_such": c.truncation_failures_seen,
        "daemons_alive_at_end": [alive.0, alive.1],
        "rss_slopes_kb_per_min": slopes,
        "findings": findings,
    });
    println!("{summary}");
    world.src.unlink();
    world.dst.unlink();
    world.canary.unlink();
    if findings > 0 {
        bail!("soak found {findings} problems (see the summary line)");
    }
    Ok(())
}

/// Slope of the least-squares line through `points` (0 for fewer than 2).
fn least_squares_slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx > 0.0 {
        sxy / sxx
    } else {
        0.0
    }
}

/// Private RSS (RssAnon) slope (kB per minute) of every process lifetime sampled for at least
/// three minutes, skipping its first minute (warm-up).
fn rss_slopes(samples: &[serde_json::Value]) -> serde_json::Value {
    let mut series: BTreeMap<(String, u64), Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples {
        let t = s["t"].as_f64().unwrap_or(0.0);
        for side in ["prefill", "decode"] {
            let pid = s[side]["pid"].as_u64().unwrap_or(0);
            let rss = s[side]["rss_anon_kb"].as_f64().unwrap_or(0.0);
            series
                .entry((side.to_string(), pid))
                .or_default()
                .push((t, rss));
        }
    }
    let mut out = Vec::new();
    for ((side, pid), points) in series {
        let Some(&(t0, _)) = points.first() else {
            continue;
        };
        let body: Vec<(f64, f64)> = points
            .into_iter()
            .filter(|(t, _)| *t >= t0 + 60.0)
            .collect();
        let span =
            body.last().map(|l| l.0).unwrap_or(0.0) - body.first().map(|f| f.0).unwrap_or(0.0);
        if body.len() < 3 || span < 120.0 {
            continue;
        }
        // A heap grows to its working size over minutes (the allocator's
        // arenas); a leak goes on growing: the second half tells them apart.
        let mid = body.first().map(|f| f.0).unwrap_or(0.0) + span / 2.0;
        let late: Vec<(f64, f64)> = body.iter().copied().filter(|p| p.0 >= mid).collect();
        out.push(json!({
            "side": side, "pid": pid, "seconds": span,
            "rss_anon_kb_first": body.first().map(|p| p.1), "rss_anon_kb_last": body.last().map(|p| p.1),
            "slope_kb_per_min": least_squares_slope(&body) * 60.0,
            "second_half_slope_kb_per_min": least_squares_slope(&late) * 60.0,
        }));
    }
    serde_json::Value::Array(out)
}
