//! Durable pool metadata behind the [`MetaStore`] trait, and [`DurablePool`]: a [`Pool`] whose
//! every event is written ahead to a store before it is applied, so a restarted manager rebuilds
//! the same state (the pool is deterministic) and carries on where it stopped.
//!
//! [`EmbeddedStore`] keeps a data directory: `wal.log` — records framed as
//! `magic "CSWL" | len u32 | crc32(magic, len) u32 | crc32(body) u32 | body`, fsynced on
//! append — and `snapshot.bin` (same framing, replaced atomically by write-to-temp, fsync,
//! rename, fsync of the directory). A snapshot records the length and crc32 of the log it
//! covers, and the log restarts after it with a random epoch record; so a crash between
//! installing a snapshot and truncating the log is recognised at recovery (the log still starts
//! with the covered bytes) and those records are not applied a second time.
//!
//! Recovery never silently loses an acknowledged record. A record is acknowledged only after its
//! fsync, and the next append starts only after that, so a crash can leave at most one
//! incomplete record, at the very end: a partial header, a body cut short, or a zero-filled
//! tail. That *torn tail* is cut off and reported. Anything else that does not decode — a bad
//! header or body anywhere, including a complete last record — is corruption: recovery fails
//! with [`MetaError::WalCorrupt`] and the manager refuses to start; `cascade pool wal verify`,
//! `dump` and `salvage` (see [`wal`]) let the operator look and decide. A failed append (ENOSPC,
//! EIO) is cut back off the file before anything else is appended; while that cut fails, every
//! append fails, so nothing is acknowledged behind a damaged record.
//!
//! The pool's identity lives in the log: [`DurablePool::init`] writes a fresh pool id as the
//! first record, and [`DurablePool::open`] refuses a store without one — a mistyped data
//! directory is an error, never an empty pool.
//!
//! With the `etcd` feature, `EtcdStore` keeps the same log and snapshots in etcd.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};

pub(crate) use lock::lock_dir;
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
    #[error("{context}: {error}")]
    Io {
        /// What was being done.
        context: String,
        /// The error. Part of the message, not a `source()`, so an error chain prints it once.
        error: std::io::Error,
    },
    /// A record or snapshot did not decode.
    #[error("{0}")]
    Corrupt(String),
    /// The write-ahead log is damaged before its end: recovery refuses to guess.
    #[error(
        "{path}: damaged record at byte {offset} ({reason}); {valid} records before it are intact. \
         Nothing was changed: inspect it with `cascade pool wal verify|dump`, and only if losing \
         what follows is acceptable, `cascade pool wal salvage`"
    )]
    WalCorrupt {
        /// The log.
        path: String,
        /// Where the damaged record starts.
        offset: u64,
        /// What is wrong with it.
        reason: String,
        /// Intact records before it.
        valid: usize,
    },
    /// The store holds no pool (a new one is made with `--init`).
    #[error("{0} holds no pool: start with --init to create one (is the path right?)")]
    NotAPool(String),
    /// `--init` on a store that already holds a pool.
    #[error("{0} already holds pool {1}: start without --init to open it")]
    AlreadyAPool(String, String),
    /// An earlier append failed and could not be cut off the log; nothing is appended until it is.
    #[error("the WAL is not writable until its failed append is cut off: {0}")]
    Poisoned(String),
    /// The pool refused a replayed or new event.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Another process, or another store of this one, holds the data directory: one manager (or
    /// `wal salvage`) per directory.
    #[error("{dir} is in use by {holder}: one pool manager per data directory; stop it first")]
    InUse {
        /// The data directory.
        dir: String,
        /// Who holds it: `pid N` (as the kernel or the lock file says), `this process (pid N)`,
        /// or `a process that did not say which`.
        holder: String,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> MetaError {
    let context = context.into();
    move |error| MetaError::Io { context, error }
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
    /// Where the store is, for messages.
    fn describe(&self) -> String;
}

/// The default store: a write-ahead log and snapshots in a data directory.
pub struct EmbeddedStore {
    dir: PathBuf,
    wal: File,
    /// The data directory's lock ([`lock_dir`]), held while the store is open.
    _lock: lock::DirLock,
    /// Bytes of whole, acknowledged records in `wal.log`.
    len: u64,
    /// Set when a failed append could not be cut off: appends fail until it is.
    poisoned: bool,
    #[cfg(test)]
    pub(crate) fail_append: Option<usize>,
    /// Test hook: a crash after installing a snapshot, before the log is truncated.
    #[cfg(test)]
    pub(crate) crash_before_truncate: bool,
}

/// The body of the record that starts a log restarted after a snapshot: this tag and 16 random
/// bytes. It makes the new log's first bytes differ from every earlier log's, so recovery can
/// tell a log the snapshot covers (its truncation was interrupted) from a new one.
const EPOCH_TAG: &[u8] = b"CSWAL-EPOCH:";
/// The start of a snapshot's body: this magic, the length and crc32 of the log it covers, the state.
const SNAPSHOT_MAGIC: &[u8; 4] = b"CSS1";

/// Magic number at the start of every framed record ("CSWL").
const MAGIC: [u8; 4] = *b"CSWL";
/// Size of a record's header.
const HEADER: usize = 16;

fn frame(b: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(b.len() + HEADER);
    v.extend(MAGIC);
    v.extend((b.len() as u32).to_le_bytes());
    v.extend(crc32fast::hash(&v[..8]).to_le_bytes());
    v.extend(crc32fast::hash(b).to_le_bytes());
    v.extend(b);
    v
}

/// What a scan of a framed log found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scan {
    /// The intact records, in order.
    pub(crate) records: Vec<Vec<u8>>,
    /// Where they end.
    pub(crate) end: usize,
    /// Why the bytes after `end` are not a record: `None` when there are none, `Some((torn,
    /// reason))` otherwise; `torn` when they can only be the last append, cut short by a crash.
    pub(crate) stop: Option<(bool, String)>,
}

/// Decodes framed records from `buf` (see the module docs for what a torn tail is).
pub(crate) fn scan(buf: &[u8]) -> Scan {
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    let mut records = Vec::new();
    let mut at = 0;
    let stop = loop {
        let rest = &buf[at..];
        if rest.is_empty() {
            break None;
        }
        if rest.iter().all(|&b| b == 0) {
            break Some((true, format!("{} zero bytes after the last record", rest.len())));
        }
        if rest.len() < HEADER {
            break Some((true, format!("a {}-byte partial header", rest.len())));
        }
        if rest[..4] != MAGIC || crc32fast::hash(&rest[..8]) != u32_at(at + 8) {
            break Some((false, "bad record header".into()));
        }
        let len = u32_at(at + 4) as usize;
        let Some(body) = rest.get(HEADER..HEADER + len) else {
            break Some((true, format!("a record of {len} bytes cut short at {}", rest.len() - HEADER)));
        };
        if crc32fast::hash(body) != u32_at(at + 12) {
            break Some((false, "record body crc32 mismatch".into()));
        }
        if !body.starts_with(EPOCH_TAG) {
            records.push(body.to_vec());
        }
        at += HEADER + len;
    };
    Scan { records, end: at, stop }
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store in `dir`, holding its lock until the store is dropped
    /// (another process, or another store in this one, on `dir` is [`MetaError::InUse`]). Whether
    /// it holds a pool is decided by [`DurablePool::open`] / [`DurablePool::init`].
    pub fn open(dir: &Path) -> Result<EmbeddedStore, MetaError> {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        // Two managers appending to one log would interleave two pools' events, and one's
        // snapshot would cut the other's acknowledged records off: refused ([`MetaError::InUse`]).
        let lock = lock_dir(dir)?;
        let wal = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(dir.join("wal.log"))
            .map_err(io(format!("opening {}", dir.join("wal.log").display())))?;
        let len = wal.metadata().map_err(io("reading the WAL's length"))?.len();
        Ok(EmbeddedStore {
            dir: dir.to_path_buf(),
            wal,
            _lock: lock,
            len,
            poisoned: false,
            #[cfg(test)]
            fail_append: None,
            #[cfg(test)]
            crash_before_truncate: false,
        })
    }

    /// Whether `dir` has a store's files at all (a log or a snapshot). Whether they hold a pool
    /// is [`DurablePool::open`]'s to decide; this only tells a new directory from a used one
    /// without creating anything.
    pub fn exists(dir: &Path) -> bool {
        dir.join("wal.log").is_file() || dir.join("snapshot.bin").is_file()
    }

    fn sync_dir(&self) -> Result<(), MetaError> {
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(format!("syncing {}", self.dir.display())))
    }

    fn wal_path(&self) -> String {
        self.dir.join("wal.log").display().to_string()
    }

    /// Empties the log (a snapshot covers it) and starts it with a fresh epoch record.
    fn restart_log(&mut self) -> Result<(), MetaError> {
        self.wal.set_len(0).and_then(|_| self.wal.sync_all()).map_err(io("truncating the WAL"))?;
        self.len = 0;
        self.poisoned = false;
        let mut epoch = EPOCH_TAG.to_vec();
        let mut random = [0u8; 16];
        getrandom::fill(&mut random)
            .map_err(|e| io("drawing the WAL's epoch")(std::io::Error::other(e.to_string())))?;
        epoch.extend(random);
        self.append(&epoch)
    }

    /// Cuts the log back to its acknowledged records.
    fn cut_back(&mut self) -> std::io::Result<()> {
        self.wal.set_len(self.len)?;
        self.wal.sync_all()
    }

    fn write_record(&mut self, framed: &[u8]) -> std::io::Result<()> {
        #[cfg(test)]
        if let Some(n) = self.fail_append.take() {
            // A disk that fills up after `n` bytes of this record.
            self.wal.write_all(&framed[..n.min(framed.len())])?;
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.wal.write_all(framed)?;
        self.wal.sync_data()
    }
}

impl MetaStore for EmbeddedStore {
    fn append(&mut self, record: &[u8]) -> Result<(), MetaError> {
        if self.poisoned {
            self.cut_back().map_err(|e| MetaError::Poisoned(e.to_string()))?;
            self.poisoned = false;
        }
        let framed = frame(record);
        if let Err(e) = self.write_record(&framed) {
            // Nothing after a failed append may be acknowledged while its bytes are on disk.
            if self.cut_back().is_err() {
                self.poisoned = true;
            }
            return Err(io("appending to the WAL")(e));
        }
        self.len += framed.len() as u64;
        Ok(())
    }

    fn snapshot(&mut self, state: &[u8]) -> Result<(), MetaError> {
        // The snapshot names the log it covers (its acknowledged bytes and their crc32): if the
        // log's truncation below never happens (a crash), recovery skips those records instead
        // of applying them a second time on top of the snapshot.
        let mut covered = vec![0u8; self.len as usize];
        self.wal
            .seek(SeekFrom::Start(0))
            .and_then(|_| self.wal.read_exact(&mut covered))
            .map_err(io("reading the WAL"))?;
        let mut body = Vec::with_capacity(state.len() + 16);
        body.extend(SNAPSHOT_MAGIC);
        body.extend(self.len.to_le_bytes());
        body.extend(crc32fast::hash(&covered).to_le_bytes());
        body.extend(state);
        let tmp = self.dir.join("snapshot.tmp");
        let mut f = File::create(&tmp).map_err(io(format!("writing {}", tmp.display())))?;
        f.write_all(&frame(&body)).and_then(|_| f.sync_all()).map_err(io("writing the snapshot"))?;
        std::fs::rename(&tmp, self.dir.join("snapshot.bin")).map_err(io("installing the snapshot"))?;
        self.sync_dir()?;
        #[cfg(test)]
        if self.crash_before_truncate {
            return Ok(());
        }
        self.restart_log()
    }

    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn recover(&mut self) -> Result<Recovered, MetaError> {
        let damaged = || MetaError::Corrupt(format!("{}: damaged snapshot", self.dir.join("snapshot.bin").display()));
        let (snapshot, covered) = match std::fs::read(self.dir.join("snapshot.bin")) {
            Ok(b) => {
                let Scan { mut records, stop, .. } = scan(&b);
                let body = records.pop().filter(|_| records.is_empty() && stop.is_none()).ok_or_else(damaged)?;
                if body.len() < 16 || &body[..4] != SNAPSHOT_MAGIC {
                    return Err(damaged());
                }
                let len = u64::from_le_bytes(body[4..12].try_into().map_err(|_| damaged())?);
                let crc = u32::from_le_bytes(body[12..16].try_into().map_err(|_| damaged())?);
                (Some(body[16..].to_vec()), Some((len, crc)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
            Err(e) => return Err(io("reading the snapshot")(e)),
        };
        let mut buf = Vec::new();
        self.wal.seek(SeekFrom::Start(0)).map_err(io("reading the WAL"))?;
        self.wal.read_to_end(&mut buf).map_err(io("reading the WAL"))?;
        // A log that starts with exactly the bytes the snapshot covers was never truncated (a
        // crash between the two): those records are in the snapshot already.
        let base = match covered {
            Some((len, crc)) if len > 0 && buf.len() as u64 >= len && crc32fast::hash(&buf[..len as usize]) == crc => {
                len as usize
            }
            _ => 0,
        };
        let Scan { records, end, stop } = scan(&buf[base..]);
        let end = base + end;
        if let Some((false, reason)) = stop {
            return Err(MetaError::WalCorrupt {
                path: self.wal_path(),
                offset: end as u64,
                reason,
                valid: records.len(),
            });
        }
        let dropped = (buf.len() - end) as u64;
        self.len = end as u64;
        if base > 0 && records.is_empty() {
            // Finish the interrupted truncation.
            self.restart_log()?;
        } else if dropped > 0 {
            self.cut_back().map_err(io("cutting the WAL's torn tail"))?;
        }
        Ok(Recovered { snapshot, records, dropped_tail_bytes: dropped })
    }
}

/// A pool event, as written ahead to the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The pool's birth: its id, the store's first record.
    Init {
        /// The pool id.
        pool: String,
        /// Copies required per model, fixed when the pool is made.
        #[serde(default)]
        k: Option<usize>,
    },
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
    /// [`Pool::deploy_all`]: a scale-out, one record (and one fsync) for all its nodes.
    DeployAll {
        /// Model.
        model: ModelId,
        /// Nodes.
        nodes: Vec<NodeId>,
        /// GPU on each.
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
    /// [`Pool::drain`].
    Drain(NodeId),
    /// [`Pool::undrain`].
    Undrain(NodeId),
    /// [`Pool::set_file_reachable`].
    FileReachable {
        /// Model.
        model: ModelId,
        /// Whether repairs may load it from its file.
        reachable: bool,
    },
    /// [`Pool::set_capacity`]: what a node advertised it may hold for the pool.
    Capacity {
        /// Node.
        node: NodeId,
        /// Bytes (`None`: no limit).
        bytes: Option<u64>,
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
    /// The pool's id (written by `init`); `None` in a store that holds no pool.
    #[serde(default)]
    id: Option<String>,
    pool: Pool,
    #[serde(default)]
    catalog: BTreeMap<ModelId, ModelEntry>,
}

fn apply(state: &mut State, e: &Event) -> Result<Vec<Action>, PoolError> {
    let pool = &mut state.pool;
    match *e {
        Event::Init { ref pool, k } => {
            state.id = Some(pool.clone());
            if let Some(k) = k {
                state.pool.set_k(k);
            }
            Ok(Vec::new())
        }
        Event::Describe { model, ref entry } => {
            state.catalog.insert(model, (**entry).clone());
            Ok(Vec::new())
        }
        Event::Register { model, bytes, file_reachable } => pool.register(model, bytes, file_reachable),
        Event::Deploy { model, node, gpu } => pool.deploy(model, node, gpu),
        Event::DeployAll { model, ref nodes, gpu } => pool.deploy_all(model, nodes, gpu),
        Event::CopyReady(c) => pool.copy_ready(c),
        Event::CopyFailed(c) => pool.copy_failed(c),
        Event::Reclaim(c) => pool.reclaim(c),
        Event::NodeDown(n) => Ok(pool.node_down(n)),
        Event::Capacity { node, bytes } => {
            pool.set_capacity(node, bytes);
            Ok(Vec::new())
        }
        Event::NodeUp(n) => Ok(pool.node_up(n)),
        Event::Drain(n) => pool.drain(n),
        Event::Undrain(n) => pool.undrain(n),
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
    /// Recovers the pool `store` holds. A store without one is refused
    /// ([`MetaError::NotAPool`]): a new pool is made by [`DurablePool::init`]. Returns the pool
    /// and how many bytes of a torn tail recovery cut off.
    pub fn open(store: S, fresh: Pool, snapshot_every: usize) -> Result<(DurablePool<S>, u64), MetaError> {
        let (pool, torn, _) = Self::recover(store, fresh, snapshot_every)?;
        if pool.state.id.is_none() {
            return Err(MetaError::NotAPool(pool.store.describe()));
        }
        Ok((pool, torn))
    }

    /// Makes a new pool, `fresh`, in an empty `store`: its first record is the new pool's id.
    /// A store that holds anything is refused ([`MetaError::AlreadyAPool`]).
    pub fn init(store: S, fresh: Pool, snapshot_every: usize) -> Result<DurablePool<S>, MetaError> {
        let (mut pool, _, had_snapshot) = Self::recover(store, fresh, snapshot_every)?;
        if pool.state.id.is_some() || pool.since_snapshot > 0 || had_snapshot {
            let id = pool.state.id.clone().unwrap_or_else(|| "without an id".into());
            return Err(MetaError::AlreadyAPool(pool.store.describe(), id));
        }
        let mut b = [0u8; 16];
        getrandom::fill(&mut b).map_err(|e| MetaError::Io {
            context: "drawing a pool id".into(),
            error: std::io::Error::other(e.to_string()),
        })?;
        let id = crate::manifest::hex(&b);
        let k = pool.state.pool.k();
        pool.apply(Event::Init { pool: id, k: Some(k) })?;
        Ok(pool)
    }

    /// The store's pool (or `fresh`), the torn bytes cut off and whether there was a snapshot.
    fn recover(mut store: S, fresh: Pool, snapshot_every: usize) -> Result<(DurablePool<S>, u64, bool), MetaError> {
        let rec = store.recover()?;
        let had_snapshot = rec.snapshot.is_some();
        let mut state = match rec.snapshot {
            Some(s) => serde_json::from_slice(&s).map_err(|e| MetaError::Corrupt(format!("snapshot: {e}")))?,
            None => State { id: None, pool: fresh, catalog: BTreeMap::new() },
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
            had_snapshot,
        ))
    }

    /// The pool's id.
    pub fn id(&self) -> &str {
        self.state.id.as_deref().unwrap_or("")
    }

    /// Writes `e` ahead, then applies it; returns the actions for the daemons.
    pub fn apply(&mut self, e: Event) -> Result<Vec<Action>, MetaError> {
        let bytes = serde_json::to_vec(&e).map_err(|e| MetaError::Corrupt(e.to_string()))?;
        self.store.append(&bytes)?;
        let actions = apply(&mut self.state, &e)?;
        self.since_snapshot += 1;
        if self.since_snapshot >= self.snapshot_every {
            // The event is durable and applied: a failed compaction must not report it failed
            // (its actions would be lost); it is tried again after the next event.
            let done = serde_json::to_vec(&self.state)
                .map_err(|e| MetaError::Corrupt(e.to_string()))
                .and_then(|state| self.store.snapshot(&state));
            match done {
                Ok(()) => self.since_snapshot = 0,
                Err(e) => tracing::warn!(error = %e, "compacting the metadata failed; will retry"),
            }
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

mod lock;
pub mod wal;

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;

#[cfg(test)]
mod tests;
