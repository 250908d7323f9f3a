//! Both ends of the submission/completion ring (layout and codecs in
//! `kvrail_core::ring`): [`WorkerRing`] is the worker's, [`SidecarRing`] the
//! sidecar's. Each index has one writer; slots are copied in and out whole, so
//! a side never decodes bytes the other side may still be rewriting.
//!
//! Doorbells: the consumer spins for a bounded time, then says it sleeps
//! (`*_SLEEPING = 1`), re-checks, and sleeps on its futex word; the producer
//! publishes its index and makes the wake system call only when it sees that
//! word set. Busy rings run without system calls.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvrail_core::ring::{
    self as layout, offset, CloseReason, Completion, RingError, RingGeometry, RingState,
    Submission, CQ_SLOT_BYTES,
};

use crate::{futex, Caller, SharedRegion, ShmError};

/// Why a ring operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RingIoError {
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Layout(#[from] RingError),
    #[error("the submission queue is full ({0} entries in flight)")]
    Full(u32),
    #[error("the ring is closed: {0}")]
    Closed(String),
    #[error("the ring was already opened by a sidecar")]
    AlreadyOpen,
}

/// The control words of a mapped ring.
struct Words<'a> {
    sq_tail: &'a AtomicU64,
    sq_head: &'a AtomicU64,
    cq_tail: &'a AtomicU64,
    cq_head: &'a AtomicU64,
    sidecar_bell: &'a AtomicU32,
    sidecar_sleeping: &'a AtomicU32,
    worker_bell: &'a AtomicU32,
    worker_sleeping: &'a AtomicU32,
    state: &'a AtomicU32,
    close_reason: &'a AtomicU32,
    cq_backlogged: &'a AtomicU64,
}

fn words(mem: &SharedRegion) -> Result<Words<'_>, ShmError> {
    Ok(Words {
        sq_tail: mem.atomic_u64(offset::SQ_TAIL)?,
        sq_head: mem.atomic_u64(offset::SQ_HEAD)?,
        cq_tail: mem.atomic_u64(offset::CQ_TAIL)?,
        cq_head: mem.atomic_u64(offset::CQ_HEAD)?,
        sidecar_bell: mem.atomic_u32(offset::SIDECAR_BELL)?,
        sidecar_sleeping: mem.atomic_u32(offset::SIDECAR_SLEEPING)?,
        worker_bell: mem.atomic_u32(offset::WORKER_BELL)?,
        worker_sleeping: mem.atomic_u32(offset::WORKER_SLEEPING)?,
        state: mem.atomic_u32(offset::STATE)?,
        close_reason: mem.atomic_u32(offset::CLOSE_REASON)?,
        cq_backlogged: mem.atomic_u64(offset::CQ_BACKLOGGED)?,
    })
}

/// Spins until `ready()` or `spin` passed; then announces sleep in
/// `sleeping`, re-checks and sleeps on `bell` (at most `sleep`). Returns
/// whether `ready()` held.
fn wait_on(
    ready: &dyn Fn() -> bool,
    bell: &AtomicU32,
    sleeping: &AtomicU32,
    spin: Duration,
    sleep: Duration,
) -> bool {
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        if ready() {
            return true;
        }
        i = i.wrapping_add(1);
        if i.is_multiple_of(64) && start.elapsed() >= spin {
            break;
        }
        std::hint::spin_loop();
    }
    // The bell is read before saying we sleep and re-checking: a producer that
    // publishes after the re-check sees `sleeping` and bumps the bell, so the
    // futex call returns at once instead of missing the wake-up.
    // `sleeping` counts sleepers, so one waking thread does not hide another.
    let seen = bell.load(Ordering::SeqCst);
    sleeping.fetch_add(1, Ordering::SeqCst);
    if ready() {
        sleeping.fetch_sub(1, Ordering::SeqCst);
        return true;
    }
    futex::wait(bell, seen, sleep);
    sleeping.fetch_sub(1, Ordering::SeqCst);
    ready()
}

fn ring_bell(bell: &AtomicU32, sleeping: &AtomicU32) {
    if sleeping.load(Ordering::SeqCst) != 0 {
        bell.fetch_add(1, Ordering::SeqCst);
        futex::wake(bell);
    }
}

fn closed_reason(w: &Words<'_>) -> Option<String> {
    (w.state.load(Ordering::Acquire) == RingState::Closed as u32).then(|| {
        match CloseReason::from_u32(w.close_reason.load(Ordering::Acquire)) {
            Some(r) => r.to_string(),
            None => "closed by the sidecar".to_string(),
        }
    })
}

/// The worker's end: creates the ring file, submits, reads completions.
/// Submissions and completions each take their own lock, so one thread may
/// submit while another waits for completions.
pub struct WorkerRing {
    mem: SharedRegion,
    geometry: RingGeometry,
    /// The next submission index (the worker is the only producer).
    sq_tail: Mutex<(u64, Vec<u8>)>,
    /// The next completion index to read.
    cq_head: Mutex<(u64, Vec<u8>)>,
}

impl WorkerRing {
    /// Creates the ring file (mode 0600, see [`SharedRegion::create`]) and
    /// writes its header.
    pub fn create(path: impl AsRef<Path>, geometry: RingGeometry) -> Result<Self, RingIoError> {
        let mem = SharedRegion::create(path, geometry.total_bytes())?;
        mem.write_at(0, &geometry.encode_header())?;
        Ok(Self {
            sq_tail: Mutex::new((0, vec![0; geometry.sq_slot_bytes as usize])),
            cq_head: Mutex::new((0, vec![0; CQ_SLOT_BYTES as usize])),
            mem,
            geometry,
        })
    }

    pub fn path(&self) -> &Path {
        self.mem.path()
    }

    pub fn geometry(&self) -> RingGeometry {
        self.geometry
    }

    /// Why the sidecar closed the ring, if it did.
    pub fn closed(&self) -> Option<String> {
        words(&self.mem).ok().and_then(|w| closed_reason(&w))
    }

    /// Whether a sidecar serves the ring now.
    pub fn is_open(&self) -> bool {
        words(&self.mem)
            .map(|w| w.state.load(Ordering::Acquire) == RingState::Open as u32)
            .unwrap_or(false)
    }

    /// Completions the sidecar had to hold back because the CQ was full.
    pub fn backlogged(&self) -> u64 {
        words(&self.mem)
            .map(|w| w.cq_backlogged.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// Writes one submission and publishes it; wakes the sidecar only if it
    /// sleeps. Never blocks: a full queue is [`RingIoError::Full`].
    pub fn submit(&self, s: &Submission) -> Result<(), RingIoError> {
        let w = words(&self.mem)?;
        if let Some(why) = closed_reason(&w) {
            return Err(RingIoError::Closed(why));
        }
        let mut guard = self.sq_tail.lock().unwrap_or_else(|e| e.into_inner());
        let (tail, buf) = &mut *guard;
        let head = w.sq_head.load(Ordering::Acquire);
        if !layout::has_room(head, *tail, self.geometry.sq_entries) {
            return Err(RingIoError::Full(self.geometry.sq_entries));
        }
        s.encode(buf)?;
        // Only the bytes the submission uses: the sidecar reads no further.
        let used = s.encoded_len().min(buf.len());
        self.mem
            .write_at(self.geometry.sq_slot_offset(*tail), &buf[..used])?;
        *tail += 1;
        w.sq_tail.store(*tail, Ordering::SeqCst);
        ring_bell(w.sidecar_bell, w.sidecar_sleeping);
        Ok(())
    }

    /// The next completion, if one is published.
    pub fn poll(&self) -> Result<Option<Completion>, RingIoError> {
        let w = words(&self.mem)?;
        let mut guard = self.cq_head.lock().unwrap_or_else(|e| e.into_inner());
        let (head, buf) = &mut *guard;
        let tail = w.cq_tail.load(Ordering::Acquire);
        match layout::available(*head, tail, self.geometry.cq_entries) {
            Some(0) => return Ok(None),
            Some(_) => {}
            None => {
                return Err(RingError::Corrupt(format!(
                    "completion tail {tail} is not within one ring of head {head}"
                ))
                .into())
            }
        }
        self.mem.read_at(self.geometry.cq_slot_offset(*head), buf)?;
        *head += 1;
        w.cq_head.store(*head, Ordering::Release);
        Ok(Some(Completion::decode(buf)?))
    }

    /// Waits for the next completion: spins for `spin`, then sleeps until the
    /// sidecar publishes one, the ring closes, or `timeout` passes (`None`).
    pub fn wait(
        &self,
        spin: Duration,
        timeout: Duration,
    ) -> Result<Option<Completion>, RingIoError> {
        let deadline = Instant::now() + timeout;
        let w = words(&self.mem)?;
        loop {
            if let Some(c) = self.poll()? {
                return Ok(Some(c));
            }
            if let Some(why) = closed_reason(&w) {
                return Err(RingIoError::Closed(why));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let head = self.cq_head.lock().unwrap_or_else(|e| e.into_inner()).0;
            // SeqCst: ordered after the store that says we sleep (aarch64 too).
            let ready = || {
                w.cq_tail.load(Ordering::SeqCst) != head
                    || w.state.load(Ordering::SeqCst) == RingState::Closed as u32
            };
            wait_on(
                &ready,
                w.worker_bell,
                w.worker_sleeping,
                spin.min(deadline - now),
                (deadline - now).min(Duration::from_millis(100)),
            );
        }
    }

    /// Marks the ring closed from the worker's side, for when the sidecar
    /// went away without closing it: whoever waits or submits is told why.
    /// A reason the sidecar already wrote is kept.
    pub fn mark_closed(&self, reason: CloseReason) {
        if let Ok(w) = words(&self.mem) {
            // The sidecar is gone, so nobody else writes these words now.
            if w.state.load(Ordering::SeqCst) != RingState::Closed as u32 {
                w.close_reason.store(reason as u32, Ordering::SeqCst);
                w.state.store(RingState::Closed as u32, Ordering::SeqCst);
            }
            w.worker_bell.fetch_add(1, Ordering::SeqCst);
            futex::wake(w.worker_bell);
        }
    }

    /// Unlinks the ring file (the mappings stay valid).
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(self.mem.path());
    }
}

/// What the sidecar found in the submission queue.
#[derive(Debug)]
pub enum Next {
    Empty,
    Submission(Submission),
    /// A slot that does not decode; the user data is the worker's tag, if
    /// readable.
    Corrupt(u64, RingError),
    /// The worker broke the index protocol: the ring must be closed.
    Overrun(CloseReason),
}

/// Ring files this process serves, by (device, inode): a ring is served
/// once at a time, whatever its state word says (the worker owns that word
/// and could set it back to "created" to have the same ring opened twice,
/// each opening then reading the same submissions).
static SERVED_RINGS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// This process's claim on serving one ring file; given back when dropped.
struct RingClaim((u64, u64));

impl RingClaim {
    fn take(identity: (u64, u64)) -> Result<Self, RingIoError> {
        let mut served = SERVED_RINGS.lock().unwrap_or_else(|e| e.into_inner());
        if served.contains(&identity) {
            return Err(RingIoError::AlreadyOpen);
        }
        served.push(identity);
        Ok(RingClaim(identity))
    }
}

impl Drop for RingClaim {
    fn drop(&mut self) {
        let mut served = SERVED_RINGS.lock().unwrap_or_else(|e| e.into_inner());
        served.retain(|i| *i != self.0);
    }
}

/// The sidecar's end of a worker's ring.
pub struct SidecarRing {
    _claim: RingClaim,
    mem: SharedRegion,
    geometry: RingGeometry,
    /// Next submission index to read (the sidecar's own copy: the shared one
    /// is only ever written from it, so a worker scribbling on `sq_head`
    /// cannot make us read a slot twice or skip one).
    sq_head: Mutex<(u64, Vec<u8>)>,
    /// Next completion index to write, same reasoning.
    cq_tail: Mutex<(u64, Vec<u8>)>,
}

impl SidecarRing {
    /// Maps a worker's ring file under the region registration policy (the
    /// caller's own tmpfs file), checks its header and claims it.
    pub fn open(path: impl AsRef<Path>, caller: Caller) -> Result<Self, RingIoError> {
        // No more than the largest ring is mapped: a sparse file of many TiB
        // would otherwise take the daemon's address space.
        let mem =
            SharedRegion::open_registered_within(path, caller, RingGeometry::MAX_TOTAL_BYTES)?;
        let identity = mem.identity().map_err(|source| ShmError::Open {
            path: mem.path().to_path_buf(),
            source,
        })?;
        let claim = RingClaim::take(identity)?;
        let mut header = [0u8; 28];
        mem.read_at(0, &mut header)?;
        let geometry = RingGeometry::decode_header(&header, mem.len())?;
        let w = words(&mem)?;
        if w.state
            .compare_exchange(
                RingState::Created as u32,
                RingState::Open as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return Err(RingIoError::AlreadyOpen);
        }
        // A fresh ring starts at 0: indices the worker preset could only
        // make the sidecar's own counters overflow.
        let indices = [&w.sq_tail, &w.sq_head, &w.cq_tail, &w.cq_head];
        if indices.iter().any(|i| i.load(Ordering::Acquire) != 0) {
            w.state.store(RingState::Created as u32, Ordering::Release);
            return Err(RingError::Geometry("a new ring's indices must be 0".into()).into());
        }
        let (sq_head, cq_tail) = (0, 0);
        Ok(Self {
            _claim: claim,
            sq_head: Mutex::new((sq_head, vec![0; geometry.sq_slot_bytes as usize])),
            cq_tail: Mutex::new((cq_tail, vec![0; CQ_SLOT_BYTES as usize])),
            mem,
            geometry,
        })
    }

    pub fn geometry(&self) -> RingGeometry {
        self.geometry
    }

    pub fn bytes(&self) -> u64 {
        self.mem.len()
    }

    /// Whether the worker truncated the file under the mapping.
    pub fn is_damaged(&self) -> bool {
        self.mem.is_poisoned()
            || self
                .mem
                .check_intact(0, self.geometry.total_bytes())
                .is_err()
    }

    /// Whether the header still says what it said at open time.
    pub fn header_intact(&self) -> bool {
        let mut header = [0u8; 28];
        self.mem.read_at(0, &mut header).is_ok() && header == self.geometry.encode_header()
    }

    /// Reads the next published submission.
    pub fn next(&self) -> Next {
        let Ok(w) = words(&self.mem) else {
            return Next::Overrun(CloseReason::Truncated);
        };
        let mut guard = self.sq_head.lock().unwrap_or_else(|e| e.into_inner());
        let (head, buf) = &mut *guard;
        let tail = w.sq_tail.load(Ordering::Acquire);
        match layout::available(*head, tail, self.geometry.sq_entries) {
            Some(0) => return Next::Empty,
            Some(_) => {}
            None => return Next::Overrun(CloseReason::SubmissionOverrun),
        }
        // The slot's used bytes only (a 4 KiB slot holds a few hundred):
        // the fixed part, then the runs and generations it counts. Bytes of
        // `buf` past them are an older slot's, which decode does not read.
        let slot = self.geometry.sq_slot_offset(*head);
        let fixed = Submission::FIXED_BYTES.min(buf.len());
        if self.mem.read_at(slot, &mut buf[..fixed]).is_err() {
            return Next::Overrun(CloseReason::Truncated);
        }
        let used = Submission::bytes_used(&buf[..fixed]).clamp(fixed, buf.len());
        if self
            .mem
            .read_at(slot + fixed as u64, &mut buf[fixed..used])
            .is_err()
        {
            return Next::Overrun(CloseReason::Truncated);
        }
        *head += 1;
        w.sq_head.store(*head, Ordering::Release);
        match Submission::decode(buf) {
            Ok(s) => Next::Submission(s),
            Err((user_data, e)) => Next::Corrupt(user_data, e),
        }
    }

    /// Whether a submission is waiting.
    pub fn has_submissions(&self) -> bool {
        let head = self.sq_head.lock().unwrap_or_else(|e| e.into_inner()).0;
        words(&self.mem)
            .map(|w| w.sq_tail.load(Ordering::SeqCst) != head)
            .unwrap_or(true)
    }

    /// Publishes one completion if the CQ has room (`Ok(false)`: full, keep it
    /// for later). Wakes the worker if it sleeps.
    pub fn complete(&self, c: &Completion) -> Result<bool, RingIoError> {
        let w = words(&self.mem)?;
        let mut guard = self.cq_tail.lock().unwrap_or_else(|e| e.into_inner());
        let (tail, buf) = &mut *guard;
        let head = w.cq_head.load(Ordering::Acquire);
        if layout::available(head, *tail, self.geometry.cq_entries).is_none() {
            return Err(RingIoError::Closed(
                CloseReason::CompletionOverrun.to_string(),
            ));
        }
        if !layout::has_room(head, *tail, self.geometry.cq_entries) {
            return Ok(false);
        }
        c.encode(buf)?;
        self.mem
            .write_at(self.geometry.cq_slot_offset(*tail), buf)?;
        *tail += 1;
        w.cq_tail.store(*tail, Ordering::SeqCst);
        ring_bell(w.worker_bell, w.worker_sleeping);
        Ok(true)
    }

    /// Records how many completions wait in the sidecar for CQ room.
    pub fn set_backlogged(&self, n: u64) {
        if let Ok(w) = words(&self.mem) {
            w.cq_backlogged.store(n, Ordering::Relaxed);
        }
    }

    /// Waits for a submission: spins for `spin`, then sleeps on the bell for
    /// at most `sleep`. Returns whether one is waiting.
    pub fn wait(&self, spin: Duration, sleep: Duration, stop: &AtomicBool) -> bool {
        let Ok(w) = words(&self.mem) else {
            return true;
        };
        wait_on(
            &|| self.has_submissions() || stop.load(Ordering::SeqCst),
            w.sidecar_bell,
            w.sidecar_sleeping,
            spin,
            sleep,
        )
    }

    /// Wakes the sidecar's own service thread (to notice a close).
    pub fn wake_service(&self) {
        if let Ok(w) = words(&self.mem) {
            w.sidecar_bell.fetch_add(1, Ordering::SeqCst);
            futex::wake(w.sidecar_bell);
        }
    }

    /// Marks the ring closed with `reason` and wakes a sleeping worker.
    pub fn close(&self, reason: CloseReason) {
        if let Ok(w) = words(&self.mem) {
            w.close_reason.store(reason as u32, Ordering::Release);
            w.state.store(RingState::Closed as u32, Ordering::SeqCst);
            w.worker_bell.fetch_add(1, Ordering::SeqCst);
            futex::wake(w.worker_bell);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrail_core::ring::{CompletionKind, RingBlocks, RingOp};

    fn sub(n: u64) -> Submission {
        Submission {
            op: RingOp::Push,
            user_data: n,
            peer: "decode".into(),
            request_id: format!("r{n}"),
            source: RingBlocks::from_ids(1, 0..1, &[n as u32], Vec::new()),
            destination: RingBlocks::from_ids(2, 0..1, &[n as u32], Vec::new()),
        }
    }

    fn done(n: u64) -> Completion {
        Completion {
            kind: CompletionKind::Accepted,
            failure_side: 0,
            user_data: n,
            transfer_id: n,
            region_id: 0,
            bytes: 0,
            elapsed_us: 0,
            sequence: 0,
            incarnation: 0,
            request_id: format!("r{n}"),
            peer: "decode".into(),
            code: String::new(),
            message: String::new(),
        }
    }

    fn path(name: &str) -> std::path::PathBuf {
        let dir = if Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("kvrail-ring-test-{name}-{}", std::process::id()))
    }

    /// A ring created by a worker and opened by a sidecar, its file unlinked.
    fn served(p: &Path, g: RingGeometry) -> (WorkerRing, SidecarRing) {
        let worker = WorkerRing::create(p, g).unwrap();
        let sidecar = SidecarRing::open(p, Caller { uid: None }).unwrap();
        worker.unlink();
        (worker, sidecar)
    }

    /// The worker owns the state word: setting it back to "created" on a
    /// ring being served must not have it served twice (each serving read
    /// the same submissions: one submission started two transfers).
    #[test]
    fn a_ring_being_served_cannot_be_opened_again() {
        let p = path("twice");
        let g = RingGeometry::new(8, 8, 1024).unwrap();
        let worker = WorkerRing::create(&p, g).unwrap();
        let first = SidecarRing::open(&p, Caller { uid: None }).unwrap();
        let w = words(&worker.mem).unwrap();
        w.state.store(RingState::Created as u32, Ordering::Release);
        assert!(matches!(
            SidecarRing::open(&p, Caller { uid: None }),
            Err(RingIoError::AlreadyOpen)
        ));
        // Once the first is gone, the (reset) ring may be served again.
        drop(first);
        w.state.store(RingState::Created as u32, Ordering::Release);
        SidecarRing::open(&p, Caller { uid: None }).unwrap();
        worker.unlink();
    }

    #[test]
    fn submissions_and_completions_cross_between_threads_in_order() {
        let p = path("order");
        let g = RingGeometry::new(8, 8, 1024).unwrap();
        let (worker, sidecar) = served(&p, g);
        assert!(matches!(
            SidecarRing::open(&p, Caller { uid: None }),
            Err(RingIoError::Shm(_))
        ));
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut seen = 0;
                while seen < 1000 {
                    let stop = AtomicBool::new(false);
                    if !sidecar.wait(Duration::from_micros(20), Duration::from_secs(5), &stop) {
                        continue;
                    }
                    match sidecar.next() {
                        Next::Submission(sub) => {
                            assert_eq!(sub.user_data, seen);
                            while !sidecar.complete(&done(seen)).unwrap() {
                                std::thread::yield_now();
                            }
                            seen += 1;
                        }
                        Next::Empty => {}
                        other => panic!("{other:?}"),
                    }
                }
            });
            let mut next_done = 0;
            for n in 0..1000 {
                loop {
                    match worker.submit(&sub(n)) {
                        Ok(()) => break,
                        Err(RingIoError::Full(8)) => {
                            let c = worker
                                .wait(Duration::from_micros(10), Duration::from_secs(5))
                                .unwrap()
                                .unwrap();
                            assert_eq!(c.user_data, next_done);
                            next_done += 1;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            while next_done < 1000 {
                let c = worker
                    .wait(Duration::from_micros(10), Duration::from_secs(5))
                    .unwrap()
                    .unwrap();
                assert_eq!(c.user_data, next_done);
                next_done += 1;
            }
        });
    }

    /// A ring file grown to many TiB (sparse on tmpfs, so it costs the
    /// worker nothing) is mapped no further than the largest ring.
    #[test]
    fn a_huge_ring_file_maps_no_more_than_the_largest_ring() {
        let p = path("huge");
        let g = RingGeometry::new(8, 8, 1024).unwrap();
        let worker = WorkerRing::create(&p, g).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(64 << 40)
            .unwrap();
        let sidecar = SidecarRing::open(&p, Caller { uid: None }).unwrap();
        assert_eq!(sidecar.mem.len(), RingGeometry::MAX_TOTAL_BYTES);
        drop((sidecar, worker));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn an_overrun_and_a_corrupt_slot_are_reported_not_read() {
        let p = path("overrun");
        let g = RingGeometry::new(4, 4, 512).unwrap();
        let (worker, sidecar) = served(&p, g);
        worker.submit(&sub(1)).unwrap();
        // Scribble over the published slot: a corrupt submission, not a crash.
        worker
            .mem
            .write_at(g.sq_slot_offset(0), &[0xff; 8])
            .unwrap();
        assert!(matches!(
            sidecar.next(),
            Next::Corrupt(_, RingError::Corrupt(_))
        ));
        // A tail moved five ahead of a four-entry ring.
        worker
            .mem
            .atomic_u64(offset::SQ_TAIL)
            .unwrap()
            .store(6, Ordering::SeqCst);
        assert!(matches!(
            sidecar.next(),
            Next::Overrun(CloseReason::SubmissionOverrun)
        ));
        sidecar.close(CloseReason::SubmissionOverrun);
        assert!(matches!(
            worker.submit(&sub(2)),
            Err(RingIoError::Closed(_))
        ));
        assert!(matches!(
            worker.wait(Duration::ZERO, Duration::from_secs(1)),
            Err(RingIoError::Closed(_))
        ));
    }

    /// The sidecar copies only the bytes a slot's counts say it uses: a
    /// small submission after a large one in the same slot (the large one's
    /// runs still behind it) reads back exactly, and a slot whose counts
    /// claim more than the slot holds is refused, not read past.
    #[test]
    fn a_slot_is_read_as_far_as_its_counts_and_no_further() {
        let p = path("used");
        let g = RingGeometry::new(2, 4, 1024).unwrap();
        let (worker, sidecar) = served(&p, g);
        let ids: Vec<u32> = (0..180).step_by(2).collect();
        let gens: Vec<u64> = ids.iter().map(|&i| u64::from(i) + 7).collect();
        let large = Submission {
            source: RingBlocks::from_ids(1, 0..2, &ids[..30], gens[..30].to_vec()),
            destination: RingBlocks::from_ids(2, 0..2, &ids[..30], Vec::new()),
            ..sub(1)
        };
        assert!(large.encoded_len() > 900, "{}", large.encoded_len());
        // The third lands in the first's slot.
        for s in [large, sub(9), sub(2)] {
            worker.submit(&s).unwrap();
            match sidecar.next() {
                Next::Submission(got) => assert_eq!(got, s),
                other => panic!("{other:?}"),
            }
        }
        // Counts for 100 runs in a 1 KiB slot: refused from the fixed part.
        worker.submit(&sub(3)).unwrap();
        worker
            .mem
            .write_at(g.sq_slot_offset(3) + 4, &100u16.to_le_bytes())
            .unwrap();
        match sidecar.next() {
            Next::Corrupt(3, RingError::Corrupt(why)) => {
                assert!(why.contains("the slot has 1024"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_full_completion_queue_holds_back_instead_of_overwriting() {
        let p = path("cqfull");
        let g = RingGeometry::new(4, 4, 512).unwrap();
        let (worker, sidecar) = served(&p, g);
        for n in 0..4 {
            assert!(sidecar.complete(&done(n)).unwrap());
        }
        assert!(!sidecar.complete(&done(4)).unwrap());
        assert_eq!(worker.poll().unwrap().unwrap().user_data, 0);
        assert!(sidecar.complete(&done(4)).unwrap());
        // A worker that moves cq_head past the tail broke the protocol.
        worker
            .mem
            .atomic_u64(offset::CQ_HEAD)
            .unwrap()
            .store(99, Ordering::SeqCst);
        assert!(matches!(
            sidecar.complete(&done(5)),
            Err(RingIoError::Closed(_))
        ));
    }
}
