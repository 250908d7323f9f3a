//! Small frames written by the thread that produced them.
//!
//! A transfer started from a worker's ring runs on the ring's own thread,
//! outside the tokio runtime. Handing its frames to the connection's writer
//! task costs a cross-thread wake-up (a parked runtime worker, then the
//! task) before the first byte leaves. When the connection's writer is idle
//! (nothing queued, nothing being written) the ring thread writes a small
//! transfer's frames itself, without waiting: whatever the socket does not
//! take at once goes to the writer task as one piece, so the stream keeps
//! its order.
//!
//! A connection's reader task writes inline only batches of control frames
//! (a receiver's Complete or acknowledgement, a grant), and only when no
//! further input waits on its connection: waking the writer task for one
//! small frame made the runtime wake a second, parked worker to look for
//! work (`perf sched` on two cores: 1.5 cross-worker wake-ups per 4 KiB push
//! in the receiving sidecar, none with inline control writes). Slices from
//! runtime tasks always go to the writer task, which gathers them into large
//! writes.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvrail_transport::InlineWrite;
use tokio::sync::mpsc;

use super::frames::{io_slices, Outgoing};
use crate::metrics as m;

/// Largest batch (frame headers and payload) written inline: larger
/// transfers are bandwidth-bound and better left to the writer task.
pub(super) const INLINE_WRITE_MAX: u64 = 128 << 10;

thread_local! {
    static INLINE_WRITES: Cell<bool> = const { Cell::new(false) };
    static INLINE_CONTROL: Cell<bool> = const { Cell::new(false) };
}

/// Whether link work done on this thread may write small frames inline (a
/// ring's thread, which is not a runtime worker, while it has no further
/// submission waiting: with more behind it, the writer task writes this one
/// while the thread starts the next, and gathers several into one write).
pub fn set_inline_writes_on_this_thread(allowed: bool) {
    INLINE_WRITES.with(|c| c.set(allowed));
}

fn inline_allowed_here() -> bool {
    INLINE_WRITES.with(Cell::get)
}

/// Runs `f` (a reader's synchronous session work) with inline control
/// writes allowed on this thread when `allowed`: the reader has no further
/// input waiting (as far as `input_pending` can tell: a stale readiness
/// flag or a spent task budget reads as "nothing waiting", which costs only
/// batching). With more behind it, its replies go to the writer task, which
/// gathers those of a burst into one write.
pub(super) fn with_inline_control<R>(allowed: bool, f: impl FnOnce() -> R) -> R {
    /// Clears the flag however `f` ends (a runtime worker runs other tasks next).
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            INLINE_CONTROL.with(|c| c.set(false));
        }
    }
    INLINE_CONTROL.with(|c| c.set(allowed));
    let _reset = Reset;
    f()
}

fn inline_control_allowed_here() -> bool {
    INLINE_CONTROL.with(Cell::get)
}

/// What a caller's context allows its frames: the one choice `pump` reads
/// from the thread it runs on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Writes {
    /// Small batches inline when the writer is idle (a ring's thread).
    Inline,
    /// Batches of control frames alone inline (a reader with nothing more
    /// waiting, where the sidecar allows it).
    InlineControl,
    /// Everything to the writer task (runtime tasks).
    Queue,
}

impl Writes {
    pub(super) fn here(control_writes_allowed: bool) -> Self {
        if inline_allowed_here() {
            Writes::Inline
        } else if control_writes_allowed && inline_control_allowed_here() {
            Writes::InlineControl
        } else {
            Writes::Queue
        }
    }
}

/// A stream connection's way in: its writer task's queue, and its socket
/// for inline writes.
pub(super) struct StreamSink {
    pub(super) tx: mpsc::UnboundedSender<Outgoing>,
    /// Frames handed to the writer task and not yet written: the task lowers
    /// it only when it has written everything it took and waits for more, so
    /// zero means nothing is queued or being written.
    pub(super) queued: Arc<AtomicU64>,
    pub(super) inline: Option<Arc<dyn InlineWrite>>,
    pub(super) counters: m::ConnCounters,
    /// Registered only where inline writes can happen.
    pub(super) inline_writes: Option<metrics::Counter>,
}

impl StreamSink {
    /// Hands a frame to the writer task; false if the task is gone.
    pub(super) fn queue(&self, out: Outgoing) -> bool {
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(out).is_ok()
    }

    /// Sends one connection's batch as `writes` allows.
    pub(super) fn send(&self, frames: Vec<Outgoing>, writes: Writes) {
        let inline = match writes {
            Writes::Inline => true,
            Writes::InlineControl => frames.iter().all(|f| matches!(f, Outgoing::Control(_))),
            Writes::Queue => false,
        };
        if inline {
            self.write_or_queue(frames);
        } else {
            self.queue_all(frames);
        }
    }

    /// Writes `frames` now if the writer is idle and they are small, else
    /// queues them.
    ///
    /// Callers hold the link's lock, the only place frames are queued from,
    /// so no frame can be queued between the idle check and the write.
    fn write_or_queue(&self, frames: Vec<Outgoing>) {
        let Some(inline) = self.inline.as_ref().filter(|_| self.idle()) else {
            return self.queue_all(frames);
        };
        if !inline_size_fits(&frames) {
            return self.queue_all(frames);
        }
        let Ok(bufs) = io_slices(&frames) else {
            // The writer task fails what cannot be gathered.
            return self.queue_all(frames);
        };
        let bufs_len: usize = bufs.iter().map(|b| b.len()).sum();
        // Any failure (the socket full, a fault on a truncated file, a broken
        // connection) leaves it to the writer task, which handles each.
        crate::trace_points::mark(crate::trace_points::INLINE_WRITE);
        let written: usize = inline.try_write_vectored(&bufs).unwrap_or_default();
        crate::trace_points::mark(crate::trace_points::INLINE_WRITTEN);
        if written == 0 {
            drop(bufs);
            return self.queue_all(frames);
        }
        let payload = frames.iter().map(Outgoing::payload_len).sum();
        let slices = frames
            .iter()
            .filter(|o| matches!(o, Outgoing::Slice { .. }))
            .count() as u64;
        if written < bufs_len {
            // The rest goes next, as bytes: the stream is mid-frame.
            let mut rest = Vec::with_capacity(bufs_len - written);
            let mut skip = written;
            for b in &bufs {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                rest.extend_from_slice(&b[skip..]);
                skip = 0;
            }
            self.queue(Outgoing::Control(rest.into()));
        }
        if let Some(c) = &self.inline_writes {
            c.increment(1);
        }
        if slices > 0 {
            self.counters.bytes_sent.increment(payload);
            self.counters.slices_sent.increment(slices);
        }
    }

    fn idle(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0
    }

    /// Frames handed to the writer task and not yet written.
    pub(super) fn unwritten(&self) -> u64 {
        self.queued.load(Ordering::Acquire)
    }

    pub(super) fn queue_all(&self, frames: Vec<Outgoing>) {
        for out in frames {
            // A closed channel means the writer died; its reader reports the loss.
            let _ = self.queue(out);
        }
    }
}

/// Whether `frames` may go inline: small, from guarded host memory, none of
/// a failed transfer or a truncated file (the writer task deals with those).
fn inline_size_fits(frames: &[Outgoing]) -> bool {
    let mut total = 0u64;
    for out in frames {
        total += match out {
            Outgoing::Control(bytes) => bytes.len() as u64,
            Outgoing::Slice { header, region, .. } => {
                // A partial write copies the rest out of the region: only
                // from a mapping the guard covers (a truncated file's fault
                // then reads zeros instead of killing the daemon).
                if out.abandoned()
                    || !region.memory.shared_host().is_some_and(|h| h.is_guarded())
                    || out.truncated_source().is_some()
                {
                    return false;
                }
                header.len() as u64 + out.payload_len()
            }
        };
        if total > INLINE_WRITE_MAX {
            return false;
        }
    }
    true
}
