//! `loadgen bench`: throughput and latency of kvrail between two local sidecars,
//! with a baseline run in the same invocation for a side-by-side ratio: iperf3 for
//! TCP on loopback, `ib_write_bw`/`ib_write_lat` on the same device pairs for RDMA
//! (`--transport rdma`, inside the Soft-RoCE VM).
//! One JSON object per result on stdout; a human table on stderr.

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::proto::{BlockRange, NotificationKind, RegionLayout, TransferState};
use kvrail_client::{blocks, dense_layout, layout_extent, Client, KvRegion, SharedRegion};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;
use tokio_stream::StreamExt;

use crate::stats::{gbps, human_bytes, parse_size, Latencies};
use loadgen::cluster::{ClusterOptions, LocalCluster};

/// Flags of `loadgen bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Connections per rail (iperf3 runs with as many streams and processes).
    /// A list (`1,2,4,8,16`) sweeps: the whole bench, baselines included, runs
    /// at each count in turn, in this one invocation.
    #[arg(long = "connections", value_delimiter = ',', default_value = "4")]
    pub connection_counts: Vec<usize>,
    /// The count being measured (one of `connection_counts`).
    #[arg(skip = 4usize)]
    pub connections: usize,
    /// Slice size.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub slice_bytes: u64,
    /// Unacknowledged bytes per connection.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    pub window_bytes: u64,
    /// Sizes of single contiguous transfers.
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M,64M,256M", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Operations to measure: push, pull.
    #[arg(long, value_delimiter = ',', default_value = "push,pull")]
    pub ops: Vec<String>,
    /// Scattered batch: COUNTxSIZE blocks at non-adjacent offsets into shuffled destination blocks.
    #[arg(long, default_value = "512x160K")]
    pub scattered: String,
    /// vLLM-shaped batch: LAYERSxBLOCKSxSIZE, K and V per layer, blocks scattered in a pool twice as large.
    #[arg(long, default_value = "80x512x4K")]
    pub vllm: String,
    /// 4 KiB push latency samples (call to the peer worker's notification).
    #[arg(long, default_value_t = 1000)]
    pub latency_samples: usize,
    /// Submission paths the latency bench measures: grpc, ring (both by
    /// default, alternated in rounds; one alone to profile it).
    #[arg(long, value_delimiter = ',', default_value = "grpc,ring", value_parser = ["grpc", "ring"])]
    pub latency_paths: Vec<String>,
    /// Push sizes the latency bench measures (one alone to profile it).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M", value_parser = parse_latency_size)]
    pub latency_sizes: Vec<u64>,
    /// Layer counts of the layer-wise ring bench (0 skips it).
    #[arg(long, value_delimiter = ',', default_value = "32,80")]
    pub latency_layers: Vec<u32>,
    /// Bytes moved per measurement, at least (small sizes repeat until they reach it);
    /// default 1G over TCP, 256M over RDMA (Soft-RoCE is slow).
    #[arg(long, value_parser = parse_size)]
    pub bytes_per_point: Option<u64>,
    /// Which parts to run: single, scattered, vllm, latency, the baseline: iperf3
    /// (tcp) or perftest (rdma), and plan (host cost of building the RDMA work
    /// requests of the vLLM batch; needs no device and no sidecar), quic-floor
    /// (QUIC runs: the packet cipher's cost per byte and raw quinn's throughput
    /// with kvrail's settings, what kvrail's QUIC is measured against),
    /// descriptors (a heterogeneous-TP hand-off of Llama-3.1-70B's KV,
    /// prefill TP 8 -> decode TP 2 and 2 -> 8: NixlConnector-style
    /// descriptors against kvrail's posts; no sidecar), tp (not by default:
    /// heterogeneous pushes, TP 2 -> 1 and 1 -> 2 of emulated ranks, against
    /// the homogeneous push of the same bytes, in alternating rounds).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "iperf3,perftest,quic-floor,single,scattered,vllm,latency,plan,descriptors",
        value_parser = ["iperf3", "perftest", "quic-floor", "single", "scattered", "vllm", "latency", "plan", "descriptors", "tp"]
    )]
    pub only: Vec<String>,
    /// Transports to measure, one after the other in this run, comma-separated.
    /// tcp, quic: two sidecars on loopback using only that transport (quic with
    /// certificates of a fresh CA); every quic point is then compared with the tcp
    /// one. rdma (alone): the sidecars on the rail addresses of
    /// `--node-a`/`--node-b` with verbs (run it inside `shared/rdma-vm/run`).
    #[arg(long, value_delimiter = ',', default_value = "tcp,quic", value_parser = ["tcp", "quic", "rdma"])]
    pub transport: Vec<String>,
    /// Rounds of the tp part (each moves at least 1 GiB per pattern).
    #[arg(long, default_value_t = 5)]
    pub tp_rounds: usize,
    /// Tokens of the request the descriptors part hands off (blocks of 16).
    #[arg(long, default_value_t = 32768)]
    pub descriptor_tokens: u64,
    #[command(flatten)]
    pub nodes: RdmaNodes,
    /// RDMA: how many rails (the first N addresses of each node); perftest runs on
    /// the same device pairs at once.
    #[arg(long, default_value_t = 1)]
    pub rdma_rails: usize,
    /// RDMA: queue pairs per rail (perftest runs with as many).
    #[arg(long, default_value_t = 2)]
    pub rdma_qps: usize,
    /// Extra `kvrail serve` flag for both sidecars (repeatable), e.g.
    /// `--sidecar-arg=--quic-initial-mtu=6550`.
    #[arg(long, allow_hyphen_values = true)]
    pub sidecar_arg: Vec<String>,
    /// Spin of the bench workers' ring waits, in microseconds (default: the
    /// client's; the sidecars' own spin is `--sidecar-arg=--ring-spin-us=N`).
    #[arg(long)]
    pub ring_spin_us: Option<u64>,
    /// iperf3 duration in seconds.
    #[arg(long, default_value_t = 3)]
    pub iperf3_seconds: u32,
    /// Rail benchmark instead: one `tc` rate per rail (e.g. `2gbit,2gbit`); the two
    /// sidecars run in network namespaces joined by one veth pair per rail (root).
    #[arg(long, value_delimiter = ',')]
    pub rails: Vec<String>,
    /// netem delay on every rail (e.g. `1ms`).
    #[arg(long)]
    pub rail_delay: Option<String>,
    /// How the failover case cuts rail 1 mid-transfer: drop (100% loss), down (link down), none.
    #[arg(long, default_value = "drop", value_parser = ["drop", "down", "none"])]
    pub rail_cut: String,
}

/// The two RDMA nodes' rail addresses (the RDMA VM's by default), shared by
/// `bench` and `replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct RdmaNodes {
    /// RDMA: the prefill node's rail addresses (its devices are found by them).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "169.254.100.1,169.254.101.1"
    )]
    pub node_a: Vec<IpAddr>,
    /// RDMA: the decode node's rail addresses.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "169.254.100.2,169.254.101.2"
    )]
    pub node_b: Vec<IpAddr>,
}

impl BenchArgs {
    /// Cluster options for two sidecars that use `transports` (in that order),
    /// with this run's connections, slices, window and `--sidecar-arg`s.
    pub(crate) fn cluster_options(&self, transports: &[&str]) -> ClusterOptions {
        let mut opts = ClusterOptions::new(self.connections, self.slice_bytes, self.window_bytes);
        opts.transports = transports.iter().map(|t| t.to_string()).collect();
        opts.extra_args = self.sidecar_arg.clone();
        opts
    }
}

pub(crate) fn parse_x(spec: &str) -> anyhow::Result<Vec<u64>> {
    spec.split('x')
        .map(|p| parse_size(p).map_err(anyhow::Error::msg))
        .collect()
}

/// Both workers: the prefill side's region and the decode side's, on one file each.
pub(crate) struct Bench {
    // Keeps the sidecar processes alive for the whole run.
    cluster: LocalCluster,
    pub(crate) p: Client,
    pub(crate) d: Client,
    pub(crate) p_mem: SharedRegion,
    pub(crate) d_mem: SharedRegion,
    args: BenchArgs,
    results: Vec<serde_json::Value>,
    iperf3_gbps: Option<f64>,
    /// One single-stream iperf3 process per connection: not bound to one thread.
    iperf3_procs_gbps: Option<f64>,
    /// Copying a cold region of the largest point's size into another with
    /// one thread per connection, through a small buffer each (the two
    /// copies loopback TCP makes), without sockets: iperf3 resends one
    /// cache-hot buffer, kvrail reads and writes whole regions.
    memory_gbps: Option<f64>,
    /// `ib_write_bw` over the same device pairs (RDMA runs).
    ib_write_bw_gbps: Option<f64>,
    contiguous_push_gbps: Option<f64>,
    /// "tcp", "quic" or "rdma": what the sidecars were set up to use.
    pub(crate) transport: &'static str,
    next_request: u64,
    /// The prefill worker's notifications: a pulled region may be freed only once served.
    p_notes: tonic::Streaming<kvrail_client::proto::Notification>,
    awaiting_served: std::collections::HashSet<String>,
}

/// What one throughput point measured.
pub(crate) struct Point {
    name: &'static str,
    op: String,
    pub(crate) bytes: u64,
    blocks: u64,
    segments: u64,
    pub(crate) lat: Latencies,
    pub(crate) total: Duration,
    pub(crate) iterations: u64,
    /// Both sidecars' CPU over the timed iterations.
    pub(crate) cpu: Option<crate::cpu::CpuUse>,
}

impl Bench {
    /// Connects to both sidecars of `cluster` and maps a source and a destination file.
    pub(crate) async fn start(
        cluster: LocalCluster,
        args: &BenchArgs,
        file_bytes: u64,
        transport: &'static str,
    ) -> anyhow::Result<Bench> {
        let mut p = cluster.client(&cluster.prefill).await?;
        let p_notes = p.subscribe("bench-p").await?;
        let d = cluster.client(&cluster.decode).await?;
        let p_kv = KvRegion::create(cluster.shm_path("p"), dense_layout(1, 1, 1, file_bytes))?;
        let d_kv = KvRegion::create(cluster.shm_path("d"), dense_layout(1, 1, 1, file_bytes))?;
        fill_source(&p_kv.memory)?;
        Ok(Bench {
            cluster,
            p,
            d,
            p_mem: p_kv.memory,
            d_mem: d_kv.memory,
            args: args.clone(),
            results: Vec::new(),
            iperf3_gbps: None,
            iperf3_procs_gbps: None,
            memory_gbps: None,
            ib_write_bw_gbps: None,
            contiguous_push_gbps: None,
            transport,
            next_request: 0,
            p_notes,
            awaiting_served: Default::default(),
        })
    }

    /// Removes the two shared-memory files.
    pub(crate) fn remove_files(&self) {
        let _ = std::fs::remove_file(self.p_mem.path());
        let _ = std::fs::remove_file(self.d_mem.path());
    }

    pub(crate) async fn register(&mut self, layout: RegionLayout) -> anyhow::Result<(u64, u64)> {
        let p = self
            .p
            .register_path("bench-p", self.p_mem.path(), layout, true)
            .await?;
        let d = self
            .d
            .register_path("bench-d", self.d_mem.path(), layout, true)
            .await?;
        Ok((p, d))
    }

    pub(crate) async fn unregister(&mut self, (p, d): (u64, u64)) -> anyhow::Result<()> {
        // As a prefill worker would: free pulled blocks only after PULL_SERVED.
        while !self.awaiting_served.is_empty() {
            let n = tokio::time::timeout(Duration::from_secs(30), self.p_notes.next())
                .await
                .context("pulls not reported served within 30 s")?
                .context("notification stream ended")??;
            self.awaiting_served.remove(&n.request_id);
        }
        self.p.unregister_region(p).await?;
        self.d.unregister_region(d).await?;
        Ok(())
    }

    /// One transfer, call to completion as the initiator sees it.
    pub(crate) async fn transfer(
        &mut self,
        op: &str,
        src: BlockRange,
        dst: BlockRange,
    ) -> anyhow::Result<(Duration, u64)> {
        self.next_request += 1;
        let req = format!("bench-{}", self.next_request);
        let start = Instant::now();
        let (client, worker) = if op == "push" {
            (&mut self.p, "bench-p")
        } else {
            (&mut self.d, "bench-d")
        };
        let t = if op == "push" {
            client.push(worker, &req, "decode", src, dst).await?
        } else {
            self.awaiting_served.insert(req.clone());
            client.pull(worker, &req, "prefill", src, dst).await?
        };
        let s = client
            .wait(t.transfer_id, Some(Duration::from_secs(120)))
            .await?;
        let elapsed = start.elapsed();
        if s.state != TransferState::Done as i32 {
            bail!("{op} {req} did not complete: {:?}", s.failure);
        }
        Ok((elapsed, t.segments))
    }

    /// Repeats a transfer (after one warm-up) until `bytes_per_point` moved, verifies, reports.
    pub(crate) async fn point(
        &mut self,
        name: &'static str,
        op: &str,
        layout: RegionLayout,
        layers: u32,
        src: Vec<u32>,
        dst: Vec<u32>,
    ) -> anyhow::Result<Point> {
        let regions = self.register(layout).await?;
        // Source blocks live on the prefill side and destinations on the decode side, for
        // push and pull alike; only who initiates differs.
        let src_range = blocks(regions.0, 0..layers, src.clone());
        let dst_range = blocks(regions.1, 0..layers, dst.clone());
        let bytes = u64::from(layers)
            * u64::from(layout.planes_per_layer)
            * src.len() as u64
            * layout.block_bytes;
        self.d_mem.fill(0, self.d_mem.len(), 0)?;
        self.transfer(op, src_range.clone(), dst_range.clone())
            .await?; // warm-up: page faults, connections
        crate::verify::compare_blocks(&self.p_mem, &self.d_mem, &layout, layers, &src, &dst, false)
            .with_context(|| format!("{name} {op} moved wrong bytes"))?;
        let iterations = (self.bytes_per_point() / bytes).clamp(3, 2000);
        let mut lat = Latencies::default();
        let mut total = Duration::ZERO;
        let mut segments = 0;
        let sidecars = [self.cluster.prefill.pid(), self.cluster.decode.pid()];
        let cpu_before = crate::cpu::sample(&sidecars);
        for _ in 0..iterations {
            let (d, segs) = self
                .transfer(op, src_range.clone(), dst_range.clone())
                .await?;
            lat.record(d);
            total += d;
            segments = segs;
        }
        let cpu = crate::cpu::since(cpu_before, &sidecars, bytes * iterations);
        self.unregister(regions).await?;
        Ok(Point {
            name,
            op: op.to_string(),
            bytes,
            blocks: u64::from(layers) * u64::from(layout.planes_per_layer) * src.len() as u64,
            segments,
            lat,
            total,
            iterations,
            cpu,
        })
    }

    fn bytes_per_point(&self) -> u64 {
        self.args
            .bytes_per_point
            .unwrap_or(if self.transport == "rdma" {
                256 << 20
            } else {
                1 << 30
            })
    }

    fn report(&mut self, p: Point, extra: serde_json::Value) {
        let rate = gbps(p.bytes * p.iterations, p.total);
        let mut v = json!({
            "bench": p.name,
            "transport": self.transport,
            "op": p.op,
            "bytes": p.bytes,
            "blocks": p.blocks,
            "segments": p.segments,
            "connections": self.args.connections,
            "iterations": p.iterations,
            "gbps": round3(rate),
            "p50_us": p.lat.percentile_us(50.0),
            "p99_us": p.lat.percentile_us(99.0),
        });
        if let Some(c) = p.cpu {
            v["sidecar_cpu_ns_per_byte"] = json!(round3(c.ns_per_byte));
            v["sidecar_cpu_ns_per_byte_each"] =
                json!([round3(c.each_ns_per_byte[0]), round3(c.each_ns_per_byte[1])]);
            v["machine_busy"] = json!(round3(c.machine_busy));
            v["udp_rcvbuf_errors"] = json!(c.net.udp_rcvbuf_errors);
            v["udp_sndbuf_errors"] = json!(c.net.udp_sndbuf_errors);
            v["tcp_retrans_segs"] = json!(c.net.tcp_retrans_segs);
        }
        if let Some(i) = self.iperf3_gbps {
            v["ratio_vs_iperf3"] = json!(round3(rate / i));
        }
        if let Some(i) = self.iperf3_procs_gbps {
            v["ratio_vs_iperf3_procs"] = json!(round3(rate / i));
        }
        if let Some(i) = self.ib_write_bw_gbps {
            v["ratio_vs_ib_write_bw"] = json!(round3(rate / i));
        }
        if let Some(m) = self.memory_gbps {
            v["ratio_vs_memory_two_copies"] = json!(round3(rate / m));
        }
        if let (Some(c), true) = (self.contiguous_push_gbps, p.name != "single") {
            v["ratio_vs_contiguous_256m"] = json!(round3(rate / c));
        }
        if let serde_json::Value::Object(m) = extra {
            for (k, val) in m {
                v[k] = val;
            }
        }
        eprintln!(
            "{:<10} {:<5} {:>10} {:>7} blk {:>6} seg {:>8.3} GB/s  p50 {:>9} us  p99 {:>9} us{}{}{}",
            p.name,
            p.op,
            human_bytes(p.bytes),
            p.blocks,
            p.segments,
            rate,
            p.lat.percentile_us(50.0),
            p.lat.percentile_us(99.0),
            match (
                v.get("ratio_vs_iperf3"),
                v.get("ratio_vs_iperf3_procs"),
                v.get("ratio_vs_ib_write_bw"),
            ) {
                (Some(a), Some(b), _) => format!("  {a}x iperf3 -P, {b}x iperf3 procs"),
                (Some(a), None, _) => format!("  {a}x iperf3"),
                (_, _, Some(r)) => format!("  {r}x ib_write_bw"),
                _ => String::new(),
            },
            v.get("ratio_vs_memory_two_copies")
                .map_or(String::new(), |m| format!(", {m}x memory")),
            p.cpu.map_or(String::new(), |c| format!("  {c}")),
        );
        println!("{v}");
        self.results.push(v);
    }
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Distinct content in every 4 KiB so that a misplaced block is caught.
fn fill_source(mem: &SharedRegion) -> anyhow::Result<()> {
    let chunk = 1 << 20;
    let mut buf = vec![0u8; chunk];
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    rand::RngCore::fill_bytes(&mut rng, &mut buf);
    let mut off = 0u64;
    while off < mem.len() {
        let n = (mem.len() - off).min(chunk as u64) as usize;
        for (i, page) in buf[..n].chunks_mut(4096).enumerate() {
            page[..8].copy_from_slice(&(off / 4096 + i as u64).to_le_bytes());
        }
        mem.write_at(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Runs `procs` iperf3 client/server pairs at once on loopback, each with
/// `streams_each` streams; total GB/s received. A pair that fails (iperf3
/// sometimes ends without a result: "the server is busy", a control connection
/// reset) is run again with a fresh server, up to [`IPERF3_ATTEMPTS`] times.
fn iperf3(procs: usize, streams_each: usize, seconds: u32) -> anyhow::Result<f64> {
    if procs == 0 {
        bail!("iperf3 needs at least one process");
    }
    // Hold every probe listener until all ports are picked, so no two are the same.
    let probes = (0..procs)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let ports = probes
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()?;
    drop(probes);
    let total = std::thread::scope(|scope| {
        let handles: Vec<_> = ports
            .iter()
            .map(|&p| scope.spawn(move || iperf3_pair(p, streams_each, seconds)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("iperf3 client thread panicked"))?
            })
            .sum::<anyhow::Result<f64>>()
    });
    total
}

/// Runs of one iperf3 pair before its baseline is reported missing.
const IPERF3_ATTEMPTS: usize = 3;

/// One iperf3 server (`-1`: one test) and its client on `port`; GB/s received.
fn iperf3_pair(port: u16, streams: usize, seconds: u32) -> anyhow::Result<f64> {
    let mut why = String::new();
    for attempt in 1..=IPERF3_ATTEMPTS {
        let mut server = Command::new("iperf3")
            .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("iperf3 is not installed (apt-get install iperf3)")?;
        let result = iperf3_client(port, streams, seconds);
        let _ = server.kill();
        let _ = server.wait();
        match result {
            Ok(g) => return Ok(g),
            Err(e) => {
                why = format!("{e:#}");
                eprintln!("iperf3 on port {port}, attempt {attempt} of {IPERF3_ATTEMPTS}: {why}");
            }
        }
    }
    bail!("iperf3 on port {port} failed {IPERF3_ATTEMPTS} times, last: {why}")
}

fn iperf3_client(port: u16, streams: usize, seconds: u32) -> anyhow::Result<f64> {
    // The client retries until its server listens (it fails fast while it does not).
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &port.to_string()])
            .args(["-P", &streams.to_string()])
            .args(["-t", &seconds.to_string(), "--json"])
            .output()?;
        // iperf3 3.12 exits 0 with --json even when it could not connect (its
        // JSON then holds an "error" and no result): what aborted earlier
        // benches with "no end.sum_received" when a server was slow to listen.
        let refused = String::from_utf8_lossy(&out.stdout).contains("Connection refused");
        if !refused || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("iperf3 printed no JSON")?;
    if let Some(e) = v["error"].as_str() {
        bail!("iperf3: {e}");
    }
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 JSON has no end.sum_received")?;
    Ok(bps / 8.0 / 1e9)
}

/// The reference of a scattered batch of `total` bytes in blocks of
/// `block_bytes`: one contiguous range of the same size, same op, same run
/// (reported as a `contiguous` point); its GB/s.
async fn contiguous_reference(
    bench: &mut Bench,
    op: &str,
    total: u64,
    block_bytes: u64,
    reference_for: &str,
) -> anyhow::Result<f64> {
    let block = if total.is_multiple_of(1 << 20) {
        1 << 20
    } else {
        block_bytes
    };
    let flat = dense_layout(1, 1, (bench.p_mem.len() / block) as u32, block);
    let ids: Vec<u32> = (0..(total / block) as u32).collect();
    let reference = bench
        .point("contiguous", op, flat, 1, ids.clone(), ids)
        .await?;
    let rate = gbps(reference.bytes * reference.iterations, reference.total);
    bench.report(reference, json!({"reference_for": reference_for}));
    Ok(rate)
}

/// What the memory system gives [`memory_copy`].
struct MemoryCopy {
    direct_gbps: f64,
    via_buffer_gbps: f64,
}

/// Copies a region of `bytes` into another with `threads` threads taking 1 MiB
/// pieces in turn (as connections take slices), directly and through a
/// 64 KiB buffer per thread (which stays in the core's cache, as a socket
/// buffer does); best of three passes each. Both regions are written once
/// first (no page faults timed); at 256 MiB and more every pass reads and
/// writes memory.
fn memory_copy(bytes: usize, threads: usize) -> anyhow::Result<MemoryCopy> {
    const PIECE: usize = 1 << 20;
    const BUFFER: usize = 64 << 10;
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.fill(1);
    let threads = threads.max(1);
    let mut pass = |via_buffer: bool| {
        let mut shares: Vec<Vec<(&[u8], &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, pair) in src.chunks(PIECE).zip(dst.chunks_mut(PIECE)).enumerate() {
            shares[i % threads].push(pair);
        }
        let start = Instant::now();
        std::thread::scope(|scope| {
            for share in shares {
                scope.spawn(move || {
                    let mut buffer = vec![0u8; BUFFER];
                    for (from, to) in share {
                        if via_buffer {
                            for (f, t) in from.chunks(BUFFER).zip(to.chunks_mut(BUFFER)) {
                                buffer[..f.len()].copy_from_slice(f);
                                t.copy_from_slice(&buffer[..f.len()]);
                            }
                        } else {
                            to.copy_from_slice(from);
                        }
                    }
                });
            }
        });
        bytes as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let best = |f: &mut dyn FnMut() -> f64| (0..3).map(|_| f()).fold(0.0, f64::max);
    let direct_gbps = best(&mut || pass(false));
    let via_buffer_gbps = best(&mut || pass(true));
    if dst != src {
        bail!("the memory copy baseline did not copy every byte");
    }
    Ok(MemoryCopy {
        direct_gbps,
        via_buffer_gbps,
    })
}

/// Reports a baseline that could not be measured (its ratios are then left out).
fn baseline_failed(bench: &mut Bench, what: &str, e: &anyhow::Error) {
    eprintln!("{what}: not measured: {e:#}");
    let v = json!({"bench": "baseline_failed", "baseline": what, "error": format!("{e:#}")});
    println!("{v}");
    bench.results.push(v);
}

/// One latency sample over gRPC: the push call to the peer worker's
/// PUSH_RECEIVED notification on its stream; also the sending sidecar's own
/// view (accepted to the peer's Complete).
async fn grpc_push_sample(
    bench: &mut Bench,
    notes: &mut tonic::Streaming<kvrail_client::proto::Notification>,
    regions: (u64, u64),
    ids: Vec<u32>,
) -> anyhow::Result<(Duration, Duration)> {
    bench.next_request += 1;
    let req = format!("lat-{}", bench.next_request);
    // The client's own push would take its ring: this path is gRPC's.
    let mut grpc = bench
        .p
        .clone()
        .with_submit_path(kvrail_client::SubmitPath::Grpc);
    let start = Instant::now();
    let t = grpc
        .push(
            "bench-p",
            &req,
            "decode",
            blocks(regions.0, 0..1, ids.clone()),
            blocks(regions.1, 0..1, ids),
        )
        .await?;
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), notes.next())
            .await
            .context("no notification within 10 s")?
            .context("notification stream ended")??;
        if n.request_id == req {
            if n.kind != NotificationKind::PushReceived as i32 {
                bail!("latency push failed: {n:?}");
            }
            break;
        }
    }
    let elapsed = start.elapsed();
    let s = bench
        .p
        .wait(t.transfer_id, Some(Duration::from_secs(10)))
        .await?;
    Ok((elapsed, Duration::from_micros(s.elapsed_us)))
}

/// `count` latency samples over the rings: submission on the prefill
/// worker's ring to PUSH_RECEIVED in the decode worker's completion queue.
/// Runs on a thread of its own (the waits block).
fn ring_push_samples(
    p: &kvrail_client::ring::Ring,
    d: &kvrail_client::ring::Ring,
    regions: (u64, u64),
    ids: &[u32],
    first_request: u64,
    count: usize,
) -> anyhow::Result<(Latencies, Latencies)> {
    use kvrail_client::ring::CompletionKind as K;
    let mut lat = Latencies::default();
    let mut submit_cpu = Latencies::default();
    for i in 0..count {
        let req = format!("ring-lat-{}", first_request + i as u64);
        let start = Instant::now();
        kvrail_sidecar::trace_points::mark(kvrail_sidecar::trace_points::BENCH_SUBMIT);
        p.submit_push(
            &req,
            "decode",
            &blocks(regions.0, 0..1, ids.to_vec()),
            &blocks(regions.1, 0..1, ids.to_vec()),
        )?;
        let submitted = start.elapsed();
        // The prefill worker does not wait for the sidecar's answers (a
        // model thread goes on with the next layer): only the decode side
        // waits, for its notification. The sender's ACCEPTED and PUSH_DONE
        // are read after it, not timed.
        loop {
            let c = d
                .wait(Duration::from_secs(10))?
                .context("no ring completion within 10 s")?;
            if c.request_id == req {
                kvrail_sidecar::trace_points::mark(kvrail_sidecar::trace_points::BENCH_NOTIFIED);
                if c.kind != K::PushReceived {
                    bail!("ring latency push failed: {c:?}");
                }
                break;
            }
        }
        lat.record(start.elapsed());
        submit_cpu.record(submitted);
        let mut answers = 0;
        while answers < 2 {
            let c = p
                .wait(Duration::from_secs(10))?
                .context("no answer on the sender's ring within 10 s")?;
            match c.kind {
                K::Accepted | K::PushDone => answers += 1,
                K::Rejected | K::Failed => bail!("ring push failed: {c:?}"),
                _ => {}
            }
        }
    }
    Ok((lat, submit_cpu))
}

/// Layer-wise streaming as a prefill worker does it: one 4 KiB push per
/// layer, submitted back to back, for `requests` requests. Reports the
/// worker's time inside each submit call and each completion read (what the
/// model thread pays), and the time until the last layer landed.
fn layerwise(
    p: &kvrail_client::ring::Ring,
    d: &kvrail_client::ring::Ring,
    regions: (u64, u64),
    layers: u32,
    first_request: u64,
    requests: u64,
) -> anyhow::Result<serde_json::Value> {
    use kvrail_client::ring::CompletionKind as K;
    let mut submit_ns = Vec::new();
    let mut completion_ns = Vec::new();
    let mut landed = Latencies::default();
    for r in 0..requests {
        let start = Instant::now();
        for layer in 0..layers {
            let req = format!("lw-{}-{layer}", first_request + r);
            let t = Instant::now();
            loop {
                match p.submit_push(
                    &req,
                    "decode",
                    &blocks(regions.0, 0..1, vec![layer]),
                    &blocks(regions.1, 0..1, vec![layer]),
                ) {
                    Ok(_) => break,
                    Err(kvrail_client::ring::RingSubmitError::Full) => std::thread::yield_now(),
                    Err(e) => bail!("layer push: {e}"),
                }
            }
            submit_ns.push(t.elapsed().as_nanos() as u64);
        }
        let mut received = 0;
        while received < layers {
            let c = d
                .wait(Duration::from_secs(10))?
                .context("no layer landed within 10 s")?;
            match c.kind {
                K::PushReceived => received += 1,
                K::Failed => bail!("layer push failed: {c:?}"),
                _ => {}
            }
        }
        landed.record(start.elapsed());
        // The sender's answers: ACCEPTED and PUSH_DONE per layer, each read timed.
        let mut answers = 0;
        while answers < 2 * layers {
            let t = Instant::now();
            match p.poll()? {
                Some(c) => {
                    completion_ns.push(t.elapsed().as_nanos() as u64);
                    match c.kind {
                        K::Accepted | K::PushDone => answers += 1,
                        K::Rejected | K::Failed => bail!("layer push failed: {c:?}"),
                        _ => {}
                    }
                }
                None => {
                    p.wait(Duration::from_secs(10))?
                        .map(|c| {
                            if matches!(c.kind, K::Accepted | K::PushDone) {
                                answers += 1;
                            }
                        })
                        .context("no answer within 10 s")?;
                }
            }
        }
    }
    let q = |v: &mut Vec<u64>, p: f64| {
        v.sort_unstable();
        v.get(((v.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1e3
    };
    Ok(json!({
        "bench": "layerwise",
        "path": "ring",
        "layers": layers,
        "bytes_per_layer": 4096,
        "requests": requests,
        "submit_p50_us": q(&mut submit_ns, 0.5),
        "submit_p99_us": q(&mut submit_ns, 0.99),
        "completion_p50_us": q(&mut completion_ns, 0.5),
        "completion_p99_us": q(&mut completion_ns, 0.99),
        "all_landed_p50_us": landed.percentile_us(50.0),
        "all_landed_p99_us": landed.percentile_us(99.0),
    }))
}

async fn latency(
    bench: &mut Bench,
    ib_write_lat: Option<crate::perftest::WriteLatency>,
) -> anyhow::Result<()> {
    kvrail_sidecar::trace_points::start_from_env();
    let layout = dense_layout(1, 1, 1024, 4096);
    let regions = bench.register(layout).await?;
    // The same memory registered again for the ring workers, whose
    // notifications go to their rings (the gRPC workers' go to the stream).
    let ring_regions = (
        bench
            .p
            .register_path("bench-p-ring", bench.p_mem.path(), layout, true)
            .await?,
        bench
            .d
            .register_path("bench-d-ring", bench.d_mem.path(), layout, true)
            .await?,
    );
    let mut opts = kvrail_client::ring::RingOptions::default();
    if let Some(us) = bench.args.ring_spin_us {
        opts.spin = Duration::from_micros(us);
    }
    let p_ring = Arc::new(bench.p.open_ring("bench-p-ring", opts).await?);
    let d_ring = Arc::new(bench.d.open_ring("bench-d-ring", opts).await?);
    let mut notes = bench.d.subscribe("bench-d").await?;
    let samples = bench.args.latency_samples;
    // Rounds alternate the two paths so both see the same machine.
    let rounds = 10usize;
    let per_round = samples.div_ceil(rounds);
    let measured = |path: &str| bench.args.latency_paths.iter().any(|p| p == path);
    let (grpc_measured, ring_measured) = (measured("grpc"), measured("ring"));
    let mut lat = Latencies::default();
    let mut in_sidecar = Latencies::default();
    for size in bench.args.latency_sizes.clone() {
        let label = crate::stats::human_bytes(size);
        let nblocks = (size / 4096) as u32;
        let mut grpc = Latencies::default();
        let mut ring = Latencies::default();
        let mut submit_cpu = Latencies::default();
        let mut grpc_sidecar = Latencies::default();
        for round in 0..=rounds {
            // Round 0 warms both paths up.
            let n = if round == 0 { 50 } else { per_round };
            let grpc_n = if grpc_measured { n } else { 0 };
            let ring_n = if ring_measured { n } else { 0 };
            for i in 0..grpc_n {
                let first = ((round * per_round + i) as u32 * nblocks) % 1024;
                let ids: Vec<u32> = (0..nblocks).map(|b| (first + b) % 1024).collect();
                let (e, s) = grpc_push_sample(bench, &mut notes, regions, ids).await?;
                if round > 0 {
                    grpc.record(e);
                    grpc_sidecar.record(s);
                }
            }
            let (p, d) = (p_ring.clone(), d_ring.clone());
            let first_request = bench.next_request;
            bench.next_request += ring_n as u64;
            let ids: Vec<u32> = (0..nblocks).collect();
            let (r, c) = tokio::task::spawn_blocking(move || {
                ring_push_samples(&p, &d, ring_regions, &ids, first_request, ring_n)
            })
            .await??;
            if round > 0 {
                ring.merge(&r);
                submit_cpu.merge(&c);
            }
        }
        if size == 4096 {
            lat = grpc.clone();
            in_sidecar = grpc_sidecar.clone();
        }
        let paths = [
            ("grpc", grpc_measured, &grpc),
            ("ring", ring_measured, &ring),
        ];
        for (path, _, l) in paths.into_iter().filter(|(_, m, _)| *m) {
            let mut v = json!({
                "bench": "latency_path",
                "transport": bench.transport,
                "path": path,
                "op": "push",
                "bytes": size,
                "samples": rounds * per_round,
                "measured": "push submitted to the peer worker's PUSH_RECEIVED",
                "p50_us": l.percentile_us(50.0),
                "p99_us": l.percentile_us(99.0),
                "p999_us": l.percentile_us(99.9),
                "gbps_at_p50": size as f64 / (l.percentile_us(50.0).max(1) as f64 * 1e3),
            });
            if path == "ring" {
                v["submit_p50_us"] = json!(submit_cpu.percentile_us(50.0));
                if grpc_measured {
                    v["ratio_p50_vs_grpc"] = json!(
                        l.percentile_us(50.0) as f64 / grpc.percentile_us(50.0).max(1) as f64
                    );
                }
            }
            println!("{v}");
            bench.results.push(v);
        }
        let summary = |l: &Latencies| {
            format!(
                "p50 {} us p99 {} us p999 {} us",
                l.percentile_us(50.0),
                l.percentile_us(99.0),
                l.percentile_us(99.9)
            )
        };
        let parts: Vec<String> = [
            ("gRPC", grpc_measured, &grpc),
            ("ring", ring_measured, &ring),
        ]
        .into_iter()
        .filter(|(_, m, _)| *m)
        .map(|(path, _, l)| format!("{path} {}", summary(l)))
        .collect();
        eprintln!("latency    push {label:>6}: {}", parts.join(" | "));
    }
    let layer_counts = bench.args.latency_layers.clone();
    for layers in layer_counts.into_iter().filter(|&l| l > 0 && ring_measured) {
        let (p, d) = (p_ring.clone(), d_ring.clone());
        let first_request = bench.next_request;
        bench.next_request += 1000;
        let requests = (samples as u64 / 40).max(5);
        let v = tokio::task::spawn_blocking(move || {
            layerwise(&p, &d, ring_regions, layers, first_request, requests)
        })
        .await??;
        eprintln!(
            "layerwise  {layers} layers x 4 KiB over the ring: worker time per push p50 {:.2} us p99 {:.2} us, per completion read p50 {:.2} us; all layers landed p50 {} us",
            v["submit_p50_us"].as_f64().unwrap_or(0.0),
            v["submit_p99_us"].as_f64().unwrap_or(0.0),
            v["completion_p50_us"].as_f64().unwrap_or(0.0),
            v["all_landed_p50_us"]
        );
        let mut v = v;
        v["transport"] = json!(bench.transport);
        println!("{v}");
        bench.results.push(v);
    }
    kvrail_sidecar::trace_points::write();
    drop(p_ring);
    drop(d_ring);
    bench.p.unregister_region(ring_regions.0).await?;
    bench.d.unregister_region(ring_regions.1).await?;
    bench.unregister(regions).await?;
    if !grpc_measured {
        return Ok(());
    }
    // Where the time goes: a bare API round trip, and the sender's own view of the push.
    let mut rpc = Latencies::default();
    for _ in 0..samples {
        let start = Instant::now();
        bench.p.list_peers().await?;
        rpc.record(start.elapsed());
    }
    let mut v = json!({
        "bench": "latency",
        "transport": bench.transport,
        "op": "push",
        "bytes": 4096,
        "blocks": 1,
        "samples": samples,
        "measured": "client push call to the peer worker's PUSH_RECEIVED notification",
        "p50_us": lat.percentile_us(50.0),
        "p99_us": lat.percentile_us(99.0),
        "p999_us": lat.percentile_us(99.9),
        "sidecar_to_peer_and_back_p50_us": in_sidecar.percentile_us(50.0),
        "api_roundtrip_p50_us": rpc.percentile_us(50.0),
        "api_roundtrip_p99_us": rpc.percentile_us(99.0),
    });
    eprintln!(
        "latency    push  4 KiB: call -> peer notification  p50 {} us  p99 {} us  (bare API round trip p50 {} us; sidecar -> peer -> sidecar p50 {} us)",
        lat.percentile_us(50.0),
        lat.percentile_us(99.0),
        rpc.percentile_us(50.0),
        in_sidecar.percentile_us(50.0)
    );
    if let Some(l) = ib_write_lat {
        v["ib_write_lat_typical_us"] = json!(l.typical_us);
        v["ib_write_lat_avg_us"] = json!(l.average_us);
        v["ib_write_lat_p99_us"] = json!(l.p99_us);
        eprintln!(
            "ib_write_lat 4 KiB on the same devices: typical {} us, avg {} us, p99 {} us",
            l.typical_us, l.average_us, l.p99_us
        );
    }
    println!("{v}");
    bench.results.push(v);
    Ok(())
}

pub async fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    let counts = args.connection_counts.clone();
    if counts.is_empty() || counts.iter().any(|&c| c == 0 || c > 64) {
        bail!("--connections takes counts of 1 to 64");
    }
    for (i, &count) in counts.iter().enumerate() {
        args.connections = count;
        if counts.len() > 1 {
            eprintln!(
                "== {count} connection(s) per rail ({} of {})",
                i + 1,
                counts.len()
            );
        }
        run_at(args.clone()).await?;
    }
    Ok(())
}

/// The bench at `args.connections`.
async fn run_at(args: BenchArgs) -> anyhow::Result<()> {
    let wants = |part: &str| args.only.iter().any(|o| o == part);
    let scattered = parse_x(&args.scattered)?;
    let vllm = parse_x(&args.vllm)?;
    if scattered.len() != 2 || vllm.len() != 3 {
        bail!("--scattered is COUNTxSIZE and --vllm is LAYERSxBLOCKSxSIZE");
    }
    let max_single = args.sizes.iter().copied().max().unwrap_or(0);
    let scattered_layout = dense_layout(1, 1, (scattered[0] * 2) as u32, scattered[1]);
    let vllm_layout = dense_layout(vllm[0] as u32, 2, (vllm[1] * 2) as u32, vllm[2]);
    let file_bytes = max_single
        .max(layout_extent(&scattered_layout))
        .max(layout_extent(&vllm_layout))
        .max(if wants("tp") {
            crate::tp_bench::FILE_BYTES
        } else {
            0
        })
        .max(4 << 20);

    if !args.rails.is_empty() {
        return crate::rails::run(args, scattered).await;
    }
    if wants("plan") {
        let v = plan_cost(&vllm, args.slice_bytes)?;
        println!("{v}");
    }
    if wants("descriptors") {
        let v = crate::descriptors::report(args.descriptor_tokens, 16, args.slice_bytes);
        println!("{}", json!({"bench": "descriptors", "report": v}));
    }
    if args.only.iter().all(|o| o == "plan" || o == "descriptors") {
        return Ok(());
    }
    let rdma = args.transport.iter().any(|t| t == "rdma");
    if rdma && args.transport.len() > 1 {
        bail!("--transport rdma runs alone (inside the RDMA VM)");
    }
    let mut baselines = Baselines::default();
    let mut results: Vec<(&'static str, Vec<serde_json::Value>)> = Vec::new();
    for name in &args.transport {
        let transport: &'static str = match name.as_str() {
            "rdma" => "rdma",
            "quic" => "quic",
            _ => "tcp",
        };
        let (cluster, devices) = if rdma {
            let devices = rdma_devices(&args)?;
            let rails = args.rdma_rails;
            let mut opts = args.cluster_options(&["rdma", "tcp"]);
            opts.metrics = true;
            opts.extra_args
                .extend(["--rdma-qps-per-rail".into(), args.rdma_qps.to_string()]);
            let cluster = LocalCluster::start_on(
                &opts,
                &args.nodes.node_a[..rails],
                &args.nodes.node_b[..rails],
            )
            .await?;
            eprintln!(
                "kvrail bench: 2 sidecars, rdma over {rails} rail(s) ({}), {} queue pairs per rail, slices of {}",
                devices
                    .iter()
                    .map(|d| format!("{} -> {}", d.client, d.server))
                    .collect::<Vec<_>>()
                    .join(", "),
                args.rdma_qps,
                human_bytes(args.slice_bytes),
            );
            (cluster, devices)
        } else {
            let mut opts = args.cluster_options(&[transport]);
            // QUIC: how connections spread over the receiving sockets.
            opts.metrics |= transport == "quic";
            eprintln!(
                "kvrail bench: 2 sidecars on loopback, {transport}, {} connections, slices of {}, window {}",
                args.connections,
                human_bytes(args.slice_bytes),
                human_bytes(args.window_bytes)
            );
            (LocalCluster::start(&opts).await?, Vec::new())
        };
        let mut bench = Bench::start(cluster, &args, file_bytes, transport).await?;
        baselines.apply(&mut bench);
        let result = run_parts(
            &mut bench,
            &wants,
            &devices,
            &scattered,
            &vllm,
            scattered_layout,
            vllm_layout,
        )
        .await;
        bench.remove_files();
        result?;
        baselines.keep(&bench);
        results.push((transport, std::mem::take(&mut bench.results)));
    }
    compare_transports(&results);
    Ok(())
}

/// What the RDMA path does on the host before each post, for the vLLM-shaped
/// batch (LAYERS x K/V x BLOCKS of SIZE, scattered in a pool twice as large on
/// both sides), slice by slice: the scatter-gather plan (`kvrail_verbs::gather`,
/// Soft-RoCE's 30 entries per request) and the work requests built from it, as
/// `rdma::build` makes them. Best of 5 passes; the device post is not included.
fn plan_cost(vllm: &[u64], slice_bytes: u64) -> anyhow::Result<serde_json::Value> {
    use kvrail_verbs::{gather, Opcode, Sge, WorkRequest};
    let (layers, count, size) = (vllm[0], vllm[1], vllm[2]);
    let pool = count * 2;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut pick = || {
        let mut v: Vec<u64> = (0..pool).collect();
        v.shuffle(&mut rng);
        v.truncate(count as usize);
        v
    };
    let (src, dst) = (pick(), pick());
    // Logical order: layer, K/V plane, block; one piece per block on each side.
    let at = |plane: u64, block: u64| (plane * pool + block) * size;
    let mut pieces = Vec::with_capacity((layers * 2 * count) as usize);
    for plane in 0..layers * 2 {
        for i in 0..count as usize {
            pieces.push((at(plane, src[i]), at(plane, dst[i])));
        }
    }
    let per_slice = (slice_bytes / size).max(1) as usize;
    let mut best = Duration::MAX;
    let (mut descriptors, mut requests) = (0u64, 0u64);
    let mut wrs: Vec<WorkRequest> = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        descriptors = 0;
        requests = 0;
        for slice in pieces.chunks(per_slice) {
            let local: Vec<(u64, u64)> = slice.iter().map(|p| (0x1000_0000 + p.0, size)).collect();
            let remote: Vec<(u64, u64)> = slice.iter().map(|p| (0x9000_0000 + p.1, size)).collect();
            wrs.clear();
            for (remote_addr, sges) in gather(&local, &remote, 30)? {
                wrs.push(WorkRequest {
                    opcode: Opcode::Write,
                    wr_id: 0,
                    sges: sges
                        .into_iter()
                        .map(|(addr, len)| Sge { addr, len, lkey: 1 })
                        .collect(),
                    remote_addr,
                    rkey: 2,
                    inline: Vec::new(),
                    signaled: false,
                });
            }
            descriptors += slice.len() as u64;
            requests += wrs.len() as u64;
            std::hint::black_box(&wrs);
        }
        best = best.min(started.elapsed());
    }
    let ns = best.as_nanos() as f64 / descriptors as f64;
    eprintln!(
        "plan       vllm  {descriptors} descriptors -> {requests} work requests: {ns:.1} ns per descriptor on this host (NIXL: ~2.4 us)"
    );
    Ok(json!({
        "bench": "plan",
        "op": "push",
        "layers": layers,
        "blocks": count,
        "block_bytes": size,
        "slice_bytes": slice_bytes,
        "descriptors": descriptors,
        "work_requests": requests,
        "max_sge": 30,
        "best_of": 5,
        "seconds": best.as_secs_f64(),
        "ns_per_descriptor": (ns * 10.0).round() / 10.0,
    }))
}

/// Baselines measured once per run (iperf3) and carried to every transport's points.
#[derive(Default)]
struct Baselines {
    iperf3_gbps: Option<f64>,
    iperf3_procs_gbps: Option<f64>,
    memory_gbps: Option<f64>,
}

impl Baselines {
    fn apply(&self, bench: &mut Bench) {
        bench.iperf3_gbps = self.iperf3_gbps;
        bench.iperf3_procs_gbps = self.iperf3_procs_gbps;
        bench.memory_gbps = self.memory_gbps;
    }

    fn keep(&mut self, bench: &Bench) {
        self.iperf3_gbps = bench.iperf3_gbps;
        self.iperf3_procs_gbps = bench.iperf3_procs_gbps;
        self.memory_gbps = bench.memory_gbps;
    }
}

/// One JSON line per point that every transport measured: each transport's rate
/// against the first one's (tcp, when it was asked for first).
fn compare_transports(results: &[(&'static str, Vec<serde_json::Value>)]) {
    let Some(((base, base_points), rest)) = results.split_first() else {
        return;
    };
    let key = |v: &serde_json::Value| {
        (
            v["bench"].as_str().map(String::from),
            v["op"].as_str().map(String::from),
            v["bytes"].as_u64(),
        )
    };
    for (transport, points) in rest {
        for p in points {
            let (Some(rate), Some(bench)) = (p["gbps"].as_f64(), p["bench"].as_str()) else {
                continue;
            };
            let Some(b) = base_points.iter().find(|b| key(b) == key(p)) else {
                continue;
            };
            let Some(base_rate) = b["gbps"].as_f64().filter(|&r| r > 0.0) else {
                continue;
            };
            let ratio = round3(rate / base_rate);
            let cpu_ratio = match (
                p["sidecar_cpu_ns_per_byte"].as_f64(),
                b["sidecar_cpu_ns_per_byte"].as_f64().filter(|&c| c > 0.0),
            ) {
                (Some(c), Some(base_c)) => Some(round3(c / base_c)),
                _ => None,
            };
            let mut v = json!({
                "bench": "compare",
                "point": bench,
                "op": p["op"],
                "bytes": p["bytes"],
                "transport": transport,
                "vs": base,
                "gbps": p["gbps"],
                "vs_gbps": b["gbps"],
                "ratio": ratio,
            });
            if let Some(c) = cpu_ratio {
                v["cpu_per_byte_ratio"] = json!(c);
            }
            eprintln!(
                "compare    {bench:<10} {:<5} {:>10}  {transport} {:>8.3} GB/s vs {base} {:>8.3} GB/s: {ratio}x{}",
                p["op"].as_str().unwrap_or(""),
                human_bytes(p["bytes"].as_u64().unwrap_or(0)),
                rate,
                base_rate,
                cpu_ratio.map_or(String::new(), |c| format!(", {c}x the CPU per byte")),
            );
            println!("{v}");
        }
    }
}

/// The RDMA device of each rail address, both nodes, or why there is none.
fn rdma_devices(args: &BenchArgs) -> anyhow::Result<Vec<crate::perftest::DevicePair>> {
    let rails = args.rdma_rails;
    if rails == 0 || rails > args.nodes.node_a.len() || rails > args.nodes.node_b.len() {
        bail!(
            "--rdma-rails {rails}: each node has {} and {} addresses",
            args.nodes.node_a.len(),
            args.nodes.node_b.len()
        );
    }
    (0..rails)
        .map(|r| {
            let open = |ip: IpAddr| {
                kvrail_verbs::Device::open(ip, None, None).with_context(|| {
                    format!("no RDMA device for {ip} (run this inside shared/rdma-vm/run)")
                })
            };
            let (a, b) = (open(args.nodes.node_a[r])?, open(args.nodes.node_b[r])?);
            Ok(crate::perftest::DevicePair {
                server: b.name().to_string(),
                client: a.name().to_string(),
                gid_index: a.gid_index(),
            })
        })
        .collect()
}

/// What the RDMA run put through verbs and TCP, and what posting cost per
/// descriptor (one block piece gathered into a work request), from both sidecars.
fn rdma_counters(bench: &mut Bench) -> anyhow::Result<()> {
    use kvrail_sidecar::metrics as m;
    let texts = [
        bench.cluster.scrape(&bench.cluster.prefill)?,
        bench.cluster.scrape(&bench.cluster.decode)?,
    ];
    let sum = |name: &str, want: &[&str]| {
        texts
            .iter()
            .map(|t| loadgen::prometheus::sum(t, name, want))
            .sum::<f64>()
    };
    let rdma_bytes = sum(m::BYTES_SENT, &["transport=\"rdma\""])
        + sum(m::BYTES_RECEIVED, &["transport=\"rdma\""]);
    let tcp_bytes = sum(m::BYTES_SENT, &["transport=\"tcp\""]);
    let build_nanos = sum(m::RDMA_BUILD_NANOS, &[]);
    let nanos = sum(m::RDMA_POST_NANOS, &[]);
    let descriptors = sum(m::RDMA_DESCRIPTORS, &[]);
    let work_requests = sum(m::RDMA_WORK_REQUESTS, &[]);
    let per = |total: f64, n: f64| round3(if n > 0.0 { total / n } else { 0.0 });
    let build_per_descriptor = per(build_nanos, descriptors);
    let v = json!({
        "bench": "rdma_counters",
        "transport": "rdma",
        "rdma_payload_bytes": rdma_bytes,
        "tcp_payload_bytes_sent": tcp_bytes,
        "descriptors": descriptors,
        "work_requests": work_requests,
        "build_ns_per_descriptor": build_per_descriptor,
        "post_ns_per_descriptor": per(nanos, descriptors),
        "post_ns_per_work_request": per(nanos, work_requests),
        "measured": "build: bounds checks and gather lists per block piece (NIXL's reference: ~2400 ns per descriptor); post: ibv_post_send, which on Soft-RoCE runs the emulated NIC",
    });
    eprintln!(
        "rdma       {} moved by verbs, {} over TCP; {descriptors} descriptors in {work_requests} work requests: build {build_per_descriptor} ns per descriptor, ibv_post_send {} ns per work request",
        human_bytes(rdma_bytes as u64),
        human_bytes(tcp_bytes as u64),
        per(nanos, work_requests),
    );
    println!("{v}");
    bench.results.push(v);
    if rdma_bytes == 0.0 {
        bail!("the RDMA bench moved no byte through verbs: see the sidecar logs");
    }
    Ok(())
}

/// How many QUIC connections each receiving socket of each sidecar's
/// listener carries (the kernel spreads them by address hash: two on one
/// socket share its endpoint's one driver task).
fn quic_socket_loads(bench: &mut Bench) -> anyhow::Result<()> {
    let gauge = kvrail_sidecar::metrics::QUIC_SOCKET_CONNECTIONS;
    for side in ["prefill", "decode"] {
        let s = if side == "prefill" {
            &bench.cluster.prefill
        } else {
            &bench.cluster.decode
        };
        let text = bench.cluster.scrape(s)?;
        let mut loads: Vec<(usize, u64)> = text
            .lines()
            .filter(|l| l.starts_with(gauge) && l[gauge.len()..].starts_with('{'))
            .filter_map(|l| {
                let socket = l
                    .split("socket=\"")
                    .nth(1)?
                    .split('"')
                    .next()?
                    .parse()
                    .ok()?;
                let n = l.rsplit(' ').next()?.parse::<f64>().ok()? as u64;
                Some((socket, n))
            })
            .collect();
        loads.sort_unstable();
        let per_socket: Vec<u64> = loads.iter().map(|&(_, n)| n).collect();
        let connections: u64 = per_socket.iter().sum();
        let used = per_socket.iter().filter(|&&n| n > 0).count();
        let busiest = per_socket.iter().copied().max().unwrap_or(0);
        let v = json!({"bench": "quic_sockets", "transport": "quic", "sidecar": side,
            "connections": connections, "sockets": per_socket.len(), "sockets_used": used,
            "busiest_socket": busiest, "per_socket": per_socket});
        eprintln!(
            "quic sockets ({side}): {connections} connections over {used} of {} receiving sockets, at most {busiest} on one",
            per_socket.len()
        );
        println!("{v}");
        bench.results.push(v);
    }
    Ok(())
}

/// What QUIC costs here before kvrail adds anything: the packet cipher per byte
/// and raw quinn with kvrail's settings, identities and connection count.
async fn quic_floor(bench: &mut Bench) -> anyhow::Result<()> {
    use kvrail_quic::probe;
    // The sidecars' QUIC settings: their defaults with this run's `--sidecar-arg`s.
    let settings = match sidecar_config(&bench.args.sidecar_arg) {
        Ok(config) => config.quic_settings(),
        Err(e) => {
            eprintln!("quic-floor: QUIC defaults (the --sidecar-arg flags: {e:#})");
            kvrail_sidecar::config::Config::default().quic_settings()
        }
    };
    let packet = usize::from(settings.max_udp_payload);
    let cipher = probe::packet_cipher_cost(packet, Duration::from_millis(300))?;
    let v = json!({"bench": "quic-floor", "transport": "quic", "op": "cipher", "packet_bytes": packet,
        "seal_ns_per_byte": round3(cipher.seal_ns_per_byte), "open_ns_per_byte": round3(cipher.open_ns_per_byte)});
    eprintln!(
        "quic-floor AES-128-GCM, {packet} B packets, one core: seal {:.3} ns/B, open {:.3} ns/B",
        cipher.seal_ns_per_byte, cipher.open_ns_per_byte
    );
    println!("{v}");
    bench.results.push(v);
    let tls = bench.cluster.dir.path().join("tls");
    let identity = |node: &str| {
        kvrail_auth::Identity::load(node, &kvrail_auth::IdentityFiles::in_dir(&tls, node))
    };
    let (sender, receiver) = (identity("prefill")?, identity("decode")?);
    let connections = bench.args.connections;
    // One thread per connection and side, as far as the cores go (the sidecars
    // spread their connections over every core too).
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let threads = connections.min(cores / 2).max(1);
    let bytes = bench.bytes_per_point();
    let me = [std::process::id()];
    // All connections on one receiving UDP socket, then each on its own
    // (what one socket costs), reads dropped; then a socket each, reads
    // copied into regions as large as this run's 256 MiB push gives each
    // connection, with a runtime worker per core and side as the sidecars
    // have (what landing the bytes costs).
    let mut points = vec![(1, probe::Landing::Dropped)];
    if connections > 1 {
        points.push((connections, probe::Landing::Dropped));
    }
    let region_bytes = (256usize << 20) / connections.max(1);
    points.push((connections, probe::Landing::IntoRegions { region_bytes }));
    for (listeners, landing) in points {
        // Landing bytes is the sidecars' work too, and they run a worker per core.
        let threads = match landing {
            probe::Landing::Dropped => threads,
            probe::Landing::IntoRegions { .. } => cores,
        };
        let before = crate::cpu::sample(&me);
        let (sender, receiver, settings) = (sender.clone(), receiver.clone(), settings.clone());
        let raw = tokio::task::spawn_blocking(move || {
            probe::raw_throughput(
                &sender,
                &receiver,
                &settings,
                connections,
                threads,
                listeners,
                bytes,
                landing,
            )
        })
        .await?;
        let raw = match raw {
            Ok(raw) => raw,
            Err(e) => {
                // A floor that cannot be measured leaves the rest of the bench standing.
                eprintln!("quic-floor raw quinn failed: {e}");
                continue;
            }
        };
        // Both ends run in this process (handshakes included, negligible next to the bytes).
        let cpu = crate::cpu::since(before, &me, raw.bytes);
        let gbps = raw.gbps();
        let (op, landed) = match landing {
            probe::Landing::Dropped => ("raw-quinn", "dropped".to_string()),
            probe::Landing::IntoRegions { region_bytes } => (
                "raw-quinn-into-regions",
                format!("copied into {} regions", human_bytes(region_bytes as u64)),
            ),
        };
        let mut v = json!({"bench": "quic-floor", "transport": "quic", "op": op, "bytes": raw.bytes,
            "connections": connections, "threads_per_side": threads, "receiving_sockets": listeners,
            "gbps": round3(gbps)});
        if let probe::Landing::IntoRegions { region_bytes } = landing {
            v["region_bytes"] = json!(region_bytes);
        }
        if let Some(c) = cpu {
            v["cpu_ns_per_byte"] = json!(round3(c.ns_per_byte));
            v["machine_busy"] = json!(round3(c.machine_busy));
            v["udp_rcvbuf_errors"] = json!(c.net.udp_rcvbuf_errors);
        }
        eprintln!(
            "quic-floor raw quinn, {connections} connections, {threads} threads a side, {listeners} receiving socket(s), reads {landed}, {}: {gbps:>8.3} GB/s{}",
            human_bytes(raw.bytes),
            cpu.map_or(String::new(), |c| format!("  {c}"))
        );
        println!("{v}");
        bench.results.push(v);
    }
    Ok(())
}

/// The configuration `kvrail serve` makes of these extra flags.
fn sidecar_config(extra: &[String]) -> anyhow::Result<kvrail_sidecar::config::Config> {
    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: kvrail_sidecar::ServeArgs,
    }
    // A rail address and no identity of its own, so that it validates (only
    // its QUIC settings are read).
    let parsed = <Serve as clap::Parser>::try_parse_from(
        ["serve", "--listen=127.0.0.1:0", "--insecure"]
            .into_iter()
            .chain(extra.iter().map(String::as_str)),
    )
    .context("--sidecar-arg is not a `kvrail serve` flag")?;
    Ok(parsed.args.to_config()?)
}

async fn run_parts(
    bench: &mut Bench,
    wants: &dyn Fn(&str) -> bool,
    devices: &[crate::perftest::DevicePair],
    scattered: &[u64],
    vllm: &[u64],
    scattered_layout: RegionLayout,
    vllm_layout: RegionLayout,
) -> anyhow::Result<()> {
    let args = bench.args.clone();
    let mut ib_write_lat = None;
    if wants("perftest") && !devices.is_empty() {
        let size = args.slice_bytes;
        let iterations = (bench.bytes_per_point() / size).max(100);
        let g = crate::perftest::write_bw(devices, size, iterations, args.rdma_qps)?;
        bench.ib_write_bw_gbps = Some(g);
        let v = json!({"bench": "ib_write_bw", "transport": "rdma", "op": "write", "bytes": size, "iterations": iterations, "qps_per_rail": args.rdma_qps, "rails": devices.len(), "gbps": round3(g)});
        eprintln!(
            "ib_write_bw {} x {iterations}, {} qps x {} rail(s): {g:>8.3} GB/s",
            human_bytes(size),
            args.rdma_qps,
            devices.len()
        );
        println!("{v}");
        bench.results.push(v);
        if wants("latency") {
            ib_write_lat = Some(crate::perftest::write_lat(&devices[0], 4096, 1000)?);
        }
    }
    if wants("iperf3") && devices.is_empty() && bench.iperf3_gbps.is_none() {
        let n = args.connections;
        // A baseline that cannot be measured is reported; the kvrail points still run.
        match iperf3(1, n, args.iperf3_seconds) {
            Ok(g) => {
                bench.iperf3_gbps = Some(g);
                let v = json!({"bench": "iperf3", "transport": "tcp", "op": "stream", "processes": 1, "streams": n, "seconds": args.iperf3_seconds, "gbps": round3(g)});
                eprintln!("iperf3     -P {n}          {g:>8.3} GB/s (one process: iperf3 < 3.16 runs every stream in one thread)");
                println!("{v}");
                bench.results.push(v);
            }
            Err(e) => baseline_failed(bench, &format!("iperf3 -P {n}"), &e),
        }
        match iperf3(n, 1, args.iperf3_seconds) {
            Ok(g) => {
                bench.iperf3_procs_gbps = Some(g);
                let v = json!({"bench": "iperf3", "transport": "tcp", "op": "stream", "processes": n, "streams": n, "seconds": args.iperf3_seconds, "gbps": round3(g)});
                eprintln!("iperf3     {n} x -P 1      {g:>8.3} GB/s ({n} processes at once)");
                println!("{v}");
                bench.results.push(v);
            }
            Err(e) => baseline_failed(bench, &format!("{n} x iperf3 -P 1"), &e),
        }
        // Larger than any cache, and no more than 2 GiB of extra memory.
        let bytes = args
            .sizes
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .clamp(256 << 20, 1 << 30);
        match tokio::task::spawn_blocking(move || memory_copy(bytes as usize, n)).await? {
            Ok(copy) => {
                bench.memory_gbps = Some(copy.via_buffer_gbps);
                let v = json!({"bench": "memory", "op": "copy", "bytes": bytes, "threads": n,
                    "direct_gbps": round3(copy.direct_gbps), "via_64k_buffer_gbps": round3(copy.via_buffer_gbps)});
                eprintln!(
                    "memory     {n} threads copy {} cold: {:>8.3} GB/s directly, {:.3} GB/s through a 64 KiB buffer each (loopback TCP's two copies, no socket)",
                    human_bytes(bytes),
                    copy.direct_gbps,
                    copy.via_buffer_gbps
                );
                println!("{v}");
                bench.results.push(v);
            }
            Err(e) => baseline_failed(bench, "memory copy", &e),
        }
    }
    if wants("quic-floor") && bench.transport == "quic" {
        quic_floor(bench).await?;
    }
    if wants("single") {
        let mut sizes = args.sizes.clone();
        sizes.sort_unstable();
        // Largest first so the scattered and vLLM ratios have their reference.
        sizes.reverse();
        for &size in &sizes {
            for op in &args.ops {
                let block = size.min(1 << 20);
                let n = (size / block).max(1);
                let layout = dense_layout(1, 1, (bench.p_mem.len() / block) as u32, block);
                let ids: Vec<u32> = (0..n as u32).collect();
                let point = bench
                    .point("single", op, layout, 1, ids.clone(), ids)
                    .await?;
                if op == "push" && size == 256 << 20 {
                    bench.contiguous_push_gbps =
                        Some(gbps(point.bytes * point.iterations, point.total));
                }
                bench.report(point, json!({}));
            }
        }
        if bench.transport == "quic" {
            quic_socket_loads(bench)?;
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    if wants("scattered") {
        let count = scattered[0] as u32;
        // Every other block: no two sources adjacent; destinations a shuffled subset.
        let src: Vec<u32> = (0..count).map(|i| i * 2).collect();
        let mut dst: Vec<u32> = (0..count * 2).collect();
        dst.shuffle(&mut rng);
        dst.truncate(count as usize);
        for op in &args.ops {
            let reference = contiguous_reference(
                bench,
                op,
                u64::from(count) * scattered[1],
                scattered[1],
                "scattered",
            )
            .await?;
            let point = bench
                .point(
                    "scattered",
                    op,
                    scattered_layout,
                    1,
                    src.clone(),
                    dst.clone(),
                )
                .await?;
            let rate = gbps(point.bytes * point.iterations, point.total);
            let ratio = round3(rate / reference);
            eprintln!("scattered  {op:<5} {ratio}x a contiguous {op} of the same size");
            bench.report(
                point,
                json!({"block_bytes": scattered[1], "ratio_vs_contiguous_same_size": ratio}),
            );
        }
    }
    if wants("vllm") {
        let pool = (vllm[1] * 2) as u32;
        let pick = |rng: &mut rand::rngs::StdRng| {
            let mut v: Vec<u32> = (0..pool).collect();
            v.shuffle(rng);
            v.truncate(vllm[1] as usize);
            v
        };
        let src = pick(&mut rng);
        let dst = pick(&mut rng);
        let total = vllm[0] * 2 * vllm[1] * vllm[2];
        for op in &args.ops {
            let reference_gbps = contiguous_reference(bench, op, total, vllm[2], "vllm").await?;
            let point = bench
                .point(
                    "vllm",
                    op,
                    vllm_layout,
                    vllm[0] as u32,
                    src.clone(),
                    dst.clone(),
                )
                .await?;
            let rate = gbps(point.bytes * point.iterations, point.total);
            let ratio = round3(rate / reference_gbps);
            eprintln!("vllm       {op:<5} {ratio}x a contiguous {op} of the same size");
            bench.report(
                point,
                json!({"layers": vllm[0], "block_bytes": vllm[2], "pool_blocks": pool, "ratio_vs_contiguous_same_size": ratio}),
            );
        }
    }
    if wants("latency") {
        latency(bench, ib_write_lat).await?;
    }
    if wants("tp") {
        crate::tp_bench::run(bench, args.tp_rounds).await?;
    }
    if !devices.is_empty() {
        rdma_counters(bench)?;
    }
    Ok(())
}

/// A latency push size: whole 4 KiB blocks of the bench's 4 MiB region.
fn parse_latency_size(s: &str) -> Result<u64, String> {
    let size = parse_size(s)?;
    if size == 0 || size % 4096 != 0 || size > 4 << 20 {
        return Err(format!(
            "{s}: a latency size is a multiple of 4 KiB up to 4 MiB"
        ));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece is copied, whatever the pieces per thread (the last one
    /// short), and both rates are measured.
    #[test]
    fn the_memory_baseline_copies_every_piece() {
        let copy = memory_copy((5 << 20) + 4096, 3).unwrap();
        assert!(copy.direct_gbps > 0.0 && copy.direct_gbps.is_finite());
        assert!(copy.via_buffer_gbps > 0.0 && copy.via_buffer_gbps.is_finite());
    }

    #[test]
    fn plan_cost_counts_descriptors_and_requests() {
        // 2 layers x K/V x 8 blocks of 4 KiB: 32 descriptors; a request covers one
        // contiguous destination extent, so at most one request per descriptor
        // (fewer where two picked destination blocks happen to be adjacent).
        let v = plan_cost(&[2, 8, 4096], 16 << 10).unwrap();
        assert_eq!(v["descriptors"], 32);
        let wrs = v["work_requests"].as_u64().unwrap();
        assert!((1..=32).contains(&wrs), "{v}");
        assert!(v["ns_per_descriptor"].as_f64().unwrap() > 0.0);
    }
}
