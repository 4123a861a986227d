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
//! Departures from the paper: the manager runs its work one model at a time (multicasts of
//! different models do not overlap), and a copy's location is host memory or GPU 0 of a node
//! (the derived topology has one GPU per node).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_multicast::cluster::{Controller, RunSpec};
use cascade_multicast::executor::new_run_id;
use cascade_multicast::{Event as McEvent, Loc, MeshRates, PlannerKind, Topology};
use cascade_transport::{Endpoint, PeerEvent, ServiceExt};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};
use tracing::{error, info, warn};

use crate::manifest::{Manifest, DEFAULT_CHUNK};
use crate::meta::{DurablePool, Event, MetaError, MetaStore, ModelEntry};
use crate::node::PoolMsg;
use crate::pool::{Action, Copy, CopyId, CopyKind, CopyState, ModelId, NodeId, Source};

mod admin;
mod report;

pub use admin::{admin_call, serve_admin, AdminCall, AdminRequest};
pub use report::{CheckReport, CopyStatus, ModelStatus, NodeStatus, Status};

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
    /// How long a node may take to answer a request (a load or a checksum); a multicast's own
    /// limit is this plus the time its bytes take at the assumed rate.
    pub request_timeout: Duration,
    /// How long to wait for the nodes at start-up; a node still missing is declared dead.
    pub ready_timeout: Duration,
}

impl ManagerConfig {
    /// Defaults for `nodes`: k = 1, a node is dead 1 s after its link went down, 25 Gbit/s links.
    pub fn new(nodes: Vec<NodeId>) -> ManagerConfig {
        ManagerConfig {
            nodes,
            k: 1,
            dead_after: Duration::from_secs(1),
            rates: MeshRates { nic_gbps: 25.0, tcp_gbps: 25.0, shm_gbps: 100.0 },
            snapshot_every: 256,
            request_timeout: Duration::from_secs(120),
            ready_timeout: Duration::from_secs(30),
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
    /// Layers `0..=layer` of a copy arrived (multicast only).
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
    /// A model has no copy and no reachable file.
    Lost {
        /// The model.
        model: ModelId,
        /// Why.
        reason: String,
    },
}

/// The pool manager.
pub struct Manager<S: MetaStore> {
    ep: Arc<Endpoint>,
    pool: DurablePool<S>,
    cfg: ManagerConfig,
    ctl: Controller,
    events: broadcast::Receiver<PeerEvent>,
    /// Nodes whose link went down, and when.
    suspects: BTreeMap<NodeId, Instant>,
    /// Every copy ever seen, so a dropped copy's node is still known.
    seen: BTreeMap<CopyId, Copy>,
    lost: BTreeMap<ModelId, String>,
    status: Arc<Mutex<Status>>,
    notices: Option<mpsc::UnboundedSender<(f64, Notice)>>,
    epoch: Instant,
}

fn loc_of(c: &Copy) -> Loc {
    match c.kind {
        CopyKind::Gpu(g) => Loc::gpu(c.node, g),
        CopyKind::HostCache => Loc::host(c.node),
    }
}

impl<S: MetaStore> Manager<S> {
    /// Recovers the pool from `store` (or starts an empty one) on the cluster member `ep`.
    pub fn open(ep: Arc<Endpoint>, store: S, cfg: ManagerConfig) -> Result<Manager<S>, ManagerError> {
        let fresh = crate::pool::Pool::new(cfg.k, cfg.nodes.iter().copied());
        let (pool, torn) = DurablePool::open(store, fresh, cfg.snapshot_every)?;
        if torn > 0 {
            warn!(bytes = torn, "recovery cut off a torn tail of the metadata log");
        }
        if pool.pool().k() != cfg.k.max(1) {
            warn!(stored = pool.pool().k(), asked = cfg.k, "the store's k wins over the configured one");
        }
        let mut m = Manager {
            events: ep.events(),
            ctl: Controller::new(ep.clone())
                .map_err(|e| ManagerError::Refused(format!("starting the controller: {e}")))?,
            ep,
            pool,
            cfg,
            suspects: BTreeMap::new(),
            seen: BTreeMap::new(),
            lost: BTreeMap::new(),
            status: Arc::default(),
            notices: None,
            epoch: Instant::now(),
        };
        m.publish();
        Ok(m)
    }

    /// Sends every [`Notice`] to `tx`, with its time since `epoch`.
    pub fn notify(&mut self, tx: mpsc::UnboundedSender<(f64, Notice)>, epoch: Instant) {
        self.notices = Some(tx);
        self.epoch = epoch;
    }

    /// The latest status, updated after every event (readable while the manager works).
    pub fn status_handle(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    fn notice(&self, n: Notice) {
        if let Some(tx) = &self.notices {
            let _ = tx.send((self.epoch.elapsed().as_secs_f64(), n));
        }
    }

    fn publish(&mut self) {
        for c in self.pool.pool().copies() {
            self.seen.insert(c.id, c.clone());
        }
        let s = Status::of(self.pool.pool(), self.pool.catalog(), &self.lost, &self.suspects);
        *self.status.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    fn apply(&mut self, e: Event) -> Result<Vec<Action>, ManagerError> {
        let actions = self.pool.apply(e)?;
        self.publish();
        Ok(actions)
    }

    fn model_bytes(&self, model: ModelId) -> u64 {
        self.pool.catalog().get(&model).map_or(0, |e| e.manifest.bytes)
    }

    /// Waits for the pool's live nodes; declares the missing ones dead, reconciles what every node
    /// holds with the recovered pool, and finishes the work a previous run left.
    pub async fn start(&mut self) -> Result<(), ManagerError> {
        let want: BTreeSet<NodeId> = self.pool.pool().live_nodes().collect();
        let deadline = Instant::now() + self.cfg.ready_timeout;
        while Instant::now() < deadline && !want.iter().all(|n| self.connected(*n)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut actions = Vec::new();
        for n in want {
            if !self.connected(n) {
                warn!(node = n, "a node did not join within the ready timeout: declaring it dead");
                self.notice(Notice::NodeDown { node: n });
                actions.extend(self.apply(Event::NodeDown(n))?);
            }
        }
        self.drive(actions).await?;
        let rep = self.reconcile().await?;
        info!(kept = rep.0, dropped = rep.1, reissued = rep.2, "reconciled the nodes with the pool");
        Ok(())
    }

    fn connected(&self, n: NodeId) -> bool {
        self.ep.link(n).is_ok()
    }

    /// Asks every live node what it holds: completed copies still loading in the pool are checked
    /// and marked ready, unknown copies are dropped, and the copies still missing are made again.
    /// Returns (kept, dropped, re-issued).
    async fn reconcile(&mut self) -> Result<(usize, usize, usize), ManagerError> {
        let held = self.list_all().await;
        let mut unknown = Vec::new();
        for (&node, ids) in &held {
            for &id in ids {
                let known = self.pool.pool().copies().any(|c| c.id == id && c.node == node);
                if !known {
                    info!(node, copy = id, "dropping a copy the pool does not know");
                    unknown.push((node, id));
                }
            }
        }
        let dropped = unknown.len();
        self.drop_on(unknown).await;
        let loading: Vec<Copy> = self.pool.pool().copies().filter(|c| c.state == CopyState::Loading).cloned().collect();
        let (mut kept, mut actions) = (0, Vec::new());
        let mut reissue = Vec::new();
        for c in loading {
            let there = held.get(&c.node).is_some_and(|ids| ids.contains(&c.id));
            if there && self.copy_matches(&c).await {
                kept += 1;
                self.notice(Notice::Ready { copy: c.id, node: c.node, bytes: self.model_bytes(c.model) });
                actions.extend(self.apply(Event::CopyReady(c.id))?);
            } else {
                reissue.push(c);
            }
        }
        let n = reissue.len();
        actions.extend(self.pending(reissue));
        self.drive(actions).await?;
        Ok((kept, dropped, n))
    }

    /// `Create` actions for copies still loading, from the model's current sources.
    fn pending(&self, copies: Vec<Copy>) -> Vec<Action> {
        copies.into_iter().map(|c| Action::Create { from: self.pool.pool().sources(c.model), copy: c }).collect()
    }

    fn alive(&self, n: NodeId) -> bool {
        self.pool.pool().live_nodes().any(|x| x == n)
    }

    /// Asks `nodes` the same kind of question at once; answers in the order asked.
    async fn ask_all(&self, asks: Vec<(NodeId, PoolMsg)>) -> Vec<Result<PoolMsg, String>> {
        let mut set = tokio::task::JoinSet::new();
        for (i, (node, m)) in asks.into_iter().enumerate() {
            let (ep, limit) = (self.ep.clone(), self.cfg.request_timeout);
            set.spawn(async move {
                // A `Failed` answer or a transport error is an `Err` with its text.
                let r = match ep.call(node, &m, limit).await {
                    Ok(PoolMsg::Failed { message }) => Err(message),
                    Ok(r) => Ok(r),
                    Err(e) => Err(e.to_string()),
                };
                (i, r)
            });
        }
        let mut out: Vec<(usize, Result<PoolMsg, String>)> = Vec::new();
        while let Some(r) = set.join_next().await {
            match r {
                Ok(x) => out.push(x),
                Err(e) => warn!(error = %e, "a request task failed"),
            }
        }
        out.sort_by_key(|(i, _)| *i);
        out.into_iter().map(|(_, r)| r).collect()
    }

    /// Drops copies on their nodes and waits for the answers (a later request then never sees
    /// them).
    async fn drop_on(&self, drops: Vec<(NodeId, CopyId)>) {
        let asks = drops.iter().map(|(n, c)| (*n, PoolMsg::Drop { copy: *c })).collect();
        for ((node, copy), r) in drops.iter().zip(self.ask_all(asks).await) {
            if let Err(e) = r {
                warn!(node, copy, error = %e, "dropping a copy failed");
            }
        }
    }

    async fn list_all(&self) -> BTreeMap<NodeId, Vec<u64>> {
        let nodes: Vec<NodeId> = self.pool.pool().live_nodes().filter(|n| self.connected(*n)).collect();
        let answers = self.ask_all(nodes.iter().map(|n| (*n, PoolMsg::List)).collect()).await;
        nodes
            .into_iter()
            .zip(answers)
            .filter_map(|(n, r)| match r {
                Ok(PoolMsg::Listed { copies }) => Some((n, copies)),
                _ => None,
            })
            .collect()
    }

    /// Whether the node holds `c` with every chunk's crc32 as its manifest says.
    async fn copy_matches(&self, c: &Copy) -> bool {
        self.check_copies(std::slice::from_ref(c)).await.get(&c.id).copied().unwrap_or(false)
    }

    /// Checksums `copies` on their nodes: copy → whether every chunk matches its manifest.
    async fn check_copies(&self, copies: &[Copy]) -> BTreeMap<CopyId, bool> {
        let mut asked = Vec::new();
        let mut asks = Vec::new();
        for c in copies {
            let Some(e) = self.pool.catalog().get(&c.model) else { continue };
            let m = &e.manifest;
            asks.push((c.node, PoolMsg::Check { copy: c.id, bytes: m.bytes, chunk: m.chunk }));
            asked.push(c);
        }
        let answers = self.ask_all(asks).await;
        let mut out: BTreeMap<CopyId, bool> = copies.iter().map(|c| (c.id, false)).collect();
        for (c, r) in asked.into_iter().zip(answers) {
            let want = self.pool.catalog().get(&c.model).map(|e| &e.manifest.chunk_crcs);
            let ok = matches!(r, Ok(PoolMsg::Checked { crcs: Some(ref got) }) if Some(got) == want);
            out.insert(c.id, ok);
        }
        out
    }

    /// Registers the safetensors file at `path` as model `name`; its first k copies are loaded
    /// from the file. Returns the model's id.
    pub async fn register(&mut self, name: &str, path: &Path) -> Result<ModelId, ManagerError> {
        if self.pool.catalog().values().any(|e| e.manifest.name == name) {
            return Err(ManagerError::Refused(format!("a model named {name:?} is registered already")));
        }
        let (p, n) = (path.to_path_buf(), name.to_string());
        let manifest = tokio::task::spawn_blocking(move || Manifest::from_file(&p, &n, DEFAULT_CHUNK))
            .await
            .map_err(|e| ManagerError::Refused(format!("reading the manifest: {e}")))??;
        if let Some((id, e)) =
            self.pool.catalog().iter().find(|(_, e)| e.manifest.content_hash == manifest.content_hash)
        {
            return Err(ManagerError::Refused(format!(
                "{} has the same content as model {id} ({:?})",
                path.display(),
                e.manifest.name
            )));
        }
        let model = self.pool.catalog().keys().next_back().map_or(1, |m| m + 1);
        let bytes = manifest.bytes;
        let entry = ModelEntry { path: path.display().to_string(), manifest };
        self.apply(Event::Describe { model, entry: Box::new(entry) })?;
        let actions = self.apply(Event::Register { model, bytes, file_reachable: true })?;
        info!(model, name, bytes, "registered a model");
        self.drive(actions).await?;
        Ok(model)
    }

    /// Starts a serving instance of `model` on GPU `gpu` of `node` (from the pool's copies).
    pub async fn deploy(&mut self, model: ModelId, node: NodeId, gpu: u32) -> Result<(), ManagerError> {
        let actions = self.apply(Event::Deploy { model, node, gpu })?;
        self.drive(actions).await
    }

    /// Deploys `model` on GPU 0 of each of `nodes` at once: one multicast.
    pub async fn scale_out(&mut self, model: ModelId, nodes: &[NodeId]) -> Result<(), ManagerError> {
        let mut actions = Vec::new();
        for &n in nodes {
            actions.extend(self.apply(Event::Deploy { model, node: n, gpu: 0 })?);
        }
        self.drive(actions).await
    }

    /// Asks for a copy to go; the pool copies first where the invariant needs it.
    pub async fn reclaim(&mut self, copy: CopyId) -> Result<(), ManagerError> {
        let actions = self.apply(Event::Reclaim(copy))?;
        self.drive(actions).await
    }

    /// Performs `actions` and everything they lead to.
    async fn drive(&mut self, actions: Vec<Action>) -> Result<(), ManagerError> {
        let mut work: VecDeque<Action> = actions.into();
        let mut failures: BTreeMap<ModelId, u32> = BTreeMap::new();
        while !work.is_empty() {
            let batch: Vec<Action> = work.drain(..).collect();
            let mut creates: BTreeMap<(ModelId, bool), Vec<(Copy, Source)>> = BTreeMap::new();
            for a in batch {
                match a {
                    Action::Drop { copy } => self.drop_copy(copy).await,
                    Action::Lost { model, reason } => {
                        error!(model, %reason, "model lost");
                        self.notice(Notice::Lost { model, reason: reason.clone() });
                        self.lost.insert(model, reason);
                        self.publish();
                    }
                    Action::Create { copy, from } => {
                        let file = from == Source::File;
                        creates.entry((copy.model, file)).or_default().push((copy, from));
                    }
                }
            }
            for ((model, file), group) in creates {
                let outcomes =
                    if file { self.load_from_file(model, &group).await } else { self.multicast(model, &group).await };
                for (copy, ok) in outcomes {
                    let next = if ok {
                        self.apply(Event::CopyReady(copy))?
                    } else {
                        let f = failures.entry(model).or_default();
                        *f += 1;
                        let next = self.apply(Event::CopyFailed(copy))?;
                        if *f > 3 {
                            error!(
                                model,
                                "giving up on this model's copies after repeated failures (see `cascade pool repair`)"
                            );
                            continue;
                        }
                        next
                    };
                    work.extend(next);
                }
            }
            // Nodes that died meanwhile.
            for a in self.poll_peers()? {
                work.push_back(a);
            }
        }
        Ok(())
    }

    async fn drop_copy(&mut self, id: CopyId) {
        let Some(c) = self.seen.get(&id).cloned() else { return };
        if self.connected(c.node) {
            self.drop_on(vec![(c.node, id)]).await;
            self.notice(Notice::Dropped { copy: id, node: c.node, bytes: self.model_bytes(c.model) });
        }
    }

    async fn load_from_file(&mut self, model: ModelId, group: &[(Copy, Source)]) -> Vec<(CopyId, bool)> {
        let Some(entry) = self.pool.catalog().get(&model).cloned() else {
            return group.iter().map(|(c, _)| (c.id, false)).collect();
        };
        let mut asks = Vec::new();
        for (c, _) in group {
            self.notice(Notice::Creating {
                copy: c.id,
                model,
                node: c.node,
                from: "file",
                bytes: entry.manifest.bytes,
            });
            let m = PoolMsg::Load { copy: c.id, path: entry.path.clone(), manifest: Box::new(entry.manifest.clone()) };
            asks.push((c.node, m));
        }
        let answers = self.ask_all(asks).await;
        if answers.iter().any(|r| matches!(r, Ok(PoolMsg::Loaded { file_missing: true, .. }))) {
            warn!(model, path = entry.path, "the model file is gone: repairs can no longer fall back to it");
            if let Err(e) = self.apply(Event::FileReachable { model, reachable: false }) {
                warn!(model, error = %e, "recording the file as unreachable failed");
            }
        }
        let mut out = Vec::new();
        for ((c, _), r) in group.iter().zip(answers) {
            let failed = match r {
                Ok(PoolMsg::Loaded { result: Ok(s), .. }) => {
                    info!(copy = c.id, model, seconds = s, "copy loaded from the file");
                    None
                }
                Ok(PoolMsg::Loaded { result: Err(e), .. }) | Err(e) => Some(e),
                Ok(other) => Some(format!("unexpected answer {other:?}")),
            };
            out.push((c.id, failed.is_none()));
            match failed {
                None => self.notice(Notice::Ready { copy: c.id, node: c.node, bytes: entry.manifest.bytes }),
                Some(e) => {
                    warn!(copy = c.id, model, error = %e, "loading from the file failed");
                    self.notice(Notice::Failed { copy: c.id, reason: e });
                }
            }
        }
        out
    }

    async fn multicast(&mut self, model: ModelId, group: &[(Copy, Source)]) -> Vec<(CopyId, bool)> {
        let fail_all = |why: String, me: &Self| {
            for (c, _) in group {
                me.notice(Notice::Failed { copy: c.id, reason: why.clone() });
            }
            group.iter().map(|(c, _)| (c.id, false)).collect::<Vec<_>>()
        };
        let Some(entry) = self.pool.catalog().get(&model).cloned() else {
            return fail_all(format!("model {model} has no catalog entry"), self);
        };
        let mut sources: BTreeMap<Loc, u64> = BTreeMap::new();
        for (_, from) in group {
            if let Source::Copies(ids) = from {
                for id in ids {
                    if let Some(c) = self.pool.pool().copies().find(|c| c.id == *id && self.connected(c.node)) {
                        sources.insert(loc_of(c), c.id);
                    }
                }
            }
        }
        if sources.is_empty() {
            return fail_all("no reachable source copy".into(), self);
        }
        let targets: BTreeMap<Loc, &Copy> = group.iter().map(|(c, _)| (loc_of(c), c)).collect();
        let connected = self.ep.connected();
        let topology =
            match Topology::from_mesh(&self.ep.config().cluster, self.ep.node(), &connected, 1, self.cfg.rates) {
                Ok(t) => t,
                Err(e) => return fail_all(format!("topology: {e}"), self),
            };
        let bytes = entry.manifest.bytes;
        for c in targets.values() {
            self.notice(Notice::Creating { copy: c.id, model, node: c.node, from: "multicast", bytes });
        }
        // The source copies are lent to the run by their nodes' pool services.
        let run_id = new_run_id();
        let lends: Vec<(NodeId, PoolMsg)> =
            sources.iter().map(|(l, c)| (l.node, PoolMsg::Lend { copy: *c, run: run_id, loc: *l, bytes })).collect();
        let lent = self.ask_all(lends).await;
        let lent: BTreeSet<Loc> =
            sources.keys().zip(&lent).filter(|(_, r)| matches!(r, Ok(PoolMsg::Done))).map(|(l, _)| *l).collect();
        if lent.is_empty() {
            let members: Vec<Loc> = sources.keys().copied().collect();
            self.ctl.release(run_id, &members).await;
            return fail_all("no source copy could be lent to the multicast".into(), self);
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let spec = RunSpec {
            topology,
            bytes,
            sources: lent.iter().copied().collect(),
            targets: targets.keys().copied().collect(),
            planner: PlannerKind::Blitz,
            layers: Vec::new(),
            seed: 0,
            deadline: self.cfg.request_timeout
                + Duration::from_secs_f64(bytes as f64 * 8.0 / (self.cfg.rates.nic_gbps * 1e9)),
            lent,
            run: Some(run_id),
            hold: true,
            layout: Some(entry.manifest.layout()),
            progress: Some(tx),
        };
        let layers = entry.manifest.layout().layers;
        let run = self.ctl.run(&spec);
        tokio::pin!(run);
        let res = loop {
            tokio::select! {
                r = &mut run => break r,
                Some((_, ev)) = rx.recv() => {
                    if let McEvent::LayerReady { target, layer } = ev {
                        if let (Some(c), Some(r)) = (targets.get(&target), layers.get(layer)) {
                            self.notice(Notice::Progress { copy: c.id, node: c.node, bytes: r.end, total: bytes });
                        }
                    }
                }
            }
        };
        let members: Vec<Loc> = spec.sources.iter().chain(spec.targets.iter()).copied().collect();
        match res {
            Ok(out) => {
                // The verified targets become held copies, then the run is released.
                let adopt: Vec<(Loc, &Copy)> =
                    targets.iter().filter(|(l, _)| out.verified.contains(l)).map(|(l, c)| (*l, *c)).collect();
                let asks =
                    adopt.iter().map(|(l, c)| (l.node, PoolMsg::Adopt { copy: c.id, run: run_id, loc: *l })).collect();
                let answers = self.ask_all(asks).await;
                let kept: BTreeSet<Loc> = adopt
                    .iter()
                    .zip(&answers)
                    .filter(|(_, r)| matches!(r, Ok(PoolMsg::Done)))
                    .map(|((l, _), _)| *l)
                    .collect();
                self.ctl.release(run_id, &members).await;
                for (l, why) in &out.report.failed {
                    if let Some(c) = targets.get(l) {
                        self.notice(Notice::Failed { copy: c.id, reason: why.clone() });
                    }
                }
                info!(
                    model,
                    targets = targets.len(),
                    kept = kept.len(),
                    seconds = out.transfer_seconds,
                    "multicast finished"
                );
                targets
                    .iter()
                    .map(|(l, c)| {
                        let ok = kept.contains(l);
                        if ok {
                            self.notice(Notice::Ready { copy: c.id, node: c.node, bytes });
                        }
                        (c.id, ok)
                    })
                    .collect()
            }
            Err(e) => {
                warn!(model, error = %e, "multicast failed");
                fail_all(e.to_string(), self)
            }
        }
    }

    /// A link down makes a live pool node a suspect; a link up clears it.
    fn note_peer(&mut self, ev: PeerEvent) {
        match ev {
            PeerEvent::Down { peer, reason } => {
                if self.alive(peer) {
                    info!(node = peer, %reason, "link to a pool node went down");
                    self.suspects.entry(peer).or_insert_with(Instant::now);
                }
            }
            PeerEvent::Up { peer, .. } => {
                self.suspects.remove(&peer);
            }
        }
    }

    /// Peer events were missed: every live pool node without a link becomes a suspect.
    fn recheck_links(&mut self) {
        for n in self.pool.pool().live_nodes().collect::<Vec<_>>() {
            if !self.connected(n) {
                self.suspects.entry(n).or_insert_with(Instant::now);
            }
        }
    }

    /// Takes the peer events that arrived: a link down makes its node a suspect; a suspect whose
    /// link stayed down for `dead_after` is declared dead. Returns the resulting actions.
    fn poll_peers(&mut self) -> Result<Vec<Action>, ManagerError> {
        loop {
            match self.events.try_recv() {
                Ok(ev) => self.note_peer(ev),
                Err(broadcast::error::TryRecvError::Lagged(_)) => self.recheck_links(),
                Err(_) => break,
            }
        }
        let mut actions = Vec::new();
        let due: Vec<NodeId> =
            self.suspects.iter().filter(|(_, t)| t.elapsed() >= self.cfg.dead_after).map(|(n, _)| *n).collect();
        for n in due {
            self.suspects.remove(&n);
            if self.connected(n) {
                continue; // it came back
            }
            warn!(node = n, after = ?self.cfg.dead_after, "declaring the node dead; repairing the pool");
            self.notice(Notice::NodeDown { node: n });
            actions.extend(self.apply(Event::NodeDown(n))?);
        }
        self.publish();
        Ok(actions)
    }

    /// Checks the invariant and every copy's checksums on its node.
    pub async fn check(&mut self) -> Result<CheckReport, ManagerError> {
        let mut problems: Vec<String> = Vec::new();
        let pool = self.pool.pool();
        for v in pool.check() {
            problems.push(report::describe(&v));
        }
        for (m, why) in &self.lost {
            problems.push(format!("model {m} is lost: {why}"));
        }
        for n in self.suspects.keys() {
            problems.push(format!("node {n} is unreachable (not yet declared dead)"));
        }
        let copies: Vec<Copy> = pool.copies().cloned().collect();
        for c in copies.iter().filter(|c| c.state == CopyState::Loading) {
            problems.push(format!("copy {} of model {} on node {} is still loading", c.id, c.model, c.node));
        }
        let held = self.list_all().await;
        for n in self.pool.pool().live_nodes() {
            match held.get(&n) {
                None => problems.push(format!("node {n} did not answer")),
                Some(ids) => {
                    for id in ids {
                        if !copies.iter().any(|c| c.id == *id && c.node == n) {
                            problems.push(format!("node {n} holds copy {id}, which the pool does not know"));
                        }
                    }
                }
            }
        }
        let ready: Vec<Copy> = copies.iter().filter(|c| c.state != CopyState::Loading).cloned().collect();
        let sums = self.check_copies(&ready).await;
        let mut bad = Vec::new();
        for c in &ready {
            if !sums.get(&c.id).copied().unwrap_or(false) {
                problems.push(format!(
                    "copy {} of model {} on node {} is missing or does not match its manifest's crcs",
                    c.id, c.model, c.node
                ));
                bad.push(c.id);
            }
        }
        Ok(CheckReport {
            healthy: problems.is_empty(),
            copies_checked: ready.len(),
            bytes_checked: ready.iter().map(|c| self.model_bytes(c.model)).sum(),
            problems,
            bad_copies: bad,
        })
    }

    /// Repairs what [`check`](Self::check) finds: unreachable nodes are declared dead now, bad
    /// copies are replaced, unknown ones dropped, unfinished ones made again. Returns the check
    /// after the repair.
    pub async fn repair(&mut self) -> Result<CheckReport, ManagerError> {
        let mut actions = Vec::new();
        for n in self.pool.pool().live_nodes().collect::<Vec<_>>() {
            if !self.connected(n) {
                self.suspects.remove(&n);
                self.notice(Notice::NodeDown { node: n });
                actions.extend(self.apply(Event::NodeDown(n))?);
            }
        }
        self.drive(actions).await?;
        let before = self.check().await?;
        let mut actions = Vec::new();
        for id in &before.bad_copies {
            if let Some(c) = self.seen.get(id).cloned() {
                self.drop_on(vec![(c.node, c.id)]).await;
                actions.extend(self.apply(Event::CopyFailed(c.id))?);
            }
        }
        self.drive(actions).await?;
        self.reconcile().await?;
        self.check().await
    }

    /// Serves admin requests and peer events until `admin` closes.
    pub async fn run(mut self, mut admin: mpsc::Receiver<AdminCall>) -> Result<(), ManagerError> {
        loop {
            let next_due = self.suspects.values().min().map(|t| *t + self.cfg.dead_after);
            let sleep = next_due.map_or(Duration::from_secs(3600), |t| t.saturating_duration_since(Instant::now()));
            tokio::select! {
                call = admin.recv() => {
                    let Some(call) = call else { return Ok(()) };
                    let res = self.serve(call.request).await;
                    let _ = call.reply.send(res.map_err(|e| e.to_string()));
                }
                ev = self.events.recv() => match ev {
                    // poll_peers below publishes the new status.
                    Ok(ev) => self.note_peer(ev),
                    Err(broadcast::error::RecvError::Lagged(_)) => self.recheck_links(),
                    Err(broadcast::error::RecvError::Closed) => {}
                },
                _ = tokio::time::sleep(sleep) => {}
            }
            let actions = self.poll_peers()?;
            self.drive(actions).await?;
        }
    }

    async fn serve(&mut self, req: AdminRequest) -> Result<serde_json::Value, ManagerError> {
        match req {
            AdminRequest::Status => Ok(to_json(&*self.status.lock().unwrap_or_else(|e| e.into_inner()))),
            AdminRequest::Check => Ok(to_json(&self.check().await?)),
            AdminRequest::Repair => Ok(to_json(&self.repair().await?)),
            AdminRequest::Register { name, path } => {
                let id = self.register(&name, Path::new(&path)).await?;
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
        }
    }
}

/// A JSON value of plain data (serializing it cannot fail).
fn to_json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or_default()
}

#[cfg(test)]
mod tests;
