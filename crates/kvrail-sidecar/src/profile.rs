//! An in-process CPU sampler for measuring the data path where no `perf` is
//! available (the `profile` feature): with `KVRAIL_PROFILE=PATH` set, the
//! daemon samples its threads at 999 Hz and, when it shuts down (SIGTERM or
//! SIGINT), writes `PATH.PID.folded`: folded stacks, `thread;outer;...;inner
//! COUNT` per line, as flame-graph tools read them.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

static LOCK_WAIT_NS: AtomicU64 = AtomicU64::new(0);
static LOCK_TAKEN: AtomicU64 = AtomicU64::new(0);

/// Times one wait for a link's lock (from `start` until dropped).
pub struct LockWait(Instant);

impl LockWait {
    pub fn start() -> Self {
        LockWait(Instant::now())
    }
}

impl Drop for LockWait {
    fn drop(&mut self) {
        LOCK_WAIT_NS.fetch_add(self.0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        LOCK_TAKEN.fetch_add(1, Ordering::Relaxed);
    }
}

/// A running sampler.
pub struct Profile {
    guard: pprof::ProfilerGuard<'static>,
    out: String,
}

/// Starts the sampler when `KVRAIL_PROFILE` names an output path.
pub fn start_from_env() -> Option<Profile> {
    let path = std::env::var_os("KVRAIL_PROFILE")?;
    let out = format!("{}.{}.folded", path.to_string_lossy(), std::process::id());
    match pprof::ProfilerGuardBuilder::default()
        .frequency(999)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
    {
        Ok(guard) => {
            tracing::info!(%out, "CPU profiler sampling at 999 Hz");
            Some(Profile { guard, out })
        }
        Err(e) => {
            tracing::warn!("profiler did not start: {e}");
            None
        }
    }
}

impl Profile {
    /// Writes every sample taken so far.
    pub fn write(&self) {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let fields: Vec<&str> = stat
            .get(stat.rfind(')').map_or(0, |i| i + 2)..)
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let switches: Vec<&str> = status
            .lines()
            .filter(|l| l.contains("ctxt_switches"))
            .collect();
        let counters = format!(
            "utime_ticks {} stime_ticks {} {} link_locks {} link_lock_wait_ms {}\n",
            fields.get(11).copied().unwrap_or("?"),
            fields.get(12).copied().unwrap_or("?"),
            switches.join(" "),
            LOCK_TAKEN.load(Ordering::Relaxed),
            LOCK_WAIT_NS.load(Ordering::Relaxed) / 1_000_000,
        );
        if let Err(e) = std::fs::write(format!("{}.counters", self.out), counters) {
            tracing::warn!("profile counters not written: {e}");
        }
        let report = match self.guard.report().build() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("profile not built: {e}");
                return;
            }
        };
        let mut text = String::new();
        for (frames, count) in &report.data {
            text.push_str(&frames.thread_name_or_id());
            for frame in frames.frames.iter().rev() {
                for symbol in frame.iter().rev() {
                    text.push(';');
                    text.push_str(&symbol.name().replace(';', ":"));
                }
            }
            text.push_str(&format!(" {count}\n"));
        }
        let written =
            std::fs::File::create(&self.out).and_then(|mut f| f.write_all(text.as_bytes()));
        match written {
            Ok(()) => tracing::info!(out = %self.out, "profile written"),
            Err(e) => tracing::warn!(out = %self.out, "profile not written: {e}"),
        }
    }
}
