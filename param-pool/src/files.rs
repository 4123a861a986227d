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
    }
}
