//! Shared-memory KV regions.
//!
//! A worker creates a file on a tmpfs (normally `/dev/shm/kvrail-...`), sizes it,
//! maps it and lays its paged KV cache out inside. It registers the *path* with the
//! sidecar, which maps the same file `MAP_SHARED`: both processes then see the same
//! pages, and the sidecar moves payload straight between those pages and its sockets.
//!
//! Why a named file rather than a memfd passed with `SCM_RIGHTS`: the local API is
//! gRPC, which cannot carry file descriptors, and a path keeps the worker side a
//! one-liner in any language (Python's `mmap` included). The socket is mode 0600,
//! so only the sidecar's own user can register paths.
//!
//! Concurrency contract: the mapping is shared with another process, so Rust's
//! aliasing rules cannot be enforced across it. kvrail's protocol keeps writers
//! apart instead: a transfer writes only the destination blocks it was granted,
//! never the same block twice (the core rejects overlapping destinations), and
//! the worker does not touch those blocks until it is notified. Source blocks
//! are read until the sender is done with them, which for a zero-copy sender
//! ([`SharedRegion::shared_bytes`]) is after the write returned: the worker
//! leaves them unchanged until it is told the transfer ended, and the sidecar
//! says so only once no view of them is held.

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use bytes::Bytes;

use memmap2::MmapRaw;

pub mod futex;
pub mod guard;
pub mod ring;
pub mod stream_copy;

pub use stream_copy::copy_streaming;

/// Why a region cannot be mapped or accessed.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("offset {offset} is not {align}-byte aligned")]
    Misaligned { offset: u64, align: u64 },
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} is not a regular file")]
    NotAFile(PathBuf),
    #[error("{0} is empty")]
    Empty(PathBuf),
    /// The filesystem cannot hold the whole region (a small /dev/shm): a
    /// sparse file would map, then kill its process with SIGBUS at the first
    /// write past the free space.
    #[error("cannot reserve {len} bytes for {path}: {source} (is the filesystem large enough? `df {path}`; in docker, raise --shm-size)")]
    Reserve {
        path: PathBuf,
        len: u64,
        source: std::io::Error,
    },
    #[error("cannot size {path} to {len} bytes: {source}")]
    Resize {
        path: PathBuf,
        len: u64,
        source: std::io::Error,
    },
    #[error("cannot map {path}: {source}")]
    Map {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("range {offset}+{len} is outside the {region_len}-byte region")]
    OutOfBounds {
        offset: u64,
        len: u64,
        region_len: u64,
    },
    /// Registration policy: regions live in shared memory (tmpfs, hugetlbfs,
    /// memfd), never in a file on disk.
    #[error("{path} is not in shared memory (it is on a {fs} filesystem): create KV regions in /dev/shm or another tmpfs")]
    NotSharedMemory { path: PathBuf, fs: String },
    /// Registration policy: the path's last component may not be a symlink.
    #[error("{0} is a symbolic link: register the file itself")]
    Symlink(PathBuf),
    /// Registration policy: the path must be absolute (the sidecar's working
    /// directory is not the worker's).
    #[error("{0} is not an absolute path")]
    Relative(PathBuf),
    /// The file shrank under the mapping (a worker truncated it): the bytes
    /// past its end are gone, and what was read or written there is not real.
    #[error("{path} was truncated under its mapping (now {size} bytes, {needed} needed): re-create and re-register the region")]
    Truncated {
        path: PathBuf,
        size: u64,
        needed: u64,
    },
    /// The SIGBUS guard is installed and its table is full: a mapping it does
    /// not cover would let a worker's truncation kill the process, so none is made.
    #[error("cannot map {0}: the SIGBUS guard already covers its {max} mappings (unregister regions or close rings first)", max = guard::MAX_MAPPINGS)]
    GuardFull(PathBuf),
    /// Registration policy: a worker registers only its own files.
    #[error("{path} belongs to uid {owner}, not to the registering worker's uid {caller}")]
    NotOwner {
        path: PathBuf,
        owner: u32,
        caller: u32,
    },
}

/// Filesystem types whose files are memory, not disk (`statfs` magic numbers).
const SHARED_MEMORY_FILESYSTEMS: [(i64, &str); 2] = [
    (0x0102_1994, "tmpfs"),               // TMPFS_MAGIC: /dev/shm, memfd
    (0x9584_58f6u32 as i64, "hugetlbfs"), // HUGETLBFS_MAGIC
];

/// Who may register a file: the worker's uid from the socket's credentials
/// (`None` when unknown: only the filesystem and symlink checks apply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: Option<u32>,
}

/// A bounds-checked range of a mapping, owning a reference to it and whatever
/// the caller wants released only with the view.
struct MappedRange<K> {
    region: Arc<SharedRegion>,
    offset: usize,
    len: usize,
    _keep: K,
}

impl<K> AsRef<[u8]> for MappedRange<K> {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `shared_bytes` checked the range against the mapping, which the
        // `Arc` keeps mapped as long as this view; the bytes are plain data that
        // any pattern may hold. The worker leaves source blocks alone until it
        // is told the transfer ended, and the sidecar tells it only after every
        // view of the transfer is dropped (`_keep`); see the module docs.
        unsafe { std::slice::from_raw_parts(self.region.map.as_ptr().add(self.offset), self.len) }
    }
}

/// A file mapped shared and read-write.
#[derive(Debug)]
pub struct SharedRegion {
    /// The mapping's entry in the SIGBUS guard (dropped before the mapping).
    guard: guard::Entry,
    map: MmapRaw,
    path: PathBuf,
    _file: File,
}

impl SharedRegion {
    /// The mapped file's (device, inode): the same file however it was
    /// named (a hard link, another path).
    pub fn identity(&self) -> std::io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let m = self._file.metadata()?;
        Ok((m.dev(), m.ino()))
    }

    /// Maps a worker's file under the registration policy: an absolute path
    /// whose last component is not a symlink, naming a regular file in shared
    /// memory (tmpfs or hugetlbfs) owned by the caller (root may register any
    /// owner's). Checked on the opened descriptor, so no rename or symlink
    /// swapped in between can redirect it.
    pub fn open_registered(path: impl AsRef<Path>, caller: Caller) -> Result<Self, ShmError> {
        Self::open_registered_within(path, caller, u64::MAX)
    }

    /// As [`SharedRegion::open_registered`], mapping at most the first
    /// `max_len` bytes: a region's layout reaches no further, and a huge
    /// (sparse, free to make) file must not take the daemon's address space.
    pub fn open_registered_within(
        path: impl AsRef<Path>,
        caller: Caller,
        max_len: u64,
    ) -> Result<Self, ShmError> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        use std::os::unix::io::AsRawFd;
        let path = path.as_ref().to_path_buf();
        if !path.is_absolute() {
            return Err(ShmError::Relative(path));
        }
        // Devices and FIFOs are refused before they are opened (opening some
        // devices does something). The path is resolved once, into a
        // descriptor that opens nothing (O_PATH); what it names is checked,
        // and that very file is then opened through it. Checking the path and
        // opening it again would let a directory swapped in between (a
        // symlink higher up the path) redirect the open to a device.
        let open_err = |source: std::io::Error| ShmError::Open {
            path: path.clone(),
            source,
        };
        let located = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(open_err)?;
        let seen = located.metadata().map_err(open_err)?;
        if seen.file_type().is_symlink() {
            return Err(ShmError::Symlink(path));
        }
        if !seen.file_type().is_file() {
            return Err(ShmError::NotAFile(path));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(format!("/proc/self/fd/{}", located.as_raw_fd()))
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    open_err(std::io::Error::new(
                        e.kind(),
                        "/proc is not mounted here (registration opens the file through /proc/self/fd)",
                    ))
                } else {
                    open_err(e)
                }
            })?;
        drop(located);
        let opened = file.metadata().map_err(open_err)?;
        if (opened.dev(), opened.ino()) != (seen.dev(), seen.ino()) || !opened.file_type().is_file()
        {
            return Err(ShmError::NotAFile(path));
        }
        // SAFETY: statfs is plain data; fstatfs fills it for a descriptor we own.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the descriptor stays open for the call.
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
            return Err(ShmError::Open {
                path,
                source: std::io::Error::last_os_error(),
            });
        }
        #[allow(clippy::unnecessary_cast)] // f_type's width differs by architecture
        let magic = fs.f_type as i64;
        if !SHARED_MEMORY_FILESYSTEMS.iter().any(|(m, _)| *m == magic) {
            return Err(ShmError::NotSharedMemory {
                path,
                fs: format!("{magic:#x}"),
            });
        }
        let meta = file.metadata().map_err(|source| ShmError::Open {
            path: path.clone(),
            source,
        })?;
        if let Some(uid) = caller.uid {
            if uid != 0 && meta.uid() != uid {
                return Err(ShmError::NotOwner {
                    path,
                    owner: meta.uid(),
                    caller: uid,
                });
            }
        }
        Self::map_file_within(file, path, max_len)
    }

    /// Maps an existing file (the sidecar's side).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        let path = path.as_ref().to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| ShmError::Open {
                path: path.clone(),
                source,
            })?;
        Self::map_file(file, path)
    }

    fn map_file(file: File, path: PathBuf) -> Result<Self, ShmError> {
        Self::map_file_within(file, path, u64::MAX)
    }

    fn map_file_within(file: File, path: PathBuf, max_len: u64) -> Result<Self, ShmError> {
        let meta = file.metadata().map_err(|source| ShmError::Open {
            path: path.clone(),
            source,
        })?;
        let ft = meta.file_type();
        if !ft.is_file() || ft.is_fifo() || ft.is_char_device() || ft.is_block_device() {
            return Err(ShmError::NotAFile(path));
        }
        if meta.len() == 0 {
            return Err(ShmError::Empty(path));
        }
        let len = usize::try_from(meta.len().min(max_len)).map_err(|_| ShmError::Map {
            path: path.clone(),
            source: std::io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|source| ShmError::Map {
                path: path.clone(),
                source,
            })?;
        let guard = guard::enter(map.as_ptr() as usize, map.len());
        if guard::installed() && !guard.is_guarded() {
            return Err(ShmError::GuardFull(path));
        }
        Ok(Self {
            guard,
            map,
            path,
            _file: file,
        })
    }

    /// Creates (or truncates) a file of `len` zero bytes and maps it (the
    /// worker's side). The file is its user's alone (mode 0600, also when it
    /// existed with a wider one): a KV cache is no other user's to read. A
    /// symlink at `path` is refused, and the file opened is the one mapped.
    pub fn create(path: impl AsRef<Path>, len: u64) -> Result<Self, ShmError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let path = path.as_ref().to_path_buf();
        let file = {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|source| ShmError::Open {
                    path: path.clone(),
                    source,
                })?;
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|source| ShmError::Open {
                    path: path.clone(),
                    source,
                })?;
            file.set_len(len).map_err(|source| ShmError::Resize {
                path: path.clone(),
                len,
                source,
            })?;
            reserve(&file, len).map_err(|source| {
                // Leave no half-made file behind.
                let _ = std::fs::remove_file(&path);
                ShmError::Reserve {
                    path: path.clone(),
                    len,
                    source,
                }
            })?;
            file
        };
        Self::map_file(file, path)
    }

    /// Start of the mapping, for registering it with an RDMA device.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a SIGBUS was contained in this mapping: its file was truncated
    /// and some pages are private zero pages now. Sticky.
    pub fn is_poisoned(&self) -> bool {
        self.guard.poisoned()
    }

    /// Whether the mapping is covered by the SIGBUS guard (see [`guard`]).
    pub fn is_guarded(&self) -> bool {
        self.guard.is_guarded()
    }

    /// Ok if `[offset, offset+len)` is still backed by the file: neither was a
    /// fault contained here, nor does the file now end before the range.
    pub fn check_intact(&self, offset: u64, len: u64) -> Result<(), ShmError> {
        let needed = offset.saturating_add(len);
        let size = self._file.metadata().map(|m| m.len()).unwrap_or(0);
        if self.is_poisoned() || size < needed {
            return Err(ShmError::Truncated {
                path: self.path.clone(),
                size,
                needed,
            });
        }
        Ok(())
    }

    /// The aligned 32-bit word at `offset`, for lock-free exchange with the
    /// other process mapping the file (ring indices, futex words).
    pub fn atomic_u32(&self, offset: u64) -> Result<&AtomicU32, ShmError> {
        self.check(offset, 4)?;
        if !offset.is_multiple_of(4) {
            return Err(ShmError::Misaligned { offset, align: 4 });
        }
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the
        // mapping lives as long as the returned reference's borrow of `self`.
        // Another process may change the word at any time, which is exactly
        // what an atomic allows; any bit pattern is a valid u32.
        Ok(unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(offset as usize).cast()) })
    }

    /// As [`atomic_u32`](Self::atomic_u32), for an aligned 64-bit word.
    pub fn atomic_u64(&self, offset: u64) -> Result<&AtomicU64, ShmError> {
        self.check(offset, 8)?;
        if !offset.is_multiple_of(8) {
            return Err(ShmError::Misaligned { offset, align: 8 });
        }
        // SAFETY: as in `atomic_u32`, with 8-byte alignment.
        Ok(unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset as usize).cast()) })
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(ShmError::OutOfBounds {
                offset,
                len,
                region_len: self.len(),
            }),
        }
    }

    /// A read view of `[offset, offset+len)`.
    pub fn slice(&self, offset: u64, len: u64) -> Result<&[u8], ShmError> {
        self.check(offset, len)?;
        // SAFETY: the range was bounds-checked against the mapping, which lives
        // as long as `self`; the bytes are plain data that any pattern may hold.
        Ok(unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(offset as usize), len as usize)
        })
    }

    /// Read views of `(offset, len)` ranges, for gathering writes to a socket.
    pub fn io_slices(&self, pieces: &[(u64, u64)]) -> Result<Vec<IoSlice<'_>>, ShmError> {
        pieces
            .iter()
            .map(|&(offset, len)| self.slice(offset, len).map(IoSlice::new))
            .collect()
    }

    /// `(offset, len)` as [`Bytes`] that keep the mapping alive, for senders that
    /// hold payload until the peer acknowledges it (QUIC) instead of copying it.
    /// `keep` is dropped with the last clone of the view: a token saying when
    /// the sender has let go of these bytes.
    pub fn shared_bytes<K: Send + Sync + 'static>(
        self: &Arc<Self>,
        offset: u64,
        len: u64,
        keep: K,
    ) -> Result<Bytes, ShmError> {
        self.check(offset, len)?;
        Ok(Bytes::from_owner(MappedRange {
            region: self.clone(),
            offset: offset as usize,
            len: len as usize,
            _keep: keep,
        }))
    }

    /// Write views of `(offset, len)` ranges, for scattering a socket read into blocks.
    /// The caller guarantees the ranges are disjoint and granted to it (module docs).
    pub fn io_slices_mut(&self, pieces: &[(u64, u64)]) -> Result<Vec<IoSliceMut<'_>>, ShmError> {
        pieces
            .iter()
            .map(|&(offset, len)| {
                self.check(offset, len)?;
                // SAFETY: bounds-checked against the mapping, which outlives the slice.
                // The mapping is MAP_SHARED read-write; exclusive use of these bytes is
                // the transfer protocol's guarantee (disjoint, granted destination blocks).
                let s = unsafe {
                    std::slice::from_raw_parts_mut(
                        self.map.as_mut_ptr().add(offset as usize),
                        len as usize,
                    )
                };
                Ok(IoSliceMut::new(s))
            })
            .collect()
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), ShmError> {
        self.check(offset, data.len() as u64)?;
        // SAFETY: bounds-checked; `data` is a distinct allocation, so the copy cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies region bytes at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, out.len() as u64)?;
        // SAFETY: bounds-checked; `out` is a distinct allocation, so the copy cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Fills `[offset, offset+len)` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), ShmError> {
        self.check(offset, len)?;
        // SAFETY: bounds-checked against the live mapping.
        unsafe {
            std::ptr::write_bytes(
                self.map.as_mut_ptr().add(offset as usize),
                byte,
                len as usize,
            )
        };
        Ok(())
    }
}

/// Keeps the heap's freed pages resident (glibc's trim and mmap thresholds
/// raised from their 128 KiB defaults): the QUIC receive path's buffers
/// come and go with the datagrams, and glibc gave their pages back and
/// faulted them in again (in a profile of a receiving sidecar, 26% of its
/// CPU in a copy into freshly faulted pages).
/// [`release_free_heap`] still returns them when much was freed. Elsewhere
/// than glibc, nothing.
pub fn keep_heap_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets two of the allocator's tunables (plain
    // integers); it touches no caller memory and is safe at any time.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD);
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD);
    }
}

/// Free memory at the top of the heap glibc keeps before giving it back
/// (default 128 KiB, and it grows only with the dynamic mmap threshold).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HEAP_TRIM_THRESHOLD: i32 = 256 << 20;
/// Allocations from this size up are mapped on their own (default 128 KiB,
/// dynamic); below it they come from the arenas, whose pages stay.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HEAP_MMAP_THRESHOLD: i32 = 8 << 20;

/// Gives the system back the free pages of this process's heap (glibc's
/// `malloc_trim`): glibc keeps freed chunks of its arenas resident, so the
/// megabytes of block lists a peer made the daemon hold stayed resident for
/// good after the transfers ended (240 MiB in the memory test). A call walks
/// the arenas; call it when much was freed, not per free. Elsewhere than
/// glibc, nothing.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes a byte count and only returns free pages of
    // the allocator's own arenas to the system; it touches no caller memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Waits for process `pid` to exit, through a pidfd (readable once the process
/// has exited) watched by the tokio reactor: no polling, no thread. Fails at once
/// when the process does not exist (or pidfds are unsupported).
pub async fn process_exit(pid: i32) -> std::io::Result<()> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the OwnedFd stays open, and keeps its number, for as long as the
    // AsyncFd that owns it.
    let watched =
        unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(std::io::Error::from)?;
    let _ready = watched.readable().await?;
    Ok(())
}

/// Allocates a new file's blocks now, so that a filesystem short of space
/// says so here instead of with SIGBUS on a later write. Filesystems that
/// cannot (no `fallocate`) keep the sparse file.
fn reserve(file: &File, len: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let Ok(len) = libc::off_t::try_from(len) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    loop {
        // SAFETY: fallocate reads no memory of ours; the descriptor is open
        // for the call.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => return Ok(()),
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm_file(name: &str) -> PathBuf {
        let p =
            Path::new("/dev/shm").join(format!("kvrail-shm-test-{}-{name}", std::process::id()));
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        p
    }

    /// A region larger than its filesystem's free space is refused when it is
    /// created, with what to do, and leaves no file: sparse, it would map and
    /// then kill the process with SIGBUS at the first write past the space
    /// (docker's 64 MiB /dev/shm and the demo's regions). Needs root (a tmpfs
    /// of 1 MiB is mounted for it); under CI it must run.
    #[test]
    fn a_region_larger_than_its_filesystem_is_refused_at_creation() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root: this test must run there"
            );
            use std::io::Write;
            // Past the harness's capture, which hides a passing test's output.
            let _ = writeln!(
                std::io::stdout().lock(),
                "SKIPPED a_region_larger_than_its_filesystem_is_refused_at_creation: mounting a small tmpfs needs root"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(mounted.success(), "mount a 1 MiB tmpfs");
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(self.0).status();
            }
        }
        let _unmount = Unmount(dir.path());
        let path = dir.path().join("region");
        let e = SharedRegion::create(&path, 4 << 20).unwrap_err();
        assert!(matches!(e, ShmError::Reserve { .. }), "{e}");
        assert!(e.to_string().contains("shm-size"), "{e}");
        assert!(!path.exists(), "the half-made file is removed");
        // What fits is created as before.
        let small = SharedRegion::create(&path, 256 << 10).unwrap();
        assert_eq!(small.len(), 256 << 10);
    }

    /// A worker shrinks its file under the mapping: reading and writing the
    /// pages past the new end would raise SIGBUS and kill the process; with the
    /// guard the copies complete over zero pages and the region says it is
    /// poisoned.
    #[test]
    fn a_truncated_file_poisons_its_mapping_instead_of_killing_the_process() {
        let _alone = guard::FAULTING_TESTS
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        guard::install().unwrap();
        let p = shm_file("truncate");
        std::fs::write(&p, vec![7u8; 64 << 10]).unwrap();
        let r = SharedRegion::open(&p).unwrap();
        assert!(r.is_guarded());
        assert!(r.check_intact(0, 64 << 10).is_ok());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4096)
            .unwrap();
        // The first page is still backed by the file.
        assert_eq!(r.slice(0, 16).unwrap(), &[7u8; 16]);
        assert!(!r.is_poisoned());
        assert!(matches!(
            r.check_intact(0, 64 << 10),
            Err(ShmError::Truncated { size: 4096, .. })
        ));
        // Past the end: a read and a write that would have raised SIGBUS.
        let mut out = vec![1u8; 8192];
        r.read_at(16 << 10, &mut out).unwrap();
        assert!(out.iter().all(|b| *b == 0));
        r.write_at(40 << 10, &[9u8; 100]).unwrap();
        assert!(r.is_poisoned());
        assert!(r.check_intact(0, 16).is_err(), "poisoned is sticky");
        drop(r);
        std::fs::remove_file(&p).unwrap();
    }

    /// A KV cache file is its user's alone, also when the path held a file
    /// with a wider mode; a symlink planted at the path is not followed.
    #[test]
    fn created_files_are_private_and_symlinks_refused() {
        use std::os::unix::fs::PermissionsExt;
        let p = shm_file("private");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let r = SharedRegion::create(&p, 8192).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(r.len(), 8192);
        drop(r);
        std::fs::remove_file(&p).unwrap();
        let target = shm_file("target");
        let link =
            Path::new("/dev/shm").join(format!("kvrail-shm-test-{}-link", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            SharedRegion::create(&link, 8192),
            Err(ShmError::Open { .. })
        ));
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 4096, "untouched");
        std::fs::remove_file(&link).unwrap();
        std::fs::remove_file(&target).unwrap();
    }

    #[test]
    fn files_of_another_user_are_refused() {
        let p = shm_file("owner");
        let me = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&p).unwrap());
        let other = if me == 4242 { 4243 } else { 4242 };
        let err = SharedRegion::open_registered(&p, Caller { uid: Some(other) }).unwrap_err();
        assert!(
            matches!(err, ShmError::NotOwner { owner, caller, .. } if owner == me && caller == other),
            "{err}"
        );
        assert!(SharedRegion::open_registered(&p, Caller { uid: Some(me) }).is_ok());
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn disk_files_symlinks_and_relative_paths_are_refused() {
        let disk = std::env::current_dir()
            .unwrap()
            .join(format!("kvrail-disk-{}", std::process::id()));
        std::fs::write(&disk, vec![0u8; 4096]).unwrap();
        let anyone = Caller { uid: None };
        let fs_type = nix_fs_type(&disk);
        let err = SharedRegion::open_registered(&disk, anyone);
        if fs_type != "tmpfs" {
            assert!(
                matches!(err, Err(ShmError::NotSharedMemory { .. })),
                "{err:?}"
            );
        }
        let link = Path::new("/dev/shm").join(format!("kvrail-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&disk, &link).unwrap();
        assert!(matches!(
            SharedRegion::open_registered(&link, anyone),
            Err(ShmError::Symlink(_))
        ));
        assert!(matches!(
            SharedRegion::open_registered("relative.bin", anyone),
            Err(ShmError::Relative(_))
        ));
        assert!(matches!(
            SharedRegion::open_registered("/dev/zero", anyone),
            Err(ShmError::NotAFile(_))
        ));
        std::fs::remove_file(&link).unwrap();
        std::fs::remove_file(&disk).unwrap();
    }

    /// "tmpfs" when the current directory is a tmpfs (then the disk case is moot).
    fn nix_fs_type(p: &Path) -> &'static str {
        let out = std::process::Command::new("stat")
            .args(["-f", "-c", "%T"])
            .arg(p)
            .output();
        match out {
            Ok(o) if String::from_utf8_lossy(&o.stdout).trim() == "tmpfs" => "tmpfs",
            _ => "other",
        }
    }

    #[test]
    fn shared_bytes_are_checked_views_that_keep_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let worker = SharedRegion::create(&path, 8192).unwrap();
        let sidecar = Arc::new(SharedRegion::open(&path).unwrap());
        worker.write_at(4096, b"block").unwrap();
        let token = Arc::new(());
        let view = sidecar.shared_bytes(4096, 5, token.clone()).unwrap();
        assert!(matches!(
            sidecar.shared_bytes(8190, 5, ()),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(sidecar.shared_bytes(u64::MAX, 2, ()).is_err());
        // The sender may hold the view after the region is unregistered.
        drop(sidecar);
        assert_eq!(&view[..], b"block");
        let tail = view.slice(1..);
        drop(view);
        assert_eq!(Arc::strong_count(&token), 2, "a slice keeps the token");
        drop(tail);
        assert_eq!(Arc::strong_count(&token), 1, "the last view released it");
    }

    #[test]
    fn two_mappings_share_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let worker = SharedRegion::create(&path, 8192).unwrap();
        let sidecar = SharedRegion::open(&path).unwrap();
        worker.write_at(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        sidecar.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        let mut views = sidecar.io_slices_mut(&[(4096, 3), (0, 2)]).unwrap();
        views[0].copy_from_slice(b"abc");
        views[1].copy_from_slice(b"xy");
        let mut out = [0u8; 3];
        worker.read_at(4096, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        let read = worker.io_slices(&[(0, 2)]).unwrap();
        assert_eq!(&*read[0], b"xy");
    }

    #[test]
    fn out_of_bounds_and_bad_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let r = SharedRegion::create(&path, 4096).unwrap();
        assert!(matches!(
            r.io_slices(&[(4000, 97)]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.io_slices_mut(&[(u64::MAX, 2)]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(r.write_at(4095, b"ab").is_err());
        assert!(matches!(
            SharedRegion::open(dir.path()),
            Err(ShmError::Open { .. } | ShmError::NotAFile(_))
        ));
        assert!(matches!(
            SharedRegion::open(dir.path().join("missing")),
            Err(ShmError::Open { .. })
        ));
        std::fs::write(dir.path().join("empty"), b"").unwrap();
        assert!(matches!(
            SharedRegion::open(dir.path().join("empty")),
            Err(ShmError::Empty(_))
        ));
    }
}
