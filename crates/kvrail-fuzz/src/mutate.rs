//! The mutation loop of the stable fuzzer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What a run did.
#[derive(Debug)]
pub struct Report {
    pub target: String,
    pub seed: u64,
    pub corpus: usize,
    pub executions: u64,
    pub seconds: f64,
    /// The input that panicked, or ran longer than [`SLOW`], saved.
    pub crash: Option<PathBuf>,
    /// "panic" or "slow".
    pub kind: Option<&'static str>,
    /// The inputs the run kept as starting points (seeds and corpus first).
    pub pool: Vec<Vec<u8>>,
}

impl Report {
    /// Writes the first `n` kept inputs into `dir` (named by content hash), to
    /// grow the committed corpus.
    pub fn save(&self, dir: &Path, n: usize) -> std::io::Result<usize> {
        use std::hash::{Hash, Hasher};
        std::fs::create_dir_all(dir)?;
        let mut written = 0;
        for input in self.pool.iter().take(n) {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            input.hash(&mut h);
            let path = dir.join(format!("{:016x}", h.finish()));
            if !path.exists() {
                std::fs::write(path, input)?;
                written += 1;
            }
        }
        Ok(written)
    }
}

/// An input that takes longer than this is a finding too (a peer could make the
/// session spin on it), once two more runs confirm it on CPU time: wall time
/// alone also counts the moments a busy machine did not run the fuzzer.
pub const SLOW: Duration = Duration::from_secs(1);

impl Report {
    pub fn to_json(&self) -> String {
        format!(
            "{{\"target\":\"{}\",\"seed\":{},\"corpus\":{},\"executions\":{},\"seconds\":{:.1},\"finding\":{},\"input\":{}}}",
            self.target,
            self.seed,
            self.corpus,
            self.executions,
            self.seconds,
            self.kind
                .map(|k| format!("\"{k}\""))
                .unwrap_or_else(|| "null".into()),
            self.crash
                .as_ref()
                .map(|p| format!("\"{}\"", p.display()))
                .unwrap_or_else(|| "null".into())
        )
    }
}

/// CPU time this thread has used (from /proc; 10 ms resolution).
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let ticks: u64 = stat
        .rsplit_once(") ")
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11) // fields 14 (utime) and 15 (stime), after pid and comm
                .take(2)
                .filter_map(|f| f.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// Values that often sit on a boundary.
const INTERESTING: [u64; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    u64::MAX / 2,
    u64::MAX,
];

fn mutate(rng: &mut StdRng, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    for _ in 0..rng.random_range(1..=4) {
        let len = input.len();
        match rng.random_range(0..9) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                input[i] ^= 1 << rng.random_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                input[i] = rng.random();
            }
            2 if len > 0 => {
                let v = INTERESTING[rng.random_range(0..INTERESTING.len())];
                let width = [1usize, 2, 4, 8][rng.random_range(0..4)];
                let i = rng.random_range(0..len);
                for (k, b) in v.to_le_bytes().iter().take(width).enumerate() {
                    if let Some(slot) = input.get_mut(i + k) {
                        *slot = *b;
                    }
                }
            }
            3 => {
                let i = rng.random_range(0..=len);
                let n = rng.random_range(1..=16);
                for _ in 0..n {
                    input.insert(i.min(input.len()), rng.random());
                }
            }
            4 if len > 1 => {
                let i = rng.random_range(0..len);
                let n = rng.random_range(1..=(len - i).min(16));
                input.drain(i..i + n);
            }
            5 if !corpus.is_empty() => {
                let other = &corpus[rng.random_range(0..corpus.len())];
                if !other.is_empty() {
                    let from = rng.random_range(0..other.len());
                    let n = rng.random_range(1..=(other.len() - from).min(64));
                    let at = rng.random_range(0..=len);
                    for (k, b) in other[from..from + n].iter().enumerate() {
                        input.insert((at + k).min(input.len()), *b);
                    }
                }
            }
            6 if len > 0 => input.truncate(rng.random_range(0..len)),
            7 if len > 2 => {
                // Repeat a chunk (lengths and counts that blow up).
                let i = rng.random_range(0..len - 1);
                let n = rng.random_range(1..=(len - i).min(32));
                let chunk = input[i..i + n].to_vec();
                for _ in 0..rng.random_range(1..8) {
                    input.extend_from_slice(&chunk);
                }
            }
            _ => input.push(rng.random()),
        }
    }
    input.truncate(64 << 10);
}

fn load(dir: &Path) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            if let Ok(b) = std::fs::read(&p) {
                out.push(b);
            }
        }
    }
    out
}

/// Runs `target` on its seeds, the corpus in `dir`, then mutations for `budget`.
pub fn run(target: &str, dir: &Path, budget: Duration, seed: u64) -> anyhow::Result<Report> {
    let mut corpus = crate::seeds(target);
    corpus.extend(load(dir));
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let mut executions = 0u64;
    // The panic message of a failing input is what the run reports; the
    // default hook would print every one.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut crash = None;
    let mut kind = None;
    // With KVRAIL_FUZZ_LAST set, each input is written there before it runs, so
    // one that aborts the process (out of memory) can be found afterwards.
    let last = std::env::var_os("KVRAIL_FUZZ_LAST").map(PathBuf::from);
    let mut try_one = |input: &[u8]| -> bool {
        executions += 1;
        if let Some(p) = &last {
            let _ = std::fs::write(p, input);
        }
        let timed = || {
            let at = Instant::now();
            let ok = catch_unwind(AssertUnwindSafe(|| crate::run(target, input))).is_ok();
            (ok, at.elapsed())
        };
        let (ok, took) = timed();
        if !ok {
            kind = Some("panic");
        } else if took > SLOW {
            // Confirm on CPU time, which a busy machine does not inflate.
            let before = thread_cpu();
            let reruns = 2;
            for _ in 0..reruns {
                timed();
            }
            if thread_cpu().saturating_sub(before) > SLOW * reruns {
                kind = Some("slow");
            }
        }
        kind.is_none()
    };
    let mut failing = None;
    for input in &corpus {
        if !try_one(input) {
            failing = Some(input.clone());
            break;
        }
    }
    while failing.is_none() && started.elapsed() < budget {
        for _ in 0..256 {
            let mut input = if corpus.is_empty() {
                Vec::new()
            } else {
                corpus[rng.random_range(0..corpus.len())].clone()
            };
            mutate(&mut rng, &mut input, &corpus);
            if !try_one(&input) {
                failing = Some(input);
                break;
            }
            // Keep some inputs as new starting points (no coverage signal: a
            // bounded random pool keeps the search from staying near the seeds).
            if rng.random_range(0..64) == 0 {
                if corpus.len() < 4096 {
                    corpus.push(input);
                } else {
                    let i = rng.random_range(0..corpus.len());
                    corpus[i] = input;
                }
            }
        }
    }
    std::panic::set_hook(hook);
    if let Some(input) = failing {
        let out = Path::new("artifacts").join(target);
        std::fs::create_dir_all(&out)?;
        let path = out.join(format!("{}-{seed:x}-{executions}", kind.unwrap_or("crash")));
        std::fs::write(&path, &input)?;
        // Run it once more with the hook back, so the panic message is printed.
        let _ = catch_unwind(AssertUnwindSafe(|| crate::run(target, &input)));
        crash = Some(path);
    }
    Ok(Report {
        target: target.to_string(),
        seed,
        corpus: corpus.len(),
        executions,
        seconds: started.elapsed().as_secs_f64(),
        crash,
        kind,
        pool: corpus,
    })
}
