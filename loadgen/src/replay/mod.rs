//! `loadgen replay`: what KV transfer does to time-to-first-token on a real
//! trace. Emulated prefill and decode workers replay the trace over two real
//! sidecars, one run per transport (and per overlap mode), every byte
//! verified; the same requests are then projected on link profiles (the seeds'
//! DGX Spark figures, one calibrated from each live run, and a free transfer).

mod live;
mod report;
mod routed;
pub mod sim;

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;

use crate::model::{self, Model};
use crate::stats::{human_bytes, parse_size};
use crate::trace::{self, TraceFormat};
use kvrail_core::geometry::rank_heads;
use live::{Geometry, TpShape};
use loadgen::cluster::{ClusterOptions, LocalCluster};
use sim::{Job, LinkProfile, Overlap, Record, Summary};

/// Flags of `loadgen replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Trace: Mooncake JSONL, or Azure 2023 CSV (by the `.csv` extension).
    /// A bare bundled name (`conversation_trace_head.jsonl`, the default, or
    /// `azure_code_head.csv`) reads the copy embedded in the binary; give the
    /// full traces (Mooncake's, Azure's) by path.
    #[arg(long, default_value = crate::trace::DEFAULT_TRACE)]
    pub trace: PathBuf,
    /// Replay only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Arrival times are multiplied by this (0.05 replays an hour in 3 minutes).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Spread the requests that share a timestamp evenly over this many ms
    /// (the Mooncake conversation trace arrives in 3 s buckets); 0: as given.
    /// Only for Mooncake traces.
    #[arg(long, default_value_t = 3000)]
    pub spread_ms: u64,
    /// Model whose KV geometry and prefill time size each request.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
    /// Tensor-parallel degree: each prefill rank sends its share of the KV
    /// (KV heads split; MLA replicated), prefill runs up to TP times faster.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Live runs emulate every tensor-parallel rank of the prefill engine
    /// (each its own worker and region, registered with its KV geometry);
    /// with `--decode-tp` different, each decode rank takes its heads from
    /// the prefill ranks holding them (head slices), every byte checked
    /// against the reference reshaping. Prefill time and projections use
    /// this TP. Default: `--tp`.
    #[arg(long)]
    pub prefill_tp: Option<u32>,
    /// Tensor-parallel ranks of the decode engine (see `--prefill-tp`).
    /// Default: `--tp`.
    #[arg(long)]
    pub decode_tp: Option<u32>,
    /// Clip prompts to this many tokens (default: the model's context).
    #[arg(long)]
    pub max_prompt_tokens: Option<u64>,
    /// Blocks the decode node already holds (a prefix seen earlier in the
    /// trace, by `hash_ids`) are not sent.
    #[arg(long)]
    pub prefix_reuse: bool,
    /// Prefill instances (GPUs, or TP groups) behind the prefill sidecar;
    /// default: enough for 70% utilisation over the replayed span.
    #[arg(long)]
    pub prefill_instances: Option<usize>,
    /// Prefill at a constant rate instead of the model's H100 curve.
    #[arg(long)]
    pub prefill_tokens_per_s: Option<f64>,
    /// Live runs: when the prefill side sends (layer: each layer as it
    /// finishes; all: after the last layer). Projections show both.
    #[arg(long, value_delimiter = ',', default_value = "layer", value_parser = Overlap::parse)]
    pub overlap: Vec<Overlap>,
    /// Live transports, one run each: tcp, quic (loopback), rdma (inside the
    /// RDMA VM, alone), or none (projections only).
    #[arg(long, value_delimiter = ',', default_value = "tcp,quic", value_parser = ["tcp", "quic", "rdma", "none"])]
    pub transport: Vec<String>,
    /// Live runs move this fraction of each block's bytes (e.g. 1/64), so a
    /// long trace fits this machine; block counts stay real. Projections
    /// are at full size.
    #[arg(long, default_value = "1", value_parser = parse_fraction)]
    pub kv_scale: f64,
    /// KV memory of each emulated worker (prefill and decode), at the scaled size.
    #[arg(long, default_value = "2G", value_parser = parse_size)]
    pub pool_bytes: u64,
    /// Connections per rail.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub slice_bytes: u64,
    /// Extra `kvrail serve` flag for both sidecars (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub sidecar_arg: Vec<String>,
    /// How the emulated prefill worker submits its pushes: through its
    /// shared-memory ring (as the clients do by default), or one gRPC call
    /// each (for comparison).
    #[arg(long, default_value = "ring", value_parser = ["ring", "grpc"])]
    pub submit: String,
    #[command(flatten)]
    pub nodes: crate::bench::RdmaNodes,
    /// Extra projection link: NAME,RAILS,GBIT_PER_RAIL,LATENCY_US (repeatable).
    #[arg(long, value_parser = parse_link)]
    pub link: Vec<LinkProfile>,
    /// The DGX Spark and `--link` profiles are projected with arrivals at this
    /// multiple of the trace's times (default 1: as recorded), whatever
    /// `--time-scale` the live runs used; the free and calibrated links are
    /// projected on the live runs' arrivals as well.
    #[arg(long, default_value_t = 1.0)]
    pub projection_time_scale: f64,
    /// N prefill and M decode sidecars (`N:M`) that find each other through
    /// etcd, no static peers; each request's instances picked by `--policy`
    /// as `kvrail.vllm_router` picks engines, one run per policy, every byte
    /// verified; TTFT per policy. Starts an etcd on loopback unless `--etcd`.
    #[arg(long, value_parser = routed::ClusterShape::parse)]
    pub cluster: Option<routed::ClusterShape>,
    /// Routing policies of a `--cluster` run, one run each.
    #[arg(long, value_delimiter = ',', default_value = "round_robin,least_loaded", value_parser = routed::Policy::parse)]
    pub policy: Vec<routed::Policy>,
    /// etcd for `--cluster` (http://HOST:PORT); default: one started here.
    #[arg(long)]
    pub etcd: Option<String>,
    /// Where per-request CSV/JSON, the summary and the plots go.
    #[arg(long, default_value = "target/kvrail-replay")]
    pub out: PathBuf,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v = match s.split_once('/') {
        Some((a, b)) => {
            let a: f64 = a
                .trim()
                .parse()
                .map_err(|_| format!("bad fraction {s:?}"))?;
            let b: f64 = b
                .trim()
                .parse()
                .map_err(|_| format!("bad fraction {s:?}"))?;
            a / b
        }
        None => s.trim().parse().map_err(|_| format!("bad number {s:?}"))?,
    };
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("{s:?}: want a fraction in (0, 1]"))
    }
}

fn parse_link(s: &str) -> Result<LinkProfile, String> {
    let f: Vec<&str> = s.split(',').collect();
    let [name, rails, gbit, lat] = f[..] else {
        return Err(format!(
            "link {s:?}: want NAME,RAILS,GBIT_PER_RAIL,LATENCY_US"
        ));
    };
    let num = |v: &str| {
        v.trim()
            .parse::<f64>()
            .map_err(|_| format!("link {s:?}: bad number {v:?}"))
    };
    Ok(LinkProfile {
        name: name.to_string(),
        rails: rails
            .trim()
            .parse()
            .map_err(|_| format!("link {s:?}: bad rail count"))?,
        gbit_per_rail: num(gbit)?,
        latency_us: num(lat)?,
        per_op_us: 0.0,
        source: "given with --link".into(),
    })
}

/// One row of the comparison: a live run or a projection, and its requests.
pub struct Series {
    pub name: String,
    pub live: bool,
    pub overlap: Overlap,
    /// Arrival times of this series, as a multiple of the trace's.
    pub time_scale: f64,
    pub records: Vec<Record>,
    pub summary: Summary,
    /// Bytes really moved (live: scaled) per second of transfer in flight.
    pub moved_gbps: f64,
}

pub async fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let model = *Model::by_name(&args.model)
        .with_context(|| format!("unknown model {:?} (known: {})", args.model, Model::names()))?;
    if args.tp == 0 {
        bail!("--tp must be at least 1");
    }
    let ranks = tp_shape(&args, &model)?;
    let tp = ranks.map_or(args.tp, |(p, _)| p);
    let live_transports: Vec<String> = args
        .transport
        .iter()
        .filter(|t| *t != "none")
        .cloned()
        .collect();
    if live_transports.iter().any(|t| t == "rdma") && live_transports.len() > 1 {
        bail!("--transport rdma runs alone (inside the RDMA VM)");
    }
    let requests = trace::read(&args.trace, args.requests.unwrap_or(usize::MAX))?;
    if requests.is_empty() {
        bail!("{} holds no requests", args.trace.display());
    }
    let mooncake = TraceFormat::of(&args.trace) == TraceFormat::MooncakeJsonl;
    let shaping = trace::Shaping {
        time_scale: args.time_scale,
        spread_bucket_ms: if mooncake { args.spread_ms } else { 0 },
        max_prompt_tokens: args.max_prompt_tokens.unwrap_or(model.context_tokens),
    };
    let arrivals = trace::shape(&requests, shaping)?;
    let per_block = per_block_bytes(&model, tp, ranks);
    let jobs = make_jobs(&args, &model, tp, per_block, &arrivals);
    if let Some(shape) = args.cluster {
        if tp != 1 || ranks.is_some() {
            bail!("--cluster emulates TP 1 engines: drop --tp, --prefill-tp and --decode-tp");
        }
        let chunk_bytes = ((model.block_bytes(1) as f64 * args.kv_scale) as u64 / 8 * 8).max(16);
        eprintln!(
            "kvrail replay --cluster {}:{}: {} requests, {} ({} per block, layer and plane live, {} at full scale), policies {:?}",
            shape.prefill,
            shape.decode,
            jobs.len(),
            model.name,
            human_bytes(chunk_bytes),
            human_bytes(model.block_bytes(1)),
            args.policy.iter().map(|p| p.label()).collect::<Vec<_>>(),
        );
        let cluster = routed::ClusterArgs {
            shape,
            policies: args.policy.clone(),
            etcd: args.etcd.clone(),
            layers: model.num_layers,
            planes: model.planes(),
            chunk_bytes,
            pool_bytes: args.pool_bytes,
            connections: args.connections,
            slice_bytes: args.slice_bytes,
            sidecar_args: args.sidecar_arg.clone(),
        };
        let runs = routed::run(&cluster, &jobs).await?;
        return routed::report(&runs, shape);
    }
    let instances = args
        .prefill_instances
        .unwrap_or_else(|| sim::instances_for(&jobs, 0.7));
    let schedule = sim::prefill_schedule(&jobs, instances);
    let (geometry, bytes_scale) = live_geometry(&args, &model, ranks)?;
    let chunk_bytes = geometry.chunk_bytes(geometry.heads(true, 0).len() as u32);
    let pool_blocks = geometry.pool_blocks;
    let total_kv: u64 = jobs.iter().map(|j| j.kv_bytes).sum();
    let trace_name = args
        .trace
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or("trace")
        .to_string();
    let config = json!({
        "replay": "config",
        "trace": trace_name,
        "requests": jobs.len(),
        "span_s": jobs.last().map_or(0.0, |j| j.arrival_ms / 1000.0),
        "time_scale": args.time_scale,
        "spread_ms": shaping.spread_bucket_ms,
        "model": model.name,
        "tp": tp,
        "prefill_tp": ranks.map(|(p, _)| p),
        "decode_tp": ranks.map(|(_, d)| d),
        "live_pushes_per_piece": geometry.routes().len(),
        "kv_bytes_per_token_per_rank": model.kv_bytes_per_token(tp),
        "block_tokens": model.block_tokens,
        "max_prompt_tokens": shaping.max_prompt_tokens,
        "prefix_reuse": args.prefix_reuse,
        "kv_bytes_total": total_kv,
        "prefill_instances": instances,
        "prefill_curve": match args.prefill_tokens_per_s {
            Some(r) => format!("constant {r} tokens/s"),
            None => model.prefill_source(),
        },
        "live_kv_scale": bytes_scale,
        "live_chunk_bytes": chunk_bytes,
        "live_submit": args.submit,
        "live_pool_blocks": pool_blocks,
    });
    println!("{config}");
    eprintln!(
        "kvrail replay: {} requests of {trace_name} over {:.1} s (time x{}), {} (TP {}: {} KiB of KV per token per rank), {} of KV{}, {instances} prefill instances",
        jobs.len(),
        jobs.last().map_or(0.0, |j| j.arrival_ms / 1000.0),
        args.time_scale,
        model.name,
        tp,
        model.kv_bytes_per_token(tp) / 1024,
        human_bytes(total_kv),
        if args.prefix_reuse { " after prefix reuse" } else { "" },
    );
    if !live_transports.is_empty() && bytes_scale < 1.0 {
        eprintln!(
            "live runs move {:.4} of each block ({} instead of {} per block, layer and plane): {} in all",
            bytes_scale,
            human_bytes(chunk_bytes),
            human_bytes(model.block_bytes(tp)),
            human_bytes((total_kv as f64 * bytes_scale) as u64),
        );
    }

    let mut series = Vec::new();
    let mut calibrated = Vec::new();
    for transport in &live_transports {
        let cluster = start_cluster(&args, transport).await?;
        for &overlap in &args.overlap {
            let label = match args.submit.as_str() {
                "grpc" => format!("{transport} {} (gRPC submissions)", overlap.label()),
                _ => format!("{transport} {}", overlap.label()),
            };
            let submit = match args.submit.as_str() {
                "grpc" => kvrail_client::SubmitPath::Grpc,
                _ => kvrail_client::SubmitPath::Ring,
            };
            let run = live::replay(
                &cluster, &jobs, &schedule, overlap, geometry, submit, &label, args.quiet,
            )
            .await?;
            let moved: u64 = run.ops.iter().map(|o| o.bytes).sum();
            if moved != run.verified_bytes {
                bail!(
                    "{label}: {} pushed but {} verified",
                    human_bytes(moved),
                    human_bytes(run.verified_bytes)
                );
            }
            eprintln!(
                "{label}: {} requests in {:.1} s, {} moved and verified byte for byte",
                run.records.len(),
                run.wall.as_secs_f64(),
                human_bytes(run.verified_bytes)
            );
            let summary = sim::summarize(&run.records);
            let moved_gbps = summary.gbps * bytes_scale;
            if let Some(p) = sim::calibrate(
                transport,
                &run.ops,
                &summary,
                &jobs,
                &schedule,
                overlap,
                bytes_scale,
            ) {
                calibrated.push((p, overlap));
            }
            series.push(Series {
                name: transport.clone(),
                live: true,
                overlap,
                time_scale: args.time_scale,
                records: run.records,
                summary,
                moved_gbps,
            });
        }
        if transport == "rdma" {
            check_rdma_carried(&cluster)?;
        }
    }

    // Projections at full size, in both overlap modes: the free transfer and
    // the calibrated links on the live runs' schedule (to set them against
    // the live rows), and every profile at `--projection-time-scale` (by
    // default the trace's own arrival times, with prefill instances for them).
    let real_arrivals = trace::shape(
        &requests,
        trace::Shaping {
            time_scale: args.projection_time_scale,
            ..shaping
        },
    )?;
    let real_jobs = make_jobs(&args, &model, tp, per_block, &real_arrivals);
    let real_schedule = sim::prefill_schedule(&real_jobs, sim::instances_for(&real_jobs, 0.7));
    let mut profiles: Vec<(Option<LinkProfile>, f64)> = vec![(None, args.time_scale)];
    let mut seen = std::collections::HashSet::new();
    for (p, _) in &calibrated {
        if seen.insert(p.name.clone()) {
            profiles.push((Some(p.clone()), args.time_scale));
        }
    }
    if args.projection_time_scale != args.time_scale {
        profiles.push((None, args.projection_time_scale));
    }
    for p in LinkProfile::builtin().into_iter().chain(args.link.clone()) {
        profiles.push((Some(p), args.projection_time_scale));
    }
    for (profile, time_scale) in &profiles {
        let (jobs, schedule) = if *time_scale == args.time_scale {
            (&jobs, &schedule)
        } else {
            (&real_jobs, &real_schedule)
        };
        for overlap in [Overlap::LayerWise, Overlap::AllAtOnce] {
            let records = sim::project(jobs, schedule, overlap, profile.as_ref());
            let summary = sim::summarize(&records);
            series.push(Series {
                name: profile.as_ref().map_or("ideal".into(), |p| p.name.clone()),
                live: false,
                overlap,
                time_scale: *time_scale,
                records,
                moved_gbps: summary.gbps,
                summary,
            });
        }
    }
    let links: Vec<&LinkProfile> = profiles.iter().filter_map(|(p, _)| p.as_ref()).collect();
    report::print(&series, &links, bytes_scale);
    report::write(&args.out, &config, &series, &links)?;
    eprintln!(
        "per-request records, summary and plots in {}",
        args.out.display()
    );
    Ok(())
}

/// `--prefill-tp`/`--decode-tp` as (prefill, decode), checked against the
/// model's KV heads as vLLM shards them; None when neither is given.
fn tp_shape(args: &ReplayArgs, model: &Model) -> anyhow::Result<Option<(u32, u32)>> {
    if args.prefill_tp.is_none() && args.decode_tp.is_none() {
        return Ok(None);
    }
    if args.tp != 1 {
        bail!("give either --tp or --prefill-tp/--decode-tp");
    }
    let (p, d) = (args.prefill_tp.unwrap_or(1), args.decode_tp.unwrap_or(1));
    for (name, tp) in [("--prefill-tp", p), ("--decode-tp", d)] {
        if tp == 0 || tp > 64 {
            bail!("{name} must be 1 to 64, not {tp}");
        }
        if let model::Attention::Gqa { kv_heads, .. } = model.attention {
            if kv_heads % tp != 0 && tp % kv_heads != 0 {
                bail!(
                    "{name} {tp} does not divide {}'s {kv_heads} KV heads (nor do they divide it)",
                    model.name
                );
            }
        }
    }
    Ok(Some((p, d)))
}

/// KV bytes one block of a request puts on the link between the two nodes
/// (all layers and planes): one rank's share at `--tp`; with emulated ranks,
/// what all decode ranks receive (each its heads).
fn per_block_bytes(model: &Model, tp: u32, ranks: Option<(u32, u32)>) -> u64 {
    let layers_planes = u64::from(model.num_layers) * u64::from(model.planes());
    match (ranks, model.attention) {
        (None, _) => layers_planes * model.block_bytes(tp),
        (Some((_, decode)), model::Attention::Gqa { kv_heads, .. }) => {
            let heads: u64 = (0..decode)
                .map(|d| rank_heads(kv_heads, decode, d).len() as u64)
                .sum();
            layers_planes * model.block_bytes(kv_heads) * heads
        }
        (Some((_, decode)), model::Attention::Mla { .. }) => {
            layers_planes * model.block_bytes(1) * u64::from(decode)
        }
    }
}

/// The live runs' geometry (at `--kv-scale`) and the fraction of the real
/// bytes they move.
fn live_geometry(
    args: &ReplayArgs,
    model: &Model,
    ranks: Option<(u32, u32)>,
) -> anyhow::Result<(Geometry, f64)> {
    let mut geometry = Geometry {
        layers: model.num_layers,
        planes: model.planes(),
        head_bytes: 0,
        pool_blocks: 0,
        tp: None,
    };
    let (widest, scale) = match ranks {
        None => {
            geometry.head_bytes =
                ((model.block_bytes(args.tp) as f64 * args.kv_scale) as u64 / 8 * 8).max(16);
            (
                1,
                geometry.head_bytes as f64 / model.block_bytes(args.tp) as f64,
            )
        }
        Some((prefill, decode)) => {
            let (kv_heads, head_dim) = match model.attention {
                model::Attention::Gqa { kv_heads, head_dim } => (kv_heads, head_dim),
                model::Attention::Mla { latent } => (1, latent),
            };
            // Heads keep their count; each shrinks to the scaled size.
            let head_size = ((f64::from(head_dim) * args.kv_scale) as u32).max(1);
            let tokens_per_block = u32::try_from(model.block_tokens)?;
            geometry.tp = Some(TpShape {
                prefill,
                decode,
                model: model.name,
                model_kv_heads: kv_heads,
                head_size,
                element_bytes: model.dtype_bytes,
                tokens_per_block,
            });
            geometry.head_bytes =
                u64::from(tokens_per_block) * u64::from(head_size) * u64::from(model.dtype_bytes);
            if geometry.head_bytes < 16 {
                bail!("a head's share of a block is {} bytes at this --kv-scale; each needs 16 for its stamps", geometry.head_bytes);
            }
            let most = |tp: u32| {
                (0..tp)
                    .map(|r| rank_heads(kv_heads, tp, r).len() as u32)
                    .max()
                    .unwrap_or(1)
            };
            (
                most(prefill).max(most(decode)),
                f64::from(head_size) / f64::from(head_dim),
            )
        }
    };
    let block_set =
        u64::from(geometry.layers) * u64::from(geometry.planes) * geometry.chunk_bytes(widest);
    geometry.pool_blocks = u32::try_from(args.pool_bytes / block_set).unwrap_or(u32::MAX);
    Ok((geometry, scale))
}

/// The requests as the emulators see them.
fn make_jobs(
    args: &ReplayArgs,
    model: &Model,
    tp: u32,
    per_block: u64,
    arrivals: &[trace::Arrival],
) -> Vec<Job> {
    arrivals
        .iter()
        .map(|a| {
            let reused = if args.prefix_reuse {
                a.reusable_tokens / model.block_tokens
            } else {
                0
            };
            let blocks = model.blocks_for(a.prompt_tokens).saturating_sub(reused);
            let prefill_ms = match args.prefill_tokens_per_s {
                Some(rate) => a.prompt_tokens as f64 / rate * 1000.0,
                None => model.prefill_ms(a.prompt_tokens) / f64::from(tp),
            };
            Job {
                index: a.index,
                arrival_ms: a.at_ms,
                prompt_tokens: a.prompt_tokens,
                blocks,
                kv_bytes: blocks * per_block,
                prefill_ms,
                layers: model.num_layers,
            }
        })
        .collect()
}

async fn start_cluster(args: &ReplayArgs, transport: &str) -> anyhow::Result<LocalCluster> {
    let mut opts = ClusterOptions::new(
        args.connections,
        args.slice_bytes,
        (args.slice_bytes * 8).max(8 << 20),
    );
    opts.extra_args = args.sidecar_arg.clone();
    if transport == "rdma" {
        opts.transports = vec!["rdma".into(), "tcp".into()];
        opts.metrics = true;
        let rails = args.nodes.node_a.len().min(args.nodes.node_b.len());
        LocalCluster::start_on(
            &opts,
            &args.nodes.node_a[..rails],
            &args.nodes.node_b[..rails],
        )
        .await
    } else {
        opts.transports = vec![transport.to_string()];
        LocalCluster::start(&opts).await
    }
}

/// An RDMA run must have moved its bytes by verbs, not over the TCP control path.
fn check_rdma_carried(cluster: &LocalCluster) -> anyhow::Result<()> {
    use kvrail_sidecar::metrics as m;
    let text = cluster.scrape(&cluster.prefill)?;
    let rdma = loadgen::prometheus::sum(&text, m::BYTES_SENT, &["transport=\"rdma\""]);
    let tcp = loadgen::prometheus::sum(&text, m::BYTES_SENT, &["transport=\"tcp\""]);
    eprintln!(
        "rdma: {} sent by verbs, {} over TCP",
        human_bytes(rdma as u64),
        human_bytes(tcp as u64)
    );
    if rdma == 0.0 {
        bail!("the rdma run moved nothing by verbs");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_and_links_parse() {
        assert_eq!(parse_fraction("1/64"), Ok(1.0 / 64.0));
        assert_eq!(parse_fraction("0.5"), Ok(0.5));
        assert!(parse_fraction("2").is_err());
        assert!(parse_fraction("1/0").is_err());
        assert!(parse_fraction("x").is_err());
        let l = parse_link("nvl,2,400,1.5").unwrap();
        assert_eq!((l.rails, l.gbit_per_rail, l.latency_us), (2, 400.0, 1.5));
        assert!(parse_link("nvl,2,400").is_err());
    }
}
