//! The controller side of the control protocol: plans a run, drives the node daemons, verifies.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::{Endpoint, PeerEvent, TransportError};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{send, Control};
use crate::executor::{new_run_id, Action, ChildSpec, Coordinator, Event, Report};
use crate::layout::Layout;
use crate::planner::{plan, PlannerKind, Request};
use crate::topology::{Loc, NodeId, Topology};
use crate::Plan;

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
    /// Sources that are copies their node holds already (by copy id) rather than a synthetic
    /// model filled with `seed`.
    pub source_copies: BTreeMap<Loc, u64>,
    /// Targets whose region their node keeps as a held copy of this id once verified.
    pub keep: BTreeMap<Loc, u64>,
    /// What the sources must hold (chunk size, crcs, layers): a source whose chunk crcs differ
    /// fails the run before anything moves. `None`: the planner's chunk size, the first
    /// source's crcs and `layers`.
    pub layout: Option<Layout>,
    /// Receives every event as it happens, with its time since the transfer started.
    pub progress: Option<mpsc::UnboundedSender<(f64, Event)>>,
}

impl RunSpec {
    /// A run of the synthetic model of `seed`, with nothing kept afterwards.
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
            source_copies: BTreeMap::new(),
            keep: BTreeMap::new(),
            layout: None,
            progress: None,
        }
    }
}

/// The outcome of a controlled run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The plan that was executed.
    pub plan: Plan,
    /// Which targets completed, failed, re-plans.
    pub report: Report,
    /// Seconds from the start of the transfer until the last target completed.
    pub transfer_seconds: f64,
    /// Targets whose whole region's crc32 equals the source's.
    pub verified: Vec<Loc>,
    /// Completed targets whose crc32 did not match (must be empty).
    pub mismatched: Vec<Loc>,
    /// Events as they happened, with their time since the transfer started.
    pub events: Vec<(f64, Event)>,
    /// Targets their node now holds as the copy `RunSpec::keep` named.
    pub kept: Vec<Loc>,
}

/// Drives runs on node daemons from a controller endpoint.
pub struct Controller {
    ep: Arc<Endpoint>,
}

impl Controller {
    /// A controller on `ep` (a cluster member; the nodes run [`serve_node`]).
    pub fn new(ep: Arc<Endpoint>) -> Controller {
        Controller { ep }
    }

    async fn expect<T>(
        &self,
        what: &str,
        limit: Duration,
        mut f: impl FnMut(NodeId, Control) -> Option<T>,
    ) -> Result<T, TransportError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let m = tokio::time::timeout_at(deadline, self.ep.recv())
                .await
                .map_err(|_| TransportError::Timeout { peer: 0, op: "multicast control", after: limit })?
                .ok_or_else(|| TransportError::Protocol { peer: None, detail: "controller endpoint closed".into() })?;
            match Control::decode(&m.payload) {
                Some(Control::Error { message, .. }) => {
                    return Err(TransportError::Protocol { peer: Some(m.from), detail: format!("{what}: {message}") })
                }
                Some(c) => {
                    if let Some(t) = f(m.from, c) {
                        return Ok(t);
                    }
                }
                None => debug!(from = m.from, "controller ignores a non-control message"),
            }
        }
    }

    /// Releases run `run` on every node of `members` that is still reachable.
    async fn release(&self, run: u32, members: &[Loc]) {
        let nodes: BTreeSet<NodeId> = members.iter().map(|l| l.node).collect();
        let mut waiting = 0;
        for &node in &nodes {
            if send(&self.ep, node, &Control::Release { run }).is_ok() {
                waiting += 1;
            }
        }
        for _ in 0..waiting {
            let r = self
                .expect("release", Duration::from_secs(5), |_, c| {
                    matches!(c, Control::Released { run: r } if r == run).then_some(())
                })
                .await;
            if let Err(e) = r {
                warn!(run, error = %e, "a node did not confirm releasing the run's regions");
                break;
            }
        }
    }

    /// Plans and runs one multicast, then verifies every completed target's bytes.
    /// A run that fails part way releases what it had set up on the nodes.
    pub async fn run(&self, spec: &RunSpec) -> Result<RunOutcome, Box<dyn std::error::Error + Send + Sync>> {
        let run = new_run_id();
        let res = self.run_inner(spec, run).await;
        if res.is_err() {
            let members: Vec<Loc> = spec.sources.iter().chain(spec.targets.iter()).copied().collect();
            self.release(run, &members).await;
        }
        res
    }

    async fn run_inner(
        &self,
        spec: &RunSpec,
        run: u32,
    ) -> Result<RunOutcome, Box<dyn std::error::Error + Send + Sync>> {
        let req = Request { bytes: spec.bytes, sources: spec.sources.clone(), targets: spec.targets.clone() };
        let plan = plan(&spec.topology, &req, spec.planner)?;
        let chunk = spec.layout.as_ref().map_or(plan.chunk_bytes, |l| l.chunk);
        let setup = Duration::from_secs(60);
        // 1. Regions.
        let members: Vec<Loc> = spec.sources.iter().chain(spec.targets.iter()).copied().collect();
        for &loc in &members {
            let copy = spec.source_copies.get(&loc).copied();
            let fill = (spec.sources.contains(&loc) && copy.is_none()).then_some(spec.seed);
            send(&self.ep, loc.node, &Control::Prepare { run, loc, bytes: spec.bytes, chunk, fill, copy })?;
        }
        let mut prepared: BTreeMap<Loc, (u32, u64)> = BTreeMap::new();
        let mut crcs = None;
        while prepared.len() < members.len() {
            let (loc, region, key, c) = self
                .expect("prepare", setup, |_, c| match c {
                    Control::Prepared { run: r, loc, region, key, crcs } if r == run => Some((loc, region, key, crcs)),
                    _ => None,
                })
                .await?;
            prepared.insert(loc, (region, key));
            if let (Some(want), Some(got)) = (&spec.layout, &c) {
                if &want.crcs != got {
                    return Err(format!("source {loc} does not hold the bytes its layout describes").into());
                }
            }
            if crcs.is_none() {
                crcs = c;
            }
        }
        let layout = match &spec.layout {
            Some(l) => l.clone(),
            None => {
                let crcs = crcs.ok_or("no source reported its checksums")?;
                Layout::new(spec.bytes, chunk, crcs, spec.layers.clone())?
            }
        };
        let specs: BTreeMap<Loc, ChildSpec> =
            prepared.iter().map(|(l, (r, k))| (*l, ChildSpec { loc: *l, region: *r, key: *k })).collect();
        // 2. Start: children before their senders, so the first notices find their member.
        let mut children: BTreeMap<Loc, Vec<ChildSpec>> = BTreeMap::new();
        for e in &plan.edges {
            children.entry(e.from).or_default().push(specs[&e.to]);
        }
        let mut coord = Coordinator::new(&spec.topology, &plan, specs.clone());
        let mut down = self.ep.events();
        let started = Instant::now();
        let mut order: Vec<Loc> = spec.targets.clone();
        order.extend(spec.sources.iter().copied());
        for loc in order {
            let source = spec.sources.contains(&loc);
            let kids = children.remove(&loc).unwrap_or_default();
            send(&self.ep, loc.node, &Control::Start { run, loc, layout: layout.clone(), source, children: kids })?;
        }
        info!(run, planner = %spec.planner, targets = spec.targets.len(), bytes = spec.bytes, chunk, "multicast started");
        // 3. Coordinate.
        let mut events = Vec::new();
        let mut last_done = 0.0;
        let deadline = tokio::time::Instant::now() + spec.deadline;
        while !coord.finished() {
            let actions = tokio::select! {
                m = self.ep.recv() => match m.as_ref().and_then(|m| Control::decode(&m.payload)) {
                    Some(Control::Report { run: r, msg }) if r == run => coord.on_report(msg),
                    Some(_) => vec![],
                    None if m.is_none() => return Err("controller endpoint closed".into()),
                    None => vec![],
                },
                ev = down.recv() => match ev {
                    Ok(PeerEvent::Down { peer, reason }) => coord.on_node_down(peer, &reason),
                    _ => vec![],
                },
                _ = tokio::time::sleep_until(deadline) => coord.on_deadline(&format!("not complete within {:?}", spec.deadline)),
            };
            for a in actions {
                match a {
                    Action::AddChild { member, child } => {
                        let _ = send(&self.ep, member.node, &Control::AddChild { run, loc: member, child });
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
        let report = coord.report(0, started.elapsed().as_secs_f64());
        // 4. Verify every completed target against a source.
        let mut verified = Vec::new();
        let mut mismatched = Vec::new();
        let check: Vec<Loc> = spec.sources[..1].iter().chain(report.completed.iter()).copied().collect();
        for &loc in &check {
            send(&self.ep, loc.node, &Control::Verify { run, loc })?;
        }
        let mut got: BTreeMap<Loc, u32> = BTreeMap::new();
        while got.len() < check.len() {
            let (loc, crc) = self
                .expect("verify", setup, |_, c| match c {
                    Control::Verified { run: r, loc, crc } if r == run => Some((loc, crc)),
                    _ => None,
                })
                .await?;
            got.insert(loc, crc);
        }
        let want = got[&spec.sources[0]];
        for t in &report.completed {
            if got.get(t) == Some(&want) {
                verified.push(*t);
            } else {
                mismatched.push(*t);
            }
        }
        // 5. Keep the verified targets that are to become copies.
        let mut kept = Vec::new();
        let keep: Vec<(Loc, u64)> = verified.iter().filter_map(|l| spec.keep.get(l).map(|c| (*l, *c))).collect();
        for &(loc, copy) in &keep {
            send(&self.ep, loc.node, &Control::Keep { run, loc, copy })?;
        }
        for _ in &keep {
            let loc = self
                .expect("keep", setup, |_, c| match c {
                    Control::Kept { run: r, loc, .. } if r == run => Some(loc),
                    _ => None,
                })
                .await?;
            kept.push(loc);
        }
        // 6. Release, on every node still reachable.
        self.release(run, &members).await;
        Ok(RunOutcome { plan, report, transfer_seconds: last_done, verified, mismatched, events, kept })
    }
}
