//! The node side: the multicast service a `cascade node` runs.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cascade_transport::background;
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{register_new_blocking, Inbox, Mesh, PeerEvent, Received, Region, ServiceExt, TransportError};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::proto::{Control, Fill, Report};
use super::{chunk_crcs, fill_synthetic};
use crate::executor::DeviceTarget;
use crate::executor::{run_member, ChildSpec, CoordSink, MemberCmd, MemberCtx, Notice, Router, ToCoord};
use crate::layout::Layout;
use crate::topology::{Loc, NodeId};
use cascade_transport::device::DeviceMemory;

/// Run ids released recently: a request for one of them is refused rather than re-creating it.
const RELEASED_MEMORY: usize = 4096;

struct NodeRun {
    controller: NodeId,
    router: Arc<Router>,
    regions: BTreeMap<Loc, Region>,
    /// Locations whose region was lent by a higher layer (never deregistered here).
    lent: BTreeSet<Loc>,
    cmds: BTreeMap<Loc, mpsc::UnboundedSender<MemberCmd>>,
    resent: Arc<AtomicU64>,
    /// Device copies of GPU targets on this node (freed with the run).
    devices: BTreeMap<Loc, Arc<DeviceTarget>>,
    /// Lent sources whose crc pass runs once they start ([`Fill::LentCheckBeside`]).
    check_beside: BTreeSet<Loc>,
}

impl NodeRun {
    fn new(controller: NodeId) -> NodeRun {
        NodeRun {
            controller,
            router: Arc::new(Router::default()),
            regions: BTreeMap::new(),
            lent: BTreeSet::new(),
            cmds: BTreeMap::new(),
            resent: Arc::default(),
            devices: BTreeMap::new(),
            check_beside: BTreeSet::new(),
        }
    }
}

#[derive(Default)]
struct State {
    runs: BTreeMap<u32, NodeRun>,
    released: VecDeque<u32>,
    /// Regions set aside for the next run's target at their location ([`MulticastNode::reserve_target`]).
    reserved: BTreeMap<Loc, Region>,
}

struct ToController {
    mesh: Arc<dyn Mesh>,
    controller: NodeId,
    run: u32,
}

impl CoordSink for ToController {
    fn send(&self, msg: ToCoord) {
        // One-way and in order on the link; a dead link is seen through the controller's events.
        if let Err(e) = self.mesh.post_oneway(self.controller, &Report { run: self.run, msg }) {
            debug!(run = self.run, error = %e, "cannot report to the controller");
        }
    }
}

/// The multicast service of one node: prepares members' regions, runs member tasks, verifies,
/// releases. Higher layers on the same node lend it source regions and take kept targets out.
pub struct MulticastNode {
    mesh: Arc<dyn Mesh>,
    op_timeout: Duration,
    state: Mutex<State>,
    /// Device memory of this node's GPUs, by index: targets `NODE/gpuN` land there.
    devices: Mutex<BTreeMap<u32, Arc<dyn DeviceMemory>>>,
    /// How many GPUs the node has (targets on a GPU beyond them are refused); 0 until a device
    /// is attached or declared: every GPU is then emulated in host memory.
    gpus: AtomicU32,
}

fn protocol(detail: String) -> TransportError {
    TransportError::Protocol { peer: None, detail }
}

fn unknown(run: u32) -> TransportError {
    protocol(format!("unknown multicast run {run}"))
}

impl MulticastNode {
    /// Starts the service on `mesh`: takes the multicast and multicast-notice inboxes now (so a
    /// request that arrives next is served) and serves them on a task until the node's service
    /// table closes. `op_timeout` limits each chunk WRITE and notice.
    pub fn start(mesh: Arc<dyn Mesh>, op_timeout: Duration) -> Result<Arc<MulticastNode>, TransportError> {
        let control = mesh.subscribe::<Control>(DEFAULT_INBOX)?;
        let notices = mesh.subscribe::<Notice>(DEFAULT_INBOX)?;
        let events = mesh.peer_events();
        let node = Arc::new(MulticastNode {
            mesh,
            op_timeout,
            state: Mutex::default(),
            devices: Mutex::default(),
            gpus: AtomicU32::new(0),
        });
        tokio::spawn(node.clone().serve(control, notices, events));
        Ok(node)
    }

    /// Makes `dev` this node's GPU `gpu`: from now on a run's target at `NODE/gpu{gpu}` lands in
    /// a host staging region as before, and each layer, once every chunk of it is verified, is
    /// copied to a buffer in `dev`; the target is reported done only when the device copy reads
    /// back with every chunk's crc. Without a device a GPU target is host memory (emulated).
    pub fn attach_device(&self, gpu: u32, dev: Arc<dyn DeviceMemory>) {
        tracing::info!(node = self.mesh.node(), gpu, device = %dev.describe(), "GPU targets land in device memory");
        self.devices.lock().unwrap_or_else(|e| e.into_inner()).insert(gpu, dev);
        self.declare_gpus(gpu.saturating_add(1));
    }

    /// Says the node has at least `n` GPUs, `gpu0` to `gpu{n-1}` (those without an attached
    /// device hold their targets in host memory): a target on a GPU beyond them is refused.
    pub fn declare_gpus(&self, n: u32) {
        self.gpus.fetch_max(n, Ordering::Relaxed);
    }

    /// Refuses a target on a GPU the node does not have (once it has declared its GPUs): the copy
    /// would have landed in host memory and been reported as on that GPU. A node that declared
    /// none emulates every GPU in host memory (the test double).
    fn has_gpu(&self, gpu: u32) -> Result<(), TransportError> {
        let n = self.gpus.load(Ordering::Relaxed);
        if n == 0 || gpu < n {
            return Ok(());
        }
        let has = if n == 1 { "only gpu0".to_string() } else { format!("gpu0 to gpu{}", n - 1) };
        Err(protocol(format!("node {} has no gpu{gpu}: it has {has}", self.mesh.node())))
    }

    /// The device copy of target `loc` in run `run` (while the run is on), if `loc` is a GPU
    /// with an attached device.
    pub fn device_target(&self, run: u32, loc: Loc) -> Option<Arc<DeviceTarget>> {
        self.state().runs.get(&run)?.devices.get(&loc).cloned()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn serve(
        self: Arc<Self>,
        mut control: Inbox<Control>,
        mut notices: Inbox<Notice>,
        mut events: tokio::sync::broadcast::Receiver<PeerEvent>,
    ) {
        loop {
            tokio::select! {
                m = control.recv() => {
                    let Some(m) = m else { return };
                    // Each request in its own task: checksums and fills never hold up the
                    // notices of other runs.
                    tokio::spawn(self.clone().handle(m));
                }
                n = notices.recv() => {
                    let Some(n) = n else { return };
                    let router = self.state().runs.get(&n.msg.run).map(|r| r.router.clone());
                    match router {
                        Some(r) => r.route(n.msg),
                        None => debug!(run = n.msg.run, "notice for a run this node does not have"),
                    }
                }
                ev = events.recv() => match ev {
                    Ok(PeerEvent::Down { peer, .. }) => self.drop_runs_of(peer),
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    _ => {}
                },
            }
        }
    }

    /// Lends `region` (a copy a higher layer holds) to run `run` as the source at `loc`, for the
    /// controller `controller`. The run reads it and never deregisters it; the lender must not
    /// write it while lent, nor after a run that checks it beside the transfer
    /// ([`Fill::LentCheckBeside`]) until that pass ends (it holds a clone of the region, so the
    /// region stays mapped; a held copy is never written again, only dropped).
    pub fn lend(&self, run: u32, loc: Loc, region: Region, controller: NodeId) -> Result<(), TransportError> {
        let mut st = self.state();
        if st.released.contains(&run) {
            return Err(protocol(format!("run {run} was released already")));
        }
        let r = st.runs.entry(run).or_insert_with(|| NodeRun::new(controller));
        if r.regions.contains_key(&loc) {
            return Err(protocol(format!("run {run} already has a region at {loc}")));
        }
        r.lent.insert(loc);
        r.regions.insert(loc, region);
        Ok(())
    }

    /// Sets `region` aside for a copy that will arrive at `loc` (a host location of this node):
    /// the next run that prepares a target there of exactly `region.len()` bytes takes it,
    /// registered then, instead of allocating one. A new instance that knows its model's size
    /// reserves its copy when it starts, its pages faulted in while it waits
    /// ([`Prefault::Background`](cascade_transport::Prefault)), so that the transfer does not
    /// pay for them: on this 2-core VM, allocating 540 MB of shared pages while the copy ran
    /// cost `cascade pd`'s scale-out 2–3 s of its transfer. A run that takes the region owns it
    /// as any target region (dropped with the run unless a higher layer detaches it). A later
    /// reservation at `loc` replaces an unused one.
    pub fn reserve_target(&self, loc: Loc, region: Region) -> Result<(), TransportError> {
        if loc.node != self.mesh.node() || loc.gpu.is_some() {
            return Err(protocol(format!("{loc} is not a host location of node {}", self.mesh.node())));
        }
        self.state().reserved.insert(loc, region);
        Ok(())
    }

    /// A handle on the region of `loc` in run `run` while the run is on, for a higher layer on
    /// this node that serves from a target as it fills (layer-wise serving). The run keeps
    /// writing the region: read only the layers its `LayerReady` events reported — those chunks
    /// are crc-verified here and the run never writes them again.
    pub fn region(&self, run: u32, loc: Loc) -> Result<Region, TransportError> {
        let st = self.state();
        let r = st.runs.get(&run).ok_or_else(|| unknown(run))?;
        r.regions.get(&loc).cloned().ok_or_else(|| protocol(format!("run {run} has no region at {loc}")))
    }

    /// Takes the region of target `loc` out of run `run`: releasing the run no longer drops it.
    /// The caller takes over its registration (it stays registered).
    pub fn detach(&self, run: u32, loc: Loc) -> Result<Region, TransportError> {
        let mut st = self.state();
        let r = st.runs.get_mut(&run).ok_or_else(|| unknown(run))?;
        if r.lent.contains(&loc) {
            return Err(protocol(format!("{loc} is a source of run {run}, not a new copy")));
        }
        let region = r.regions.remove(&loc).ok_or_else(|| protocol(format!("run {run} has no region at {loc}")))?;
        // The member task only reads the region from now on; ending it is release's job.
        Ok(region)
    }

    /// The controller of these runs is gone: nobody will detach or release their regions.
    fn drop_runs_of(&self, controller: NodeId) {
        let mut st = self.state();
        let orphans: Vec<u32> = st.runs.iter().filter(|(_, r)| r.controller == controller).map(|(id, _)| *id).collect();
        for id in orphans {
            if let Some(r) = st.runs.remove(&id) {
                self.release_regions(&r);
                remember(&mut st.released, id);
                info!(run = id, controller, "dropped the run of a controller that went down");
            }
        }
    }

    fn release_regions(&self, r: &NodeRun) {
        for (loc, region) in &r.regions {
            if !r.lent.contains(loc) {
                self.mesh.deregister(region.id());
            }
        }
        // Dropping the command senders ends the member tasks.
    }

    async fn handle(self: Arc<Self>, m: Received<Control>) {
        let Some(to) = m.reply_to else {
            warn!(from = m.from, "a multicast control message that is not a request");
            return;
        };
        let reply = match self.serve_request(m.from, m.msg).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "multicast control request failed");
                Control::Failed { message: e.to_string() }
            }
        };
        if let Err(e) = self.mesh.reply(&to, &reply) {
            warn!(to = to.peer, error = %e, "cannot answer the multicast controller");
        }
    }

    async fn serve_request(&self, from: NodeId, c: Control) -> Result<Control, TransportError> {
        match c {
            Control::Prepare { run, loc, bytes, chunk, fill } => self.prepare(from, run, loc, bytes, chunk, fill).await,
            Control::Start { run, loc, layout, source, children, ready_first } => {
                let bytes = layout.bytes;
                let (ctx, inbox, rx) = self.member(run, loc, layout, source)?;
                let check = self.state().runs.get_mut(&run).is_some_and(|r| r.check_beside.remove(&loc));
                if check {
                    check_beside(&ctx);
                }
                // Otherwise the first WRITE to each child looks its region up, and each copy maps
                // the pages it writes (allocated by then, or by the copy itself).
                if ready_first {
                    ready_children(self.mesh.clone(), self.op_timeout, &children, bytes).await;
                }
                tokio::spawn(run_member(ctx, children, inbox, rx));
                Ok(Control::Ack)
            }
            Control::AddChild { run, loc, child } => {
                let st = self.state();
                let r = st.runs.get(&run).ok_or_else(|| unknown(run))?;
                let tx = r.cmds.get(&loc).ok_or_else(|| protocol(format!("run {run} has no member at {loc}")))?;
                tx.send(MemberCmd::AddChild(child)).map_err(|_| protocol(format!("member {loc} has ended")))?;
                Ok(Control::Ack)
            }
            Control::Verify { run, loc } => {
                let region = {
                    let st = self.state();
                    let r = st.runs.get(&run).ok_or_else(|| unknown(run))?;
                    r.regions.get(&loc).cloned().ok_or_else(|| unknown(run))?
                };
                let crc = blocking(move || {
                    let n = region.len();
                    // SAFETY: the controller verifies a target after it reported Done (every
                    // chunk's WRITE completed and was checked) and a source that only sends.
                    unsafe { region.crc32(0, n) }
                })
                .await?;
                Ok(Control::Verified { crc })
            }
            Control::Release { run } => {
                let mut st = self.state();
                if let Some(r) = st.runs.remove(&run) {
                    self.release_regions(&r);
                }
                remember(&mut st.released, run);
                Ok(Control::Ack)
            }
            other => Err(protocol(format!("a node does not serve {other:?}"))),
        }
    }

    /// The context of member `loc` of `run`, registered with the run's router.
    fn member(
        &self,
        run: u32,
        loc: Loc,
        layout: Layout,
        source: bool,
    ) -> Result<(MemberCtx, mpsc::UnboundedReceiver<Notice>, mpsc::UnboundedReceiver<MemberCmd>), TransportError> {
        let dev = match loc.gpu {
            Some(i) if !source => self.devices.lock().unwrap_or_else(|e| e.into_inner()).get(&i).cloned(),
            _ => None,
        };
        let mut st = self.state();
        let r = st.runs.get_mut(&run).ok_or_else(|| unknown(run))?;
        let region = r.regions.get(&loc).cloned().ok_or_else(|| unknown(run))?;
        let device = match dev {
            Some(dev) => {
                let t = Arc::new(DeviceTarget::new(dev, &region, layout.chunk)?);
                r.devices.insert(loc, t.clone());
                Some(t)
            }
            None => None,
        };
        let inbox = r.router.add(loc);
        let (tx, rx) = mpsc::unbounded_channel();
        r.cmds.insert(loc, tx);
        let ctx = MemberCtx {
            run,
            me: loc,
            is_source: source,
            layout: Arc::new(layout),
            mesh: self.mesh.clone(),
            region,
            router: r.router.clone(),
            coord: Arc::new(ToController { mesh: self.mesh.clone(), controller: r.controller, run }),
            op_timeout: self.op_timeout,
            resent: r.resent.clone(),
            device,
        };
        Ok((ctx, inbox, rx))
    }

    /// The region lent to `run` at `loc`, if it holds `bytes`.
    fn lent_region(&self, run: u32, loc: Loc, bytes: u64) -> Result<Region, TransportError> {
        let region = {
            let st = self.state();
            let r = st.runs.get(&run).filter(|r| r.lent.contains(&loc));
            r.and_then(|r| r.regions.get(&loc).cloned())
                .ok_or_else(|| protocol(format!("no region was lent to run {run} at {loc}")))?
        };
        if region.len() < bytes {
            return Err(protocol(format!("the lent region has {} bytes, the run moves {bytes}", region.len())));
        }
        Ok(region)
    }

    /// Takes the region reserved at `loc` if it has exactly `bytes` (one of another size stays).
    fn take_reserved(&self, loc: Loc, bytes: u64) -> Option<Region> {
        let mut st = self.state();
        match st.reserved.get(&loc) {
            Some(r) if r.len() == bytes => st.reserved.remove(&loc),
            _ => None,
        }
    }

    async fn prepare(
        &self,
        from: NodeId,
        run: u32,
        loc: Loc,
        bytes: u64,
        chunk: u64,
        fill: Fill,
    ) -> Result<Control, TransportError> {
        if self.state().released.contains(&run) {
            return Err(protocol(format!("run {run} was released already")));
        }
        if let (Some(gpu), Fill::Target | Fill::TargetInBackground) = (loc.gpu, &fill) {
            self.has_gpu(gpu)?;
        }
        let reserved = match fill {
            Fill::Target | Fill::TargetInBackground => self.take_reserved(loc, bytes),
            _ => None,
        };
        let (region, crcs) = match (fill, reserved) {
            (Fill::Lent, _) => {
                let region = self.lent_region(run, loc, bytes)?;
                let r2 = region.clone();
                // SAFETY: a lent region is a held copy: complete, and written by nobody while lent.
                let crcs = blocking(move || unsafe { chunk_crcs(&r2, bytes, chunk) }).await?;
                return Ok(Control::Prepared { region: region.id().0, key: region.key().0, crcs: Some(crcs) });
            }
            (Fill::LentCheckBeside, _) => {
                let region = self.lent_region(run, loc, bytes)?;
                // The pass starts with the source (`Start`): the targets' start-up, on the same
                // cores, does not wait behind it.
                let mut st = self.state();
                if let Some(r) = st.runs.get_mut(&run) {
                    r.check_beside.insert(loc);
                }
                return Ok(Control::Prepared { region: region.id().0, key: region.key().0, crcs: None });
            }
            (Fill::Synthetic { seed }, _) => {
                let region = register_new_blocking(self.mesh.clone(), bytes).await?;
                let r2 = region.clone();
                let done = blocking(move || {
                    // SAFETY: the region is new: no peer knows its key before the reply below.
                    unsafe { fill_synthetic(&r2, bytes, seed)? };
                    // SAFETY: as above.
                    unsafe { chunk_crcs(&r2, bytes, chunk) }
                })
                .await;
                match done {
                    Ok(crcs) => (region, Some(crcs)),
                    Err(e) => {
                        self.mesh.deregister(region.id());
                        return Err(e);
                    }
                }
            }
            (Fill::Target | Fill::TargetInBackground, Some(region)) => {
                self.mesh.register(&region)?;
                debug!(run, %loc, bytes, "the target's region is the one reserved for it");
                (region, None)
            }
            (Fill::Target, None) => {
                // Allocating (and pre-faulting) a large region takes long: not on the node's
                // async workers, whose links would miss their keepalives meanwhile.
                (register_new_blocking(self.mesh.clone(), bytes).await?, None)
            }
            (Fill::TargetInBackground, None) => (self.mesh.register_new_background(bytes)?, None),
        };
        let reply = Control::Prepared { region: region.id().0, key: region.key().0, crcs };
        let mut st = self.state();
        if st.released.contains(&run) {
            // Released while this request was filling: nothing may stay behind.
            self.mesh.deregister(region.id());
            return Err(protocol(format!("run {run} was released while it was prepared")));
        }
        let r = st.runs.entry(run).or_insert_with(|| NodeRun::new(from));
        if let Some(old) = r.regions.insert(loc, region) {
            if !r.lent.contains(&loc) {
                self.mesh.deregister(old.id());
            }
        }
        Ok(reply)
    }
}

/// Runs a lent source's crc pass beside the transfer and reports it to the run's controller
/// ([`ToCoord::SourceChecked`]; no crcs when the pass failed).
fn check_beside(ctx: &MemberCtx) {
    let (region, coord, loc, run) = (ctx.region.clone(), ctx.coord.clone(), ctx.me, ctx.run);
    let (bytes, chunk) = (ctx.layout.bytes, ctx.layout.chunk);
    tokio::spawn(async move {
        // At background priority: the transfer it runs beside comes first on a busy host.
        let pass = background::run_in_background("cascade-crc-pass", move || {
            // SAFETY: a lent region is a held copy, never written again (the contract of
            // `lend`); the run's members only read it too, and the clone keeps it mapped.
            unsafe { chunk_crcs(&region, bytes, chunk) }
        });
        let crcs = match pass.await {
            Some(Ok(crcs)) => crcs,
            failed => {
                warn!(run, %loc, error = ?failed.map(|r| r.err()), "the lent source's crc pass failed");
                Vec::new()
            }
        };
        coord.send(ToCoord::SourceChecked { loc, crcs });
    });
}

/// Readies the links to a member's children on other nodes for its first chunk: each
/// child's region is looked up and, on shared memory, mapped (see `Link::prepare`), so that
/// none of it falls in the transfer. It runs before the member is started and its start
/// acknowledged, when the run asks for it; a child whose link cannot be readied is left to the first WRITE, which
/// reports what is wrong.
async fn ready_children(mesh: Arc<dyn Mesh>, op_timeout: Duration, children: &[ChildSpec], bytes: u64) {
    let me = mesh.node();
    let handles: Vec<_> = children
        .iter()
        .filter(|c| c.loc.node != me)
        .filter_map(|c| Some((c.loc, mesh.link(c.loc.node).ok()?.prepare(c.remote(bytes)))))
        .collect();
    for (child, h) in handles {
        if let Err(e) = h.wait("ready a child", op_timeout).await {
            debug!(%child, error = %e, "child's region not readied; the first write will");
        }
    }
}

fn remember(released: &mut VecDeque<u32>, run: u32) {
    released.push_back(run);
    while released.len() > RELEASED_MEMORY {
        released.pop_front();
    }
}

/// Runs CPU-heavy work (checksums, fills) on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TransportError> + Send + 'static,
) -> Result<T, TransportError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| protocol(format!("blocking task failed: {e}")))?
}
