//! `kvrail`: the KV-cache transport sidecar.
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvrail_auth::generate::{self, Validity};

/// mimalloc, not glibc's malloc: the data path allocates on one thread and
/// frees on another (a ring thread's records, a reader's buffers), which
/// glibc serves from a locked arena's bins; a profile of a 4 KiB ring push
/// put 8% of its ring thread in glibc's malloc and free (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Serve(Box<kvrail_sidecar::ServeArgs>),
    /// Make the cluster's certificates: a CA, then one certificate per node.
    #[command(subcommand)]
    Certs(Certs),
    /// Check this node's rails (links, bonds, MTUs, subnets, RDMA devices, GIDs)
    /// and reach each peer on each rail; says how to fix what is wrong. Takes the
    /// same configuration as `serve`; exits 1 when a check failed.
    Doctor(Box<kvrail_sidecar::doctor::DoctorArgs>),
}

#[derive(Subcommand)]
enum Certs {
    /// Create DIR/ca.pem and DIR/ca.key (the cluster CA; keep ca.key off the nodes).
    Init {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Create DIR/NODE.pem and DIR/NODE.key for each node, signed by DIR's CA.
    Node {
        #[arg(long)]
        dir: PathBuf,
        /// Node names, as in `--node` and the peers' `--peer NAME=...`.
        #[arg(required = true)]
        names: Vec<String>,
        /// Days the certificates stay valid.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(i64).range(1..=36500))]
        days: i64,
        /// Replace a node's existing certificate and key.
        #[arg(long)]
        force: bool,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    kvrail_sidecar::init_logging();
    kvrail_sidecar::exit_on_error(run(Cli::parse().command).await)
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => kvrail_sidecar::serve(*args).await,
        Command::Doctor(args) => {
            let code = kvrail_sidecar::doctor::run(*args).await?;
            std::process::exit(code)
        }
        Command::Certs(Certs::Init { dir }) => {
            let ca = generate::ca(&dir)?;
            println!("{}", ca.display());
            Ok(())
        }
        Command::Certs(Certs::Node {
            dir,
            names,
            days,
            force,
        }) => {
            for name in &names {
                kvrail_auth::check_node_name(name).map_err(anyhow::Error::msg)?;
                let existing = dir.join(format!("{name}.pem"));
                if !force && existing.exists() {
                    anyhow::bail!(
                        "{} exists: pass --force to replace node {name:?}'s certificate and key",
                        existing.display()
                    );
                }
            }
            for name in names {
                let cert = generate::node(&dir, &name, Validity::days(days))?;
                println!("{}", cert.display());
            }
            Ok(())
        }
    }
}
