//! The pipelined chain executor: runs a [`Plan`] over the transport.
//!
//! Every plan member (a source or a target) runs as a task on its node's [`Mesh`]:
//!
//! * a sender WRITEs chunk *i* from its registered region straight into the child's registered
//!   region (no staging copy), then SENDs the child a 32-byte notice. Over tcp the notice is
//!   posted in the same batch as the WRITE, so the link delivers it right behind the bytes
//!   (`Link`'s order within a batch) and a chunk moves on as soon as it lands, with no round
//!   trip per chunk and hop; elsewhere (shm, the `mem` double) the notice waits for the WRITE's
//!   completion, which carries the crc of the bytes as placed and spares the child a pass over
//!   them;
//! * a receiver checks the chunk's crc32 against the layout's table **before** it counts or
//!   forwards it; on a mismatch it asks the sender (NACK) to write that chunk again;
//! * each child has its own forwarding task that sends chunk *i* as soon as it is verified, so
//!   chunk *i* moves down the chain while chunk *i+1* arrives;
//! * when every chunk of a layer and of all layers before it is verified at a target,
//!   [`Event::LayerReady`] is emitted — in layer order, as layer-wise serving consumes them.
//!
//! A coordinator watches the edges. When a sender cannot reach its child (a failed WRITE, or the
//! link reported dead), the child is re-planned from the members that hold everything — the
//! sources and completed targets, minus the one that failed it — with the same planner; a child
//! that no holder can reach is reported failed. The run always ends with a [`Report`]: every
//! target completed or failed, by the deadline at the latest.
//!
//! Members on the same node (an NVLink group, a host cache feeding a local GPU) exchange chunks by
//! a local copy between their regions — a stand-in for NVLink/PCIe copies until the CUDA backend
//! exists. While it runs, the executor holds its nodes' multicast-notice inboxes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Mesh, Region, ServiceExt, TransportError};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::layout::Layout;
use crate::topology::{Loc, Topology};
use crate::Plan;

mod coord;
mod member;
mod notice;

pub(crate) use coord::{Action, Coordinator};
pub(crate) use member::{run_member, CoordSink, MemberCmd, MemberCtx, Router};
pub use member::{ChildSpec, DeviceTarget, ToCoord};
pub use notice::{Kind as NoticeKind, Notice};

/// Progress reported while a multicast runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The transfer began: every member is set up and started (always the first event, at
    /// t = 0). `setup_ms` is the set-up before it (see `RunOutcome::setup_seconds`).
    Started {
        /// Milliseconds from the request to the transfer's start.
        setup_ms: u64,
    },
    /// Every chunk of layers `0..=layer` is verified at `target` (announced in layer order).
    LayerReady {
        /// The target.
        target: Loc,
        /// Layer index in the layout.
        layer: usize,
    },
    /// `target` holds everything, verified.
    TargetDone {
        /// The target.
        target: Loc,
    },
    /// `target` was given a new sender after its previous one failed it.
    Replanned {
        /// The target.
        target: Loc,
        /// Its new sender.
        from: Loc,
    },
    /// `target` could not be completed.
    TargetFailed {
        /// The target.
        target: Loc,
        /// Why.
        reason: String,
    },
}

/// The outcome of a multicast.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Targets that hold every chunk, verified.
    pub completed: Vec<Loc>,
    /// Targets that did not, with the reason.
    pub failed: Vec<(Loc, String)>,
    /// How many times targets were re-planned.
    pub replans: u32,
    /// Chunks that failed verification and were sent again.
    pub resent_chunks: u64,
    /// Wall time of the run.
    pub seconds: f64,
}

/// One plan member: its location, its node's mesh, and its registered region.
#[derive(Clone)]
pub struct Member {
    /// Location in the plan.
    pub loc: Loc,
    /// Its node.
    pub mesh: Arc<dyn Mesh>,
    /// Its region (sources: holding the parameters; targets: to receive them), registered on the
    /// node so peers can write into it.
    pub region: Region,
}

/// Settings of a run.
#[derive(Debug, Clone, Copy)]
pub struct ExecOptions {
    /// Limit for one chunk WRITE or notice.
    pub op_timeout: Duration,
    /// Limit for the whole run; targets not done by then are reported failed.
    pub deadline: Duration,
    /// How often the coordinator checks that senders can still reach their children.
    pub watch_every: Duration,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            op_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(600),
            watch_every: Duration::from_millis(50),
        }
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// A plan location has no member.
    #[error("plan location {0} has no member")]
    MissingMember(Loc),
    /// A member's region cannot hold the layout.
    #[error("member {loc}: region of {have} bytes cannot hold {want}")]
    RegionTooSmall {
        /// The member.
        loc: Loc,
        /// Its region's length.
        have: u64,
        /// Bytes needed.
        want: u64,
    },
    /// The transport refused something at setup.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// A fresh run id: it keeps concurrent runs' notices apart.
pub fn new_run_id() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        // Without the OS random source a clock-derived id still separates runs in practice.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos());
        b = t.unwrap_or(1).to_le_bytes();
    }
    u32::from_le_bytes(b)
}

/// Runs `plan` with every member in this process (each on its own node's mesh); returns when
/// every target is completed or failed.
pub async fn execute(
    topo: &Topology,
    plan: &Plan,
    layout: &Layout,
    members: Vec<Member>,
    events: Option<mpsc::UnboundedSender<Event>>,
    opts: ExecOptions,
) -> Result<Report, ExecError> {
    let started = Instant::now();
    let members: BTreeMap<Loc, Member> = members.into_iter().map(|m| (m.loc, m)).collect();
    let mut children: BTreeMap<Loc, Vec<ChildSpec>> = BTreeMap::new();
    let mut specs = BTreeMap::new();
    for e in &plan.edges {
        for l in [e.from, e.to] {
            let m = members.get(&l).ok_or(ExecError::MissingMember(l))?;
            if m.region.len() < layout.bytes {
                return Err(ExecError::RegionTooSmall { loc: l, have: m.region.len(), want: layout.bytes });
            }
        }
        let r = &members[&e.to].region;
        let spec = ChildSpec { loc: e.to, region: r.id().0, key: r.key().0, held_layers: 0 };
        specs.insert(e.to, spec);
        children.entry(e.from).or_default().push(spec);
    }
    let mut coord = Coordinator::new(topo, plan, specs);
    let sources = plan.sources();
    let run = new_run_id();
    let layout = Arc::new(layout.clone());
    let (to_coord, mut coord_rx) = mpsc::unbounded_channel::<ToCoord>();
    let sink: Arc<dyn CoordSink> = Arc::new(to_coord);
    let resent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    // One router per node, fed by that node's notice inbox (held for the run).
    let mut routers: BTreeMap<u32, Arc<Router>> = BTreeMap::new();
    for m in members.values() {
        let node = m.mesh.node();
        if routers.contains_key(&node) {
            continue;
        }
        let router = Arc::new(Router::default());
        routers.insert(node, router.clone());
        let mut inbox = m.mesh.subscribe::<Notice>(DEFAULT_INBOX)?;
        tasks.spawn(async move {
            while let Some(m) = inbox.recv().await {
                if m.msg.run == run {
                    router.route(m.msg);
                }
            }
        });
    }
    let mut cmds = BTreeMap::new();
    for (&loc, m) in &members {
        let router = routers[&m.mesh.node()].clone();
        let inbox = router.add(loc);
        let (ctx_tx, ctx_rx) = mpsc::unbounded_channel();
        cmds.insert(loc, ctx_tx);
        let ctx = MemberCtx {
            run,
            me: loc,
            is_source: sources.contains(&loc),
            layout: layout.clone(),
            mesh: m.mesh.clone(),
            region: m.region.clone(),
            router,
            coord: sink.clone(),
            op_timeout: opts.op_timeout,
            resent: resent.clone(),
            device: None,
        };
        tasks.spawn(run_member(ctx, children.remove(&loc).unwrap_or_default(), inbox, ctx_rx));
    }
    let apply = |actions: Vec<Action>| {
        for a in actions {
            match a {
                Action::AddChild { member, child } => {
                    if let Some(tx) = cmds.get(&member) {
                        let _ = tx.send(MemberCmd::AddChild(child));
                    }
                }
                Action::Emit(e) => {
                    if let Some(tx) = &events {
                        let _ = tx.send(e);
                    }
                }
            }
        }
    };
    let deadline = tokio::time::Instant::now() + opts.deadline;
    let mut tick = tokio::time::interval(opts.watch_every);
    while !coord.finished() {
        tokio::select! {
            msg = coord_rx.recv() => match msg {
                Some(m) => apply(coord.on_report(m)),
                None => break,
            },
            _ = tick.tick() => {
                for (p, c) in coord.edges_in_flight() {
                    let alive = members[&p].mesh.link(c.node).map(|l| l.is_alive()).unwrap_or(false);
                    if !alive {
                        apply(coord.on_broken(p, c, &format!("link from {p} to {c} is down")));
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                apply(coord.on_deadline(&format!("not complete within the {:?} deadline", opts.deadline)));
            }
        }
    }
    tasks.abort_all();
    Ok(coord.report(resent.load(std::sync::atomic::Ordering::Relaxed), started.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests;
