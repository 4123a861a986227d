//! The node side of the pool: the pool service a `cascade node` runs beside the multicast
//! service. It owns the node's held copies (the regions that outlive multicast runs) and serves
//! the pool manager's requests:
//!
//! ```text
//! manager -> node   Load{pool, copy, path, manifest}   ->  Loaded{result, file_missing}   (io_uring, crc-verified)
//! manager -> node   Drop{pool, copy}                   ->  Dropped
//! manager -> node   Check{pool, copy, bytes, chunk}    ->  Checked{crcs}    (None: no such copy)
//! manager -> node   List{pool}                         ->  Listed{copies, foreign, capacity}
//! manager -> node   Lend{pool, copy, run, loc, bytes}  ->  Done      the copy becomes the source of a multicast run
//! manager -> node   Adopt{pool, copy, run, loc}        ->  Done      a verified target of a run becomes held copy `copy`
//! (any of them)                                        ->  Failed{message}
//! ```
//!
//! A node remembers which pool each copy belongs to (the pool id its manager was created with):
//! every request names its pool and reaches only that pool's copies, so a manager started on
//! the wrong (or a new) store cannot drop or overwrite another pool's copies; it sees them as
//! `foreign` in a listing.
//!
//! Lend and Adopt go through the node's [`MulticastNode`]: the pool (the higher crate) calls
//! into the multicast (the lower one), never the other way round.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use cascade_multicast::cluster::{chunk_crcs, MulticastNode};
use cascade_multicast::{Loc, NodeId};
use cascade_transport::service::{ServiceId, DEFAULT_INBOX};
use cascade_transport::{Inbox, Mesh, Received, Region, ServiceExt, TransportError};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::loader::{load_counting, LoadOptions, LoadProgress};
use crate::manifest::Manifest;

/// Requests of the pool service, and their replies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PoolMsg {
    /// Load the model file at `path` into a new held copy.
    Load {
        /// The pool.
        pool: String,
        /// The copy's id.
        copy: u64,
        /// The safetensors file.
        path: String,
        /// Its manifest (what to place where, and the crcs to verify).
        manifest: Box<Manifest>,
    },
    /// The outcome of a load: seconds taken, or why it failed.
    Loaded {
        /// Seconds, or the error.
        result: Result<f64, String>,
        /// The error is that the file does not exist on the node.
        file_missing: bool,
    },
    /// Release a held copy.
    Drop {
        /// The pool.
        pool: String,
        /// The copy.
        copy: u64,
    },
    /// The copy is gone (or was never here).
    Dropped,
    /// Checksum a held copy.
    Check {
        /// The pool.
        pool: String,
        /// The copy.
        copy: u64,
        /// Model bytes.
        bytes: u64,
        /// Chunk size of the manifest's crcs.
        chunk: u64,
    },
    /// The crc32 of each chunk; `None` when the node holds no such copy.
    Checked {
        /// Per-chunk crc32.
        crcs: Option<Vec<u32>>,
    },
    /// List the held copies.
    List {
        /// The pool asking.
        pool: String,
    },
    /// The held copies.
    Listed {
        /// Ids of the asking pool's copies, ascending.
        copies: Vec<u64>,
        /// Copies of other pools, by pool id and copy id: not the asker's to touch.
        foreign: Vec<(String, u64)>,
        /// The bytes this node may give to regions (its configured limit), if limited.
        capacity: Option<u64>,
    },
    /// Lend held copy `copy` to multicast run `run` as its source at `loc`.
    Lend {
        /// The pool.
        pool: String,
        /// The copy.
        copy: u64,
        /// The run (its controller is the requester).
        run: u32,
        /// The source's location in the run.
        loc: Loc,
        /// Bytes the run moves.
        bytes: u64,
    },
    /// Take the verified target `loc` of run `run` as held copy `copy`.
    Adopt {
        /// The pool.
        pool: String,
        /// The new copy's id.
        copy: u64,
        /// The run.
        run: u32,
        /// The target's location.
        loc: Loc,
    },
    /// Lend or Adopt succeeded.
    Done,
    /// The request failed at the node.
    Failed {
        /// Why.
        message: String,
    },
    /// How far the node's load of copy `copy` is (asked while a `Load` runs). Added after the
    /// messages above, at the end, so that a node built before it refuses only this request
    /// (as a body it cannot decode) and the manager then waits for its loads without progress.
    LoadProgress {
        /// The pool.
        pool: String,
        /// The copy.
        copy: u64,
    },
    /// The answer to `LoadProgress`.
    LoadAt {
        /// Bytes placed and bytes verified so far; `None` when no such load runs on the node
        /// (not yet started, or over).
        progress: Option<(u64, u64)>,
    },
}

cascade_transport::binary_message!(PoolMsg, ServiceId::POOL, 2);

/// The node's held copies, by pool id and copy id. Their regions stay registered (peers may
/// read them as multicast sources) until dropped.
#[derive(Default)]
pub struct HeldCopies {
    map: Mutex<BTreeMap<(String, u64), Region>>,
}

impl HeldCopies {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u64), Region>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `region` as copy `id` of `pool`; returns the region it replaces, if any.
    pub fn insert(&self, pool: &str, id: u64, region: Region) -> Option<Region> {
        self.lock().insert((pool.to_string(), id), region)
    }

    /// The region of copy `id` of `pool`.
    pub fn get(&self, pool: &str, id: u64) -> Option<Region> {
        self.lock().get(&(pool.to_string(), id)).cloned()
    }

    /// Stops holding copy `id` of `pool`; the caller deregisters the region.
    pub fn remove(&self, pool: &str, id: u64) -> Option<Region> {
        self.lock().remove(&(pool.to_string(), id))
    }

    /// Ids of `pool`'s held copies, ascending.
    pub fn ids(&self, pool: &str) -> Vec<u64> {
        self.lock().keys().filter(|(p, _)| p == pool).map(|(_, c)| *c).collect()
    }

    /// Copies held for pools other than `pool`.
    pub fn foreign(&self, pool: &str) -> Vec<(String, u64)> {
        self.lock().keys().filter(|(p, _)| p != pool).cloned().collect()
    }
}

/// The pool service of one node.
pub struct PoolNode {
    mesh: Arc<dyn Mesh>,
    multicast: Arc<MulticastNode>,
    held: HeldCopies,
    /// The loads running, by pool id and copy id.
    loading: Mutex<BTreeMap<(String, u64), Arc<LoadProgress>>>,
}

impl PoolNode {
    /// Starts the pool service on `mesh` next to the node's multicast service: takes the pool
    /// inbox now and serves it on a task until the node's service table closes.
    pub fn start(mesh: Arc<dyn Mesh>, multicast: Arc<MulticastNode>) -> Result<Arc<PoolNode>, TransportError> {
        let inbox = mesh.subscribe::<PoolMsg>(DEFAULT_INBOX)?;
        let node = Arc::new(PoolNode { mesh, multicast, held: HeldCopies::default(), loading: Mutex::default() });
        tokio::spawn(node.clone().serve(inbox));
        Ok(node)
    }

    /// The copies this node holds.
    pub fn held(&self) -> &HeldCopies {
        &self.held
    }

    async fn serve(self: Arc<Self>, mut inbox: Inbox<PoolMsg>) {
        while let Some(m) = inbox.recv().await {
            // Loads and checksums take long: each request on its own task.
            tokio::spawn(self.clone().handle(m));
        }
    }

    async fn handle(self: Arc<Self>, m: Received<PoolMsg>) {
        let Some(to) = m.reply_to else {
            warn!(from = m.from, "a pool message that is not a request");
            return;
        };
        let reply = match self.serve_request(m.from, m.msg).await {
            Ok(r) => r,
            Err(e) => PoolMsg::Failed { message: e.to_string() },
        };
        if let Err(e) = self.mesh.reply(&to, &reply) {
            warn!(to = to.peer, error = %e, "cannot answer the pool manager");
        }
    }

    async fn serve_request(self: &Arc<Self>, from: NodeId, msg: PoolMsg) -> Result<PoolMsg, TransportError> {
        match msg {
            PoolMsg::Load { pool, copy, path, manifest } => {
                let me = self.clone();
                blocking(move || Ok(me.load(&pool, copy, &path, &manifest))).await
            }
            PoolMsg::LoadProgress { pool, copy } => {
                let loads = self.loading.lock().unwrap_or_else(|e| e.into_inner());
                let progress = loads.get(&(pool, copy)).map(|p| (p.placed.load(Relaxed), p.verified.load(Relaxed)));
                Ok(PoolMsg::LoadAt { progress })
            }
            PoolMsg::Drop { pool, copy } => {
                if let Some(r) = self.held.remove(&pool, copy) {
                    self.mesh.deregister(r.id());
                    info!(copy, "dropped a copy");
                }
                Ok(PoolMsg::Dropped)
            }
            PoolMsg::Check { pool, copy, bytes, chunk } => {
                let Some(r) = self.held.get(&pool, copy) else { return Ok(PoolMsg::Checked { crcs: None }) };
                // SAFETY: a held copy is complete and nobody writes it: sources are only read.
                let crcs = blocking(move || unsafe { chunk_crcs(&r, bytes.min(r.len()), chunk) }).await.ok();
                Ok(PoolMsg::Checked { crcs })
            }
            PoolMsg::List { pool } => Ok(PoolMsg::Listed {
                copies: self.held.ids(&pool),
                foreign: self.held.foreign(&pool),
                capacity: self.mesh.memory_limit(),
            }),
            PoolMsg::Lend { pool, copy, run, loc, bytes } => {
                let region =
                    self.held.get(&pool, copy).ok_or_else(|| refused(format!("this node holds no copy {copy}")))?;
                if region.len() < bytes {
                    return Err(refused(format!("copy {copy} has {} bytes, the run moves {bytes}", region.len())));
                }
                self.multicast.lend(run, loc, region, from)?;
                Ok(PoolMsg::Done)
            }
            PoolMsg::Adopt { pool, copy, run, loc } => {
                let region = self.multicast.detach(run, loc)?;
                if let Some(old) = self.held.insert(&pool, copy, region) {
                    // A manager re-issued this copy after a restart: the new bytes replace the old.
                    self.mesh.deregister(old.id());
                }
                Ok(PoolMsg::Done)
            }
            other => Err(refused(format!("a node does not serve {other:?}"))),
        }
    }

    /// Loads `path` into a new held copy (on a blocking thread). The region is registered only
    /// once it holds the verified bytes.
    fn load(&self, pool: &str, copy: u64, path: &str, manifest: &Manifest) -> PoolMsg {
        let file_missing = !Path::new(path).exists();
        let key = (pool.to_string(), copy);
        let progress = Arc::new(LoadProgress::default());
        self.loading.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone(), progress.clone());
        let result = self.mesh.alloc(manifest.bytes).map_err(|e| e.to_string()).and_then(|region| {
            // SAFETY: the region was just allocated and is not registered: nobody else reaches it.
            let rep = unsafe { load_counting(manifest, Path::new(path), &region, LoadOptions::default(), &progress) };
            let rep = rep.map_err(|e| e.to_string())?;
            self.mesh.register(&region).map_err(|e| e.to_string())?;
            if let Some(old) = self.held.insert(pool, copy, region) {
                self.mesh.deregister(old.id());
            }
            info!(pool, copy, path, seconds = rep.seconds, mode = ?rep.mode, "loaded a copy from its file");
            Ok(rep.seconds)
        });
        let mut loads = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        // Only this load's entry: a manager restarted meanwhile may have re-issued the copy.
        if loads.get(&key).is_some_and(|p| Arc::ptr_eq(p, &progress)) {
            loads.remove(&key);
        }
        drop(loads);
        PoolMsg::Loaded { result, file_missing }
    }
}

fn refused(detail: String) -> TransportError {
    TransportError::Protocol { peer: None, detail }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TransportError> + Send + 'static,
) -> Result<T, TransportError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| refused(format!("blocking task failed: {e}")))?
}

/// The services of a pool node: multicast and pool, on one endpoint.
pub struct NodeServices {
    /// The multicast service.
    pub multicast: Arc<MulticastNode>,
    /// The pool service.
    pub pool: Arc<PoolNode>,
}

/// Starts a pool node's services on `mesh` (what `cascade node` runs); they serve until the
/// node's service table closes. `op_timeout` limits each chunk WRITE of a multicast.
pub fn start_services(mesh: Arc<dyn Mesh>, op_timeout: std::time::Duration) -> Result<NodeServices, TransportError> {
    let multicast = MulticastNode::start(mesh.clone(), op_timeout)?;
    let pool = PoolNode::start(mesh, multicast.clone())?;
    Ok(NodeServices { multicast, pool })
}
