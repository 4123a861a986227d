//! `mem`: an in-process **test double** of the transport, with programmable faults.
//!
//! It is not a backend for production: nodes live in one process and operations are plain memcpys
//! between their [`RegionTable`]s. Its purpose is to drive the real code above the transport
//! (multicast executor, pool repair) through failures on demand: drop an operation (it never
//! completes, so the caller's timeout fires), delay it, corrupt the bytes it lands, or kill a node
//! (every operation to or from it fails with `PeerDown`). Key and bounds checks are the same as on
//! the real backends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};

use crate::endpoint::PeerEvent;
use crate::error::{Result, TransportError};
use crate::link::{BackendKind, Completion, Done, Incoming, Link, Op, OpHandle};
use crate::region::{Region, RegionTable};
use crate::service::Services;
use crate::stats::{LinkStats, StatsSnapshot};
use crate::NodeId;

/// A fault applied to operations from one node to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Swallow operations: they never complete (the caller's timeout fires).
    Drop,
    /// Delay each operation by this long.
    Delay(Duration),
    /// Land the data with one byte flipped (crc verification catches it).
    Corrupt,
    /// Corrupt only the next `n` operations, then behave normally.
    CorruptNext(u32),
    /// Delay only the next `n` operations by this long, then behave normally.
    DelayNext(u32, Duration),
}

struct NodeState {
    regions: RegionTable,
    /// The node's link-level receive queue, pumped into its services in order.
    inbox: mpsc::UnboundedSender<Incoming>,
    services: Arc<Services>,
    events: broadcast::Sender<PeerEvent>,
    alive: bool,
}

#[derive(Default)]
struct Fabric {
    nodes: Mutex<HashMap<NodeId, NodeState>>,
    faults: Mutex<HashMap<(NodeId, NodeId), Fault>>,
    /// Links cut between two live nodes (unordered pairs, smaller id first).
    cut: Mutex<std::collections::HashSet<(NodeId, NodeId)>>,
}

fn pair(a: NodeId, b: NodeId) -> (NodeId, NodeId) {
    (a.min(b), a.max(b))
}

impl Fabric {
    fn lock_nodes(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, NodeState>> {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The in-process fabric joining [`MemNode`]s (test double).
#[derive(Clone, Default)]
pub struct MemFabric(Arc<Fabric>);

impl MemFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node (or revives a killed one with fresh, empty state). Must run inside a tokio
    /// runtime: a task hands the node's received messages to its services.
    pub fn add_node(&self, id: NodeId) -> MemNode {
        self.add_node_with_limit(id, None)
    }

    /// Adds a node whose regions may take at most `limit` bytes (see [`crate::MemoryBudget`]).
    pub fn add_node_with_limit(&self, id: NodeId, limit: Option<u64>) -> MemNode {
        let (tx, mut rx) = mpsc::unbounded_channel::<Incoming>();
        let regions = RegionTable::new();
        let services = Services::new(id);
        let events = broadcast::channel(1024).0;
        let state = NodeState {
            regions: regions.clone(),
            inbox: tx,
            services: services.clone(),
            events: events.clone(),
            alive: true,
        };
        let others: Vec<broadcast::Sender<PeerEvent>> = {
            let mut nodes = self.0.lock_nodes();
            nodes.insert(id, state);
            nodes.iter().filter(|(n, s)| **n != id && s.alive).map(|(_, s)| s.events.clone()).collect()
        };
        for o in others {
            let _ = o.send(PeerEvent::Up { peer: id, backend: BackendKind::Mem });
        }
        let (fabric, svc) = (self.clone(), services.clone());
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                if let Some(back) = svc.deliver(m.from, m.payload).await {
                    let to = fabric.0.lock_nodes().get(&m.from).filter(|n| n.alive).map(|n| n.inbox.clone());
                    if let Some(to) = to {
                        let _ = to.send(Incoming { from: id, payload: back });
                    }
                }
            }
        });
        MemNode {
            id,
            fabric: self.clone(),
            regions,
            services,
            events,
            budget: crate::MemoryBudget::new(limit),
            metrics: Arc::new(crate::Metrics::new()),
        }
    }

    /// Sets (or with `None` clears) the fault on operations from `from` to `to`.
    pub fn set_fault(&self, from: NodeId, to: NodeId, fault: Option<Fault>) {
        let mut f = self.0.faults.lock().unwrap_or_else(|e| e.into_inner());
        match fault {
            Some(x) => f.insert((from, to), x),
            None => f.remove(&(from, to)),
        };
    }

    /// The fault applying to the next operation from `from` to `to`, counting down `CorruptNext`
    /// and `DelayNext` (which applies as `Delay`).
    fn take_fault(&self, from: NodeId, to: NodeId) -> Option<Fault> {
        let mut f = self.0.faults.lock().unwrap_or_else(|e| e.into_inner());
        let fault = f.get(&(from, to)).copied();
        // What is left of a counted fault after this operation.
        let rest = match fault {
            Some(Fault::CorruptNext(n)) => (n > 1).then(|| Fault::CorruptNext(n - 1)),
            Some(Fault::DelayNext(n, d)) => (n > 1).then(|| Fault::DelayNext(n - 1, d)),
            _ => return fault,
        };
        match rest {
            Some(r) => f.insert((from, to), r),
            None => f.remove(&(from, to)),
        };
        match fault {
            Some(Fault::DelayNext(_, d)) => Some(Fault::Delay(d)),
            other => other,
        }
    }

    /// Kills a node: every operation to or from it fails with `PeerDown`.
    pub fn kill(&self, id: NodeId) {
        let others: Vec<(NodeId, Arc<Services>, broadcast::Sender<PeerEvent>)> = {
            let mut nodes = self.0.lock_nodes();
            if let Some(n) = nodes.get_mut(&id) {
                n.alive = false;
            }
            nodes.iter().map(|(n, s)| (*n, s.services.clone(), s.events.clone())).collect()
        };
        // Calls waiting on the killed node fail at once, and so do the killed node's own.
        let reason = "node killed (mem fault)";
        let dead = others.iter().find(|(n, _, _)| *n == id).map(|(_, s, _)| s.clone());
        for (n, s, ev) in &others {
            if *n != id {
                s.peer_down(id, reason);
                let _ = ev.send(PeerEvent::Down { peer: id, reason: reason.into(), graceful: false });
            }
        }
        // The killed node's own services stop, as its process would.
        if let Some(d) = dead {
            d.close();
        }
    }

    /// True while the node exists and has not been killed.
    pub fn is_alive(&self, id: NodeId) -> bool {
        self.0.lock_nodes().get(&id).is_some_and(|n| n.alive)
    }

    /// Cuts (`up = false`) or restores the link between `a` and `b`, both staying alive with
    /// their state: a flapping link. Cutting fails the calls between them and tells both sides
    /// `Down`; restoring tells both `Up`.
    pub fn set_link(&self, a: NodeId, b: NodeId, up: bool) {
        let changed = {
            let mut cut = self.0.cut.lock().unwrap_or_else(|e| e.into_inner());
            if up {
                cut.remove(&pair(a, b))
            } else {
                cut.insert(pair(a, b))
            }
        };
        if !changed {
            return;
        }
        let ends: Vec<(NodeId, NodeId, Arc<Services>, broadcast::Sender<PeerEvent>)> = {
            let nodes = self.0.lock_nodes();
            [(a, b), (b, a)]
                .into_iter()
                .filter_map(|(me, peer)| nodes.get(&me).map(|n| (me, peer, n.services.clone(), n.events.clone())))
                .collect()
        };
        let reason = "link cut (mem fault)";
        for (_, peer, services, events) in ends {
            if up {
                let _ = events.send(PeerEvent::Up { peer, backend: BackendKind::Mem });
            } else {
                services.peer_down(peer, reason);
                let _ = events.send(PeerEvent::Down { peer, reason: reason.into(), graceful: false });
            }
        }
    }

    fn is_cut(&self, a: NodeId, b: NodeId) -> bool {
        self.0.cut.lock().unwrap_or_else(|e| e.into_inner()).contains(&pair(a, b))
    }
}

/// One node of a [`MemFabric`] (test double).
pub struct MemNode {
    id: NodeId,
    fabric: MemFabric,
    regions: RegionTable,
    services: Arc<Services>,
    events: broadcast::Sender<PeerEvent>,
    budget: crate::MemoryBudget,
    metrics: Arc<crate::Metrics>,
}

impl MemNode {
    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The node's metrics registry (what its users record; the test double's links are not
    /// metered).
    pub fn metrics(&self) -> &Arc<crate::Metrics> {
        &self.metrics
    }

    /// Regions peers may access.
    pub fn regions(&self) -> &RegionTable {
        &self.regions
    }

    /// A link to `peer`.
    pub fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        if !self.fabric.0.lock_nodes().contains_key(&peer) {
            return Err(TransportError::NotConnected { peer });
        }
        Ok(Arc::new(MemLink {
            from: self.id,
            to: peer,
            fabric: self.fabric.clone(),
            stats: Arc::new(LinkStats::default()),
            closed: Arc::new(AtomicBool::new(false)),
            swallowed: Arc::new(Mutex::new(Vec::new())),
        }))
    }

    /// The node's control-plane services.
    pub fn services(&self) -> &Arc<Services> {
        &self.services
    }

    /// Peer up/down events: `Up` when a node joins the fabric, `Down` when one is killed.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.events.subscribe()
    }

    /// The node's memory budget (the system's available memory; a test may set a limit with
    /// [`MemFabric::add_node_with_limit`]).
    pub fn budget(&self) -> &crate::MemoryBudget {
        &self.budget
    }
}

struct MemLink {
    from: NodeId,
    to: NodeId,
    fabric: MemFabric,
    stats: Arc<LinkStats>,
    closed: Arc<AtomicBool>,
    /// Completions of dropped operations, held so that they neither complete nor fail until closed.
    swallowed: Arc<Mutex<Vec<Done>>>,
}

impl MemLink {
    fn down(&self, reason: &str) -> TransportError {
        TransportError::PeerDown { peer: self.to, reason: reason.into() }
    }

    /// Performs `op` now, against the current fabric state.
    fn execute(&self, op: Op, corrupt: bool) -> Result<Completion> {
        let (regions, inbox) = {
            let nodes = self.fabric.0.lock_nodes();
            let alive = |n| nodes.get(&n).is_some_and(|s: &NodeState| s.alive);
            if !alive(self.from) || !alive(self.to) || self.closed.load(Ordering::SeqCst) {
                return Err(self.down("node killed (mem fault)"));
            }
            if self.fabric.is_cut(self.from, self.to) {
                return Err(self.down("link cut (mem fault)"));
            }
            let t = &nodes[&self.to];
            (t.regions.clone(), t.inbox.clone())
        };
        op.check_local()?;
        let refused = |status| TransportError::Refused { peer: self.to, op: "mem", status };
        match op {
            Op::Write { local, local_offset, remote, remote_offset, len, verify, placed_crc } => {
                let dst = regions.access(remote.id, remote.key, remote_offset, len).map_err(refused)?;
                copy_between(&local, local_offset, &dst, remote_offset, len, corrupt);
                self.stats.tx(len);
                check_crc(self.to, "write", verify, (&local, local_offset), (&dst, remote_offset), len)?;
                // The double reports the placed bytes' crc as shm does (read after the copy, so
                // an injected corruption shows in it).
                // SAFETY: the initiator owns the destination range for this operation.
                let crc = if placed_crc { unsafe { dst.crc32(remote_offset, len) }.ok() } else { None };
                Ok(Completion { bytes: len, crc })
            }
            Op::Read { local, local_offset, remote, remote_offset, len, verify } => {
                let src = regions.access(remote.id, remote.key, remote_offset, len).map_err(refused)?;
                copy_between(&src, remote_offset, &local, local_offset, len, corrupt);
                self.stats.rx(len);
                check_crc(self.to, "read", verify, (&src, remote_offset), (&local, local_offset), len)?;
                Ok(Completion::moved(len))
            }
            Op::Send { payload } => {
                let n = payload.len() as u64;
                inbox.send(Incoming { from: self.from, payload }).map_err(|_| self.down("receiver gone"))?;
                self.stats.tx(n);
                Ok(Completion::moved(n))
            }
        }
    }
}

fn copy_between(src: &Region, so: u64, dst: &Region, dof: u64, len: u64, corrupt: bool) {
    if len == 0 {
        return;
    }
    let (Ok(s), Ok(d)) = (src.ptr_range(so, len), dst.ptr_range(dof, len)) else { return };
    // SAFETY: both ranges were bounds-checked; the regions stay alive for the call. Only raw
    // pointers touch the memory (other tasks may write these regions as peers); `ptr::copy`
    // handles overlap when source and destination are the same region.
    unsafe {
        std::ptr::copy(s, d, len as usize);
        if corrupt {
            *d ^= 0x5a;
        }
    }
}

fn check_crc(
    peer: NodeId,
    op: &'static str,
    verify: bool,
    src: (&Region, u64),
    dst: (&Region, u64),
    len: u64,
) -> Result<()> {
    if !verify {
        return Ok(());
    }
    // SAFETY: the operation just copied these ranges; the initiator owns both until it completes.
    let expected = unsafe { src.0.crc32(src.1, len)? };
    // SAFETY: as above.
    let actual = unsafe { dst.0.crc32(dst.1, len)? };
    if expected != actual {
        return Err(TransportError::CrcMismatch { peer, op, expected, actual });
    }
    Ok(())
}

impl Link for MemLink {
    fn peer(&self) -> NodeId {
        self.to
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Mem
    }
    fn post(&self, ops: Vec<Op>) -> Vec<OpHandle> {
        let (mut items, handles): (Vec<(Op, Done)>, Vec<OpHandle>) = ops
            .into_iter()
            .rev()
            .map(|op| {
                let (done, h) = OpHandle::new(self.to);
                ((op, done), h)
            })
            .unzip();
        let handles = handles.into_iter().rev().collect();
        // `items` holds the batch last first: pop takes them in posting order.
        while let Some((op, done)) = items.pop() {
            match self.fabric.take_fault(self.from, self.to) {
                Some(Fault::Delay(d)) => {
                    // This operation and, behind it, the rest of the batch, in order (see `Link`).
                    items.push((op, done));
                    let me = self.clone_handle();
                    tokio::spawn(async move {
                        let mut first = Some(Fault::Delay(d));
                        while let Some((op, done)) = items.pop() {
                            let fault = first.take().or_else(|| me.fabric.take_fault(me.from, me.to));
                            if let Some(Fault::Delay(d)) = fault {
                                tokio::time::sleep(d).await;
                            }
                            me.run(op, done, fault);
                        }
                    });
                    break;
                }
                fault => self.run(op, done, fault),
            }
        }
        handles
    }
    fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::SeqCst)
            && self.fabric.is_alive(self.to)
            && self.fabric.is_alive(self.from)
            && !self.fabric.is_cut(self.from, self.to)
    }
    fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::SeqCst);
        for done in self.swallowed.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = done.send(Err(self.down(reason)));
        }
    }
}

impl MemLink {
    fn clone_handle(&self) -> MemLink {
        MemLink {
            from: self.from,
            to: self.to,
            fabric: self.fabric.clone(),
            stats: self.stats.clone(),
            closed: self.closed.clone(),
            swallowed: self.swallowed.clone(),
        }
    }

    /// Carries out one operation under `fault` (a delay is the caller's to wait out first).
    fn run(&self, op: Op, done: Done, fault: Option<Fault>) {
        match fault {
            Some(Fault::Drop) => self.swallowed.lock().unwrap_or_else(|e| e.into_inner()).push(done),
            Some(Fault::Corrupt | Fault::CorruptNext(_)) => self.finish(done, self.execute(op, true)),
            Some(Fault::Delay(_) | Fault::DelayNext(..)) | None => self.finish(done, self.execute(op, false)),
        }
    }

    fn finish(&self, done: Done, r: Result<Completion>) {
        match &r {
            Ok(_) => self.stats.op_ok(),
            Err(_) => self.stats.op_err(),
        }
        let _ = done.send(r);
    }
}

#[cfg(test)]
mod tests;
