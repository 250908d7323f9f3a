//! `kvrail`: the KV-cache transport sidecar.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvrail",
    version,
    about = "KV-cache transport sidecar for disaggregated LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the sidecar daemon.
    Serve(kvrail_sidecar::ServeArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvrail_sidecar::init_logging();
    match Cli::parse().command {
        Command::Serve(args) => kvrail_sidecar::serve(args).await,
    }
}
