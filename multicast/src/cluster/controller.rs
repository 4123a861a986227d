//! The controller side: plans a run, drives the nodes' multicast services, verifies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Inbox, Mesh, PeerEvent, ServiceExt, TransportError};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{info, warn};

use super::proto::{Control, Fill, Report};
use crate::executor::{new_run_id, Action, ChildSpec, Coordinator, Event, Report as RunReport, ToCoord};
use crate::layout::{Layout, LayoutError};
use crate::planner::{PlanError, PlannerKind, Request};
use crate::topology::{Loc, NodeId, Topology};
use crate::Plan;

/// How long a node may take to answer a set-up request (allocation, fill, checksums).
const SETUP: Duration = Duration::from_secs(60);
/// How often a run checks that its members' links are up.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// Where members live and how a run is shaped.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Which node hosts each plan location.
    pub topology: Topology,
    /// Parameter bytes.
    pub bytes: u64,
    /// Sources and targets.
    pub sources: Vec<Loc>,
    /// Targets.
    pub targets: Vec<Loc>,
    /// Planner.
    pub planner: PlannerKind,
    /// Layer table (empty: one layer).
    pub layers: Vec<std::ops::Range<u64>>,
    /// Seed of the synthetic model.
    pub seed: u64,
    /// Limit for the whole run.
    pub deadline: Duration,
    /// Sources whose node lent the run a region it holds ([`MulticastNode::lend`](super::MulticastNode::lend)),
    /// rather than a synthetic model filled with `seed`.
    pub lent: BTreeSet<Loc>,
    /// The run's id: set when regions were lent to it beforehand; `None` draws a fresh one.
    pub run: Option<u32>,
    /// Leave the run on the nodes after verification, so that their services can detach targets;
    /// the caller then releases it with [`Controller::release`].
    pub hold: bool,
    /// What the sources must hold (chunk size, crcs, layers): a source whose chunk crcs differ
    /// fails the run ([`ControlError::SourceMismatch`]) — before anything moves, or, for a
    /// lent source of a run that starts at once, when its crc pass beside the transfer ends
    /// (every target accepts only chunks whose crc matches the layout meanwhile). `None`: the
    /// planner's chunk size, the first source's crcs and `layers`.
    pub layout: Option<Layout>,
    /// Receives every event as it happens, with its time since the transfer started.
    pub progress: Option<mpsc::UnboundedSender<(f64, Event)>>,
    /// The planner's cost model (chunk overhead, hop latency, chunk bounds): measured values
    /// where the caller has them, the defaults otherwise.
    pub cost: crate::CostModel,
    /// Start moving bytes at once: the targets' pages are allocated in the background while
    /// the transfer fills them, and senders look their children up on the first WRITE. The
    /// default (false) prepares everything first, so the transfer's time is the transfer's
    /// alone (what a benchmark against pre-allocated buffers compares); at once, the first
    /// layers arrive sooner and the set-up overlaps the transfer.
    pub start_at_once: bool,
}

impl RunSpec {
    /// A run of the synthetic model of `seed`, released when it ends.
    pub fn synthetic(topology: Topology, bytes: u64, sources: Vec<Loc>, targets: Vec<Loc>, seed: u64) -> RunSpec {
        RunSpec {
            topology,
            bytes,
            sources,
            targets,
            planner: PlannerKind::Blitz,
            layers: Vec::new(),
            seed,
            deadline: Duration::from_secs(600),
            lent: BTreeSet::new(),
            run: None,
            hold: false,
            layout: None,
            progress: None,
            cost: crate::CostModel::default(),
            start_at_once: false,
        }
    }

    fn members(&self) -> Vec<Loc> {
        self.sources.iter().chain(self.targets.iter()).copied().collect()
    }

    /// Whether lent sources are checked beside the transfer rather than before it: when the
    /// run starts at once and the layout's crcs are known beforehand.
    pub(crate) fn checks_beside(&self) -> bool {
        self.start_at_once && self.layout.is_some()
    }

    /// The lent sources this run checks beside the transfer.
    fn checked_beside(&self) -> BTreeSet<Loc> {
        if !self.checks_beside() {
            return BTreeSet::new();
        }
        self.sources.iter().filter(|l| self.lent.contains(l)).copied().collect()
    }
}

/// The outcome of a controlled run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The run's id.
    pub run: u32,
    /// The plan that was executed.
    pub plan: Plan,
    /// Which targets completed, failed, re-plans.
    pub report: RunReport,
    /// Seconds from the start of the transfer until the last target completed.
    pub transfer_seconds: f64,
    /// Seconds of set-up before the transfer started: planning, the members' regions
    /// (allocated and pre-faulted; a synthetic source filled and checksummed), and each sender's
    /// links readied for its children (looked up and mapped).
    pub setup_seconds: f64,
    /// Targets whose whole region's crc32 equals the source's.
    pub verified: Vec<Loc>,
    /// Completed targets whose crc32 did not match (must be empty).
    pub mismatched: Vec<Loc>,
    /// Events as they happened, with their time since the transfer started.
    pub events: Vec<(f64, Event)>,
}

/// Why a controlled run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The planner refused the request.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The layout does not describe the bytes.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A node could not be reached or did not answer.
    #[error("{what}: {error}")]
    Transport {
        /// The step.
        what: &'static str,
        /// The transport's error. Part of the message, not a `source()`, so an error chain prints it once.
        error: TransportError,
    },
    /// A node refused a request.
    #[error("{what} at node {node}: {message}")]
    Node {
        /// The step.
        what: &'static str,
        /// The node.
        node: NodeId,
        /// Its answer.
        message: String,
    },
    /// A source's chunk crcs differ from the layout's.
    #[error("source {0} does not hold the bytes its layout describes")]
    SourceMismatch(Loc),
    /// A node answered with a message that does not answer the request.
    #[error("{what} at node {node}: unexpected answer {answer}")]
    Unexpected {
        /// The step.
        what: &'static str,
        /// The node.
        node: NodeId,
        /// What came.
        answer: String,
    },
}

type RunTable = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<ToCoord>>>>;

/// Drives runs on the nodes' multicast services from a controller node. Runs may overlap: the
/// run that holds the report inbox hands every run its reports.
pub struct Controller {
    mesh: Arc<dyn Mesh>,
    runs: RunTable,
    reports: tokio::sync::Mutex<Inbox<Report>>,
}

impl Controller {
    /// A controller on `mesh` (a cluster member; the nodes run [`MulticastNode`](super::MulticastNode)).
    /// It takes the node's multicast-report inbox.
    pub fn new(mesh: Arc<dyn Mesh>) -> Result<Controller, TransportError> {
        let reports = tokio::sync::Mutex::new(mesh.subscribe::<Report>(DEFAULT_INBOX)?);
        Ok(Controller { mesh, runs: Arc::default(), reports })
    }

    /// Takes one report from the inbox and hands it to its run. False once the inbox closed.
    /// Cancel-safe: a waiting run that gets its own report elsewhere drops this future.
    async fn pump(&self) -> bool {
        let mut inbox = self.reports.lock().await;
        let Some(m) = inbox.recv().await else { return false };
        let tx = self.runs.lock().unwrap_or_else(|e| e.into_inner()).get(&m.msg.run).cloned();
        if let Some(tx) = tx {
            let _ = tx.send(m.msg.msg);
        }
        true
    }

    /// Releases run `run` on every node of `members` that is still reachable.
    pub async fn release(&self, run: u32, members: &[Loc]) {
        let nodes: BTreeSet<NodeId> = members.iter().map(|l| l.node).collect();
        let mut set = JoinSet::new();
        for node in nodes {
            let mesh = self.mesh.clone();
            set.spawn(async move { (node, ask(&mesh, "release", node, Control::Release { run }).await) });
        }
        while let Some(r) = set.join_next().await {
            if let Ok((node, Err(e))) = r {
                warn!(run, node, error = %e, "a node did not confirm releasing the run's regions");
            }
        }
    }

    /// Plans and runs one multicast, then verifies every completed target's bytes.
    /// A run that fails part way releases what it had set up on the nodes.
    pub async fn run(&self, spec: &RunSpec) -> Result<RunOutcome, ControlError> {
        let run = spec.run.unwrap_or_else(new_run_id);
        let started = std::time::Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).insert(run, tx);
        let res = self.run_inner(spec, run, rx).await;
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).remove(&run);
        // A run that could not be planned asked no node for anything: there is nothing to
        // release (a member outside the mesh was warned about as "did not confirm releasing").
        let planned = !matches!(res, Err(ControlError::Plan(_)));
        if planned && (res.is_err() || !spec.hold) {
            self.release(run, &spec.members()).await;
        }
        self.record(spec, &res, started.elapsed());
        res
    }

    /// The run in the node's metrics: its outcome, its duration, the bytes it delivered.
    fn record(&self, spec: &RunSpec, res: &Result<RunOutcome, ControlError>, took: Duration) {
        let m = self.mesh.metrics();
        let outcome = match res {
            Ok(o) if o.report.failed.is_empty() && o.mismatched.is_empty() => "ok",
            Ok(_) => "partial",
            Err(_) => "error",
        };
        m.counter("cascade_multicast_runs", "Multicast runs this node controlled, by outcome", &[("outcome", outcome)])
            .inc();
        let planner = format!("{:?}", spec.planner).to_lowercase();
        m.histogram(
            "cascade_multicast_duration_seconds",
            "Multicast runs this node controlled, from the request to the verified end, by planner",
            &[("planner", &planner)],
        )
        .observe(took.as_secs_f64());
        if let Ok(o) = res {
            m.counter("cascade_multicast_target_bytes", "Bytes multicast runs delivered to targets, verified", &[])
                .inc_by(o.verified.len() as u64 * spec.bytes);
        }
    }

    /// Asks every member's node for its region, concurrently; checks the sources' crcs.
    async fn prepare(
        &self,
        spec: &RunSpec,
        run: u32,
        chunk: u64,
    ) -> Result<(BTreeMap<Loc, (u32, u64)>, Option<Vec<u32>>), ControlError> {
        let mut set = JoinSet::new();
        for loc in spec.members() {
            let fill = match (spec.sources.contains(&loc), spec.lent.contains(&loc)) {
                (true, true) if spec.checks_beside() => Fill::LentCheckBeside,
                (true, true) => Fill::Lent,
                (true, false) => Fill::Synthetic { seed: spec.seed },
                (false, _) if spec.start_at_once => Fill::TargetInBackground,
                (false, _) => Fill::Target,
            };
            let msg = Control::Prepare { run, loc, bytes: spec.bytes, chunk, fill };
            let mesh = self.mesh.clone();
            set.spawn(async move { (loc, ask(&mesh, "prepare", loc.node, msg).await) });
        }
        let mut prepared = BTreeMap::new();
        let mut crcs: Option<(Loc, Vec<u32>)> = None;
        // After the first failure the other answers are still awaited: the run's release
        // follows, and a Prepare a node handles after it would leave that node's region
        // registered for good.
        let mut failed: Option<ControlError> = None;
        while let Some(r) = set.join_next().await {
            let Ok((loc, r)) = r else { continue };
            if failed.is_some() {
                continue;
            }
            match r {
                Ok(Control::Prepared { region, key, crcs: c }) => {
                    prepared.insert(loc, (region, key));
                    if let (Some(want), Some(got)) = (&spec.layout, &c) {
                        if &want.crcs != got {
                            failed = Some(ControlError::SourceMismatch(loc));
                            continue;
                        }
                    }
                    if let Some(c) = c {
                        // The first source in the spec's order gives the layout's crcs.
                        let rank = |l: &Loc| spec.sources.iter().position(|s| s == l);
                        if crcs.as_ref().is_none_or(|(l, _)| rank(&loc) < rank(l)) {
                            crcs = Some((loc, c));
                        }
                    }
                }
                Ok(other) => failed = Some(unexpected("prepare", loc.node, &other)),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok((prepared, crcs.map(|(_, c)| c))),
        }
    }

    /// Waits for the crc passes of lent sources that had not reported when the transfer ended
    /// (a transfer faster than a pass over the source): the run succeeds only once every such
    /// source is known to hold its layout's bytes, or its node is down (its targets verified
    /// every chunk they hold; there is nothing left to check against). A node that went down
    /// during the transfer — its event already taken by the run's loop — is seen from its link,
    /// at once and on every watch tick.
    pub(crate) async fn await_checks(
        &self,
        run: u32,
        layout: &Layout,
        mut checking: BTreeSet<Loc>,
        reports: &mut mpsc::UnboundedReceiver<ToCoord>,
        down: &mut tokio::sync::broadcast::Receiver<PeerEvent>,
    ) -> Result<(), ControlError> {
        let give_up = tokio::time::Instant::now() + SETUP;
        let mut inbox_open = true;
        let mut watch = tokio::time::interval(WATCH_EVERY);
        let me = self.mesh.node();
        loop {
            let gone: Vec<Loc> =
                checking.iter().filter(|l| l.node != me && !self.mesh.connected_to(l.node)).copied().collect();
            for l in gone {
                warn!(run, %l, "a lent source's node is down before its check ended");
                checking.remove(&l);
            }
            let Some(first) = checking.first().copied() else { return Ok(()) };
            tokio::select! {
                _ = watch.tick() => {},
                m = reports.recv() => match m {
                    Some(ToCoord::SourceChecked { loc, crcs }) => source_checked(layout, &mut checking, loc, &crcs)?,
                    Some(_) => {}
                    None => return Err(ControlError::Node { what: "check a source", node: first.node, message: "the controller's report table closed".into() }),
                },
                open = self.pump(), if inbox_open => inbox_open = open,
                ev = down.recv() => if let Ok(PeerEvent::Down { peer, reason, .. }) = ev {
                    if checking.iter().any(|l| l.node == peer) {
                        warn!(run, peer, %reason, "a lent source's node went down before its check ended");
                        checking.retain(|l| l.node != peer);
                    }
                },
                _ = tokio::time::sleep_until(give_up) => return Err(ControlError::Node {
                    what: "check a source",
                    node: first.node,
                    message: format!("run {run}: no crc pass reported within {SETUP:?}"),
                }),
            }
        }
    }

    async fn run_inner(
        &self,
        spec: &RunSpec,
        run: u32,
        mut reports: mpsc::UnboundedReceiver<ToCoord>,
    ) -> Result<RunOutcome, ControlError> {
        let begun = Instant::now();
        let req = Request { bytes: spec.bytes, sources: spec.sources.clone(), targets: spec.targets.clone() };
        let plan = crate::plan_with(&spec.topology, &req, spec.planner, &spec.cost)?;
        let chunk = spec.layout.as_ref().map_or(plan.chunk_bytes, |l| l.chunk);
        // Peer events from now on: a member that dies while the run is set up is seen too.
        let mut down = self.mesh.peer_events();
        // 1. Regions.
        let (prepared, crcs) = self.prepare(spec, run, chunk).await?;
        let layout = match &spec.layout {
            Some(l) => l.clone(),
            None => {
                let crcs = crcs.ok_or(ControlError::Unexpected {
                    what: "prepare",
                    node: spec.sources.first().map_or(0, |l| l.node),
                    answer: "no checksums from a source".into(),
                })?;
                Layout::new(spec.bytes, chunk, crcs, spec.layers.clone())?
            }
        };
        let specs: BTreeMap<Loc, ChildSpec> = prepared
            .iter()
            .map(|(l, (r, k))| (*l, ChildSpec { loc: *l, region: *r, key: *k, held_layers: 0 }))
            .collect();
        // 2. Start: every target before any source, so the first notices find their member.
        let mut children: BTreeMap<Loc, Vec<ChildSpec>> = BTreeMap::new();
        for e in &plan.edges {
            children.entry(e.from).or_default().push(specs[&e.to]);
        }
        let mut coord = Coordinator::new(&spec.topology, &plan, specs.clone());
        // Lent sources whose crc pass runs beside the transfer and has not reported yet.
        let mut checking = spec.checked_beside();
        for group in [&spec.targets, &spec.sources] {
            let mut set = JoinSet::new();
            for &loc in group {
                let source = spec.sources.contains(&loc);
                let kids = children.remove(&loc).unwrap_or_default();
                let ready_first = !spec.start_at_once;
                let msg = Control::Start { run, loc, layout: layout.clone(), source, children: kids, ready_first };
                let mesh = self.mesh.clone();
                set.spawn(async move { (loc, ask(&mesh, "start", loc.node, msg).await) });
            }
            while let Some(r) = set.join_next().await {
                if let Ok((loc, r)) = r {
                    expect_ack("start", loc.node, r?)?;
                }
            }
        }
        let started = Instant::now();
        let setup_seconds = (started - begun).as_secs_f64();
        let first = Event::Started { setup_ms: (setup_seconds * 1e3).round() as u64 };
        if let Some(p) = &spec.progress {
            let _ = p.send((0.0, first.clone()));
        }
        tracing::debug!(run, edges = ?plan.edges.iter().map(|e| (e.from, e.to)).collect::<Vec<_>>(), "plan");
        info!(run, planner = %spec.planner, targets = spec.targets.len(), bytes = spec.bytes, chunk, "multicast started");
        // 3. Coordinate.
        let mut events = vec![(0.0, first)];
        let mut last_done = 0.0;
        let deadline = tokio::time::Instant::now() + spec.deadline;
        let mut inbox_open = true;
        // Links are also watched, in case a member's node went down before its events were
        // subscribed (or they lagged).
        let mut watch = tokio::time::interval(WATCH_EVERY);
        while !coord.finished() {
            let actions = tokio::select! {
                _ = watch.tick() => {
                    let mut out = Vec::new();
                    for (p, c) in coord.edges_in_flight() {
                        for node in [p.node, c.node] {
                            if node != self.mesh.node() && !self.mesh.connected_to(node) {
                                out.extend(coord.on_node_down(node, "its link is down"));
                            }
                        }
                    }
                    out
                },
                m = reports.recv() => match m {
                    Some(ToCoord::SourceChecked { loc, crcs }) => {
                        source_checked(&layout, &mut checking, loc, &crcs)?;
                        vec![]
                    }
                    Some(msg) => coord.on_report(msg),
                    None => coord.on_deadline("the controller's report table closed"),
                },
                open = self.pump(), if inbox_open => {
                    inbox_open = open;
                    if open { vec![] } else { coord.on_deadline("the controller's node shut down") }
                },
                ev = down.recv() => match ev {
                    Ok(PeerEvent::Down { peer, reason, .. }) => coord.on_node_down(peer, &reason),
                    _ => vec![],
                },
                _ = tokio::time::sleep_until(deadline) => coord.on_deadline(&format!("not complete within {:?}", spec.deadline)),
            };
            for a in actions {
                match a {
                    Action::AddChild { member, child } => {
                        let msg = Control::AddChild { run, loc: member, child };
                        if let Err(e) = ask(&self.mesh, "add child", member.node, msg)
                            .await
                            .and_then(|r| expect_ack("add child", member.node, r))
                        {
                            warn!(run, %member, error = %e, "re-planned sender refused its new child");
                            let actions = coord.on_broken(member, child.loc, &e.to_string());
                            for a in actions {
                                if let Action::Emit(e) = a {
                                    events.push((started.elapsed().as_secs_f64(), e));
                                }
                            }
                        }
                    }
                    Action::Emit(e) => {
                        let t = started.elapsed().as_secs_f64();
                        if matches!(e, Event::TargetDone { .. }) {
                            last_done = t;
                        }
                        if let Some(p) = &spec.progress {
                            let _ = p.send((t, e.clone()));
                        }
                        events.push((t, e));
                    }
                }
            }
        }
        self.await_checks(run, &layout, checking, &mut reports, &mut down).await?;
        let report = coord.report(0, started.elapsed().as_secs_f64());
        // 4. Every completed target checked each chunk's crc32 against the layout (the sources'
        // bytes at prepare time) as it landed, and asked its sender again for a chunk that did
        // not match: every byte was verified once, where it landed, so no whole-region pass is
        // made again at the end (it cost a full read of every target).
        let verified = report.completed.clone();
        let mismatched = Vec::new();
        Ok(RunOutcome { run, plan, report, transfer_seconds: last_done, setup_seconds, verified, mismatched, events })
    }
}

/// Takes a lent source's crc pass (beside the transfer): a mismatch fails the run.
fn source_checked(layout: &Layout, checking: &mut BTreeSet<Loc>, loc: Loc, crcs: &[u32]) -> Result<(), ControlError> {
    if !checking.remove(&loc) {
        return Ok(());
    }
    if crcs != layout.crcs {
        warn!(%loc, "a lent source does not hold the bytes its layout describes");
        return Err(ControlError::SourceMismatch(loc));
    }
    tracing::debug!(%loc, "lent source checked beside the transfer");
    Ok(())
}

/// One request to a node's multicast service; `Failed` becomes [`ControlError::Node`].
async fn ask(mesh: &Arc<dyn Mesh>, what: &'static str, node: NodeId, msg: Control) -> Result<Control, ControlError> {
    match mesh.call(node, &msg, SETUP).await {
        Ok(Control::Failed { message }) => Err(ControlError::Node { what, node, message }),
        Ok(r) => Ok(r),
        Err(error) => Err(ControlError::Transport { what, error }),
    }
}

fn expect_ack(what: &'static str, node: NodeId, r: Control) -> Result<(), ControlError> {
    match r {
        Control::Ack => Ok(()),
        other => Err(unexpected(what, node, &other)),
    }
}

fn unexpected(what: &'static str, node: NodeId, answer: &Control) -> ControlError {
    ControlError::Unexpected { what, node, answer: format!("{answer:?}") }
}
