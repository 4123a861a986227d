//! The operator's tools for an embedded store's log (`cascade pool wal verify|dump|salvage`):
//! recovery refuses a damaged log and never repairs it on its own, so these look at it without
//! changing it, and — only when asked — keep its intact prefix.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{io, scan, Event, MetaError, Scan};

/// What a look at a log found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WalReport {
    /// The log.
    pub path: String,
    /// Its length.
    pub bytes: u64,
    /// Intact records from its start.
    pub records: usize,
    /// Where they end.
    pub intact_bytes: u64,
    /// Bytes of a torn tail (the last append, cut short by a crash) that recovery would cut.
    pub torn_tail_bytes: u64,
    /// A damaged record that makes recovery refuse the log: its offset and what is wrong.
    pub damaged: Option<(u64, String)>,
    /// Whether a snapshot precedes the log.
    pub snapshot: bool,
}

impl WalReport {
    /// True when recovery would accept the log.
    pub fn ok(&self) -> bool {
        self.damaged.is_none()
    }
}

fn read(dir: &Path) -> Result<(PathBuf, Vec<u8>), MetaError> {
    let path = dir.join("wal.log");
    let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
    Ok((path, bytes))
}

/// Looks at the log in `dir` without changing it.
pub fn verify(dir: &Path) -> Result<WalReport, MetaError> {
    let (path, bytes) = read(dir)?;
    let Scan { records, end, stop } = scan(&bytes);
    let (torn, damaged) = match stop {
        None => (0, None),
        Some((true, _)) => ((bytes.len() - end) as u64, None),
        Some((false, reason)) => (0, Some((end as u64, reason))),
    };
    Ok(WalReport {
        path: path.display().to_string(),
        bytes: bytes.len() as u64,
        records: records.len(),
        intact_bytes: end as u64,
        torn_tail_bytes: torn,
        damaged,
        snapshot: dir.join("snapshot.bin").exists(),
    })
}

/// The intact records of the log in `dir`, decoded (a record that does not decode as an event
/// is shown as its bytes' length).
pub fn dump(dir: &Path) -> Result<Vec<serde_json::Value>, MetaError> {
    let (_, bytes) = read(dir)?;
    Ok(scan(&bytes)
        .records
        .iter()
        .map(|r| match serde_json::from_slice::<Event>(r) {
            Ok(e) => serde_json::to_value(e).unwrap_or_default(),
            Err(_) => serde_json::json!({ "undecodable_bytes": r.len() }),
        })
        .collect())
}

/// What a salvage did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Salvaged {
    /// Records kept.
    pub kept_records: usize,
    /// Bytes given up (the damaged record and everything after it).
    pub dropped_bytes: u64,
    /// Where the original log was kept.
    pub original: String,
}

/// Keeps the intact prefix of the log in `dir`, after keeping the original beside it
/// (`wal.log.damaged-<unix seconds>`). Everything from the first damaged record on is given up:
/// the operator's explicit decision, never recovery's. Refused while a manager holds `dir`
/// ([`MetaError::InUse`]).
pub fn salvage(dir: &Path) -> Result<Salvaged, MetaError> {
    // A manager running on `dir` would go on appending to the log this replaces.
    let _lock = super::lock_dir(dir)?;
    let (path, bytes) = read(dir)?;
    let Scan { records, end, .. } = scan(&bytes);
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let original = dir.join(format!("wal.log.damaged-{secs}"));
    std::fs::copy(&path, &original).map_err(io(format!("keeping the original as {}", original.display())))?;
    let tmp = dir.join("wal.salvage");
    std::fs::write(&tmp, &bytes[..end])
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &path))
        .and_then(|_| std::fs::File::open(dir)?.sync_all())
        .map_err(io(format!("writing the salvaged {}", path.display())))?;
    Ok(Salvaged {
        kept_records: records.len(),
        dropped_bytes: (bytes.len() - end) as u64,
        original: original.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::{EmbeddedStore, MetaStore, HEADER};
    use crate::test_util::Scratch;

    #[test]
    fn verify_reports_damage_and_salvage_keeps_the_intact_prefix_and_the_original() {
        let d = Scratch::new("wal-tool");
        let mut s = EmbeddedStore::open(&d).unwrap();
        for e in [Event::NodeDown(1), Event::NodeUp(1), Event::NodeDown(2)] {
            s.append(&serde_json::to_vec(&e).unwrap()).unwrap();
        }
        drop(s);
        let clean = verify(&d).unwrap();
        assert!(clean.ok() && clean.records == 3 && clean.torn_tail_bytes == 0, "{clean:?}");
        assert_eq!(dump(&d).unwrap()[1], serde_json::json!({ "NodeUp": 1 }));

        let mut bytes = std::fs::read(d.join("wal.log")).unwrap();
        let first = HEADER + serde_json::to_vec(&Event::NodeDown(1)).unwrap().len();
        bytes[first + HEADER + 1] ^= 4; // inside the second record's body
        std::fs::write(d.join("wal.log"), &bytes).unwrap();
        let bad = verify(&d).unwrap();
        assert!(!bad.ok() && bad.records == 1, "{bad:?}");
        assert_eq!(std::fs::read(d.join("wal.log")).unwrap(), bytes, "verify changed nothing");

        let done = salvage(&d).unwrap();
        assert_eq!(done.kept_records, 1);
        assert_eq!(std::fs::read(&done.original).unwrap(), bytes, "the original is kept");
        let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
        assert_eq!(rec.records.len(), 1);
    }
}
