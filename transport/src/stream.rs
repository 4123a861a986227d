//! The link engine shared by the stream backends (`tcp`, and `shm`'s control path).
//!
//! A link owns two tasks: a *writer* draining a queue of outgoing frames (requests, answers,
//! keepalives) and a *reader* that decodes frames, serves the peer's one-sided operations against
//! the local [`RegionTable`] and completes our own pending operations. Payloads move between the
//! socket and registered regions directly: WRITE data is read from the socket straight into the
//! destination region, READ answers are written to the socket straight from the source region.
//!
//! What the reader does with each frame is decided by a pure state machine (`machine.rs`); the
//! reader only executes its steps. A malformed frame, an unknown request id or a dead peer closes only this link: every pending
//! operation fails with `PeerDown` and the owner is told through `on_close`.
//!
//! A node that closes a link on purpose ([`StreamLink::leave`]) first sends a goodbye frame when
//! the peer understands one: the writer finishes the frame in flight and writes the control
//! frames already queued, replies among them (each for at most [`GOODBYE_FLUSH`]), writes the
//! goodbye and its reason, and stops. The peer's reader then
//! closes its end as a *departure* ([`Closed::graceful`]); every other close is a failure.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

use crate::error::{Result, TransportError};
pub(crate) use crate::frame::{FrameSink, FrameSource, Out, Payload};
use crate::link::{BackendKind, Completion, Done, Link, Op, OpHandle};
use crate::onesided::{LookupServer, OneSided, OneSidedEngine, PeerAccess};
use crate::region::{Region, RegionId, RegionTable, RemoteKey, RemoteRegion};
use crate::service::Services;
use crate::stats::{LinkStats, StatsSnapshot};
use crate::wire::{EngineTag, Header, Opcode, FLAG_CRC};
use crate::NodeId;
use machine::LinkTables;
use reader::read_loop;
use writer::write_loop;

/// Payload bytes read per socket call while landing data (also the liveness granularity).
const CHUNK: usize = 1 << 20;

/// How long a leaving link's writer may spend finishing the frame in flight and writing its
/// goodbye; past it the link closes without one (the peer then sees a failure).
pub(crate) const GOODBYE_FLUSH: Duration = Duration::from_millis(500);

/// Timing settings of a link.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) keepalive: Duration,
    pub(crate) dead_after: Duration,
}

/// Resolves once `rx` carries `true` (or its sender is gone).
pub(crate) async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// How a link closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Closed {
    /// Why, in words.
    pub(crate) reason: String,
    /// True when the link was closed on purpose: the peer said goodbye, or this side left.
    pub(crate) graceful: bool,
}

/// Called once when the link closes.
pub(crate) type OnClose = Box<dyn FnOnce(Closed) + Send>;

/// One of our operations, waiting for the peer's answer.
enum Pending {
    Write { done: Done, len: u64, crc: Option<u32>, placed: Option<u32> },
    Read { done: Done, dest: Region, offset: u64, len: u64, verify: bool },
    Lookup { done: tokio::sync::oneshot::Sender<Result<Option<PeerAccess>>>, engine: Arc<dyn OneSidedEngine> },
}

pub(crate) struct Shared {
    pub(crate) peer: NodeId,
    pub(crate) kind: BackendKind,
    pub(crate) regions: RegionTable,
    pub(crate) stats: LinkStats,
    /// Pending operations; `None` once closed (so nothing is inserted after the drain).
    pending: Mutex<Option<HashMap<u64, Pending>>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    start: Instant,
    last_rx_ms: AtomicU64,
    last_tx_ms: AtomicU64,
    shutdown: watch::Sender<bool>,
    on_close: Mutex<Option<OnClose>>,
    /// The peer understands a goodbye (`Caps::GOODBYE`).
    peer_hears_goodbye: bool,
    /// Our goodbye's reason, once this side leaves and the peer understands one.
    goodbye: Mutex<Option<String>>,
    /// Set when the writer task has ended (after its goodbye, if any).
    writer_done: watch::Sender<bool>,
    /// Answer the peer's one-sided lookups of local regions, one per engine this node serves.
    servers: Vec<Arc<dyn LookupServer>>,
    /// Frames for the writer: control (headers, messages, acks) and bulk (region data).
    tx: Lanes,
}

/// The writer's two queues. Control frames go out before bulk frames still queued, so that a
/// message or an ack never waits behind megabytes of a transfer: a WRITE's data and a message
/// posted *separately* after it may reach the peer in either order — only the WRITE's completion
/// says that its bytes landed (the region concurrency contract). Within one batch
/// ([`Link::post`]) a SEND stays behind the batch's WRITEs: once a frame of the batch went to
/// the bulk lane, the batch's later SENDs follow it there (its other small frames keep the
/// control lane).
pub(crate) struct Lanes {
    control: mpsc::UnboundedSender<Out>,
    bulk: mpsc::UnboundedSender<Out>,
}

/// Region payloads above this go in the bulk lane.
const BULK: u64 = 64 << 10;

impl Lanes {
    fn new() -> (Lanes, mpsc::UnboundedReceiver<Out>, mpsc::UnboundedReceiver<Out>) {
        let (control, crx) = mpsc::unbounded_channel();
        let (bulk, brx) = mpsc::unbounded_channel();
        (Lanes { control, bulk }, crx, brx)
    }

    fn send(&self, out: Out) -> bool {
        self.send_in(out, &mut false)
    }

    /// Queues `out` as one frame of a batch: `in_bulk` says that an earlier frame of the batch
    /// went to the bulk lane (then a SEND goes there too, behind it) and is set when this one
    /// does.
    fn send_in(&self, out: Out, in_bulk: &mut bool) -> bool {
        let (big, send) = match &out {
            Out::Frame { header, payload, .. } => {
                (matches!(payload, Payload::Region { len, .. } if *len > BULK), header.op == Opcode::Send)
            }
            _ => (false, false),
        };
        let bulk = big || (send && *in_bulk);
        *in_bulk |= bulk;
        if bulk { self.bulk.send(out) } else { self.control.send(out) }.is_ok()
    }
}

impl Shared {
    /// Posts one operation through the framed protocol.
    pub(crate) fn post_framed(&self, op: Op) -> OpHandle {
        self.post_framed_in(op, &mut false)
    }

    /// Posts one operation of a batch through the framed protocol, after the batch's earlier
    /// ones (`in_bulk`: see [`Lanes::send_in`]).
    fn post_framed_in(&self, op: Op, in_bulk: &mut bool) -> OpHandle {
        let s = self;
        let (done, handle) = OpHandle::new(s.peer);
        if let Err(e) = op.check_local() {
            s.finish_op(done, Err(e));
            return handle;
        }
        let (header, payload, pending) = match op {
            Op::Write { local, local_offset, remote, remote_offset, len, verify, .. } => {
                // SAFETY: the initiator's source range is its own for the operation (region contract).
                let crc = if verify { unsafe { local.crc32(local_offset, len) }.ok() } else { None };
                let h = Header {
                    region: remote.id.0,
                    key: remote.key.0,
                    offset: remote_offset,
                    len,
                    ..Header::new(Opcode::Write)
                }
                .with_crc(crc);
                (
                    h,
                    Payload::Region { region: local, offset: local_offset, len },
                    Pending::Write { done, len, crc, placed: None },
                )
            }
            Op::Read { local, local_offset, remote, remote_offset, len, verify } => {
                let mut h = Header {
                    region: remote.id.0,
                    key: remote.key.0,
                    offset: remote_offset,
                    len,
                    ..Header::new(Opcode::ReadReq)
                };
                if verify {
                    h.flags |= FLAG_CRC;
                }
                (h, Payload::None, Pending::Read { done, dest: local, offset: local_offset, len, verify })
            }
            Op::Send { payload } => {
                let len = payload.len() as u64;
                let h = Header { len, ..Header::new(Opcode::Send) };
                if !s.tx.send_in(
                    Out::Frame { header: h, payload: Payload::Bytes(payload), done: Some((done, len)) },
                    in_bulk,
                ) {
                    return OpHandle::ready(s.peer, Err(s.down("link closed")));
                }
                return handle;
            }
        };
        match s.insert(pending) {
            Ok(id) => {
                let header = Header { req_id: id, ..header };
                if !s.tx.send_in(Out::Frame { header, payload, done: None }, in_bulk) {
                    s.close("writer stopped");
                }
            }
            Err(Pending::Write { done, .. } | Pending::Read { done, .. }) => {
                s.finish_op(done, Err(s.down("link closed")))
            }
            Err(Pending::Lookup { .. }) => {}
        }
        handle
    }

    /// Looks up a peer region for `engine`'s one-sided access (its lookup request).
    /// `Ok(None)`: the peer cannot expose it this way; use the framed protocol.
    pub(crate) async fn request_access(
        &self,
        region: RegionId,
        key: RemoteKey,
        engine: Arc<dyn OneSidedEngine>,
    ) -> Result<Option<PeerAccess>> {
        let (done, rx) = tokio::sync::oneshot::channel();
        let tag = engine.tag();
        let id = self.insert(Pending::Lookup { done, engine }).map_err(|_| self.down("link closed"))?;
        let h = Header::lookup(tag, id, region.0, key.0);
        self.send(Out::Frame { header: h, payload: Payload::None, done: None });
        rx.await.map_err(|_| self.down("link closed"))?
    }

    /// Registers a WRITE whose bytes were already placed one-sidedly; resolves on its ack.
    pub(crate) fn post_written(
        &self,
        done: Done,
        remote: RemoteRegion,
        offset: u64,
        len: u64,
        crc: Option<u32>,
        placed: Option<u32>,
    ) {
        let s = self;
        match s.insert(Pending::Write { done, len, crc, placed }) {
            Ok(id) => {
                let (region, key) = (remote.id.0, remote.key.0);
                let h = Header { req_id: id, region, key, offset, len, ..Header::new(Opcode::Written) }.with_crc(crc);
                s.send(Out::Frame { header: h, payload: Payload::None, done: None });
            }
            Err(Pending::Write { done, .. }) => s.finish_op(done, Err(s.down("link closed"))),
            Err(_) => {}
        }
    }

    /// True once this side leaves with a goodbye still to write.
    fn says_goodbye(&self) -> bool {
        self.goodbye.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn touch_rx(&self) {
        self.last_rx_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn down(&self, reason: &str) -> TransportError {
        TransportError::PeerDown { peer: self.peer, reason: reason.to_string() }
    }

    /// Registers a pending operation and returns its request id, or fails if the link is closed.
    fn insert(&self, p: Pending) -> std::result::Result<u64, Pending> {
        let mut g = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_mut() {
            Some(map) => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                map.insert(id, p);
                Ok(id)
            }
            None => Err(p),
        }
    }

    fn take(&self, id: u64) -> Option<Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).as_mut()?.remove(&id)
    }

    pub(crate) fn send(&self, out: Out) -> bool {
        self.tx.send(out)
    }

    /// Closes the link once as a failure: fails every pending operation and tells the owner.
    pub(crate) fn close(&self, reason: &str) {
        self.close_as(reason, false, false);
    }

    /// Closes the link on purpose: the writer says goodbye (when the peer understands one)
    /// before it stops; pending operations fail as on any close.
    pub(crate) fn leave(&self, reason: &str) {
        self.close_as(reason, true, self.peer_hears_goodbye);
    }

    /// Closes the link once; `goodbye`: the writer is to say goodbye with `reason` (decided
    /// by whichever close came first, so a failure racing a leave never says goodbye).
    fn close_as(&self, reason: &str, graceful: bool, goodbye: bool) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        debug!(peer = self.peer, kind = %self.kind, reason, graceful, "link closed");
        if goodbye {
            *self.goodbye.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
        }
        let drained = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        for (_, p) in drained.into_iter().flatten() {
            self.fail(p, reason);
        }
        // `send_replace`: the value must stick even before the link's tasks first ran and subscribed
        // (`send` stores nothing while there is no receiver).
        self.shutdown.send_replace(true);
        if let Some(f) = self.on_close.lock().unwrap_or_else(|e| e.into_inner()).take() {
            f(Closed { reason: reason.to_string(), graceful });
        }
    }

    /// Fails a pending operation with `PeerDown`.
    fn fail(&self, p: Pending, reason: &str) {
        self.stats.op_err();
        match p {
            Pending::Write { done, .. } | Pending::Read { done, .. } => {
                let _ = done.send(Err(self.down(reason)));
            }
            Pending::Lookup { done, .. } => {
                let _ = done.send(Err(self.down(reason)));
            }
        }
    }

    pub(crate) fn finish_op(&self, done: Done, r: Result<Completion>) {
        match &r {
            Ok(_) => self.stats.op_ok(),
            Err(_) => self.stats.op_err(),
        }
        let _ = done.send(r);
    }
}

impl LinkTables for Shared {
    fn peer(&self) -> NodeId {
        self.peer
    }
    fn regions(&self) -> &RegionTable {
        &self.regions
    }
    fn take(&self, req_id: u64) -> Option<Pending> {
        Shared::take(self, req_id)
    }
    fn server(&self, tag: EngineTag) -> Option<&Arc<dyn LookupServer>> {
        self.servers.iter().find(|x| x.tag() == tag)
    }
    fn stats(&self) -> &LinkStats {
        &self.stats
    }
}

/// Everything a link needs besides its stream.
pub(crate) struct LinkCtx {
    /// One-sided engine of this link (shm, rdma), if any.
    pub(crate) one_sided: Option<OneSided>,
    /// Answer the peer's one-sided lookups, one per engine this node serves.
    pub(crate) servers: Vec<Arc<dyn LookupServer>>,
    pub(crate) peer: NodeId,
    pub(crate) kind: BackendKind,
    pub(crate) regions: RegionTable,
    pub(crate) services: Arc<Services>,
    pub(crate) timing: Timing,
    pub(crate) on_close: OnClose,
    /// The peer understands a goodbye (it advertised `Caps::GOODBYE`).
    pub(crate) goodbye: bool,
}

/// A link over a byte stream.
pub(crate) struct StreamLink {
    pub(crate) shared: Arc<Shared>,
    /// Mappings of the peer's shared regions (shm links only).
    pub(crate) one_sided: Option<Arc<OneSided>>,
}

impl StreamLink {
    /// Starts the reader, writer and watchdog tasks on the current runtime.
    pub(crate) fn spawn<R: FrameSource, W: FrameSink>(ctx: LinkCtx, reader: R, writer: W) -> Arc<StreamLink> {
        let LinkCtx { one_sided, servers, peer, kind, regions, services, timing, on_close, goodbye } = ctx;
        let one_sided = one_sided.map(Arc::new);
        let mut withdrawn = regions.withdrawn();
        let (tx, control_rx, bulk_rx) = Lanes::new();
        let (shutdown, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            peer,
            kind,
            regions,
            stats: LinkStats::default(),
            pending: Mutex::new(Some(HashMap::new())),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            start: Instant::now(),
            last_rx_ms: AtomicU64::new(0),
            last_tx_ms: AtomicU64::new(0),
            shutdown,
            on_close: Mutex::new(Some(on_close)),
            peer_hears_goodbye: goodbye,
            goodbye: Mutex::new(None),
            writer_done: watch::channel(false).0,
            servers,
            tx,
        });
        let s = shared.clone();
        tokio::spawn(async move {
            // The writer watches the stop signal itself, so that a leaving link can finish its
            // frame in flight and say goodbye.
            if let Err(e) = write_loop(&s, writer, (control_rx, bulk_rx), timing).await {
                s.close(&format!("send failed: {e}"));
            }
            s.writer_done.send_replace(true);
        });
        let s = shared.clone();
        let os = one_sided.clone();
        tokio::spawn(async move {
            let mut stop = s.shutdown.subscribe();
            let r = tokio::select! {
                r = read_loop(&s, reader, &services, os.as_deref(), timing) => r,
                _ = crate::stream::stopped(&mut stop) => Ok(None),
            };
            match r {
                Ok(Some(why)) => s.close_as(&format!("node {} left: {why}", s.peer), true, false),
                Ok(None) => {}
                Err(e) => s.close(&e.to_string()),
            }
        });
        if matches!(kind, BackendKind::Shm | BackendKind::Rdma) {
            // Tell a peer that may have mapped (or keyed) a local region when it is withdrawn, so
            // the peer drops its mapping and the memory can be freed.
            let s = shared.clone();
            tokio::spawn(async move {
                let mut stop = s.shutdown.subscribe();
                loop {
                    let id = tokio::select! {
                        id = withdrawn.recv() => match id {
                            Ok(id) => id,
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                            Err(_) => return,
                        },
                        _ = crate::stream::stopped(&mut stop) => return,
                    };
                    let h = Header { region: id.0, ..Header::new(Opcode::Forget) };
                    if !s.send(Out::Frame { header: h, payload: Payload::None, done: None }) {
                        return;
                    }
                }
            });
        }
        let s = shared.clone();
        tokio::spawn(async move {
            let mut stop = s.shutdown.subscribe();
            let mut tick = tokio::time::interval(timing.keepalive / 2);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = crate::stream::stopped(&mut stop) => return,
                }
                let idle = s.now_ms().saturating_sub(s.last_rx_ms.load(Ordering::Relaxed));
                if idle > timing.dead_after.as_millis() as u64 {
                    warn!(peer = s.peer, idle_ms = idle, "peer silent, declaring it down");
                    s.close(&format!("no traffic for {idle} ms (keepalive)"));
                    return;
                }
            }
        });
        Arc::new(StreamLink { shared, one_sided })
    }

    /// Closes the link on purpose, saying goodbye to a peer that understands one (see the
    /// module docs); [`writer_stopped`](Self::writer_stopped) tells when it is out.
    pub(crate) fn leave(&self, reason: &str) {
        self.shared.leave(reason);
    }

    /// Resolves once the writer task has ended (after its goodbye, if it sent one).
    pub(crate) async fn writer_stopped(&self) {
        let mut rx = self.shared.writer_done.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }
}

impl Link for StreamLink {
    fn peer(&self) -> NodeId {
        self.shared.peer
    }
    fn kind(&self) -> BackendKind {
        self.shared.kind
    }
    fn post(&self, ops: Vec<Op>) -> Vec<OpHandle> {
        let _span = tracing::debug_span!("post", peer = self.shared.peer, n = ops.len()).entered();
        match &self.one_sided {
            Some(os) => one_sided::post_batch(&self.shared, os, ops),
            None => {
                let mut in_bulk = false;
                ops.into_iter().map(|op| self.shared.post_framed_in(op, &mut in_bulk)).collect()
            }
        }
    }
    fn prepare(&self, remote: RemoteRegion) -> OpHandle {
        match &self.one_sided {
            Some(os) => one_sided::prepare(&self.shared, os, remote),
            None => OpHandle::ready(self.shared.peer, Ok(Completion::moved(0))),
        }
    }
    fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }
    fn is_alive(&self) -> bool {
        !self.shared.closed.load(Ordering::SeqCst)
    }
    fn close(&self, reason: &str) {
        self.shared.close(reason);
    }
}

impl Drop for StreamLink {
    fn drop(&mut self) {
        self.shared.close("link dropped");
    }
}

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzz;
mod machine;
mod one_sided;
mod reader;
mod writer;

#[cfg(test)]
mod tests;
