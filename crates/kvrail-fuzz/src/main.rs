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

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let target = args.next().unwrap_or_default();
    if !kvrail_fuzz::TARGETS.contains(&target.as_str()) {
        anyhow::bail!(
            "usage: kvrail-fuzz TARGET [--seconds N] [--corpus DIR] [--seed S]; targets: {}",
            kvrail_fuzz::TARGETS.join(", ")
        );
    }
    let mut seconds = 10u64;
    let mut corpus = PathBuf::from(env_dir()).join("corpus").join(&target);
    let mut seed = rand::random::<u64>();
    let mut save = 0usize;
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        match flag.as_str() {
            "--seconds" => seconds = value.parse()?,
            "--corpus" => corpus = PathBuf::from(value),
            "--seed" => seed = value.parse()?,
            "--save" => save = value.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    let report = kvrail_fuzz::mutate::run(&target, &corpus, Duration::from_secs(seconds), seed)?;
    println!("{}", report.to_json());
    if save > 0 && report.crash.is_none() {
        let n = report.save(&corpus, save)?;
        eprintln!("{target}: {n} inputs added to {}", corpus.display());
    }
    if let Some(path) = report.crash {
        eprintln!("{target}: an input panicked; saved to {}", path.display());
        std::process::exit(1);
    }
    Ok(())
}

/// The crate's directory at run time (cargo sets it), else the current one.
fn env_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| "crates/kvrail-fuzz".into())
}
