//! Multicast across processes: the node side ([`serve_node`], what `cascade node` runs) and the
//! controller ([`Controller`], what `cascade multicast` and the benchmark use).
//!
//! The controller is a member of the cluster like the nodes; control messages travel as SENDs on
//! the same links as the data (JSON behind a 4-byte magic, so they never mix with chunk notices):
//!
//! ```text
//! controller -> node   Prepare{run, loc, bytes, fill}   allocate + register a region (sources fill it)
//! node -> controller   Prepared{run, loc, region, key, crcs}   (crcs: per chunk, from a source)
//! controller -> node   Start{run, loc, layout, source, children}
//! node -> controller   Report{run, ToCoord}              Done / LayerReady / ChildLost
//! controller -> node   AddChild{run, loc, child}          after a re-plan
//! controller -> node   Verify{run, loc}  ->  Verified{run, loc, crc}
//! controller -> node   Release{run}  ->  Released{run}     deregister the run's regions
//! ```
//!
//! Without a GPU backend a location's region is host memory on its node; sources are filled with
//! a deterministic pseudo-random model (the parameter pool will supply real ones).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_transport::{Endpoint, Link, Op, PeerEvent, Region, TransportError};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::executor::{
    new_run_id, notice_run, run_member, Action, ChildSpec, CoordSink, Coordinator, Event, MemberCmd, MemberCtx, Report,
    Router, ToCoord,
};
use crate::layout::Layout;
use crate::planner::{plan, PlannerKind, Request};
use crate::topology::{Loc, NodeId, Topology};
use crate::Plan;

const MAGIC: &[u8; 4] = b"CSCT";

/// A control message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Control {
    /// Allocate and register a region for `loc`; with `fill`, fill it with the synthetic model of
    /// that seed and answer with the crc of each `chunk`.
    Prepare {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// Bytes of the model.
        bytes: u64,
        /// Chunk size (for the crcs of a source).
        chunk: u64,
        /// Seed of the synthetic model (sources only).
        fill: Option<u64>,
    },
    /// The region is ready.
    Prepared {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// Region id.
        region: u32,
        /// Its key.
        key: u64,
        /// Per-chunk crc32 (sources only).
        crcs: Option<Vec<u32>>,
    },
    /// Start the member.
    Start {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// What travels.
        layout: Layout,
        /// True for a source.
        source: bool,
        /// Where it sends.
        children: Vec<ChildSpec>,
    },
    /// A member's report.
    Report {
        /// Run id.
        run: u32,
        /// The report.
        msg: ToCoord,
    },
    /// A new child after a re-plan.
    AddChild {
        /// Run id.
        run: u32,
        /// The sender.
        loc: Loc,
        /// The child.
        child: ChildSpec,
    },
    /// Ask for the crc32 of a member's whole region.
    Verify {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
    },
    /// The crc32 of a member's region.
    Verified {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// crc32 of the model's bytes in the region.
        crc: u32,
    },
    /// Drop the run's regions.
    Release {
        /// Run id.
        run: u32,
    },
    /// The node dropped the run's regions.
    Released {
        /// Run id.
        run: u32,
    },
    /// A request failed at the node.
    Error {
        /// Run id.
        run: u32,
        /// What failed.
        message: String,
    },
}

impl Control {
    /// Encodes with the magic prefix.
    pub fn encode(&self) -> bytes::Bytes {
        let mut v = MAGIC.to_vec();
        // Serializing these plain types cannot fail.
        v.extend(serde_json::to_vec(self).unwrap_or_default());
        v.into()
    }

    /// Decodes a message that starts with the magic prefix.
    pub fn decode(b: &[u8]) -> Option<Control> {
        b.strip_prefix(MAGIC.as_slice()).and_then(|j| serde_json::from_slice(j).ok())
    }
}

fn send(ep: &Endpoint, to: NodeId, m: &Control) -> Result<(), TransportError> {
    // Fire and forget: the link delivers SENDs in order; a dead link is seen through PeerDown.
    let link = ep.link(to)?;
    drop(link.post(vec![Op::Send { payload: m.encode() }]));
    Ok(())
}

/// Fills `region[..bytes]` with the synthetic model of `seed` (xorshift, 8 bytes at a time).
pub fn fill_synthetic(region: &Region, bytes: u64, seed: u64) -> Result<(), TransportError> {
    let mut x = seed | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(buf.len() as u64) as usize;
        for w in buf[..n].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
        region.write_local(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

struct NodeRun {
    controller: NodeId,
    router: Arc<Router>,
    regions: BTreeMap<Loc, Region>,
    cmds: BTreeMap<Loc, mpsc::UnboundedSender<MemberCmd>>,
    resent: Arc<std::sync::atomic::AtomicU64>,
}

struct ToController {
    link: Arc<dyn Link>,
    run: u32,
}

impl CoordSink for ToController {
    fn send(&self, msg: ToCoord) {
        drop(self.link.post(vec![Op::Send { payload: Control::Report { run: self.run, msg }.encode() }]));
    }
}

/// Serves multicast runs on this node until its endpoint shuts down: the daemon's main loop.
pub async fn serve_node(ep: Arc<Endpoint>, op_timeout: Duration) {
    let runs: Arc<Mutex<BTreeMap<u32, NodeRun>>> = Arc::default();
    while let Some(m) = ep.recv().await {
        // Chunk notices go to their run's router.
        if let Some(run) = notice_run(&m.payload) {
            if let Some(r) = runs.lock().unwrap_or_else(|e| e.into_inner()).get(&run) {
                r.router.route(run, &m.payload);
            }
            continue;
        }
        let Some(c) = Control::decode(&m.payload) else {
            debug!(from = m.from, len = m.payload.len(), "ignoring an unknown message");
            continue;
        };
        if let Err(e) = handle(&ep, &runs, m.from, c.clone(), op_timeout) {
            warn!(error = %e, "control request failed");
            let run = match c {
                Control::Prepare { run, .. }
                | Control::Start { run, .. }
                | Control::AddChild { run, .. }
                | Control::Verify { run, .. }
                | Control::Release { run } => run,
                _ => 0,
            };
            let _ = send(&ep, m.from, &Control::Error { run, message: e.to_string() });
        }
    }
}

fn handle(
    ep: &Arc<Endpoint>,
    runs: &Arc<Mutex<BTreeMap<u32, NodeRun>>>,
    from: NodeId,
    c: Control,
    op_timeout: Duration,
) -> Result<(), TransportError> {
    let mut guard = runs.lock().unwrap_or_else(|e| e.into_inner());
    match c {
        Control::Prepare { run, loc, bytes, chunk, fill } => {
            let r = guard.entry(run).or_insert_with(|| NodeRun {
                controller: from,
                router: Arc::new(Router::default()),
                regions: BTreeMap::new(),
                cmds: BTreeMap::new(),
                resent: Default::default(),
            });
            let region = ep.register_new(bytes)?;
            let crcs = match fill {
                Some(seed) => {
                    fill_synthetic(&region, bytes, seed)?;
                    let n = bytes.div_ceil(chunk.max(1));
                    Some(
                        (0..n)
                            .map(|i| region.crc32(i * chunk, chunk.min(bytes - i * chunk)))
                            .collect::<Result<Vec<u32>, _>>()?,
                    )
                }
                None => None,
            };
            let reply = Control::Prepared { run, loc, region: region.id().0, key: region.key().0, crcs };
            r.regions.insert(loc, region);
            send(ep, from, &reply)
        }
        Control::Start { run, loc, layout, source, children } => {
            let r = guard.get_mut(&run).ok_or_else(|| unknown(run))?;
            let region = r.regions.get(&loc).cloned().ok_or_else(|| unknown(run))?;
            let inbox = r.router.add(loc);
            let (tx, rx) = mpsc::unbounded_channel();
            r.cmds.insert(loc, tx);
            let ctx = MemberCtx {
                run,
                me: loc,
                is_source: source,
                layout: Arc::new(layout),
                mesh: ep.clone(),
                region,
                router: r.router.clone(),
                coord: Arc::new(ToController { link: ep.link(r.controller)?, run }),
                op_timeout,
                resent: r.resent.clone(),
            };
            tokio::spawn(run_member(ctx, children, inbox, rx));
            Ok(())
        }
        Control::AddChild { run, loc, child } => {
            let r = guard.get(&run).ok_or_else(|| unknown(run))?;
            if let Some(tx) = r.cmds.get(&loc) {
                let _ = tx.send(MemberCmd::AddChild(child));
            }
            Ok(())
        }
        Control::Verify { run, loc } => {
            let r = guard.get(&run).ok_or_else(|| unknown(run))?;
            let region = r.regions.get(&loc).ok_or_else(|| unknown(run))?;
            let bytes = region.len();
            send(ep, from, &Control::Verified { run, loc, crc: region.crc32(0, bytes)? })
        }
        Control::Release { run } => {
            if let Some(r) = guard.remove(&run) {
                for region in r.regions.values() {
                    ep.regions().deregister(region.id());
                }
                // Dropping the command senders ends the member tasks.
            }
            send(ep, from, &Control::Released { run })
        }
        other => {
            debug!(?other, "unexpected control message at a node");
            Ok(())
        }
    }
}

fn unknown(run: u32) -> TransportError {
    TransportError::Protocol { peer: None, detail: format!("unknown multicast run {run}") }
}

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

    /// Plans and runs one multicast, then verifies every completed target's bytes.
    pub async fn run(&self, spec: &RunSpec) -> Result<RunOutcome, Box<dyn std::error::Error + Send + Sync>> {
        let req = Request { bytes: spec.bytes, sources: spec.sources.clone(), targets: spec.targets.clone() };
        let plan = plan(&spec.topology, &req, spec.planner)?;
        let run = new_run_id();
        let chunk = plan.chunk_bytes;
        let setup = Duration::from_secs(60);
        // 1. Regions.
        let members: Vec<Loc> = spec.sources.iter().chain(spec.targets.iter()).copied().collect();
        for &loc in &members {
            let fill = spec.sources.contains(&loc).then_some(spec.seed);
            send(&self.ep, loc.node, &Control::Prepare { run, loc, bytes: spec.bytes, chunk, fill })?;
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
            if crcs.is_none() {
                crcs = c;
            }
        }
        let crcs = crcs.ok_or("no source reported its checksums")?;
        let layout = Layout::new(spec.bytes, chunk, crcs, spec.layers.clone())?;
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
        // 5. Release, on every node still reachable.
        let nodes: std::collections::BTreeSet<NodeId> = members.iter().map(|l| l.node).collect();
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
        Ok(RunOutcome { plan, report, transfer_seconds: last_done, verified, mismatched, events })
    }
}

#[cfg(test)]
mod tests;
