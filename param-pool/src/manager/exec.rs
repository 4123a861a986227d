//! Executes the manager's jobs on the nodes: loads from the model file through the nodes' pool
//! services, chained multicasts through the controller. A job owns what it needs (an [`Io`]
//! handle and its [`Job`]), so jobs of different models run concurrently.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_multicast::cluster::{Controller, RunSpec};
use cascade_multicast::executor::new_run_id;
use cascade_multicast::{Event as McEvent, Loc, MeshRates, PlannerKind, Topology};
use cascade_transport::{Mesh, ServiceExt};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::plan::Job;
use super::{Notice, Status};
use crate::node::PoolMsg;
use crate::pool::{CopyId, ModelCopy, ModelId, NodeId};

/// What a finished job reports to the driver.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The model.
    pub model: ModelId,
    /// Each copy, and whether it is ready.
    pub copies: Vec<(CopyId, bool)>,
    /// A node found the model file missing.
    pub file_missing: bool,
}

/// The manager's handles for talking to the nodes, shared by concurrent jobs.
#[derive(Clone)]
pub struct Io {
    /// The manager's node.
    pub mesh: Arc<dyn Mesh>,
    /// Drives multicasts.
    pub ctl: Arc<Controller>,
    /// The pool's nodes (for the derived topology).
    pub nodes: Vec<NodeId>,
    /// Rates the planner assumes.
    pub rates: MeshRates,
    /// How long a node may take to answer one request (a load: without progress).
    pub request_timeout: Duration,
    /// How often a running load is asked how far it is.
    pub load_poll: Duration,
    /// Where notices go, with their time since `epoch`.
    pub notices: Option<mpsc::UnboundedSender<(f64, Notice)>>,
    /// Time zero of the notices.
    pub epoch: Instant,
    /// The pool's id: every request names it, and reaches only its copies.
    pub pool: String,
    /// The manager's published status: a copy's progress is written into it as it arrives, so
    /// `status` shows how far each loading copy is while the manager is busy driving it.
    pub status: Arc<Mutex<Status>>,
    /// Why the latest copies that failed did (newest last, at most [`FAILURES_KEPT`]): a
    /// request that wanted one (a deploy) answers with its reason.
    pub failures: Arc<Mutex<VecDeque<(CopyId, String)>>>,
}

/// Failure reasons kept for answers.
pub const FAILURES_KEPT: usize = 256;

/// How often a running load's progress is asked for, by default.
pub const LOAD_POLL: Duration = Duration::from_millis(500);
/// The most a load from the file may take in all while it keeps making progress.
const LOAD_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// A node's answer as the manager's jobs take it: a `Failed` answer or a transport error is an
/// `Err` with its text.
fn answer(r: Result<PoolMsg, cascade_transport::TransportError>) -> Result<PoolMsg, String> {
    match r {
        Ok(PoolMsg::Failed { message }) => Err(message),
        Ok(r) => Ok(r),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs `f` on every item at once, each on a task of its own; the answers come in the order of
/// the items, and an item whose task failed (panicked) answers an `Err` in its own place.
async fn in_order<T, F, Fut>(items: Vec<T>, f: F) -> Vec<Result<PoolMsg, String>>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Result<PoolMsg, String>> + Send + 'static,
{
    let n = items.len();
    let mut set = tokio::task::JoinSet::new();
    for (i, item) in items.into_iter().enumerate() {
        let fut = f(item);
        set.spawn(async move { (i, fut.await) });
    }
    let mut out: Vec<Result<PoolMsg, String>> = (0..n).map(|_| Err("its request's task failed".into())).collect();
    while let Some(r) = set.join_next().await {
        match r {
            Ok((i, r)) => out[i] = r,
            Err(e) => warn!(error = %e, "a request task failed"),
        }
    }
    out
}

/// What the nodes hold: this pool's copies, and other pools' (never touched).
#[derive(Debug, Default)]
pub struct Listing {
    /// This pool's copies, per node.
    pub ours: BTreeMap<NodeId, Vec<CopyId>>,
    /// Other pools' copies (pool id, copy id), per node.
    pub foreign: BTreeMap<NodeId, Vec<(String, u64)>>,
    /// What each node may hold (its configured memory limit; `None`: no limit).
    pub capacity: BTreeMap<NodeId, Option<u64>>,
}

impl Io {
    /// Publishes a notice.
    pub fn notice(&self, n: Notice) {
        let event = match &n {
            Notice::NodeDown { .. } => "node_down",
            Notice::Creating { .. } => "creating",
            Notice::Progress { .. } => "progress",
            Notice::Ready { .. } => "ready",
            Notice::Failed { .. } => "failed",
            Notice::Dropped { .. } => "dropped",
            Notice::Transferring { .. } => "transferring",
            Notice::Lost { .. } => "lost",
        };
        self.mesh
            .metrics()
            .counter("cascade_pool_events", "What the pool manager did, by event", &[("event", event)])
            .inc();
        if let Notice::Failed { copy, reason } = &n {
            let mut f = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            if f.len() == FAILURES_KEPT {
                f.pop_front();
            }
            f.push_back((*copy, reason.clone()));
        }
        if let Notice::Progress { copy, bytes, .. } = &n {
            let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = s.copies.iter_mut().find(|c| c.id == *copy && c.state == "loading") {
                c.in_place = Some(*bytes);
            }
        }
        if let Some(tx) = &self.notices {
            let _ = tx.send((self.epoch.elapsed().as_secs_f64(), n));
        }
    }

    /// Whether the link to `node` is up.
    pub fn connected(&self, node: NodeId) -> bool {
        self.mesh.connected_to(node)
    }

    /// Asks several nodes' pool services at once; the answers come in the order asked. A
    /// `Failed` answer or a transport error is an `Err` with its text.
    pub async fn ask_all(&self, asks: Vec<(NodeId, PoolMsg)>) -> Vec<Result<PoolMsg, String>> {
        let limit = self.request_timeout;
        in_order(asks, |(node, m)| {
            let mesh = self.mesh.clone();
            async move { answer(mesh.call(node, &m, limit).await) }
        })
        .await
    }

    /// Loads copies from the file on their nodes at once (`asks`: each copy's node and its
    /// `Load`), reporting each one's progress; the answers come in the order asked, as from
    /// [`Io::ask_all`].
    async fn load_all(&self, asks: Vec<(NodeId, PoolMsg)>, total: u64) -> Vec<Result<PoolMsg, String>> {
        in_order(asks, |(node, m)| {
            let io = self.clone();
            async move { io.load_one(node, m, total).await }
        })
        .await
    }

    /// One `Load` on `node`, its progress asked for every `load_poll` and published as
    /// [`Notice::Progress`] (the bytes placed). A load may take as long as it keeps going: it is
    /// given up once `request_timeout` passes without a byte placed or verified — which is also
    /// how long a node that cannot say how far it is (one built before `LoadProgress`) or one
    /// that stopped answering gets in all.
    pub(super) async fn load_one(&self, node: NodeId, m: PoolMsg, total: u64) -> Result<PoolMsg, String> {
        let PoolMsg::Load { copy, .. } = &m else { return Err(format!("not a load: {m:?}")) };
        let copy = *copy;
        let call = self.mesh.call(node, &m, LOAD_LIMIT);
        tokio::pin!(call);
        let mut tick = tokio::time::interval(self.load_poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.reset(); // the first ask after one period, not at once
        let (mut last, mut moved) = ((0, 0), tokio::time::Instant::now());
        loop {
            tokio::select! {
                r = &mut call => return answer(r),
                _ = tick.tick() => {
                    let ask = PoolMsg::LoadProgress { pool: self.pool.clone(), copy };
                    // The ask's own limit: a few default periods, even when polling faster.
                    if let Ok(PoolMsg::LoadAt { progress: Some(p) }) = self.mesh.call(node, &ask, self.load_poll.max(LOAD_POLL) * 4).await {
                        if p.0 > last.0 {
                            self.notice(Notice::Progress { copy, node, bytes: p.0.min(total), total });
                        }
                        if p != last {
                            (last, moved) = (p, tokio::time::Instant::now());
                        }
                    }
                    if moved.elapsed() >= self.request_timeout {
                        return Err(format!(
                            "the load on node {node} made no progress for {:?} ({} of {total} bytes placed, {} verified)",
                            self.request_timeout, last.0, last.1
                        ));
                    }
                }
            }
        }
    }

    /// Drops copies on their nodes and waits for the answers (a later request never sees them).
    pub async fn drop_all(&self, drops: Vec<(NodeId, CopyId)>) {
        self.drop_of(drops.into_iter().map(|(n, c)| (n, self.pool.clone(), c)).collect()).await;
    }

    /// Drops copies of any pool (node, pool id, copy id) and waits for the answers.
    pub async fn drop_of(&self, drops: Vec<(NodeId, String, CopyId)>) {
        let asks = drops.iter().map(|(n, pool, c)| (*n, PoolMsg::Drop { pool: pool.clone(), copy: *c })).collect();
        for ((node, pool, copy), r) in drops.iter().zip(self.ask_all(asks).await) {
            if let Err(e) = r {
                warn!(node, pool, copy, error = %e, "dropping a copy failed");
            }
        }
    }

    /// Lists every given node's copies; nodes that do not answer are left out.
    pub async fn list(&self, nodes: Vec<NodeId>) -> Listing {
        let nodes: Vec<NodeId> = nodes.into_iter().filter(|n| self.connected(*n)).collect();
        let answers =
            self.ask_all(nodes.iter().map(|n| (*n, PoolMsg::List { pool: self.pool.clone() })).collect()).await;
        let mut out = Listing::default();
        for (n, r) in nodes.into_iter().zip(answers) {
            if let Ok(PoolMsg::Listed { copies, foreign, capacity }) = r {
                out.ours.insert(n, copies);
                out.capacity.insert(n, capacity);
                if !foreign.is_empty() {
                    out.foreign.insert(n, foreign);
                }
            }
        }
        out
    }

    /// Checksums copies on their nodes against the crcs given with each: copy → match.
    pub async fn check(&self, copies: Vec<(ModelCopy, u64, u64, Vec<u32>)>) -> BTreeMap<CopyId, bool> {
        let asks = copies
            .iter()
            .map(|(c, bytes, chunk, _)| {
                (c.node, PoolMsg::Check { pool: self.pool.clone(), copy: c.id, bytes: *bytes, chunk: *chunk })
            })
            .collect();
        let answers = self.ask_all(asks).await;
        copies
            .iter()
            .zip(answers)
            .map(|((c, _, _, want), r)| {
                (c.id, matches!(r, Ok(PoolMsg::Checked { crcs: Some(ref got) }) if got == want))
            })
            .collect()
    }

    /// Runs one job to its end.
    pub async fn run(self, job: Job) -> Outcome {
        match job {
            Job::Load { model, entry, copies } => self.load(model, entry, copies).await,
            Job::Multicast { model, entry, sources, targets } => self.multicast(model, entry, sources, targets).await,
        }
    }

    async fn load(self, model: ModelId, entry: crate::meta::ModelEntry, copies: Vec<ModelCopy>) -> Outcome {
        let bytes = entry.manifest.bytes;
        let mut asks = Vec::new();
        for c in &copies {
            self.notice(Notice::Creating { copy: c.id, model, node: c.node, from: "file", bytes });
            let m = PoolMsg::Load {
                pool: self.pool.clone(),
                copy: c.id,
                path: entry.path.clone(),
                manifest: Box::new(entry.manifest.clone()),
            };
            asks.push((c.node, m));
        }
        let answers = self.load_all(asks, bytes).await;
        let file_missing = answers.iter().any(|r| matches!(r, Ok(PoolMsg::Loaded { file_missing: true, .. })));
        let mut out = Vec::new();
        for (c, r) in copies.iter().zip(answers) {
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
                None => self.notice(Notice::Ready { copy: c.id, node: c.node, bytes }),
                Some(e) => {
                    warn!(copy = c.id, model, error = %e, "loading from the file failed");
                    self.notice(Notice::Failed { copy: c.id, reason: e });
                }
            }
        }
        Outcome { model, copies: out, file_missing }
    }

    fn fail_all(&self, model: ModelId, targets: &BTreeMap<Loc, ModelCopy>, why: &str) -> Outcome {
        for c in targets.values() {
            self.notice(Notice::Failed { copy: c.id, reason: why.to_string() });
        }
        Outcome { model, copies: targets.values().map(|c| (c.id, false)).collect(), file_missing: false }
    }

    async fn multicast(
        self,
        model: ModelId,
        entry: crate::meta::ModelEntry,
        sources: BTreeMap<Loc, CopyId>,
        targets: BTreeMap<Loc, ModelCopy>,
    ) -> Outcome {
        let bytes = entry.manifest.bytes;
        let links: Vec<_> = self.nodes.iter().filter_map(|n| self.mesh.link(*n).ok().map(|l| (*n, l.kind()))).collect();
        let mut all = self.nodes.clone();
        all.push(self.mesh.node());
        // The nodes' GPUs as far as the run names them: with one per node, every copy on a GPU
        // above 0 (`cascade pool deploy --gpu 1`) was "not in the topology" and never made.
        let gpus = sources.keys().chain(targets.keys()).filter_map(|l| l.gpu).max().map_or(1, |g| g + 1);
        let topology = match Topology::from_links(&all, self.mesh.node(), &links, gpus, self.rates) {
            Ok(t) => t,
            Err(e) => return self.fail_all(model, &targets, &format!("topology: {e}")),
        };
        for c in targets.values() {
            self.notice(Notice::Creating { copy: c.id, model, node: c.node, from: "multicast", bytes });
        }
        // The source copies are lent to the run by their nodes' pool services.
        let run = new_run_id();
        let lends = sources
            .iter()
            .map(|(l, c)| (l.node, PoolMsg::Lend { pool: self.pool.clone(), copy: *c, run, loc: *l, bytes }))
            .collect();
        let lent = self.ask_all(lends).await;
        let lent: BTreeSet<Loc> =
            sources.keys().zip(&lent).filter(|(_, r)| matches!(r, Ok(PoolMsg::Done))).map(|(l, _)| *l).collect();
        if lent.is_empty() {
            let members: Vec<Loc> = sources.keys().copied().collect();
            self.ctl.release(run, &members).await;
            return self.fail_all(model, &targets, "no source copy could be lent to the multicast");
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
            deadline: self.request_timeout + Duration::from_secs_f64(bytes as f64 * 8.0 / (self.rates.nic_gbps * 1e9)),
            lent,
            run: Some(run),
            hold: true,
            layout: Some(entry.manifest.layout()),
            progress: Some(tx),
            cost: cascade_multicast::CostModel::default(),
            // A new copy is wanted as soon as possible, layer by layer: set-up overlaps the
            // transfer instead of preceding it.
            start_at_once: true,
        };
        let layers = entry.manifest.layout().layers;
        let running = self.ctl.run(&spec);
        tokio::pin!(running);
        let res = loop {
            tokio::select! {
                r = &mut running => break r,
                Some((_, ev)) = rx.recv() => match ev {
                    McEvent::LayerReady { target, layer } => {
                        if let (Some(c), Some(r)) = (targets.get(&target), layers.get(layer)) {
                            self.notice(Notice::Progress { copy: c.id, node: c.node, bytes: r.end, total: bytes });
                        }
                    }
                    McEvent::Started { setup_ms } => {
                        let nodes = targets.values().map(|c| c.node).collect();
                        self.notice(Notice::Transferring { model, nodes, setup_seconds: setup_ms as f64 / 1e3 });
                    }
                    _ => {}
                }
            }
        };
        let members: Vec<Loc> = spec.sources.iter().chain(spec.targets.iter()).copied().collect();
        let out = match res {
            Ok(out) => out,
            Err(e) => {
                warn!(model, error = %e, "multicast failed");
                return self.fail_all(model, &targets, &e.to_string());
            }
        };
        // The verified targets become held copies, then the run is released.
        let adopt: Vec<(Loc, &ModelCopy)> =
            targets.iter().filter(|(l, _)| out.verified.contains(l)).map(|(l, c)| (*l, c)).collect();
        let asks = adopt
            .iter()
            .map(|(l, c)| (l.node, PoolMsg::Adopt { pool: self.pool.clone(), copy: c.id, run, loc: *l }))
            .collect();
        let answers = self.ask_all(asks).await;
        let kept: BTreeSet<Loc> =
            adopt.iter().zip(&answers).filter(|(_, r)| matches!(r, Ok(PoolMsg::Done))).map(|((l, _), _)| *l).collect();
        self.ctl.release(run, &members).await;
        for (l, why) in &out.report.failed {
            if let Some(c) = targets.get(l) {
                self.notice(Notice::Failed { copy: c.id, reason: why.clone() });
            }
        }
        info!(model, targets = targets.len(), kept = kept.len(), seconds = out.transfer_seconds, "multicast finished");
        let copies = targets
            .iter()
            .map(|(l, c)| {
                let ok = kept.contains(l);
                if ok {
                    self.notice(Notice::Ready { copy: c.id, node: c.node, bytes });
                }
                (c.id, ok)
            })
            .collect();
        Outcome { model, copies, file_missing: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn answers_keep_their_place_even_when_a_task_fails() {
        // Item 1 panics, and item 0 answers last: each answer still lands in its own place.
        let out = in_order(vec![0u64, 1, 2], |i| async move {
            tokio::time::sleep(Duration::from_millis(10 * (3 - i))).await;
            if i == 1 {
                panic!("a request task that fails (this panic is the test's)");
            }
            Ok(PoolMsg::Loaded { result: Ok(i as f64), file_missing: false })
        })
        .await;
        assert_eq!(out.len(), 3);
        assert!(matches!(out[0], Ok(PoolMsg::Loaded { result: Ok(x), .. }) if x == 0.0), "{out:?}");
        assert!(out[1].as_ref().is_err_and(|e| e.contains("task failed")), "{out:?}");
        assert!(matches!(out[2], Ok(PoolMsg::Loaded { result: Ok(x), .. }) if x == 2.0), "{out:?}");
    }
}
