//! The member side: one task per plan member on its node, and the per-node router that hands it
//! the notices addressed to it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cascade_transport::{BackendKind, Link, Mesh, Op, Region, RemoteRegion, ServiceExt, TransportError};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;

use super::notice::{Kind, Notice};
use crate::layout::Layout;
use crate::topology::Loc;

/// Chunks in flight from one member to one child.
const WINDOW: usize = 4;
/// Bytes in flight to a child over tcp, where each chunk's notice rides behind its bytes
/// ([`notice_rides_behind`]), in chunks of at least [`WINDOW`]: enough queued data that a member
/// the two-core host did not schedule for a few milliseconds does not idle its link (16 of the
/// 64 KiB chunks of a long chain), and no more, since everything queued on a host's link also
/// delays the TCP acknowledgements it sends upstream. Measured on the netns bed (1000 Mbit/s,
/// 64 MiB, 8 targets, ten runs each): 1.052–1.074× the bound (median 1.058) against
/// 1.054–1.112× (1.075) with the notice after the WRITE's completion and 4 in flight; with the
/// notice after the completion, 32 chunks in flight gave 1.25×, as each notice then waited
/// behind the queued chunks.
const STREAM_BYTES_IN_FLIGHT: u64 = 1 << 20;

/// Whether a chunk's notice is posted in the WRITE's batch, right behind its bytes, rather than
/// after its completion: over tcp, whose link reports no crc of the bytes as placed (the child
/// reads the chunk for its crc either way), so waiting for the round trip buys nothing. On shm
/// (and the `mem` double) the completion's crc, computed by the copy, spares the child that pass
/// over memory, which is what limits a chain on one host.
fn notice_rides_behind(kind: BackendKind) -> bool {
    kind == BackendKind::Tcp
}

/// How often a member looks for a link that is not up yet.
const LINK_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// A child of a member: where it is and which region of its node to write into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChildSpec {
    /// The child's location.
    pub loc: Loc,
    /// Region id on the child's node.
    pub region: u32,
    /// Its remote key.
    pub key: u64,
    /// Layers `[0, held_layers)` the child already holds verified (it reported them ready): a
    /// sender taking it over after a re-plan starts at the first chunk of the next layer.
    pub held_layers: u32,
}

impl ChildSpec {
    pub(crate) fn remote(&self, len: u64) -> RemoteRegion {
        RemoteRegion {
            node: self.loc.node,
            id: cascade_transport::RegionId(self.region),
            key: cascade_transport::RemoteKey(self.key),
            len,
        }
    }
}

/// What a member tells its coordinator.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ToCoord {
    /// The member holds every chunk, verified.
    Done(Loc),
    /// Every chunk of a layer is verified at the member.
    LayerReady {
        /// The member.
        loc: Loc,
        /// The layer.
        layer: usize,
    },
    /// The member could not send to a child.
    ChildLost {
        /// The sender.
        parent: Loc,
        /// The child.
        child: Loc,
        /// The error.
        reason: String,
    },
    /// A lent source's node finished the crc32 pass over its region that runs beside the
    /// transfer ([`Fill::LentCheckBeside`](crate::cluster::Fill::LentCheckBeside)): the
    /// controller compares these with the layout's. Not a member's report; the coordinator
    /// ignores it.
    SourceChecked {
        /// The source.
        loc: Loc,
        /// Its chunks' crc32, in order (empty: the pass failed).
        crcs: Vec<u32>,
    },
}

/// Where members send their reports (a channel in-process, the controller's link in a daemon).
pub(crate) trait CoordSink: Send + Sync + 'static {
    /// Delivers one report.
    fn send(&self, m: ToCoord);
}

impl CoordSink for mpsc::UnboundedSender<ToCoord> {
    fn send(&self, m: ToCoord) {
        let _ = mpsc::UnboundedSender::send(self, m);
    }
}

/// Commands from the coordinator to a member.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum MemberCmd {
    /// Start sending a new child every chunk from its first layer not held (`held_layers`).
    AddChild(ChildSpec),
}

/// Routes a node's notices (for one run) to its member tasks; also carries same-node deliveries.
/// Notices for a member that is not registered yet are kept until it is.
#[derive(Default)]
pub(crate) struct Router {
    inner: Mutex<RouterState>,
}

#[derive(Default)]
struct RouterState {
    inboxes: BTreeMap<Loc, mpsc::UnboundedSender<Notice>>,
    early: BTreeMap<Loc, Vec<Notice>>,
}

impl Router {
    pub(crate) fn add(&self, loc: Loc) -> mpsc::UnboundedReceiver<Notice> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for n in st.early.remove(&loc).unwrap_or_default() {
            let _ = tx.send(n);
        }
        st.inboxes.insert(loc, tx);
        rx
    }

    pub(crate) fn deliver(&self, n: Notice) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match st.inboxes.get(&n.to) {
            Some(tx) => {
                let _ = tx.send(n);
            }
            None => st.early.entry(n.to).or_default().push(n),
        }
    }

    /// Hands a received notice of this router's run to its member.
    pub(crate) fn route(&self, n: Notice) {
        self.deliver(n);
    }
}

/// Everything a member task needs.
pub(crate) struct MemberCtx {
    pub(crate) run: u32,
    pub(crate) me: Loc,
    pub(crate) is_source: bool,
    pub(crate) layout: Arc<Layout>,
    pub(crate) mesh: Arc<dyn Mesh>,
    pub(crate) region: Region,
    pub(crate) router: Arc<Router>,
    pub(crate) coord: Arc<dyn CoordSink>,
    pub(crate) op_timeout: Duration,
    pub(crate) resent: Arc<std::sync::atomic::AtomicU64>,
    /// Where a GPU target's layers go once verified in the staging region.
    pub(crate) device: Option<Arc<DeviceTarget>>,
}

/// A GPU target's copy in device memory: its buffer, on its device.
pub struct DeviceTarget {
    /// The device.
    pub dev: Arc<dyn cascade_transport::device::DeviceMemory>,
    /// The buffer, as long as the staging region.
    pub buf: cascade_transport::device::DeviceBuffer,
    /// The staging region pinned for the device (where the device pins), while the run is on.
    pub pinned: Option<cascade_transport::device::PinGuard>,
    /// Where the device copy is read back to be checked, one chunk at a time.
    read_back: Mutex<cascade_transport::device::ReadBack>,
}

impl DeviceTarget {
    /// A buffer on `dev` as long as `region` (the target's staging region, pinned for the device
    /// while this lives) and a read-back buffer of one `chunk`.
    pub fn new(
        dev: Arc<dyn cascade_transport::device::DeviceMemory>,
        region: &cascade_transport::Region,
        chunk: u64,
    ) -> Result<DeviceTarget, TransportError> {
        let buf = dev.alloc(region.len())?;
        let pinned = dev.pin(region)?;
        let read_back = Mutex::new(cascade_transport::device::ReadBack::new(dev.as_ref(), chunk)?);
        Ok(DeviceTarget { dev, buf, pinned, read_back })
    }

    /// Copies layer `l` (every chunk verified in `region`) to the device.
    fn upload_layer(&self, layout: &Layout, region: &cascade_transport::Region, l: usize) -> Result<(), String> {
        let chunks = layout.chunks_of_layer(l);
        if chunks.is_empty() {
            return Ok(());
        }
        let (start, end) = (layout.chunk_range(chunks.start).start, layout.chunk_range(chunks.end - 1).end);
        // SAFETY: every chunk of the layer is verified here, and a member writes a verified
        // chunk's range never again (only a NACKed, unverified one is re-sent).
        unsafe {
            cascade_transport::device::upload_region(self.dev.as_ref(), &self.buf, start, region, start, end - start)
        }
        .map_err(|e| format!("copying layer {l} to {}: {e}", self.dev.describe()))
    }

    /// Reads `chunks` back from the device and checks their crcs.
    fn verify(&self, layout: &Layout, chunks: std::ops::Range<u32>) -> Result<(), String> {
        let ranges = chunks.clone().map(|i| (layout.chunk_range(i), layout.crcs[i as usize]));
        let mut rb = self.read_back.lock().unwrap_or_else(|e| e.into_inner());
        match rb.verify(self.dev.as_ref(), &self.buf, ranges) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(i)) => Err(format!(
                "chunk {} differs on {} from what was verified",
                chunks.start + i as u32,
                self.dev.describe()
            )),
            Err(e) => Err(format!("reading back from {}: {e}", self.dev.describe())),
        }
    }

    /// Starts the thread that moves this target's layers to the device as they complete here,
    /// so the member keeps taking chunks while the copies run. Each layer sent to the returned
    /// channel (in order) is uploaded, read back and checked chunk by chunk, then announced as
    /// ready through `report`; after the last layer the target reports done. On a failed copy or
    /// check it says why and reports nothing more: the target will not complete.
    fn start_copier(
        self: Arc<Self>,
        ctx: Arc<MemberCtx>,
        report: mpsc::UnboundedSender<ToCoord>,
    ) -> std::io::Result<std::sync::mpsc::Sender<usize>> {
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        std::thread::Builder::new().name(format!("device-copy-{}", ctx.me)).spawn(move || {
            let last = ctx.layout.layers.len().saturating_sub(1);
            let mut checked = 0;
            for l in rx {
                let upto = ctx.layout.chunks_of_layer(l).end.max(checked);
                let copied = self.upload_layer(&ctx.layout, &ctx.region, l).and_then(|()| self.verify(&ctx.layout, checked..upto));
                if let Err(why) = copied {
                    tracing::error!(run = ctx.run, loc = %ctx.me, %why, "device copy failed; the target will not complete");
                    return;
                }
                checked = upto;
                let _ = report.send(ToCoord::LayerReady { loc: ctx.me, layer: l });
                if l == last {
                    let _ = report.send(ToCoord::Done(ctx.me));
                }
            }
        })?;
        Ok(tx)
    }
}

#[derive(Clone)]
enum Dest {
    /// A child on another node; its link is looked up for every chunk (links are replaced when
    /// they reconnect).
    Remote {
        node: cascade_transport::NodeId,
        region: RemoteRegion,
    },
    Local {
        region: Region,
    },
}

impl MemberCtx {
    fn dest(&self, child: &ChildSpec) -> Result<Dest, TransportError> {
        if child.loc.node == self.mesh.node() {
            let region = self
                .mesh
                .regions()
                .get(cascade_transport::RegionId(child.region))
                .ok_or(TransportError::NotConnected { peer: child.loc.node })?;
            return Ok(Dest::Local { region });
        }
        Ok(Dest::Remote { node: child.loc.node, region: child.remote(self.layout.bytes) })
    }

    /// The link to `node`, waiting up to the operation timeout for it to come up: a node may
    /// serve a run before its own mesh is complete, and a link may be reconnecting. A node that
    /// is really gone is seen by the coordinator, which re-plans meanwhile.
    async fn link_to(&self, node: cascade_transport::NodeId) -> Result<Arc<dyn Link>, TransportError> {
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        loop {
            match self.mesh.link(node) {
                Ok(l) if l.is_alive() => return Ok(l),
                r if tokio::time::Instant::now() >= deadline => {
                    return Err(r.err().unwrap_or(TransportError::NotConnected { peer: node }))
                }
                _ => tokio::time::sleep(LINK_POLL).await,
            }
        }
    }

    /// Moves chunk `i` of this member's region to `to` and tells it.
    async fn send_chunk(&self, to: Loc, dest: &Dest, i: u32) -> Result<(), TransportError> {
        let r = self.layout.chunk_range(i);
        let notice = Notice { run: self.run, kind: Kind::Chunk, index: i, from: self.me, to, crc: None };
        match dest {
            Dest::Local { region } => {
                // Same node: a local copy (stand-in for an NVLink/PCIe copy).
                // SAFETY: this member holds chunk `i` verified (it only forwards what it has, and
                // nobody writes a chunk after that); the child's chunk `i` is written by its one
                // sender, this member, until the notice below.
                unsafe { self.region.copy_to(r.start, region, r.start, r.end - r.start)? };
                self.router.deliver(notice);
                Ok(())
            }
            Dest::Remote { node, region } => {
                let link = self.link_to(*node).await?;
                let write = Op::write(&self.region, r.start, *region, r.start, r.end - r.start);
                if notice_rides_behind(link.kind()) {
                    // One batch: the link delivers the notice after the bytes are placed.
                    let handles = self.mesh.post_oneway_after(*node, vec![write], &notice)?;
                    for (h, what) in handles.into_iter().zip(["chunk write", "chunk notice"]) {
                        h.wait(what, self.op_timeout).await?;
                    }
                    return Ok(());
                }
                // The notice is posted only once the WRITE has completed, so data precedes it.
                let h = link.post(vec![write.with_placed_crc()]).pop().ok_or_else(|| closed(to))?;
                let done = h.wait("chunk write", self.op_timeout).await?;
                self.notify(Notice { crc: done.crc, ..notice }).await
            }
        }
    }

    async fn notify(&self, n: Notice) -> Result<(), TransportError> {
        let h = self.mesh.post_oneway(n.to.node, &n)?;
        h.wait("chunk notice", self.op_timeout).await.map(drop)
    }

    async fn send_nack(&self, to: Loc, i: u32) {
        let n = Notice { run: self.run, kind: Kind::Nack, index: i, from: self.me, to, crc: None };
        if to.node == self.mesh.node() {
            self.router.deliver(n);
        } else {
            let _ = self.notify(n).await;
        }
    }
}

fn closed(peer: Loc) -> TransportError {
    TransportError::PeerDown { peer: peer.node, reason: "link closed".into() }
}

/// Chunks a member holds, with a wake-up for its forwarding tasks.
struct Have {
    bits: Mutex<Vec<bool>>,
    more: Notify,
}

impl Have {
    fn has(&self, i: u32) -> bool {
        self.bits.lock().unwrap_or_else(|e| e.into_inner())[i as usize]
    }

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

/// One member: verifies what arrives, forwards to its children, answers NACKs.
pub(crate) async fn run_member(
    ctx: MemberCtx,
    initial_children: Vec<ChildSpec>,
    mut inbox: mpsc::UnboundedReceiver<Notice>,
    mut cmds: mpsc::UnboundedReceiver<MemberCmd>,
) {
    let ctx = Arc::new(ctx);
    let n = ctx.layout.chunks();
    let have = Arc::new(Have { bits: Mutex::new(vec![ctx.is_source; n as usize]), more: Notify::new() });
    let mut count = if ctx.is_source { n } else { 0 };
    let mut next_layer = 0;
    // A GPU target's layers go to its device on a thread of their own, which announces each as
    // ready once it is there and checked; its reports come back through `from_device`.
    let (to_coord, mut from_device) = mpsc::unbounded_channel();
    let mut device_failed = false;
    let copier = match ctx.device.clone() {
        Some(d) => match d.start_copier(ctx.clone(), to_coord) {
            Ok(tx) => Some(tx),
            Err(e) => {
                tracing::error!(run = ctx.run, loc = %ctx.me, error = %e, "cannot start the device copier; the target will not complete");
                device_failed = true;
                None
            }
        },
        None => None,
    };
    let mut layer_left: Vec<u32> =
        (0..ctx.layout.layers.len()).map(|l| ctx.layout.chunks_of_layer(l).len() as u32).collect();
    let mut forwarders = JoinSet::new();
    let mut dests: BTreeMap<Loc, Dest> = BTreeMap::new();
    // Children a WRITE to failed: reported lost, and sent nothing more on their NACKs (over tcp a
    // refused WRITE's notice still arrives, and its NACK would ask for the chunk again and again).
    let given_up: Arc<Mutex<BTreeSet<Loc>>> = Arc::default();
    let give_up = |set: &Mutex<BTreeSet<Loc>>, child: Loc| {
        set.lock().unwrap_or_else(|e| e.into_inner()).insert(child);
    };
    let add_child = |child: ChildSpec, forwarders: &mut JoinSet<()>, dests: &mut BTreeMap<Loc, Dest>| {
        let lost = |reason: String| ToCoord::ChildLost { parent: ctx.me, child: child.loc, reason };
        given_up.lock().unwrap_or_else(|e| e.into_inner()).remove(&child.loc);
        match ctx.dest(&child) {
            Ok(d) => {
                dests.insert(child.loc, d.clone());
                let (c2, have, given_up) = (ctx.clone(), have.clone(), given_up.clone());
                forwarders.spawn(async move {
                    // Up to WINDOW chunks (over tcp, STREAM_BYTES_IN_FLIGHT) in flight to this
                    // child: a WRITE's round trip and its notice overlap the next chunks' transfer
                    // instead of idling the link.
                    let stream = match d {
                        Dest::Remote { node, .. } => {
                            c2.link_to(node).await.is_ok_and(|l| notice_rides_behind(l.kind()))
                        }
                        Dest::Local { .. } => false,
                    };
                    let window = match stream {
                        true => WINDOW.max((STREAM_BYTES_IN_FLIGHT / c2.layout.chunk.max(1)) as usize),
                        false => WINDOW,
                    };
                    let window = Arc::new(Semaphore::new(window));
                    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let mut inflight = JoinSet::new();
                    // A child taken over after a re-plan holds its first layers already.
                    let layers = c2.layout.layers.len();
                    let first = match child.held_layers as usize {
                        0 => 0,
                        h if h >= layers => c2.layout.chunks(),
                        h => c2.layout.chunks_of_layer(h).start,
                    };
                    for i in first..c2.layout.chunks() {
                        have.wait(i).await;
                        let Ok(permit) = window.clone().acquire_owned().await else { return };
                        if failed.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                        let (c3, d, failed, given_up) = (c2.clone(), d.clone(), failed.clone(), given_up.clone());
                        inflight.spawn(async move {
                            let r = c3.send_chunk(child.loc, &d, i).await;
                            drop(permit);
                            if let Err(e) = r {
                                give_up(&given_up, child.loc);
                                if !failed.swap(true, std::sync::atomic::Ordering::Relaxed) {
                                    let reason = e.to_string();
                                    c3.coord.send(ToCoord::ChildLost { parent: c3.me, child: child.loc, reason });
                                }
                            }
                        });
                        while inflight.try_join_next().is_some() {}
                    }
                    while inflight.join_next().await.is_some() {}
                });
            }
            Err(e) => ctx.coord.send(lost(e.to_string())),
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
                        let r = ctx.layout.chunk_range(nt.index);
                        // The crc of the chunk as placed here: the sender's, when its link read
                        // it back from this region as it copied (a fellow member, authenticated
                        // by the mesh), else this member's own read of the chunk.
                        // SAFETY: the sender posts the notice after its WRITE of this chunk completed
                        // or in the WRITE's batch, which the link delivers after the bytes are placed
                        // (`Link`'s order within a batch); it writes the chunk again only when asked
                        // (NACK).
                        let got = nt.crc.or_else(|| unsafe { ctx.region.crc32(r.start, r.end - r.start) }.ok());
                        if got != Some(ctx.layout.crcs[nt.index as usize]) {
                            // Never counted, never forwarded: ask the sender for it again.
                            ctx.send_nack(nt.from, nt.index).await;
                            continue;
                        }
                        have.bits.lock().unwrap_or_else(|e| e.into_inner())[nt.index as usize] = true;
                        have.more.notify_waiters();
                        count += 1;
                        for (l, left) in layer_left.iter_mut().enumerate() {
                            if ctx.layout.chunks_of_layer(l).contains(&nt.index) {
                                *left -= 1;
                            }
                        }
                        // Layers are announced in order: LayerReady{k} means layers 0..=k are all
                        // complete (chunks may land out of order within the sending window).
                        while next_layer < layer_left.len() && layer_left[next_layer] == 0 && !device_failed {
                            match &copier {
                                // A GPU target's layer is ready once it is on the device: the
                                // copier announces it (a closed copier has said why it stopped).
                                Some(c) => device_failed = c.send(next_layer).is_err(),
                                None => ctx.coord.send(ToCoord::LayerReady { loc: ctx.me, layer: next_layer }),
                            }
                            next_layer += 1;
                        }
                        if count == n && ctx.device.is_none() {
                            ctx.coord.send(ToCoord::Done(ctx.me));
                        }
                    }
                    Kind::Nack => {
                        let gone = given_up.lock().unwrap_or_else(|e| e.into_inner()).contains(&nt.from);
                        if let Some(d) = dests.get(&nt.from).filter(|_| !gone).cloned() {
                            ctx.resent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let (c2, given_up) = (ctx.clone(), given_up.clone());
                            forwarders.spawn(async move {
                                if let Err(e) = c2.send_chunk(nt.from, &d, nt.index).await {
                                    give_up(&given_up, nt.from);
                                    c2.coord.send(ToCoord::ChildLost { parent: c2.me, child: nt.from, reason: e.to_string() });
                                }
                            });
                        }
                    }
                }
            }
            Some(m) = from_device.recv() => ctx.coord.send(m),
            cmd = cmds.recv() => match cmd {
                Some(MemberCmd::AddChild(c)) => add_child(c, &mut forwarders, &mut dests),
                None => return,
            },
        }
    }
}
