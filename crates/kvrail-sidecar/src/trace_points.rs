//! Timestamps at named points of the data path (the `profile` feature), for
//! finding where a small push's microseconds go across processes: with
//! `KVRAIL_TRACE=PATH`, each process records `(point, wall-clock ns, thread)`
//! and writes `PATH.PID.trace` (one `point ns thread` per line) at shutdown.
//! Without the feature every mark compiles to nothing.
//! `tools/bench/trace_stages.py` turns a run's files into per-stage
//! percentiles (docs/benchmarks.md).

// The points, numbered as they appear in the trace files.
/// A ring's thread took a submission off the ring.
pub const RING_SUBMISSION: u8 = 1;
/// A ring's thread writes frames inline, and has written them.
pub const INLINE_WRITE: u8 = 2;
pub const INLINE_WRITTEN: u8 = 3;
/// A reader has a frame (header, and a control message's body).
pub const FRAME_READ: u8 = 10;
/// A transfer's end reaches the daemon (`Shared::on_event`).
pub const TRANSFER_END: u8 = 11;
/// A completion goes into a worker's ring, and is written (its bell rung).
pub const RING_COMPLETION: u8 = 12;
pub const RING_COMPLETION_WRITTEN: u8 = 13;
/// loadgen's latency bench: a push submitted, its notification read.
pub const BENCH_SUBMIT: u8 = 20;
pub const BENCH_NOTIFIED: u8 = 21;
/// `start_transfer`: validated and planned, the link found, the transfer
/// recorded, the link locked, the session's start done.
pub const START_CHECKED: u8 = 30;
pub const START_LINK_FOUND: u8 = 31;
pub const START_RECORDED: u8 = 32;
pub const START_LOCKED: u8 = 33;
pub const START_SESSION_DONE: u8 = 34;
/// The link's pump polls the session's frames, and has gathered them.
pub const PUMP_TRANSMIT: u8 = 35;
pub const PUMP_GATHERED: u8 = 36;
/// A reader has a data frame's header; the open before it is settled; the
/// transfer's gate is learnt; the payload read starts, ends, is checked.
pub const SLICE_HEADER: u8 = 40;
pub const SLICE_OPEN_SETTLED: u8 = 41;
pub const SLICE_GATE_LEARNED: u8 = 42;
pub const SLICE_PAYLOAD_READ: u8 = 43;
pub const SLICE_CHECKED: u8 = 44;
pub const SLICE_PAYLOAD_START: u8 = 45;
/// A writer task woke for queued frames, starts a write, has written it.
pub const WRITER_WOKE: u8 = 60;
pub const WRITER_WRITE: u8 = 61;
pub const WRITER_WRITTEN: u8 = 62;

/// Time sums (`Stopwatch::account`), written beside the marks as `PATH.PID.sums`, one
/// `slot count nanoseconds` per line: a writer task waiting for its next
/// frames, for a staged slice's device copy, writing host frames, writing
/// staged ones; a reader reading a staged payload, taking a staging buffer;
/// a received slice's host-to-device copy (submission to completion seen)
/// and its submission call alone.
pub const SUM_WRITER_IDLE: usize = 0;
pub const SUM_WRITER_COPY_WAIT: usize = 1;
pub const SUM_WRITER_WRITE: usize = 2;
pub const SUM_READER_STAGED_READ: usize = 3;
pub const SUM_READER_POOL_TAKE: usize = 4;
pub const SUM_TO_DEVICE: usize = 5;
pub const SUM_WRITER_STAGED_WRITE: usize = 6;
pub const SUM_TO_DEVICE_SUBMIT: usize = 7;
#[cfg(feature = "profile")]
const SUMS: usize = 8;

#[cfg(feature = "profile")]
mod imp {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    const CAPACITY: usize = 1 << 20;
    static ON: AtomicBool = AtomicBool::new(false);
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static MARKS: [AtomicU64; CAPACITY] = [const { AtomicU64::new(0) }; CAPACITY];

    pub fn start_from_env() {
        ON.store(
            std::env::var_os("KVRAIL_TRACE").is_some(),
            Ordering::Relaxed,
        );
    }

    #[inline]
    pub fn mark(point: u8) {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if i < CAPACITY {
            // The wall clock: the same in every process of the machine.
            let ns = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            MARKS[i].store(
                (u64::from(point) << 56) | (thread_index() << 48) | (ns & NS_MASK),
                Ordering::Relaxed,
            );
        }
    }

    /// The low 48 bits of the wall clock's nanoseconds (about 78 hours):
    /// enough to order one run's marks across its processes.
    const NS_MASK: u64 = (1 << 48) - 1;

    /// A small number for the calling thread (in order of first mark, 255
    /// for the 255th and later), so that a trace tells threads apart.
    fn thread_index() -> u64 {
        static THREADS: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static INDEX: u64 = THREADS.fetch_add(1, Ordering::Relaxed).min(255);
        }
        INDEX.with(|i| *i)
    }

    static SUM_NS: [AtomicU64; super::SUMS] = [const { AtomicU64::new(0) }; super::SUMS];
    static SUM_COUNT: [AtomicU64; super::SUMS] = [const { AtomicU64::new(0) }; super::SUMS];

    #[inline]
    pub fn account(slot: usize, spent: std::time::Duration) {
        if ON.load(Ordering::Relaxed) && slot < super::SUMS {
            SUM_NS[slot].fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
            SUM_COUNT[slot].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn write() {
        let Some(path) = std::env::var_os("KVRAIL_TRACE") else {
            return;
        };
        let sums: String = (0..super::SUMS)
            .map(|i| {
                format!(
                    "{i} {} {}\n",
                    SUM_COUNT[i].load(Ordering::Relaxed),
                    SUM_NS[i].load(Ordering::Relaxed)
                )
            })
            .collect();
        let _ = std::fs::write(
            format!("{}.{}.sums", path.to_string_lossy(), std::process::id()),
            sums,
        );
        let n = NEXT.load(Ordering::Relaxed).min(CAPACITY);
        let marks: String = MARKS[..n]
            .iter()
            .map(|m| {
                let v = m.load(Ordering::Relaxed);
                format!("{} {} {}\n", v >> 56, v & NS_MASK, (v >> 48) & 0xff)
            })
            .collect();
        let _ = std::fs::write(
            format!("{}.{}.trace", path.to_string_lossy(), std::process::id()),
            marks,
        );
    }
}

#[cfg(not(feature = "profile"))]
mod imp {
    pub fn start_from_env() {}
    #[inline(always)]
    pub fn mark(_point: u8) {}
    pub fn write() {}
}

pub use imp::{mark, start_from_env, write};

/// Times a stretch for the sums (`SUM_*`); without the feature it is empty
/// and reads no clock.
#[cfg(feature = "profile")]
pub struct Stopwatch(std::time::Instant);
#[cfg(not(feature = "profile"))]
pub struct Stopwatch;

impl Stopwatch {
    #[inline(always)]
    pub fn start() -> Self {
        #[cfg(feature = "profile")]
        return Stopwatch(std::time::Instant::now());
        #[cfg(not(feature = "profile"))]
        Stopwatch
    }

    /// Adds the time since `start` to sum `slot`.
    #[inline(always)]
    pub fn account(&self, slot: usize) {
        #[cfg(feature = "profile")]
        imp::account(slot, self.0.elapsed());
        #[cfg(not(feature = "profile"))]
        let _ = slot;
    }
}
