//! The pipelined chain executor: runs a [`Plan`] over the transport.
//!
//! Every plan member (a source or a target) runs as a task on its node's [`Mesh`]:
//!
//! * a sender WRITEs chunk *i* from its registered region straight into the child's registered
//!   region (no staging copy), then SENDs the child a 32-byte notice;
//! * a receiver checks the chunk's crc32 against the layout's table **before** it counts or
//!   forwards it; on a mismatch it asks the sender (NACK) to write that chunk again;
//! * each child has its own forwarding task that sends chunk *i* as soon as it is verified, so
//!   chunk *i* moves down the chain while chunk *i+1* arrives;
//! * when every chunk of a layer is verified at a target, [`Event::LayerReady`] is emitted.
//!
//! A coordinator watches the edges. When a sender cannot reach its child (a failed WRITE, or the
//! link reported dead), the child is re-planned from the members that hold everything — the
//! sources and completed targets, minus the one that failed it — with the same planner; a child
//! that no holder can reach is reported failed. The run always ends with a [`Report`]: every
//! target completed or failed, by the deadline at the latest.
//!
//! Members on the same node (an NVLink group, a host cache feeding a local GPU) exchange chunks by
//! a local copy between their regions — a stand-in for NVLink/PCIe copies until the CUDA backend
//! exists. The executor consumes its nodes' receive queues while it runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cascade_transport::{Link, Mesh, Op, Region, RemoteRegion, TransportError};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use crate::layout::Layout;
use crate::planner::{plan, PlannerKind, Request};
use crate::topology::{Loc, Topology};
use crate::Plan;

/// Progress reported while a multicast runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Every chunk of `layer` is verified at `target`.
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

// ---- the notice sent after each chunk WRITE (and the NACK) ----

const MAGIC: u32 = u32::from_le_bytes(*b"CSMC");
const NOTICE_LEN: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chunk = 1,
    Nack = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Notice {
    run: u32,
    kind: Kind,
    index: u32,
    from: Loc,
    to: Loc,
}

fn put_loc(b: &mut [u8], l: Loc) {
    b[0..4].copy_from_slice(&l.node.to_le_bytes());
    b[4..8].copy_from_slice(&l.gpu.unwrap_or(u32::MAX).to_le_bytes());
}

fn get_loc(b: &[u8]) -> Loc {
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Loc { node: u(0), gpu: Some(u(4)).filter(|g| *g != u32::MAX) }
}

impl Notice {
    fn encode(&self) -> [u8; NOTICE_LEN] {
        let mut b = [0u8; NOTICE_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.run.to_le_bytes());
        b[8] = self.kind as u8;
        b[12..16].copy_from_slice(&self.index.to_le_bytes());
        put_loc(&mut b[16..24], self.from);
        put_loc(&mut b[24..32], self.to);
        b
    }

    fn decode(b: &[u8]) -> Option<Notice> {
        if b.len() != NOTICE_LEN || b[0..4] != MAGIC.to_le_bytes() {
            return None;
        }
        let kind = match b[8] {
            1 => Kind::Chunk,
            2 => Kind::Nack,
            _ => return None,
        };
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Notice { run: u(4), kind, index: u(12), from: get_loc(&b[16..24]), to: get_loc(&b[24..32]) })
    }
}

// ---- coordinator <-> members ----

enum ToCoord {
    Done(Loc),
    ChildLost { parent: Loc, child: Loc, reason: String },
}

enum Cmd {
    AddChild(Loc),
}

/// Where a member sends: another node through the transport, or a member on its own node.
#[derive(Clone)]
enum Dest {
    Remote { link: Arc<dyn Link>, region: RemoteRegion },
    Local { region: Region, inbox: mpsc::UnboundedSender<Notice> },
}

struct Shared {
    run: u32,
    layout: Layout,
    members: BTreeMap<Loc, Member>,
    inboxes: BTreeMap<Loc, mpsc::UnboundedSender<Notice>>,
    to_coord: mpsc::UnboundedSender<ToCoord>,
    events: Option<mpsc::UnboundedSender<Event>>,
    opts: ExecOptions,
    resent: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn emit(&self, e: Event) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    fn dest(&self, from: Loc, to: Loc) -> Result<Dest, TransportError> {
        let (m_from, m_to) = (&self.members[&from], &self.members[&to]);
        if from.node == to.node {
            return Ok(Dest::Local { region: m_to.region.clone(), inbox: self.inboxes[&to].clone() });
        }
        Ok(Dest::Remote { link: m_from.mesh.link(to.node)?, region: m_to.region.remote(to.node) })
    }

    /// Moves chunk `i` from `from`'s region to `to` and tells `to`.
    async fn send_chunk(&self, from: Loc, to: Loc, dest: &Dest, i: u32) -> Result<(), TransportError> {
        let r = self.layout.chunk_range(i);
        let src = &self.members[&from].region;
        let notice = Notice { run: self.run, kind: Kind::Chunk, index: i, from, to };
        match dest {
            Dest::Local { region, inbox } => {
                region.write_local(r.start, &src.view(r.start, r.end - r.start)?)?;
                let _ = inbox.send(notice);
                Ok(())
            }
            Dest::Remote { link, region } => {
                // The notice is posted only once the WRITE has completed, so data precedes it.
                let write = Op::write(src, r.start, *region, r.start, r.end - r.start);
                let h = link.post(vec![write]).pop().ok_or_else(|| closed(to))?;
                h.wait("chunk write", self.opts.op_timeout).await?;
                let send = Op::Send { payload: bytes::Bytes::copy_from_slice(&notice.encode()) };
                let h = link.post(vec![send]).pop().ok_or_else(|| closed(to))?;
                h.wait("chunk notice", self.opts.op_timeout).await.map(drop)
            }
        }
    }

    async fn send_nack(&self, me: Loc, to: Loc, i: u32) {
        let n = Notice { run: self.run, kind: Kind::Nack, index: i, from: me, to };
        match self.dest(me, to) {
            Ok(Dest::Local { .. }) => {
                let _ = self.inboxes[&to].send(n);
            }
            Ok(Dest::Remote { link, .. }) => {
                let h = link.post(vec![Op::Send { payload: bytes::Bytes::copy_from_slice(&n.encode()) }]);
                for x in h {
                    let _ = x.wait("nack", self.opts.op_timeout).await;
                }
            }
            Err(_) => {}
        }
    }
}

fn closed(peer: Loc) -> TransportError {
    TransportError::PeerDown { peer: peer.node, reason: "link closed".into() }
}

/// Chunks a member holds, with a wake-up for forwarding tasks.
struct Have {
    bits: Mutex<Vec<bool>>,
    more: Notify,
}

impl Have {
    fn has(&self, i: u32) -> bool {
        self.bits.lock().unwrap_or_else(|e| e.into_inner())[i as usize]
    }

    /// Waits until chunk `i` is held.
    async fn wait(&self, i: u32) {
        loop {
            let notified = self.more.notified();
            if self.has(i) {
                return;
            }
            notified.await;
        }
    }
}

/// Runs `plan` over the members' meshes; returns when every target is completed or failed.
pub async fn execute(
    topo: &Topology,
    plan_in: &Plan,
    layout: &Layout,
    members: Vec<Member>,
    events: Option<mpsc::UnboundedSender<Event>>,
    opts: ExecOptions,
) -> Result<Report, ExecError> {
    let started = Instant::now();
    let members: BTreeMap<Loc, Member> = members.into_iter().map(|m| (m.loc, m)).collect();
    let targets: BTreeSet<Loc> = plan_in.edges.iter().map(|e| e.to).collect();
    let mut parent: BTreeMap<Loc, Loc> = BTreeMap::new();
    for e in &plan_in.edges {
        for l in [e.from, e.to] {
            let m = members.get(&l).ok_or(ExecError::MissingMember(l))?;
            if m.region.len() < layout.bytes {
                return Err(ExecError::RegionTooSmall { loc: l, have: m.region.len(), want: layout.bytes });
            }
        }
        parent.insert(e.to, e.from);
    }
    let sources: BTreeSet<Loc> = plan_in.edges.iter().map(|e| e.from).filter(|l| !targets.contains(l)).collect();
    let mut run_bytes = [0u8; 4];
    // The run id only keeps concurrent runs' notices apart; if the OS random source fails, a
    // clock-derived id does that too.
    if getrandom::fill(&mut run_bytes).is_err() {
        run_bytes = started.elapsed().subsec_nanos().to_le_bytes();
    }
    let (to_coord, mut coord_rx) = mpsc::unbounded_channel();
    let mut inbox_rx = BTreeMap::new();
    let mut inboxes = BTreeMap::new();
    for &l in members.keys() {
        let (tx, rx) = mpsc::unbounded_channel();
        inboxes.insert(l, tx);
        inbox_rx.insert(l, rx);
    }
    let shared = Arc::new(Shared {
        run: u32::from_le_bytes(run_bytes),
        layout: layout.clone(),
        members: members.clone(),
        inboxes,
        to_coord,
        events,
        opts,
        resent: Default::default(),
    });
    let mut tasks = JoinSet::new();
    // One router per node: demultiplexes this run's notices to member inboxes.
    let mut nodes: BTreeMap<u32, Arc<dyn Mesh>> = BTreeMap::new();
    for m in members.values() {
        nodes.entry(m.mesh.node()).or_insert_with(|| m.mesh.clone());
    }
    for mesh in nodes.into_values() {
        let s = shared.clone();
        tasks.spawn(async move {
            while let Some(m) = mesh.recv().await {
                if let Some(n) = Notice::decode(&m.payload).filter(|n| n.run == s.run) {
                    if let Some(tx) = s.inboxes.get(&n.to) {
                        let _ = tx.send(n);
                    }
                }
            }
        });
    }
    // Members.
    let mut cmds = BTreeMap::new();
    let mut children: BTreeMap<Loc, Vec<Loc>> = BTreeMap::new();
    for e in &plan_in.edges {
        children.entry(e.from).or_default().push(e.to);
    }
    for (&loc, rx) in inbox_rx.iter_mut() {
        let (ctx, crx) = mpsc::unbounded_channel();
        cmds.insert(loc, ctx);
        let initial = children.get(&loc).cloned().unwrap_or_default();
        let is_source = sources.contains(&loc);
        let inbox = std::mem::replace(rx, mpsc::unbounded_channel().1);
        tasks.spawn(member(shared.clone(), loc, is_source, initial, inbox, crx));
    }

    // Coordinator.
    let mut done: BTreeSet<Loc> = BTreeSet::new();
    let mut failed: BTreeMap<Loc, String> = BTreeMap::new();
    let mut attempts: BTreeMap<Loc, u32> = BTreeMap::new();
    let mut excluded: BTreeMap<Loc, BTreeSet<Loc>> = BTreeMap::new();
    let mut replans = 0u32;
    let deadline = tokio::time::Instant::now() + opts.deadline;
    let mut tick = tokio::time::interval(opts.watch_every);
    while done.len() + failed.len() < targets.len() {
        let mut broken: Vec<(Loc, Loc, String)> = Vec::new();
        tokio::select! {
            msg = coord_rx.recv() => match msg {
                Some(ToCoord::Done(l)) => {
                    if targets.contains(&l) && !failed.contains_key(&l) && done.insert(l) {
                        shared.emit(Event::TargetDone { target: l });
                    }
                }
                Some(ToCoord::ChildLost { parent: p, child, reason }) => broken.push((p, child, reason)),
                None => break,
            },
            _ = tick.tick() => {
                for (&c, &p) in &parent {
                    if done.contains(&c) || failed.contains_key(&c) || p.node == c.node {
                        continue;
                    }
                    let alive = members[&p].mesh.link(c.node).map(|l| l.is_alive()).unwrap_or(false);
                    if !alive {
                        broken.push((p, c, format!("link from {p} to {c} is down")));
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                for &t in &targets {
                    if !done.contains(&t) && !failed.contains_key(&t) {
                        failed.insert(t, format!("not complete within the {:?} deadline", opts.deadline));
                        shared.emit(Event::TargetFailed { target: t, reason: failed[&t].clone() });
                    }
                }
                break;
            }
        }
        // Worklist: a failed target orphans its own children, which are handled in turn.
        while let Some((p, c, reason)) = broken.pop() {
            if done.contains(&c) || failed.contains_key(&c) || parent.get(&c) != Some(&p) {
                continue; // stale, or already handled
            }
            excluded.entry(c).or_default().insert(p);
            let n = attempts.entry(c).or_default();
            *n += 1;
            let holders: Vec<Loc> = sources
                .iter()
                .chain(done.iter())
                .copied()
                .filter(|h| !excluded[&c].contains(h) && !failed.contains_key(h))
                .collect();
            let new_parent = if *n > 3 || holders.is_empty() {
                None
            } else {
                let req = Request { bytes: layout.bytes, sources: holders, targets: vec![c] };
                plan(topo, &req, PlannerKind::Blitz).ok().and_then(|p| p.edges.first().map(|e| e.from))
            };
            match new_parent {
                Some(np) => {
                    replans += 1;
                    parent.insert(c, np);
                    if let Some(tx) = cmds.get(&np) {
                        let _ = tx.send(Cmd::AddChild(c));
                    }
                    shared.emit(Event::Replanned { target: c, from: np });
                }
                None => {
                    let why = format!("no surviving holder can reach it (last error: {reason})");
                    shared.emit(Event::TargetFailed { target: c, reason: why.clone() });
                    failed.insert(c, why);
                    for (&orphan, &op) in &parent {
                        if op == c && !done.contains(&orphan) && !failed.contains_key(&orphan) {
                            broken.push((c, orphan, format!("its sender {c} failed")));
                        }
                    }
                }
            }
        }
    }
    tasks.abort_all();
    let completed: Vec<Loc> = done.into_iter().collect();
    Ok(Report {
        completed,
        failed: failed.into_iter().collect(),
        replans,
        resent_chunks: shared.resent.load(std::sync::atomic::Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// One member: verifies what arrives, forwards to its children, answers NACKs.
async fn member(
    s: Arc<Shared>,
    me: Loc,
    is_source: bool,
    initial_children: Vec<Loc>,
    mut inbox: mpsc::UnboundedReceiver<Notice>,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
) {
    let n = s.layout.chunks();
    let have = Arc::new(Have { bits: Mutex::new(vec![is_source; n as usize]), more: Notify::new() });
    let mut count = if is_source { n } else { 0 };
    let mut layer_left: Vec<u32> =
        (0..s.layout.layers.len()).map(|l| s.layout.chunks_of_layer(l).len() as u32).collect();
    let mut forwarders = JoinSet::new();
    let mut dests: BTreeMap<Loc, Dest> = BTreeMap::new();
    let add_child = |child: Loc, forwarders: &mut JoinSet<()>, dests: &mut BTreeMap<Loc, Dest>| {
        let s2 = s.clone();
        match s.dest(me, child) {
            Ok(d) => {
                dests.insert(child, d.clone());
                let have = have.clone();
                forwarders.spawn(async move {
                    for i in 0..s2.layout.chunks() {
                        have.wait(i).await;
                        if let Err(e) = s2.send_chunk(me, child, &d, i).await {
                            let _ = s2.to_coord.send(ToCoord::ChildLost { parent: me, child, reason: e.to_string() });
                            return;
                        }
                    }
                });
            }
            Err(e) => {
                let _ = s.to_coord.send(ToCoord::ChildLost { parent: me, child, reason: e.to_string() });
            }
        }
    };
    for c in initial_children {
        add_child(c, &mut forwarders, &mut dests);
    }
    loop {
        tokio::select! {
            notice = inbox.recv() => {
                let Some(nt) = notice else { return };
                match nt.kind {
                    Kind::Chunk => {
                        if nt.index >= n || have.has(nt.index) {
                            continue;
                        }
                        let r = s.layout.chunk_range(nt.index);
                        let ok = s.members[&me].region.crc32(r.start, r.end - r.start).ok() == Some(s.layout.crcs[nt.index as usize]);
                        if !ok {
                            // Never counted, never forwarded: ask the sender for it again.
                            s.send_nack(me, nt.from, nt.index).await;
                            continue;
                        }
                        have.bits.lock().unwrap_or_else(|e| e.into_inner())[nt.index as usize] = true;
                        have.more.notify_waiters();
                        count += 1;
                        for (l, left) in layer_left.iter_mut().enumerate() {
                            if s.layout.chunks_of_layer(l).contains(&nt.index) {
                                *left -= 1;
                                if *left == 0 {
                                    s.emit(Event::LayerReady { target: me, layer: l });
                                }
                            }
                        }
                        if count == n {
                            let _ = s.to_coord.send(ToCoord::Done(me));
                        }
                    }
                    Kind::Nack => {
                        if let Some(d) = dests.get(&nt.from).cloned() {
                            s.resent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let s2 = s.clone();
                            forwarders.spawn(async move {
                                if let Err(e) = s2.send_chunk(me, nt.from, &d, nt.index).await {
                                    let _ = s2.to_coord.send(ToCoord::ChildLost { parent: me, child: nt.from, reason: e.to_string() });
                                }
                            });
                        }
                    }
                }
            }
            cmd = cmds.recv() => match cmd {
                Some(Cmd::AddChild(c)) => add_child(c, &mut forwarders, &mut dests),
                None => return,
            },
        }
    }
}

#[cfg(test)]
mod tests;
