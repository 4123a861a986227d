//! Where an import writes: the directory it is given, checked before anything is read, and the
//! directory beside it that the files are written into and then exchanged with it.

use std::path::{Path, PathBuf};

use super::{bad, IMPORT_FILES};
use crate::ExecError;

/// What an import finds where it is to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// Nothing: the directory is created.
    Missing,
    /// An empty directory.
    Empty,
    /// A directory with only [`IMPORT_FILES`]: an earlier import, replaced.
    Import,
}

/// What `out` is; an error naming what it holds where an import may not replace it.
pub(super) fn target(out: &Path) -> Result<Target, ExecError> {
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Target::Missing),
        Err(e) => return Err(bad(format!("{}: {e}", out.display()))),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        return Err(bad(format!("{} is a symbolic link: name the directory itself", out.display())));
    }
    if !meta.is_dir() {
        return Err(bad(format!("{} is there and is not a directory", out.display())));
    }
    let (mut others, mut files) = (Vec::new(), 0);
    for entry in std::fs::read_dir(out).map_err(|e| bad(format!("{}: {e}", out.display())))? {
        let entry = entry.map_err(|e| bad(format!("{}: {e}", out.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let file = entry.file_type().is_ok_and(|t| t.is_file());
        if !file || !IMPORT_FILES.contains(&name.as_str()) {
            others.push(name);
        } else {
            files += 1;
        }
    }
    if others.is_empty() {
        return Ok(if files == 0 { Target::Empty } else { Target::Import });
    }
    others.sort();
    let shown = if others.len() > 4 {
        format!("{} and {} more", others[..3].join(", "), others.len() - 3)
    } else {
        others.join(", ")
    };
    Err(bad(format!(
        "{} holds {shown}, which an import does not write ({}): refused, so that nothing there is \
         overwritten or left beside the new model; name a new or empty directory",
        out.display(),
        IMPORT_FILES.join(", ")
    )))
}

/// A fresh directory beside `out` (same file system, hidden, named after it and this process)
/// to write an import into; `out`'s parents are created.
pub(super) fn staging(out: &Path) -> Result<PathBuf, ExecError> {
    let name = out.file_name().ok_or_else(|| bad(format!("{} names no directory", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(parent).map_err(|e| bad(format!("{}: {e}", parent.display())))?;
    let prefix = format!(".{}.import-", name.to_string_lossy());
    remove_abandoned(parent, &prefix);
    let tmp = parent.join(format!("{prefix}{}", std::process::id()));
    // One left by an earlier process of this id that was killed.
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| bad(format!("{}: {e}", tmp.display())))?;
    Ok(tmp)
}

/// Removes the staging directories in `dir` named `prefix` and a process id that no process has
/// now: imports killed while they wrote (each may hold most of a model). One whose process id
/// is alive (maybe another process's by now) is left.
fn remove_abandoned(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Moves the import written in `tmp` to `out`: a rename where `out` is missing, an atomic
/// exchange (`renameat2(RENAME_EXCHANGE)`) where it `replaces` a directory, which leaves the
/// previous one in `tmp`.
pub(super) fn put_in_place(tmp: &Path, out: &Path, replaces: bool) -> Result<(), ExecError> {
    let failed = |e: std::io::Error| bad(format!("moving the import into {}: {e}", out.display()));
    if !replaces {
        // Fails (the directory is not empty) if another import got there meanwhile.
        return std::fs::rename(tmp, out).map_err(failed);
    }
    use std::os::unix::ffi::OsStrExt;
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|e| bad(format!("{}: {e}", p.display())));
    let (from, to) = (c(tmp)?, c(out)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; renameat2 only
    // reads them.
    let rc =
        unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc != 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory holding files an import does not write (here another model's), a symbolic
    /// link or a plain file is refused before the GGUF is even opened, and left as it was; an
    /// empty directory or an earlier import's may be written.
    #[test]
    fn an_import_refuses_a_directory_it_would_mix_with_or_overwrite() {
        let dir = std::env::temp_dir().join(format!("cascade-gguf-target-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bert = dir.join("bert");
        std::fs::create_dir_all(&bert).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "sentence_bert_config.json"] {
            std::fs::write(bert.join(f), f).unwrap();
        }
        let missing = Path::new("/nonexistent.gguf");
        let e = crate::gguf::import(missing, &bert, crate::gguf::Storage::F32, |_, _, _| {}).unwrap_err().to_string();
        assert!(e.contains("holds sentence_bert_config.json, vocab.txt, which an import does not write"), "{e}");
        assert_eq!(std::fs::read_to_string(bert.join("model.safetensors")).unwrap(), "model.safetensors");
        std::os::unix::fs::symlink(&bert, dir.join("link")).unwrap();
        let e = crate::gguf::import(missing, &dir.join("link"), crate::gguf::Storage::F32, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        let e = crate::gguf::import(missing, &bert.join("vocab.txt"), crate::gguf::Storage::F32, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a directory"), "{e}");

        assert_eq!(target(&dir.join("none")).unwrap(), Target::Missing);
        std::fs::create_dir(dir.join("empty")).unwrap();
        assert_eq!(target(&dir.join("empty")).unwrap(), Target::Empty);
        for f in ["vocab.txt", "sentence_bert_config.json"] {
            std::fs::remove_file(bert.join(f)).unwrap();
        }
        assert_eq!(target(&bert).unwrap(), Target::Import);
        std::fs::create_dir(bert.join("config.json.d")).unwrap();
        assert!(target(&bert).is_err(), "a directory among the files");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A staging directory left by a killed import (its process gone) is removed by the next
    /// import of the same directory; one of a live process, or of another directory, is not.
    #[test]
    fn the_next_import_removes_what_a_killed_one_left() {
        let dir = std::env::temp_dir().join(format!("cascade-gguf-abandoned-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // No process has a pid above the kernel's maximum (at most 2^22).
        let dead = dir.join(format!(".model.import-{}", 1u32 << 23));
        let alive = dir.join(".model.import-1");
        let other = dir.join(format!(".other.import-{}", 1u32 << 23));
        for d in [&dead, &alive, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.safetensors"), "partial").unwrap();
        }
        let tmp = staging(&dir.join("model")).unwrap();
        assert!(!dead.exists() && alive.exists() && other.exists() && tmp.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An import replaces an earlier one by exchanging the directories in one step: the new files
    /// are where the old ones were, and the old ones where the new were written.
    #[test]
    fn putting_an_import_in_place_exchanges_the_directories() {
        let dir = std::env::temp_dir().join(format!("cascade-gguf-exchange-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (out, tmp) = (dir.join("model"), dir.join(".model.import"));
        for (d, text) in [(&out, "old"), (&tmp, "new")] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.safetensors"), text).unwrap();
        }
        put_in_place(&tmp, &out, true).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("model.safetensors")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(tmp.join("model.safetensors")).unwrap(), "old");
        // Where the directory was missing but another import put one there meanwhile, the rename
        // fails rather than replacing it.
        assert!(put_in_place(&tmp, &out, false).unwrap_err().to_string().contains("moving the import into"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
