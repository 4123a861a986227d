//! The endpoint: a node joins the cluster and keeps a full mesh of links (the connection pool).
//!
//! At start the endpoint binds its listeners (TCP, plus a unix socket for same-host peers), then
//! for every peer with a larger id it dials — shared memory when the peer is on the same host,
//! TCP otherwise — while peers with a smaller id dial it. A TCP link between two nodes that both
//! opened an RDMA device (feature `rdma`, `EndpointConfig::rdma`) is upgraded: the two exchange
//! queue-pair information over it, and from then on one-sided WRITE/READ go over an RC queue pair
//! while the TCP stream carries control (lookups, completions' acks, SEND, keepalive). [`Endpoint::wait_ready`] returns once
//! every peer is connected and reports the mesh setup time.
//!
//! Every link runs a keepalive; a silent or broken link is closed, its operations fail with
//! `PeerDown`, a [`PeerEvent::Down`] is published, and the dialing side reconnects with exponential
//! backoff (the accepting side takes the new connection when it comes). A node that shuts its
//! endpoint down says goodbye on every link first, so its peers report a departure
//! (`Down { graceful: true, .. }`) rather than a failure; [`Endpoint::leave`] waits until the
//! goodbyes are out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{broadcast, oneshot, watch};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::config::{select_backend, EndpointConfig, NodeSpec};
use crate::error::{Result, TransportError};
use crate::handshake::{self, Caps, DriveError, HandshakeConfig, PeerInfo, PROTOCOL_VERSION};
use crate::link::{run_batch, BackendKind, Completion, Link, Op};
use crate::onesided::{LookupServer, OneSided};
use crate::rdma::RdmaCtx;
use crate::region::{Region, RegionTable};
use crate::service::Services;
use crate::shm::{FdReader, FdWriter};
use crate::stats::StatsSnapshot;
use crate::stream::{Closed, LinkCtx, StreamLink, Timing};
use crate::NodeId;

/// A change in a peer's reachability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    /// A link to the peer is up.
    Up {
        /// The peer.
        peer: NodeId,
        /// Its backend.
        backend: BackendKind,
    },
    /// The link to the peer closed; its pending operations failed with `PeerDown`.
    Down {
        /// The peer.
        peer: NodeId,
        /// Why.
        reason: String,
        /// True when the peer said goodbye first (it shut its endpoint down on purpose); false
        /// when the link failed (connection lost, peer silent, protocol broken). Either way what
        /// the peer held is out of reach until it comes back.
        graceful: bool,
    },
}

/// The state of the mesh when it became ready.
#[derive(Debug, Clone)]
pub struct MeshReport {
    /// Time from `start` until every peer was connected.
    pub setup: Duration,
    /// Each peer with the backend chosen for it.
    pub peers: Vec<(NodeId, BackendKind)>,
}

/// Counters of one peer's link.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerStats {
    /// The peer.
    pub peer: NodeId,
    /// Backend of its current link.
    pub backend: BackendKind,
    /// Its counters.
    pub stats: StatsSnapshot,
}

struct Entry {
    link: Arc<StreamLink>,
    /// The link as users get it: metered in the node's registry (made once per link, since
    /// users look links up per operation).
    metered: Arc<dyn Link>,
    generation: u64,
}

struct Inner {
    cfg: EndpointConfig,
    me: NodeSpec,
    caps: Caps,
    regions: RegionTable,
    links: Mutex<HashMap<NodeId, Entry>>,
    generation: AtomicU64,
    events: broadcast::Sender<PeerEvent>,
    services: Arc<Services>,
    changed: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    started: Instant,
    rdma: Option<RdmaCtx>,
    budget: crate::MemoryBudget,
    metrics: Arc<crate::Metrics>,
}

/// A node's endpoint in the cluster: its regions, its links, and the operations over them.
pub struct Endpoint {
    inner: Arc<Inner>,
    /// Listeners bound by [`bind`](Self::bind), until [`open`](Self::open) starts serving them.
    unopened: Mutex<Option<(TcpListener, Option<UnixListener>)>>,
}

impl Endpoint {
    /// Binds the listeners and starts connecting to every peer. Must run inside a tokio runtime.
    pub async fn start(cfg: EndpointConfig) -> Result<Endpoint> {
        let ep = Endpoint::bind(cfg).await?;
        ep.open();
        Ok(ep)
    }

    /// Binds the listeners but connects to no peer yet: a node subscribes its services between
    /// `bind` and [`open`](Self::open), so that no peer's request finds a service missing.
    pub async fn bind(cfg: EndpointConfig) -> Result<Endpoint> {
        cfg.validate()?;
        let me =
            cfg.cluster.node(cfg.node).cloned().ok_or_else(|| TransportError::Config("node not in cluster".into()))?;
        let mut caps = Caps::TCP.with(Caps::GOODBYE);
        if cfg.shm {
            caps = caps.with(Caps::SHM);
        }
        let rdma = if cfg.rdma {
            match RdmaCtx::open() {
                Ok(ctx) => {
                    caps = caps.with(Caps::RDMA);
                    Some(ctx)
                }
                Err(e) => {
                    warn!(error = %e, "RDMA requested but unavailable; falling back to tcp");
                    None
                }
            }
        } else {
            None
        };
        // The same-host socket is bound before the TCP listener: a peer that can reach this node
        // over TCP then always finds the socket too, and never settles for tcp by racing start-up.
        let unix = if cfg.shm {
            let path = cfg.socket_path(cfg.node);
            if std::os::unix::net::UnixStream::connect(&path).is_ok() {
                // Another endpoint of this node answers there: taking its socket would silently
                // push its same-host peers onto tcp.
                return Err(TransportError::Config(format!(
                    "node {} of this cluster already runs on this host (its socket {} answers)",
                    cfg.node,
                    path.display()
                )));
            }
            let _ = std::fs::remove_file(&path);
            Some(UnixListener::bind(&path).map_err(|e| TransportError::io(format!("binding {}", path.display()), e))?)
        } else {
            None
        };
        let tcp = match bind(me.addr, cfg.connect_timeout).await {
            Ok(l) => l,
            Err(e) => {
                if cfg.shm {
                    let _ = std::fs::remove_file(cfg.socket_path(cfg.node));
                }
                return Err(e);
            }
        };
        let inner = Arc::new(Inner {
            me,
            caps,
            regions: RegionTable::new(),
            links: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            events: broadcast::channel(1024).0,
            services: Services::new(cfg.node),
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
            started: Instant::now(),
            rdma,
            budget: crate::MemoryBudget::new(cfg.memory_limit),
            metrics: Arc::new(crate::Metrics::new()),
            cfg,
        });
        let weak = Arc::downgrade(&inner);
        inner.metrics.on_render(move || {
            let Some(inner) = weak.upgrade() else { return };
            let kinds: Vec<BackendKind> = {
                let links = inner.links.lock().unwrap_or_else(|e| e.into_inner());
                links.values().filter(|e| e.link.is_alive()).map(|e| e.link.kind()).collect()
            };
            let m = &inner.metrics;
            m.clear_gauge("cascade_mesh_peers_up");
            for kind in [BackendKind::Tcp, BackendKind::Shm, BackendKind::Rdma] {
                let n = kinds.iter().filter(|k| **k == kind).count();
                m.gauge(
                    "cascade_mesh_peers_up",
                    "Peers with a live link, by backend",
                    &[("backend", &kind.to_string())],
                )
                .set(n as f64);
            }
        });
        info!(node = inner.cfg.node, addr = %inner.me.addr, caps = inner.caps.0, "endpoint listening");
        Ok(Endpoint { inner, unopened: Mutex::new(Some((tcp, unix))) })
    }

    /// Starts accepting peers and dialing them (once; later calls do nothing).
    pub fn open(&self) {
        let Some((tcp, unix)) = self.unopened.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
        let inner = &self.inner;
        tokio::spawn(accept_tcp(Arc::downgrade(inner), tcp, inner.shutdown.subscribe()));
        if let Some(u) = unix {
            tokio::spawn(accept_unix(Arc::downgrade(inner), u, inner.shutdown.subscribe()));
        }
        for peer in inner.cfg.cluster.nodes.iter().filter(|n| n.id > inner.cfg.node) {
            tokio::spawn(dial_loop(Arc::downgrade(inner), peer.clone(), inner.shutdown.subscribe()));
        }
    }

    /// This node's id.
    pub fn node(&self) -> NodeId {
        self.inner.cfg.node
    }

    /// The capabilities this node advertises.
    pub fn caps(&self) -> Caps {
        self.inner.caps
    }

    /// The settings in force.
    pub fn config(&self) -> &EndpointConfig {
        &self.inner.cfg
    }

    /// Regions exposed to peers.
    pub fn regions(&self) -> &RegionTable {
        &self.inner.regions
    }

    /// Allocates a region peers could reach once registered (shared memory when shm is on, so
    /// same-host peers can map it); it is private to the caller until [`register`](Self::register).
    pub fn alloc(&self, len: u64) -> Result<Region> {
        Region::alloc_within(len, self.inner.cfg.shm, &self.inner.budget)
    }

    /// The node's memory budget for regions (what [`Endpoint::alloc`] allocates against).
    pub fn budget(&self) -> &crate::MemoryBudget {
        &self.inner.budget
    }

    /// Registers `r`: peers may address it from now on (with the RDMA device too, if any).
    pub fn register(&self, r: &Region) -> Result<()> {
        if let Some(rdma) = &self.inner.rdma {
            rdma.register(r)?;
        }
        self.inner.regions.register(r);
        Ok(())
    }

    /// Withdraws region `id` from peers: their new accesses are refused and an RDMA device no
    /// longer reaches its memory. Returns the table's handle (`None` if it was not registered).
    /// Operations in flight keep their own handles (see [`Region::is_unique`]).
    pub fn deregister(&self, id: crate::RegionId) -> Option<Region> {
        if let Some(rdma) = &self.inner.rdma {
            rdma.deregister(id);
        }
        self.inner.regions.deregister(id)
    }

    /// Allocates a region and registers it.
    pub fn register_new(&self, len: u64) -> Result<Region> {
        let r = self.alloc(len)?;
        self.register(&r)?;
        Ok(r)
    }

    /// Waits until every peer is connected; reports how long the mesh took to come up.
    pub async fn wait_ready(&self, limit: Duration) -> Result<MeshReport> {
        let want = self.inner.cfg.cluster.nodes.len() - 1;
        let mut rx = self.inner.changed.subscribe();
        let res = tokio::time::timeout(limit, async {
            loop {
                if self.connected().len() == want {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        let peers = self.connected();
        if res.is_err() || peers.len() != want {
            let missing: Vec<NodeId> = self
                .inner
                .cfg
                .cluster
                .nodes
                .iter()
                .map(|n| n.id)
                .filter(|id| *id != self.node() && !peers.iter().any(|(p, _)| p == id))
                .collect();
            return Err(TransportError::MeshIncomplete { missing, after: limit });
        }
        let setup = self.inner.started.elapsed();
        info!(node = self.node(), peers = want, setup_ms = setup.as_secs_f64() * 1e3, "mesh ready");
        Ok(MeshReport { setup, peers })
    }

    /// Peers with a live link, and their backends.
    pub fn connected(&self) -> Vec<(NodeId, BackendKind)> {
        let links = self.inner.links.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = links.iter().filter(|(_, e)| e.link.is_alive()).map(|(p, e)| (*p, e.link.kind())).collect();
        v.sort_unstable();
        v
    }

    /// The current link to `peer`.
    pub fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        let links = self.inner.links.lock().unwrap_or_else(|e| e.into_inner());
        match links.get(&peer) {
            Some(e) if e.link.is_alive() => Ok(e.metered.clone()),
            _ => Err(TransportError::NotConnected { peer }),
        }
    }

    /// Posts `ops` to `peer` and waits for all of them, each within the configured operation timeout.
    pub async fn run(&self, peer: NodeId, ops: Vec<Op>) -> Result<Vec<Result<Completion>>> {
        let link = self.link(peer)?;
        Ok(run_batch(&link, ops, self.inner.cfg.op_timeout).await)
    }

    /// The node's control-plane services: subscribe, call and reply through
    /// [`ServiceExt`](crate::service::ServiceExt).
    pub fn services(&self) -> &Arc<Services> {
        &self.inner.services
    }

    /// The node's metrics registry: the transport's families, and whatever the node's other
    /// parts (multicast, pool, exec) record there. [`crate::Metrics::render`] is `/metrics`.
    pub fn metrics(&self) -> &Arc<crate::Metrics> {
        &self.inner.metrics
    }

    /// Subscribes to peer up/down events.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.inner.events.subscribe()
    }

    /// Counters of every current link.
    pub fn stats(&self) -> Vec<PeerStats> {
        let links = self.inner.links.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> =
            links.iter().map(|(p, e)| PeerStats { peer: *p, backend: e.link.kind(), stats: e.link.stats() }).collect();
        v.sort_by_key(|s| s.peer);
        v
    }

    /// Closes every link and stops listening. Each link says goodbye to its peer first, from
    /// its own task: a process about to exit should call [`leave`](Self::leave) instead, which
    /// waits until they are out.
    pub fn shutdown(&self) {
        self.shutdown_links();
    }

    /// Says goodbye to every peer, closes every link and stops listening, as
    /// [`shutdown`](Self::shutdown), then waits until every link's goodbye is written (each at
    /// most half a second; a peer that does not read in time sees a failure instead).
    pub async fn leave(&self) {
        for link in self.shutdown_links() {
            link.writer_stopped().await;
        }
    }

    fn shutdown_links(&self) -> Vec<Arc<StreamLink>> {
        self.inner.shutdown.send_replace(true);
        self.inner.services.close();
        let links: Vec<Entry> =
            self.inner.links.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, e)| e).collect();
        for e in &links {
            e.link.leave("endpoint shut down");
        }
        if self.inner.cfg.shm {
            let _ = std::fs::remove_file(self.inner.cfg.socket_path(self.inner.cfg.node));
        }
        links.into_iter().map(|e| e.link).collect()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    fn handshake_cfg(&self) -> HandshakeConfig {
        HandshakeConfig {
            version: PROTOCOL_VERSION,
            node: self.cfg.node,
            caps: self.caps,
            secret: self.cfg.secret.clone(),
            timeout: self.cfg.connect_timeout,
        }
    }

    /// Installs an authenticated same-host connection as a shm link.
    fn install_shm(self: &Arc<Self>, peer: &PeerInfo, s: UnixStream, closed: Option<oneshot::Sender<String>>) {
        let (r, w) = s.into_split();
        let shm = OneSided::new(Arc::new(crate::shm::ShmEngine));
        self.install(peer, BackendKind::Shm, Some(shm), FdReader::new(r), FdWriter(w), closed);
    }

    /// Installs an authenticated TCP connection, upgraded to RDMA when both sides can.
    async fn install_tcp(
        self: &Arc<Self>,
        mut s: TcpStream,
        peer: &PeerInfo,
        closed: Option<oneshot::Sender<String>>,
    ) -> Result<()> {
        let (kind, one_sided) = self.maybe_rdma(&mut s, peer).await?;
        let (r, w) = s.into_split();
        self.install(peer, kind, one_sided, r, w, closed);
        Ok(())
    }

    /// After the handshake on a TCP connection: upgrade to RDMA when both sides have a device.
    async fn maybe_rdma(&self, s: &mut TcpStream, peer: &PeerInfo) -> Result<(BackendKind, Option<OneSided>)> {
        match &self.rdma {
            Some(ctx) if peer.caps.has(Caps::RDMA) => {
                Ok(match ctx.upgrade(s, peer.node, self.cfg.connect_timeout).await? {
                    Some(engine) => (BackendKind::Rdma, Some(OneSided::new(engine))),
                    None => (BackendKind::Tcp, None),
                })
            }
            _ => Ok((BackendKind::Tcp, None)),
        }
    }

    /// The one-sided engines whose lookups this node answers: shm always (regions that are not
    /// shared answer `NotShareable`), rdma with a device.
    fn lookup_servers(&self) -> Vec<Arc<dyn LookupServer>> {
        let mut v: Vec<Arc<dyn LookupServer>> = vec![Arc::new(crate::shm::ShmLookups)];
        if let Some(rdma) = &self.rdma {
            v.push(rdma.lookups());
        }
        v
    }

    fn timing(&self) -> Timing {
        Timing { keepalive: self.cfg.keepalive, dead_after: self.cfg.dead_after }
    }

    /// Installs a fresh link to `peer`, replacing any older one. `closed` fires when it closes.
    fn install<R, W>(
        self: &Arc<Self>,
        info: &PeerInfo,
        kind: BackendKind,
        one_sided: Option<OneSided>,
        r: R,
        w: W,
        closed: Option<oneshot::Sender<String>>,
    ) where
        R: crate::frame::FrameSource,
        W: crate::frame::FrameSink,
    {
        if *self.shutdown.borrow() {
            return;
        }
        let peer = info.node;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let weak = Arc::downgrade(self);
        let on_close = Box::new(move |c: Closed| {
            if let Some(inner) = weak.upgrade() {
                inner.closed(peer, generation, &c.reason, c.graceful);
            }
            if let Some(tx) = closed {
                let _ = tx.send(c.reason);
            }
        });
        let ctx = LinkCtx {
            one_sided,
            servers: self.lookup_servers(),
            peer,
            kind,
            regions: self.regions.clone(),
            services: self.services.clone(),
            timing: self.timing(),
            on_close,
            goodbye: info.caps.has(Caps::GOODBYE),
        };
        let link = StreamLink::spawn(ctx, r, w);
        #[cfg(test)]
        tests::hooks::pause_install(&self.cfg.cluster.name, self.cfg.node);
        let metered = Arc::new(crate::metrics::Metered::new(link.clone(), &self.metrics));
        let old = {
            let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
            // Checked under the lock that `shutdown` drains: a link installed after the drain
            // would otherwise stay alive (keepalives and all) on an endpoint that shut down.
            if *self.shutdown.borrow() {
                drop(links);
                link.leave("endpoint shut down");
                return;
            }
            let old = links.insert(peer, Entry { link: link.clone(), metered, generation });
            // Sent under the lock, so that the `Down` of this generation (sent after `closed`
            // takes the lock) always follows its `Up`.
            info!(node = self.cfg.node, peer, backend = %kind, "link up");
            let _ = self.events.send(PeerEvent::Up { peer, backend: kind });
            old
        };
        drop(old); // closes the replaced link outside the lock
        self.changed.send_modify(|g| *g += 1);
        // A link that closed between its spawn and its entry found no entry to remove; remove it
        // now (`closed` is idempotent per generation).
        if !link.is_alive() {
            self.closed(peer, generation, "link closed while it was installed", false);
        }
    }

    fn closed(&self, peer: NodeId, generation: u64, reason: &str, graceful: bool) {
        let removed = {
            let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
            match links.get(&peer) {
                Some(e) if e.generation == generation => links.remove(&peer),
                _ => None,
            }
        };
        if removed.is_some() {
            if graceful {
                info!(node = self.cfg.node, peer, reason, "peer left");
            } else {
                warn!(node = self.cfg.node, peer, reason, "peer down");
            }
            let how = if graceful { "left" } else { "failed" };
            let help = "Links to peers that closed, by how: left (the peer said goodbye) or failed";
            self.metrics.counter("cascade_mesh_peer_losses", help, &[("how", how)]).inc();
            self.services.peer_down(peer, reason);
            let _ = self.events.send(PeerEvent::Down { peer, reason: reason.to_string(), graceful });
            self.changed.send_modify(|g| *g += 1);
        }
        drop(removed);
    }

    fn is_member(&self, id: NodeId) -> bool {
        self.cfg.cluster.node(id).is_some()
    }
}

/// Binds the TCP listener. A previous endpoint on the same address (this node restarting) may
/// still be closing its listener: the bind is retried for up to `patience` while the address is
/// in use, then fails with that error.
async fn bind(addr: std::net::SocketAddr, patience: Duration) -> Result<TcpListener> {
    let deadline = Instant::now() + patience;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                debug!(%addr, "address in use; waiting for it to be released");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(TransportError::io(format!("binding {addr}"), e)),
        }
    }
}

fn hs_error(peer: String, e: DriveError) -> TransportError {
    match e {
        DriveError::Handshake(error) => TransportError::Handshake { peer, error },
        DriveError::Io(source) => TransportError::io(format!("handshake with {peer}"), source),
    }
}

/// Dials `peer` once: connection, handshake, link. Returns the link's close notification.
async fn dial_once(inner: &Arc<Inner>, peer: &NodeSpec) -> Result<oneshot::Receiver<String>> {
    let want = select_backend(&inner.me, inner.caps, peer, inner.caps);
    let limit = inner.cfg.connect_timeout;
    if want == BackendKind::Shm {
        if let Some(rx) = dial_shm(inner, peer).await? {
            return Ok(rx);
        }
    }
    let mut s = tokio::time::timeout(limit, TcpStream::connect(peer.addr))
        .await
        .map_err(|_| TransportError::Timeout { peer: peer.id, op: "connect", after: limit })?
        .map_err(|e| TransportError::io(format!("connecting to node {} at {}", peer.id, peer.addr), e))?;
    if want == BackendKind::Shm {
        // A peer binds its same-host socket before its TCP listener, so a socket that was not
        // there a moment ago raced the peer's start-up: now that TCP answers, it is there.
        if let Some(rx) = dial_shm(inner, peer).await? {
            return Ok(rx);
        }
    }
    crate::tcp::tune(&s).map_err(|e| TransportError::io("setting TCP_NODELAY", e))?;
    let info = handshake::dial(&mut s, &inner.handshake_cfg(), peer.id)
        .await
        .map_err(|e| hs_error(format!("node {} at {}", peer.id, peer.addr), e))?;
    check_info(&info, peer.id)?;
    let (tx, rx) = oneshot::channel();
    inner.install_tcp(s, &info, Some(tx)).await?;
    Ok(rx)
}

/// Dials `peer`'s same-host socket: `None` when it does not answer (then tcp is used).
async fn dial_shm(inner: &Arc<Inner>, peer: &NodeSpec) -> Result<Option<oneshot::Receiver<String>>> {
    let path = inner.cfg.socket_path(peer.id);
    match tokio::time::timeout(inner.cfg.connect_timeout, UnixStream::connect(&path)).await {
        Ok(Ok(mut s)) => {
            let info = handshake::dial(&mut s, &inner.handshake_cfg(), peer.id)
                .await
                .map_err(|e| hs_error(format!("node {}", peer.id), e))?;
            check_info(&info, peer.id)?;
            let (tx, rx) = oneshot::channel();
            inner.install_shm(&info, s, Some(tx));
            Ok(Some(rx))
        }
        Ok(Err(e)) => {
            debug!(peer = peer.id, error = %e, "same-host socket unavailable; using tcp");
            Ok(None)
        }
        Err(_) => {
            debug!(peer = peer.id, "same-host socket timed out; using tcp");
            Ok(None)
        }
    }
}

fn check_info(info: &PeerInfo, expect: NodeId) -> Result<()> {
    if info.node != expect {
        return Err(TransportError::Protocol { peer: Some(info.node), detail: format!("expected node {expect}") });
    }
    Ok(())
}

/// Keeps the link to `peer` up: dial, wait for it to close, back off, dial again.
async fn dial_loop(weak: Weak<Inner>, peer: NodeSpec, mut stop: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let max = inner.cfg.reconnect_max;
        let span = info_span!("connect", node = inner.cfg.node, peer = peer.id);
        let r = dial_once(&inner, &peer).instrument(span).await;
        drop(inner);
        match r {
            Ok(closed) => {
                backoff = Duration::from_millis(50);
                tokio::select! {
                    _ = closed => {}
                    _ = crate::stream::stopped(&mut stop) => return,
                }
            }
            Err(e) => {
                // Refusals (wrong secret, version) are worth a warning; a peer not up yet is not.
                match &e {
                    TransportError::Handshake { .. } => {
                        warn!(peer = peer.id, error = %e, "connection refused")
                    }
                    _ => debug!(peer = peer.id, error = %e, "connect failed; will retry"),
                }
                backoff = (backoff * 2).min(max);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = crate::stream::stopped(&mut stop) => return,
        }
    }
}

async fn accept_tcp(weak: Weak<Inner>, l: TcpListener, mut stop: watch::Receiver<bool>) {
    loop {
        // Biased: once the endpoint is shut down, no connection waiting in the backlog is taken
        // (an unbiased select picks either ready branch at random).
        let (mut s, addr) = tokio::select! {
            biased;
            _ = crate::stream::stopped(&mut stop) => return,
            r = l.accept() => match r {
                Ok(x) => x,
                Err(e) => { crate::back_off_after_failed_accept("peer", &e).await; continue; }
            },
        };
        let Some(inner) = weak.upgrade() else { return };
        tokio::spawn(async move {
            let _ = crate::tcp::tune(&s);
            let hcfg = inner.handshake_cfg();
            match handshake::accept(&mut s, &hcfg, |n| inner.is_member(n)).await {
                Ok(info) => {
                    if let Err(e) = inner.install_tcp(s, &info, None).await {
                        warn!(node = inner.cfg.node, peer = info.node, error = %e, "RDMA setup failed")
                    }
                }
                Err(e) => {
                    warn!(node = inner.cfg.node, from = %addr, error = %hs_error(addr.to_string(), e), "refused a connection")
                }
            }
        });
    }
}

async fn accept_unix(weak: Weak<Inner>, l: UnixListener, mut stop: watch::Receiver<bool>) {
    loop {
        let mut s = tokio::select! {
            biased;
            _ = crate::stream::stopped(&mut stop) => return,
            r = l.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => { crate::back_off_after_failed_accept("same-host peer", &e).await; continue; }
            },
        };
        let Some(inner) = weak.upgrade() else { return };
        tokio::spawn(async move {
            let hcfg = inner.handshake_cfg();
            match handshake::accept(&mut s, &hcfg, |n| inner.is_member(n)).await {
                Ok(info) => inner.install_shm(&info, s, None),
                Err(e) => {
                    warn!(node = inner.cfg.node, error = %hs_error("a local peer".into(), e), "refused a connection")
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
