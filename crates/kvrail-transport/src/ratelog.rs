//! Log lines that a remote party can trigger at will (refused handshakes,
//! malformed requests) are rate limited, so a flood cannot fill the disk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Admits at most `per_second` lines each second and counts the rest.
#[derive(Debug)]
pub struct RateLimitedLog {
    per_second: u64,
    /// The current second (since the epoch) in the high 32 bits, lines admitted
    /// in it in the low 32.
    window: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimitedLog {
    pub fn new(per_second: u64) -> Self {
        Self {
            per_second,
            window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last admitted one)` if this line may be
    /// logged now, else `None` (and it is counted).
    pub fn admit(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            & 0xffff_ffff;
        let mut cur = self.window.load(Ordering::Relaxed);
        loop {
            let (second, count) = (cur >> 32, cur & 0xffff_ffff);
            let next = if second == now {
                if count >= self.per_second {
                    self.suppressed.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                cur + 1
            } else {
                (now << 32) | 1
            };
            match self
                .window
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(self.suppressed.swap(0, Ordering::Relaxed)),
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_rate_and_counted() {
        let log = RateLimitedLog::new(5);
        let admitted = (0..1000).filter(|_| log.admit().is_some()).count();
        // Within one second: 5 (10 if the second ticked over during the loop).
        assert!((5..=10).contains(&admitted), "{admitted}");
    }
}
