//! `loadgen gpu`: GPU-resident paged KV moved GPU -> sidecar -> TCP loopback ->
//! sidecar -> GPU through the staged pipeline, verified on the GPU, with its two
//! bounds measured in the same run: the device-to-host copy bandwidth (one copy
//! into pinned memory) and kvrail's TCP loopback throughput for the same blocks
//! in host memory. One JSON object per result on stdout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::gpu::{cuda, Gpu, GpuKvRegion};
use kvrail_client::proto::{RegionLayout, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use serde_json::json;

use crate::stats::{gbps, human_bytes, parse_size};
use loadgen::cluster::{ClusterOptions, LocalCluster};

/// Flags of `loadgen gpu`.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuArgs {
    /// KV bytes per transfer (rounded down to whole blocks of every layer).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub bytes: u64,
    /// Layers of the model (Llama-3.1-8B: 32).
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    /// Bytes of one block of one plane (Llama-3.1-8B, 16 tokens: 16 x 8 heads x 128 x 2 B).
    #[arg(long, default_value = "32K", value_parser = parse_size)]
    pub block_bytes: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: u32,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Operations: push (prefill sends) and pull (decode reads); both move prefill -> decode.
    #[arg(long, value_delimiter = ',', default_value = "push,pull")]
    pub ops: Vec<String>,
    /// TCP connections between the sidecars.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Slice size of host transfers (the host TCP reference); GPU regions'
    /// transfers use the sidecar's `--gpu-slice-bytes` (default 4 MiB, within
    /// the window; docs/gpu.md). The defaults are the sidecar's.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub slice_bytes: u64,
    /// Unacknowledged bytes per connection.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    pub window_bytes: u64,
    /// Extra `kvrail serve` flags for both sidecars (e.g. `--sidecar-arg=--gpu-stage-depth=4`).
    #[arg(long = "sidecar-arg", allow_hyphen_values = true)]
    pub sidecar_args: Vec<String>,
}

pub async fn run(args: GpuArgs) -> anyhow::Result<()> {
    let gpu = Gpu::open(args.device).context("no GPU to run on")?;
    let block_bytes = args.block_bytes;
    let per_block = u64::from(args.layers) * 2 * block_bytes;
    let num_blocks = u32::try_from(args.bytes / per_block).context("too many blocks")?;
    if num_blocks == 0 {
        bail!("--bytes is smaller than one block of every layer ({per_block} bytes)");
    }
    let layout = dense_layout(args.layers, 2, num_blocks, block_bytes);
    let bytes = per_block * u64::from(num_blocks);
    eprintln!(
        "GPU {} ({:?}); {} of KV: {} layers x K/V x {num_blocks} blocks x {}",
        gpu.name(),
        gpu.capabilities(),
        human_bytes(bytes),
        args.layers,
        human_bytes(block_bytes)
    );

    // Bound 1: one device-to-host copy of the same size into pinned memory.
    let d2h = copy_bandwidth(&gpu, bytes, args.runs).await?;
    println!(
        "{}",
        json!({"bench": "gpu", "name": "d2h_copy", "bytes": bytes, "gbytes_per_s": d2h})
    );

    let mut opts = ClusterOptions::new(args.connections, args.slice_bytes, args.window_bytes);
    opts.transports = vec!["tcp".into()];
    opts.extra_args = args.sidecar_args.clone();
    let cluster = LocalCluster::start(&opts).await?;
    let mut p = cluster.client(&cluster.prefill).await?;
    let mut d = cluster.client(&cluster.decode).await?;

    // Bound 2: kvrail over TCP loopback, the same blocks in host shared memory.
    let src_host = KvRegion::create(cluster.shm_path("gpu-bench-src"), layout)?;
    let dst_host = KvRegion::create(cluster.shm_path("gpu-bench-dst"), layout)?;
    let host_ids = (
        p.register_region("bench-p", &src_host, true).await?,
        d.register_region("bench-d", &dst_host, false).await?,
    );
    // The GPU regions, same layout; destination blocks in reverse order, so that
    // every block lands somewhere else than where it came from.
    let src_gpu = GpuKvRegion::create(&gpu, layout)?;
    let dst_gpu = GpuKvRegion::create(&gpu, layout)?;
    let seed = 0x6b76_7261;
    src_gpu.fill(seed)?;
    let gpu_ids = (
        src_gpu.register(&mut p, "bench-p", true).await?,
        dst_gpu.register(&mut d, "bench-d", false).await?,
    );
    let src_blocks: Vec<u32> = (0..num_blocks).collect();
    let dst_blocks: Vec<u32> = (0..num_blocks).rev().collect();

    let mut summary = Vec::new();
    for op in &args.ops {
        let mut host_times = Vec::new();
        let mut gpu_times = Vec::new();
        let mut verified = 0u64;
        for run in 0..args.runs {
            host_times.push(
                transfer(
                    &mut p,
                    &mut d,
                    op,
                    (host_ids.0, src_blocks.clone()),
                    (host_ids.1, dst_blocks.clone()),
                    args.layers,
                    &format!("host-{op}-{run}"),
                )
                .await?,
            );
            dst_gpu.zero()?;
            gpu_times.push(
                transfer(
                    &mut p,
                    &mut d,
                    op,
                    (gpu_ids.0, src_blocks.clone()),
                    (gpu_ids.1, dst_blocks.clone()),
                    args.layers,
                    &format!("gpu-{op}-{run}"),
                )
                .await?,
            );
            verified += verify(
                &dst_gpu,
                &layout,
                seed,
                &src_blocks,
                &dst_blocks,
                args.layers,
            )?;
        }
        let tcp = gbps(bytes, median(&mut host_times));
        let staged = gbps(bytes, median(&mut gpu_times));
        let bound = tcp.min(d2h);
        let ratio = staged / bound;
        println!(
            "{}",
            json!({"bench": "gpu", "name": format!("tcp_host_{op}"), "bytes": bytes, "gbytes_per_s": tcp})
        );
        println!(
            "{}",
            json!({"bench": "gpu", "name": format!("gpu_staged_{op}"), "bytes": bytes,
                   "gbytes_per_s": staged, "verified_bytes": verified,
                   "bound_gbytes_per_s": bound, "ratio_to_bound": ratio})
        );
        summary.push(format!(
            "{op}: staged GPU {staged:.3} GB/s, host TCP {tcp:.3} GB/s, d2h copy {d2h:.3} GB/s -> {ratio:.3}x min(d2h, tcp); {} verified on the GPU",
            human_bytes(verified)
        ));
    }
    for line in summary {
        eprintln!("{line}");
    }
    src_host.unlink();
    dst_host.unlink();
    Ok(())
}

/// Median wall time of one transfer; `runs` >= 1.
fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// GB/s of one device-to-host copy of `bytes` into pinned memory (median of runs).
async fn copy_bandwidth(gpu: &Arc<Gpu>, bytes: u64, runs: usize) -> anyhow::Result<f64> {
    let device = Arc::new(cuda::DeviceBuffer::zeroed(gpu, bytes)?);
    let queue = cuda::CopyQueue::new(gpu, "bench")?;
    let mut buffer = Some(cuda::PinnedBuffer::new(gpu, bytes as usize)?);
    let mut times = Vec::new();
    for _ in 0..runs.max(1) {
        let Some(b) = buffer.take() else {
            bail!("staging buffer lost");
        };
        let start = Instant::now();
        let done = queue
            .to_host(device.clone(), &[(0, bytes)], b)
            .map_err(|(e, _)| e)?
            .await
            .context("copy queue stopped")?;
        times.push(start.elapsed());
        done.result?;
        buffer = Some(done.buffer);
    }
    Ok(gbps(bytes, median(&mut times)))
}

/// One push (from prefill) or pull (by decode) of every listed block.
async fn transfer(
    p: &mut Client,
    d: &mut Client,
    op: &str,
    src: (u64, Vec<u32>),
    dst: (u64, Vec<u32>),
    layers: u32,
    request: &str,
) -> anyhow::Result<Duration> {
    let src = blocks(src.0, 0..layers, src.1);
    let dst = blocks(dst.0, 0..layers, dst.1);
    let start = Instant::now();
    let (client, t) = match op {
        "push" => {
            let t = p.push("bench-p", request, "decode", src, dst).await?;
            (p, t)
        }
        "pull" => {
            let t = d.pull("bench-d", request, "prefill", src, dst).await?;
            (d, t)
        }
        other => bail!("unknown op {other} (push or pull)"),
    };
    let s = client
        .wait(t.transfer_id, Some(Duration::from_secs(300)))
        .await?;
    if s.state != TransferState::Done as i32 {
        bail!("{op} {request} did not complete: {:?}", s.failure);
    }
    Ok(start.elapsed())
}

/// Checks every destination block on the GPU against its source block's
/// pattern; returns the bytes verified.
pub fn verify(
    dst: &GpuKvRegion,
    source: &RegionLayout,
    seed: u32,
    src_blocks: &[u32],
    dst_blocks: &[u32],
    layers: u32,
) -> anyhow::Result<u64> {
    let pairs: Vec<(u32, u32)> = src_blocks
        .iter()
        .copied()
        .zip(dst_blocks.iter().copied())
        .collect();
    let bad = dst.mismatches(source, seed, &pairs)?;
    if bad > 0 {
        bail!("{bad} words of the destination blocks differ from their source, on the GPU");
    }
    Ok(u64::from(layers)
        * u64::from(source.planes_per_layer)
        * pairs.len() as u64
        * source.block_bytes)
}
