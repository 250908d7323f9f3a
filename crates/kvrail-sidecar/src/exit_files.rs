//! Files a worker process asked to have removed once it exits
//! (`RemoveOnExit`): a vLLM engine moves its host KV cache under a
//! shared-memory file, and an engine killed with SIGKILL (vLLM force-kills
//! its workers at shutdown) cannot remove its own; the file would keep its
//! gigabytes in /dev/shm.
//!
//! Each file is pinned when asked for: its directory is held open (so no
//! directory renamed or swapped for a symlink later can redirect the removal)
//! and its (device, inode) recorded. At exit the name is removed only if it
//! still names that very file, through the held directory.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Files one process may have pinned.
pub const MAX_FILES_PER_PROCESS: usize = 64;
/// Files pinned over all processes.
pub const MAX_FILES: usize = 4096;

/// Why a file cannot be pinned.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error("{0:?} is not an absolute path naming a file")]
    NotAFilePath(PathBuf),
    #[error("cannot open the directory of {path:?}: {source}")]
    Directory {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path:?}: {source}")]
    Stat {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0:?} is not a regular file")]
    NotRegular(PathBuf),
    #[error("{path:?} belongs to uid {owner}, not to the caller (uid {caller})")]
    NotOwner {
        path: PathBuf,
        owner: u32,
        caller: u32,
    },
    /// The caller could not remove the file itself (its directory is not the
    /// caller's to write): the sidecar will not do it for it.
    #[error("the caller (uid {caller}) may not remove files from the directory of {path:?}")]
    DirectoryNotWritable { path: PathBuf, caller: u32 },
    #[error("at most {MAX_FILES_PER_PROCESS} files per process and {MAX_FILES} in all")]
    TooMany,
}

/// One file, pinned.
struct PinnedFile {
    dir: File,
    name: OsString,
    identity: (u64, u64),
    /// Its owner when pinned: tmpfs gives a freed inode number to the next
    /// file made, so (device, inode) alone could match a file another user
    /// made under the same name after ours went.
    owner: u32,
    path: PathBuf,
}

impl PinnedFile {
    /// `/proc/self/fd/<dir>/<name>`: the name inside the held directory.
    fn held_path(&self) -> PathBuf {
        Path::new(&format!("/proc/self/fd/{}", self.dir.as_raw_fd())).join(&self.name)
    }

    fn pin(path: &Path, caller_uid: Option<u32>) -> Result<Self, PinError> {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(PinError::NotAFilePath(path.to_path_buf()));
        };
        if !path.is_absolute() {
            return Err(PinError::NotAFilePath(path.to_path_buf()));
        }
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(parent)
            .map_err(|source| PinError::Directory {
                path: path.to_path_buf(),
                source,
            })?;
        let mut pinned = PinnedFile {
            dir,
            name: name.to_os_string(),
            identity: (0, 0),
            owner: 0,
            path: path.to_path_buf(),
        };
        let meta =
            std::fs::symlink_metadata(pinned.held_path()).map_err(|source| PinError::Stat {
                path: path.to_path_buf(),
                source,
            })?;
        if !meta.file_type().is_file() {
            return Err(PinError::NotRegular(path.to_path_buf()));
        }
        if let Some(uid) = caller_uid {
            if uid != 0 && meta.uid() != uid {
                return Err(PinError::NotOwner {
                    path: path.to_path_buf(),
                    owner: meta.uid(),
                    caller: uid,
                });
            }
            // Removing a name writes its directory: the caller's own, or
            // one open to everyone (/dev/shm, /tmp: sticky, so only the
            // owner of the file may remove it, and the caller owns it).
            let dir = pinned.dir.metadata().map_err(|source| PinError::Stat {
                path: path.to_path_buf(),
                source,
            })?;
            let writable =
                (dir.uid() == uid && dir.mode() & 0o300 == 0o300) || dir.mode() & 0o003 == 0o003;
            if uid != 0 && !writable {
                return Err(PinError::DirectoryNotWritable {
                    path: path.to_path_buf(),
                    caller: uid,
                });
            }
        }
        pinned.identity = (meta.dev(), meta.ino());
        pinned.owner = meta.uid();
        Ok(pinned)
    }

    /// Removes the file if its name still names the pinned file.
    fn remove(&self) -> Result<bool, std::io::Error> {
        let held = self.held_path();
        match std::fs::symlink_metadata(&held) {
            Ok(m)
                if (m.dev(), m.ino()) == self.identity
                    && m.uid() == self.owner
                    && m.file_type().is_file() =>
            {
                std::fs::remove_file(&held)?;
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Files pinned per process.
#[derive(Default)]
pub struct ExitFiles {
    by_pid: Mutex<HashMap<i32, Vec<PinnedFile>>>,
}

impl ExitFiles {
    /// Pins `paths` for removal when process `pid` exits (the caller then
    /// watches it). A path pinned again replaces its earlier pin.
    pub fn pin(&self, pid: i32, caller_uid: Option<u32>, paths: &[String]) -> Result<(), PinError> {
        let mut pinned: Vec<PinnedFile> = Vec::new();
        for p in paths {
            if !pinned.iter().any(|f| f.path.as_os_str() == p.as_str()) {
                pinned.push(PinnedFile::pin(Path::new(p), caller_uid)?);
            }
        }
        let again = |f: &PinnedFile| pinned.iter().any(|p| p.path == f.path);
        let mut by_pid = self.by_pid.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = by_pid.values().map(Vec::len).sum();
        let (mine_before, mine_kept) = by_pid.get(&pid).map_or((0, 0), |m| {
            (m.len(), m.iter().filter(|f| !again(f)).count())
        });
        let mine_after = mine_kept + pinned.len();
        if mine_after > MAX_FILES_PER_PROCESS || total - mine_before + mine_after > MAX_FILES {
            return Err(PinError::TooMany);
        }
        let mine = by_pid.entry(pid).or_default();
        mine.retain(|f| !again(f));
        mine.extend(pinned);
        Ok(())
    }

    /// Whether process `pid` has files pinned.
    pub fn has(&self, pid: i32) -> bool {
        let by_pid = self.by_pid.lock().unwrap_or_else(|e| e.into_inner());
        by_pid.get(&pid).is_some_and(|f| !f.is_empty())
    }

    /// Forgets process `pid`'s files without removing them (its exit cannot
    /// be watched).
    pub fn forget(&self, pid: i32) {
        let mut by_pid = self.by_pid.lock().unwrap_or_else(|e| e.into_inner());
        by_pid.remove(&pid);
    }

    /// Process `pid` exited: removes its files (those still its own).
    pub fn exited(&self, pid: i32) {
        let files = {
            let mut by_pid = self.by_pid.lock().unwrap_or_else(|e| e.into_inner());
            by_pid.remove(&pid).unwrap_or_default()
        };
        for f in files {
            match f.remove() {
                Ok(true) => {
                    tracing::info!(pid, path = %f.path.display(), "worker exited: removed its file")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(pid, path = %f.path.display(), "worker exited: cannot remove its file: {e}")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removed at exit only while its name still names the pinned file:
    /// not a file swapped in under the same name, not through a directory
    /// swapped for a symlink.
    #[test]
    fn only_the_pinned_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
        std::fs::write(path("kv"), b"kv").unwrap();
        std::fs::write(path("table"), b"{}").unwrap();
        std::fs::write(path("swapped"), b"x").unwrap();
        let files = ExitFiles::default();
        files
            .pin(7, None, &[path("kv"), path("table"), path("swapped")])
            .unwrap();
        // Another file under the pinned name (the old one kept alive
        // elsewhere, so that the new one cannot get its inode number).
        std::fs::hard_link(path("swapped"), path("kept")).unwrap();
        std::fs::remove_file(path("swapped")).unwrap();
        std::fs::write(path("swapped"), b"someone else's").unwrap();
        assert!(files.has(7));
        files.exited(7);
        assert!(!Path::new(&path("kv")).exists());
        assert!(!Path::new(&path("table")).exists());
        assert!(Path::new(&path("swapped")).exists());
        assert!(!files.has(7));
    }

    #[test]
    fn what_cannot_be_pinned_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let files = ExitFiles::default();
        for bad in ["relative", "/", "/proc/self/no-such-file"] {
            assert!(files.pin(1, None, &[bad.to_string()]).is_err(), "{bad}");
        }
        let d = dir.path().to_string_lossy().into_owned();
        assert!(matches!(
            files.pin(1, None, &[d]),
            Err(PinError::NotRegular(_))
        ));
        let f = dir.path().join("f");
        std::fs::write(&f, b"").unwrap();
        let f = f.to_string_lossy().into_owned();
        let me = std::fs::metadata(dir.path()).unwrap().uid();
        assert!(matches!(
            files.pin(1, Some(me + 1), std::slice::from_ref(&f)),
            Err(PinError::NotOwner { .. })
        ));
        let many: Vec<String> = (0..=MAX_FILES_PER_PROCESS).map(|_| f.clone()).collect();
        files.pin(1, None, &many).unwrap(); // the same path, pinned once
        let many: Vec<String> = (0..=MAX_FILES_PER_PROCESS)
            .map(|i| {
                let p = dir.path().join(format!("m{i}"));
                std::fs::write(&p, b"").unwrap();
                p.to_string_lossy().into_owned()
            })
            .collect();
        assert!(matches!(files.pin(2, None, &many), Err(PinError::TooMany)));
    }

    /// Removing a name writes its directory: a caller that could not remove
    /// the file itself (its own file, in a directory not its own to write)
    /// does not get the sidecar to do it.
    #[test]
    fn a_file_the_caller_could_not_remove_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("locked");
        std::fs::create_dir(&sub).unwrap();
        let f = sub.join("kv");
        std::fs::write(&f, b"").unwrap();
        let me = std::fs::metadata(&f).unwrap().uid();
        // Root may remove anything: the caller is then another user, who
        // owns the file but not the directory.
        let caller = if me == 0 { 12345 } else { me };
        if me == 0 {
            std::os::unix::fs::chown(&f, Some(caller), None).unwrap();
        }
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o555)).unwrap();
        let files = ExitFiles::default();
        let path = f.to_string_lossy().into_owned();
        let refused = files.pin(1, Some(caller), std::slice::from_ref(&path));
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            matches!(refused, Err(PinError::DirectoryNotWritable { .. })),
            "{refused:?}"
        );
        // A directory open to everyone (sticky, as /dev/shm) is fine.
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o1777)).unwrap();
        files.pin(1, Some(caller), &[path]).unwrap();
    }
}
