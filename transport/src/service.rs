//! Typed services on a node's endpoint: the control plane.
//!
//! Every control message travels in an [`Envelope`] — service id, protocol version, kind and
//! request id — followed by the service's own [`Message`], encoded by a compact binary codec
//! (postcard over the message's serde form). A node's [`Services`] table hands each service its
//! own bounded inbox ([`ServiceExt::subscribe`]); requests are answered with
//! [`ServiceExt::reply`], and [`ServiceExt::call`] matches a reply to its request by id. A reply
//! that comes after its caller gave up is dropped and counted, never handed to another waiter.
//!
//! What the transport does with a message it cannot deliver, always logged and counted:
//!
//! | received | answer to the sender |
//! | --- | --- |
//! | not an envelope | none (the sender cannot be named); `malformed` counted |
//! | a service nobody subscribed | `Error` [`ServiceFault::UnknownService`] |
//! | a newer version than the subscriber reads | `Error` [`ServiceFault::UnsupportedVersion`] |
//! | a body its service cannot decode | `Error` [`ServiceFault::Malformed`] |
//! | a reply whose request is unknown or timed out | none; `late_replies` counted |
//!
//! A one-way message that fails gets an `Error` with request id 0, which its sender logs.
//!
//! Inboxes are bounded: a service that falls behind stalls the links that feed it (the link's
//! reader waits for room) rather than losing messages. Replies and errors never wait for an
//! inbox — they complete their call directly — so a service that waits on calls cannot deadlock
//! against its own inbox.

use std::any::Any;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::error::{Result, TransportError};
use crate::link::{Op, OpHandle};
use crate::mesh::{BoxFuture, Mesh};
use crate::NodeId;

mod envelope;

pub use envelope::{Envelope, EnvelopeError, Kind, ServiceId, ENVELOPE_LEN};

/// The default capacity of a service inbox.
pub const DEFAULT_INBOX: usize = 4096;

/// A service's message type: one enum per service, versioned, with a binary codec.
pub trait Message: Sized + Send + 'static {
    /// The service it belongs to.
    const SERVICE: ServiceId;
    /// The protocol version this code writes (and the newest it reads).
    const VERSION: u16;
    /// The body's bytes.
    fn encode_body(&self) -> Vec<u8>;
    /// Decodes a body written in `version` (≤ [`Self::VERSION`]).
    fn decode_body(version: u16, body: &[u8]) -> std::result::Result<Self, CodecError>;
}

/// A body that does not decode as its service's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {service} message: {detail}")]
pub struct CodecError {
    /// The service.
    pub service: ServiceId,
    /// What was wrong.
    pub detail: String,
}

/// Encodes a serde value with the control plane's binary codec (postcard).
pub fn encode_binary<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail: postcard only fails on a full buffer or on
    // types serde cannot represent (maps with non-string keys are fine in postcard).
    postcard::to_allocvec(v).unwrap_or_default()
}

/// Decodes a whole body written by [`encode_binary`]; trailing bytes are an error.
pub fn decode_binary<T: DeserializeOwned>(service: ServiceId, b: &[u8]) -> std::result::Result<T, CodecError> {
    match postcard::take_from_bytes(b) {
        Ok((v, [])) => Ok(v),
        Ok((_, rest)) => Err(CodecError { service, detail: format!("{} trailing bytes", rest.len()) }),
        Err(e) => Err(CodecError { service, detail: e.to_string() }),
    }
}

/// Implements [`Message`] for a serde type with the binary codec.
#[macro_export]
macro_rules! binary_message {
    ($t:ty, $service:expr, $version:expr) => {
        impl $crate::service::Message for $t {
            const SERVICE: $crate::service::ServiceId = $service;
            const VERSION: u16 = $version;
            fn encode_body(&self) -> Vec<u8> {
                $crate::service::encode_binary(self)
            }
            fn decode_body(_version: u16, body: &[u8]) -> Result<Self, $crate::service::CodecError> {
                $crate::service::decode_binary($service, body)
            }
        }
    };
}

/// Why the transport could not deliver a request (the body of a `Kind::Error` envelope).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceFault {
    /// No service with this id runs on the node.
    #[error("no such service on the node")]
    UnknownService,
    /// The node's service reads older versions only.
    #[error("unsupported version (the node reads up to version {supported})")]
    UnsupportedVersion {
        /// The newest version the node reads.
        supported: u16,
    },
    /// The body did not decode.
    #[error("the node could not decode the message: {detail}")]
    Malformed {
        /// The decoder's complaint.
        detail: String,
    },
}

binary_message!(ServiceFault, ServiceId::TRANSPORT, 1);

/// How to answer a request: handed out with it, consumed by [`ServiceExt::reply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    /// The requester.
    pub peer: NodeId,
    /// The service.
    pub service: ServiceId,
    /// The request's id.
    pub request_id: u64,
}

/// A message taken from a service inbox.
#[derive(Debug)]
pub struct Received<M> {
    /// The sender.
    pub from: NodeId,
    /// The message.
    pub msg: M,
    /// Set for requests: where the reply goes.
    pub reply_to: Option<ReplyTo>,
}

struct Queued {
    from: NodeId,
    reply_to: Option<ReplyTo>,
    msg: Box<dyn Any + Send>,
}

type Decoder = fn(u16, &[u8]) -> std::result::Result<Box<dyn Any + Send>, CodecError>;

fn decode_any<M: Message>(version: u16, body: &[u8]) -> std::result::Result<Box<dyn Any + Send>, CodecError> {
    M::decode_body(version, body).map(|m| Box::new(m) as Box<dyn Any + Send>)
}

struct Subscription {
    max_version: u16,
    decode: Decoder,
    tx: mpsc::Sender<Queued>,
}

struct PendingCall {
    peer: NodeId,
    service: ServiceId,
    tx: oneshot::Sender<Result<(u16, Bytes)>>,
}

/// Counters of a node's service table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServiceStats {
    /// Messages delivered to a service inbox.
    pub delivered: u64,
    /// Replies matched to their call.
    pub replies: u64,
    /// Replies (or errors) for a request that is unknown, timed out, or from another peer.
    pub late_replies: u64,
    /// Messages that were not envelopes.
    pub malformed: u64,
    /// Messages answered with a [`ServiceFault`].
    pub refused: u64,
    /// Faults received for one-way messages this node sent.
    pub faults_received: u64,
}

#[derive(Default)]
struct Counters {
    delivered: AtomicU64,
    replies: AtomicU64,
    late_replies: AtomicU64,
    malformed: AtomicU64,
    refused: AtomicU64,
    faults_received: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A node's table of services: subscriptions, calls waiting for replies, counters.
pub struct Services {
    node: NodeId,
    subs: Mutex<HashMap<ServiceId, Subscription>>,
    pending: Mutex<HashMap<u64, PendingCall>>,
    next_id: AtomicU64,
    counters: Counters,
    /// Messages this node sends itself, delivered in order by one task (see [`post`]).
    loopback: std::sync::OnceLock<mpsc::UnboundedSender<(Bytes, crate::link::Done)>>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services").field("node", &self.node).field("stats", &self.stats()).finish()
    }
}

impl Services {
    /// An empty table for `node`.
    pub fn new(node: NodeId) -> Arc<Services> {
        Arc::new(Services {
            node,
            subs: Mutex::default(),
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            counters: Counters::default(),
            loopback: std::sync::OnceLock::new(),
        })
    }

    /// Delivers a message this node sends itself, as a link delivers a peer's: requests and
    /// one-way messages to the service's inbox, replies to the waiting call, in posting order.
    /// Must run inside a tokio runtime (the first use starts the delivering task).
    fn post_local(self: &Arc<Self>, payload: Bytes) -> OpHandle {
        let tx = self.loopback.get_or_init(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(Bytes, crate::link::Done)>();
            let weak = Arc::downgrade(self);
            tokio::spawn(async move {
                while let Some((payload, done)) = rx.recv().await {
                    let Some(services) = weak.upgrade() else { return };
                    let len = payload.len() as u64;
                    if let Some(back) = services.deliver(services.node, payload).await {
                        // A fault (unknown service, say) goes back to this node's sender too.
                        let _ = services.deliver(services.node, back).await;
                    }
                    let _ = done.send(Ok(crate::link::Completion::moved(len)));
                }
            });
            tx
        });
        let (done, h) = OpHandle::new(self.node);
        if let Err(mpsc::error::SendError((_, done))) = tx.send((payload, done)) {
            let _ = done.send(Err(TransportError::PeerDown { peer: self.node, reason: "service table closed".into() }));
        }
        h
    }

    /// Its counters.
    pub fn stats(&self) -> ServiceStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServiceStats {
            delivered: l(&c.delivered),
            replies: l(&c.replies),
            late_replies: l(&c.late_replies),
            malformed: l(&c.malformed),
            refused: l(&c.refused),
            faults_received: l(&c.faults_received),
        }
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, HashMap<ServiceId, Subscription>> {
        self.subs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, PendingCall>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens `M`'s inbox with room for `capacity` messages. One inbox per service: a second
    /// subscription while the first inbox lives is refused.
    pub fn subscribe<M: Message>(&self, capacity: usize) -> Result<Inbox<M>> {
        let mut subs = self.subs();
        if subs.get(&M::SERVICE).is_some_and(|s| !s.tx.is_closed()) {
            return Err(TransportError::Config(format!("service {} is subscribed already", M::SERVICE)));
        }
        let (tx, rx) = mpsc::channel(capacity.max(1));
        subs.insert(M::SERVICE, Subscription { max_version: M::VERSION, decode: decode_any::<M>, tx });
        Ok(Inbox { rx, _m: PhantomData })
    }

    fn register_call(&self, peer: NodeId, service: ServiceId) -> (u64, oneshot::Receiver<Result<(u16, Bytes)>>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending().insert(id, PendingCall { peer, service, tx });
        (id, rx)
    }

    fn forget_call(&self, id: u64) {
        self.pending().remove(&id);
    }

    /// Closes every inbox (their `recv` returns `None` once drained) and fails every pending
    /// call: the node is shutting down.
    pub fn close(&self) {
        self.subs().clear();
        let pending: Vec<PendingCall> = self.pending().drain().map(|(_, c)| c).collect();
        for c in pending {
            let _ = c.tx.send(Err(TransportError::PeerDown { peer: c.peer, reason: "this node shut down".into() }));
        }
    }

    /// Calls pending on `peer` fail with `PeerDown`: its link is gone.
    pub(crate) fn peer_down(&self, peer: NodeId, reason: &str) {
        let failed: Vec<PendingCall> = {
            let mut p = self.pending();
            let ids: Vec<u64> = p.iter().filter(|(_, c)| c.peer == peer).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| p.remove(&id)).collect()
        };
        for c in failed {
            let _ = c.tx.send(Err(TransportError::PeerDown { peer, reason: reason.to_string() }));
        }
    }

    fn fault(&self, env: &Envelope, fault: ServiceFault) -> Option<Bytes> {
        bump(&self.counters.refused);
        let back = Envelope { service: env.service, version: 1, kind: Kind::Error, request_id: env.request_id };
        Some(back.encode(&fault.encode_body()))
    }

    /// Takes one message a link received from `from`. Waits while the service's inbox is full.
    /// Returns what must be sent back to `from`, if anything (a fault).
    pub(crate) async fn deliver(&self, from: NodeId, payload: Bytes) -> Option<Bytes> {
        let (env, body) = match Envelope::decode(&payload) {
            Ok(x) => x,
            Err(e) => {
                bump(&self.counters.malformed);
                warn!(node = self.node, from, error = %e, "dropping a control message that is not an envelope");
                return None;
            }
        };
        match env.kind {
            Kind::Reply | Kind::Error => {
                self.complete(from, &env, body);
                None
            }
            Kind::OneWay | Kind::Request => {
                let (tx, msg) = {
                    let subs = self.subs();
                    let Some(sub) = subs.get(&env.service).filter(|s| !s.tx.is_closed()) else {
                        drop(subs);
                        debug!(node = self.node, from, service = %env.service, "message for an unknown service");
                        return self.fault(&env, ServiceFault::UnknownService);
                    };
                    if env.version > sub.max_version {
                        let supported = sub.max_version;
                        drop(subs);
                        warn!(node = self.node, from, service = %env.service, version = env.version, supported, "unsupported version");
                        return self.fault(&env, ServiceFault::UnsupportedVersion { supported });
                    }
                    match (sub.decode)(env.version, body) {
                        Ok(m) => (sub.tx.clone(), m),
                        Err(e) => {
                            drop(subs);
                            warn!(node = self.node, from, error = %e, "dropping a message that does not decode");
                            return self.fault(&env, ServiceFault::Malformed { detail: e.detail });
                        }
                    }
                };
                let reply_to = (env.kind == Kind::Request).then_some(ReplyTo {
                    peer: from,
                    service: env.service,
                    request_id: env.request_id,
                });
                let q = Queued { from, reply_to, msg };
                let sent = match tx.try_send(q) {
                    Ok(()) => Ok(()),
                    Err(mpsc::error::TrySendError::Full(q)) => {
                        debug!(node = self.node, from, service = %env.service, "inbox full: holding the link back");
                        tx.send(q).await.map_err(drop)
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
                };
                if sent.is_err() {
                    return self.fault(&env, ServiceFault::UnknownService);
                }
                bump(&self.counters.delivered);
                None
            }
        }
    }

    fn complete(&self, from: NodeId, env: &Envelope, body: &[u8]) {
        if env.kind == Kind::Error && env.request_id == 0 {
            bump(&self.counters.faults_received);
            let fault = ServiceFault::decode_body(env.version, body);
            warn!(node = self.node, from, service = %env.service, ?fault, "a peer refused a one-way message");
            return;
        }
        let call = {
            let mut p = self.pending();
            match p.get(&env.request_id) {
                Some(c) if c.peer == from && c.service == env.service => p.remove(&env.request_id),
                _ => None,
            }
        };
        let Some(call) = call else {
            bump(&self.counters.late_replies);
            debug!(node = self.node, from, id = env.request_id, "dropping a reply nobody waits for");
            return;
        };
        bump(&self.counters.replies);
        tracing::trace!(node = self.node, from, id = env.request_id, "reply matched");
        let r = match env.kind {
            Kind::Error => {
                let fault = ServiceFault::decode_body(env.version, body)
                    .unwrap_or_else(|e| ServiceFault::Malformed { detail: e.detail });
                Err(TransportError::Service { peer: from, service: env.service, fault })
            }
            _ => Ok((env.version, Bytes::copy_from_slice(body))),
        };
        let _ = call.tx.send(r);
    }
}

/// A service's inbox (bounded): messages arrive decoded, in per-link order.
pub struct Inbox<M> {
    rx: mpsc::Receiver<Queued>,
    _m: PhantomData<fn() -> M>,
}

impl<M: Message> Inbox<M> {
    /// The next message; `None` once the node's service table is gone.
    pub async fn recv(&mut self) -> Option<Received<M>> {
        loop {
            let q = self.rx.recv().await?;
            // The decoder stored with this subscription produced an `M`; nothing else is queued.
            if let Ok(msg) = q.msg.downcast::<M>() {
                return Some(Received { from: q.from, msg: *msg, reply_to: q.reply_to });
            }
        }
    }

    /// Unsubscribes: messages from now on are answered [`ServiceFault::UnknownService`], while
    /// those already queued can still be taken (with [`Inbox::try_recv`]) and answered.
    pub fn close(&mut self) {
        self.rx.close();
    }

    /// The next message if one is queued, without waiting (for callers that poll).
    pub fn try_recv(&mut self) -> Option<Received<M>> {
        loop {
            let q = self.rx.try_recv().ok()?;
            if let Ok(msg) = q.msg.downcast::<M>() {
                return Some(Received { from: q.from, msg: *msg, reply_to: q.reply_to });
            }
        }
    }
}

/// Sends a control message to `peer`; to this node itself, through its own services (no link
/// reaches a node from itself), so a node can call the services it runs like any other's.
fn post(mesh: &(impl Mesh + ?Sized), peer: NodeId, payload: Bytes) -> Result<OpHandle> {
    // Refused when posted: it failed only in its handle (after the caller had gone on), and one
    // to this node itself was delivered whatever its size.
    crate::link::check_message(&payload)?;
    if peer == mesh.services().node {
        return Ok(mesh.services().post_local(payload));
    }
    let link = mesh.link(peer)?;
    link.post(vec![Op::Send { payload }]).pop().ok_or(TransportError::NotConnected { peer })
}

/// Posts `ops` and then the message `payload` to `peer` in one batch (see [`Link`](crate::Link)'s
/// order within a batch): the ops' handles, and the message's. Without ops this is [`post`];
/// with ops `peer` must be another node, since no link reaches a node from itself.
fn post_behind(
    mesh: &(impl Mesh + ?Sized),
    peer: NodeId,
    mut ops: Vec<Op>,
    payload: Bytes,
) -> Result<(Vec<OpHandle>, OpHandle)> {
    if ops.is_empty() {
        return post(mesh, peer, payload).map(|sent| (Vec::new(), sent));
    }
    crate::link::check_message(&payload)?;
    if peer == mesh.services().node {
        return Err(TransportError::NotConnected { peer });
    }
    ops.push(Op::Send { payload });
    let mut handles = mesh.link(peer)?.post(ops);
    let sent = handles.pop().ok_or(TransportError::NotConnected { peer })?;
    Ok((handles, sent))
}

/// The control plane's operations, on every [`Mesh`].
pub trait ServiceExt: Mesh {
    /// Opens `M`'s inbox on this node (see [`Services::subscribe`]).
    fn subscribe<M: Message>(&self, capacity: usize) -> Result<Inbox<M>> {
        self.services().subscribe::<M>(capacity)
    }

    /// Posts a one-way message; the handle resolves once the link has sent it.
    fn post_oneway<M: Message>(&self, peer: NodeId, msg: &M) -> Result<OpHandle> {
        let env = Envelope { service: M::SERVICE, version: M::VERSION, kind: Kind::OneWay, request_id: 0 };
        post(self, peer, env.encode(&msg.encode_body()))
    }

    /// Posts `ops` and then the one-way message `msg` to `peer` in one batch, so that the message
    /// reaches the peer after the batch's WRITEs placed their bytes (the order within a batch,
    /// see [`Link`](crate::Link)) without waiting for their round trips: a WRITE and the notice
    /// telling the owner that its bytes are there. Handles: one per operation, then the
    /// message's. There is no link from a node to itself, so with `ops` `peer` must be another
    /// node.
    fn post_oneway_after<M: Message>(&self, peer: NodeId, ops: Vec<Op>, msg: &M) -> Result<Vec<OpHandle>> {
        let env = Envelope { service: M::SERVICE, version: M::VERSION, kind: Kind::OneWay, request_id: 0 };
        let (mut handles, sent) = post_behind(self, peer, ops, env.encode(&msg.encode_body()))?;
        handles.push(sent);
        Ok(handles)
    }

    /// Answers a request.
    fn reply<M: Message>(&self, to: &ReplyTo, msg: &M) -> Result<()> {
        let env = Envelope { service: to.service, version: M::VERSION, kind: Kind::Reply, request_id: to.request_id };
        post(self, to.peer, env.encode(&msg.encode_body())).map(drop)
    }

    /// Sends a request and waits at most `limit` for its reply. Fails early when the peer's link
    /// goes down; a reply after `limit` is dropped and counted as late.
    fn call<'a, M: Message + Sync>(&'a self, peer: NodeId, msg: &'a M, limit: Duration) -> BoxFuture<'a, Result<M>> {
        self.call_after(peer, Vec::new(), msg, limit)
    }

    /// [`call`](Self::call) with `ops` posted ahead of the request in the same batch, so that
    /// the request reaches `peer` after their WRITEs placed their bytes (the order within a
    /// batch, see [`Link`](crate::Link)): hand a peer data and ask it to act on it in one round
    /// trip. An operation that fails fails the call (the reply, if one comes, is dropped); a
    /// WRITE refused at the peer still lets the request through, so what the peer reads it should
    /// check. `ops` must be empty when `peer` is this node.
    fn call_after<'a, M: Message + Sync>(
        &'a self,
        peer: NodeId,
        ops: Vec<Op>,
        msg: &'a M,
        limit: Duration,
    ) -> BoxFuture<'a, Result<M>> {
        Box::pin(async move {
            let services = self.services().clone();
            let (id, rx) = services.register_call(peer, M::SERVICE);
            tracing::trace!(node = services.node, peer, id, service = %M::SERVICE, ops = ops.len(), "call");
            let env = Envelope { service: M::SERVICE, version: M::VERSION, kind: Kind::Request, request_id: id };
            let posted = post_behind(self, peer, ops, env.encode(&msg.encode_body()));
            let r = match posted {
                Err(e) => Err(e),
                Ok((before, sent)) => {
                    let exchange = async {
                        for h in before {
                            h.await?;
                        }
                        // A request that could not be sent fails now, not at the time limit.
                        sent.await?;
                        match rx.await {
                            Ok(r) => r,
                            Err(_) => Err(TransportError::PeerDown { peer, reason: "service table closed".into() }),
                        }
                    };
                    match tokio::time::timeout(limit, exchange).await {
                        Ok(r) => r,
                        Err(_) => Err(TransportError::Timeout { peer, op: "control call", after: limit }),
                    }
                }
            };
            services.forget_call(id);
            let (version, body) = r?;
            M::decode_body(version, &body).map_err(|e| TransportError::Service {
                peer,
                service: M::SERVICE,
                fault: ServiceFault::Malformed { detail: e.detail },
            })
        })
    }
}

impl<T: Mesh + ?Sized> ServiceExt for T {}

#[cfg(test)]
mod tests;
