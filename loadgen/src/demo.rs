//! `loadgen demo`: the main job. Two sidecars on loopback; the first requests of
//! a real trace (bundled Mooncake slice); each request's KV sized from the model
//! table, pushed prefill -> decode through the sidecars, verified byte for byte,
//! and its transfer time set against a modelled time-to-first-token.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use kvrail_client::proto::{NotificationKind, RegionLayout};
use kvrail_client::{blocks, dense_layout, KvRegion, SharedRegion};
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde_json::json;
use tokio_stream::StreamExt;

use crate::model::Model;
use crate::stats::{gbps, human_bytes, parse_size, Latencies};
use crate::trace;
use loadgen::cluster::{ClusterOptions, LocalCluster};

/// Flags of `loadgen demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Trace: Mooncake JSONL, or Azure 2023 CSV (by the `.csv` extension).
    /// A bare bundled name (`conversation_trace_head.jsonl`, the default, or
    /// `azure_code_head.csv`) reads the copy embedded in the binary.
    #[arg(long, default_value = crate::trace::DEFAULT_TRACE)]
    pub trace: PathBuf,
    /// Requests replayed from the start of the trace.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Model whose KV geometry sizes each request (llama-3.1-8b, llama-3.1-70b, qwen2.5-32b).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
    /// Prompts longer than this are clipped (bounds memory: both sides hold a pool for one prompt).
    #[arg(long, default_value_t = 8192)]
    pub max_prompt_tokens: u64,
    /// TCP connections per rail.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Slice size (4 KiB to 64 MiB).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub slice_bytes: u64,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Transports to replay the trace over, one after the other in this run
    /// (same requests, same blocks), comma-separated: tcp, quic. Both are
    /// authenticated with certificates of a fresh cluster CA.
    #[arg(long, value_delimiter = ',', default_value = "tcp", value_parser = ["tcp", "quic"])]
    pub transport: Vec<String>,
}

/// Per-request outcome.
struct Outcome {
    transfer: Duration,
    prefill_ms: f64,
    bytes: u64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.max_prompt_tokens == 0 {
        bail!("--max-prompt-tokens must be 1 or more");
    }
    if !(1..=64).contains(&args.connections) {
        bail!("--connections must be 1 to 64");
    }
    if !(4096..=(64 << 20)).contains(&args.slice_bytes) {
        bail!("--slice-bytes must be between 4 KiB and 64 MiB");
    }
    let model =
        *Model::by_name(&args.model).with_context(|| format!("unknown model {:?}", args.model))?;
    let requests = trace::read(&args.trace, args.requests)?;
    if requests.is_empty() {
        bail!("{} holds no requests", args.trace.display());
    }
    let max_blocks = model.blocks_for(args.max_prompt_tokens.max(16)) as u32;
    // A pool twice the largest request, so that each request lands in scattered blocks.
    let layout = dense_layout(
        model.num_layers,
        model.planes(),
        max_blocks * 2,
        model.block_bytes(1),
    );
    let mut rows = Vec::new();
    for transport in &args.transport {
        let outcomes = replay(&args, &model, &requests, layout, max_blocks, transport).await?;
        rows.push(summarize(&args, &model, &outcomes, transport));
    }
    eprintln!();
    eprintln!("transport  transfer p50   transfer p99   GB/s    TTFT p50 (modelled)  TTFT p99   transfer share of TTFT p50 / p99");
    for row in rows {
        eprintln!("{row}");
    }
    Ok(())
}

/// Replays `requests` over two fresh sidecars that use `transport`, verifying
/// every request's blocks.
async fn replay(
    args: &DemoArgs,
    model: &Model,
    requests: &[trace::Request],
    layout: RegionLayout,
    max_blocks: u32,
    transport: &str,
) -> anyhow::Result<Vec<Outcome>> {
    let mut opts = ClusterOptions::new(
        args.connections,
        args.slice_bytes,
        (args.slice_bytes * 8).max(8 << 20),
    );
    opts.transports = vec![transport.to_string()];
    eprintln!(
        "kvrail demo: {} requests of {} on {} ({} KiB of KV per token, prompts clipped at {} tokens), 2 sidecars on loopback over {transport}",
        requests.len(),
        args.trace.file_name().and_then(|f| f.to_str()).unwrap_or("trace"),
        model.name,
        model.kv_bytes_per_token(1) / 1024,
        args.max_prompt_tokens
    );
    let cluster = LocalCluster::start(&opts).await?;
    let mut p = cluster.client(&cluster.prefill).await?;
    let mut d = cluster.client(&cluster.decode).await?;
    let p_kv = KvRegion::create(cluster.shm_path("demo-p"), layout)?;
    let d_kv = KvRegion::create(cluster.shm_path("demo-d"), layout)?;
    let result = async {
        fill_random(&p_kv.memory)?;
        // Touch every destination page now, so tmpfs page allocation is not timed as transfer.
        d_kv.memory.fill(0, d_kv.memory.len(), 0)?;
        let p_region = p.register_region("prefill-0", &p_kv, false).await?;
        let d_region = d.register_region("decode-0", &d_kv, false).await?;
        let mut notes = d.subscribe("decode-0").await?;

        let bar = if args.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(requests.len() as u64)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(2024);
        let mut outcomes = Vec::with_capacity(requests.len());
        let mut moved = 0u64;
        let started = Instant::now();
        for (i, r) in requests.iter().enumerate() {
            let tokens = r.input_length.clamp(1, args.max_prompt_tokens);
            let n = model.blocks_for(tokens) as usize;
            let src = pick(&mut rng, max_blocks * 2, n);
            let dst = pick(&mut rng, max_blocks * 2, n);
            let req = format!("trace-{i}");
            let t0 = Instant::now();
            p.push(
                "prefill-0",
                &req,
                "decode",
                blocks(p_region, 0..model.num_layers, src.clone()),
                blocks(d_region, 0..model.num_layers, dst.clone()),
            )
            .await?;
            let note = loop {
                let n = tokio::time::timeout(Duration::from_secs(120), notes.next())
                    .await
                    .context("no notification within 120 s")?
                    .context("notification stream ended")??;
                if n.request_id == req {
                    break n;
                }
            };
            let transfer = t0.elapsed();
            if note.kind != NotificationKind::PushReceived as i32 {
                bail!("request {req} failed: {:?}", note.failure);
            }
            crate::verify::compare_blocks(
                &p_kv.memory,
                &d_kv.memory,
                &layout,
                layout.num_layers,
                &src,
                &dst,
                true,
            )
            .with_context(|| format!("request {req}"))?;
            moved += note.bytes;
            outcomes.push(Outcome {
                transfer,
                prefill_ms: model.prefill_ms(tokens),
                bytes: note.bytes,
            });
            bar.set_message(format!(
                "{} moved, {:.2} GB/s",
                human_bytes(moved),
                gbps(moved, started.elapsed())
            ));
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok::<_, anyhow::Error>(outcomes)
    }
    .await;
    p_kv.unlink();
    d_kv.unlink();
    drop(cluster);
    result
}

fn pick(rng: &mut rand::rngs::StdRng, pool: u32, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..pool).collect();
    v.shuffle(rng);
    v.truncate(n);
    v
}

pub(crate) fn fill_random(mem: &SharedRegion) -> anyhow::Result<()> {
    let chunk = 4 << 20;
    let mut buf = vec![0u8; chunk];
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let mut off = 0u64;
    while off < mem.len() {
        let n = (mem.len() - off).min(chunk as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        mem.write_at(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Prints the JSON summary of one transport's replay; its table row.
fn summarize(args: &DemoArgs, model: &Model, outcomes: &[Outcome], transport: &str) -> String {
    let mut transfer = Latencies::default();
    let mut ttft = Latencies::default();
    let mut shares: Vec<f64> = Vec::with_capacity(outcomes.len());
    let mut bytes = 0u64;
    let mut busy = Duration::ZERO;
    for o in outcomes {
        transfer.record(o.transfer);
        let t = o.prefill_ms + o.transfer.as_secs_f64() * 1000.0;
        ttft.record(Duration::from_secs_f64(t / 1000.0));
        shares.push(o.transfer.as_secs_f64() * 1000.0 / t);
        bytes += o.bytes;
        busy += o.transfer;
    }
    shares.sort_by(f64::total_cmp);
    let pct = |v: &[f64], p: f64| v[((v.len() as f64 - 1.0) * p / 100.0).round() as usize];
    let share_mean = shares.iter().sum::<f64>() / shares.len() as f64;
    let v = json!({
        "demo": "trace_push",
        "transport": transport,
        "model": model.name,
        "trace": args.trace.file_name().and_then(|f| f.to_str()),
        "requests": outcomes.len(),
        "max_prompt_tokens": args.max_prompt_tokens,
        "kv_bytes_total": bytes,
        "verified_bytes": bytes,
        "gbps": (gbps(bytes, busy) * 1000.0).round() / 1000.0,
        "transfer_p50_ms": transfer.percentile_us(50.0) as f64 / 1000.0,
        "transfer_p99_ms": transfer.percentile_us(99.0) as f64 / 1000.0,
        "modelled_ttft_p50_ms": ttft.percentile_us(50.0) as f64 / 1000.0,
        "modelled_ttft_p99_ms": ttft.percentile_us(99.0) as f64 / 1000.0,
        "transfer_share_of_ttft_p50": (pct(&shares, 50.0) * 1000.0).round() / 1000.0,
        "transfer_share_of_ttft_p99": (pct(&shares, 99.0) * 1000.0).round() / 1000.0,
        "transfer_share_of_ttft_mean": (share_mean * 1000.0).round() / 1000.0,
        "ttft_model": "prefill time from a measured H100 bf16 fit (loadgen/src/model.rs) + measured transfer (not overlapped)",
    });
    println!("{v}");
    eprintln!(
        "{transport}: {} requests, {} of KV moved and verified byte for byte",
        outcomes.len(),
        human_bytes(bytes)
    );
    format!(
        "{transport:<10} {:>9.2} ms   {:>9.2} ms   {:>5.2}   {:>12.1} ms      {:>7.1} ms   {:>5.1}% / {:.1}%",
        transfer.percentile_us(50.0) as f64 / 1000.0,
        transfer.percentile_us(99.0) as f64 / 1000.0,
        gbps(bytes, busy),
        ttft.percentile_us(50.0) as f64 / 1000.0,
        ttft.percentile_us(99.0) as f64 / 1000.0,
        pct(&shares, 50.0) * 100.0,
        pct(&shares, 99.0) * 100.0
    )
}
