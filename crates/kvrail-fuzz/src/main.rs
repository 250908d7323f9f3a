//! `kvrail-fuzz TARGET [--seconds N] [--corpus DIR] [--seed S] [--save N]`: a mutation
//! fuzzer on stable Rust. It starts from the target's seeds and the files in
//! `DIR` (default: this crate's `corpus/TARGET`), mutates them (bit flips,
//! byte sets, interesting integers, inserts, deletes, splices, truncations) and
//! runs the target on each input; an input that panics is written to
//! `artifacts/TARGET/` and the run exits 1. It is not coverage-guided (that is
//! what the libFuzzer harness in docs/fuzzing.md is for): it trades guidance
//! for running anywhere, CI included. Prints one JSON line with the counts;
//! `--save N` adds up to N of the inputs it kept to the corpus directory.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// A mutation fuzzer for kvrail's decoders, on stable Rust.
#[derive(Parser)]
#[command(name = "kvrail-fuzz", version)]
struct Args {
    /// What to fuzz: one of kvrail_fuzz::TARGETS (`kvrail-fuzz list` prints them).
    target: String,
    /// How long to run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seed inputs (default: this crate's corpus/TARGET).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// The random seed (default: a fresh one, printed in the report).
    #[arg(long)]
    seed: Option<u64>,
    /// Add up to N of the inputs kept to the corpus directory.
    #[arg(long, default_value_t = 0)]
    save: usize,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.target == "list" {
        println!("{}", kvrail_fuzz::TARGETS.join("\n"));
        return std::process::ExitCode::SUCCESS;
    }
    if !kvrail_fuzz::TARGETS.contains(&args.target.as_str()) {
        eprintln!(
            "error: unknown target {:?}; targets: {}",
            args.target,
            kvrail_fuzz::TARGETS.join(", ")
        );
        return std::process::ExitCode::from(2);
    }
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let target = args.target;
    let corpus = args
        .corpus
        .unwrap_or_else(|| PathBuf::from(env_dir()).join("corpus").join(&target));
    let seed = args.seed.unwrap_or_else(rand::random::<u64>);
    let report =
        kvrail_fuzz::mutate::run(&target, &corpus, Duration::from_secs(args.seconds), seed)?;
    println!("{}", report.to_json());
    if args.save > 0 && report.crash.is_none() {
        let n = report.save(&corpus, args.save)?;
        eprintln!("{target}: {n} inputs added to {}", corpus.display());
    }
    if let Some(path) = report.crash {
        eprintln!("{target}: an input panicked; saved to {}", path.display());
        return Ok(std::process::ExitCode::FAILURE);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The crate's directory at run time (cargo sets it), else the current one.
fn env_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| "crates/kvrail-fuzz".into())
}
