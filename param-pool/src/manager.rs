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
use cascade_multicast::{Event as McEvent, Loc, MeshRates, PlannerKind, Topology};
use cascade_transport::{Endpoint, PeerEvent};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};
use tracing::{error, info, warn};

use crate::manifest::{Manifest, DEFAULT_CHUNK};
use crate::meta::{DurablePool, Event, MetaError, MetaStore, ModelEntry};
use crate::node::NodeMsg;
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
            ctl: Controller::new(ep.clone()),
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
        let mut dropped = 0;
        for (&node, ids) in &held {
            for &id in ids {
                let known = self.pool.pool().copies().any(|c| c.id == id && c.node == node);
                if !known {
                    self.send(node, &NodeMsg::Drop { copy: id });
                    info!(node, copy = id, "dropping a copy the pool does not know");
                    dropped += 1;
                }
            }
        }
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

    fn send(&self, node: NodeId, m: &NodeMsg) -> bool {
        match self.ep.link(node) {
            Ok(link) => {
                drop(link.post(vec![cascade_transport::Op::Send { payload: m.encode() }]));
                true
            }
            Err(_) => false,
        }
    }

    /// Waits for `n` replies `f` accepts, within `limit`; returns those that came.
    async fn replies<T>(&self, n: usize, limit: Duration, mut f: impl FnMut(NodeId, NodeMsg) -> Option<T>) -> Vec<T> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut out = Vec::new();
        while out.len() < n {
            let Ok(Some(m)) = tokio::time::timeout_at(deadline, self.ep.recv()).await else { break };
            if let Some(t) = NodeMsg::decode(&m.payload).and_then(|msg| f(m.from, msg)) {
                out.push(t);
            }
        }
        out
    }

    async fn list_all(&self) -> BTreeMap<NodeId, Vec<u64>> {
        let nodes: Vec<NodeId> = self.pool.pool().live_nodes().filter(|n| self.send(*n, &NodeMsg::List)).collect();
        self.replies(nodes.len(), self.cfg.request_timeout, |from, m| match m {
            NodeMsg::Listed { copies } => Some((from, copies)),
            _ => None,
        })
        .await
        .into_iter()
        .collect()
    }

    /// Whether the node holds `c` with every chunk's crc32 as its manifest says.
    async fn copy_matches(&self, c: &Copy) -> bool {
        self.check_copies(std::slice::from_ref(c)).await.get(&c.id).copied().unwrap_or(false)
    }

    /// Checksums `copies` on their nodes: copy → whether every chunk matches its manifest.
    async fn check_copies(&self, copies: &[Copy]) -> BTreeMap<CopyId, bool> {
        let mut asked = 0;
        for c in copies {
            let Some(e) = self.pool.catalog().get(&c.model) else { continue };
            let m = &e.manifest;
            if self.send(c.node, &NodeMsg::Check { copy: c.id, bytes: m.bytes, chunk: m.chunk }) {
                asked += 1;
            }
        }
        let got = self
            .replies(asked, self.cfg.request_timeout, |_, m| match m {
                NodeMsg::Checked { copy, crcs } => Some((copy, crcs)),
                _ => None,
            })
            .await;
        let mut out: BTreeMap<CopyId, bool> = copies.iter().map(|c| (c.id, false)).collect();
        for (id, crcs) in got {
            let Some(c) = copies.iter().find(|c| c.id == id) else { continue };
            let want = self.pool.catalog().get(&c.model).map(|e| &e.manifest.chunk_crcs);
            out.insert(id, crcs.is_some() && crcs.as_ref() == want);
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
                    Action::Drop { copy } => self.drop_copy(copy),
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

    fn drop_copy(&mut self, id: CopyId) {
        let Some(c) = self.seen.get(&id).cloned() else { return };
        if self.send(c.node, &NodeMsg::Drop { copy: id }) {
            self.notice(Notice::Dropped { copy: id, node: c.node, bytes: self.model_bytes(c.model) });
        }
    }

    async fn load_from_file(&mut self, model: ModelId, group: &[(Copy, Source)]) -> Vec<(CopyId, bool)> {
        let Some(entry) = self.pool.catalog().get(&model).cloned() else {
            return group.iter().map(|(c, _)| (c.id, false)).collect();
        };
        let mut asked = Vec::new();
        let mut out = Vec::new();
        for (c, _) in group {
            self.notice(Notice::Creating {
                copy: c.id,
                model,
                node: c.node,
                from: "file",
                bytes: entry.manifest.bytes,
            });
            let m = NodeMsg::Load { copy: c.id, path: entry.path.clone(), manifest: Box::new(entry.manifest.clone()) };
            if self.send(c.node, &m) {
                asked.push(c.id);
            } else {
                out.push((c.id, false));
            }
        }
        let limit = self.cfg.request_timeout;
        let got = self
            .replies(asked.len(), limit, |_, m| match m {
                NodeMsg::Loaded { copy, result, file_missing } => Some((copy, result, file_missing)),
                _ => None,
            })
            .await;
        if got.iter().any(|(_, _, missing)| *missing) {
            warn!(model, path = entry.path, "the model file is gone: repairs can no longer fall back to it");
            if let Err(e) = self.apply(Event::FileReachable { model, reachable: false }) {
                warn!(model, error = %e, "recording the file as unreachable failed");
            }
        }
        for id in asked {
            let ok = match got.iter().find(|(c, _, _)| *c == id) {
                Some((_, Ok(s), _)) => {
                    info!(copy = id, model, seconds = s, "copy loaded from the file");
                    true
                }
                Some((_, Err(e), _)) => {
                    warn!(copy = id, model, error = %e, "loading from the file failed");
                    self.notice(Notice::Failed { copy: id, reason: e.clone() });
                    false
                }
                None => {
                    self.notice(Notice::Failed { copy: id, reason: format!("no answer within {limit:?}") });
                    false
                }
            };
            if ok {
                let node = group.iter().find(|(c, _)| c.id == id).map_or(0, |(c, _)| c.node);
                self.notice(Notice::Ready { copy: id, node, bytes: entry.manifest.bytes });
            }
            out.push((id, ok));
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
        let (tx, mut rx) = mpsc::unbounded_channel();
        let spec = RunSpec {
            topology,
            bytes,
            sources: sources.keys().copied().collect(),
            targets: targets.keys().copied().collect(),
            planner: PlannerKind::Blitz,
            layers: Vec::new(),
            seed: 0,
            deadline: self.cfg.request_timeout
                + Duration::from_secs_f64(bytes as f64 * 8.0 / (self.cfg.rates.nic_gbps * 1e9)),
            source_copies: sources,
            keep: targets.iter().map(|(l, c)| (*l, c.id)).collect(),
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
        match res {
            Ok(out) => {
                for (l, why) in &out.report.failed {
                    if let Some(c) = targets.get(l) {
                        self.notice(Notice::Failed { copy: c.id, reason: why.clone() });
                    }
                }
                info!(
                    model,
                    targets = targets.len(),
                    kept = out.kept.len(),
                    seconds = out.transfer_seconds,
                    "multicast finished"
                );
                targets
                    .iter()
                    .map(|(l, c)| {
                        let ok = out.kept.contains(l);
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
                self.send(c.node, &NodeMsg::Drop { copy: c.id });
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
