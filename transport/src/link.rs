//! The one trait every backend implements, and the operations posted on it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::error::{Result, TransportError};
use crate::region::{Region, RemoteRegion};
use crate::stats::StatsSnapshot;
use crate::NodeId;

/// Which backend carries a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Framed protocol over TCP sockets.
    Tcp,
    /// Same-host shared memory (memcpy into the peer's mapping), control over a unix socket.
    Shm,
    /// RDMA RC queue pair.
    Rdma,
    /// In-process test double.
    Mem,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Tcp => "tcp",
            BackendKind::Shm => "shm",
            BackendKind::Rdma => "rdma",
            BackendKind::Mem => "mem",
        })
    }
}

/// One operation posted on a link.
#[derive(Debug, Clone)]
pub enum Op {
    /// One-sided WRITE of `len` bytes from `local[local_offset..]` into `remote[remote_offset..]`.
    Write {
        /// Source region.
        local: Region,
        /// Offset in the source.
        local_offset: u64,
        /// Destination region at the peer.
        remote: RemoteRegion,
        /// Offset in the destination.
        remote_offset: u64,
        /// Bytes to move.
        len: u64,
        /// Verify the data's crc32 at the destination.
        verify: bool,
        /// Report the crc32 of the bytes as placed at the destination in the completion, where
        /// the link computes it as part of the transfer (see [`Completion::crc`]).
        placed_crc: bool,
    },
    /// One-sided READ of `len` bytes from `remote[remote_offset..]` into `local[local_offset..]`.
    Read {
        /// Destination region.
        local: Region,
        /// Offset in the destination.
        local_offset: u64,
        /// Source region at the peer.
        remote: RemoteRegion,
        /// Offset in the source.
        remote_offset: u64,
        /// Bytes to move.
        len: u64,
        /// Verify the data's crc32 on arrival.
        verify: bool,
    },
    /// Two-sided SEND of a message to the peer's receive queue.
    Send {
        /// The message.
        payload: Bytes,
    },
}

impl Op {
    /// A WRITE of `len` bytes between the given offsets.
    pub fn write(local: &Region, local_offset: u64, remote: RemoteRegion, remote_offset: u64, len: u64) -> Op {
        Op::Write { local: local.clone(), local_offset, remote, remote_offset, len, verify: false, placed_crc: false }
    }

    /// A READ of `len` bytes between the given offsets.
    pub fn read(local: &Region, local_offset: u64, remote: RemoteRegion, remote_offset: u64, len: u64) -> Op {
        Op::Read { local: local.clone(), local_offset, remote, remote_offset, len, verify: false }
    }

    /// The same operation with crc32 verification on.
    pub fn verified(mut self) -> Op {
        if let Op::Write { verify, .. } | Op::Read { verify, .. } = &mut self {
            *verify = true;
        }
        self
    }

    /// The same WRITE, asking for the crc32 of the bytes as placed (see [`Completion::crc`]);
    /// other operations are returned as they are.
    pub fn with_placed_crc(mut self) -> Op {
        if let Op::Write { placed_crc, .. } = &mut self {
            *placed_crc = true;
        }
        self
    }

    /// Short name for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Write { .. } => "write",
            Op::Read { .. } => "read",
            Op::Send { .. } => "send",
        }
    }

    /// Checks the local side of the operation before anything is sent.
    pub(crate) fn check_local(&self) -> Result<()> {
        match self {
            Op::Write { local, local_offset, len, .. } | Op::Read { local, local_offset, len, .. } => {
                local.check(*local_offset, *len)
            }
            Op::Send { payload } => check_message(payload),
        }
    }
}

/// Refuses a message over the wire's limit ([`crate::wire::MAX_MESSAGE`]).
pub(crate) fn check_message(payload: &[u8]) -> Result<()> {
    let len = payload.len() as u64;
    if len > crate::wire::MAX_MESSAGE {
        return Err(TransportError::MessageTooLarge { len, max: crate::wire::MAX_MESSAGE });
    }
    Ok(())
}

/// A finished operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Payload bytes moved.
    pub bytes: u64,
    /// For a WRITE posted [`Op::with_placed_crc`]: the crc32 of the bytes as they were placed in
    /// the peer's region, computed by the link as part of the transfer — on shared memory read
    /// back from the destination block by block right after each block's copy, while it is in
    /// cache. `None` where the link does not compute it (tcp, where the receiver reads the
    /// bytes off the socket; RDMA, where no CPU touches them); the caller then checks the bytes
    /// itself.
    pub crc: Option<u32>,
}

impl Completion {
    /// `bytes` moved, no crc reported.
    pub fn moved(bytes: u64) -> Completion {
        Completion { bytes, crc: None }
    }
}

pub(crate) type Done = oneshot::Sender<Result<Completion>>;

/// Called once with an operation's result when its handle resolves (metrics).
pub(crate) type Observer = Box<dyn FnOnce(&Result<Completion>) + Send>;

/// The pending result of one posted operation. Resolves to `PeerDown` if the link dies first.
pub struct OpHandle {
    peer: NodeId,
    rx: oneshot::Receiver<Result<Completion>>,
    observer: Option<Observer>,
}

impl std::fmt::Debug for OpHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpHandle").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl OpHandle {
    pub(crate) fn new(peer: NodeId) -> (Done, OpHandle) {
        let (tx, rx) = oneshot::channel();
        (tx, OpHandle { peer, rx, observer: None })
    }

    /// The same handle, calling `f` with the result when it resolves.
    pub(crate) fn observed(mut self, f: Observer) -> OpHandle {
        self.observer = Some(f);
        self
    }

    /// A handle that is already resolved.
    pub(crate) fn ready(peer: NodeId, r: Result<Completion>) -> OpHandle {
        let (tx, h) = Self::new(peer);
        let _ = tx.send(r);
        h
    }

    /// Waits at most `limit`; a late operation fails with `Timeout`.
    pub async fn wait(self, op: &'static str, limit: Duration) -> Result<Completion> {
        let peer = self.peer;
        tokio::time::timeout(limit, self).await.unwrap_or(Err(TransportError::Timeout { peer, op, after: limit }))
    }
}

impl Future for OpHandle {
    type Output = Result<Completion>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let peer = self.peer;
        let r = Pin::new(&mut self.rx).poll(cx).map(|r| r.unwrap_or_else(|_| link_closed(peer)));
        if let Poll::Ready(r) = &r {
            if let Some(f) = self.observer.take() {
                f(r);
            }
        }
        r
    }
}

/// A handle dropped with its observer still waiting (fire and forget: a one-way message, a WRITE
/// whose completion nobody awaits, a task that ended first) still has its result observed — the
/// metrics count every completed operation, not only awaited ones: at once when it is in,
/// otherwise by a task that waits for it (without a runtime, it is not observed).
impl Drop for OpHandle {
    fn drop(&mut self) {
        let Some(f) = self.observer.take() else { return };
        let peer = self.peer;
        match self.rx.try_recv() {
            Ok(r) => f(&r),
            Err(oneshot::error::TryRecvError::Closed) => f(&link_closed(peer)),
            Err(oneshot::error::TryRecvError::Empty) => {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let rx = std::mem::replace(&mut self.rx, oneshot::channel().1);
                    rt.spawn(async move { f(&rx.await.unwrap_or_else(|_| link_closed(peer))) });
                }
            }
        }
    }
}

/// The result of an operation whose link went before it completed.
fn link_closed(peer: NodeId) -> Result<Completion> {
    Err(TransportError::PeerDown { peer, reason: "link closed".into() })
}

/// A message received by SEND/RECV, before the node's services take it.
#[derive(Debug, Clone)]
pub(crate) struct Incoming {
    /// The sender.
    pub(crate) from: NodeId,
    /// The message.
    pub(crate) payload: Bytes,
}

/// A connection to one peer over one backend.
///
/// Operations are posted without waiting and complete asynchronously; a batch is posted at once.
/// Operations of one batch may complete in any order; SENDs are delivered in posting order.
///
/// **Order within a batch** (as on an RDMA RC queue pair): a SEND posted after WRITEs *in the
/// same [`post`](Link::post)* reaches the peer after those WRITEs' bytes were placed — or after
/// they were refused, so a receiver still checks what it reads. The usual use is a WRITE and the
/// message telling its owner the bytes are there, posted together instead of the message waiting
/// for the WRITE's round trip. Nothing else is ordered: WRITEs among themselves, READs, and
/// operations posted in separate calls (a control message overtakes bulk data posted before it).
pub trait Link: Send + Sync + 'static {
    /// The peer at the other end.
    fn peer(&self) -> NodeId;
    /// The backend carrying this link.
    fn kind(&self) -> BackendKind;
    /// Posts operations; each handle resolves when its operation completes or fails.
    fn post(&self, ops: Vec<Op>) -> Vec<OpHandle>;
    /// Readies the link to move bytes to and from `remote` before the first operation needs it:
    /// a one-sided link looks the region up and, on shared memory, maps its pages, which
    /// otherwise fall on the first WRITEs. The handle resolves (with zero bytes) when that is
    /// done; a link with nothing to ready resolves it at once. Operations work without it.
    fn prepare(&self, remote: RemoteRegion) -> OpHandle {
        let _ = remote;
        OpHandle::ready(self.peer(), Ok(Completion::moved(0)))
    }
    /// Per-link counters.
    fn stats(&self) -> StatsSnapshot;
    /// False once the link has failed or been closed.
    fn is_alive(&self) -> bool;
    /// Closes the link; pending operations fail with `PeerDown`.
    fn close(&self, reason: &str);
}

/// Posts `ops` on `link` and waits for all of them, each at most `limit`.
pub async fn run_batch(link: &Arc<dyn Link>, ops: Vec<Op>, limit: Duration) -> Vec<Result<Completion>> {
    let names: Vec<&'static str> = ops.iter().map(Op::name).collect();
    let handles = link.post(ops);
    let mut out = Vec::with_capacity(handles.len());
    let deadline = tokio::time::Instant::now() + limit;
    for (h, name) in handles.into_iter().zip(names) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        out.push(h.wait(name, left).await.map_err(|e| match e {
            TransportError::Timeout { peer, op, .. } => TransportError::Timeout { peer, op, after: limit },
            other => other,
        }));
    }
    out
}
