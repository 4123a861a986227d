//! Durable pool metadata behind the [`MetaStore`] trait, and [`DurablePool`]: a [`Pool`] whose
//! every event is written ahead to a store before it is applied, so a restarted manager rebuilds
//! the same state (the pool is deterministic) and carries on where it stopped.
//!
//! [`EmbeddedStore`] keeps a data directory: `wal.log` — records framed as
//! `len u32 | crc32 u32 | bytes`, fsynced on append — and `snapshot.bin` (same framing, replaced
//! atomically by write-to-temp, fsync, rename, fsync of the directory). On recovery a torn or
//! corrupt tail (a crash mid-append) is detected by its length or crc, reported, and cut off.
//!
//! With the `etcd` feature, `EtcdStore` keeps the same log and snapshots in etcd.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::manifest::Manifest;
use crate::pool::{Action, CopyId, ModelId, NodeId, Pool, PoolError};

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    /// A file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A record or snapshot did not decode.
    #[error("{0}")]
    Corrupt(String),
    /// The pool refused a replayed or new event.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> MetaError {
    let context = context.into();
    move |source| MetaError::Io { context, source }
}

/// What recovery found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovered {
    /// The last snapshot.
    pub snapshot: Option<Vec<u8>>,
    /// Records appended after it, in order.
    pub records: Vec<Vec<u8>>,
    /// Bytes of a torn or corrupt tail that were cut off.
    pub dropped_tail_bytes: u64,
}

/// Durable storage for the pool's metadata.
pub trait MetaStore: Send {
    /// Appends a record durably.
    fn append(&mut self, record: &[u8]) -> Result<(), MetaError>;
    /// Replaces everything so far with `state` (compaction).
    fn snapshot(&mut self, state: &[u8]) -> Result<(), MetaError>;
    /// The last snapshot and the records after it; cuts off a torn tail.
    fn recover(&mut self) -> Result<Recovered, MetaError>;
}

/// The default store: a write-ahead log and snapshots in a data directory.
pub struct EmbeddedStore {
    dir: PathBuf,
    wal: File,
}

fn frame(b: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(b.len() + 8);
    v.extend((b.len() as u32).to_le_bytes());
    v.extend(crc32fast::hash(b).to_le_bytes());
    v.extend(b);
    v
}

/// Decodes framed records from `buf`; returns them and where the valid part ends.
fn unframe(buf: &[u8]) -> (Vec<Vec<u8>>, usize) {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 8 {
        let len = u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
        let crc = u32::from_le_bytes([buf[at + 4], buf[at + 5], buf[at + 6], buf[at + 7]]);
        let Some(body) = buf.get(at + 8..at + 8 + len) else { break };
        if crc32fast::hash(body) != crc {
            break;
        }
        out.push(body.to_vec());
        at += 8 + len;
    }
    (out, at)
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store in `dir`.
    pub fn open(dir: &Path) -> Result<EmbeddedStore, MetaError> {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let wal = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(dir.join("wal.log"))
            .map_err(io(format!("opening {}", dir.join("wal.log").display())))?;
        Ok(EmbeddedStore { dir: dir.to_path_buf(), wal })
    }

    fn sync_dir(&self) -> Result<(), MetaError> {
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(format!("syncing {}", self.dir.display())))
    }
}

impl MetaStore for EmbeddedStore {
    fn append(&mut self, record: &[u8]) -> Result<(), MetaError> {
        self.wal.write_all(&frame(record)).map_err(io("appending to the WAL"))?;
        self.wal.sync_data().map_err(io("syncing the WAL"))
    }

    fn snapshot(&mut self, state: &[u8]) -> Result<(), MetaError> {
        let tmp = self.dir.join("snapshot.tmp");
        let mut f = File::create(&tmp).map_err(io(format!("writing {}", tmp.display())))?;
        f.write_all(&frame(state)).and_then(|_| f.sync_all()).map_err(io("writing the snapshot"))?;
        std::fs::rename(&tmp, self.dir.join("snapshot.bin")).map_err(io("installing the snapshot"))?;
        self.sync_dir()?;
        // The snapshot covers every record: start an empty log.
        self.wal.set_len(0).and_then(|_| self.wal.sync_all()).map_err(io("truncating the WAL"))?;
        Ok(())
    }

    fn recover(&mut self) -> Result<Recovered, MetaError> {
        let snapshot = match std::fs::read(self.dir.join("snapshot.bin")) {
            Ok(b) => {
                let (mut recs, end) = unframe(&b);
                if recs.len() != 1 || end != b.len() {
                    return Err(MetaError::Corrupt(format!(
                        "{}: damaged snapshot",
                        self.dir.join("snapshot.bin").display()
                    )));
                }
                recs.pop()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("reading the snapshot")(e)),
        };
        let mut buf = Vec::new();
        self.wal.seek(SeekFrom::Start(0)).map_err(io("reading the WAL"))?;
        self.wal.read_to_end(&mut buf).map_err(io("reading the WAL"))?;
        let (records, end) = unframe(&buf);
        let dropped = (buf.len() - end) as u64;
        if dropped > 0 {
            self.wal
                .set_len(end as u64)
                .and_then(|_| self.wal.sync_all())
                .map_err(io("cutting the WAL's torn tail"))?;
        }
        Ok(Recovered { snapshot, records, dropped_tail_bytes: dropped })
    }
}

/// A pool event, as written ahead to the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// [`Pool::register`].
    Register {
        /// Model.
        model: ModelId,
        /// Bytes.
        bytes: u64,
        /// Whether repairs may use the file.
        file_reachable: bool,
    },
    /// [`Pool::deploy`].
    Deploy {
        /// Model.
        model: ModelId,
        /// Node.
        node: NodeId,
        /// GPU.
        gpu: u32,
    },
    /// [`Pool::copy_ready`].
    CopyReady(CopyId),
    /// [`Pool::copy_failed`].
    CopyFailed(CopyId),
    /// [`Pool::reclaim`].
    Reclaim(CopyId),
    /// [`Pool::node_down`].
    NodeDown(NodeId),
    /// [`Pool::node_up`].
    NodeUp(NodeId),
    /// [`Pool::set_file_reachable`].
    FileReachable {
        /// Model.
        model: ModelId,
        /// Whether repairs may load it from its file.
        reachable: bool,
    },
    /// What a model is (written before its `Register`): the catalog entry daemons load it from.
    Describe {
        /// Model.
        model: ModelId,
        /// Its file and manifest.
        entry: Box<ModelEntry>,
    },
}

/// A registered model's file and manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEntry {
    /// The safetensors file, as the nodes open it.
    pub path: String,
    /// Its manifest (layers, packed size, chunk crcs, content hash).
    pub manifest: Manifest,
}

/// Everything the store keeps: the pool and the model catalog.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct State {
    pool: Pool,
    #[serde(default)]
    catalog: BTreeMap<ModelId, ModelEntry>,
}

fn apply(state: &mut State, e: &Event) -> Result<Vec<Action>, PoolError> {
    let pool = &mut state.pool;
    match *e {
        Event::Describe { model, ref entry } => {
            state.catalog.insert(model, (**entry).clone());
            Ok(Vec::new())
        }
        Event::Register { model, bytes, file_reachable } => pool.register(model, bytes, file_reachable),
        Event::Deploy { model, node, gpu } => pool.deploy(model, node, gpu),
        Event::CopyReady(c) => pool.copy_ready(c),
        Event::CopyFailed(c) => pool.copy_failed(c),
        Event::Reclaim(c) => pool.reclaim(c),
        Event::NodeDown(n) => Ok(pool.node_down(n)),
        Event::NodeUp(n) => Ok(pool.node_up(n)),
        Event::FileReachable { model, reachable } => pool.set_file_reachable(model, reachable).map(|_| Vec::new()),
    }
}

/// A pool whose events are written ahead to a [`MetaStore`].
pub struct DurablePool<S: MetaStore> {
    state: State,
    store: S,
    since_snapshot: usize,
    snapshot_every: usize,
}

impl<S: MetaStore> DurablePool<S> {
    /// Recovers the pool from `store`, or starts `fresh` when the store is empty. Returns the pool
    /// and how many bytes of a torn tail recovery cut off.
    pub fn open(mut store: S, fresh: Pool, snapshot_every: usize) -> Result<(DurablePool<S>, u64), MetaError> {
        let rec = store.recover()?;
        let mut state = match rec.snapshot {
            Some(s) => serde_json::from_slice(&s).map_err(|e| MetaError::Corrupt(format!("snapshot: {e}")))?,
            None => State { pool: fresh, catalog: BTreeMap::new() },
        };
        for r in &rec.records {
            let e: Event = serde_json::from_slice(r).map_err(|e| MetaError::Corrupt(format!("WAL record: {e}")))?;
            // Replaying refused events is deterministic too: they were refused the first time.
            let _ = apply(&mut state, &e);
        }
        let since = rec.records.len();
        Ok((
            DurablePool { state, store, since_snapshot: since, snapshot_every: snapshot_every.max(1) },
            rec.dropped_tail_bytes,
        ))
    }

    /// Writes `e` ahead, then applies it; returns the actions for the daemons.
    pub fn apply(&mut self, e: Event) -> Result<Vec<Action>, MetaError> {
        let bytes = serde_json::to_vec(&e).map_err(|e| MetaError::Corrupt(e.to_string()))?;
        self.store.append(&bytes)?;
        let actions = apply(&mut self.state, &e)?;
        self.since_snapshot += 1;
        if self.since_snapshot >= self.snapshot_every {
            let state = serde_json::to_vec(&self.state).map_err(|e| MetaError::Corrupt(e.to_string()))?;
            self.store.snapshot(&state)?;
            self.since_snapshot = 0;
        }
        Ok(actions)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.state.pool
    }

    /// The model catalog.
    pub fn catalog(&self) -> &BTreeMap<ModelId, ModelEntry> {
        &self.state.catalog
    }
}

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;

#[cfg(test)]
mod tests;
