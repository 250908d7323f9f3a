//! Notices when this process stopped running for a while: a starved CPU, a
//! machine reclaiming or swapping memory, a SIGSTOP, a blocked runtime.
//! Peers judge a silent sidecar's rails stalled after a second and fail its
//! transfers after five; the warning says why, on the side that was silent.

use std::time::{Duration, Instant};

use tracing::warn;

use crate::metrics as m;

/// How often the watch wakes.
const TICK: Duration = Duration::from_millis(100);
/// A wake this much later than asked for is reported: half a peer's
/// initial stall deadline, far above scheduling noise.
pub const REPORTED_LATENESS: Duration = Duration::from_millis(500);

/// Runs until the runtime ends.
pub async fn run() {
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        let now = Instant::now();
        let late = now.saturating_duration_since(last).saturating_sub(TICK);
        last = now;
        if late >= REPORTED_LATENESS {
            m::process_stalls().increment(1);
            m::process_stall_seconds().record(late.as_secs_f64());
            warn!(
                "this process did not run for {} ms (peers judge its rails stalled after 1 s): {}",
                late.as_millis(),
                pressure()
            );
        }
    }
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
