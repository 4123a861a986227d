//! [`Mesh`]: what code above the transport needs from a node — its id, its links, its regions and
//! its service table — implemented by the real [`Endpoint`](crate::Endpoint) and by the
//! [`MemNode`](crate::mem::MemNode) test double alike. The control plane's typed operations
//! (subscribe, call, reply) are [`ServiceExt`](crate::service::ServiceExt)'s, on every `Mesh`.

use std::future::Future;

use std::pin::Pin;
use std::sync::Arc;

use crate::endpoint::PeerEvent;
use crate::error::Result;
use crate::link::Link;
use crate::region::{Region, RegionTable};
use crate::service::Services;
use crate::NodeId;

/// A boxed future, for the dyn-compatible async method of [`Mesh`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One node's view of the cluster.
pub trait Mesh: Send + Sync + 'static {
    /// This node's id.
    fn node(&self) -> NodeId;
    /// The link to `peer`.
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>>;
    /// Regions peers may access on this node.
    fn regions(&self) -> &RegionTable;
    /// The node's service table (control-plane inboxes and pending calls).
    fn services(&self) -> &Arc<Services>;
    /// Allocates a region of `len` bytes that peers could reach once registered (shared memory
    /// where the node's peers can map it); private to the caller until [`register`](Self::register).
    fn alloc(&self, len: u64) -> Result<Region>;
    /// As [`alloc`](Self::alloc), choosing when a shared region's pages are allocated (a node
    /// without shared regions allocates them at once).
    fn alloc_prefault(&self, len: u64, prefault: crate::Prefault) -> Result<Region> {
        let _ = prefault;
        self.alloc(len)
    }
    /// Registers a region: peers may address it from now on.
    fn register(&self, region: &Region) -> Result<()>;
    /// Withdraws a region from peers (and from an RDMA device, where the node has one).
    fn deregister(&self, id: crate::RegionId) -> Option<Region> {
        self.regions().deregister(id)
    }
    /// Allocates a region and registers it.
    fn register_new(&self, len: u64) -> Result<Region> {
        let r = self.alloc(len)?;
        self.register(&r)?;
        Ok(r)
    }
    /// Allocates a region whose pages a thread of its own faults in, from the last page back
    /// ([`Prefault::Background`](crate::Prefault)), and registers it: quick enough for an async
    /// worker, and usable at once (a write that gets ahead of the thread faults its pages in
    /// itself). On a node whose registration pins memory (RDMA), registering still faults it in.
    fn register_new_background(&self, len: u64) -> Result<Region> {
        let r = self.alloc_prefault(len, crate::Prefault::Background)?;
        self.register(&r)?;
        Ok(r)
    }
    /// Peer up/down events from now on.
    fn peer_events(&self) -> tokio::sync::broadcast::Receiver<PeerEvent>;
    /// Whether a live link to `peer` exists now.
    fn connected_to(&self, peer: NodeId) -> bool {
        self.link(peer).is_ok_and(|l| l.is_alive())
    }
    /// The node's configured memory limit for regions, if any (what it advertises to a pool).
    fn memory_limit(&self) -> Option<u64>;
    /// The node's metrics registry, where the services running on it record theirs.
    fn metrics(&self) -> &Arc<crate::Metrics>;
}

/// [`Mesh::register_new`] on a blocking thread, for async code.
///
/// Allocating a shared region pre-faults it: every page is zeroed before it returns, which on a
/// loaded host holds the calling thread for seconds (188 MB of KV pages took 1.8–3 s of a runtime
/// worker in `cascade pd`). Done on a runtime worker, it stalls more than that task: the
/// runtime's I/O driver and timers are not polled meanwhile, the node's links send no
/// keepalive, and its peers declare it down.
pub async fn register_new_blocking(mesh: Arc<dyn Mesh>, len: u64) -> Result<Region> {
    tokio::task::spawn_blocking(move || mesh.register_new(len)).await.map_err(|e| crate::TransportError::Protocol {
        peer: None,
        detail: format!("allocating a {len}-byte region failed: {e}"),
    })?
}

impl Mesh for crate::Endpoint {
    fn node(&self) -> NodeId {
        crate::Endpoint::node(self)
    }
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        crate::Endpoint::link(self, peer)
    }
    fn regions(&self) -> &RegionTable {
        crate::Endpoint::regions(self)
    }
    fn services(&self) -> &Arc<Services> {
        crate::Endpoint::services(self)
    }
    fn alloc(&self, len: u64) -> Result<Region> {
        crate::Endpoint::alloc(self, len)
    }
    fn alloc_prefault(&self, len: u64, prefault: crate::Prefault) -> Result<Region> {
        Region::alloc_within_prefault(len, self.config().shm, self.budget(), prefault)
    }
    fn memory_limit(&self) -> Option<u64> {
        self.budget().limit()
    }
    fn register(&self, region: &Region) -> Result<()> {
        crate::Endpoint::register(self, region)
    }
    fn deregister(&self, id: crate::RegionId) -> Option<Region> {
        crate::Endpoint::deregister(self, id)
    }
    fn peer_events(&self) -> tokio::sync::broadcast::Receiver<PeerEvent> {
        crate::Endpoint::events(self)
    }
    fn metrics(&self) -> &Arc<crate::Metrics> {
        crate::Endpoint::metrics(self)
    }
}

impl Mesh for crate::mem::MemNode {
    fn node(&self) -> NodeId {
        self.id()
    }
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        crate::mem::MemNode::link(self, peer)
    }
    fn regions(&self) -> &RegionTable {
        crate::mem::MemNode::regions(self)
    }
    fn services(&self) -> &Arc<Services> {
        crate::mem::MemNode::services(self)
    }
    fn alloc(&self, len: u64) -> Result<Region> {
        Region::alloc_within(len, false, crate::mem::MemNode::budget(self))
    }
    fn memory_limit(&self) -> Option<u64> {
        crate::mem::MemNode::budget(self).limit()
    }
    fn register(&self, region: &Region) -> Result<()> {
        self.regions().register(region);
        Ok(())
    }
    fn peer_events(&self) -> tokio::sync::broadcast::Receiver<PeerEvent> {
        crate::mem::MemNode::events(self)
    }
    fn metrics(&self) -> &Arc<crate::Metrics> {
        crate::mem::MemNode::metrics(self)
    }
}
