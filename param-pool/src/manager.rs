//! The pool manager daemon: the pure [`Pool`](crate::pool::Pool) made durable by a
//! [`MetaStore`], driving the node daemons over the transport.
//!
//! The manager is a member of the cluster (it is not one of the pool's nodes). It turns the
//! pool's actions into work on the nodes — `Create` from surviving copies becomes one chained
//! multicast per model (the blitz planner picks the chains among every ready copy), `Create`
//! from the file becomes an io_uring load on the new copy's node, `Drop` releases a held copy —
//! and feeds the outcomes back as events, until no action is left.
//!
//! A node is declared dead when its link went down and has not come back within
//! `dead_after` (seed paper 004, "Fault tolerance": the monitor's heartbeat). Every event is
//! written ahead to the store, so a manager killed in the middle of a repair recovers its pool on
//! restart, asks every node what it holds, keeps the copies that were completed (after checking
//! their crcs), drops the ones it no longer knows, and re-issues the copies still loading: no
//! copy is duplicated or lost.
//!
//! The manager is a sans-I/O core and a thin driver. The core is the pure pool
//! ([`Pool`](crate::pool::Pool)), the failure detector ([`Detector`]: peer events and the time
//! in, nodes due to be declared dead out) and the policy ([`plan`]: actions into one job per
//! model, the retry budget, reconcile decisions). The driver executes: it writes events ahead
//! (on a blocking thread), runs the jobs of different models concurrently ([`exec`]), and feeds
//! their outcomes back. It reaches the nodes through a [`Mesh`], so the same manager runs on
//! real endpoints and on the `mem` test double with virtual time.
//!
//! Departures from the paper: a copy's location is host memory or GPU 0 of a node (the derived
//! topology has one GPU per node); at most one job per model runs at a time (a model's
//! follow-up copies wait for its running job).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_multicast::cluster::Controller;
use cascade_multicast::MeshRates;
use cascade_transport::{Mesh, PeerEvent};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};
use tracing::{error, info, warn};

use crate::manifest::{Manifest, DEFAULT_CHUNK};
use crate::meta::{DurablePool, Event, MetaError, MetaStore, ModelEntry};
use crate::pool::{Action, CopyId, CopyKind, CopyState, ModelCopy, ModelId, NodeId};

mod admin;
mod check;
mod detector;
mod drain;
pub mod epoch;
pub mod exec;
mod peers;
pub mod plan;
mod report;

pub use admin::{
    admin_call, serve_admin, AdminAddr, AdminCall, AdminError, AdminListener, AdminRequest, Caller, MAX_CONNECTIONS,
    MAX_LINE,
};
pub use detector::Detector;
pub use drain::DrainReport;
pub use report::{CheckReport, CopyStatus, ForeignCopy, ModelStatus, NodeReport, NodeStatus, Status};

/// Why a manager operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// The metadata store failed.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The model file could not be read as a model.
    #[error(transparent)]
    Manifest(#[from] crate::manifest::ManifestError),
    /// A request that cannot be served.
    #[error("{0}")]
    Refused(String),
}

/// Settings of the manager.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The pool's nodes (cluster members holding copies; not the manager itself).
    pub nodes: Vec<NodeId>,
    /// Copies required per model.
    pub k: usize,
    /// How long a node's link may stay down before the node is declared dead.
    pub dead_after: Duration,
    /// Rates the planner assumes for the links (derived topology).
    pub rates: MeshRates,
    /// Snapshot the store after this many events.
    pub snapshot_every: usize,
    /// How long a node may take to answer a request (a checksum, a listing); a multicast's own
    /// limit is this plus the time its bytes take at the assumed rate. A load from the file may
    /// take longer as long as it keeps going: it is given up after this long without progress.
    pub request_timeout: Duration,
    /// How often a running load from the file is asked how far it is (its progress notices).
    pub load_poll: Duration,
    /// How long to wait for the nodes at start-up; a node still missing is declared dead.
    pub ready_timeout: Duration,
    /// Make a new pool in an empty store (`--init`) instead of opening the one it holds.
    pub init: bool,
}

impl ManagerConfig {
    /// Defaults for `nodes`: k = 1, a node is dead 1 s after its link went down, 25 Gbit/s links.
    pub fn new(nodes: Vec<NodeId>) -> ManagerConfig {
        ManagerConfig {
            nodes,
            k: 1,
            dead_after: Duration::from_secs(1),
            rates: MeshRates { nic_gbps: 25.0, tcp_gbps: 25.0, shm_gbps: 100.0, machine_gbps: None },
            snapshot_every: 256,
            request_timeout: Duration::from_secs(120),
            load_poll: exec::LOAD_POLL,
            ready_timeout: Duration::from_secs(30),
            init: false,
        }
    }
}

/// What the manager did, as it happens (for progress bars and timelines).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Notice {
    /// A node was declared dead; its copies are gone.
    NodeDown {
        /// The node.
        node: NodeId,
        /// It had been drained and held nothing: it left, and nothing is repaired.
        drained: bool,
    },
    /// A copy is being made.
    Creating {
        /// The copy.
        copy: CopyId,
        /// Its model.
        model: ModelId,
        /// Its node.
        node: NodeId,
        /// `file` or `multicast`.
        from: &'static str,
        /// Bytes of the model.
        bytes: u64,
    },
    /// Part of a copy is in place: layers `0..=layer` of a multicast arrived and were verified,
    /// or a load from the file placed `bytes` so far.
    Progress {
        /// The copy.
        copy: CopyId,
        /// Its node.
        node: NodeId,
        /// Bytes in place.
        bytes: u64,
        /// Bytes of the model.
        total: u64,
    },
    /// A copy is complete and verified.
    Ready {
        /// The copy.
        copy: CopyId,
        /// Its node.
        node: NodeId,
        /// Its bytes.
        bytes: u64,
    },
    /// A copy could not be made.
    Failed {
        /// The copy.
        copy: CopyId,
        /// Why.
        reason: String,
    },
    /// A copy was released.
    Dropped {
        /// The copy.
        copy: CopyId,
        /// Its node.
        node: NodeId,
        /// Its bytes.
        bytes: u64,
    },
    /// A multicast of a model began moving bytes, `setup_seconds` after it was asked for
    /// (planning, the targets' regions, the senders' links readied).
    Transferring {
        /// The model.
        model: ModelId,
        /// Its targets' nodes.
        nodes: Vec<NodeId>,
        /// Seconds of set-up before the first byte.
        setup_seconds: f64,
    },
    /// A model has no copy and no reachable file.
    Lost {
        /// The model.
        model: ModelId,
        /// Why.
        reason: String,
    },
}

/// The pool manager.
pub struct Manager<S: MetaStore + 'static> {
    io: exec::Io,
    /// `None` only while an event is being written ahead on a blocking thread.
    pool: Option<DurablePool<S>>,
    cfg: ManagerConfig,
    events: broadcast::Receiver<PeerEvent>,
    detector: Detector,
    /// Every copy ever seen, so a dropped copy's node is still known.
    seen: BTreeMap<CopyId, ModelCopy>,
    lost: BTreeMap<ModelId, String>,
    /// Why the manager is degraded (its store refuses writes), if it is.
    degraded: Option<String>,
    /// Other pools' copies the nodes hold, as last listed (reported, never touched).
    foreign: BTreeMap<NodeId, Vec<(String, u64)>>,
    /// Copies whose bytes this manager checked against their manifest (made, or checked since).
    verified: BTreeSet<CopyId>,
    /// Copies the last check found missing or different.
    bad: BTreeSet<CopyId>,
    /// What happened to each node, latest last (at most [`HISTORY`] entries each).
    history: BTreeMap<NodeId, VecDeque<(f64, String)>>,
    /// Time zero of the history.
    since: Instant,
    status: Arc<Mutex<Status>>,
}

/// Entries of history kept per node.
const HISTORY: usize = 32;

/// How often a degraded manager tries its store again.
const DEGRADED_RETRY: Duration = Duration::from_secs(1);

impl<S: MetaStore + 'static> Manager<S> {
    /// Recovers the pool `store` holds (or, with `cfg.init`, makes a new one in an empty store)
    /// on the cluster member `mesh`.
    pub fn open(mesh: Arc<dyn Mesh>, store: S, cfg: ManagerConfig) -> Result<Manager<S>, ManagerError> {
        if cfg.k == 0 {
            return Err(ManagerError::Refused("k must be at least 1".into()));
        }
        let fresh = crate::pool::Pool::new(cfg.k, cfg.nodes.iter().copied());
        let (pool, torn) = if cfg.init {
            (DurablePool::init(store, fresh, cfg.snapshot_every)?, 0)
        } else {
            DurablePool::open(store, fresh, cfg.snapshot_every)?
        };
        info!(pool = pool.id(), "pool opened");
        if torn > 0 {
            warn!(bytes = torn, "recovery cut off a torn tail of the metadata log");
        }
        if pool.pool().k() != cfg.k {
            warn!(stored = pool.pool().k(), asked = cfg.k, "the store's k wins over the configured one");
        }
        let ctl = Controller::new(mesh.clone())
            .map_err(|e| ManagerError::Refused(format!("starting the multicast controller: {e}")))?;
        let status: Arc<Mutex<Status>> = Arc::default();
        let io = exec::Io {
            status: status.clone(),
            ctl: Arc::new(ctl),
            nodes: cfg.nodes.clone(),
            rates: cfg.rates,
            request_timeout: cfg.request_timeout,
            load_poll: cfg.load_poll,
            notices: None,
            epoch: Instant::now(),
            pool: pool.id().to_string(),
            mesh: mesh.clone(),
            failures: Arc::default(),
        };
        let mut m = Manager {
            events: mesh.peer_events(),
            io,
            pool: Some(pool),
            detector: Detector::new(cfg.dead_after),
            cfg,
            seen: BTreeMap::new(),
            lost: BTreeMap::new(),
            degraded: None,
            foreign: BTreeMap::new(),
            history: BTreeMap::new(),
            since: Instant::now(),
            verified: BTreeSet::new(),
            bad: BTreeSet::new(),
            status,
        };
        m.publish();
        Ok(m)
    }

    /// The pool's id (made by `--init`; the nodes keep its copies under it).
    pub fn pool_id(&self) -> &str {
        &self.io.pool
    }

    /// Sends every [`Notice`] to `tx`, with its time since `epoch`.
    pub fn notify(&mut self, tx: mpsc::UnboundedSender<(f64, Notice)>, epoch: Instant) {
        self.io.notices = Some(tx);
        self.io.epoch = epoch;
    }

    /// The latest status, updated after every event (readable while the manager works).
    pub fn status_handle(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    fn durable(&self) -> &DurablePool<S> {
        // The pool is only out while `apply` awaits its blocking write, which holds `&mut self`.
        self.pool.as_ref().unwrap_or_else(|| unreachable!("the pool is back after every apply"))
    }

    fn pool(&self) -> &crate::pool::Pool {
        self.durable().pool()
    }

    fn catalog(&self) -> &BTreeMap<ModelId, ModelEntry> {
        self.durable().catalog()
    }

    fn notice(&self, n: Notice) {
        self.io.notice(n);
    }

    /// The pool's shape in the node's metrics: copies by state and tier, resident bytes by tier.
    fn publish_metrics(&self, s: &Status) {
        let m = self.io.mesh.metrics();
        // Cleared and set again in one step: a scrape in between saw copies but no bytes.
        m.update(|| set_pool_metrics(m, s));
    }

    /// A repair begins (`trigger`: a node's death or the operator's request).
    fn count_repair(&self, trigger: &str) {
        self.io
            .mesh
            .metrics()
            .counter("cascade_pool_repairs", "Repairs of the pool, by trigger", &[("trigger", trigger)])
            .inc();
    }

    fn publish(&mut self) {
        let Some(p) = self.pool.as_ref() else { return };
        for c in p.pool().copies() {
            self.seen.insert(c.id, c.clone());
        }
        let mut s = Status::of(p.pool(), p.catalog(), &self.lost, self.detector.suspects());
        if let Some(why) = &self.degraded {
            s.degraded = Some(why.clone());
            s.healthy = false;
        }
        let known: BTreeSet<CopyId> = s.copies.iter().map(|c| c.id).collect();
        self.verified.retain(|c| known.contains(c));
        self.bad.retain(|c| known.contains(c));
        for c in &mut s.copies {
            c.verified = self.verified.contains(&c.id);
            c.bad = self.bad.contains(&c.id);
        }
        if !self.bad.is_empty() {
            s.healthy = false;
            s.violations.push(format!(
                "{} failed their last check: missing on their node or different from the manifest",
                copies(self.bad.len())
            ));
        }
        s.foreign = self
            .foreign
            .iter()
            .flat_map(|(n, v)| v.iter().map(|(p, c)| report::ForeignCopy { node: *n, pool: p.clone(), copy: *c }))
            .collect();
        self.publish_metrics(&s);
        let mut published = self.status.lock().unwrap_or_else(|e| e.into_inner());
        // A loading copy keeps the progress its multicast reported (written by `Io::notice`).
        let progress: BTreeMap<CopyId, u64> =
            published.copies.iter().filter_map(|c| Some((c.id, c.in_place?))).collect();
        for c in s.copies.iter_mut().filter(|c| c.state == "loading") {
            c.in_place = progress.get(&c.id).copied();
        }
        *published = s;
    }

    /// Writes `e` ahead (fsync on a blocking thread) and applies it.
    async fn apply(&mut self, e: Event) -> Result<Vec<Action>, ManagerError> {
        let Some(mut pool) = self.pool.take() else {
            return Err(ManagerError::Refused("the pool is being written".into()));
        };
        let (pool, r) = tokio::task::spawn_blocking(move || {
            let r = pool.apply(e);
            (pool, r)
        })
        .await
        .map_err(|e| ManagerError::Refused(format!("the metadata writer failed: {e}")))?;
        self.pool = Some(pool);
        self.publish();
        Ok(r?)
    }

    fn model_bytes(&self, model: ModelId) -> u64 {
        self.catalog().get(&model).map_or(0, |e| e.manifest.bytes)
    }

    /// Drops every copy the live nodes hold for other pools — only when the operator asks
    /// (`cascade pool drop-foreign`). Returns how many were dropped.
    pub async fn drop_foreign(&mut self) -> usize {
        let listing = self.io.list(self.pool().live_nodes().collect()).await;
        let drops: Vec<(NodeId, String, CopyId)> =
            listing.foreign.into_iter().flat_map(|(n, v)| v.into_iter().map(move |(p, c)| (n, p, c))).collect();
        let n = drops.len();
        self.io.drop_of(drops).await;
        warn!(copies = n, "dropped other pools' copies, as asked");
        self.foreign.clear();
        self.publish();
        n
    }

    /// Every member node: state, bytes, copies and history (`cascade pool nodes`).
    pub fn nodes_report(&self) -> Vec<report::NodeReport> {
        let bytes = self.pool().bytes_per_node();
        self.pool()
            .members()
            .map(|(n, live)| {
                let state = if !live {
                    if self.detector.returning().contains_key(&n) {
                        "returning"
                    } else {
                        "dead"
                    }
                } else if self.detector.suspects().contains_key(&n) {
                    "suspect"
                } else if self.pool().is_draining(n) {
                    if self.pool().copies().any(|c| c.node == n) {
                        "draining"
                    } else {
                        "drained"
                    }
                } else {
                    "live"
                };
                report::NodeReport {
                    id: n,
                    state: state.into(),
                    bytes: bytes.get(&n).copied().unwrap_or(0),
                    copies: self.pool().copies().filter(|c| c.node == n).count(),
                    draining: self.pool().is_draining(n),
                    history: self.history.get(&n).map(|h| h.iter().cloned().collect()).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// Waits for the pool's live nodes; declares the missing ones dead, reconciles what every node
    /// holds with the recovered pool, and finishes the work a previous run left.
    pub async fn start(&mut self) -> Result<(), ManagerError> {
        let want: BTreeSet<NodeId> = self.pool().live_nodes().collect();
        let deadline = tokio::time::Instant::now() + self.cfg.ready_timeout;
        while tokio::time::Instant::now() < deadline && !want.iter().all(|n| self.connected(*n)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut actions = Vec::new();
        for n in want {
            if !self.connected(n) {
                warn!(node = n, "a node did not join within the ready timeout");
                actions.extend(self.declare_dead(n).await?);
            }
        }
        self.drive(actions).await?;
        let rep = self.reconcile().await?;
        info!(kept = rep.0, dropped = rep.1, reissued = rep.2, "reconciled the nodes with the pool");
        // Members declared dead (by this run or an earlier one) that are connected now wait for
        // re-admission like any returning node.
        let now = tokio::time::Instant::now();
        for (n, live) in self.pool().members().collect::<Vec<_>>() {
            if !live && self.connected(n) {
                self.detector.dead_link_up(now, n);
                self.remember(n, "connected at start-up although declared dead; waiting before re-admission".into());
            }
        }
        Ok(())
    }

    /// Asks every live node what it holds: completed copies still loading in the pool are checked
    /// and marked ready, this pool's copies it has no record of (made after the last record a
    /// crash cut off) are dropped, and the copies still missing are made again. Other pools'
    /// copies are reported and left alone. Returns (kept, dropped, re-issued).
    async fn reconcile(&mut self) -> Result<(usize, usize, usize), ManagerError> {
        let listing = self.io.list(self.pool().live_nodes().collect()).await;
        for (node, v) in &listing.foreign {
            warn!(
                node,
                copies = v.len(),
                "the node holds copies of another pool: left alone (see `cascade pool status`)"
            );
        }
        self.foreign = listing.foreign;
        for (n, cap) in listing.capacity {
            if self.pool().capacity(n) != cap {
                info!(node = n, capacity = ?cap, "the node's capacity for the pool");
                self.apply(Event::Capacity { node: n, bytes: cap }).await?;
            }
        }
        self.publish();
        let held = listing.ours;
        let r = plan::reconcile(self.pool(), &held);
        for (node, id) in &r.unknown {
            info!(node, copy = id, "dropping a copy the pool does not know");
        }
        let dropped = r.unknown.len();
        self.io.drop_all(r.unknown).await;
        let mut actions = Vec::new();
        for c in &r.missing {
            warn!(copy = c.id, node = c.node, model = c.model, "a copy the pool counts on is gone from its node");
            actions.extend(self.apply(Event::CopyFailed(c.id)).await?);
        }
        let sums = self.io.check(self.with_crcs(&r.check)).await;
        let (mut kept, mut reissue) = (0, r.reissue);
        for c in r.check {
            if sums.get(&c.id).copied().unwrap_or(false) {
                kept += 1;
                self.verified.insert(c.id);
                self.notice(Notice::Ready { copy: c.id, node: c.node, bytes: self.model_bytes(c.model) });
                actions.extend(self.apply(Event::CopyReady(c.id)).await?);
            } else {
                reissue.push(c);
            }
        }
        let n = reissue.len();
        actions.extend(plan::reissue(self.pool(), reissue));
        self.drive(actions).await?;
        Ok((kept, dropped, n))
    }

    /// Each copy with what its check needs: model bytes, chunk size and the manifest's crcs.
    fn with_crcs(&self, copies: &[ModelCopy]) -> Vec<(ModelCopy, u64, u64, Vec<u32>)> {
        copies
            .iter()
            .filter_map(|c| {
                let m = &self.catalog().get(&c.model)?.manifest;
                Some((c.clone(), m.bytes, m.chunk, m.chunk_crcs.clone()))
            })
            .collect()
    }

    /// Registers the safetensors file at `path` as model `name`; its first k copies are loaded
    /// from the file. Returns the model's id.
    pub async fn register(&mut self, name: &str, path: &Path) -> Result<ModelId, ManagerError> {
        self.register_as(name, path, Caller::Operator).await
    }

    /// As [`Manager::register`], for `caller`: a local user may only register a file it could
    /// read itself (the manager, often root, reads it on the caller's behalf).
    pub async fn register_as(&mut self, name: &str, path: &Path, caller: Caller) -> Result<ModelId, ManagerError> {
        if let Caller::Local { uid, gid } = caller {
            let p = path.to_path_buf();
            tokio::task::spawn_blocking(move || admin::may_read(uid, gid, &p))
                .await
                .map_err(|e| ManagerError::Refused(format!("checking the file's permissions: {e}")))?
                .map_err(ManagerError::Refused)?;
        }
        if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            return Err(ManagerError::Refused(format!(
                "model name {:?}: 1 to 128 characters, none of them control characters",
                name.escape_debug().to_string()
            )));
        }
        // Refused before anything is written (or the file read): a refused register leaves no
        // trace. Room for the model's bytes is checked once they are known, below.
        self.pool().can_place(0).map_err(|e| ManagerError::Refused(e.to_string()))?;
        if self.catalog().values().any(|e| e.manifest.name == name) {
            return Err(ManagerError::Refused(format!("a model named {name:?} is registered already")));
        }
        let (p, n) = (path.to_path_buf(), name.to_string());
        let manifest = tokio::task::spawn_blocking(move || Manifest::from_file(&p, &n, DEFAULT_CHUNK))
            .await
            .map_err(|e| ManagerError::Refused(format!("reading the manifest: {e}")))??;
        if let Some((id, e)) = self.catalog().iter().find(|(_, e)| e.manifest.content_hash == manifest.content_hash) {
            return Err(ManagerError::Refused(format!(
                "{} has the same content as model {id} ({:?})",
                path.display(),
                e.manifest.name
            )));
        }
        let model = self.catalog().keys().next_back().map_or(1, |m| m + 1);
        let bytes = manifest.bytes;
        // Refused before anything is written: a refused register leaves no trace.
        self.pool().can_place(bytes).map_err(|e| ManagerError::Refused(e.to_string()))?;
        let entry = ModelEntry { path: path.display().to_string(), manifest };
        self.apply(Event::Describe { model, entry: Box::new(entry) }).await?;
        let actions = self.apply(Event::Register { model, bytes, file_reachable: true }).await?;
        info!(model, name, bytes, "registered a model");
        self.drive(actions).await?;
        let ready = self.ready_copies(model, |_| true);
        if ready < self.pool().k() {
            return Err(ManagerError::Refused(format!(
                "model {model} is registered, but only {ready} of its k = {} copies could be made \
                 (see `cascade pool status`; `cascade pool repair` retries)",
                self.pool().k()
            )));
        }
        Ok(model)
    }

    /// Starts a serving instance of `model` on GPU `gpu` of `node` (from the pool's copies); one
    /// already there is the answer (a second copy at its place could never be made: the
    /// multicast refused a target that is also its source).
    pub async fn deploy(&mut self, model: ModelId, node: NodeId, gpu: u32) -> Result<(), ManagerError> {
        if self.ready_copies(model, |c| c.node == node && c.kind == CopyKind::Gpu(gpu)) > 0 {
            return Ok(());
        }
        let actions = self.apply(Event::Deploy { model, node, gpu }).await?;
        self.drive(actions).await?;
        if self.ready_copies(model, |c| c.node == node && c.kind == CopyKind::Gpu(gpu)) == 0 {
            // Why its last attempt failed, when a node or the multicast said so.
            let place = |id: &CopyId| {
                self.seen.get(id).is_some_and(|c| c.model == model && c.node == node && c.kind == CopyKind::Gpu(gpu))
            };
            let failures = self.io.failures.lock().unwrap_or_else(|e| e.into_inner());
            let why = failures.iter().rev().find(|(id, _)| place(id)).map(|(_, why)| why.clone());
            return Err(ManagerError::Refused(match why {
                Some(why) => format!("the instance of model {model} on node {node} gpu{gpu} could not be made: {why}"),
                None => format!(
                    "the instance of model {model} on node {node} gpu{gpu} could not be made (see the manager's log)"
                ),
            }));
        }
        Ok(())
    }

    /// Ready copies of `model` that `pick` accepts.
    fn ready_copies(&self, model: ModelId, pick: impl Fn(&ModelCopy) -> bool) -> usize {
        self.pool().copies().filter(|c| c.model == model && c.state == CopyState::Ready && pick(c)).count()
    }

    /// Deploys `model` on GPU 0 of each of `nodes` at once: one multicast. All or none: a node
    /// the pool refuses (dead, full, unknown) refuses the whole scale-out and nothing starts
    /// (deploying node by node left the copies of the nodes before it loading, with nobody to
    /// make them). One metadata record for all the nodes. A node listed twice is refused before
    /// anything is recorded (it asked for two instances on the node's GPU 0).
    pub async fn scale_out(&mut self, model: ModelId, nodes: &[NodeId]) -> Result<(), ManagerError> {
        if let Some((first, i)) = first_repeat(nodes) {
            return Err(ManagerError::Refused(format!(
                "node {} is listed twice in model {model}'s scale-out (at {first} and {i}): nothing was started",
                nodes[i]
            )));
        }
        let actions = self.apply(Event::DeployAll { model, nodes: nodes.to_vec(), gpu: 0 }).await?;
        self.drive(actions).await
    }

    /// Asks for a copy to go; the pool copies first where the invariant needs it.
    pub async fn reclaim(&mut self, copy: CopyId) -> Result<(), ManagerError> {
        let actions = self.apply(Event::Reclaim(copy)).await?;
        self.drive(actions).await
    }

    /// Performs `actions` and everything they lead to. Jobs of different models run
    /// concurrently; nodes that die meanwhile are declared dead and repaired in the same drive.
    async fn drive(&mut self, actions: Vec<Action>) -> Result<(), ManagerError> {
        let mut work: VecDeque<Action> = actions.into();
        let mut creates = BTreeMap::new();
        let mut busy: BTreeSet<ModelId> = BTreeSet::new();
        let mut retries = plan::Retries::default();
        // Follow-ups of copies that failed while a node was suspect: held until the detector
        // decides (a source on a suspect node fails every attempt until it is declared dead).
        let mut deferred: Vec<Action> = Vec::new();
        let mut running: tokio::task::JoinSet<exec::Outcome> = tokio::task::JoinSet::new();
        loop {
            if self.detector.suspects().is_empty() {
                work.extend(deferred.drain(..));
            }
            let batch = plan::split(work.drain(..));
            let drops: Vec<(NodeId, CopyId)> = batch
                .drops
                .iter()
                .filter_map(|id| self.seen.get(id))
                .filter(|c| self.connected(c.node))
                .map(|c| (c.node, c.id))
                .collect();
            for &(node, copy) in &drops {
                let bytes = self.seen.get(&copy).map_or(0, |c| self.model_bytes(c.model));
                self.notice(Notice::Dropped { copy, node, bytes });
            }
            self.io.drop_all(drops).await;
            for (model, reason) in batch.lost {
                error!(model, %reason, "model lost");
                self.notice(Notice::Lost { model, reason: reason.clone() });
                self.lost.insert(model, reason);
                self.publish();
            }
            for (k, mut g) in batch.creates {
                creates.entry(k).or_insert_with(Vec::new).append(&mut g);
            }
            for ((model, file), group) in plan::startable(&mut creates, &busy) {
                match plan::job(self.pool(), self.catalog(), model, file, &group, |n| self.io.connected(n)) {
                    Ok(job) => {
                        busy.insert(model);
                        running.spawn(self.io.clone().run(job));
                    }
                    Err(why) => {
                        for (c, _) in &group {
                            self.notice(Notice::Failed { copy: c.id, reason: why.clone() });
                            let next = self.failed(c.id, model, &mut retries).await?;
                            self.follow_up(next, &mut work, &mut deferred);
                        }
                    }
                }
            }
            if !work.is_empty() {
                continue;
            }
            if running.is_empty() && deferred.is_empty() {
                if creates.is_empty() {
                    return Ok(());
                }
                continue;
            }
            // Wait for a job to end, or for a node to be due (a death during a repair).
            let due = self.detector.poll_timeout();
            tokio::select! {
                done = running.join_next(), if !running.is_empty() => {
                    let Some(done) = done else { continue };
                    let out = done.map_err(|e| ManagerError::Refused(format!("a job failed: {e}")))?;
                    busy.remove(&out.model);
                    if out.file_missing {
                        warn!(model = out.model, "the model file is gone: repairs can no longer fall back to it");
                        self.apply(Event::FileReachable { model: out.model, reachable: false }).await?;
                    }
                    for (copy, ok) in out.copies {
                        // The pool may have moved on while the job ran (its node died, say).
                        if !self.pool().copies().any(|c| c.id == copy && c.state == CopyState::Loading) {
                            info!(copy, ok, "a job's outcome for a copy the pool no longer makes");
                            continue;
                        }
                        if ok {
                            // Loads check every chunk's crc32, multicast targets are verified
                            // before they are adopted.
                            self.verified.insert(copy);
                            work.extend(self.apply(Event::CopyReady(copy)).await?);
                        } else {
                            let next = self.failed(copy, out.model, &mut retries).await?;
                            self.follow_up(next, &mut work, &mut deferred);
                        }
                    }
                }
                ev = self.events.recv() => self.note_peer_result(ev),
                _ = sleep_until(due) => {}
            }
            work.extend(self.poll_peers().await?);
        }
    }

    /// A copy could not be made: the pool re-plans it, until the model's retry budget is spent.
    /// Failures while a node is suspect do not count: they wait for the detector's verdict.
    async fn failed(
        &mut self,
        copy: CopyId,
        model: ModelId,
        retries: &mut plan::Retries,
    ) -> Result<Vec<Action>, ManagerError> {
        let next = self.apply(Event::CopyFailed(copy)).await?;
        if !self.detector.suspects().is_empty() || retries.failed(model) {
            Ok(next)
        } else {
            error!(model, "giving up on this model's copies after repeated failures (see `cascade pool repair`)");
            Ok(Vec::new())
        }
    }

    /// Where a failed copy's follow-ups go: straight back to work, or held while a node is suspect.
    fn follow_up(&self, next: Vec<Action>, work: &mut VecDeque<Action>, deferred: &mut Vec<Action>) {
        if self.detector.suspects().is_empty() {
            work.extend(next);
        } else {
            deferred.extend(next);
        }
    }

    /// Serves admin requests and peer events until `admin` closes.
    ///
    /// A store that refuses writes (a full disk, a failing etcd) does not stop the manager: it
    /// reports itself degraded (`Status::degraded`), does nothing it could not write ahead — every
    /// event is logged before it is applied, so a refused write changes nothing — and tries its
    /// store again every second. When a write goes through it picks up what was interrupted: the
    /// nodes it could not declare dead are suspects again, and unfinished copies are reconciled.
    pub async fn run(mut self, mut admin: mpsc::Receiver<AdminCall>) -> Result<(), ManagerError> {
        loop {
            let due = self.detector.poll_timeout();
            let retry = self.degraded.is_some();
            tokio::select! {
                call = admin.recv() => {
                    let Some(call) = call else { return Ok(()) };
                    let res = self.serve(call.request, call.caller).await;
                    if let Err(e) = &res {
                        self.store_failed(e);
                    }
                    let _ = call.reply.send(res.map_err(|e| e.to_string()));
                }
                // poll_peers below publishes the new status.
                ev = self.events.recv() => self.note_peer_result(ev),
                _ = sleep_until(due) => {}
                _ = tokio::time::sleep(DEGRADED_RETRY), if retry => {
                    if let Err(e) = self.resume().await {
                        if !self.store_failed(&e) {
                            return Err(e);
                        }
                    }
                }
            }
            let step = match self.poll_peers().await {
                Ok(actions) => self.drive(actions).await,
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                if !self.store_failed(&e) {
                    return Err(e);
                }
            }
        }
    }

    /// Whether `e` is the store refusing a write; if so the manager is degraded until a write
    /// goes through again.
    fn store_failed(&mut self, e: &ManagerError) -> bool {
        let ManagerError::Meta(m @ (MetaError::Io { .. } | MetaError::Poisoned(_))) = e else { return false };
        if self.degraded.is_none() {
            error!(error = %m, "the metadata store refuses writes: degraded until it recovers");
        }
        self.degraded = Some(m.to_string());
        self.publish();
        true
    }

    /// Tries the store again after a degraded spell: the nodes that lost their links are suspects
    /// again (their deaths may not have been written), and unfinished copies are reconciled.
    async fn resume(&mut self) -> Result<(), ManagerError> {
        let Some(why) = self.degraded.clone() else { return Ok(()) };
        self.recheck_links();
        let mut actions = Vec::new();
        // A write the store takes proves it writable again (it records a fact already true).
        for n in self.pool().live_nodes().filter(|n| self.connected(*n)).take(1).collect::<Vec<_>>() {
            actions.extend(self.apply(Event::NodeUp(n)).await?);
        }
        self.degraded = None;
        info!(was = %why, "the metadata store takes writes again; resuming");
        self.drive(actions).await?;
        self.reconcile().await?;
        self.publish();
        Ok(())
    }

    async fn serve(&mut self, req: AdminRequest, caller: Caller) -> Result<serde_json::Value, ManagerError> {
        match req {
            AdminRequest::Status => Ok(to_json(&*self.status.lock().unwrap_or_else(|e| e.into_inner()))),
            AdminRequest::Check => Ok(to_json(&self.check().await?)),
            AdminRequest::Nodes => Ok(to_json(&self.nodes_report())),
            AdminRequest::DropForeign => Ok(serde_json::json!({ "dropped": self.drop_foreign().await })),
            AdminRequest::Repair => Ok(to_json(&self.repair().await?)),
            AdminRequest::Register { name, path } => {
                let id = self.register_as(&name, Path::new(&path), caller).await?;
                Ok(serde_json::json!({ "model": id }))
            }
            AdminRequest::Deploy { model, node, gpu } => {
                self.deploy(model, node, gpu).await?;
                Ok(serde_json::json!({}))
            }
            AdminRequest::Reclaim { copy } => {
                self.reclaim(copy).await?;
                Ok(serde_json::json!({}))
            }
            AdminRequest::Drain { node } => Ok(to_json(&self.drain(node).await?)),
            AdminRequest::Undrain { node } => {
                self.undrain(node).await?;
                Ok(serde_json::json!({}))
            }
            AdminRequest::ApplyEpoch { moves } => {
                self.apply_epoch(&moves).await?;
                Ok(serde_json::json!({ "moved": moves.len() }))
            }
        }
    }
}

/// Sleeps until `t`, or forever without one.
async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// A JSON value of plain data (serializing it cannot fail).
fn to_json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or_default()
}

/// The pool's shape in the node's metrics (see `publish_metrics`).
fn set_pool_metrics(m: &cascade_transport::Metrics, s: &Status) {
    let tier = |kind: &str| if kind == "host" { "host" } else { "gpu" };
    let bytes: BTreeMap<ModelId, u64> = s.models.iter().map(|x| (x.id, x.bytes)).collect();
    m.clear_gauge("cascade_pool_copies");
    m.clear_gauge("cascade_pool_resident_bytes");
    let mut copies: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    let mut resident: BTreeMap<&str, f64> = BTreeMap::from([("host", 0.0), ("gpu", 0.0)]);
    for c in &s.copies {
        *copies.entry((c.state.as_str(), tier(&c.kind))).or_default() += 1.0;
        if c.state == "ready" {
            *resident.entry(tier(&c.kind)).or_default() += bytes.get(&c.model).copied().unwrap_or(0) as f64;
        }
    }
    for ((state, tier), n) in copies {
        m.gauge("cascade_pool_copies", "Copies in the pool, by state and tier", &[("state", state), ("tier", tier)])
            .set(n);
    }
    for (tier, b) in resident {
        m.gauge("cascade_pool_resident_bytes", "Bytes of ready copies, by tier", &[("tier", tier)]).set(b);
    }
    m.gauge("cascade_pool_models", "Models registered in the pool", &[]).set(s.models.len() as f64);
    m.gauge("cascade_pool_healthy", "1 when the pool is healthy (see cascade pool status)", &[]).set(if s.healthy {
        1.0
    } else {
        0.0
    });
}

/// The first element of `v` equal to an earlier one: (the earlier one's index, its own).
fn first_repeat<T: PartialEq>(v: &[T]) -> Option<(usize, usize)> {
    v.iter().enumerate().find_map(|(i, x)| v[..i].iter().position(|y| y == x).map(|first| (first, i)))
}

/// "1 copy", "2 copies" (for what the manager tells about copies).
fn copies(n: usize) -> String {
    format!("{n} {}", if n == 1 { "copy" } else { "copies" })
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_drain;
#[cfg(test)]
mod tests_load;
#[cfg(test)]
mod tests_mem;
