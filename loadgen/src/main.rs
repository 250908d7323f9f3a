//! loadgen: benchmarks, the two-sidecar demo, and (hidden) the sidecar itself so
//! that one binary can start real sidecar processes.

mod bench;
mod cpu;
mod demo;
mod descriptors;
mod gpu;
mod model;
mod perftest;
mod rails;
mod replay;
mod soak;
mod stats;
mod tp_bench;
mod trace;
mod verify;

use clap::{Parser, Subcommand};

/// mimalloc, not glibc's malloc: the data path allocates on one thread and
/// frees on another (a ring thread's records, a reader's buffers), which
/// glibc serves from a locked arena's bins; a profile of a 4 KiB ring push
/// put 8% of its ring thread in glibc's malloc and free (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "loadgen",
    about = "kvrail load generator: benchmarks and trace-driven demo"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay the first requests of a trace through two local sidecars; print transfer times and TTFT share.
    Demo(demo::DemoArgs),
    /// Replay a trace through emulated prefill/decode workers and two sidecars per transport; TTFT per transport, live and projected.
    Replay(replay::ReplayArgs),
    /// Measure throughput and latency between two local sidecars, with iperf3 side by side.
    Bench(bench::BenchArgs),
    /// GPU-resident KV through the staged pipeline over TCP loopback, verified on the GPU, against its bounds (needs a CUDA GPU).
    Gpu(gpu::GpuArgs),
    /// Two sidecars under load and chaos (pauses, kills and restarts, truncated files) for a given time; every byte and notification checked, daemon resources sampled.
    Soak(soak::SoakArgs),
    /// Run a sidecar daemon (same as `kvrail serve`); used to start real sidecar processes.
    #[command(hide = true)]
    Sidecar(Box<kvrail_sidecar::ServeArgs>),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    kvrail_sidecar::init_logging();
    let command = Cli::parse().command;
    // On Ctrl-C or SIGTERM the run is dropped, so the sidecars it started
    // are stopped and its shared-memory files removed (their Drops) before
    // the process exits. A sidecar handles its own signals: it shuts down in
    // order (writing a profile or trace first) rather than being dropped.
    let outcome = if matches!(command, Command::Sidecar(_)) {
        run(command).await
    } else {
        tokio::select! {
            outcome = run(command) => outcome,
            signal = interrupted() => Err(anyhow::anyhow!("stopped by {signal}")),
        }
    };
    kvrail_sidecar::exit_on_error(outcome)
}

/// The first SIGINT or SIGTERM.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Demo(a) => demo::run(a).await,
        Command::Replay(a) => replay::run(a).await,
        Command::Bench(a) => bench::run(a).await,
        Command::Gpu(a) => gpu::run(a).await,
        Command::Soak(a) => soak::run(a).await,
        Command::Sidecar(a) => kvrail_sidecar::serve(*a).await,
    }
}
