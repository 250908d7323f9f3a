//! Contains the SIGBUS a worker can cause by shrinking a file the sidecar maps.
//!
//! Pages of a `MAP_SHARED` mapping past the end of its (truncated) file raise
//! SIGBUS when touched from user space, which by default kills the process:
//! one worker's mistake would take every worker's transfers down. Copies the
//! kernel does (a socket `writev`/`readv` over the mapping) fail with EFAULT
//! instead.
//!
//! The guard: every mapping the sidecar makes is entered in a fixed table; a
//! SIGBUS handler that finds the faulting address in one of them maps a private
//! zero page over the faulting page (so the interrupted copy completes, reading
//! or writing that page), marks the mapping *poisoned* and returns. Everything
//! that moves a region's bytes checks the mark before reporting success, so the
//! transfers of that region fail with a clear reason and nothing else notices.
//! A SIGBUS at any other address gets the default action (the process dies, as
//! it would have). `touch` turns a socket call's EFAULT into the same path.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// Mappings the guard can cover at once (regions and rings of all workers).
/// With the guard installed, `SharedRegion` maps nothing past this
/// (`ShmError::GuardFull`), so every mapping of the process is covered.
pub const MAX_MAPPINGS: usize = 4096;
const SLOTS: usize = MAX_MAPPINGS;

struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    poisoned: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // the initialiser of a static array
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    poisoned: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// SIGBUS faults the handler contained, since the process started.
static CONTAINED: AtomicUsize = AtomicUsize::new(0);

/// How many SIGBUS faults the guard has contained in this process (a count
/// for tests and diagnostics).
pub fn contained_faults() -> usize {
    CONTAINED.load(Ordering::Relaxed)
}

/// Installs the process's SIGBUS handler (once). Until it is installed, a
/// truncated mapping still kills the process: the daemon installs it at start.
pub fn install() -> std::io::Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: sigaction is plain data; all-zero is a valid empty value.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        // SAFETY: sa_mask is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: installs a handler for SIGBUS; `action` is fully initialised.
        if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
            result = Err(std::io::Error::last_os_error());
        } else {
            INSTALLED.store(true, Ordering::Release);
        }
    });
    result
}

/// Whether [`install`] succeeded in this process.
/// For tests of the truncation paths: a guarded region of `len` bytes in a
/// fresh file named after `tag`, whose file is then cut to nothing and
/// unlinked, as a worker that shrinks its file under the sidecar does. Every
/// page of it faults (and reads as the guard's zero page) from now on.
#[doc(hidden)]
pub fn truncated_region(tag: &str, len: u64) -> std::io::Result<crate::SharedRegion> {
    install()?;
    let path = std::env::temp_dir().join(format!("kvrail-{tag}-{}", std::process::id()));
    let region = crate::SharedRegion::create(&path, len).map_err(std::io::Error::other)?;
    let cut = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(0));
    let _ = std::fs::remove_file(&path);
    cut?;
    Ok(region)
}

pub fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

/// Whether all of `buf` lies in one mapping the guard covers (installed, and
/// entered in the table): only then may [`touch`] read it without risking a
/// SIGBUS that kills the process.
pub fn covers(buf: &[u8]) -> bool {
    if !installed() || buf.is_empty() {
        return false;
    }
    let (lo, hi) = (buf.as_ptr() as usize, buf.as_ptr() as usize + buf.len());
    TABLE.iter().any(|slot| {
        slot.live_range()
            .is_some_and(|(start, end)| lo >= start && hi <= end)
    })
}

impl Slot {
    /// The mapping a live entry holds, `[start, end)`; None for a free slot
    /// or one being removed. Plain atomics: the SIGBUS handler calls it too.
    fn live_range(&self) -> Option<(usize, usize)> {
        let start = self.start.load(Ordering::Acquire);
        if start == 0 || start == usize::MAX {
            return None;
        }
        Some((start, self.end.load(Ordering::Acquire)))
    }
}

/// A mapping's entry in the table; freed on drop.
#[derive(Debug)]
pub struct Entry(Option<usize>);

/// Enters `[start, start+len)` in the table. `Entry(None)` when the table is
/// full: that mapping would be unguarded (a truncation kills the process, as
/// without the guard), so `SharedRegion` refuses to keep it.
pub fn enter(start: usize, len: usize) -> Entry {
    for (i, slot) in TABLE.iter().enumerate() {
        if slot
            .start
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            slot.poisoned.store(false, Ordering::Relaxed);
            slot.end.store(start + len, Ordering::Release);
            slot.start.store(start, Ordering::Release);
            return Entry(Some(i));
        }
    }
    Entry(None)
}

impl Entry {
    /// Whether a SIGBUS was contained in this mapping (its file was truncated
    /// under it): some of its pages are now private zero pages.
    pub fn poisoned(&self) -> bool {
        self.0
            .is_some_and(|i| TABLE[i].poisoned.load(Ordering::Acquire))
    }

    pub fn is_guarded(&self) -> bool {
        self.0.is_some() && installed()
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            // Out of the table before the mapping goes (the caller unmaps after).
            TABLE[i].start.store(usize::MAX, Ordering::Release);
            TABLE[i].end.store(0, Ordering::Release);
            TABLE[i].start.store(0, Ordering::Release);
        }
    }
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Only async-signal-safe work here: atomics and one mmap.
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Relaxed);
    for slot in TABLE.iter() {
        let Some((start, end)) = slot.live_range() else {
            continue;
        };
        if addr >= start && addr < end {
            let at = addr & !(page - 1);
            // SAFETY: replaces one page of a mapping this process made and still
            // holds (its entry is live) with a private zero page; the mapping's
            // owner learns of it through the poisoned mark before trusting bytes.
            let mapped = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if mapped != libc::MAP_FAILED {
                slot.poisoned.store(true, Ordering::Release);
                CONTAINED.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    // Not ours: the default action, as if no handler were installed.
    // SAFETY: signal() and raise() are async-signal-safe.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// Reads one byte of every 4 KiB page `buf` touches, from user space (a
/// buffer that does not start on a page boundary spans one page more than its
/// length says; 4 KiB steps reach every page of any larger page size too).
/// Over a truncated mapping that raises the SIGBUS the guard contains (a
/// kernel copy only said EFAULT), so a retried socket call then succeeds over
/// zero pages.
pub fn touch(buf: &[u8]) {
    const STEP: usize = 4096;
    let start = buf.as_ptr() as usize;
    let mut at = 0;
    while at < buf.len() {
        std::hint::black_box(buf[at]);
        // The first byte of the next 4 KiB page.
        at = ((start + at) / STEP + 1) * STEP - start;
    }
}

/// Tests that make the guard contain faults run one at a time (they read the
/// process-wide count).
#[cfg(test)]
pub(crate) static FAULTING_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// `covers` holds only for bytes inside one entered mapping while its
    /// entry lives (the EFAULT retries touch nothing else).
    #[test]
    fn covers_only_what_an_entry_holds() {
        install().unwrap();
        let buf = vec![1u8; 3 * 4096];
        let inner = &buf[4096..8192];
        assert!(!covers(inner), "nothing entered yet");
        let entry = enter(buf[4096..].as_ptr() as usize, 2 * 4096);
        assert!(entry.is_guarded());
        assert!(covers(inner));
        assert!(covers(&buf[8192..]));
        assert!(!covers(&buf[..8192]), "starts before the entry");
        assert!(!covers(&buf[4096..4096]), "empty");
        drop(entry);
        assert!(!covers(inner), "the entry is gone");
    }

    /// An unaligned buffer's last page is touched too (one byte every 4 KiB
    /// from its start would miss it): touching it contains one fault per page,
    /// and reading its last byte afterwards faults no more.
    #[test]
    fn touch_reaches_every_page_of_an_unaligned_buffer() {
        // The fault count is the process's: no other test may fault meanwhile.
        let _alone = FAULTING_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        // The file shrinks under the mapping: every page now faults.
        let region = truncated_region("touch", 4 * 4096).unwrap();
        assert!(region.is_guarded());
        let before = contained_faults();
        touch(region.slice(100, 4096).unwrap()); // pages 0 and 1
        assert!(region.is_poisoned());
        assert_eq!(contained_faults() - before, 2, "one fault per page");
        assert_eq!(region.slice(4195, 1).unwrap()[0], 0);
        assert_eq!(contained_faults() - before, 2, "page 1 was already touched");
    }
}
