//! Keeps one runtime worker awake for a short while after traffic.
//!
//! A frame that arrives while every runtime worker sleeps in `epoll_wait`
//! waits for the kernel to wake one and for a CPU to run it; on a machine of
//! two cores that wait was most of a 4 KiB push's time (docs/ring-format.md).
//! While traffic is recent, one task here yields in a loop instead, giving
//! its CPU to any other runnable thread of that CPU (`sched_yield`) each
//! round; a yielded task's worker polls the I/O driver when it can take the
//! driver's lock (on the multi-thread runtime a worker asleep in `epoll`
//! holds it, and then the poll is skipped). Which of these gave the measured
//! gain (2 cores: 4 KiB p50 ~108 -> ~76 us) was not measured; keeping a CPU
//! out of idle is another candidate. Once nothing has moved for the window,
//! it sleeps until the next traffic.
//!
//! Opt-in (`runtime_busy_poll_us`), and known limits: any frame refreshes it,
//! so a peer sending a ping a millisecond keeps one thread spinning; GPU-
//! staged, inline and RDMA one-sided sends are not counted toward bulk; the
//! bulk threshold is per window, not a rate.
//!
//! Bulk traffic does not spin: a worker is busy then anyway, and a spinner
//! takes CPU from the copies (2 cores: pulls fell from ~4.2 to ~2.4 GB/s
//! when it spun through them). The spin holds only while the current window
//! and the one before it have each carried under [`BULK_BYTES`] (the one
//! before, so that a window opened by an acknowledgement in the middle of a
//! bulk transfer does not wake the spinner for a moment each time).
//!
//! The same accounting tells connection readers whether to spin for their
//! next frame (`reader_spin_us`, see `link::reader`): only while traffic is
//! not bulk, and at most a quarter of the CPUs' worth of readers at once
//! (many connections with sparse small frames would otherwise keep every
//! runtime worker spinning).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Bytes per window above which traffic counts as bulk (no spin).
pub const BULK_BYTES: u64 = 512 << 10;

/// The accounting's window when only readers spin.
pub const READER_SPIN_WINDOW: Duration = Duration::from_millis(1);

/// The spinner and what wakes it; `touch` is cheap enough for every frame.
#[derive(Debug)]
pub struct BusyPoll {
    /// The accounting's window; zero: no accounting, nothing spins.
    window: Duration,
    /// Whether the runtime spinner runs (`runtime_busy_poll_us`).
    runtime_spin: bool,
    /// How long a reader spins for its next frame while traffic is not bulk.
    reader_spin: Duration,
    /// Readers spinning now, and how many may at once.
    readers_spinning: AtomicUsize,
    max_readers_spinning: usize,
    epoch: Instant,
    /// Microseconds since `epoch` of the last traffic.
    last_us: AtomicU64,
    /// Start of the current window, the bytes it has carried, and the bytes
    /// of the window just before it (0 if that one passed without traffic).
    window_start_us: AtomicU64,
    window_bytes: AtomicU64,
    previous_window_bytes: AtomicU64,
    parked: AtomicBool,
    wake: Notify,
}

impl BusyPoll {
    /// A spinner that keeps polling for `runtime_window` after traffic (zero:
    /// never), and readers that spin up to `reader_spin` for their next frame
    /// (zero: never). Either on, traffic is counted in windows of
    /// `runtime_window`, else of [`READER_SPIN_WINDOW`].
    pub fn new(runtime_window: Duration, reader_spin: Duration) -> Arc<Self> {
        let window = if !runtime_window.is_zero() || reader_spin.is_zero() {
            runtime_window
        } else {
            READER_SPIN_WINDOW
        };
        Arc::new(Self {
            window,
            runtime_spin: !runtime_window.is_zero(),
            reader_spin,
            readers_spinning: AtomicUsize::new(0),
            max_readers_spinning: max_readers_spinning(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            epoch: Instant::now(),
            last_us: AtomicU64::new(0),
            window_start_us: AtomicU64::new(0),
            window_bytes: AtomicU64::new(0),
            previous_window_bytes: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            wake: Notify::new(),
        })
    }

    /// Whether traffic is counted (`touch` does anything).
    pub fn enabled(&self) -> bool {
        !self.window.is_zero()
    }

    /// Whether the runtime spinner runs.
    pub fn runtime_spin(&self) -> bool {
        self.runtime_spin && self.enabled()
    }

    /// Whether a reader that has nothing left to read may spin for its next
    /// frame now: not when off, nor while traffic is bulk (a reader is then
    /// seldom idle for long, and a spinning one takes CPU from the copies).
    pub fn reader_spin_on(&self) -> bool {
        !self.reader_spin.is_zero() && !self.bulk()
    }

    /// Leave for one reader to spin (while the ticket lives), unless off,
    /// bulk, or as many readers spin already as may.
    pub fn reader_spin(self: &Arc<Self>) -> Option<ReaderSpin> {
        if !self.reader_spin_on() {
            return None;
        }
        self.readers_spinning
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_readers_spinning).then_some(n + 1)
            })
            .ok()?;
        Some(ReaderSpin {
            poll: self.clone(),
            length: self.reader_spin,
        })
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn window_us(&self) -> u64 {
        self.window.as_micros() as u64
    }

    /// Traffic of `bytes` payload happened: keep polling for the window from
    /// now, unless the window's traffic is bulk.
    pub fn touch(&self, bytes: u64) {
        if !self.enabled() {
            return;
        }
        self.touch_at(self.now_us(), bytes);
        if self.parked.load(Ordering::SeqCst) && !self.bulk() {
            self.wake.notify_one();
        }
    }

    /// The accounting of [`BusyPoll::touch`] at `now` (microseconds since
    /// `epoch`).
    fn touch_at(&self, now: u64, bytes: u64) {
        // Counted per window, approximately: touches racing a window's turn
        // may land in either window.
        let start = self.window_start_us.load(Ordering::Relaxed);
        let since = now.saturating_sub(start);
        if since >= self.window_us() {
            let previous = if since < 2 * self.window_us() {
                self.window_bytes.load(Ordering::Relaxed)
            } else {
                0
            };
            self.previous_window_bytes
                .store(previous, Ordering::Relaxed);
            self.window_start_us.store(now, Ordering::Relaxed);
            self.window_bytes.store(bytes, Ordering::Relaxed);
        } else if bytes > 0 {
            self.window_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        self.last_us.store(now, Ordering::SeqCst);
    }

    fn bulk(&self) -> bool {
        self.window_bytes.load(Ordering::Relaxed) >= BULK_BYTES
            || self.previous_window_bytes.load(Ordering::Relaxed) >= BULK_BYTES
    }

    /// Traffic within the window, and not bulk.
    fn recent(&self) -> bool {
        self.recent_at(self.now_us())
    }

    fn recent_at(&self, now: u64) -> bool {
        let last = self.last_us.load(Ordering::SeqCst);
        now.saturating_sub(last) < self.window_us() && !self.bulk()
    }

    /// The spinning task; runs until the runtime drops it.
    pub async fn run(self: Arc<Self>) {
        if !self.runtime_spin() {
            return;
        }
        loop {
            if self.recent() {
                std::thread::yield_now();
                tokio::task::yield_now().await;
                continue;
            }
            // Published before the last look, so a touch in between either
            // sees `parked` and notifies (the permit is kept) or is seen here.
            self.parked.store(true, Ordering::SeqCst);
            if !self.recent() {
                self.wake.notified().await;
            }
            self.parked.store(false, Ordering::SeqCst);
        }
    }
}

/// Readers that may spin at once with `cpus` CPUs: a quarter, at least one.
fn max_readers_spinning(cpus: usize) -> usize {
    (cpus / 4).max(1)
}

/// One reader's leave to spin, for [`ReaderSpin::length`] at most.
#[derive(Debug)]
pub struct ReaderSpin {
    poll: Arc<BusyPoll>,
    pub length: Duration,
}

impl Drop for ReaderSpin {
    fn drop(&mut self) {
        self.poll.readers_spinning.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spins_after_traffic_then_sleeps_until_the_next() {
        // A window long enough for this thread to see the spin on a loaded machine.
        let poll = BusyPoll::new(Duration::from_millis(500), Duration::ZERO);
        let task = tokio::spawn(poll.clone().run());
        // No traffic yet: the spinner parks.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !poll.parked.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "never parked");
            tokio::task::yield_now().await;
        }
        poll.touch(4096);
        // Woken by the touch, it spins for the window, then parks again.
        while poll.parked.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "a touch did not wake it");
            tokio::task::yield_now().await;
        }
        while !poll.parked.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "never parked after the window");
            tokio::task::yield_now().await;
        }
        assert!(!poll.recent());
        // Bulk traffic neither wakes it nor keeps it spinning.
        poll.touch(BULK_BYTES);
        assert!(!poll.recent());
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            poll.parked.load(Ordering::SeqCst),
            "bulk traffic woke the spinner"
        );
        task.abort();
    }

    #[test]
    fn bulk_windows_hold_off_the_spin_until_a_quiet_window() {
        let poll = BusyPoll::new(Duration::from_micros(1000), Duration::ZERO);
        poll.touch_at(0, 4096);
        assert!(poll.recent_at(10), "small traffic spins");
        assert!(!poll.recent_at(1001), "the window passed");
        poll.touch_at(1100, BULK_BYTES);
        assert!(!poll.recent_at(1110), "bulk does not spin");
        // An acknowledgement opening the next window: the one before was bulk.
        poll.touch_at(2200, 0);
        assert!(!poll.recent_at(2210), "the window after bulk is still bulk");
        // The next window follows one that carried nothing but that ack.
        poll.touch_at(3300, 0);
        assert!(
            poll.recent_at(3310),
            "a quiet window after bulk spins again"
        );
        // After a long silence the last window counts for nothing.
        poll.touch_at(4400, BULK_BYTES);
        poll.touch_at(9000, 64);
        assert!(poll.recent_at(9010));
    }

    #[tokio::test]
    async fn a_zero_window_never_spins() {
        let poll = BusyPoll::new(Duration::ZERO, Duration::ZERO);
        poll.touch(0);
        assert!(!poll.enabled());
        assert!(!poll.reader_spin_on());
        // Returns at once instead of looping.
        tokio::time::timeout(Duration::from_secs(10), poll.run())
            .await
            .expect("a zero window spun");
    }

    /// Readers alone: traffic is counted (in 1 ms windows), the runtime
    /// spinner does not run, and readers spin except while traffic is bulk.
    #[tokio::test]
    async fn reader_spin_alone_counts_traffic_and_stops_for_bulk() {
        let spin = Duration::from_micros(50);
        let poll = BusyPoll::new(Duration::ZERO, spin);
        assert!(poll.enabled() && !poll.runtime_spin());
        tokio::time::timeout(Duration::from_secs(10), poll.clone().run())
            .await
            .expect("the runtime spinner ran");
        assert_eq!(poll.reader_spin().map(|t| t.length), Some(spin));
        let now = poll.now_us();
        poll.touch_at(now, BULK_BYTES);
        assert!(poll.reader_spin().is_none(), "bulk traffic: no reader spin");
        // Two quiet windows later small traffic spins again.
        poll.touch_at(now + 3000, 4096);
        assert!(poll.reader_spin_on());
        // At most the cap at once; a ticket dropped makes room.
        let tickets: Vec<ReaderSpin> = std::iter::from_fn(|| poll.reader_spin())
            .take(1000)
            .collect();
        assert_eq!(tickets.len(), poll.max_readers_spinning);
        drop(tickets);
        assert!(poll.reader_spin().is_some());
    }

    #[test]
    fn a_quarter_of_the_cpus_may_spin_readers_at_once() {
        assert_eq!(max_readers_spinning(1), 1);
        assert_eq!(max_readers_spinning(4), 1);
        assert_eq!(max_readers_spinning(16), 4);
        assert_eq!(max_readers_spinning(64), 16);
    }
}
