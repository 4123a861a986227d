//! Opening model files safely: without blocking on a FIFO or device, regular files only.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` for reading with `extra` open flags (e.g. `O_DIRECT`). The open never blocks (a
/// FIFO without a writer would hold the caller forever) and anything but a regular file is
/// refused with `InvalidInput`.
pub fn open_regular(path: &Path, extra: i32) -> std::io::Result<File> {
    let f = File::options().read(true).custom_flags(libc::O_NONBLOCK | extra).open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    Ok(f)
}

/// A regular file mapped read-only: its bytes without a copy in the process's own memory (the
/// page cache holds them, and may drop and read them again under memory pressure), so that
/// building tensors or a region from a model file does not hold the file twice.
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps `path`, opened as [`open_regular`] opens it (a FIFO or a directory is refused).
    pub fn open(path: &Path) -> std::io::Result<MappedFile> {
        let file = open_regular(path, 0)?;
        // SAFETY: the mapping is read-only. Model files must not be modified while they are
        // mapped (the pool publishes new models under new names): a concurrent write would
        // change the bytes read (the manifest's checksums catch it where they are checked), a
        // concurrent truncation would raise SIGBUS, as with any mapped file.
        let map = unsafe { memmap2::Mmap::map(&file) }?;
        Ok(MappedFile { map })
    }
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedFile({} bytes)", self.map.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_or_a_directory_is_refused_at_once() {
        let d = crate::test_util::Scratch::new("fifo");
        std::fs::create_dir_all(&*d).unwrap();
        let fifo = d.join("model.safetensors");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = open_regular(&fifo, 0).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
        assert!(open_regular(&d, 0).is_err(), "a directory");
        let file = d.join("real");
        std::fs::write(&file, b"x").unwrap();
        open_regular(&file, 0).unwrap();
        // A mapping reads what the file holds, and refuses what the open refuses.
        assert_eq!(&*MappedFile::open(&file).unwrap(), b"x");
        assert_eq!(MappedFile::open(&fifo).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        assert!(MappedFile::open(&d).is_err(), "a directory");
    }
}
