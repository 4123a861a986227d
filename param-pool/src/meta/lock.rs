//! One holder per data directory: [`DirLock`].
//!
//! The lock is a POSIX record lock (`fcntl(F_SETLK)`) on `dir/LOCK`, which the kernel keeps per
//! *process*: a child does not inherit it, and it goes when the process ends, however it ends, so
//! no stale lock is ever left behind. It replaced an `flock(2)`, which belongs to the open file
//! and so was also held, for a moment, by every child a thread of the holding process forked:
//! until that child's `exec` closed its copy of the descriptor, the directory stayed locked after
//! its store was dropped, and reopening it was refused as in use by the very process reopening it
//! (1,080 of 2,000 reopens, with one thread starting `true` in a loop; CI met it as the etcd tests
//! started `etcd` beside the crash property test).
//!
//! A record lock does not exclude its own process, so a registry of the directories this
//! process holds does that. Closing *any* descriptor of a file drops the process's record locks
//! on it: only [`lock_dir`] opens `LOCK`, and only when the registry says no one in this process
//! holds the directory.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Mutex;

use super::{io, MetaError};

/// The data directories (device, inode) some [`DirLock`] of this process holds.
static HELD: Mutex<BTreeSet<(u64, u64)>> = Mutex::new(BTreeSet::new());

/// A data directory held by this process until the value is dropped.
#[derive(Debug)]
pub(crate) struct DirLock {
    /// `dir/LOCK`, open while the lock is held (closing it releases the lock).
    file: Option<File>,
    /// The directory's key in [`HELD`].
    key: (u64, u64),
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // The kernel's lock goes first: a store of this process that opened the directory
        // between the two steps would otherwise lose its lock when this file closes.
        drop(self.file.take());
        HELD.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.key);
    }
}

/// Takes `dir` (which must exist) for this process, or says who holds it
/// ([`MetaError::InUse`]). The lock file says which process holds it.
pub(crate) fn lock_dir(dir: &Path) -> Result<DirLock, MetaError> {
    let meta = std::fs::metadata(dir).map_err(io(format!("reading {}", dir.display())))?;
    let key = (meta.dev(), meta.ino());
    let in_use = |holder: String| MetaError::InUse { dir: dir.display().to_string(), holder };
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    if held.contains(&key) {
        return Err(in_use(format!("this process (pid {})", std::process::id())));
    }
    let path = dir.join("LOCK");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    match record_lock(&f, libc::F_SETLK) {
        Ok(_) => {}
        // A file system that keeps no locks (some FUSE and network mounts) cannot tell: go on
        // unlocked, as before the lock existed, and say so.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)) => {
            tracing::warn!(dir = %dir.display(), error = %e, "the data directory cannot be locked here: nothing stops a second manager on it");
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
            // The kernel knows the holder's pid (0 when it is in another pid namespace); the
            // file says what the holder wrote.
            let pid = record_lock(&f, libc::F_GETLK)
                .ok()
                .filter(|l| l.l_type != libc::F_UNLCK as libc::c_short)
                .map(|l| l.l_pid);
            let mut written = String::new();
            let _ = f.read_to_string(&mut written);
            let holder = match (pid, written.trim()) {
                (Some(pid), _) if pid > 0 => format!("pid {pid}"),
                (_, "") => "a process that did not say which".to_string(),
                (_, written) => written.to_string(),
            };
            return Err(in_use(holder));
        }
        Err(e) => return Err(io(format!("locking {}", path.display()))(e)),
    }
    f.set_len(0)
        .and_then(|_| f.seek(SeekFrom::Start(0)))
        .and_then(|_| writeln!(f, "pid {}", std::process::id()))
        .map_err(io(format!("writing {}", path.display())))?;
    held.insert(key);
    Ok(DirLock { file: Some(f), key })
}

/// `fcntl(cmd)` with a write lock over the whole of `f`: `F_SETLK` takes it (failing with
/// `EAGAIN`/`EACCES` when another process holds it), `F_GETLK` says who would stop it.
fn record_lock(f: &File, cmd: libc::c_int) -> std::io::Result<libc::flock> {
    // SAFETY: all-zero is a valid `flock` (plain integers); the fields that matter are set below.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = 0;
    l.l_len = 0; // to the end of the file, however long it grows
                 // SAFETY: fcntl(2) on a descriptor `f` keeps open for the call, with a pointer to a live,
                 // initialised `flock` that F_SETLK reads and F_GETLK overwrites; nothing else is touched.
    if unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut l as *mut libc::flock) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l)
}
