//! Notices when this process stopped running for a while: a starved CPU, a
//! machine reclaiming or swapping memory, a SIGSTOP, a blocked runtime.
//! Peers judge a silent sidecar's rails stalled after a second and fail its
//! transfers after five; the warning says why, on the side that was silent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::metrics as m;

/// How often the watch wakes.
const TICK: Duration = Duration::from_millis(100);
/// A wake this much later than asked for is reported: half a peer's
/// initial stall deadline, far above scheduling noise.
pub const REPORTED_LATENESS: Duration = Duration::from_millis(500);

/// Runs until the runtime ends. Two clocks tell the causes apart: a plain
/// thread that wakes late means the process did not run (starved CPU,
/// reclaim, SIGSTOP); a runtime task that wakes late while that thread kept
/// time means every runtime worker was busy (a task blocking its thread).
pub async fn run() {
    let started = Instant::now();
    // Milliseconds since `started` up to which the thread saw the process
    // stopped (its latest late wake), so the task does not report it twice.
    let process_stopped_until = Arc::new(AtomicU64::new(0));
    let seen = process_stopped_until.clone();
    // The thread ends with this task (a runtime shut down).
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let stopped = stop.0.clone();
    let thread = std::thread::Builder::new()
        .name("kvrail-stall-watch".into())
        .spawn(move || {
            let mut last = Instant::now();
            while !stopped.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                let now = Instant::now();
                let late = late_since(last, now);
                last = now;
                if late >= REPORTED_LATENESS {
                    seen.store(millis(started, now), Ordering::Relaxed);
                    report(m::STALL_PROCESS, late, "this process did not run");
                }
            }
        });
    if let Err(e) = thread {
        warn!("cannot start the stall watch's thread ({e}); runtime stalls are reported as the process's");
    }
    let _stop = stop;
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        let now = Instant::now();
        let late = late_since(last, now);
        let window_start = millis(started, last);
        last = now;
        if late < REPORTED_LATENESS {
            continue;
        }
        // After a stop both clocks wake late: give the thread a tick to say so.
        tokio::time::sleep(TICK).await;
        last = Instant::now();
        if process_stopped_until.load(Ordering::Relaxed) >= window_start {
            continue; // the thread reports it: the whole process stopped
        }
        report(
            m::STALL_RUNTIME,
            late,
            "every async worker of this process was busy (a task blocked its thread; the process ran)",
        );
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn late_since(last: Instant, now: Instant) -> Duration {
    now.saturating_duration_since(last).saturating_sub(TICK)
}

fn millis(start: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(start).as_millis()).unwrap_or(u64::MAX)
}

fn report(cause: &'static str, late: Duration, what: &str) {
    m::process_stalls(cause).increment(1);
    m::process_stall_seconds(cause).record(late.as_secs_f64());
    warn!(
        cause,
        "{what} for {} ms (peers judge its rails stalled after 1 s): {}",
        late.as_millis(),
        pressure()
    );
}

/// The kernel's pressure stall figures (share of the last 10 s some task
/// waited for CPU, memory, I/O), where the kernel keeps them.
fn pressure() -> String {
    let figures: Vec<String> = ["cpu", "memory", "io"]
        .iter()
        .filter_map(|what| {
            let text = std::fs::read_to_string(format!("/proc/pressure/{what}")).ok()?;
            let some = text.lines().find(|l| l.starts_with("some"))?;
            let avg10 = some
                .split_whitespace()
                .find_map(|f| f.strip_prefix("avg10="))?;
            Some(format!("{what} {avg10}%"))
        })
        .collect();
    if figures.is_empty() {
        "no pressure figures here (/proc/pressure)".into()
    } else {
        format!("waiting over the last 10 s: {}", figures.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that blocks the runtime's only worker is reported as the
    /// runtime's stall, not as the process not running (its thread kept time).
    #[test]
    fn a_blocked_runtime_is_told_apart_from_a_stopped_process() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("a runtime");
            rt.block_on(async {
                let watch = tokio::spawn(run());
                tokio::time::sleep(TICK * 2).await;
                // The stimulus: the only worker is blocked, the process runs.
                std::thread::sleep(REPORTED_LATENESS + TICK * 2);
                let deadline = Instant::now() + Duration::from_secs(10);
                while !handle.render().contains("cause=\"runtime\"") && Instant::now() < deadline {
                    tokio::time::sleep(TICK).await;
                }
                watch.abort();
            });
        });
        let text = handle.render();
        assert!(
            text.contains("kvrail_process_stalls_total{cause=\"runtime\"} 1"),
            "{text}"
        );
        assert!(!text.contains("cause=\"process\""), "{text}");
    }
}
